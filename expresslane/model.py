"""The decoder, pure math: one Laneformer that is also every Llama (the 1-lane case).

The residual stream carries a lane axis, h: (B, S, L, D). Per-lane projections are lane-major
(L, out/L, in) "row" or (L, out, in/L) "column" weights, kept as the checkpoint has them; a Llama
(out, in) matrix is held as (1, out, in). After every attention and MLP module the per-lane
partials are reduced by the layer's mode (laneformer.md 5.2): present (immediate all-reduce),
no_reduce, or past (own fresh partial + the other lanes' partials from `broadcast_delay` layers
earlier). Parameter names are the Laneformer checkpoint keys: its state dict loads as is.

`forward(tokens, positions, cache)` covers prefill, decode and training (cache=None).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

if torch.cuda.is_available():  # flash attention's bottom-right bias, unmaterialised (below); its
    # module imports torch._dynamo, 1.6 s that a start without CUDA skips
    from torch.nn.attention.bias import causal_lower_right

from .cache import KVCache
from .config import ModelConfig
from .rope import apply_rope, cos_sin, inv_frequencies

LANES_APART = ("vocab_parallel", "lane")  # heads that read every lane's stream side by side


def lane_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., l, :] = W[l] @ x[..., l, :] (+ b[l]) for x (..., L, in) and W (L, out, in)."""
    if w.shape[0] == 1:
        return F.linear(x, w[0], None if b is None else b[0])
    lead = x.shape[:-2]
    xl = x.reshape(-1, w.shape[0], w.shape[2]).transpose(0, 1)  # (L, N, in)
    y = torch.bmm(xl, w.transpose(1, 2)).transpose(0, 1)  # (N, L, out)
    if b is not None:
        y = y + b
    return y.reshape(*lead, w.shape[0], w.shape[1])


