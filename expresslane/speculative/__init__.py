"""Speculative decoding by prompt lookup: the config, drafter and exact acceptance rule
(`drafting.py`) and the loop that verifies drafts on the engine's own step and streams what is
kept (`decoder.py`)."""
