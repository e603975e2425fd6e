"""Bad GGUF files: truncated, wrong magic, unknown architecture, unknown or unsupported tensor
type, missing tokenizer. Each is one line on stderr, naming the problem, and exit code 2."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf_kit import random_raw, write_gguf

from expresslane.__main__ import main

D, V, F = 32, 64, 64  # hidden, vocab, FFN: one tiny layer


def _tensors(qtype: str = "Q8_0", d: int = D, f: int = F) -> dict:
    rng = np.random.default_rng(0)
    f32 = lambda *s: (rng.standard_normal(s).astype(np.float32), "F32")  # noqa: E731
    out = {"token_embd.weight": f32(V, d), "output_norm.weight": f32(d)}
    for name, rows, cols in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d),
                             ("attn_output", d, d), ("ffn_gate", f, d), ("ffn_up", f, d),
                             ("ffn_down", d, f)):  # fmt: skip
        out[f"blk.0.{name}.weight"] = (random_raw(qtype, rows, cols), qtype)
    out["blk.0.attn_norm.weight"] = f32(d)
    out["blk.0.ffn_norm.weight"] = f32(d)
    return out


def _meta(arch: str = "llama", d: int = D, f: int = F) -> dict:
    return {f"{arch}.{k}": v for k, v in (("embedding_length", d), ("block_count", 1),
            ("feed_forward_length", f), ("attention.head_count", 4),
            ("context_length", 64))}  # fmt: skip


def _good(tmp_path):
    return write_gguf(tmp_path / "m.gguf", "llama", _meta(), _tensors())


def _fails(capsys, path, *words, command="run"):
    tail = {"run": ["--prompt", "x", "--max-tokens", "1"],
            "bench": ["--no-peer", "--contexts", "4", "--decode-tokens", "2"]}  # fmt: skip
    argv = [command, str(path), *tail[command]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"expresslane {command}: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.mark.parametrize("command", ["run", "bench"])
def test_truncated_inside_the_tensor_data(tmp_path, capsys, command):
    path = _good(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _fails(capsys, path, str(path.name), "truncated", command=command)


def test_truncated_inside_the_header(tmp_path, capsys):
    path = _good(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    _fails(capsys, path, "m.gguf", "truncated or corrupt GGUF header")


def test_truncated_inside_the_vocabulary(tmp_path, capsys):
    """The vocabulary's strings are read in one loop (reader._strings): a string running past
    the end is the same one-line error as anywhere in the header."""
    tokens = [f"tok{i}" for i in range(V)]
    path = write_gguf(tmp_path / "m.gguf", "llama", {**_meta(), "tokenizer.ggml.tokens": tokens},
                      _tensors())  # fmt: skip
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"tok40") + 2])
    _fails(capsys, path, "m.gguf", "truncated or corrupt GGUF header")


def test_wrong_magic(tmp_path, capsys):
    path = _good(tmp_path)
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    _fails(capsys, path, "m.gguf", "not a GGUF file", "GGML")


def test_unknown_architecture(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", "mamba", _meta("mamba"), _tensors())
    _fails(capsys, path, "architecture 'mamba' is not supported", "llama")


def test_unsupported_tensor_type(tmp_path, capsys):
    # a type llama.cpp has and we do not read (Q8_K, its activations' blocks, which no weight
    # quantizer writes); 256-value rows: a wider model
    meta, tensors = _meta(d=256, f=256), _tensors("Q8_K", 256, 256)
    path = write_gguf(tmp_path / "m.gguf", "llama", meta, tensors)
    _fails(capsys, path, "blk.0.attn_q.weight", "Q8_K", "Q4_K", "NVFP4", "Q1_0")


def test_unknown_tensor_type_id(tmp_path, capsys):
    path = _good(tmp_path)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 200)  # the type field after the dims
    path.write_bytes(bytes(data))
    _fails(capsys, path, "blk.0.attn_q.weight", "unknown GGML type id 200")


def test_missing_tokenizer_metadata(tmp_path, capsys):
    _fails(capsys, _good(tmp_path), "no tokenizer.ggml.tokens", "beside the GGUF")


def test_a_folder_with_two_ggufs_is_ambiguous(tmp_path, capsys):
    _good(tmp_path)
    (tmp_path / "n.gguf").write_bytes((tmp_path / "m.gguf").read_bytes())
    _fails(capsys, tmp_path, "2 GGUF files", "m.gguf")


def test_a_file_that_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    _fails(capsys, tmp_path / "notes.txt", "is a file", ".gguf")


def _split(tmp_path):
    """The good model in three parts: m-00001-of-00003.gguf ... (4 tensors per part at most)."""
    return write_gguf(tmp_path / "m.gguf", "llama", _meta(), _tensors(), split=4)


def test_a_split_model_with_a_missing_part(tmp_path, capsys):
    first = _split(tmp_path)
    assert first.name == "m-00001-of-00003.gguf"
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    _fails(capsys, first, "part 2 of 3 is missing", "m-00002-of-00003.gguf")


def test_a_split_part_renamed_so_its_siblings_cannot_be_found(tmp_path, capsys):
    first = _split(tmp_path)
    renamed = first.rename(tmp_path / "model.gguf")
    _fails(capsys, renamed, "split into 3 files", "-NNNNN-of-00003.gguf")


def test_a_split_part_swapped_for_another(tmp_path, capsys):
    first = _split(tmp_path)
    third = tmp_path / "m-00003-of-00003.gguf"
    third.write_bytes((tmp_path / "m-00002-of-00003.gguf").read_bytes())
    _fails(capsys, first, "m-00003-of-00003.gguf", "says it is part 2 of 3")
