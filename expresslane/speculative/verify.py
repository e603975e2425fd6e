"""The verify step of speculative decoding: the last token and k drafts in one model call.

The model scores tokens [t, d_1 .. d_k] at positions [p, p + 1 .. p + k] against the KV cache,
`speculative.accept` keeps the longest agreeing prefix plus one token of the model's own, and
the cache is left as if the rejected drafts had never been written: their slots are marked
empty (`cache.truncate` on the host, `forget` inside a captured step), and only the last token
and the kept drafts are committed to `cache.tokens` (what prefix reuse compares prompts with).
That alone is not enough on sliding-window layers: writing p + j into a ring of `window` slots
overwrites the key of p + j - window, which the queries after p still need when the draft is
rejected. So the engine gives rings `headroom` = k extra slots (cache.py): then a draft's slot
only ever held a key that is out of every later query's window.

Three forms with the same arithmetic:
- `verify_eager`: the model's plain forward on the growing cache (the eager engine, and
  whenever logprobs are asked for); returns the logits of every row.
- `verify_packed`: where the decode step runs on packed weights (a CPU's static path), the same
  step for the k + 1 rows (packed_verify.py: each weight read once for all of them; on the C
  path each row has the bits of a plain step); returns the logits of every row.
- `VerifyGraph`: fixed k, static buffers, acceptance on the device, one host copy of
  [n, tokens] per step; captured in a CUDA graph on a GPU exactly like the decode step (it is a
  DecodeGraph whose step is the verify), run eagerly elsewhere (tests prove that path on a CPU).
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..config import SamplingParams
from ..model import Laneformer
from ..step.graph import DecodeGraph
from ..step.packed_verify import PackedVerifier
from .drafting import accept


def forget(cache: KVCache, positions: torch.Tensor, keep: torch.Tensor) -> None:
    """Mark the slots written for `positions` (S,) empty where `keep` (S,) is False.

    Device-side and shape-static (no host sync), so a captured verify step runs it too.
    """
    for pc in cache.pos:
        slots = positions % pc.shape[0]  # rings wrap; full layers: slot == position
        pc.index_copy_(0, slots, torch.where(keep, positions, -1))


@torch.inference_mode()
def verify_eager(
    model: Laneformer,
    cache: KVCache,
    token: int,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor]:
    """Verify `drafts` after `token` (at position cache.length) -> (new tokens, logits (S, V)).

    The new tokens are the kept drafts and the model's own token (1 .. k + 1 of them); row j of
    the logits is the distribution that token j was chosen from. The cache ends holding `token`
    and the kept drafts, committed (cache.tokens); the rejected ones are truncated away.
    """
    dev = cache.k[0].device
    start = cache.length
    ids = torch.tensor([[token, *drafts]], device=dev)  # (1, S)
    logits = model(ids, cache=cache)[0]  # (S, V); the cache advanced by S
    return settle(cache, start, ids[0], logits, params, generator), logits


@torch.inference_mode()
def verify_packed(
    verifier: PackedVerifier,
    cache: KVCache,
    token: int,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], torch.Tensor]:
    """verify_eager on the packed decode step's weights (packed_verify.py, each weight read once
    for the k + 1 rows): the same acceptance, commit and truncation."""
    start = cache.length
    ids = [token, *drafts]
    logits = verifier.logits(ids, start)  # (S, V); writes positions start .. start + k
    return settle(cache, start, torch.tensor(ids), logits, params, generator), logits


def settle(cache: KVCache, start: int, ids: torch.Tensor, logits: torch.Tensor,
           params: SamplingParams, generator: torch.Generator | None) -> list[int]:  # fmt: skip
    """Accept against logits (S, V) for ids (S,) written from `start` -> the new tokens; commit
    the last token and the kept drafts, truncate the rejected ones away."""
    kept, tokens = accept(logits, ids[1:].to(logits.device), params, generator)
    out = torch.cat((kept.view(1), tokens)).tolist()  # the one host copy
    n, new = out[0], out[1 : out[0] + 2]
    cache.commit([int(ids[0]), *new[:-1]])  # the last token and the kept drafts: final
    if n < ids.shape[0] - 1:
        cache.truncate(start + n + 1)  # the rejected drafts' slots emptied
    return new


class VerifyGraph(DecodeGraph):
    """The verify step for a fixed k on static buffers (captured on CUDA, eager elsewhere).

    Inputs: `token` (1, k + 1) = [last token, drafts], `pos` (1,) = the last token's position.
    Output: `out` (k + 2,) = [n kept, tokens (k + 1,)]. It shares the request's generator with
    the decode graph (registered with every graph that draws from it), so one seed drives the
    whole request. Capture warms up and undoes the warm-up (cache slots of all k + 1 positions,
    inputs, RNG) through DecodeGraph's own snapshot, as `steps` = k + 1 covers those positions.
    """

    def __init__(
        self,
        model: Laneformer,
        cache: KVCache,
        params: SamplingParams,
        k: int,
        generator: torch.Generator | None,
        capture: bool | None = None,
    ):
        super().__init__(model, cache, params, steps=k + 1, capture=capture)
        dev = cache.k[0].device
        self.k = k
        self.generator = generator
        self.token = torch.zeros((1, k + 1), dtype=torch.long, device=dev)
        self.out = torch.zeros((k + 2,), dtype=torch.long, device=dev)
        self.offsets = torch.arange(k + 1, device=dev)

    def _step_loop(self) -> None:  # DecodeGraph bounds the cache's live slots around it
        positions = self.pos + self.offsets  # (k + 1,)
        logits = self.model(self.token, positions=positions, cache=self.cache)[0]  # (k+1, V)
        kept, tokens = accept(logits, self.token[0, 1:], self.params, self.generator, self.knobs)
        self.out[0] = kept
        self.out[1:] = tokens
        forget(self.cache, positions, self.offsets <= kept)

    def load_drafts(self, token: int, drafts: list[int], position: int) -> None:
        """Inputs for one step: drafts shorter than k are padded (a pad token that the model
        happens to agree with is a correct token like any other)."""
        pad = [drafts[-1]] * (self.k - len(drafts))
        self.token.copy_(torch.tensor([[token, *drafts, *pad]]), non_blocking=True)
        self.pos.fill_(position)
        self.host_pos = position  # the live slot bound: position + k + 1

    def set_params(self, params: SamplingParams) -> None:
        """The request's sampler values; the seed belongs to the shared generator's owner."""
        self.knobs.load(params)

    def verify(self) -> list[int]:
        """Run the step; [n, tokens] on the host (the one copy)."""
        return self.run().tolist()
