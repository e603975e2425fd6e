"""The decode step on packed weights: one token through every layer and the head, in fp32.

The CPU twin of the fused GPU step (fused.py), with the same interface (`next_token`, `logits`)
so that DecodeGraph runs either. Per layer (`decode_layer`): RMSNorm, one Q/K/V product, RoPE,
the KV-cache write, attention over the live cache slots only, one output product and the DTP
reduce, RMSNorm, one gate/up product, SiLU(gate) * up, one down product and the reduce
(packing.py builds the weights, quant.py computes the products). Activations, RoPE, softmax
and reduces are fp32 whatever the weights' format; the cache keeps its own dtype.

Compiled (`compile=True`), `decode_layer` and `head` are each compiled once by inductor and
called for every layer: the layers differ only in their tensors, which are arguments, so a
30-layer model compiles one layer's graph (plus one per sliding-window or reduce variant), not
30. Inductor fuses each product with the conversion of its weights and the small ops around it
into a few C++ loops. Run eagerly it is the same arithmetic; the model's own forward on the same
packed storage is its reference.

Live slots: the cache's `live` bound (set by DecodeGraph from the host's position count) limits
every layer's scan to min(live, cap) slots, passed as the length of a (live,) tensor whose size
is a dynamic dimension (one compilation for every context length); `pos` masks the rest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..config import ModelConfig, SamplingParams
from ..kernels.ref import _head_input
from ..model import Laneformer
from ..rope import apply_rope, cos_sin
from ..sampler import SamplerKnobs, sample
from ..weights.packing import pack_model
from ..weights.quant import QTensor, matvec
from .fused import MAX_OVERRUN
from .native import NativeStep, available, native_matvec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm of x (..., D) with a shared (D,) or per-lane (L, D) scale."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def reduce(y: torch.Tensor, mode: str, past: torch.Tensor | None) -> torch.Tensor:
    """What a module adds to each lane's residual (laneformer-spec 6.2); y, past (..., L, D)
    fp32 (a verify step puts a token axis in front)."""
    if mode == "present":
        return y.sum(-2, keepdim=True).expand_as(y)
    if mode == "no_reduce":
        return y * math.sqrt(y.shape[-2])
    if past is None:
        return y
    return y + (past.sum(-2, keepdim=True) - past)


def attend_live(q, k_cache, v_cache, pos_cache, position, n, window: int | None):
    """q (Hq, hd) fp32 over the first n slots of the cache -> (Hq, hd) fp32 (GQA)."""
    n_kv, hd = k_cache.shape[1], k_cache.shape[2]
    k, v, pos = k_cache[:n].float(), v_cache[:n].float(), pos_cache[:n]  # (n, Hkv, hd), (n,)
    valid = (pos >= 0) & (pos <= position)  # empty slots and the future
    if window is not None:
        valid &= pos > position - window
    qg = q.view(n_kv, -1, hd)  # (Hkv, G, hd)
    scores = torch.einsum("hgd,nhd->hgn", qg, k) * hd**-0.5
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    return torch.einsum("hgn,nhd->hgd", probs, v).reshape(-1, hd)


def product(w: QTensor, x: torch.Tensor, native: bool) -> torch.Tensor:
    """W @ x in fp32: the AVX-512 kernel (cpu_matvec.py) or quant.matvec (inductor / eager)."""
    return native_matvec(w, x) if native else matvec(w, x)


def decode_layer(
    h, w, kc, vc, pc, position, cos, sin, span, past_a, past_m,
    *, native, heads, kv_heads, head_dim, eps, rope_style, window, mode,
):  # fmt: skip
    """One layer for one token: h (L, D) fp32 -> (h, attention partials a, MLP partials m).

    `w` is the layer's tensors (`PackedDecoder.layer_tensors`: norms, biases and each matrix's
    QTensor fields, its format first); kc/vc/pc its cache; span (live,) bounds the slots read.
    Keyword arguments are constants (one compilation per distinct set).
    """
    attention_norm, qkv, bqkv, wo, ffn_norm, w13, w2 = w
    L = h.shape[0]
    xn = rms_norm(h, attention_norm, eps)
    qkv = product(QTensor(*qkv), xn, native)  # (L, (Hq + 2 Hkv) hd / L)
    if bqkv is not None:
        qkv = qkv + bqkv
    lq, lkv = heads * head_dim // L, kv_heads * head_dim // L
    q = qkv[:, :lq].reshape(1, heads, head_dim)  # lane l owns heads l*Hq/L ...
    k = qkv[:, lq : lq + lkv].reshape(1, kv_heads, head_dim)
    v = qkv[:, lq + lkv :].reshape(1, kv_heads, head_dim)
    q, k = apply_rope(q, cos, sin, rope_style), apply_rope(k, cos, sin, rope_style)
    slot = position % kc.shape[0]  # ring layers wrap
    kc.index_copy_(0, slot, k.to(kc.dtype))
    vc.index_copy_(0, slot, v.to(vc.dtype))
    pc.index_copy_(0, slot, position)
    n = min(span.shape[0], kc.shape[0])
    o = attend_live(q[0], kc, vc, pc, position, n, window)  # (Hq, hd)
    a = product(QTensor(*wo), o.reshape(L, -1), native)  # (L, D)
    h = h + reduce(a, mode, past_a)
    gu = product(QTensor(*w13), rms_norm(h, ffn_norm, eps), native)  # (L, 2F/L)
    f = gu.shape[-1] // 2
    m = product(QTensor(*w2), F.silu(gu[:, :f]) * gu[:, f:], native)  # (L, D)
    h = h + reduce(m, mode, past_m)
    return h, a, m


def head(h, norm, w, *, native, head_type, eps, pre_norm_lane_agg, greedy):
    """Final norm and LM head: fp32 logits (V,), or with `greedy` their argmax (0-d)."""
    x = _head_input(h, norm.float(), head_type, eps, pre_norm_lane_agg)
    logits = product(QTensor(*w), x, native).reshape(-1)  # vocab_parallel: lane order
    return torch.argmax(logits) if greedy else logits


def _parts(q: QTensor) -> tuple:
    return q.flat


class PackedDecoder:
    def __init__(
        self,
        model: Laneformer,
        cache: KVCache,
        compile: bool = False,
        native: bool | None = None,
    ):
        self.cfg: ModelConfig = model.cfg
        self.cache = cache
        self.weights = pack_model(model)  # the model's own packing, or its dtype
        self.inv_freq = model.inv_freq
        # the C kernels where built and supported (default), else quant.matvec; a one-lane
        # model then runs each layer as one C call (NativeStep), nothing to compile
        fmts = self.weights.formats
        self.native = all(available(f) for f in fmts) if native is None else native
        self.step = None
        if self.native and NativeStep.supports(self.cfg, cache, self.weights):
            positions = cache.max_len + MAX_OVERRUN
            self.step = NativeStep(self.weights, self.cfg, model.inv_freq, cache, positions)
        self.layer_tensors = [
            (w.attention_norm, _parts(w.wqkv), w.bqkv, _parts(w.wo), w.ffn_norm, _parts(w.w13),
             _parts(w.w2))
            for w in self.weights.layers
        ]  # fmt: skip
        self.compiled = compile and self.step is None
        self._layer = torch.compile(decode_layer, dynamic=False) if self.compiled else decode_layer
        self._head = torch.compile(head, dynamic=False) if self.compiled else head
        self._span = torch.arange(cache.max_len, device=cache.k[0].device)
        self._marked = False

    def _live_span(self) -> torch.Tensor:
        live = self.cache.live if self.cache.live is not None else self.cache.max_len
        span = self._span[: max(2, live)]  # sizes 0 and 1 would be specialised
        if self.compiled and not self._marked:
            torch._dynamo.mark_dynamic(span, 0)
            self._marked = True
        return span

    def hidden(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """token (1, 1), position (1,) -> final residual stream (L, D) fp32; writes the KV."""
        if self.step is not None:
            return self.step.hidden(token.view(1), int(position))  # (1, D)
        cfg, cache = self.cfg, self.cache
        h = self.weights.embed.lookup(token.view(1)).expand(cfg.num_lanes, -1)  # (L, D)
        cos, sin = cos_sin(self.inv_freq, position)  # (1, hd/2), as the model computes them
        span = self._live_span()
        past_a: list[torch.Tensor | None] = [None] * cfg.num_layers
        past_m: list[torch.Tensor | None] = [None] * cfg.num_layers
        for i, w in enumerate(self.layer_tensors):
            src = cfg.past_source(i)
            pa, pm = (None, None) if src is None else (past_a[src], past_m[src])
            h, a, m = self._layer(
                h, w, cache.k[i], cache.v[i], cache.pos[i], position, cos, sin, span, pa, pm,
                native=self.native, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.norm_eps, rope_style=cfg.rope_style,
                window=cfg.window(i), mode=cfg.reduce_mode(i),
            )  # fmt: skip
            if cfg.broadcasts(i):
                past_a[i], past_m[i] = a, m
        return h

    def _run_head(self, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        cfg, wt = self.cfg, self.weights
        return self._head(
            h, wt.final_norm, _parts(wt.head), native=self.native,
            head_type=cfg.lm_head_type, eps=cfg.norm_eps,
            pre_norm_lane_agg=cfg.pre_norm_lane_agg, greedy=greedy,
        )  # fmt: skip

    def logits(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """fp32 logits (V,) for the token at `position`."""
        h = self.hidden(token, position)
        if self.step is not None:
            return self.step.head(h)[1][0].clone()
        return self._run_head(h, greedy=False)

    def next_token(
        self,
        token: torch.Tensor,
        position: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        knobs: SamplerKnobs | None = None,
    ) -> torch.Tensor:
        """The sampled next token, a 0-d tensor (greedy: the logits' argmax, in the head)."""
        h = self.hidden(token, position)
        if self.step is not None:
            best, logits = self.step.head(h)
            if params.greedy:
                return torch.tensor(best)
            return sample(logits[0], params, generator, knobs)
        if params.greedy:
            return self._run_head(h, greedy=True)
        return sample(self._run_head(h, greedy=False), params, generator, knobs)
