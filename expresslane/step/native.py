"""The AVX-512 decode step (csrc/): whole layers of one-lane models, and products for the rest.

`expresslane._cpu_kernels` is an optional C extension built by `pip install` (pyproject.toml;
no torch headers, so it builds in seconds). Each weight format needs an instruction set, checked
at run time: fp32 and fp16 AVX-512F, bf16 AVX512_BF16, int8 and GGUF's Q8_0 / Q4_1 AVX512_VNNI
(`available(fmt)`).

- `NativeStep`: a one-lane (Llama-family) model's decode step as one C call per layer plus one
  for the head (csrc/cpu_layer.c): the same arithmetic as packed_step.decode_layer, with every
  intermediate in a scratch buffer allocated once. Used by PackedDecoder where it applies
  (`NativeStep.supports`).
  `hidden_tokens` / `head_tokens` run S tokens through the same calls at once (the verify step
  of speculative decoding, packed_verify.py): each weight read once for all S, the bits of S
  single-token steps.
- `cpu_matvec`: the products alone, as the operator `torch.ops.expresslane.cpu_matvec`, which
  the compiled multi-lane step calls in place of quant.matvec.

Why C at all: at batch 1 a CPU core converting weights to fp32 (what inductor generates: one
accumulator per row, the conversion in registers) is bound by that conversion for 16-bit and
int8 weights, and a ~20-op layer costs tens of microseconds in Python; llama.cpp is faster on
both counts. The kernels here read rows front to back with several accumulators and use the
dot-product instructions (vdpbf16ps, vpdpbusd) that torch.compile does not emit. Measured
against llama.cpp in BENCHMARKS.md; compared with the dequantized reference in
tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import os

import torch

from ..cache import KVCache
from ..config import ModelConfig
from ..rope import cos_sin
from ..weights.packing import PackedWeights
from ..weights.quant import QTensor

try:
    from .. import _cpu_kernels as _native
except ImportError:  # not built (no compiler at install time): the compiled Python path runs
    _native = None

MAX_TOKENS = 16  # tokens of one multi-token call (a verify step: k + 1)
CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int8": 3, "q8_0": 4, "q4_1": 5}
NEEDS = {"float32": 1, "float16": 1, "bfloat16": 2, "int8": 4, "q8_0": 4, "q4_1": 4}  # cpu bits
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


# --- the products, as an operator for the compiled step -------------------------------------
# A plain Library kernel, not torch.library.custom_op: the latter's Python wrappers cost ~100 us
# a call, this ~7 us.
_lib = torch.library.Library("expresslane", "DEF")
_lib.define(
    "cpu_matvec(Tensor data, Tensor? scale, Tensor? rowsum, Tensor? mins, Tensor x, str fmt) "
    "-> Tensor"
)


def cpu_matvec(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    rowsum: torch.Tensor | None,
    mins: torch.Tensor | None,
    x: torch.Tensor,
    fmt: str,
) -> torch.Tensor:
    """y (..., N) fp32 = W (..., N, K) @ x (..., K), W stored as `fmt` (QTensor's fields)."""
    data, x = data.contiguous(), x.contiguous().float()
    scale, rowsum, mins = (None if t is None else t.contiguous() for t in (scale, rowsum, mins))
    N, K = data.shape[-2], x.shape[-1]
    y = torch.empty(data.shape[:-1], dtype=torch.float32)
    rc = _native.matvec(
        CODES[fmt], data.data_ptr(), _addr(scale), _addr(rowsum), _addr(mins), x.data_ptr(),
        y.data_ptr(), y.numel() // N, N, K, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cpu_matvec({fmt}): the kernel refused (status {rc})")
    return y


def _fake(data, scale, rowsum, mins, x, fmt):
    return data.new_empty(data.shape[:-1], dtype=torch.float32)


if _native is not None:
    _lib.impl("cpu_matvec", cpu_matvec, "CPU")
    torch.library.register_fake("expresslane::cpu_matvec", _fake, lib=_lib)


def native_matvec(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """quant.matvec through the C kernel (the caller checked `available(w.fmt)`)."""
    return torch.ops.expresslane.cpu_matvec(w.data, w.scale, w.rowsum, w.mins, x, w.fmt)


def native_matmul(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """S tokens at once: W (L, N, K) or (N, K) and x (S, L, K) or (S, K) -> y (S, L, N) or
    (S, N) fp32, each weight row read once for all S, each token's result the bits of
    native_matvec's (csrc/cpu_matmul.c). For the verify step; not an operator (run eagerly)."""
    fields = [None if t is None else t.contiguous() for t in (w.data, w.scale, w.rowsum, w.mins)]
    x = x.contiguous().float()
    N, K, S = fields[0].shape[-2], x.shape[-1], x.shape[0]
    L = x[0].numel() // K
    y = torch.empty((*x.shape[:-1], N), dtype=torch.float32)
    rc = _native.matmul(CODES[w.fmt], *(_addr(t) for t in fields), x.data_ptr(), y.data_ptr(),
                        S, L, N, K, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cpu_matmul({w.fmt}): the kernel refused (status {rc})")
    return y


# --- whole layers of a one-lane model -------------------------------------------------------
class NativeStep:
    """The decode step of a one-lane model in C: `hidden` runs the layers, `head` the rest."""

    @staticmethod
    def supports(cfg: ModelConfig, cache: KVCache, weights: PackedWeights) -> bool:
        return (
            all(available(f) for f in weights.formats)
            and cfg.num_lanes == 1
            and cfg.lm_head_type == "replicate"
            and (cfg.num_heads // cfg.num_kv_heads) * -(-cfg.head_dim // 16) <= 32  # registers
            and all(k.dtype == torch.float32 and k.device.type == "cpu" for k in cache.k)
        )

    def __init__(self, weights: PackedWeights, cfg: ModelConfig, inv_freq: torch.Tensor,
                 cache: KVCache, positions: int):  # fmt: skip
        self.cfg, self.cache, self.weights = cfg, cache, weights
        fields = _native.layer_fields()
        self.keep = []  # every tensor a descriptor points into stays alive with the step
        self.descs = [self._describe(i, w, fields) for i, w in enumerate(weights.layers)]
        F, D = cfg.intermediate_size, cfg.hidden_size
        # every layer's intermediates (the head needs less): allocated once, 64-byte aligned
        size = _native.layer_scratch(D, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, F,
                                     cache.max_len)  # fmt: skip
        self.scratch = torch.empty(size, dtype=torch.uint8)
        self.h = torch.empty(D)
        self.logits = torch.empty(cfg.vocab_size)
        self._tokens_scratch: torch.Tensor | None = None  # the verify step's, at first use
        # RoPE angles of every position a step may write (a multi-step replay runs past the
        # budget): the same fp32 values the model computes on the fly
        table = cos_sin(inv_freq, torch.arange(positions))
        self.cos, self.sin = (t.contiguous() for t in table)  # (positions, hd/2)
        self.head_norm = weights.final_norm.float().contiguous()

    def _describe(self, i: int, w, fields: tuple[str, ...]) -> torch.Tensor:
        cfg, c = self.cfg, self.cache
        t = {
            "attention_norm": w.attention_norm.float().contiguous(),
            "ffn_norm": w.ffn_norm.float().contiguous(),
            "qkv_bias": None if w.bqkv is None else w.bqkv.float().contiguous(),
            "k_cache": c.k[i], "v_cache": c.v[i], "pos_cache": c.pos[i],
        }  # fmt: skip
        sizes = dict(
            dim=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.intermediate_size, cap=c.k[i].shape[0],
            window=cfg.window(i) or 0, rope_half=int(cfg.rope_style == "half"),
        )  # fmt: skip
        for name, q in (("qkv", w.wqkv), ("wo", w.wo), ("w13", w.w13), ("w2", w.w2)):
            sizes[name + "_fmt"] = CODES[q.fmt]
            for suffix, f in (("", q.data), ("_scale", q.scale), ("_rowsum", q.rowsum),
                              ("_mins", q.mins)):  # fmt: skip
                t[name + suffix] = f
        for v in t.values():
            assert v is None or v.is_contiguous(), "packed tensors are contiguous"
        self.keep += [v for v in t.values() if v is not None]
        return torch.tensor([sizes[f] if f in sizes else _addr(t[f]) for f in fields])

    def hidden(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """Writes this token's KV and returns the final residual stream (D,) fp32."""
        self.h.copy_(self.weights.embed.lookup(token.view(1))[0])
        live = self.cache.live if self.cache.live is not None else self.cache.max_len
        row = position * self.cos.shape[1] * 4
        cos, sin = self.cos.data_ptr() + row, self.sin.data_ptr() + row
        h, scratch, eps = self.h.data_ptr(), self.scratch.data_ptr(), self.cfg.norm_eps
        threads = torch.get_num_threads()
        for d in self.descs:
            rc = _native.layer(d.data_ptr(), h, cos, sin, position, live, eps, scratch, threads)
            if rc != 0:
                raise RuntimeError(f"native decode layer refused (status {rc})")
        return self.h

    def hidden_tokens(self, tokens: torch.Tensor, position: int, live: int) -> torch.Tensor:
        """S <= MAX_TOKENS tokens at positions position.. (a verify step) -> their final residual
        streams (S, D) fp32; writes their KV. Attention reads the first min(live, cap) slots
        (live >= position + S). Each row is the bits `hidden` gives for that token alone."""
        S, cfg = tokens.shape[0], self.cfg
        if not 1 <= S <= MAX_TOKENS:
            raise ValueError(f"hidden_tokens: {S} tokens, expected 1..{MAX_TOKENS}")
        h = self.weights.embed.lookup(tokens.view(S)).contiguous()  # (S, D)
        scratch = self._tokens_work()
        row = position * self.cos.shape[1] * 4
        cos, sin = self.cos.data_ptr() + row, self.sin.data_ptr() + row
        threads = torch.get_num_threads()
        for d in self.descs:
            rc = _native.layer(d.data_ptr(), h.data_ptr(), cos, sin, position, live,
                               cfg.norm_eps, scratch.data_ptr(), threads, S)  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"native decode layer refused (status {rc})")
        return h

    def head_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (S, V) for final residual streams h (S, D)."""
        w, cfg, S = self.weights.head, self.cfg, h.shape[0]
        logits = torch.empty(S, cfg.vocab_size)
        best = _native.head(
            CODES[w.fmt], w.data.data_ptr(), _addr(w.scale), _addr(w.rowsum), _addr(w.mins),
            self.head_norm.data_ptr(), h.contiguous().data_ptr(), cfg.vocab_size,
            cfg.hidden_size, cfg.norm_eps, logits.data_ptr(), self._tokens_work().data_ptr(),
            torch.get_num_threads(), S,
        )  # fmt: skip
        if best < 0:
            raise RuntimeError("native head refused")
        return logits

    def _tokens_work(self) -> torch.Tensor:
        if self._tokens_scratch is None:
            cfg = self.cfg
            size = _native.layer_scratch(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                         cfg.head_dim, cfg.intermediate_size,
                                         self.cache.max_len, MAX_TOKENS)  # fmt: skip
            self._tokens_scratch = torch.empty(size, dtype=torch.uint8)
        return self._tokens_scratch

    def head(self, h: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(greedy token, fp32 logits (V,)) for the final residual stream h (D,)."""
        w = self.weights.head
        best = _native.head(
            CODES[w.fmt], w.data.data_ptr(), _addr(w.scale), _addr(w.rowsum), _addr(w.mins),
            self.head_norm.data_ptr(), h.data_ptr(), self.cfg.vocab_size, self.cfg.hidden_size,
            self.cfg.norm_eps, self.logits.data_ptr(), self.scratch.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if best < 0:
            raise RuntimeError("native head refused")
        return best, self.logits