class RMSNorm(nn.Module):
    """Shared weight (D,) applied to every lane, or a per-lane scale (L, D) (laneformer.md 4.1).

    `round_before_scale` follows each reference's rounding: transformers' Llama and the per-lane
    LaneRMSNorm round the normalised value to the activation dtype before scaling; the shared
    Laneformer norm scales in fp32 and rounds once.
    """

    def __init__(self, dim: int, eps: float, lanes: int | None, round_before_scale: bool):
        super().__init__()
        self.eps, self.round_before_scale = eps, round_before_scale
        self.per_lane = lanes is not None
        shape = (lanes, dim) if self.per_lane else (dim,)
        self.register_parameter(
            "scale" if self.per_lane else "weight", nn.Parameter(torch.ones(shape))
        )

    @property
    def gamma(self) -> torch.Tensor:
        return self.scale if self.per_lane else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.gamma, self.eps, self.round_before_scale)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, round_before_scale: bool):
    """RMSNorm over the last axis with fp32 statistics (the RMSNorm module's math)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_before_scale:
        return xf.to(x.dtype) * gamma
    return (xf * gamma.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        L, D = cfg.num_lanes, cfg.hidden_size
        self.cfg, self.layer, self.window = cfg, layer, cfg.window(layer)
        self.wq = _Proj((L, cfg.lane_q_dim, D), cfg.attention_bias)
        self.wk = _Proj((L, cfg.lane_kv_dim, D), cfg.attention_bias)
        self.wv = _Proj((L, cfg.lane_kv_dim, D), cfg.attention_bias)
        self.wo = _Proj((L, D, cfg.lane_q_dim), False)
        if cfg.qk_norm:  # qwen3: one (head_dim,) scale shared by every head, as transformers'
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, None, round_before_scale=True)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, None, round_before_scale=True)

    def forward(self, x, cos, sin, positions, cache: KVCache | None) -> torch.Tensor:
        cfg = self.cfg
        B, S, L, _ = x.shape
        q = self.wq(x).reshape(B, S, cfg.num_heads, cfg.head_dim)  # lanes then heads
        k = self.wk(x).reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
        v = self.wv(x).reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin, cfg.rope_style), apply_rope(k, cos, sin, cfg.rope_style)
        kpos = positions
        if cache is not None:
            k, v, kpos = cache.update(self.layer, k[0], v[0], positions)
            k, v = k[None].to(q.dtype), v[None].to(q.dtype)  # (1, T, H_kv, hd); a half cache
        T = k.shape[1]
        # A long chunk outside decode whose keys all lie in the window: the cache returns keys
        # exactly at positions 0..T-1 (slot == position; a ring past its window fails the
        # test, T > window), the queries are the last S of them. Then the mask is causal aligned
        # bottom-right and SDPA runs it as flash attention instead of a materialised mask: a
        # cold prefill (T == S), a chunk after cached ones or a reused prefix, training.
        static = cache is not None and cache.static
        causal = S > 16 and not static and (self.window is None or self.window >= T)
        if causal:
            o = attend(q, k, v, None)  # (B, H, S, hd)
        elif self.window is not None and S > max(16, self.window) and not static:
            o = windowed_attention(q, k, v, positions, kpos, self.window)
        else:
            o = attend(q, k, v, visible_mask(positions, kpos, self.window))
        o = o.transpose(1, 2).reshape(B, S, L, cfg.lane_q_dim)  # each lane gets its own heads
        return self.wo(o)


def visible_mask(positions: torch.Tensor, kpos: torch.Tensor, window: int | None):
    """(S, T) bool: query at positions[i] sees key at kpos[j] (-1: an empty slot)."""
    visible = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] >= 0)
    if window is not None:
        visible &= kpos[None, :] > positions[:, None] - window
    return visible


def windowed_attention(q, k, v, positions, kpos, window: int) -> torch.Tensor:
    """A chunk longer than its window, in blocks of `window` queries: each block reads the
    chunk's own keys from one window before it (and the older keys only while they can be
    visible), so the masked scores are S x 2W instead of S x T.

    q (B, S, H, hd), positions (S,) consecutive; k/v (B, T, H_kv, hd) and kpos (T,): the older
    keys first (a ring or a cached prefix, T - S of them, any order), then the chunk's own S
    in order, as the cache returns them. -> (B, H, S, hd)."""
    S, T = q.shape[1], k.shape[1]
    old = T - S
    out = []
    for a in range(0, S, window):
        b = min(S, a + window)
        own = slice(old + max(0, a - window + 1), old + b)  # from the first query's window
        kb, vb, pb = k[:, own], v[:, own], kpos[own]
        if a < window - 1 and old:  # older keys are within the first queries' window
            kb, vb = torch.cat((k[:, :old], kb), 1), torch.cat((v[:, :old], vb), 1)
            pb = torch.cat((kpos[:old], pb))
        out.append(attend(q[:, a:b], kb, vb, visible_mask(positions[a:b], pb, window)))
    return torch.cat(out, dim=2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None):
    """q (B, S, H, hd), k/v (B, T, H_kv, hd), visible (S, T) or None (causal, the queries the
    last S of the T keys) -> (B, H, S, hd).

    Few queries (decode, small chunks): grouped matmuls with no KV repetition, softmax in fp32
    (laneformer.md 4.3); CPU SDPA with a mask and GQA is an order of magnitude slower there. Long
    prefills and training: SDPA (fp32 accumulation in its fused kernels), causal when it can.
    """
    B, S, H, hd = q.shape
    Hkv = k.shape[2]
    if S > 16:
        if visible is None:
            return causal_attention(q, k, v)
        q, k, v = q.transpose(1, 2), *_heads_for_sdpa(q, k, v, grouped_ok=False)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, enable_gqa=H != k.shape[1]
        )
    rep = H // Hkv
    qg = q.reshape(B, S, Hkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep * S, hd)
    scores = (qg @ k.permute(0, 2, 3, 1)).float() * hd**-0.5  # (B, H_kv, rep*S, T)
    scores = scores.masked_fill(~visible.repeat(rep, 1), float("-inf"))
    o = scores.softmax(-1).to(v.dtype) @ v.transpose(1, 2)  # (B, H_kv, rep*S, hd)
    return o.reshape(B, Hkv, rep, S, hd).reshape(B, H, S, hd)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Query i (of S) sees keys 0..T-S+i (of T >= S): q (B, S, H, hd), k/v (B, T, H_kv, hd)
    -> (B, H, S, hd). T == S is SDPA's own causal mask; T > S (queries after a cached prefix)
    its bottom-right causal bias, flash attention on a GPU, a materialised mask elsewhere."""
    S, T, H = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = q.transpose(1, 2), *_heads_for_sdpa(q, k, v, grouped_ok=T == S)  # (B, H., S|T, hd)
    gqa = H != k.shape[1]
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.is_cuda:  # flash attention takes the bias unmaterialised
        mask = causal_lower_right(S, T)
    else:  # the mask the bias materialises off CUDA
        mask = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(T - S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _heads_for_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grouped_ok: bool):
    """k, v (B, T, H_kv, hd) as (B, H_kv, T, hd); on CUDA repeated to q's H heads unless the
    call takes grouped heads in a fused kernel (`grouped_ok`: plain causal, flash): a mask or the
    bottom-right bias with grouped heads falls back to the unfused math kernel (S x T scores in
    memory), and one copy of K and V costs far less."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    rep = q.shape[2] // k.shape[1]
    if q.is_cuda and rep > 1 and not grouped_ok:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return k, v


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        L, D, F_ = cfg.num_lanes, cfg.hidden_size, cfg.lane_ffn_dim
        self.w1, self.w3, self.w2 = _Proj((L, F_, D)), _Proj((L, F_, D)), _Proj((L, D, F_))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Proj(nn.Module):
    """A lane-major linear: weight (L, out, in), optional bias (L, out)."""

    def __init__(self, shape: tuple[int, int, int], bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(shape[:2])) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lane_linear(x, self.weight, self.bias)


def reduce(y: torch.Tensor, mode: str, past: torch.Tensor | None) -> torch.Tensor:
    """What a module adds to each lane's residual (laneformer.md 5.2); y, past: (B, S, L, D).
    One lane (a Llama): y itself in every mode, as each formula gives for L = 1 (a sum over one
    lane, sqrt(1), past - past = 0) without their passes over the activations (2% of a
    SmolLM2-shaped 4,000-token fp32 prefill on the CPU, 2026-12-07; BENCHMARKS.md)."""
    if y.shape[-2] == 1:
        return y
    if mode == "present":
        return y.sum(-2, keepdim=True)
    if mode == "no_reduce":
        return y * math.sqrt(y.shape[-2])
    if past is None:  # Option B at layers d..2d-1: nothing arrives yet
        return y
    return y + (past.sum(-2, keepdim=True) - past)


class Partials:
    """The delay line of the DTP partials: what each layer broadcasts (`ModelConfig.broadcasts`),
    kept until the layer `broadcast_delay` later adds it (`ModelConfig.past_source`). One per
    forward or step, filled layer by layer."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.attn: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.mlp: list[torch.Tensor | None] = [None] * cfg.num_layers

    def arriving(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(attention, MLP) partials that reach `layer`: (None, None) when none do."""
        src = self.cfg.past_source(layer)
        return (None, None) if src is None else (self.attn[src], self.mlp[src])

    def keep(self, layer: int, attn: torch.Tensor, mlp: torch.Tensor) -> None:
        if self.cfg.broadcasts(layer):
            self.attn[layer], self.mlp[layer] = attn, mlp


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        lanes = cfg.num_lanes if cfg.per_lane_norms else None
        rbs = cfg.family == "llama" or cfg.per_lane_norms
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, lanes, rbs)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, lanes, rbs)
        self.feed_forward = FeedForward(cfg)
        self.mode = cfg.reduce_mode(layer)

    def forward(self, h, cos, sin, positions, cache, past_a, past_m):
        a = self.attention(self.attention_norm(h), cos, sin, positions, cache)
        h = h + reduce(a, self.mode, past_a)
        m = self.feed_forward(self.ffn_norm(h))
        h = h + reduce(m, self.mode, past_m)
        return h, a, m


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        lanes = None if cfg.final_norm_shared else cfg.num_lanes
        rbs = cfg.family == "llama" or lanes is not None
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, lanes, rbs)


class LaneLMHead(nn.Module):
    """lm_head_type 'lane': one (V, L*D) linear over the lane-major concatenation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.linear = nn.Linear(cfg.num_lanes * cfg.hidden_size, cfg.vocab_size, bias=False)


class Laneformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        V, D, L = cfg.vocab_size, cfg.hidden_size, cfg.num_lanes
        if cfg.lm_head_type == "lane":
            self.lm_head = LaneLMHead(cfg)
        elif cfg.lm_head_type == "vocab_parallel":
            self.lm_head = _Proj((L, V // L, D))
        elif not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(D, V, bias=False)
        self.register_buffer(
            "inv_freq",
            inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, V) (or (B, 1, V) with last_only), fp32 or model dtype."""
        h = self.hidden(tokens, positions, cache)
        return self.finish(h, tokens.shape[1], cache, last_only)

    def hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) -> the residual stream after the last layer (B, S, L, D), the keys and
        values written to the cache (which `finish` then advances)."""
        h, positions, cos, sin = self.embed(tokens, positions, cache)
        partials = Partials(self.cfg)
        for i, block in enumerate(self.model.layers):
            h, a, m = block(h, cos, sin, positions, cache, *partials.arriving(i))
            partials.keep(i, a, m)
        return h

    def finish(self, h: torch.Tensor, n: int, cache: KVCache | None, last_only: bool):
        """After the layers: the cache counts the `n` new positions, then the head's logits."""
        if cache is not None:
            cache.advance(n)
        return self.head(h[:, -1:] if last_only else h)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None, cache: KVCache | None):
        """tokens (B, S) -> the lane-expanded residual (B, S, L, D), positions and RoPE angles."""
        B, S = tokens.shape
        if cache is not None and B != 1:
            raise ValueError("a KV cache holds one sequence: batch size must be 1")
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + S, device=tokens.device)
        cos, sin = cos_sin(self.inv_freq, positions)
        h = self.model.tok_embeddings(tokens)  # (B, S, D): every lane starts from the same row
        h = h.unsqueeze(2).expand(B, S, self.cfg.num_lanes, self.cfg.hidden_size)  # (B,S,L,D)
        return h, positions, cos, sin

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lane aggregation (laneformer.md 6): what the LM head reads, and what
        /v1/embeddings pools. h (B, S, L, D) -> (B, S, L * D) for the lane and vocab-parallel
        heads (lanes side by side), (B, S, D) for the others."""
        cfg, norm = self.cfg, self.model.norm
        B, S, L, D = h.shape
        if cfg.lm_head_type in LANES_APART:
            return norm(h).reshape(B, S, L * D)
        return norm(h.sum(-2)) if cfg.pre_norm_lane_agg else norm(h).mean(-2)  # (B, S, D)

    @property
    def head_width(self) -> int:  # head_input's last dimension
        cfg = self.cfg
        return cfg.hidden_size * (cfg.num_lanes if cfg.lm_head_type in LANES_APART else 1)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on head_input (laneformer.md 6); h (B, S, L, D) -> (B, S, V)."""
        cfg, z = self.cfg, self.head_input(h)
        if cfg.lm_head_type == "vocab_parallel":  # each lane's slice of the vocabulary, in order
            return self.lm_head(z.view(h.shape)).reshape(*h.shape[:2], cfg.vocab_size)
        if cfg.lm_head_type == "lane":
            return self.lm_head.linear(z)
        if hasattr(self, "lm_head"):  # untied, or a tied head given its own storage (quantized)
            return self.lm_head(z)
        return F.linear(z, self.model.tok_embeddings.weight)


@torch.no_grad()
def init_weights(model: Laneformer, seed: int = 0, norm_noise: float = 0.0) -> Laneformer:
    """Random weights with fan-in scaling (for presets, tests and training from scratch).

    The draws come from a generator on the parameters' device (fp32, then cast): on a GPU the
    weights are made there, not streamed from the host."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, device=dev)

    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "norm.scale")):
            p.copy_(1.0 + norm_noise * randn(p.shape))
        elif name.endswith(".bias"):
            p.copy_(0.02 * randn(p.shape))
        elif "tok_embeddings" in name:
            p.copy_(randn(p.shape))
        else:
            p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)
    return model
