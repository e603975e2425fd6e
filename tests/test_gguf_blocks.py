"""GGUF's 1.6- to 8-bit block types, kept or re-laid (weights/blocks.py), and their C products
(csrc/cpu_nibble.c): random valid blocks of every type on irregular shapes, against gguf-py's
dequantization bit for bit, the product against that reference, and S tokens against S single
tokens bit for bit per row."""

from __future__ import annotations

import pytest
import torch
from gguf_kit import reference_dequant

from expresslane.step import native
from expresslane.weights.gguf_blocks import TYPES
from expresslane.weights.quant import from_gguf

gguf = pytest.importorskip("gguf")

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4")  # blocks of 32 values
CODEBOOKS = ("IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", *CODEBOOKS, "TQ2_0", "TQ1_0")  # of 256
WIDE = ("NVFP4", "Q1_0")  # blocks of 64 and 128 values
# (N, K): K a multiple of 32 (legacy: partial last groups of 1-3 blocks) or of 256
SHAPES = (
    {t: [(37, 96), (5, 160), (130, 576), (9, 224), (3, 32)] for t in LEGACY}
    | {t: [(37, 256), (11, 768), (130, 512)] for t in KQUANTS}
    | {
        "NVFP4": [(37, 64), (5, 192), (130, 576), (9, 320)],
        "Q1_0": [(37, 128), (5, 384), (30, 1536)],
    }
)
F16_AT = {  # byte offsets of a block's f16 fields (d, and m / dmin)
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ2_0": (64,), "TQ1_0": (52,), "IQ1_M": (), "MXFP4": (),
    "NVFP4": (), "Q1_0": (0,),
} | dict.fromkeys(CODEBOOKS[:-1], (0,))  # UE4M3 scales: any byte  # fmt: skip


