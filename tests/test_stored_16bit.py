"""A checkpoint whose matrices are stored in bf16 (or fp16) is packed in that format on a CPU with
its matrices read as stored (`stored.stored_matrices`, `packing.pack_stored`), never as fp32 on the
way, and gives what loading fp32 and packing did: the same packed weights, bit for bit, and
logits. A LoRA's adapted matrices are still read as floats and merged; lanes and a Laneformer's
vocab-parallel head too."""

from __future__ import annotations

import sys

import pytest
import tiny
import torch
from test_lora import IDS, peft_adapter
from test_packed_step import llama

from expresslane import checkpoint
from expresslane.checkpoint import load_model, save_model
from expresslane.weights.lora import load_adapter, merge
from expresslane.weights.packing import load_packed, pack_model


def _same_packing(ours, before):
    a = [q for m in [*ours.packed.matrices, ours.packed.embed] for q in m.pieces]
    b = [q for m in [*before.packed.matrices, before.packed.embed] for q in m.pieces]
    assert [q.fmt for q in a] == [q.fmt for q in b] and len(a) == len(b)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.data, q.data)
    with torch.inference_mode():
        assert torch.equal(ours(torch.tensor([IDS])), before(torch.tensor([IDS])))


@pytest.fixture
def reads(monkeypatch):
    """(our name, the function that read it) for every tensor read from a checkpoint."""
    seen: list[tuple[str, str]] = []
    read_tensor = checkpoint.read_tensor

    def spy(cfg, handle, key, ours, *rest, **kw):
        seen.append((ours, sys._getframe(1).f_code.co_name))
        return read_tensor(cfg, handle, key, ours, *rest, **kw)

    monkeypatch.setattr(checkpoint, "read_tensor", spy)
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "name,model",
    [("llama-tied", lambda: llama(seed=21)),
     ("qwen2-untied", lambda: llama(seed=22, model_type="qwen2", tie_word_embeddings=False)),
     ("laneformer", lambda: tiny.laneformer(seed=23))],
)  # fmt: skip
def test_matrices_are_read_as_stored(name, model, dtype, tmp_path, reads):
    path = save_model(model(), tmp_path / name, dtype=dtype)
    ours = load_packed(path, device="cpu", progress=False)
    assert ours.packed.fmt == dtype
    by_load = {n for n, fn in reads if fn == "load_model"}
    assert not any(n.endswith("weight") and ".layers." in n and "norm" not in n for n in by_load)
    assert "model.tok_embeddings.weight" not in by_load
    assert {n for n, fn in reads if fn != "load_model"}  # the packer read them
    before = load_model(path, device="cpu", dtype="float32", progress=False)
    pack_model(before, dtype)
    _same_packing(ours, before)


def test_an_adapted_matrix_is_merged_from_floats(tmp_path, reads):
    path = save_model(llama(seed=24, vocab_size=64), tmp_path / "m", dtype="bfloat16")
    before = load_model(path, device="cpu", dtype="float32", progress=False)
    peft_adapter(tmp_path / "ad", before)
    reads.clear()
    ours = load_packed(path, device="cpu", progress=False, lora=((str(tmp_path / "ad"), 1.0),))
    by_load = {n for n, fn in reads if fn == "load_model"}
    assert "model.layers.0.attention.wq.weight" in by_load  # adapted: merged from its floats
    assert "model.layers.0.attention.wk.weight" not in by_load
    merge(before, [load_adapter(tmp_path / "ad", before.cfg)])
    pack_model(before, "bfloat16")
    _same_packing(ours, before)
