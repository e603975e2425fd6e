"""Sampling: a request's sampling configuration (`params.py`: SamplingParams, its checks,
OpenAI's logit_bias) and the pick of the next token on the model's device (`sampler.py`:
greedy, temperature, top-k, top-p, min-p, penalties, a grammar's mask, logprobs)."""
