"""Naive reference (oracle) Laneformer decoder, written from docs/laneformer.md 3 to 7.

This file is deliberately independent of expresslane/model.py, cache.py and rope.py: it reads
only the checkpoint-style state dict (laneformer.md 3.3 key names) and the ModelConfig fields, and
re-derives every rule (layer reduce modes, DTP wiring, sliding-window layers, heads) from the
documented semantics. It is slow on purpose:

- no KV cache: the logits of position q are computed by running the whole decoder on the causal
  prefix tokens[: q + 1] from scratch and keeping its last position;
- lanes, layers and attention heads are Python loops; every lane linear is a plain matmul with
  that lane's weight slice (laneformer.md 3.2);
- RoPE is the complex-number formula of laneformer.md 4.4 (torch.polar), interleaved pairs
  (2i, 2i+1) for Laneformer and rotate-half pairs (i, i + hd/2) for rope_style "half" (Llama);
- the attention mask is built element by element from the predicate of laneformer.md 7
  (kv <= q and, on sliding layers, kv > q - W);
- everything runs in float64.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "reference_logits",
    "reduce_mode",
    "past_source",
    "sliding_layers",
]


# --- layer assignment (laneformer.md 5.3, 5.4 and 7) -------------------------------------------
def reduce_mode(cfg, i: int) -> str:
    """laneformer.md 5.3: layers i < d use present/no_reduce per use_early_comm; layers i >= d
    use past when use_comm, else no_reduce."""
    d = cfg.broadcast_delay
    if i < d:
        return "present" if cfg.use_early_comm else "no_reduce"
    return "past" if cfg.use_comm else "no_reduce"


def past_source(cfg, i: int) -> int | None:
    """The layer whose per-lane partials a `past` layer i consumes (laneformer.md 5.2: i - d).

    Option A (laneformer.md 5.4): every layer stores its per-lane outputs, so layer i always
    reads i - d.
    Option B: layers < d do not broadcast, so layers d..2d-1 get no past (the term is zero)."""
    if reduce_mode(cfg, i) != "past":
        return None
    d = cfg.broadcast_delay
    src = i - d
    if cfg.dtp_variant == "B" and src < d:
        return None
    return src


def sliding_layers(cfg) -> list[bool]:
    """Laneformer: unclamped layers are full; else layer i slides iff i < n or i >= N + n,
    where n = sliding_window_n_layers (the reference implementation reads nothing else; a
    `layer_types` list is never consulted). Without a sliding_window every layer is full.

    Llama-family configs use the config's layer_types."""
    n_layers = cfg.num_layers
    if cfg.sliding_window is None:
        return [False] * n_layers
    n = cfg.sliding_window_n_layers
    if cfg.family == "laneformer":
        unclamped = set(cfg.unclamped_layers)
        return [(i not in unclamped) and (i < n or i >= n_layers + n) for i in range(n_layers)]
    return [t == "sliding_attention" for t in cfg.layer_types]


