"""Split GGUF models (llama.cpp's gguf-split layout, written here by gguf-py's GGUFWriter): the
parts read as one checkpoint, named by any part or by their folder, with the same tensors and
logits as the one-file model. Bad parts: tests/test_gguf_errors.py."""

from __future__ import annotations

import pytest
import torch
from gguf_kit import hf_to_gguf
from test_gguf_models import TOKENS, _hf_model

from expresslane.checkpoint import load_config, load_model
from expresslane.gguf import find_gguf
from expresslane.gguf.reader import read_file_header, read_header
from expresslane.gguf.tensors import GGUFCheckpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    hf = _hf_model("llama-gqa")
    whole = hf_to_gguf(hf, tmp_path_factory.mktemp("whole") / "m.gguf", weight_type="Q8_0")
    first = hf_to_gguf(hf, tmp_path_factory.mktemp("split") / "m.gguf", "Q8_0", split=10)
    return hf, whole, first


def test_the_parts_hold_every_tensor_once(files):
    _, whole, first = files
    parts = sorted(first.parent.glob("*.gguf"))
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    one = read_header(whole)
    assert read_file_header(parts[1]).get("split.no") == 1
    for part in parts:  # whichever part is named, the whole model is read
        merged = read_header(part)
        assert merged.path == parts[0]
        assert merged.tensors.keys() == one.tensors.keys()
        assert {merged.tensors[n].file for n in merged.tensors} == set(parts)
        for name in one.tensors:
            assert (merged.raw_bytes(name) == one.raw_bytes(name)).all(), name


def test_a_folder_of_parts_is_the_model(files):
    _, _, first = files
    assert find_gguf(first.parent) == first
    assert load_config(first.parent) == load_config(first)


def test_split_model_runs_like_the_whole_file(files):
    hf, whole, first = files
    a = GGUFCheckpoint(whole)
    b = GGUFCheckpoint(first.parent / "m-00002-of-00003.gguf")
    for key in a.keys():
        assert torch.equal(a.tensor(key), b.tensor(key)), key
    ours = load_model(first, device="cpu", dtype="float32", progress=False)
    ref = load_model(whole, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        assert torch.equal(ours(TOKENS), ref(TOKENS))
