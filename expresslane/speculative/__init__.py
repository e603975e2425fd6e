"""Speculative decoding: the config, the prompt-lookup drafter and the exact acceptance rule
(`drafting.py`), a draft model's drafts (`draft_model.py`), drafts from a request's predicted
output (`prediction.py`), and the loop that verifies drafts on the engine's own step and streams
what is kept (`decoder.py`)."""