# --- building blocks --------------------------------------------------------------------------
def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (laneformer.md 4.1)."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def _norm(sd: dict, prefix: str, x_lanes: list[torch.Tensor], eps: float, shared: bool):
    """Apply a shared (`prefix.weight` (D,)) or per-lane (`prefix.scale` (L, D)) RMSNorm to each
    lane's (T, D) hidden state independently."""
    out = []
    for lane, x in enumerate(x_lanes):
        if shared:
            gamma = sd[prefix + ".weight"]
        else:
            gamma = sd[prefix + ".scale"][lane]
        out.append(_rms_normalize(x, eps) * gamma)
    return out


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    """Rotate one head's vectors x (T, hd) at absolute positions (T,) (laneformer.md 4.4).

    Pair i (i = 0 .. hd/2 - 1) is the complex number x[2i] + j x[2i+1] (interleaved) or
    x[i] + j x[i + hd/2] (half), multiplied by exp(j p w_i) with w_i = theta^(-2i/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    i = torch.arange(half, dtype=torch.float64)
    omega = theta ** (-2.0 * i / hd)
    angle = positions.to(torch.float64)[:, None] * omega[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)
    if style == "interleaved":
        z = torch.complex(x[:, 0::2], x[:, 1::2]) * rot
        out = torch.empty_like(x)
        out[:, 0::2] = z.real
        out[:, 1::2] = z.imag
        return out
    if style == "half":
        z = torch.complex(x[:, :half], x[:, half:]) * rot
        return torch.cat([z.real, z.imag], dim=-1)
    raise ValueError(f"unknown rope style {style!r}")


def _visible(q: int, kv: int, window: int | None) -> bool:
    """laneformer.md 7: causal, plus kv > q - W on sliding layers."""
    if kv > q:
        return False
    return window is None or kv > q - window


def _row_linear(sd: dict, key: str, x: torch.Tensor, lane: int) -> torch.Tensor:
    """LaneRowLinear for one lane: x (T, in) @ W[lane].T (+ optional per-lane bias)."""
    y = x @ sd[key + ".weight"][lane].T
    bias = sd.get(key + ".bias")
    if bias is not None:
        y = y + bias[lane]
    return y


def _attention(cfg, sd, prefix, xn_lanes, positions, window):
    """laneformer.md 4.3 for all T positions of the current prefix; the per-lane partials a_l."""
    L = cfg.num_lanes
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = positions.shape[0]
    # 1. projections, per lane (LaneRowLinear)
    q_lanes = [_row_linear(sd, prefix + ".wq", xn_lanes[lane], lane) for lane in range(L)]
    k_lanes = [_row_linear(sd, prefix + ".wk", xn_lanes[lane], lane) for lane in range(L)]
    v_lanes = [_row_linear(sd, prefix + ".wv", xn_lanes[lane], lane) for lane in range(L)]
    # 2. head assignment: flatten lanes then heads
    q_all = torch.cat(q_lanes, dim=-1)  # (T, H*hd)
    k_all = torch.cat(k_lanes, dim=-1)  # (T, Hkv*hd)
    v_all = torch.cat(v_lanes, dim=-1)
    assert q_all.shape[-1] == H * hd and k_all.shape[-1] == Hkv * hd
    n_rep = H // Hkv
    mask = torch.tensor(
        [[_visible(qp, kp, window) for kp in range(T)] for qp in range(T)], dtype=torch.bool
    )
    heads_out = []
    for h in range(H):
        kvh = h // n_rep  # 3. GQA: repeat-interleave, query head h uses KV head h // n_rep
        qh = _rope(q_all[:, h * hd : (h + 1) * hd], positions, cfg.rope_theta, cfg.rope_style)
        kh = _rope(k_all[:, kvh * hd : (kvh + 1) * hd], positions, cfg.rope_theta, cfg.rope_style)
        vh = v_all[:, kvh * hd : (kvh + 1) * hd]
        scores = (qh @ kh.T) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads_out.append(torch.softmax(scores, dim=-1) @ vh)  # (T, hd)
    o_all = torch.cat(heads_out, dim=-1)  # (T, H*hd)
    # 7. re-laning: lane l gets the concatenation of its own H/L heads; 8. wo (column linear)
    per_lane = H * hd // L
    wo = sd[prefix + ".wo.weight"]  # (L, D, H*hd/L)
    return [o_all[:, lane * per_lane : (lane + 1) * per_lane] @ wo[lane].T for lane in range(L)]


def _mlp(cfg, sd, prefix, xn_lanes):
    """laneformer.md 4.5: m_l = W2[l] (silu(W1[l] x_l) * W3[l] x_l)."""
    out = []
    for lane, x in enumerate(xn_lanes):
        g = x @ sd[prefix + ".w1.weight"][lane].T
        u = x @ sd[prefix + ".w3.weight"][lane].T
        act = g * torch.sigmoid(g) * u
        out.append(act @ sd[prefix + ".w2.weight"][lane].T)
    return out


def _reduce(cfg, mode, y, past):
    """laneformer.md 5.2. y, past: lists of per-lane (T, D) tensors (past None = no past term).
    Returns the list of values to add to each lane's residual."""
    L = len(y)
    if mode == "no_reduce":
        return [math.sqrt(L) * y[lane] for lane in range(L)]
    if mode == "present":
        total = y[0]
        for lane in range(1, L):
            total = total + y[lane]
        return [total for _ in range(L)]
    if mode == "past":
        if past is None:  # Option B at layers d..2d-1: only the own fresh partial
            return list(y)
        total = past[0]
        for lane in range(1, L):
            total = total + past[lane]
        return [y[lane] + (total - past[lane]) for lane in range(L)]
    raise ValueError(mode)


