"""The C decode step (csrc/): whole layers of one-lane models, and products for the rest.

`expresslane._cpu_kernels` is an optional C extension built by `pip install` (pyproject.toml;
no torch headers), for AVX-512; `_cpu_kernels_avx2` is the same source built for AVX2 (csrc/
simd_avx2.h), which runs where AVX-512 does not (`_kernels`). Each weight format needs an
instruction set, checked at run time: in the AVX-512 build fp32 and fp16 AVX-512F, bf16
AVX512_BF16, int8 and the GGUF block formats (quant.GGUF_FORMATS) AVX512_VNNI; in the AVX2 build,
AVX2 with FMA and F16C (`available(fmt)`).

- `NativeStep`: a one-lane (Llama-family) model's step as one C call per layer plus one for the
  head (csrc/cpu_layer.c), for S tokens at positions position..: S = 1 is a decode step, S = k + 1
  the verify step of speculative decoding. The same arithmetic as packed.layer (qwen3's q/k
  norms included), with every intermediate in a scratch buffer allocated once. Each weight is
  read once for all S, and a token's row has the same bits whatever S (the one-token product is
  the S = 1 case of the same kernels, csrc/cpu_matmul.c). Used by PackedDecoder where it applies
  (`NativeStep.supports`).
- `native_dequantize`: a block-format matrix's values (fp32 or bf16) for a long prefill's GEMM.
- `lowp_activations`: what x is to the products with `lowp` (a prompt at llama.cpp's precision),
  their reference.
- `native_matmul`: the products alone; `cpu_matvec`, the one-token case as the operator
  `torch.ops.expresslane.cpu_matvec`, which the compiled multi-lane step calls in place of
  quant.matvec.

Why C at all: at batch 1 a CPU core converting weights to fp32 (what inductor generates: one
accumulator per row, the conversion in registers) is bound by that conversion for 16-bit and
int8 weights, and a ~20-op layer costs tens of microseconds in Python; llama.cpp is faster on
both counts. The kernels here read rows front to back with several accumulators and use the
dot-product instructions (vdpbf16ps, vpdpbusd) that torch.compile does not emit. Measured
against llama.cpp in BENCHMARKS.md; compared with the dequantized reference in
tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import importlib
import os

import torch

from ..cache import KVCache
from ..config import ModelConfig
from ..rope import cos_sin
from ..weights.packing import PackedWeights
from ..weights.quant import GGUF_FORMATS, QTensor

# EXPRESSLANE_CPU_KERNELS=avx2 takes the AVX2 build where AVX-512 runs too (to compare the two:
# tests/test_cpu_avx2.py); =0 turns the C kernels off (below)
BUILDS = {"": ("_cpu_kernels", "_cpu_kernels_avx2"), "avx2": ("_cpu_kernels_avx2",)}


def _kernels():
    """The AVX-512 build where this CPU has all its sets (AVX-512F, BF16, VNNI); else the same
    kernels built for AVX2 (csrc/simd_avx2.h: AVX-512's operations on two 256-bit halves, the
    same bits), which run every format; else what the AVX-512 build runs here; None where
    neither runs (not built: no compiler at install time; no AVX2): the compiled Python path."""
    found = []
    for name in BUILDS.get(os.environ.get("EXPRESSLANE_CPU_KERNELS", ""), BUILDS[""]):
        try:
            found.append(importlib.import_module(f"..{name}", __package__))
        except ImportError:
            continue
    every = 7  # csrc/cpu_kernels.h: HAS_AVX512 | HAS_BF16 | HAS_VNNI
    ranked = sorted(found, key=lambda m: -bin(m.features() & every).count("1"))  # stable
    return ranked[0] if ranked and ranked[0].features() else None


_native = _kernels()

DEQUANT_DTYPES = (torch.float32, torch.bfloat16)  # what csrc's el_dequant writes
# the cache types cpu_layer.c reads and writes (its kv_dtype codes; --kv-cache-dtype)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# formats whose products can take x at llama.cpp's precision (csrc/cpu_kernels.h's lowp): GGUF's
# block formats (8 bits a value, a scale per 32-value block) and bf16 (x rounded to bf16)
LOWP_FORMATS = frozenset({*GGUF_FORMATS, "bfloat16"})
MAX_TOKENS = 40  # tokens of one call: a verify step (k + 1), a prefill chunk (cpu_matmul.c: 8 x 5)
# csrc/cpu_kernels.h's FMT_* codes, and the feature bits (HAS_*) each format needs
CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3, "q8_0": 4, "q4_1": 5, "q4_0": 6,
         "q5_0": 7, "q5_1": 8, "q4_k": 9, "q5_k": 10, "q6_k": 11, "iq4_nl": 12, "iq4_xs": 13,
         "q3_k": 14, "q2_k": 15, "iq3_s": 16, "iq3_xxs": 17, "iq2_xxs": 18, "iq1_s": 19,
         "iq2_xs": 20, "iq2_s": 21, "iq1_m": 22, "mxfp4": 23, "nvfp4": 24, "q1_0": 25}  # fmt: skip
NEEDS = {f: 1 if f in ("float32", "float16") else 2 if f == "bfloat16" else 4 for f in CODES}
# HAS_AMX: the bf16 and int8 products run in AMX tiles (csrc/cpu_amx.c; EXPRESSLANE_AMX=0: not;
# EXPRESSLANE_AMX=emulate: their instructions in C, csrc/cpu_amx_emulate.h, for tests)
HAS_AMX = 8
# EXPRESSLANE_CPU_KERNELS=0 turns the C kernels off (the compiled Python step then runs): to
# compare the two, or to rule the extension out when something looks wrong.
ENABLED = os.environ.get("EXPRESSLANE_CPU_KERNELS", "1") != "0"
FEATURES = _native.features() if _native is not None and ENABLED else 0


def native_step_built() -> bool:
    """True when the C step can run here at all (built, AVX-512): the CLI then decodes on CPUs
    through the packed step by default (no compilation needed)."""
    return available("float32")


def available(fmt: str) -> bool:
    """True when the C kernels for `fmt` are built and this CPU has their instructions."""
    return fmt in NEEDS and FEATURES & NEEDS[fmt] == NEEDS[fmt]


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _matrix(w: QTensor) -> list[int]:
    """A matrix as the C side takes it: its format code and the six addresses of a qmat_t."""
    return [CODES[w.fmt], *(_addr(t) for t in (w.data, w.scale, w.rowsum, w.mins, w.high, w.sub))]


# csrc/cpu_kernels.h's flags for a product's or a layer's last argument: x at llama.cpp's
# precision; a prompt's chunk (Q8_0's and most nibble formats' blocks then in AMX tiles where the
# CPU has them: not a decode's bits)
EL_LOWP, EL_PROMPT = 1, 2


def _flags(lowp: bool, prompt: bool) -> int:
    return (EL_LOWP if lowp else 0) | (EL_PROMPT if prompt else 0)


def _matmul(w: QTensor, x: torch.Tensor, S: int, flags: int = 0) -> torch.Tensor:
    """S tokens: W (L, N, K) or (N, K) and x (S, L, K) or (S, K) -> (S, L, N) or (S, N)."""
    x = x.contiguous().float()
    N, K = w.data.shape[-2], x.shape[-1]
    L = x.numel() // (S * K)
    y = torch.empty((*x.shape[:-1], N), dtype=torch.float32)
    rc = _native.matmul(*_matrix(w), x.data_ptr(), y.data_ptr(), S, L, N, K,
                        torch.get_num_threads(), flags)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cpu_matmul({w.fmt}): the kernel refused (status {rc})")
    return y


# --- the one-token product, as an operator for the compiled step ----------------------------
# A plain Library kernel, not torch.library.custom_op: the latter's Python wrappers cost ~100 us
# a call, this ~7 us.
_lib = torch.library.Library("expresslane", "DEF")
_lib.define(
    "cpu_matvec(Tensor data, Tensor? scale, Tensor? rowsum, Tensor? mins, Tensor? high, "
    "Tensor? sub, Tensor x, str fmt) -> Tensor"
)


def cpu_matvec(data, scale, rowsum, mins, high, sub, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """y (..., N) fp32 = W (..., N, K) @ x (..., K), W stored as `fmt` (QTensor's fields)."""
    fields = (None if t is None else t.contiguous() for t in (data, scale, rowsum, mins, high, sub))
    return _matmul(QTensor(fmt, *fields), x.unsqueeze(0), 1)[0]


def _fake(data, scale, rowsum, mins, high, sub, x, fmt):
    return data.new_empty(data.shape[:-1], dtype=torch.float32)


if _native is not None:
    _lib.impl("cpu_matvec", cpu_matvec, "CPU")
    torch.library.register_fake("expresslane::cpu_matvec", _fake, lib=_lib)


def native_matvec(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """quant.matvec through the C kernel (the caller checked `available(w.fmt)`)."""
    if w.stack is not None:
        return torch.cat([native_matvec(p, x) for p in w.stack], dim=-1)
    return torch.ops.expresslane.cpu_matvec(w.data, w.scale, w.rowsum, w.mins, w.high, w.sub, x,
                                            w.fmt)  # fmt: skip


def native_matmul(w: QTensor, x: torch.Tensor, lowp: bool = False, prompt: bool = False
                  ) -> torch.Tensor:  # fmt: skip
    """S tokens at once: W (L, N, K) or (N, K) and x (S, L, K) or (S, K) -> y (S, L, N) or
    (S, N) fp32, each weight row read once for all S, each token's result the bits of
    native_matvec's (csrc/cpu_matmul.c). For the verify step; not an operator (run eagerly).
    lowp: LOWP_FORMATS take x at llama.cpp's precision (a prompt's opt-in): still a row's bits
    whatever S, but not native_matvec's. prompt: a prompt's chunk (EL_PROMPT), whose bits need
    not be a decode step's."""
    if w.stack is not None:
        return torch.cat([native_matmul(p, x, lowp, prompt) for p in w.stack], dim=-1)
    return _matmul(QTensor(w.fmt, *(None if t is None else t.contiguous() for t in w.parts)),
                   x, x.shape[0], _flags(lowp, prompt))  # fmt: skip


def lowp_activations(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference of `lowp`: x (..., K) fp32 as a product in `fmt` takes it with x at
    llama.cpp's precision, so that native_matmul(w, x, lowp=True) is w's values times this to
    fp32's rounding. Block formats: per 32-value block q = round(x / s), s = max |x| / 127 (1 for
    zeros), |q| <= 127, back to s q (csrc/cpu_activations.c block8); bf16: x rounded to bf16;
    the others: x itself."""
    if fmt == "bfloat16":
        return x.bfloat16().float()
    if fmt not in GGUF_FORMATS:
        return x
    xb = x.reshape(*x.shape[:-1], -1, 32)  # (..., K / 32, 32)
    a = xb.abs().amax(-1, keepdim=True)
    s = torch.where(a > 0, a / 127, torch.ones_like(a))
    return (torch.round(xb * (1 / s)).clamp(-127, 127) * s).reshape(x.shape)


def native_dequantize(w: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w.dequantize() (fp32), or its round to bf16, for the GGUF block formats through the C
    decoder (csrc/cpu_nibble.c: the products' own group loader, several times the speed of the
    reference's tensor operations); other formats, or without AVX512_VNNI, the reference."""
    if w.stack is not None:
        return torch.cat([native_dequantize(p, dtype) for p in w.stack], dim=-2)
    if w.fmt not in GGUF_FORMATS or not available(w.fmt) or dtype not in DEQUANT_DTYPES:
        return w.dequantize().to(dtype)
    out = torch.empty(w.shape, dtype=dtype)
    K = w.shape[-1]
    q = QTensor(w.fmt, *(None if t is None else t.contiguous() for t in w.parts))
    rc = _native.dequant(*_matrix(q), out.data_ptr(), out.numel() // K, K,
                         int(dtype == torch.bfloat16), torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cpu_dequant({w.fmt}, K={K}): the decoder refused (status {rc})")
    return out


# --- whole layers of a one-lane model -------------------------------------------------------
SUFFIXES = ("", "_scale", "_rowsum", "_mins", "_high", "_sub")  # a matrix's descriptor entries


class NativeStep:
    """The step of a one-lane model in C for S tokens: `hidden` runs the layers, `head` the rest."""

    @staticmethod
    def supports(cfg: ModelConfig, cache: KVCache, weights: PackedWeights) -> bool:
        return (
            all(available(f) for f in weights.formats)
            and cfg.num_lanes == 1
            and cfg.lm_head_type == "replicate"
            and (cfg.num_heads // cfg.num_kv_heads) * -(-cfg.head_dim // 16) <= 32  # registers
            and all(k.dtype in KV_DTYPES and k.device.type == "cpu" for k in cache.k)
        )

    def __init__(self, weights: PackedWeights, cfg: ModelConfig, inv_freq: torch.Tensor,
                 cache: KVCache, positions: int):  # fmt: skip
        self.cfg, self.cache, self.weights = cfg, cache, weights
        fields = _native.layer_fields()
        self.keep = []  # every tensor a descriptor points into stays alive with the step
        self.descs = [self._describe(i, w, fields) for i, w in enumerate(weights.layers)]
        # every layer's intermediates for up to MAX_TOKENS tokens (the head needs less):
        # allocated once, 64-byte aligned; a call for S tokens uses its first part
        size = _native.layer_scratch(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                     cfg.head_dim, cfg.intermediate_size, cache.max_len,
                                     MAX_TOKENS)  # fmt: skip
        self.scratch = torch.empty(size, dtype=torch.uint8)
        self.logits = torch.empty(MAX_TOKENS, cfg.vocab_size)
        # RoPE angles of every position a step may write (a multi-step replay runs past the
        # budget): the same fp32 values the model computes on the fly
        table = cos_sin(inv_freq, torch.arange(positions))
        self.cos, self.sin = (t.contiguous() for t in table)  # (positions, hd/2)
        self.head_norm = weights.final_norm.float().contiguous()
        self.head_matrix = _matrix(weights.head)

    def _describe(self, i: int, w, fields: tuple[str, ...]) -> torch.Tensor:
        cfg, c = self.cfg, self.cache
        t = {
            "attention_norm": w.attention_norm.float().contiguous(),
            "ffn_norm": w.ffn_norm.float().contiguous(),
            "qkv_bias": None if w.bqkv is None else w.bqkv.float().contiguous(),
            "q_norm": None if w.q_norm is None else w.q_norm.float().contiguous(),
            "k_norm": None if w.k_norm is None else w.k_norm.float().contiguous(),
            "k_cache": c.k[i], "v_cache": c.v[i], "pos_cache": c.pos[i],
        }  # fmt: skip
        sizes = dict(
            dim=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.intermediate_size, cap=c.k[i].shape[0],
            window=cfg.window(i) or 0, rope_half=int(cfg.rope_style == "half"),
            kv_dtype=KV_DTYPES[c.k[i].dtype],
        )  # fmt: skip
        for name, m in (("qkv", w.wqkv), ("wo", w.wo), ("w13", w.w13), ("w2", w.w2)):
            pieces = m.pieces  # up to three row ranges, each in its own format
            assert len(pieces) <= 3, f"{name}: {len(pieces)} formats in one product"
            for j in range(3):
                part = name + ("", "_1", "_2")[j]
                q = pieces[j] if j < len(pieces) else None
                sizes[part + "_fmt"] = CODES[q.fmt] if q is not None else 0
                sizes[part + "_rows"] = q.shape[-2] if q is not None else 0
                fields_ = q.parts if q is not None else (None,) * 6
                for suffix, f in zip(SUFFIXES, fields_, strict=True):
                    t[part + suffix] = f
        for v in t.values():
            assert v is None or v.is_contiguous(), "packed tensors are contiguous"
        self.keep += [v for v in t.values() if v is not None]
        return torch.tensor([sizes[f] if f in sizes else _addr(t[f]) for f in fields])

    def hidden(self, tokens: torch.Tensor, position: int, live: int | None = None,
               lowp: bool = False, prompt: bool = False) -> torch.Tensor:  # fmt: skip
        """S <= MAX_TOKENS tokens at positions position.. -> their final residual streams (S, D)
        fp32; writes their KV. Attention reads the first min(live, cap) slots (default: the
        cache's live bound; a verify step passes position + S). lowp: LOWP_FORMATS' products
        take x at llama.cpp's precision (a prompt's opt-in, --prefill-dtype). prompt: the
        tokens are a prompt's chunk, whose bits need not be a decode step's (EL_PROMPT)."""
        S = tokens.numel()
        if not 1 <= S <= MAX_TOKENS:
            raise ValueError(f"NativeStep.hidden: {S} tokens, expected 1..{MAX_TOKENS}")
        if live is None:
            live = self.cache.live if self.cache.live is not None else self.cache.max_len
        h = self.weights.embed.lookup(tokens.view(S)).contiguous()  # (S, D)
        row = position * self.cos.shape[1] * 4
        cos, sin = self.cos.data_ptr() + row, self.sin.data_ptr() + row
        scratch, eps, threads = self.scratch.data_ptr(), self.cfg.norm_eps, torch.get_num_threads()
        flags = _flags(lowp, prompt)
        for d in self.descs:
            rc = _native.layer(d.data_ptr(), h.data_ptr(), cos, sin, position, live, eps,
                               scratch, threads, S, flags)  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"native decode layer refused (status {rc})")
        return h

    def head(self, h: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(greedy token after the last row, fp32 logits (S, V)) for final residual streams
        h (S, D). The logits are a view of a buffer the next call overwrites."""
        cfg, S = self.cfg, h.shape[0]
        best = _native.head(
            *self.head_matrix, self.head_norm.data_ptr(), h.contiguous().data_ptr(),
            cfg.vocab_size, cfg.hidden_size, cfg.norm_eps, self.logits.data_ptr(),
            self.scratch.data_ptr(), torch.get_num_threads(), S,
        )  # fmt: skip
        if best < 0:
            raise RuntimeError("native head refused")
        return best, self.logits[:S]
