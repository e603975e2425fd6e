"""Training-side tools built on the public APIs: corpus, tokenizer, trainer, SFT, DTP ablation."""
