"""One rank on one namespace "host", for tests/test_hosts.py: `python netns_rank.py PLAN RANK`.

PLAN (JSON) lists phases; each joins a group of `world` ranks at `endpoint` with the multi-host
flags' Rendezvous (ranks >= world skip it), then:

- "cases": for every checkpoint, the gathered logits of PROMPT and GREEDY tokens, saved by rank
  r to `{out}.{r}`;
- "victim" (optional, after the cases): a long greedy request on `kill_path` in which rank
  `victim` exits abruptly after `after` tokens; every other rank saves to `{out}.kill.{r}`
  what ended its request (it must be GroupLostError, from the peer's closed connection, not
  from a timeout) and whether a later request is refused.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from expresslane.parallel import ParallelEngine, load_shard
from expresslane.parallel.exchange import gather_vocab
from expresslane.parallel.launch import init_distributed
from expresslane.parallel.rendezvous import GroupLostError, Rendezvous, parse_endpoint
from expresslane.sampling.params import SamplingParams

PROMPT = [1, 17, 40, 5, 88, 23, 9, 61]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def cases(rank: int, world: int, paths: dict) -> dict:
    out = {}
    for name, path in paths.items():
        model = load_shard(path, rank, world, device="cpu")
        engine = ParallelEngine(model, max_model_len=64, prefill_chunk=5)
        with torch.no_grad():
            local = model(torch.tensor([PROMPT]))[0]
            logits = gather_vocab(model.exchange, local, model.place.vocab_sizes)
        out[name] = dict(logits=logits, greedy=list(engine.generate(PROMPT, GREEDY)))
    return out


def kill(rank: int, world: int, phase: dict) -> dict:
    model = load_shard(phase["kill_path"], rank, world, device="cpu")
    engine = ParallelEngine(model, max_model_len=256)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    got, t_last = 0, time.monotonic()
    try:
        for _ in engine.generate(PROMPT, params):
            got, t_last = got + 1, time.monotonic()
            if rank == phase["victim"] and got == phase["after"]:
                sys.stdout.flush()
                os._exit(17)  # no goodbye: the peers see a closed connection
    except GroupLostError as e:
        waited = time.monotonic() - t_last
        return dict(error=type(e).__name__, message=str(e), tokens=got, waited_s=waited,
                    refused_after=_again(engine))  # fmt: skip
    return dict(error=None, tokens=got)


def _again(engine: ParallelEngine) -> str:
    """A request after the loss: refused at once with the same error."""
    try:
        list(engine.generate(PROMPT, GREEDY))
    except GroupLostError as e:
        return type(e).__name__
    return "accepted"


def main() -> None:
    plan, rank = json.loads(open(sys.argv[1]).read()), int(sys.argv[2])
    for phase in plan["phases"]:
        world = phase["world"]
        if rank >= world:
            continue
        host, port = parse_endpoint(phase["endpoint"])
        rdzv = Rendezvous(world, rank, host, port, plan["timeout_s"])
        init_distributed(rank, world, "cpu", threads=1, rdzv=rdzv)
        torch.save(cases(rank, world, phase["cases"]), f"{phase['out']}.{rank}")
        if "victim" in phase:
            torch.save(kill(rank, world, phase), f"{phase['out']}.kill.{rank}")
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
