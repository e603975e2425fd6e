"""The verify step on packed weights: S = k + 1 tokens through every layer and the head at once.

Speculative decoding checks k drafts with one model call over [last token, drafts] at their
positions (verify.py). On a CPU the plain decode step runs on packed weights (packed_step.py);
verifying with the model's own forward instead (oneDNN on dequantized weights) cost more than
the tokens it saved. This is the packed step for S tokens: each weight matrix is read once for
all of them, so a verify costs about one decode step plus the arithmetic of the extra rows.

- One-lane models with the C kernels: `NativeStep.hidden` / `head` for S tokens (one C call
  per layer, products in csrc/cpu_matmul.c). Each token's row is the bits the single-token step
  gives, so greedy speculation reproduces plain greedy decoding on this path exactly.
- Otherwise (lanes, no C extension, an unsupported shape): `verify_layer`, decode_layer's
  arithmetic with a token axis in front, run eagerly (products by the C kernels where built,
  else quant.matvec). Slow, but correct; the model's forward on the same packed storage is the
  reference both are tested against.

Per layer every new key and value is written first (slot = position % cap), then each query
attends over the live slots masked by position, which makes it causal among the new tokens. On
a ring that is right only while the slots written do not hold keys the first query still sees:
rings need k slots of headroom (the engine gives them, cache.py); `fits` says when a call may
run. More than MAX_TOKENS tokens go in chunks, as a prefill would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rope import apply_rope, cos_sin
from ..weights.quant import QTensor, matvec
from .native import MAX_TOKENS, native_matmul
from .packed import PackedDecoder, reduce, rms_norm


def product(w: QTensor, x: torch.Tensor, native: bool) -> torch.Tensor:
    """W @ x for S tokens, x (S, ..., K) -> (S, ..., N) fp32."""
    return native_matmul(w, x) if native else matvec(w, x)


def attend_tokens(q, k_cache, v_cache, pos_cache, positions, n, window: int | None):
    """q (S, Hq, hd) fp32, each at its position (S,), over the first n slots -> (S, Hq, hd)."""
    S, n_kv, hd = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    k, v, pos = k_cache[:n].float(), v_cache[:n].float(), pos_cache[:n]  # (n, Hkv, hd), (n,)
    valid = (pos[None] >= 0) & (pos[None] <= positions[:, None])  # (S, n): causal, filled
    if window is not None:
        valid &= pos[None] > positions[:, None] - window
    qg = q.view(S, n_kv, -1, hd)  # (S, Hkv, G, hd)
    scores = torch.einsum("shgd,nhd->shgn", qg, k) * hd**-0.5
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("shgn,nhd->shgd", probs, v).reshape(S, -1, hd)


def verify_layer(
    h, w, kc, vc, pc, positions, cos, sin, n, past_a, past_m,
    *, native, heads, kv_heads, head_dim, eps, rope_style, window, mode,
):  # fmt: skip
    """One layer for S tokens: h (S, L, D) fp32 -> (h, attention partials a, MLP partials m).

    decode_layer's arithmetic per token (`w`: PackedDecoder.layer_tensors' entry); n bounds the
    slots read. All S keys and values are written before any query attends."""
    attention_norm, qkv, bqkv, wo, ffn_norm, w13, w2 = w
    S, L = h.shape[0], h.shape[1]
    qkv = product(QTensor(*qkv), rms_norm(h, attention_norm, eps), native)  # (S, L, n_qkv/L)
    if bqkv is not None:
        qkv = qkv + bqkv
    lq, lkv = heads * head_dim // L, kv_heads * head_dim // L
    q = qkv[..., :lq].reshape(S, heads, head_dim)  # lane l owns heads l*Hq/L ...
    k = qkv[..., lq : lq + lkv].reshape(S, kv_heads, head_dim)
    v = qkv[..., lq + lkv :].reshape(S, kv_heads, head_dim)
    q, k = apply_rope(q, cos, sin, rope_style), apply_rope(k, cos, sin, rope_style)
    slots = positions % kc.shape[0]  # ring layers wrap
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))
    pc.index_copy_(0, slots, positions)
    o = attend_tokens(q, kc, vc, pc, positions, min(n, kc.shape[0]), window)  # (S, Hq, hd)
    a = product(QTensor(*wo), o.reshape(S, L, -1), native)  # (S, L, D)
    h = h + reduce(a, mode, past_a)
    gu = product(QTensor(*w13), rms_norm(h, ffn_norm, eps), native)  # (S, L, 2F/L)
    f = gu.shape[-1] // 2
    m = product(QTensor(*w2), F.silu(gu[..., :f]) * gu[..., f:], native)  # (S, L, D)
    h = h + reduce(m, mode, past_m)
    return h, a, m


def head_tokens(h, norm, w: QTensor, *, native, head_type, eps, pre_norm_lane_agg):
    """Final norm and LM head for S tokens: h (S, L, D) -> fp32 logits (S, V)."""
    S = h.shape[0]
    if head_type == "replicate":  # kernels.ref._head_input with a token axis
        if pre_norm_lane_agg:
            x = rms_norm(h.sum(1), norm, eps)  # (S, D)
        else:
            x = rms_norm(h, norm, eps).mean(1)
    else:
        x = rms_norm(h, norm, eps)  # (S, L, D)
        if head_type == "lane":
            x = x.reshape(S, -1)  # (S, L*D), lane-major
    return product(w, x, native).reshape(S, -1)  # vocab_parallel: lane order


class PackedVerifier:
    """Scores S tokens at consecutive positions against the cache on a PackedDecoder's weights."""

    def __init__(self, decoder: PackedDecoder):
        self.decoder = decoder
        self.cfg, self.cache = decoder.cfg, decoder.cache

    def fits(self, S: int) -> bool:
        """Can S tokens be written before they attend? Not on a ring with fewer than S - 1
        slots of headroom (it would overwrite keys the first queries still see)."""
        return all(
            w is None or k.shape[0] >= self.cache.max_len or k.shape[0] - w >= S - 1
            for w, k in zip(self.cache.windows, self.cache.k, strict=True)
        )

    @torch.inference_mode()
    def logits(self, tokens: list[int], position: int) -> torch.Tensor:
        """fp32 logits (S, V): row j is the distribution after tokens[j] at position + j.
        Writes the S keys and values (the caller keeps or truncates them)."""
        rows = []
        for at in range(0, len(tokens), MAX_TOKENS):
            chunk = torch.tensor(tokens[at : at + MAX_TOKENS])
            rows.append(self._chunk(chunk, position + at))
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _chunk(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        dec, S = self.decoder, tokens.shape[0]
        live = position + S  # every slot a later position could hold stays unread
        if dec.step is not None:
            return dec.step.head(dec.step.hidden(tokens, position, live))[1].clone()
        cfg, cache = self.cfg, self.cache
        positions = torch.arange(position, position + S)
        h = dec.weights.embed.lookup(tokens)[:, None, :].expand(S, cfg.num_lanes, -1)
        cos, sin = cos_sin(dec.inv_freq, positions)  # (S, hd/2)
        native = dec.native
        past_a: list[torch.Tensor | None] = [None] * cfg.num_layers
        past_m: list[torch.Tensor | None] = [None] * cfg.num_layers
        for i, w in enumerate(dec.layer_tensors):
            src = cfg.past_source(i)
            pa, pm = (None, None) if src is None else (past_a[src], past_m[src])
            h, a, m = verify_layer(
                h, w, cache.k[i], cache.v[i], cache.pos[i], positions, cos, sin, live, pa, pm,
                native=native, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, eps=cfg.norm_eps, rope_style=cfg.rope_style,
                window=cfg.window(i), mode=cfg.reduce_mode(i),
            )  # fmt: skip
            if cfg.broadcasts(i):
                past_a[i], past_m[i] = a, m
        wt = dec.weights
        return head_tokens(h, wt.final_norm, wt.head, native=native, head_type=cfg.lm_head_type,
                           eps=cfg.norm_eps, pre_norm_lane_agg=cfg.pre_norm_lane_agg)  # fmt: skip
