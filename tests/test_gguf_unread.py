"""A GGUF file packed for the CPU step is read once, as stored: the matrices a kernel takes as
blocks are never dequantized to floats on the way (`stored.stored_only`, `load_model(unread=)`),
and what comes out is what reading every tensor as floats first gave: the same packed weights, bit
for bit, and the same logits. A LoRA adapter's matrices are still read as floats (they are merged
there); a Laneformer's lanes, stacked from floats, too."""

from __future__ import annotations

import pytest
import torch
from gguf_kit import hf_to_gguf
from test_gguf_models import _hf_model

from expresslane.assets import TRAINED
from expresslane.checkpoint import load_model, open_checkpoint
from expresslane.gguf.tensors import GGUFCheckpoint
from expresslane.gguf.write import write_laneformer
from expresslane.weights.packing import load_packed, pack_gguf
from expresslane.weights.stored import stored_only

IDS = torch.tensor([[5, 17, 101, 33, 250, 7, 64, 199, 12, 3]])


def _read_as_floats(path):
    """The way before: every tensor dequantized to fp32, then the file's blocks packed."""
    model = load_model(path, device="cpu", dtype="float32", progress=False)
    pack_gguf(model, path)
    return model


def _pieces(packed):
    for q in [*packed.matrices, packed.embed]:
        yield from q.pieces


def _assert_same(ours, before):
    a, b = list(_pieces(ours.packed)), list(_pieces(before.packed))
    assert len(a) == len(b) and [p.fmt for p in a] == [p.fmt for p in b]
    for p, q in zip(a, b, strict=True):
        for x, y in zip(p.parts, q.parts, strict=True):
            assert (x is None) == (y is None), p.fmt
            if x is not None:
                assert x.shape == y.shape and torch.equal(x, y), p.fmt
    with torch.inference_mode():
        assert torch.equal(ours(IDS), before(IDS))


@pytest.fixture
def dequantized(monkeypatch):
    """The checkpoint keys read as floats."""
    seen: list[str] = []
    tensor = GGUFCheckpoint.tensor

    def spy(self, key):
        seen.append(key)
        return tensor(self, key)

    monkeypatch.setattr(GGUFCheckpoint, "tensor", spy)
    return seen


@pytest.mark.parametrize(
    "case,kind",
    [("llama-gqa", "Q4_0"), ("llama-tied-llama3-rope", "Q8_0"), ("qwen2-bias", "F16"),
     ("qwen3-qk-norm", "Q5_1")],
)  # fmt: skip
def test_stored_blocks_are_never_read_as_floats(case, kind, tmp_path, dequantized):
    path = hf_to_gguf(_hf_model(case), tmp_path / "m.gguf", weight_type=kind)
    ours = load_packed(path, device="cpu", progress=False)
    floats = set(dequantized)
    assert floats and all(len(GGUFCheckpoint(path).shape(k)) == 1 for k in floats), floats
    before = _read_as_floats(path)
    assert len(dequantized) > len(floats)  # the old way read the matrices too
    _assert_same(ours, before)


def test_an_adapted_matrix_is_read_as_floats_and_merged(tmp_path, dequantized):
    from expresslane.bench.lora import write_adapter
    from expresslane.weights.lora import load_adapter, merge

    path = hf_to_gguf(_hf_model("llama-gqa"), tmp_path / "m.gguf", weight_type="Q4_0")
    adapter = tmp_path / "lora.gguf"
    cfg = open_checkpoint(path)[1]
    write_adapter(adapter, cfg, 4, 8.0, ("q", "down"), 0)
    ours = load_packed(path, device="cpu", progress=False, lora=((str(adapter), 1.0),))
    matrices = {k for k in dequantized if len(GGUFCheckpoint(path).shape(k)) == 2}
    want = {f"model.layers.{i}.{m}.weight" for i in range(cfg.num_layers)
            for m in ("self_attn.q_proj", "mlp.down_proj")}  # fmt: skip
    assert matrices == want
    before = load_model(path, device="cpu", dtype="float32", progress=False)
    adapted = merge(before, [load_adapter(adapter, cfg)])
    pack_gguf(before, path, adapted)
    _assert_same(ours, before)


def test_a_laneformers_lanes_are_read_as_floats(tmp_path, dequantized):
    """Its lanes are stacked from floats (no `fused` for L > 1), its embedding is stored."""
    path = write_laneformer(TRAINED, tmp_path / "lf.gguf", "Q8_0")
    cfg = open_checkpoint(path)[1]
    assert cfg.num_lanes > 1 and stored_only(cfg, path) == {"model.tok_embeddings.weight"}
    ours = load_packed(path, device="cpu", progress=False)
    assert "model.tok_embeddings.weight" not in dequantized
    _assert_same(ours, _read_as_floats(path))
