"""The packed CPU step: S >= 1 tokens through every layer and the head on packed weights, fp32.

One layer, one attention and one head with a token axis serve decode (S = 1) and the verify
step of speculative decoding (S = k + 1). Per layer (`layer`): RMSNorm, one Q/K/V product,
qwen3's RMSNorm of each query and key head where the model has one, RoPE, every new key and
value written to the cache, attention over the live cache slots, one output product and the
DTP reduce, RMSNorm, one gate/up product, SiLU(gate) * up, one down product and the reduce
(packing.py builds the weights, quant.py computes the products).
Activations, RoPE, softmax and reduces are fp32 whatever the weights' format.

Rows are independent of S: products go row by row (`quant.matvec`) or through the C kernels,
whose S-token product gives each row the bits of the one-token product (csrc/cpu_matmul.c);
each query attends alone; the rest is elementwise or reduces within a row. So a verify's rows
are the bits of S decode steps, and greedy speculation is plain greedy decoding exactly.

Backends, chosen at construction:
- one-lane (Llama-family) models with the C extension: `NativeStep` (native.py), one C call per
  layer and one for the head, S tokens per call (up to MAX_TOKENS, longer inputs in chunks);
- otherwise this file's Python layer, with the C products where built (lanes), else
  quant.matvec. Compiled (`compile=True`), the one-token layer and head are each compiled once
  by inductor and called for every layer (the layers differ only in their tensors, which are
  arguments); a verify then runs its rows as single compiled steps, one after another (exact,
  as each is a decode step; S > 1 would need its own compilation).

Each query sees the slots of positions up to its own (masked by position, so causal among the
new tokens). On a ring that is right only while the slots written hold no key the first query
still sees: rings get k slots of headroom from the engine (cache.py). Live slots: the cache's
`live` bound (set by DecodeGraph from the host's position count) limits every scan to
min(live, cap) slots, passed as the length of a (live,) tensor whose size is a dynamic dimension
when compiled (one compilation for every context length).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..config import ModelConfig
from ..kernels.ref import _head_input
from ..model import Laneformer, Partials
from ..rope import apply_rope, cos_sin
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, argmax, sample
from ..weights.packing import pack_model
from ..weights.quant import QTensor, matvec
from .fused import MAX_OVERRUN
from .native import MAX_TOKENS, NativeStep, available, native_matmul, native_matvec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm of x (..., D) with a shared (D,) or per-lane (L, D) scale."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def reduce(y: torch.Tensor, mode: str, past: torch.Tensor | None) -> torch.Tensor:
    """What a module adds to each lane's residual (laneformer-spec 6.2); y, past (S, L, D)."""
    if mode == "present":
        return y.sum(-2, keepdim=True).expand_as(y)
    if mode == "no_reduce":
        return y * math.sqrt(y.shape[-2])
    if past is None:
        return y
    return y + (past.sum(-2, keepdim=True) - past)


def product(w: QTensor, x: torch.Tensor, native: bool) -> torch.Tensor:
    """W @ x for S tokens in fp32, x (S, ..., K) -> (S, ..., N), each row as if alone: the C
    kernels (one read of each weight row for all S), else quant.matvec row by row."""
    if native:
        return native_matvec(w, x[0])[None] if x.shape[0] == 1 else native_matmul(w, x)
    return torch.stack([matvec(w, row) for row in x])


def attend(q, k_cache, v_cache, pos_cache, position, n, window: int | None):
    """One query q (Hq, hd) fp32 at `position` (0-d or (1,)) over the first n slots -> (Hq, hd)."""
    n_kv, hd = k_cache.shape[1], k_cache.shape[2]
    k, v, pos = k_cache[:n].float(), v_cache[:n].float(), pos_cache[:n]  # (n, Hkv, hd), (n,)
    valid = (pos >= 0) & (pos <= position)  # empty slots and the future
    if window is not None:
        valid &= pos > position - window
    qg = q.view(n_kv, -1, hd)  # (Hkv, G, hd)
    scores = torch.einsum("hgd,nhd->hgn", qg, k) * hd**-0.5
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    return torch.einsum("hgn,nhd->hgd", probs, v).reshape(-1, hd)


