"""Prefix reuse: a prompt starts from what the KV cache already holds of it.

An agent sends its whole conversation again every turn, and almost all of it was in the cache a
moment ago. `PrefixReuse.start(prompt)` finds the longest prefix of the prompt whose keys and
values are still right in every layer, truncates the cache to it and returns its length r; the
engine then prefills only prompt[r:].

Which r can be resumed from (the cache's `tokens` say which id sits behind each position):

- r <= the common prefix of `cache.tokens` and the prompt, and r <= len(prompt) - 1: the last
  prompt position is always computed, for its logits.
- A full-attention layer holds every committed position, so any such r.
- A sliding-window ring (cap slots, slot = position % cap) keeps only its newest positions. A
  query at r sees the keys of r-window+1 .. r, so the ring must still hold r-window+1 .. r-1.
  After a request that wrote N positions into a ring of cap = window slots, that is r in
  {N-1, N} (any r <= N while N <= cap): the common case, a prompt that extends the previous
  prompt plus its completion, hits. The check reads the ring's `pos`, so positions written but
  never committed (a forward that failed, a decode graph that ran ahead) count as what they
  are: slots overwritten.
- The rings as they were after the last prefill are kept (`RingSnapshot`, a copy on the cache's
  device): a prompt that extends the previous *prompt* but not its completion (the client
  re-tokenized or edited the answer) resumes at the end of that prompt instead of at 0.

Where a layer cannot resume at r, a smaller r is taken, down to 0: a cold prefill.

Exactness: a prefill that starts at r is one more chunk of a chunked prefill. A key at position
p is a function of tokens 0..p only, and the DTP delayed partials (model.py) are per position
inside one forward, so nothing but the cache crosses a chunk boundary. Logits equal a cold
prefill's to fp rounding (the matrices have other shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .cache import KVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])


def ring_starts(pos: torch.Tensor, window: int, limit: int, size: int) -> torch.Tensor:
    """(size,) bool: may a prefill start at r, for r <= limit, with the ring that holds `pos`?

    `pos` (cap,) is the position each slot holds (host tensor). A query at r needs the keys of
    positions max(0, r - window + 1) .. r - 1: all of them must be in their slots.
    """
    cap = pos.shape[0]
    p = torch.arange(limit)
    held = (pos[p % cap] == p).long()
    count = F.pad(held.cumsum(0), (1, 0))  # count[j]: positions < j the ring holds
    r = torch.arange(limit + 1)
    lo = (r - window + 1).clamp(min=0)
    out = torch.zeros(size, dtype=torch.bool)
    out[: limit + 1] = count[r] - count[lo] == r - lo
    return out


class RingSnapshot:
    """The ring layers' slots (keys, values, positions) after the last prefill, on the cache's
    device, and the token ids they were computed from. Allocated on first use: as much memory
    as the rings themselves."""

    def __init__(self, cache: KVCache, layers: list[int]):
        self.cache, self.layers = cache, layers
        self.tokens: list[int] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def take(self) -> None:
        c = self.cache
        if self.saved is None:
            self.saved = [(c.k[i].clone(), c.v[i].clone(), c.pos[i].clone()) for i in self.layers]
        else:
            for (k, v, p), i in zip(self.saved, self.layers, strict=True):
                k.copy_(c.k[i]), v.copy_(c.v[i]), p.copy_(c.pos[i])
        self.tokens = list(c.tokens)

    def restore(self, j: int) -> None:
        """Put ring layer number j (of `layers`) back as it was saved."""
        k, v, p = self.saved[j]
        i = self.layers[j]
        self.cache.k[i].copy_(k), self.cache.v[i].copy_(v), self.cache.pos[i].copy_(p)


class PrefixReuse:
    """Decides where a prompt's prefill starts; counts what it reused.

    Counters: `requests` (prompts looked up), `queried_tokens`, `hits` (prompts that reused at
    least one token), `reused_tokens`, `snapshot_hits` (hits that needed the ring snapshot).
    """

    def __init__(self, cache: KVCache, enabled: bool = True):
        self.cache, self.enabled = cache, enabled
        # rings that can lose positions; a ring as long as the context never wraps
        self.rings = [
            i
            for i, w in enumerate(cache.windows)
            if w is not None and cache.k[i].shape[0] < cache.max_len
        ]
        self.snapshot = RingSnapshot(cache, self.rings) if enabled and self.rings else None
        self.requests = self.queried_tokens = self.hits = self.reused_tokens = 0
        self.snapshot_hits = 0

    def start(
        self,
        prompt_ids: Sequence[int],
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> int:
        """Truncate the cache to the longest reusable prefix of the prompt; return its length.

        `agree` maps the (len(prompt),) bool tensor of valid starts to the one every rank of a
        parallel engine shares (their intersection), so all ranks start at the same position.
        """
        if not self.enabled:
            self.cache.reset()
            return 0
        valid, now = self._plan(prompt_ids)
        if agree is not None:
            valid = agree(valid)
        r = int(valid.nonzero().max())  # valid[0] always holds
        restored = [j for j, ok in enumerate(now) if not ok[r]]
        for j in restored:  # this ring can start at r only as the snapshot holds it
            self.snapshot.restore(j)
        self.cache.truncate(r)
        self.requests += 1
        self.queried_tokens += len(prompt_ids)
        self.hits += r > 0
        self.reused_tokens += r
        self.snapshot_hits += bool(restored) and r > 0
        return r

    def prefilled(self) -> None:
        """The whole prompt is in: keep the rings as they are now, before decoding wraps them."""
        if self.snapshot is not None:
            self.snapshot.take()

    def _plan(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(valid starts, (m,) bool; and per ring layer, the starts its current slots allow)."""
        m, cache = len(prompt_ids), self.cache
        limit = min(common_prefix(cache.tokens, prompt_ids), m - 1)
        valid = torch.arange(m) <= limit
        if limit == 0 or not self.rings:
            return valid, []
        snap = self.snapshot
        kept = snap is not None and snap.saved is not None
        snap_limit = min(limit, common_prefix(snap.tokens, prompt_ids)) if kept else 0
        # one transfer for every ring's positions, current and saved
        parts = [cache.pos[i] for i in self.rings]
        if snap_limit > 0:
            parts += [p for _, _, p in snap.saved]
        held = torch.cat(parts).cpu().split([p.shape[0] for p in parts])
        now = []
        for j, i in enumerate(self.rings):
            w = cache.windows[i]
            ok = ring_starts(held[j], w, limit, m)
            now.append(ok)
            if snap_limit > 0:
                ok = ok | ring_starts(held[len(self.rings) + j], w, snap_limit, m)
            valid &= ok
        return valid, now
