"""The embedded Laneformer written as GGUF (expresslane/gguf/write.py, layout in
gguf/laneformer.py) reads back as the same model: the same config, bit-equal tensors in F32 and
gguf-py's own dequantization of its quantization in Q8_0/Q4_1, equal logits and greedy tokens
through the engine, and the same from a split file. Llama checkpoints are refused by the writer."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from expresslane.assets import TRAINED
from expresslane.checkpoint import load_model, open_checkpoint
from expresslane.engine import Engine
from expresslane.gguf.tensors import GGUFCheckpoint
from expresslane.gguf.write import main as write_main
from expresslane.gguf.write import write_laneformer
from expresslane.sampling.params import SamplingParams
from expresslane.weights.packing import load_packed

TOKENS = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def original():
    return load_model(TRAINED, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    return write_laneformer(TRAINED, tmp_path_factory.mktemp("f32") / "lf.gguf", "F32")


def test_f32_file_is_the_same_model(original, f32_file):
    ours = load_model(f32_file, device="cpu", dtype="float32", progress=False)
    assert ours.cfg.dtype == "float32"  # the file's type, as for any GGUF
    assert replace(ours.cfg, dtype=original.cfg.dtype) == original.cfg
    assert ours.cfg.lm_head_type == "vocab_parallel" and ours.cfg.window(0) == 128
    theirs = ours.state_dict()
    for name, a in original.state_dict().items():
        assert torch.equal(a, theirs[name]), name
    with torch.no_grad():
        assert torch.equal(original(TOKENS), ours(TOKENS))


def test_the_engine_decodes_the_gguf_as_the_checkpoint(original, f32_file):
    """The CLI's load path (pack_gguf's stored blocks) gives the checkpoint's greedy tokens;
    the tokenizer files were copied beside the GGUF."""
    assert (f32_file.parent / "tokenizer.json").is_file()
    prompt, params = TOKENS[0, :8].tolist(), SamplingParams(max_tokens=24, ignore_eos=True)
    ref = list(Engine(original, max_model_len=64).generate(prompt, params))
    packed = load_packed(f32_file, device="cpu", progress=False)
    assert list(Engine(packed, max_model_len=64).generate(prompt, params)) == ref


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_quantized_file_holds_gguf_py_quantization(tmp_path, type_name):
    path = write_laneformer(TRAINED, tmp_path / "lf.gguf", type_name)
    _, _, handles, where = open_checkpoint(TRAINED)
    ck = GGUFCheckpoint(path)
    assert sorted(ck.keys()) == sorted(where)
    qtype = gguf.GGMLQuantizationType[type_name]
    for key in where:
        w = handles[where[key]].get_slice(key)[:].float().numpy()
        info = ck.header.tensors[ck._names[key]]
        want = qtype.name if w.ndim > 1 and "norm" not in key else "F32"
        assert info.type_name == want, key
        ref = w if want == "F32" else gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        assert np.array_equal(ck.tensor(key).numpy(), ref.reshape(w.shape)), key


def test_split_file_reads_as_the_whole(original, tmp_path):
    first = write_laneformer(TRAINED, tmp_path / "lf.gguf", "F32", split_max_tensors=20)
    assert first.name == "lf-00001-of-00003.gguf"
    ours = load_model(tmp_path, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        assert torch.equal(original(TOKENS), ours(TOKENS))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(lm_head_type="lane", replicated_rmsn_scale=False, broadcast_delay=1),
        dict(lm_head_type="replicate", tie_word_embeddings=True, pre_norm_lane_agg=True,
             unclamped_layers=[0], dtp_variant="B", model_type="laneformer_tp"),
    ],
    ids=["lane-head-per-lane-norms", "tied-unclamped-variant-b"],
)  # fmt: skip
def test_other_laneformer_layouts_round_trip(tmp_path, overrides):
    """Per-lane norm scales (`.scale`, (L, D)), the lane head, a tied head and the DTP and
    layer fields each come back as written."""
    from tiny import laneformer

    from expresslane.checkpoint import save_model

    model = laneformer(seed=3, **overrides)
    src = save_model(model, tmp_path / "src", dtype="float32")
    ours = load_model(write_laneformer(src, tmp_path / "lf.gguf"), device="cpu", progress=False)
    assert ours.cfg == model.cfg
    x = TOKENS[:, :20] % model.cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(x), ours(x))


def test_the_writer_refuses_a_llama(tmp_path, capsys):
    from tiny import laneformer

    from expresslane.checkpoint import save_model

    llama = laneformer(model_type="llama", num_lanes=1, lm_head_type="replicate")
    src = save_model(llama, tmp_path / "llama", dtype="float32")
    assert write_main([str(src), str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "convert_hf_to_gguf.py" in err[0], err