def layer(
    h, w, kc, vc, pc, positions, cos, sin, span, past_a, past_m,
    *, native, heads, kv_heads, head_dim, eps, rope_style, window, mode,
):  # fmt: skip
    """One layer for S tokens: h (S, L, D) fp32 -> (h, attention partials a, MLP partials m).

    `w` is the layer's tensors (`PackedDecoder.layer_tensors`: norms, biases and each matrix's
    QTensor fields, its format first); kc/vc/pc its cache; positions (S,); span (live,) bounds
    the slots read. Keyword arguments are constants (one compilation per distinct set).
    """
    attention_norm, qkv, bqkv, wo, ffn_norm, w13, w2, q_norm, k_norm = w
    S, L = h.shape[0], h.shape[1]
    qkv = product(QTensor(*qkv), rms_norm(h, attention_norm, eps), native)  # (S, L, n_qkv/L)
    if bqkv is not None:
        qkv = qkv + bqkv
    lq, lkv = heads * head_dim // L, kv_heads * head_dim // L
    q = qkv[..., :lq].reshape(S, heads, head_dim)  # lane l owns heads l*Hq/L ...
    k = qkv[..., lq : lq + lkv].reshape(S, kv_heads, head_dim)
    v = qkv[..., lq + lkv :].reshape(S, kv_heads, head_dim)
    if q_norm is not None:  # qwen3: each head normalised over head_dim before RoPE
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin, rope_style), apply_rope(k, cos, sin, rope_style)
    slots = positions % kc.shape[0]  # ring layers wrap
    kc.index_copy_(0, slots, k.to(kc.dtype))  # every key and value before any query attends
    vc.index_copy_(0, slots, v.to(vc.dtype))
    pc.index_copy_(0, slots, positions)
    n = min(span.shape[0], kc.shape[0])
    o = torch.stack([attend(q[s], kc, vc, pc, positions[s], n, window) for s in range(S)])
    a = product(QTensor(*wo), o.reshape(S, L, -1), native)  # (S, L, D)
    h = h + reduce(a, mode, past_a)
    gu = product(QTensor(*w13), rms_norm(h, ffn_norm, eps), native)  # (S, L, 2F/L)
    f = gu.shape[-1] // 2
    m = product(QTensor(*w2), F.silu(gu[..., :f]) * gu[..., f:], native)  # (S, L, D)
    h = h + reduce(m, mode, past_m)
    return h, a, m


def head(h, norm, w, *, native, head_type, eps, pre_norm_lane_agg, greedy):
    """Final norm and LM head for S tokens, h (S, L, D): fp32 logits (S, V), or with `greedy`
    the last row's argmax (0-d)."""
    x = torch.stack([_head_input(row, norm.float(), head_type, eps, pre_norm_lane_agg)
                     for row in h])  # fmt: skip
    logits = product(QTensor(*w), x, native).reshape(h.shape[0], -1)  # vocab_parallel: lanes
    return argmax(logits[-1]) if greedy else logits


def _parts(q: QTensor) -> tuple:
    return q.flat