def _final_logits(cfg, sd, h_lanes, emb):
    """laneformer.md 6: final norm rule and heads. h_lanes: per-lane (T, D)."""
    L, V, eps = cfg.num_lanes, cfg.vocab_size, cfg.norm_eps
    final_shared = cfg.replicated_rmsn_scale or cfg.pre_norm_lane_agg
    head = cfg.lm_head_type
    if head == "replicate":
        w = emb if cfg.tie_word_embeddings else sd["lm_head.weight"]
        assert w.shape == (V, cfg.hidden_size), w.shape
        if cfg.pre_norm_lane_agg:
            s = h_lanes[0]
            for lane in range(1, L):
                s = s + h_lanes[lane]
            x = _norm(sd, "model.norm", [s], eps, shared=True)[0]
        else:
            n = _norm(sd, "model.norm", h_lanes, eps, final_shared)
            x = n[0]
            for lane in range(1, L):
                x = x + n[lane]
            x = x / L
        return x @ w.T
    if cfg.pre_norm_lane_agg:
        raise ValueError("pre_norm_lane_agg needs lm_head_type 'replicate' (laneformer.md 6)")
    n = _norm(sd, "model.norm", h_lanes, eps, final_shared)
    if head == "lane":
        w = sd["lm_head.linear.weight"]  # (V, L*D), lane-major input
        return torch.cat(n, dim=-1) @ w.T
    if head == "vocab_parallel":
        w = sd["lm_head.weight"]  # (L, V/L, D)
        assert w.shape == (L, V // L, cfg.hidden_size), w.shape
        return torch.cat([n[lane] @ w[lane].T for lane in range(L)], dim=-1)
    raise ValueError(f"unknown lm_head_type {head!r}")


def _forward_prefix(cfg, sd, tokens: list[int]) -> torch.Tensor:
    """Run the whole decoder on `tokens` (no cache); return the logits of every position."""
    L, N, eps = cfg.num_lanes, cfg.num_layers, cfg.norm_eps
    shared = cfg.replicated_rmsn_scale
    T = len(tokens)
    positions = torch.arange(T)
    emb = sd["model.tok_embeddings.weight"]
    e = emb[torch.tensor(tokens, dtype=torch.long)]  # (T, D)
    h = [e.clone() for _ in range(L)]  # laneformer.md 4.2: copied unchanged to all lanes
    sliding = sliding_layers(cfg)
    future_attention: list[list[torch.Tensor]] = []
    future_mlp: list[list[torch.Tensor]] = []
    for i in range(N):
        p = f"model.layers.{i}"
        window = cfg.sliding_window if sliding[i] else None
        mode = reduce_mode(cfg, i)
        src = past_source(cfg, i)
        # attention sub-block
        xn = _norm(sd, p + ".attention_norm", h, eps, shared)
        a = _attention(cfg, sd, p + ".attention", xn, positions, window)
        future_attention.append(a)
        add = _reduce(cfg, mode, a, future_attention[src] if src is not None else None)
        h = [h[lane] + add[lane] for lane in range(L)]
        # MLP sub-block
        xn = _norm(sd, p + ".ffn_norm", h, eps, shared)
        m = _mlp(cfg, sd, p + ".feed_forward", xn)
        future_mlp.append(m)
        add = _reduce(cfg, mode, m, future_mlp[src] if src is not None else None)
        h = [h[lane] + add[lane] for lane in range(L)]
    return _final_logits(cfg, sd, h, emb)


def reference_logits(cfg, state_dict: dict, tokens: list[int], dtype=torch.float64):
    """Logits (S, V) of `tokens` under `cfg` and a spec-9 state dict, computed position by
    position: row q is the last row of a cache-free forward over tokens[: q + 1]."""
    if cfg.rope_scaling is not None:
        raise NotImplementedError("the reference implements unscaled RoPE only")
    sd = {k: v.detach().to(dtype) for k, v in state_dict.items()}
    rows = []
    with torch.no_grad():
        for q in range(len(tokens)):
            rows.append(_forward_prefix(cfg, sd, list(tokens[: q + 1]))[-1])
    return torch.stack(rows)
