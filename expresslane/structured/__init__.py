"""Structured output: grammars compiled for constrained decoding (`grammar.py`, llguidance) and
the engine's decoding under a grammar (`decoding.py`: the mask in the pick, jump-forward, drafts
checked against the matcher)."""
