"""ParallelEngine: the Engine over a ParallelLaneformer, run by every rank in lockstep.

Every rank holds its own shard, KV cache and sampler state and makes the same calls in the same
order; the collectives inside the forward keep them together, and the token pick is
vocab-parallel (exchange.sample_sharded), so every rank gets the same token without anyone
gathering all logits (greedy and plain temperature sampling).

Two ways to keep the ranks' calls identical:

- "spmd": every rank runs the same program (run, bench, tests): nothing extra is exchanged.
- "lead" / "follow" (serve): rank 0 takes requests; before each request it broadcasts it, and
  before every prefill chunk, after the last and before every decode step a go/stop flag
  (cancellation, a closed stream), while ranks > 0 sit in `follow()`. The flag is one tiny
  blocking broadcast per token.

A lost peer (gone, or silent past the group's timeout) ends the request on every rank with
`GroupLostError` (parallel/rendezvous.py), and the engine refuses all later work with the same
error: the group must be restarted. An idle lead sends an "idle" announcement every
`idle_interval` seconds (the server's worker calls `idle()`), so that followers never wait on
a collective longer than the timeout, and a follower lost while nobody asks is noticed anyway.

The generation loop itself is Engine.generate_steps (prefill and decode steps give each rank its
vocab chunk of the logits); this file supplies its hooks: the request's start (seed,
announcement), the go flag, the vocab-parallel pick, the lead's stop flag for a closed stream,
and where a prefill may start with prefix reuse (the starts every rank's cache allows: ranks
decide alike, but a rank whose forward failed must not pull the others into its cache state).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from ..engine import Engine
from ..generation import Step
from ..sampling.params import SamplingParams
from ..sampling.sampler import sample
from ..step.prefill import PREFILL_CHUNK
from .exchange import gather_vocab, sample_sharded
from .model import ParallelLaneformer
from .rendezvous import GroupLostError, group_guard, is_peer_failure, joined_timeout_s
from .shard import load_shard

ROLES = ("spmd", "lead", "follow")


class ParallelEngine(Engine):
    grammars = False  # the vocab-parallel pick takes no token mask yet
    adjusts_logits = False  # nor a request's penalties (its logits are this rank's share)
    predicts = False  # nor drafts: its decode is eager, one token a step

    def __init__(
        self,
        model: ParallelLaneformer,
        max_model_len: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        role: str = "spmd",
        prefix_reuse: bool = True,
        kv_cache_dtype: str = "auto",
    ):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        # The cache holds the local KV heads. Eager decode: a pick exchanges between ranks, which
        # the single-device decode graph (sampler inside the step) has no place for. No prefill
        # warm-up: a prefill exchanges too, and this rank's exchange is not set up yet.
        super().__init__(model, max_model_len, prefill_chunk, decode="eager",
                         prefix_reuse=prefix_reuse, prefill_warmup=False,
                         kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        self.cfg = model.global_cfg
        self.ex, self.place, self.role = model.exchange, model.place, role
        self.lost: GroupLostError | None = None
        self.on_lost: list[Callable[[GroupLostError], None]] = []  # e.g. stop the server

    # --- a group that lost a rank ---------------------------------------------------------------
    def _guard(self):
        if self.lost is not None:
            raise GroupLostError(str(self.lost))
        return group_guard(self._lose)

    def _lose(self, err: GroupLostError) -> None:
        self.lost = err
        for fn in self.on_lost:
            fn(err)

    @property
    def idle_interval(self) -> float | None:
        """Seconds between the idle lead's announcements (None: nobody waits on this rank)."""
        if self.role != "lead" or self.ex.world == 1 or self.lost is not None:
            return None
        return min(30.0, joined_timeout_s() / 4)

    def idle(self) -> None:
        """Lead, between requests: tell the followers it is alive (they time out otherwise)."""
        with self._guard():
            self._announce(("idle",))

    def generate_steps(self, prompt_ids, params, cancel=None) -> Iterator[Step]:
        with self._guard():
            yield from super().generate_steps(prompt_ids, params, cancel)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        rank: int = 0,
        world: int = 1,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        role: str = "spmd",
        lora: tuple[tuple[str, float], ...] = (),
        **kw,
    ) -> ParallelEngine:
        model = load_shard(path, rank, world, device=device, dtype=dtype, lora=lora)
        return cls(model, max_model_len=max_model_len, role=role, **kw)

    # --- keeping ranks together ---------------------------------------------------------------
    def _announce(self, what: tuple | None) -> tuple:
        """Rank 0 (lead) sends what every rank is about to do; followers receive it."""
        box = [what]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _with_seed(self, params: SamplingParams) -> SamplingParams:
        """A sampled request needs the same noise everywhere: rank 0's seed when none is given."""
        if params.greedy or params.seed is not None or self.ex.world == 1:
            return params
        seed = torch.randint(0, 2**62, (1,), device=self.device)
        if self.role == "spmd":  # the lead sends its seed with the request instead
            dist.broadcast(seed, src=0)
        return replace(params, seed=int(seed))

    # --- Engine.generate_steps hooks: the vocab-parallel pick and the lead/follow flags ---------
    def _begin(self, prompt_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Agree on the seed; the lead announces the request to its followers."""
        if self.role != "follow":
            params = self._with_seed(params)
        if self.role == "lead" and self.ex.world > 1:
            self._announce(("generate", list(prompt_ids), params))
        return params

    def _go_on(self, cancel: threading.Event | None) -> bool:
        """spmd: this rank's own answer. lead/follow: rank 0's, broadcast (only it has a cancel)."""
        stop = cancel is not None and cancel.is_set()
        if self.role == "spmd" or self.ex.world == 1:
            return not stop
        flag = torch.tensor([0 if stop else 1], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _pick(self, logits, params, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token, full logits when logprobs were asked for); `logits` is this rank's chunk."""
        if params.logprobs is not None:
            full = gather_vocab(self.ex, logits, self.place.vocab_sizes)
            return sample(full, params, generator), full
        offset, sizes = self.model.vocab_offset, self.place.vocab_sizes
        return sample_sharded(self.ex, logits, params, generator, offset, sizes), None

    def _agree_starts(self, valid: torch.Tensor) -> torch.Tensor:
        """The prefill starts every rank's cache allows: the intersection (MIN of 0/1)."""
        if self.ex.world == 1:
            return valid
        flags = valid.to(device=self.device, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.ex.group)
        return flags.cpu().bool()

    def _left_early(self) -> None:
        """Lead: the followers wait on the next go flag; a stop flag ends their request too."""
        exc = sys.exc_info()[1]  # set when an error ends the loop
        if exc is not None and is_peer_failure(exc):
            return  # the group is gone: nobody is waiting
        if self.role == "lead" and self.ex.world > 1:
            dist.broadcast(torch.tensor([0], device=self.device), src=0)

    def follow(self) -> None:
        """Ranks > 0 in "follow" role: do what rank 0 announces until it says shutdown."""
        while True:
            with self._guard():
                what = self._announce(None)
            if what[0] == "shutdown":
                return
            if what[0] == "generate":
                for _ in self.generate_steps(what[1], what[2]):
                    pass
            elif what[0] == "score":
                self.prompt_logprobs(what[1])

    def shutdown(self) -> None:
        if self.role == "lead" and self.ex.world > 1 and self.lost is None:
            with self._guard():
                self._announce(("shutdown",))

    @torch.inference_mode()
    def prompt_logprobs(
        self, prompt_ids: Sequence[int], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """log-softmax at every prompt position: (S, V) fp32, the vocab chunks gathered.

        `cancel` is not checked here: the followers would need a go flag per chunk, and a
        scoring prefill is one forward; cancellation takes effect at the next request.
        """
        self.check_prompt(prompt_ids)
        with self._guard():
            return self._score(prompt_ids)

    def _score(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        if self.role == "lead" and self.ex.world > 1:
            self._announce(("score", list(prompt_ids)))
        self.cache.reset()
        ids = torch.tensor(prompt_ids, device=self.device, dtype=torch.long)[None]
        out = []
        for s in range(0, ids.shape[1], self.prefill_chunk):
            local = self.model(ids[:, s : s + self.prefill_chunk], cache=self.cache)[0]
            self.cache.commit(prompt_ids[s : s + self.prefill_chunk])
            out.append(gather_vocab(self.ex, local, self.place.vocab_sizes))
        return torch.cat(out).float().log_softmax(-1)
