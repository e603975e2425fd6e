"""Benchmarks and performance models: what decode speed a model can reach and what it does reach."""
