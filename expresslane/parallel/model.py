"""ParallelLaneformer: the decoder's forward for the lanes (or heads) one rank holds.

It reuses the model's modules (Block, RMSNorm, Attention, FeedForward) built from the shard's
config, so every per-lane computation is the model's own; only the reduces differ
(laneformer.md 5.2, 8.2). Per module of layer i:

- present (i < d, or every layer of a Llama): blocking all-reduce of the sum of local partials;
- no_reduce: sqrt(L) * y with the global lane count L (nothing sent);
- past: y + (S - own), S = the sum over all lanes of layer src = i - d, own = this rank's
  per-lane partials of layer src (laneformer.md 5.6 order: all-reduce of rank sums, then subtract).

A layer some later layer consumes sends its rank sum right after the module (an asynchronous
all-reduce) and the consumer waits on that message only. Option A's sums for the present
layers (d..2d-1 consuming 0..d-1) are the present all-reduces' results, already local: no
extra message. Layers whose partials nobody consumes (the last d) send nothing.

`receive_skew` is a fault injector for tests: consume every message `skew` layers early.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..model import Backbone, Laneformer, _Proj
from ..rope import inv_frequencies
from .exchange import Exchange
from .placement import Placement


class ParallelLaneformer(nn.Module):
    def __init__(self, place: Placement, exchange: Exchange | None = None, receive_skew: int = 0):
        super().__init__()
        g = self.global_cfg = place.cfg
        self.place = place
        # `cfg` describes the shard (lanes, heads, FFN units local; layers, vocab global), so
        # Engine sizes its KV cache for the local KV heads only.
        self.cfg = cfg = place.local_cfg
        self.exchange = exchange or Exchange()
        self.model = Backbone(cfg)
        a, b = place.vocab_chunk()
        D, n = g.hidden_size, cfg.num_lanes
        if g.lm_head_type == "vocab_parallel":
            self.lm_head = _Proj((n, g.vocab_size // g.num_lanes, D))
        elif g.lm_head_type == "lane":
            self.lm_head = nn.Module()
            self.lm_head.linear = nn.Linear(g.num_lanes * D, b - a, bias=False)
        elif not g.tie_word_embeddings:
            self.lm_head = nn.Linear(D, b - a, bias=False)
        with torch.device("cpu"):  # even when built on meta: meta ops would import dynamo
            inv_freq = inv_frequencies(g.head_dim, g.rope_theta, g.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.bytes_loaded = 0
        N = g.num_layers
        if place.splits_lanes:
            self.modes = [g.reduce_mode(i) for i in range(N)]
            srcs = [g.past_source(i) for i in range(N)]
            self.sources = [None if s is None else s + receive_skew for s in srcs]
        else:  # tensor parallelism: an all-reduce after every module
            self.modes, self.sources = ["present"] * N, [None] * N
        self.sends = [i in self.sources for i in range(N)]

    @property
    def vocab_offset(self) -> int:
        return self.place.vocab_chunk()[0]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens (B, S) -> this rank's vocab chunk of the logits, (B, S, V_r)."""
        # the whole model's prologue and epilogue (they read cfg, inv_freq, embedding, head)
        h, positions, cos, sin = Laneformer.embed(self, tokens, positions, cache)
        kept: dict[str, tuple] = {}  # "A3" -> (message or sum, own per-lane partials)
        for i, block in enumerate(self.model.layers):
            a = block.attention(block.attention_norm(h), cos, sin, positions, cache)
            h = h + self._reduce(i, "A", a, kept)
            m = block.feed_forward(block.ffn_norm(h))
            h = h + self._reduce(i, "M", m, kept)
        if kept:  # a message sent but never consumed would desynchronise the ranks
            raise AssertionError(f"unconsumed DTP messages: {sorted(kept)}")
        return Laneformer.finish(self, h, tokens.shape[1], cache, last_only)  # our own head

    def _reduce(self, i: int, mod: str, y: torch.Tensor, kept: dict) -> torch.Tensor:
        ex, mode, tag = self.exchange, self.modes[i], f"{mod}{i}"
        if mode == "present":
            total = ex.all_reduce(y.sum(-2, keepdim=True), tag)
            if self.sends[i]:
                kept[tag] = (total, y)  # Option A: the sum is already here
            return total
        if self.sends[i]:
            kept[tag] = (ex.start(y.sum(-2, keepdim=True), tag), y)
        if mode == "no_reduce":
            return y * math.sqrt(self.global_cfg.num_lanes)
        src = self.sources[i]
        if src is None:  # Option B at layers d..2d-1: nothing arrives yet
            return y
        msg, own = kept.pop(f"{mod}{src}")
        total = msg if isinstance(msg, torch.Tensor) else ex.wait(msg, consumer=tag)
        return y + (total - own)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, lane aggregation and this rank's rows of the LM head (laneformer.md 6)."""
        g, norm, ex = self.global_cfg, self.model.norm, self.exchange
        B, S, n, D = h.shape
        if g.lm_head_type == "vocab_parallel":  # local lanes own the local vocab slices
            return self.lm_head(norm(h)).reshape(B, S, -1)
        if g.lm_head_type == "lane":
            x = torch.cat(ex.all_gather(norm(h), "gather_lanes"), -2)  # lanes in rank order
            return self.lm_head.linear(x.reshape(B, S, g.num_lanes * D))
        if not self.place.splits_lanes:  # one lane, replicated on every rank
            z = norm(h.sum(-2)) if g.pre_norm_lane_agg else norm(h).mean(-2)
        elif g.pre_norm_lane_agg:
            z = norm(ex.all_reduce(h.sum(-2), "sum_lanes", "head"))
        else:
            z = ex.all_reduce(norm(h).sum(-2), "sum_lanes", "head") / g.num_lanes
        if g.tie_word_embeddings:
            a, b = self.place.vocab_chunk()
            return F.linear(z, self.model.tok_embeddings.weight[a:b])
        return self.lm_head(z)