class PackedDecoder:
    """The packed CPU step (module docstring): a `Step` (protocol.py)."""

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
             _parts(w.w2), w.q_norm, w.k_norm)
            for w in self.weights.layers
        ]  # fmt: skip
        self.compiled = compile and self.step is None
        self._layer = torch.compile(layer, dynamic=False) if self.compiled else layer
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

    def _live(self) -> int:
        return self.cache.live if self.cache.live is not None else self.cache.max_len

    def hidden(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """tokens (S,) from position (1,) -> final residual streams (S, L, D) fp32; writes the
        S keys and values (the Python layer)."""
        cfg, cache = self.cfg, self.cache
        S = tokens.shape[0]
        positions = position.view(1) + torch.arange(S)  # (S,)
        h = self.weights.embed.lookup(tokens)[:, None, :].expand(S, cfg.num_lanes, -1)
        cos, sin = cos_sin(self.inv_freq, positions)  # (S, hd/2), as the model computes them
        span = self._live_span()
        partials = Partials(cfg)
        for i, w in enumerate(self.layer_tensors):
            pa, pm = partials.arriving(i)
            h, a, m = self._layer(
                h, w, cache.k[i], cache.v[i], cache.pos[i], positions, cos, sin, span, pa, pm,
                native=self.native, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.norm_eps, rope_style=cfg.rope_style,
                window=cfg.window(i), mode=cfg.reduce_mode(i),
            )  # fmt: skip
            partials.keep(i, a, m)
        return h

    def _run_head(self, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        cfg, wt = self.cfg, self.weights
        return self._head(
            h, wt.final_norm, _parts(wt.head), native=self.native,
            head_type=cfg.lm_head_type, eps=cfg.norm_eps,
            pre_norm_lane_agg=cfg.pre_norm_lane_agg, greedy=greedy,
        )  # fmt: skip

    def _native_rows(self, tokens: torch.Tensor, position: int, lowp: bool = False,
                     prompt: bool = False):  # fmt: skip
        """The final residual streams (S', D) fp32 of tokens (S,) (NativeStep.hidden's: the C
        layers run one-lane models), through them in calls of at most `prefill_chunk()` tokens
        (lowp, prompt: NativeStep.hidden's); each the step's buffer, valid until the next call."""
        live, width = self._live(), self.prefill_chunk()
        for at in range(0, tokens.shape[0], width):
            chunk = tokens[at : at + width]
            yield self.step.hidden(chunk, position + at, max(live, position + at + len(chunk)),
                                   lowp, prompt)  # fmt: skip

    def _native_logits(self, tokens: torch.Tensor, position: int, last_only: bool = False,
                       lowp: bool = False, shared: bool = False, prompt: bool = False
                       ) -> torch.Tensor:  # fmt: skip
        """fp32 logits (S, V), or (1, V) of the last row, through the C layers. Rows come in
        the head's buffer, copied; with `shared` and one call's tokens, not (forward_shared)."""
        keep = shared and tokens.shape[0] <= self.prefill_chunk()
        rows = []
        for h in self._native_rows(tokens, position, lowp, prompt):
            if not last_only:
                logits = self.step.head(h)[1]
                rows.append(logits if keep else logits.clone())
        if last_only:
            return self.step.head(h[-1:])[1].clone()
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def prefill_chunk(self) -> int:
        """Tokens one call may write: MAX_TOKENS, or fewer where a ring's headroom is smaller
        (the first token's window must survive the last one's write)."""
        return min(MAX_TOKENS, self.cache.forward_room() or MAX_TOKENS)

    def prefill_logits(self, tokens: torch.Tensor, position: int, lowp: bool = False
                       ) -> torch.Tensor:  # fmt: skip
        """fp32 logits (V,) after tokens (S,) written from `position`: a prefill's, the head
        on the last row only, through the C layers (StepPrefill is chosen only with them).
        lowp: the layers' products take x at llama.cpp's precision (native.LOWP_FORMATS). A
        prompt's bits need not be a decode step's: Q8_0's and the nibble formats' but NVFP4's run
        in AMX tiles where the CPU has them (csrc/cpu_amx_blocks.c)."""
        with self._live_slots(position + tokens.numel()):
            return self._native_logits(tokens.view(-1), position, last_only=True, lowp=lowp,
                                       prompt=True)[0]  # fmt: skip

    def prefill_hidden(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The final residual streams (S, L, D) fp32 of tokens (S,) written from `position`
        through the C layers, exact, the cache written as prefill_logits writes it (a prompt's
        chunks: their blocks in AMX tiles where the CPU has them): what /v1/embeddings pools
        (serve/embeddings.py)."""
        L, D = self.cfg.num_lanes, self.cfg.hidden_size
        with self._live_slots(position + tokens.numel()):
            rows = self._native_rows(tokens.view(-1), position, prompt=True)
            return torch.cat([h.reshape(-1, L, D).clone() for h in rows])

    @contextlib.contextmanager
    def _live_slots(self, end: int):
        """Within: the C layers scan the cache's slots up to `end` only (a prefill's)."""
        if self.step is None:
            raise ValueError("a prefill through the C layers (NativeStep), not built here")
        cache = self.cache
        was = cache.static, cache.live
        cache.static, cache.live = True, end
        try:
            yield
        finally:
            cache.static, cache.live = was

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (S, V) of final residual streams h (S, L, D) fp32 (a prefill's last
        rows), through the step's head: the C head where built, else the packed products."""
        if self.step is not None and h.shape[1] == 1:
            return self.step.head(h[:, 0].contiguous())[1].clone()
        return self._run_head(h, greedy=False)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """fp32 logits (S, V): row j for tokens[j] at position + j. Writes the S keys/values."""
        tokens = tokens.view(-1)
        if self.step is not None:
            return self._native_logits(tokens, int(position))
        if self.compiled and tokens.shape[0] > 1:  # rows as compiled single steps (docstring)
            return torch.cat([self.forward(tokens[j : j + 1], position + j)
                              for j in range(tokens.shape[0])])  # fmt: skip
        return self._run_head(self.hidden(tokens, position), greedy=False)

    def forward_shared(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """forward's logits (S, V) in the C head's own buffer, not copied: valid until the
        step's next call (protocol.py). A grammar's pick and a request's logprobs read them at
        once, and the copy of 49,152 floats measured 2.5% of a SmolLM2 decode step there (the
        free grammar's cost, 2026-12-07). Without the C step, or past one call's tokens: copied."""
        if self.step is None:
            return self.forward(tokens, position)
        return self._native_logits(tokens.view(-1), int(position), shared=True)

    def next_token(
        self,
        tokens: torch.Tensor,
        position: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        knobs: SamplerKnobs | None = None,
    ) -> torch.Tensor:
        """The token after the last of `tokens`, 0-d (greedy: the logits' argmax, in the head)."""
        tokens = tokens.view(-1)
        if tokens.shape[0] == 1 and self.step is not None:  # the C head's own argmax
            at = int(position)
            h = self.step.hidden(tokens, at, max(self._live(), at + 1))
            best, logits = self.step.head(h)  # logits (1, V): the step's buffer, not copied
            if params.greedy:
                return torch.tensor(best)
            return sample(logits[0], params, generator, knobs)
        if tokens.shape[0] == 1 and params.greedy:
            return self._run_head(self.hidden(tokens, position), greedy=True)
        logits = self.forward(tokens, position)[-1]
        return argmax(logits) if params.greedy else sample(logits, params, generator, knobs)
