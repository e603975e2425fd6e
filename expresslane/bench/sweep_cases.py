"""The sweep's cases: one per kernel of a model's fused step, at its real shapes (bench/sweep.py).

A case holds what the sweep needs of one kernel and shape: independent weights (and KV) for
each timed copy, the kernel's launch for S tokens, the launch of token j alone (batch
invariance), the reference (kernels/ref.py), and the bytes one call must move. Attention has a
case per context, since its splits are fixed chunks of the cache. `DRY_DIMS` are the
interpreter-sized shapes of `--dry-run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Dims:
    """The shapes of one model's fused step (lane-major, as the kernels see them)."""

    name: str
    L: int
    D: int
    HQ: int
    HKV: int
    HD: int
    F: int
    V: int
    MAX_LEN: int
    WINDOW: int | None
    mode: str  # the reduce mode of most layers
    head: str  # lm_head_type
    rope: str


def dims_of(model_ref: str, max_len: int = 4096) -> Dims:
    from ..presets import load_model_config

    cfg = load_model_config(model_ref)
    windows = [cfg.window(i) for i in range(cfg.num_layers) if cfg.window(i)]
    modes = [cfg.reduce_mode(i) for i in range(cfg.num_layers)]
    return Dims(model_ref, cfg.num_lanes, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, max_len,
                min(windows[0], max_len) if windows else None, max(set(modes), key=modes.count),
                cfg.lm_head_type, cfg.rope_style)  # fmt: skip


DRY_DIMS = [  # interpreter-sized: 2 lanes and "past"; 1 lane, GQA 4, head_dim 24, "present"
    Dims("dry-laneformer", 2, 64, 4, 2, 16, 96, 64, 48, 16, "past", "vocab_parallel",
         "interleaved"),
    Dims("dry-llama", 1, 48, 4, 1, 24, 64, 50, 48, None, "present", "replicate", "half"),
]  # fmt: skip


@dataclasses.dataclass
class Case:
    kernel: str  # the tuning name
    label: str
    nbytes: int  # bytes one call must move (S = 1)
    make: Callable[[], dict]  # independent weights (and KV) for one copy
    run: Callable[[dict, int], torch.Tensor]  # (copy, S) -> the kernel's output, (S, ...)
    lone: Callable[[dict, int], torch.Tensor]  # (copy, j) -> token j launched alone
    ref: Callable[[dict, int], torch.Tensor]  # (copy, S) -> kernels/ref.py's output


def _attention_case(d: Dims, name: str, cap: int, win: int | None, ctx: int, q: torch.Tensor,
                    dtype: torch.dtype, dev: str, s_max: int) -> Case:  # fmt: skip
    """Attention of s_max new tokens after ctx - 1 cached positions, on a cache of cap slots."""
    from ..kernels import decode_attention as da
    from ..kernels import ref

    pos0 = ctx - 1
    at = torch.tensor([pos0], dtype=torch.int64, device=dev)

    def kv():
        k = torch.randn(cap, d.HKV, d.HD, device=dev).to(dtype)
        held = torch.arange(max(0, pos0 + s_max - cap), pos0 + s_max, device=dev)
        pos = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        pos[held % cap] = held
        return k, k.clone(), pos

    def lone(p, j):
        k, v, pos = p["kv"]
        pos = torch.where(pos > pos0 + j, -1, pos)  # later tokens not yet written
        return da.decode_attention(q[j], k, v, pos, at + j, window=win)

    e = torch.empty((), dtype=dtype).element_size()
    return Case("attention", f"{name} ctx {ctx} Hq{d.HQ}/Hkv{d.HKV} hd{d.HD}",
                2 * min(ctx, cap) * d.HKV * d.HD * e, lambda: {"kv": kv()},
                lambda p, n: da.decode_attention(q[:n], *p["kv"], at, window=win), lone,
                lambda p, n: ref.decode_attention(q[:n], *p["kv"], at, window=win))  # fmt: skip


