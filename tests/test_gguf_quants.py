"""GGUF reading: every tensor type we load dequantizes to what `gguf.quants.dequantize` gives,
and the header parser reads exactly what `gguf.GGUFReader` reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_kit import K_TYPES, random_raw, reference_dequant, write_gguf

from expresslane.gguf.quants import SUPPORTED, dequantize, raw_to_float
from expresslane.gguf.reader import read_header
from expresslane.gguf.tensors import unpermute_rows


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_each_type_dequantizes_like_gguf(tmp_path, type_name):
    # irregular shapes: odd row counts, several blocks per row, a second tensor after the first
    cols = 512 if type_name in (*K_TYPES, "NVFP4", "Q1_0") else 96
    raws = {"a": random_raw(type_name, 3, cols, seed=1), "b": random_raw(type_name, 5, cols, 2)}
    tensors = {n: (r, type_name) for n, r in raws.items()}
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, tensors)
    header = read_header(path)
    for name, raw in raws.items():
        rows = raw.shape[0]
        info = header.tensors[name]
        assert (info.type_name, info.shape) == (type_name, (rows, cols))
        stored = header.raw_bytes(name)
        assert np.array_equal(stored.reshape(rows, -1), raw)
        ours = raw_to_float(header, name)
        ref = torch.from_numpy(reference_dequant(stored, type_name, (rows, cols)).copy())
        assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
        assert torch.equal(ours, ref), (ours - ref).abs().max()


def test_dequantize_handles_flat_and_shaped_input():
    raw = random_raw("Q4_K", 2, 256, seed=3)
    flat = dequantize(torch.from_numpy(raw.reshape(-1)), "Q4_K", (2, 256))
    shaped = dequantize(torch.from_numpy(raw), "Q4_K", (512,))
    assert torch.equal(flat.reshape(-1), shaped)


def test_unpermute_inverts_llama_cpp_permute():
    from gguf_kit import permute

    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)  # 6 heads of head_dim 8
    back = unpermute_rows(torch.from_numpy(permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))
    b = np.arange(48, dtype=np.float32)  # biases are permuted the same way
    assert torch.equal(unpermute_rows(torch.from_numpy(permute(b, 6)), 6), torch.from_numpy(b))


META = {
    "test.u8": ("uint8", 200),
    "test.i8": ("int8", -5),
    "test.u16": ("uint16", 60000),
    "test.i16": ("int16", -300),
    "test.u32": ("uint32", 4_000_000_000),
    "test.i32": ("int32", -7),
    "test.f32": ("float32", 0.25),
    "test.u64": ("uint64", 2**40),
    "test.i64": ("int64", -(2**40)),
    "test.f64": ("float64", 1e-300),
    "test.bool": ("bool", True),
    "test.str": ("string", "héllo ✓"),
}


def test_header_parser_matches_gguf_reader(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, (kind, value) in META.items():
        getattr(w, f"add_{kind}")(key, value)
    w.add_array("test.strs", ["a", "", "ü b", "<|im_end|>"])
    V = gguf.GGUFValueType
    w.add_key_value("test.ints", [3, -1, 7], V.ARRAY, V.INT32)
    w.add_key_value("test.floats", [0.5, -2.0], V.ARRAY, V.FLOAT32)
    w.add_key_value("test.bools", [True, False], V.ARRAY, V.BOOL)
    w.add_custom_alignment(64)
    for i, t in enumerate(("F32", "Q8_0", "Q6_K")):
        cols = 256 if t == "Q6_K" else 64
        w.add_tensor(f"t{i}", random_raw(t, 3, cols, i), raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = gguf.GGUFReader(tmp_path / "m.gguf")
    ours = read_header(tmp_path / "m.gguf")
    assert ours.version == ref.fields["GGUF.version"].contents()
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for k in keys:
        want = ref.fields[k].contents()
        assert ours.metadata[k] == pytest.approx(want) if isinstance(want, float) else want
    assert ours.data_offset == ref.data_offset
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.offset == t.data_offset
        assert np.array_equal(ours.raw_bytes(t.name), np.asarray(t.data).view(np.uint8).ravel())
