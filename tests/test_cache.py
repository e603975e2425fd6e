"""The static KV cache: incremental decode equals one full forward; rings hold `window` slots."""

from __future__ import annotations

import pytest
import tiny
import torch

from expresslane.cache import KVCache
from expresslane.presets import get_preset


@pytest.fixture(scope="module")
def model():
    return tiny.laneformer(seed=3, vocab_size=128, hidden_size=64, intermediate_size=128,
                           sliding_window=64, max_position_embeddings=512)  # fmt: skip


def test_decode_300_tokens_one_at_a_time_equals_full_forward(model):
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg, max_len=320)
    with torch.no_grad():
        full = model(tokens)[0]
        steps = torch.cat([model(tokens[:, t : t + 1], cache=cache)[0] for t in range(300)])
    assert (full - steps).abs().max().item() <= 1e-4
    assert cache.length == 300


@pytest.mark.parametrize("chunks", [(100, 1, 150, 49), (70, 70, 70, 90), (1, 299)])
def test_chunked_prefill_across_ring_wrap_equals_full_forward(model, chunks):
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.cfg, max_len=300)
    out, start = [], 0
    with torch.no_grad():
        full = model(tokens)[0]
        for n in chunks:
            out.append(model(tokens[:, start : start + n], cache=cache)[0])
            start += n
    assert (full - torch.cat(out)).abs().max().item() <= 1e-4


def test_ring_buffer_memory_is_window_positions(model):
    cache = KVCache(model.cfg, max_len=512)
    caps = [k.shape[0] for k in cache.k]
    assert caps == [64, 64, 512]
    per_pos = 2 * model.cfg.num_kv_heads * model.cfg.head_dim * 4
    assert cache.nbytes == (64 + 64 + 512) * per_pos


def test_laneformer_2b_kv_bytes_at_4096():
    cfg = get_preset("laneformer-2b")  # the spec's 2B shape
    cache = KVCache(cfg, max_len=4096, device="meta", dtype=torch.bfloat16)
    assert cache.nbytes == 251_658_240  # laneformer.md 7: 251.7 MB, not 377.5 MB


def test_forward_room_is_the_rings_headroom_plus_one():
    """How many tokens one forward may write (split.chunk_width, the packed prefill, the fused
    step's check): a wrapping ring's headroom + 1; no limit where no ring wraps."""
    cfg = tiny.laneformer_config()  # two 16-token windows
    assert KVCache(cfg, 64, headroom=3).forward_room() == 4
    assert KVCache(cfg, 64).forward_room() == 1
    assert KVCache(cfg, 16).forward_room() is None  # rings as long as the context never wrap
    no_rings = tiny.laneformer_config(sliding_window=None, sliding_window_n_layers=0)
    assert KVCache(no_rings, 64).forward_room() is None