def cases(d: Dims, context: int, dtype: torch.dtype, dev: str, s_max: int,
          attn_contexts: list[int]) -> list[Case]:  # fmt: skip
    """One case per kernel of the step at the context (attention at each of attn_contexts);
    inputs for up to s_max tokens."""
    from ..kernels import gemv_reduce as gr
    from ..kernels import lm_head, norm_qkv, ref, swiglu

    L, D, hd, FL = d.L, d.D, d.HD, d.F // d.L
    QL, KL = d.HQ * hd // L, d.HKV * hd // L
    e = torch.empty((), dtype=dtype).element_size()
    pos0 = context - 1

    def w(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dtype)

    def kv(cap):  # the positions before pos0, the S new ones written as norm_qkv would
        k = torch.randn(cap, d.HKV, hd, device=dev).to(dtype)
        held = torch.arange(max(0, pos0 + s_max - cap), pos0 + s_max, device=dev)
        pos = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        pos[held % cap] = held
        return k, k.clone(), pos

    # made before any capture: a host-to-device copy cannot be captured
    wheres = [torch.tensor([pos0 + j], dtype=torch.int64, device=dev) for j in range(s_max)]

    x = torch.randn(s_max, L, D, device=dev).to(dtype)
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(dtype)
    ang = torch.arange(pos0 + s_max, device=dev)[:, None] * (
        10000.0 ** (-torch.arange(0, hd, 2, device=dev) / hd))[None, :]  # fmt: skip
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    q = torch.randn(s_max, d.HQ, hd, device=dev).to(dtype)
    ring = d.WINDOW + s_max - 1 if d.WINDOW else None
    out: list[Case] = []

    def qkv(p, xs, where):  # a fresh copy of the cache each call: writes must not accumulate
        cache = [t.clone() for t in p["kv"]]
        return norm_qkv.norm_qkv(xs, nw, p["wq"], p["wk"], p["wv"], cos, sin, where, *cache,
                                 rope_style=d.rope), cache  # fmt: skip

    def qkv_ref(p, n):
        cache = [t.clone() for t in p["kv"]]
        return ref.norm_qkv(x[:n], nw, p["wq"], p["wk"], p["wv"], cos, sin, wheres[0], *cache,
                            rope_style=d.rope)  # fmt: skip

    out.append(Case("norm_qkv", f"L{L} ({QL}+2x{KL}) x {D}", L * (QL + 2 * KL) * D * e,
                    lambda: {"wq": w(L, QL, D), "wk": w(L, KL, D), "wv": w(L, KL, D),
                             "kv": kv(ring or d.MAX_LEN)},
                    lambda p, n: qkv(p, x[:n], wheres[0])[0],
                    lambda p, j: qkv(p, x[j], wheres[j])[0], qkv_ref))  # fmt: skip
    for ctx in attn_contexts:  # splits are fixed cache chunks: time short and long contexts
        for name, cap, win in (("full", d.MAX_LEN, None), ("sliding", ring, d.WINDOW)):
            if cap is not None:
                out.append(_attention_case(d, name, cap, win, ctx, q, dtype, dev, s_max))
    r = torch.randn(s_max, L, D, device=dev).to(dtype)
    past = r.flip(0).contiguous() if d.mode == "past" else None
    for name, k_in in (("wo", QL), ("w2", FL)):
        a = torch.randn(s_max, L, k_in, device=dev).to(dtype)

        def proj(p, n, fn, a=a):
            return fn(a[:n], p["w"], r[:n], None if past is None else past[:n], mode=d.mode)[0]

        out.append(Case(f"gemv_reduce_{d.mode}", f"{name} {d.mode} L{L} {D} x {k_in}",
                        L * D * k_in * e, lambda k_in=k_in: {"w": w(L, D, k_in)},
                        lambda p, n, proj=proj: proj(p, n, gr.gemv_reduce),
                        lambda p, j, a=a: gr.gemv_reduce(
                            a[j], p["w"], r[j], None if past is None else past[j], mode=d.mode)[0],
                        lambda p, n, proj=proj: proj(p, n, ref.gemv_reduce)))  # fmt: skip
    out.append(Case("norm_swiglu", f"L{L} 2x{FL} x {D}", 2 * L * FL * D * e,
                    lambda: {"w1": w(L, FL, D), "w3": w(L, FL, D)},
                    lambda p, n: swiglu.norm_swiglu(x[:n], nw, p["w1"], p["w3"]),
                    lambda p, j: swiglu.norm_swiglu(x[j], nw, p["w1"], p["w3"]),
                    lambda p, n: ref.norm_swiglu(x[:n], nw, p["w1"], p["w3"])))  # fmt: skip
    shape = {"vocab_parallel": (L, d.V // L, D), "lane": (d.V, L * D)}.get(d.head, (d.V, D))
    kw = dict(head_type=d.head)
    out.append(Case("lm_head", f"{d.head} {'x'.join(map(str, shape))}",
                    d.V * (shape[-1] if d.head != "lane" else L * D) * e,
                    lambda: {"w": w(*shape)},
                    lambda p, n: lm_head.lm_head_logits(x[:n], nw, p["w"], **kw),
                    lambda p, j: lm_head.lm_head_logits(x[j], nw, p["w"], **kw),
                    lambda p, n: ref.lm_head_logits(x[:n], nw, p["w"], **kw)))  # fmt: skip
    return out
