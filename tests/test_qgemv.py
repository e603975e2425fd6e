"""The quantized GPU products (kernels/qgemv.py) and their layout (weights/gpu_pack.py).

In the Triton interpreter on a CPU (TRITON_INTERPRET=1, set before triton is imported), at small
irregular shapes: K not a multiple of the group (padded), O not a multiple of the tile, 1 and 3
lanes, 1 to 8 tokens. References: `GPUQuant.dequantize` (fp32 q * scale + mins) through
`qgemv_reference`, GGUF's own block formats for the repacks, and for the model the same weights
dequantized into a plain float model (kernels/qlinear.quantized_reference).
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEVICE, GPU, triton  # noqa: E402, F401  (first: sets the interpreter)

from expresslane.errors import ConfigError  # noqa: E402
from expresslane.kernels.qgemv import qgemv, qgemv_reference  # noqa: E402
from expresslane.kernels.qlinear import (  # noqa: E402
    QuantProj,
    quantize_model,
    quantized_bytes,
    quantized_reference,
)
from expresslane.weights import gpu_pack, quant  # noqa: E402

pytestmark = pytest.mark.gpu
FORMATS = [("int8", 32), ("int8", 128), ("int4", 32), ("int4", 128)]


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of a different sum
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * want.float().abs().max().item(), f"max error {err}"


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_qgemv_equals_the_dequantized_product(fmt, group, dtype, norm):
    torch.manual_seed(1)
    L, O, K, S = 3, 37, 200, 3  # K padded to 256: the tail must never reach a sum
    w = gpu_pack.quantize(torch.randn(L, O, K), fmt, group).to(DEVICE)
    x = torch.randn(S, L, K, device=DEVICE).to(dtype)
    nw = (torch.rand(L, K, device=DEVICE) + 0.5).to(dtype) if norm else None
    got = qgemv(w, x, norm_weight=nw)
    assert got.shape == (S, L, O) and got.dtype == dtype
    _close(got, qgemv_reference(w, x, norm_weight=nw), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_in_groups_of_16_equals_the_dequantized_product(dtype):
    """Groups of 16 (the GGUF repacks of the types with a scale per 16 values: IQ2_XS, IQ2_S,
    IQ1_M, NVFP4), built directly (no gguf, so the GPU stage runs it too), 1 and 5 tokens, the
    5-token rows bitwise the lone tokens'."""
    torch.manual_seed(6)
    L, O, K = 2, 29, 176  # K padded to 192: the tail's groups are zero
    q = torch.randint(-43, 44, (L, O, 192), dtype=torch.int8)
    q[..., K:] = 0
    scale = (torch.rand(L, O, 192 // 16) * 0.02 + 1e-3).half()
    w = gpu_pack.GPUQuant("int8", 16, K, q, scale).to(DEVICE)
    x = torch.randn(5, L, K, device=DEVICE).to(dtype)
    got = qgemv(w, x)
    _close(got, qgemv_reference(w, x), dtype)
    alone = torch.stack([qgemv(w, x[s]) for s in range(5)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 128)])
def test_each_tokens_row_is_independent_of_the_token_count(fmt, group):
    """Batch invariance, bitwise: token s of an S-token call equals a 1-token call on it."""
    torch.manual_seed(2)
    L, O, K = 1, 24, 160
    w = gpu_pack.quantize(torch.randn(L, O, K), fmt, group).to(DEVICE)
    x = torch.randn(8, L, K, device=DEVICE).to(torch.bfloat16)
    nw = (torch.rand(K, device=DEVICE) + 0.5).to(torch.bfloat16)
    alone = torch.stack([qgemv(w, x[s], norm_weight=nw) for s in range(8)])  # (8, L, O)
    for S in (2, 5, 8):
        assert torch.equal(qgemv(w, x[:S].contiguous(), norm_weight=nw), alone[:S])


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_quantize_rounds_to_the_nearest_level(fmt, group):
    torch.manual_seed(3)
    w = torch.randn(2, 9, 96) * torch.linspace(0.1, 3, 96)
    q = gpu_pack.quantize(w, fmt, group)
    assert q.shape == w.shape and q.padded_k == (128 if group == 128 else 128)
    step = q.scale.float().repeat_interleave(group, -1)[..., :96]  # (2, 9, 96)
    assert ((q.dequantize() - w).abs() <= 0.5 * step + 1e-3 * w.abs().amax()).all()
    bits = 8 if fmt == "int8" else 4
    per_value = 8 * q.nbytes / q.data[..., 0].numel() / q.padded_k
    assert per_value == bits + 16 * (1 if fmt == "int8" else 2) / group


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_gguf_blocks_repack_to_the_same_values(fmt):
    torch.manual_seed(4)
    w = torch.randn(2, 11, 96)  # K = 3 blocks of 32, padded to 128
    blocks = quant.quantize(w, fmt)
    g = gpu_pack.from_qtensor(blocks)
    assert g.fmt == ("int8" if fmt == "q8_0" else "int4") and g.group == 32
    assert torch.equal(g.dequantize(), blocks.dequantize())


def test_q4_k_repacks_to_ggufs_dequantization():
    pytest.importorskip("gguf")  # the GPU image has no gguf: the test runs where it is
    from expresslane.gguf.quants import dequantize as gguf_dequantize

    torch.manual_seed(5)
    n, k = 3, 512
    raw = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8)
    d = (torch.rand(n * k // 256, 2) * 0.01).half().view(torch.uint8)  # d, dmin: sane f16
    raw[:, 0:4] = d.reshape(-1, 4)
    g = gpu_pack.from_q4_k(raw.reshape(-1), n, k)
    assert torch.equal(g.dequantize()[0], gguf_dequantize(raw, "Q4_K", (n, k)))
    x = torch.randn(2, 1, k, device=DEVICE)
    _close(qgemv(g.to(DEVICE), x), x @ gguf_dequantize(raw, "Q4_K", (n, k)).T.to(DEVICE), x.dtype)


GRIDDED = [("IQ4_NL", 96), ("IQ4_XS", 512), ("IQ3_S", 512), ("IQ3_XXS", 256), ("IQ2_XXS", 512),
           ("IQ1_S", 256), ("MXFP4", 96), ("IQ2_XS", 256), ("IQ2_S", 512), ("IQ1_M", 256),
           ("NVFP4", 192), ("Q1_0", 384), ("Q4_0", 96), ("Q5_0", 160), ("Q6_K", 256),
           ("Q3_K", 512)]  # fmt: skip
PER_16 = ("IQ2_XS", "IQ2_S", "IQ1_M", "NVFP4", "Q6_K", "Q3_K")  # groups of 16


@pytest.mark.parametrize("ggml_type, k", GRIDDED)
def test_grid_blocks_repack_with_ggufs_values(ggml_type, k):
    """IQ4's grid values as int8 with the block's scale (IQ4_XS: d times its 6-bit scale, in
    fp32; the codebook types' times their power of two; the per-16 types in groups of 16; Q1_0
    as +-1; Q5_0, Q6_K, Q3_K less their offset), IQ3_S's re-laid nibbles and Q4_0's as int4
    (scale 2 d s, min -15 d s; d, -8 d): the reference dequantization bit for bit, and the
    product on it."""
    pytest.importorskip("gguf")
    from gguf_kit import random_raw

    from expresslane.gguf.quants import dequantize as gguf_dequantize
    from expresslane.weights.quant import from_gguf

    n = 5
    raw = torch.from_numpy(random_raw(ggml_type, n, k, seed=k))
    g = gpu_pack.from_qtensor(from_gguf(ggml_type, raw, (n, k)))
    want = gguf_dequantize(raw, ggml_type, (n, k))
    fmt = "int4" if ggml_type in ("IQ3_S", "Q4_0") else "int8"
    group = 16 if ggml_type in PER_16 else 32
    assert g.fmt == fmt and g.group == group and torch.equal(g.dequantize()[0], want)
    x = torch.randn(2, 1, k, device=DEVICE)
    _close(qgemv(g.to(DEVICE), x), x @ want.T.to(DEVICE), x.dtype)


@pytest.mark.parametrize("ggml_type, k", [("Q2_K", 256), ("Q5_1", 64), ("Q5_K", 256)])
def test_types_without_a_gpu_layout_are_refused_by_name(ggml_type, k):
    """Refused, naming the format, not repacked wrong (repack_gguf repacks only
    qlinear.REPACKED; the rest load as floats)."""
    pytest.importorskip("gguf")
    from gguf_kit import random_raw

    from expresslane.kernels.qlinear import REPACKED
    from expresslane.weights.quant import from_gguf

    q = from_gguf(ggml_type, torch.from_numpy(random_raw(ggml_type, 3, k, seed=1)), (3, k))
    with pytest.raises(ValueError, match=f"no GPU layout for the {q.fmt} format"):
        gpu_pack.from_qtensor(q)
    assert ggml_type not in REPACKED


@pytest.fixture(scope="module")
def tiny_pair():
    import tiny

    model = tiny.laneformer(seed=3, max_position_embeddings=64).to(DEVICE)
    ref = tiny.laneformer(seed=3, max_position_embeddings=64).to(DEVICE)
    return quantize_model(model, "int4-g32"), quantized_reference(ref, "int4-g32")


def test_quantized_model_equals_its_dequantized_reference(tiny_pair, monkeypatch):
    """Every projection and the head on the kernel (<= 8 tokens) give the float model's logits;
    the bytes counted are the layout's."""
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    model, ref = tiny_pair
    assert isinstance(model.model.layers[0].attention.wq, QuantProj)
    assert isinstance(model.lm_head, QuantProj)  # the vocab-parallel head (L, V/L, D)
    ids = torch.tensor([[1, 5, 9, 13]], device=DEVICE)
    with torch.no_grad():
        _close(model(ids), ref(ids), torch.float32)
    mats = [m.q for m in model.modules() if isinstance(m, QuantProj)]
    assert quantized_bytes(model) == sum(q.nbytes for q in mats) and len(mats) == 3 * 7 + 1


def test_a_tied_head_is_quantized_apart_from_the_embedding(monkeypatch):
    import tiny

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    kw = dict(seed=4, lm_head_type="replicate", tie_word_embeddings=True)
    model = quantize_model(tiny.laneformer(**kw).to(DEVICE), "int8")
    ref = quantized_reference(tiny.laneformer(**kw).to(DEVICE), "int8")
    embed = tiny.laneformer(**kw).model.tok_embeddings.weight
    assert torch.equal(model.model.tok_embeddings.weight.cpu(), embed)  # lookups stay float
    assert isinstance(model.lm_head, QuantProj) and model.lm_head.plain
    ids = torch.tensor([[3, 1, 4]], device=DEVICE)
    with torch.no_grad():
        _close(model(ids), ref(ids), torch.float32)


def test_quantized_model_decodes_like_its_reference(tiny_pair, monkeypatch):
    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    model, ref = tiny_pair
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    got = Engine(model, max_model_len=16, decode="graph", kernels="auto")
    assert got.step_name == "forward"  # the fused bf16 step does not read quantized weights
    want = Engine(ref, max_model_len=16, decode="graph", kernels="off")
    prompt = [1, 5, 9]
    assert list(got.generate(prompt, params)) == list(want.generate(prompt, params))


def test_quantization_names_are_checked():
    from expresslane.weights.packing import load_plan

    with pytest.raises(ConfigError, match="int4"):
        load_plan("cpu", "auto", "int4")  # the CPU packed step has no int4 kernel
    with pytest.raises(ConfigError, match="int3"):
        load_plan("cpu", "auto", "int3")
    with pytest.raises(ConfigError, match="group"):
        gpu_pack.quantize(torch.zeros(4, 64), "int4", 64)


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1", "IQ4_NL", "MXFP4", "MXFP4-floats"])
def test_gguf_blocks_repack_into_the_model(tmp_path, monkeypatch, ggml_type):
    """A Llama GGUF's Q8_0 / Q4_1 / IQ4_NL / MXFP4 matrices (projections and the tied head) on
    the kernels give the logits of the same file loaded as floats (its dequantized values).
    MXFP4-floats: every matrix's blocks refused by the CPU layout (from_gguf None, as for an MXFP4
    scale no f16 holds), which then keep their floats."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from gguf_kit import hf_to_gguf

    from expresslane.checkpoint import load_model
    from expresslane.kernels.qlinear import repack_gguf

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    floats = ggml_type.endswith("-floats")
    path = hf_to_gguf(hf, tmp_path / "m.gguf", weight_type=ggml_type.removesuffix("-floats"))
    ref = load_model(path, device="cpu", dtype="float32", progress=False).to(DEVICE)
    if floats:
        monkeypatch.setattr("expresslane.kernels.qlinear.from_gguf", lambda *a: None)
    model = repack_gguf(load_model(path, device="cpu", dtype="float32", progress=False), path)
    model = model.to(DEVICE)
    assert isinstance(model.model.layers[0].feed_forward.w2, QuantProj) != floats
    head = getattr(model, "lm_head", None)  # a tied head without one: the embedding
    assert isinstance(head, QuantProj) != floats and (floats or head.plain)
    ids = torch.tensor([[3, 1, 4, 1, 5]], device=DEVICE)
    with torch.no_grad():
        _close(model(ids), ref(ids), torch.float32)
