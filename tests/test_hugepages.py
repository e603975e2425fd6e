"""Packed weights and the KV cache in huge pages (weights/hugepages.py): the same values, one
arena on a 2 MB boundary that the kernel may back with huge pages, no second copy of a weight,
and the same tokens as without."""

from __future__ import annotations

import weakref

import pytest
import tiny
import torch
from test_packed_step import llama

from expresslane.cache import KVCache
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.weights import hugepages
from expresslane.weights.packing import pack_model
from expresslane.weights.quant import quantize, stack_rows

HUGE = hugepages.arena(1) is not None  # this kernel lets a program ask for huge pages


def _matrices() -> list:
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(2, 24 + i, 64, generator=g) for i in range(5)]
    q4 = stack_rows([quantize(w[4], "q4_1"), quantize(w[0], "float16")])  # a mixed stack
    fmts = ("float32", "bfloat16", "int8", "q8_0")
    qs = [*(quantize(x, f) for x, f in zip(w, fmts, strict=False)), q4]
    return qs


def _mapping(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ptr."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= ptr < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1]
    return fields


def test_a_placer_keeps_every_value():
    before = _matrices()
    placer = hugepages.Placer()
    after = [placer(m) for m in before]
    for a, b in zip(after, before, strict=True):
        assert a.fmt == b.fmt and a.shape == b.shape
        assert torch.equal(a.dequantize(), b.dequantize())
        for ta, tb in zip(a.fields, b.fields, strict=True):
            assert ta.dtype == tb.dtype and ta.shape == tb.shape and torch.equal(ta, tb)
    if HUGE:  # one arena, in order, every field on a cache line, the first on a huge page
        ptrs = [t.data_ptr() for m in after for t in m.fields]
        assert ptrs == sorted(ptrs) and all(p % hugepages.ALIGN == 0 for p in ptrs)
        assert ptrs[0] % hugepages.HUGE_PAGE == 0
        old = {t.data_ptr() for t in before[0].fields}
        assert not old & {t.data_ptr() for t in after[0].fields}  # copied


@pytest.mark.parametrize("why", ["turned off", "too little memory"])
def test_without_an_arena_nothing_moves(monkeypatch, why):
    if why == "turned off":
        monkeypatch.setattr(hugepages, "ENABLED", False)
    else:  # a second copy of the weights would not fit
        monkeypatch.setattr(hugepages, "available_bytes", lambda: hugepages.HUGE_PAGE)
    before = _matrices()
    assert hugepages.arena(1 << 20) is None
    placer = hugepages.Placer()
    assert all(placer(m) is m for m in before)


@pytest.mark.skipif(not HUGE, reason="this kernel gives no huge pages on request")
def test_a_placer_takes_matrices_one_at_a_time_into_segments():
    """Each matrix copied as it comes; a segment too small for the next starts another arena,
    on a huge page; values unchanged."""
    before = _matrices()
    placer = hugepages.Placer(segment=4096)  # below every matrix here: one arena each
    after = [placer(m) for m in before]
    for a, b in zip(after, before, strict=True):
        assert a is not b and torch.equal(a.dequantize(), b.dequantize())
        ptrs = [t.data_ptr() for t in a.fields]
        assert ptrs == sorted(ptrs) and all(p % hugepages.ALIGN == 0 for p in ptrs)
        assert ptrs[0] % hugepages.HUGE_PAGE == 0  # its own segment


def test_a_placer_without_an_arena_leaves_matrices_and_stops_asking(monkeypatch):
    asked = []
    monkeypatch.setattr(hugepages, "arena", lambda n: asked.append(n))
    placer = hugepages.Placer()
    before = _matrices()
    assert all(placer(m) is m for m in before) and len(asked) == 1


@pytest.mark.skipif(not HUGE, reason="this kernel gives no huge pages on request")
@pytest.mark.parametrize("case,kind", [("llama-gqa", "Q4_0"), ("qwen2-bias", "F16")])
def test_loading_lets_each_matrix_go_before_it_makes_the_next(monkeypatch, tmp_path, case, kind):
    """A GGUF file's matrices are placed as they are made (hugepages.Placer): when the packer
    hands over the next one, the last one's unplaced fields (re-laid blocks, views of the file's
    mapped pages) are gone, so loading peaks at the placed weights and one matrix, not two copies
    of the model (BENCHMARKS.md: the section on a file's first token)."""
    from gguf_kit import hf_to_gguf
    from test_gguf_models import _hf_model

    from expresslane.weights.packing import load_packed

    path = hf_to_gguf(_hf_model(case), tmp_path / "m.gguf", weight_type=kind)
    given, lingering = [], []
    real = hugepages.Placer.__call__

    def spy(self, m):
        lingering.append(sum(r() is not None for r in given))
        given.extend(weakref.ref(t) for t in m.fields)
        return real(self, m)

    monkeypatch.setattr(hugepages.Placer, "__call__", spy)
    model = load_packed(path, device="cpu", progress=False)
    assert len(lingering) == len(model.packed.matrices) + 1 - model.cfg.tie_word_embeddings
    assert not any(lingering), lingering


@pytest.mark.skipif(not HUGE, reason="this kernel has no transparent huge pages to ask for")
def test_the_arena_is_eligible_for_huge_pages():
    room = hugepages.arena(3 * hugepages.HUGE_PAGE)
    room.fill_(1)  # touched: the kernel backs it now
    fields = _mapping(room.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert fields["THPeligible"] == "1"


def test_the_kv_cache_is_zeroed_and_laid_out_as_before():
    cfg = tiny.laneformer_config()
    cache = KVCache(cfg, max_len=40, headroom=2)
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    for i, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
        w = cfg.window(i)
        cap = min(w + 2, 40) if w else 40
        assert k.shape == v.shape == (cap, cfg.num_kv_heads, cfg.head_dim)
        assert k.is_contiguous() and not k.any() and not v.any()
    k0 = cache.k[0]
    k0.fill_(3.0)  # layers do not overlap
    assert not cache.v[0].any() and not cache.k[1].any()


def _present(ptr: int) -> bool:
    """Whether the page at address ptr is in memory now (/proc/self/pagemap's bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(ptr // 4096 * 8)
        return bool(int.from_bytes(f.read(8), "little") >> 63)


@pytest.mark.skipif(not HUGE, reason="this kernel gives no huge pages on request")
def test_the_first_requests_kv_pages_are_in_memory_at_load():
    """Slot 0 of every layer's K and V is touched when the cache is made, so that the first
    request does not fault them in (a huge page's first touch took ~3 ms on the 2-vCPU VM:
    0.4 s of SmolLM2's first token); the pages past them are left to the requests."""
    cfg = tiny.laneformer_config()
    cache = KVCache(cfg, max_len=hugepages.HUGE_PAGE // 4)  # each layer's K: pages of its own
    for t in (*cache.k, *cache.v):
        assert _present(t.data_ptr()) and not t.view(-1)[:1].any()
    last = cache.v[-1]
    assert not _present(last.data_ptr() + last.numel() * last.element_size() - 8)


def _tokens(model, n: int = 12) -> list[int]:
    engine = Engine(model, max_model_len=64, decode="graph")
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return [s.token for s in engine.generate_steps([1, 7, 9, 30, 11], params)]


@pytest.mark.parametrize("fmt", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("name", ["llama-tied", "qwen2-untied", "laneformer"])
def test_placed_weights_decode_the_same_tokens(monkeypatch, name, fmt):
    make = {
        "llama-tied": llama,
        "qwen2-untied": lambda: llama(model_type="qwen2", tie_word_embeddings=False),
        "laneformer": lambda: tiny.laneformer(seed=3),
    }[name]
    plain, placed = make(), make()
    with monkeypatch.context() as m:
        m.setattr(hugepages, "ENABLED", False)
        pack_model(plain, fmt)
        want = _tokens(plain)
    pack_model(placed, fmt)
    assert _tokens(placed) == want
    if HUGE and fmt is None:  # same dtype: the parameters are views of the placed copy
        p, w = placed.packed, placed.model.layers[0]
        assert w.attention.wq.weight.data_ptr() == p.layers[0].wqkv.data.data_ptr()
        assert placed.model.tok_embeddings.weight.data_ptr() == p.embed.data.data_ptr()
        assert p.layers[0].wqkv.data.data_ptr() % hugepages.HUGE_PAGE == 0
