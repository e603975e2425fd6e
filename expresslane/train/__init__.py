"""Training-side tools built on the public APIs: tokenizer training today."""