def random_blocks(ggml_type: str, N: int, K: int, seed: int) -> torch.Tensor:
    """Random bytes for every block, with finite f16 scales of varied size."""
    g = torch.Generator().manual_seed(seed)
    _, bv, bb = TYPES[ggml_type]
    raw = torch.randint(0, 256, (N, K // bv, bb), generator=g, dtype=torch.uint8)
    for at in F16_AT[ggml_type]:
        d = (torch.rand(N, K // bv, generator=g) * 0.02 + 1e-4).half()
        raw[..., at : at + 2] = d.unsqueeze(-1).view(torch.uint8)
    if ggml_type == "MXFP4":  # e: 2^(e - 128), in the range an f16 holds (blocks.MXFP4_E)
        raw[..., 0] = torch.randint(104, 144, raw.shape[:-1], generator=g, dtype=torch.uint8)
    if ggml_type == "IQ1_M":  # d's 16 bits in the top nibbles of the four u16 of scales
        d = (torch.rand(N, K // bv, generator=g) * 0.02 + 1e-4).half().view(torch.int16).int()
        sc = raw[..., 48:56].contiguous().view(torch.int16).int()  # (N, K/256, 4)
        sc = sc & 0x0FFF | (d.unsqueeze(-1) >> torch.arange(0, 16, 4) & 15) << 12
        raw[..., 48:56] = sc.to(torch.int16).view(torch.uint8)
    return raw.reshape(N, -1)


def gguf_reference(ggml_type: str, raw: torch.Tensor, N: int, K: int) -> torch.Tensor:
    return torch.from_numpy(reference_dequant(raw.numpy(), ggml_type, (N, K)).copy())


CASES = [(t, s) for t in (*LEGACY, *KQUANTS, *WIDE) for s in SHAPES[t]]


@pytest.mark.parametrize("ggml_type, shape", CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_blocks_dequantize_as_gguf_py_does(ggml_type, shape):
    N, K = shape
    raw = random_blocks(ggml_type, N, K, N + K)
    q = from_gguf(ggml_type, raw, shape)
    assert q.fmt == TYPES[ggml_type][0] and q.shape == shape  # TQ*: as q2_k
    assert torch.equal(q.dequantize(), gguf_reference(ggml_type, raw, N, K))
    assert torch.equal(q.rows(2, 5).dequantize(), q.dequantize()[2:5])


def _needs(t):
    fmt = TYPES[t][0]
    return pytest.mark.skipif(not native.available(fmt), reason=f"no C kernels for {fmt} here")


@pytest.mark.parametrize(
    "ggml_type, shape", [pytest.param(t, s, marks=_needs(t)) for t, s in CASES],
    ids=[f"{t}-{s}" for t, s in CASES],
)  # fmt: skip
def test_product_equals_the_dequantized_reference(ggml_type, shape):
    N, K = shape
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 7 * N + K), shape)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(3, K, generator=g)
    x[:, 0] = 25.0  # an outlier: x's 16-bit fixed point scales to it
    got = native.native_matmul(q, x)  # (3, N)
    w = q.dequantize().double()
    ref = x.double() @ w.T
    # x in 16-bit fixed point: each element off by at most half a step of max|x| / 32639
    step = x.abs().amax(-1, keepdim=True).double() / 32639
    bound = 0.5 * step * w.abs().sum(-1) + 1e-5 * ref.abs() + 1e-6
    assert ((got.double() - ref).abs() <= bound).all()
    one = native.native_matvec(q, x[1])
    assert torch.equal(one, got[1])


@pytest.mark.parametrize(
    "ggml_type, shape", [pytest.param(t, s, marks=_needs(t)) for t, s in CASES],
    ids=[f"{t}-{s}" for t, s in CASES],
)  # fmt: skip
def test_16_bit_products_are_the_product_of_x_rounded_to_its_fixed_point(ggml_type, shape):
    """The exact step's x in 16-bit fixed point (one scale per vector: max |x| / 32639 for the
    nibble formats, / 32767 for Q8_0, csrc/cpu_activations.c), offsets included: the product
    is the dequantized weights times that rounded x to fp32's rounding, so x's rounding error
    weighs the weights alone."""
    N, K = shape
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 5 * N + K), shape)
    g = torch.Generator().manual_seed(K + 1)
    x = torch.randn(4, K, generator=g) * torch.rand(K, generator=g) ** 4 * 10  # outliers
    top = 32767 if ggml_type == "Q8_0" else 32639
    sx = x.abs().amax(-1, keepdim=True) / top
    rounded = torch.round(x / sx).clamp(-top, top) * sx
    w = q.dequantize().double()
    ref = rounded.double() @ w.T
    tol = 1e-5 * (rounded.double().abs() @ w.abs().T) + 1e-6
    got = native.native_matmul(q, x)
    assert ((got.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize(
    "ggml_type, shape", [pytest.param(t, s, marks=_needs(t)) for t, s in CASES],
    ids=[f"{t}-{s}" for t, s in CASES],
)  # fmt: skip
def test_a_prompts_products_are_x_rounded_times_the_weights(ggml_type, shape):
    """A prompt's chunk (prompt=True: on a CPU with AMX, Q8_0 and the nibble formats but NVFP4
    in tiles, csrc/cpu_amx_blocks.c) to the same bound as the exact step's products;
    where the tiles run, the bits are not the decode kernels' (their own order of sums), and a
    chunk of 7 tokens, below their least, is."""
    N, K = shape
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 3 * N + K), shape)
    g = torch.Generator().manual_seed(K + 2)
    x = torch.randn(37, K, generator=g) * torch.rand(K, generator=g) ** 4 * 10
    top = 32767 if ggml_type == "Q8_0" else 32639
    sx = x.abs().amax(-1, keepdim=True) / top
    rounded = torch.round(x / sx).clamp(-top, top) * sx
    w = q.dequantize().double()
    ref = rounded.double() @ w.T
    got = native.native_matmul(q, x, prompt=True)
    slack = 10 if ggml_type in ("MXFP4", "NVFP4") else 1  # e2m1 grids: x 2^40 apart in a row
    tol = slack * 1e-5 * (rounded.double().abs() @ w.abs().T) + 1e-6
    assert ((got.double() - ref).abs() <= tol).all()
    tiles = bool(native.FEATURES & native.HAS_AMX) and ggml_type != "NVFP4"  # f16 scales
    assert torch.equal(got, native.native_matmul(q, x)) == (not tiles)
    assert torch.equal(native.native_matmul(q, x[:7], prompt=True), native.native_matmul(q, x[:7]))


@pytest.mark.parametrize(
    "ggml_type, shape", [pytest.param(t, s, marks=_needs(t)) for t, s in CASES],
    ids=[f"{t}-{s}" for t, s in CASES],
)  # fmt: skip
def test_c_dequantize_is_the_reference_bit_for_bit(ggml_type, shape):
    """The C decoder (a long prefill's weights): fp32 the reference's bits, bf16 their round to
    nearest even, for row views and lanes too."""
    N, K = shape
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 3 * N + K), shape)
    ref = q.dequantize()
    assert torch.equal(native.native_dequantize(q), ref)
    assert torch.equal(native.native_dequantize(q, torch.bfloat16), ref.bfloat16())
    assert torch.equal(native.native_dequantize(q.rows(1, N)), ref[1:])
    lanes = q.map(lambda t: torch.stack([t, t.flip(0)]))  # (2, N, K): the rows reversed
    assert torch.equal(native.native_dequantize(lanes), torch.stack([ref, ref.flip(0)]))


def test_mxfp4_scales_no_f16_holds_keep_the_matrix_in_floats():
    """MXFP4's e stands for 2^(e - 128); our layout keeps it as an f16, exact for e in 104..143.
    A matrix with another e is not re-laid (None: its loader keeps floats), still read exactly."""
    from expresslane.gguf.quants import dequantize
    from expresslane.weights.gguf_blocks import MXFP4_E

    raw = random_blocks("MXFP4", 5, 64, 2)
    assert from_gguf("MXFP4", raw, (5, 64)) is not None
    for e in (MXFP4_E[0] - 1, MXFP4_E[1] + 1, 0):
        odd = raw.clone().reshape(5, 2, 17)
        odd[3, 1, 0] = e
        assert from_gguf("MXFP4", odd.reshape(5, -1), (5, 64)) is None
        assert torch.equal(dequantize(odd, "MXFP4", (5, 64)), gguf_reference("MXFP4", odd, 5, 64))


@pytest.mark.parametrize("ggml_type", [pytest.param(t, marks=_needs(t)) for t in KQUANTS])
def test_a_k_that_superblocks_do_not_divide_is_refused(ggml_type):
    """The kernels read whole superblocks (the 2-bit loader whole groups of 128 values): a
    matrix cut to 128 columns is refused, not read past its rows."""
    from expresslane.weights.quant import QTensor

    q = from_gguf(ggml_type, random_blocks(ggml_type, 3, 256, 1), (3, 256))
    per = q.data.shape[-1] // 2  # half of each row's data: K = 128
    cut = QTensor(q.fmt, q.data[:, :per].contiguous(), *q.parts[1:])
    with pytest.raises(RuntimeError, match="refused"):
        native.native_matmul(cut, torch.randn(2, 128))


def _width(ggml_type: str) -> int:
    """A K for the type with a partial last group where its blocks allow one."""
    return 512 if ggml_type in KQUANTS else {"NVFP4": 320, "Q1_0": 384}.get(ggml_type, 352)


@pytest.mark.parametrize("ggml_type", [pytest.param(t, marks=_needs(t)) for t in TYPES])
def test_s_token_rows_are_the_single_token_bits(ggml_type):
    N, K = 19, _width(ggml_type)
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 5), (N, K))
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(9))
    single = torch.stack([native.native_matvec(q, x[s]) for s in range(9)])
    for S in range(1, 10):
        assert torch.equal(native.native_matmul(q, x[:S]), single[:S]), S


