"""Speculative decoding by prompt lookup: the config, drafter and exact acceptance rule
(`drafting.py`), the verify step (`verify.py`) and the loop that streams kept tokens
(`decoder.py`)."""
