"""Llama-family checkpoints saved by transformers give transformers' logits and tokens."""

from __future__ import annotations

import pytest
import torch

from expresslane.checkpoint import load_model
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-gqa-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-sliding": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_key_value_heads=2, sliding_window=24),
    ),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32)),
}


def _save_hf(name: str, path) -> torch.nn.Module:
    cfg_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF initialises with std 0.02: widen so logits are not flat
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf(request.param, path)
    ours = load_model(path, device="cpu", dtype="float32", progress=False)
    return hf, ours


def test_logits_match_transformers(pair):
    hf, ours = pair
    tokens = torch.randint(3, 300, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert (ref - got).abs().max().item() <= 1e-4


def test_greedy_tokens_match_transformers(pair):
    hf, ours = pair
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(
            prompt,
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=64,
        )[0, 12:].tolist()
    engine = Engine(ours, max_model_len=128, prefill_chunk=5)
    got = list(engine.generate(prompt[0].tolist(), SamplingParams(max_tokens=64, ignore_eos=True)))
    assert got == ref