@pytest.mark.parametrize("ggml_type", [pytest.param(t, marks=_needs(t)) for t in TYPES])
def test_a_rows_bits_do_not_depend_on_its_place_or_the_threads(ggml_type):
    """The kernels sum each row's lanes 16 rows at a time (csrc EL_TILES): a row gives the same
    bits in any slot of a tile, in any lane, with 1 or 2 threads (which split the rows
    elsewhere), for 1 token or a verify's 7."""
    N, K = 37, _width(ggml_type)
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 11), (N, K))
    lanes = q.map(lambda t: torch.stack([t, t.flip(0)]))  # (2, N, K): the rows reversed
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(4))
    before, first = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for S in (1, 7):
                one = native.native_matmul(q, x[:S])  # (S, N)
                two = native.native_matmul(lanes, x[:S, None].expand(S, 2, K).contiguous())
                assert torch.equal(two[:, 0], one) and torch.equal(two[:, 1], one.flip(-1))
                assert torch.equal(one, first.setdefault(S, one)), (threads, S)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "ggml_type, shape", [pytest.param(t, s, marks=_needs(t)) for t, s in CASES],
    ids=[f"{t}-{s}" for t, s in CASES],
)  # fmt: skip
def test_8_bit_products_are_the_product_of_x_rounded_per_block(ggml_type, shape):
    """lowp (--prefill-dtype int8): the product of the dequantized weights with x rounded to 8
    bits per block, offsets included (an exact offset from x's own sums gave ~2.5x the error on
    SmolLM2), to fp32's rounding; a row's bits whatever S; not the 16-bit product."""
    N, K = shape
    q = from_gguf(ggml_type, random_blocks(ggml_type, N, K, 3 * N + K), shape)
    g = torch.Generator().manual_seed(N)
    x = torch.randn(7, K, generator=g) * torch.rand(K, generator=g) ** 4 * 10  # outliers
    x[:, K // 2 :] *= 0.01  # blocks of very different sizes: each keeps its own scale
    got = native.native_matmul(q, x, lowp=True)
    w = q.dequantize().double()
    ref = native.lowp_activations(x, q.fmt).double() @ w.T
    tol = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-5
    assert ((got.double() - ref).abs() <= tol).all()
    one = torch.cat([native.native_matmul(q, x[s : s + 1], lowp=True) for s in range(7)])
    assert torch.equal(one, got)
    assert not torch.equal(got, native.native_matmul(q, x))


# --- whole GGUF files through the packed step ------------------------------------------------
MIXES = {  # tensor kind -> GGUF type, as llama.cpp's quantizer mixes them
    **{t: dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down", "embd"), t) for t in TYPES},
    "Q4_K_M": dict(q="Q4_K", k="Q4_K", v="Q6_K", o="Q4_K", gate="Q4_K", up="Q4_K", down="Q6_K",
                   embd="Q6_K"),
    # rows not a multiple of 256 fall back to legacy types: Q/K and V, gate and up differ
    "fallbacks": dict(q="Q5_0", k="Q5_0", v="Q8_0", o="Q5_1", gate="Q5_1", up="Q4_0",
                      down="Q4_K", embd="Q8_0"),
    # the 2- to 4-bit types of Q2_K / Q3_K_M / IQ4_XS files side by side in fused products
    "low_bits": dict(q="Q3_K", k="Q2_K", v="IQ4_XS", o="IQ4_NL", gate="Q2_K", up="Q3_K",
                     down="IQ4_XS", embd="IQ4_NL"),
}  # fmt: skip
KIND = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
        "ffn_up": "up", "ffn_down": "down", "token_embd": "embd"}  # fmt: skip


def retyped(src, dst, mix: dict[str, str]):
    """The GGUF file src with every matrix stored as `mix` says: gguf-py's quantizer where it
    has one, else random blocks (K types)."""
    import numpy as np
    from gguf_kit import QUANTIZABLE, random_raw, random_raw_from

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0],
                        sub_type=f.types[1] if len(f.types) > 1 else None)  # fmt: skip
    for i, t in enumerate(r.tensors):
        a = np.array(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        if a.ndim == 1 or KIND.get(kind) is None:
            w.add_tensor(t.name, a)
            continue
        ty = mix[KIND[kind]]
        qt = gguf.GGMLQuantizationType[ty]
        raw = random_raw_from(a, ty) if ty in QUANTIZABLE else random_raw(ty, *a.shape, seed=i)
        w.add_tensor(t.name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_files_run_as_stored_through_the_packed_step(tmp_path, mix):
    """Every matrix packed in its file's own type (no fp32), fused products of mixed types kept
    part by part; the C step's logits, token by token, are the forward's on the file
    dequantized (to x's 16-bit fixed point: random K blocks make logits in the hundreds)."""
    from test_packed_step import PROMPT, llama

    from expresslane.bench.llamacpp import write_gguf
    from expresslane.cache import KVCache
    from expresslane.checkpoint import load_model
    from expresslane.step.packed import PackedDecoder
    from expresslane.weights.packing import pack_gguf

    formats = {TYPES[t][0] for t in MIXES[mix].values()}
    if not all(native.available(f) for f in formats):
        pytest.skip("no C kernels for these formats here")
    src = llama(seed=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512, vocab_size=96)  # fmt: skip
    f32 = write_gguf(src, None, tmp_path / "f32.gguf", "F32")
    path = retyped(f32, tmp_path / f"{mix}.gguf", MIXES[mix])
    model, reference = load_model(path, progress=False), load_model(path, progress=False)
    packed = pack_gguf(model, path)
    assert packed.formats == formats
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        want = reference(tokens)[0]
        for c_step in (True, False):  # one C call per layer; the Python layer on the C products
            cache = KVCache(model.cfg, max_len=32)
            cache.static = True
            dec = PackedDecoder(model, cache)
            if not c_step:
                dec.step = None
            got = torch.cat([dec.forward(tokens[0, i : i + 1], torch.tensor([i]))
                             for i in range(len(PROMPT))])  # fmt: skip
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-3 * want.abs().max().item())
