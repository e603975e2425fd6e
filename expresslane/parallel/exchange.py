"""The exchange between ranks: collectives issued at once and waited on only where consumed.

Everything goes through `torch.distributed` (NCCL on GPUs, gloo on CPUs): `start` issues an
asynchronous all-reduce of this rank's partial sum (laneformer.md 8.2: a rank holding several
lanes sends their sum; the all-reduce of rank sums is the sum over all lanes) and returns a
`Message`; `wait` blocks on it where the sum is consumed, `broadcast_delay` layers later. A
"present" reduce is `start` then `wait` at once.

Tracing records, per message, when it was issued, when the collective completed (a future
callback), when the consumer asked for it and how long that wait blocked, relative to the start
of the traced step. Injected latency (gloo only) models a slower link honestly: a message counts
as delivered `latency_s` after the collective really completed, and `wait` polls until then
(polling, not sleeping: a sleeping process on a busy CPU wakes up milliseconds late); a wait
that comes later than that does not block at all. The same rule applies to every
message, blocking or delayed, so DTP and immediate all-reduces pay the same per-message price.

The vocab-parallel token pick lives here too: greedy takes each rank's (max, global index) and
exchanges the pairs; plain temperature sampling on GPUs does the same exponential race as
`sampler.draw` (argmax of p / E) in log space with the same noise vector, drawn in full from
the shared seeded generator on every rank; filters, logprobs and every draw on CPUs gather the
logits and call the one-device sampler. (A CPU draws by the inverse CDF, one uniform a row:
drawing the race's noise there took 876 us a token, gathering 2 ranks' logits of a 49k
vocabulary over gloo is 4 V bytes. A sharded CDF would take three exchanges of scalars, and
bits equal to the one-device draw's only with a shared maximum.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..sampling.params import SamplingParams
from ..sampling.sampler import sample


@dataclass
class Message:
    tag: str  # "A3" / "M3" (module and layer) or a head/sampling name
    kind: str  # "present", "dtp" or "head"
    buf: Any  # the tensor reduced in place, or the list an all-gather fills
    work: Any = None
    fut: Any = None
    t_issue: float = 0.0
    t_done: list = field(default_factory=list)  # set by the completion callback


class Exchange:
    def __init__(self, group=None, latency_s: float = 0.0):
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        self.backend = dist.get_backend(group) if on else "none"
        self.latency_s = 0.0
        self.set_latency(latency_s)
        self.events: list[dict] | None = None
        self.t0 = time.perf_counter()

    def set_latency(self, seconds: float) -> None:
        if seconds and self.world > 1 and self.backend != "gloo":
            raise ConfigError(f"injected latency needs the gloo backend, not {self.backend}")
        self.latency_s = seconds

    def trace(self, on: bool = True) -> None:
        """Start (or stop) recording events; times are relative to this call."""
        self.events = [] if on else None
        self.t0 = time.perf_counter()

    # --- collectives ------------------------------------------------------------------------
    def start(self, t: torch.Tensor, tag: str, kind: str = "dtp") -> Message:
        """Issue an all-reduce (sum) of `t`, which the exchange now owns, without waiting."""
        msg = Message(tag, kind, t, t_issue=time.perf_counter())
        if self.world > 1:
            msg.work = dist.all_reduce(t, group=self.group, async_op=True)
            self._watch(msg)
        return msg

    def wait(self, msg: Message, consumer: str = "") -> Any:
        t_wait = time.perf_counter()
        if msg.work is not None:
            msg.work.wait()
            if msg.fut is not None:
                msg.fut.wait()
            if self.latency_s:  # poll like a receiver spinning on a flag; sleep(0) frees the GIL
                ready = msg.t_done[0] + self.latency_s
                while time.perf_counter() < ready:
                    time.sleep(0)
        if self.events is not None and msg.work is not None:
            end = time.perf_counter()
            ms = lambda t: round((t - self.t0) * 1e3, 3)  # noqa: E731
            self.events.append(
                dict(
                    rank=self.rank,
                    tag=msg.tag,
                    kind=msg.kind,
                    consumer=consumer or msg.tag,
                    issued_ms=ms(msg.t_issue),
                    done_ms=ms(msg.t_done[0]) if msg.t_done else None,
                    wait_ms=ms(t_wait),
                    blocked_ms=round((end - t_wait) * 1e3, 3),
                )
            )
        return msg.buf

    def all_reduce(self, t: torch.Tensor, tag: str, kind: str = "present") -> torch.Tensor:
        return self.wait(self.start(t, tag, kind))

    def all_gather(self, t: torch.Tensor, tag: str) -> list[torch.Tensor]:
        """Blocking all-gather of equal-shape tensors, in rank order."""
        if self.world == 1:
            return [t]
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        msg = Message(tag, "head", outs, t_issue=time.perf_counter())
        msg.work = dist.all_gather(outs, t, group=self.group, async_op=True)
        self._watch(msg)
        return self.wait(msg)

    def _watch(self, msg: Message) -> None:
        if self.latency_s or self.events is not None:
            msg.fut = msg.work.get_future().then(lambda _: msg.t_done.append(time.perf_counter()))


# --- vocab-parallel sampling ----------------------------------------------------------------
def pick_max(ex: Exchange, score: torch.Tensor, offset: int) -> torch.Tensor:
    """Global argmax of a vocab-sharded score (V_r,): ties go to the lowest global index."""
    i = score.argmax()
    if ex.world == 1:
        return i + offset
    pair = torch.stack((score[i].double(), (i + offset).double()))
    pairs = torch.stack(ex.all_gather(pair, "argmax"))  # (G, 2), ranks in vocab order
    return pairs[pairs[:, 0].argmax(), 1].long()  # first max = lowest rank = lowest index


def gather_vocab(ex: Exchange, logits: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The full (..., V) logits from each rank's (..., V_r) chunk (padded for uneven chunks)."""
    if ex.world == 1:
        return logits
    n = max(sizes)
    pad = logits.new_full((*logits.shape[:-1], n - logits.shape[-1]), float("-inf"))
    parts = ex.all_gather(torch.cat((logits, pad), -1), "gather_logits")
    return torch.cat([p[..., :s] for p, s in zip(parts, sizes, strict=True)], -1)


def is_plain_temperature(params: SamplingParams, vocab: int) -> bool:
    no_top_k = params.top_k <= 0 or params.top_k >= vocab
    return no_top_k and params.top_p >= 1.0 and params.min_p <= 0.0


def sample_sharded(
    ex: Exchange,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    offset: int,
    sizes: list[int],
) -> torch.Tensor:
    """sampler.sample for logits (V_r,) sharded by vocab: the same token on every rank."""
    vocab = sum(sizes)
    if params.greedy:
        return pick_max(ex, logits.float(), offset)
    if is_plain_temperature(params, vocab) and logits.device.type != "cpu":
        # argmax(p / E) == argmax(z / T - log E); E is the one-device noise vector, sliced.
        noise = torch.empty(vocab, dtype=torch.float32, device=logits.device)
        noise.exponential_(generator=generator)
        race = logits.float() / params.temperature - noise[offset : offset + logits.shape[-1]].log()
        return pick_max(ex, race, offset)
    return sample(gather_vocab(ex, logits, sizes), params, generator)
