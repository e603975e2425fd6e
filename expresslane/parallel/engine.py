"""ParallelEngine: the Engine over a ParallelLaneformer, run by every rank in lockstep.

Every rank holds its own shard, KV cache and sampler state and makes the same calls in the same
order; the collectives inside the forward keep them together, and the token pick is
vocab-parallel (exchange.sample_sharded), so every rank gets the same token without anyone
gathering all logits (greedy and plain temperature sampling).

Two ways to keep the ranks' calls identical:

- "spmd": every rank runs the same program (run, bench, tests): nothing extra is exchanged.
- "lead" / "follow" (serve): rank 0 takes requests; before each request it broadcasts it, and
  before every prefill chunk and decode step a go/stop flag (cancellation, a closed stream),
  while ranks > 0 sit in `follow()`. The flag is one tiny blocking broadcast per token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from ..config import SamplingParams
from ..engine import Engine, Stats, Step
from ..sampler import make_generator, sample
from .exchange import gather_vocab, sample_sharded
from .model import ParallelLaneformer
from .placement import load_shard

ROLES = ("spmd", "lead", "follow")


class ParallelEngine(Engine):
    def __init__(
        self,
        model: ParallelLaneformer,
        max_model_len: int | None = None,
        prefill_chunk: int = 512,
        role: str = "spmd",
    ):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        super().__init__(model, max_model_len, prefill_chunk)  # cache for the local KV heads
        self.cfg = model.global_cfg
        self.ex, self.place, self.role = model.exchange, model.place, role

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
        **kw,
    ) -> ParallelEngine:
        model = load_shard(path, rank, world, device=device, dtype=dtype)
        return cls(model, max_model_len=max_model_len, role=role, **kw)

    # --- keeping ranks together ---------------------------------------------------------------
    def _announce(self, what: tuple | None) -> tuple:
        """Rank 0 (lead) sends what every rank is about to do; followers receive it."""
        box = [what]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _go(self, cancel: threading.Event | None) -> bool:
        stop = cancel is not None and cancel.is_set()
        if self.role == "spmd" or self.ex.world == 1:
            return not stop
        flag = torch.tensor([0 if stop else 1], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _stop(self) -> None:
        """Lead: tell the followers that the stream ended early (closed or cancelled)."""
        dist.broadcast(torch.tensor([0], device=self.device), src=0)

    def _with_seed(self, params: SamplingParams) -> SamplingParams:
        """A sampled request needs the same noise everywhere: rank 0's seed when none is given."""
        if params.greedy or params.seed is not None or self.ex.world == 1:
            return params
        seed = torch.randint(0, 2**62, (1,), device=self.device)
        if self.role == "spmd":  # the lead sends its seed with the request instead
            dist.broadcast(seed, src=0)
        return replace(params, seed=int(seed))

    def follow(self) -> None:
        """Ranks > 0 in "follow" role: do what rank 0 announces until it says shutdown."""
        while True:
            what = self._announce(None)
            if what[0] == "shutdown":
                return
            if what[0] == "generate":
                for _ in self.generate_steps(what[1], what[2]):
                    pass
            elif what[0] == "score":
                self.prompt_logprobs(what[1])

    def shutdown(self) -> None:
        if self.role == "lead" and self.ex.world > 1:
            self._announce(("shutdown",))

    # --- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event | None = None):
        """Fill the cache; returns this rank's vocab chunk of the last logits, or None."""
        self.cache.reset()
        ids = torch.tensor(prompt_ids, device=self.device, dtype=torch.long)[None]
        logits = None
        for start in range(0, ids.shape[1], self.prefill_chunk):
            if not self._go(cancel):
                return None
            logits = self.model(
                ids[:, start : start + self.prefill_chunk], cache=self.cache, last_only=True
            )
        return logits[0, -1]

    def _pick(self, logits, params, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token, full logits when logprobs were asked for)."""
        if params.logprobs is not None:
            full = gather_vocab(self.ex, logits, self.place.vocab_sizes)
            return sample(full, params, gen), full
        offset = self.model.vocab_offset
        return sample_sharded(self.ex, logits, params, gen, offset, self.place.vocab_sizes), None

    @torch.inference_mode()
    def generate_steps(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        cancel: threading.Event | None = None,
    ) -> Iterator[Step]:
        """Engine.generate_steps with the vocab-parallel pick and the lead/follow flags."""
        params.validate()
        self.check_prompt(prompt_ids)
        if self.role != "follow":
            params = self._with_seed(params)
        if self.role == "lead" and self.ex.world > 1:
            self._announce(("generate", list(prompt_ids), params))
        budget = min(params.max_tokens, self.max_len - len(prompt_ids))
        stops = self.stop_ids(params)
        gen = make_generator(params, self.device)
        self.stats = st = Stats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        if budget == 0:
            st.finish_reason = "length"
            return
        logits = self.prefill(prompt_ids, cancel)
        done = False
        try:
            for i in range(budget):
                if logits is None:
                    st.finish_reason = "abort"
                    done = True
                    return
                tok, full = self._pick(logits, params, gen)
                step = self.make_step(tok, full, params, stops, i == budget - 1, t0)
                done = step.finish_reason is not None  # every rank knows: no flag needed
                yield step
                if done:
                    return
                if not self._go(cancel):
                    st.finish_reason, done = "abort", True
                    return
                logits = self.model(tok.view(1, 1), cache=self.cache)[0, -1]
        finally:
            if not done and self.role == "lead" and self.ex.world > 1:
                self._stop()

    @torch.inference_mode()
    def prompt_logprobs(
        self, prompt_ids: Sequence[int], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """log-softmax at every prompt position: (S, V) fp32, the vocab chunks gathered.

        `cancel` is not checked here: the followers would need a go flag per chunk, and a
        scoring prefill is one forward; cancellation takes effect at the next request.
        """
        self.check_prompt(prompt_ids)
        if self.role == "lead" and self.ex.world > 1:
            self._announce(("score", list(prompt_ids)))
        self.cache.reset()
        ids = torch.tensor(prompt_ids, device=self.device, dtype=torch.long)[None]
        out = [
            gather_vocab(
                self.ex,
                self.model(ids[:, s : s + self.prefill_chunk], cache=self.cache)[0],
                self.place.vocab_sizes,
            )
            for s in range(0, ids.shape[1], self.prefill_chunk)
        ]
        return torch.cat(out).float().log_softmax(-1)
