"""DTP on real processes: a trace of one decode step per rank, and injected-latency hiding.

`python -m expresslane.bench.dtp_trace [--devices 2] [--latencies 0,1,2,4]` builds a random
Laneformer (or takes --model), splits its lanes over N gloo processes and prints:

1. the trace of one decode step per rank (exchange.Exchange events): for every message, when it
   was issued, when the collective completed, when its consumer waited and how long it blocked;
2. decode ms/token with a latency added to every message (gloo; see exchange.py: a message
   counts as delivered X ms after its collective really completed), for the model as configured
   (DTP: `broadcast_delay` layers present, then delayed messages) and for the same weights with
   an immediate all-reduce after every module (broadcast_delay = num_layers, "TP");

then one JSON line with everything. Per mode and latency, medians over --steps steps (each step
traced): ms/token, `added` over the same mode at 0 latency, and the ms blocked per token in
blocking waits (present layers, token pick) and in delayed waits. `delayed hidden` = 1 -
blocked in delayed waits / (delayed messages * latency): the share of the delayed messages'
injected latency that never reached the token time. Each run also records `message_ms`: the
median time of one blocking all-reduce of a hidden-size message (what the link really costs).
Timings on a shared CPU are noisy.

Across hosts, every host runs this command with the multi-host flags (`--nnodes N --node-rank
R --rdzv-endpoint HOST:PORT`, one rank each) and node 0 prints; `python -m
expresslane.bench.dtp_hosts` does that in network namespaces with delayed links.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from ..checkpoint import save_model
from ..cli.launch import spawn
from ..config import ModelConfig
from ..model import Laneformer, init_weights
from ..parallel import ParallelEngine, load_shard, rendezvous
from ..parallel.exchange import sample_sharded

PROMPT = [1, 17, 40, 5, 88, 23, 9, 61, 3, 14, 15, 92, 65, 35, 89, 79]


def random_checkpoint(args: argparse.Namespace, out: str) -> str:
    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="laneformer",
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.ffn,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            num_lanes=args.lanes,
            broadcast_delay=args.delay,
            lm_head_type="vocab_parallel",
            max_position_embeddings=256,
        )
    )
    save_model(init_weights(Laneformer(cfg), seed=0), out)
    return out


class _Decoder:
    """One engine decoding greedily, one timed step at a time."""

    greedy = True  # stands in for SamplingParams in sample_sharded

    def __init__(self, engine: ParallelEngine):
        self.engine, self.model, self.ex = engine, engine.model, engine.ex
        self.logits = None
        N, sends, modes = len(self.model.modes), self.model.sends, self.model.modes
        delayed = sum(sends[i] and modes[i] != "present" for i in range(N))
        self.blocking = 2 * modes.count("present") + 1  # two modules a layer, and the pick
        self.messages = self.blocking + 2 * delayed

    def restart(self, latency_ms: float) -> None:
        self.ex.set_latency(latency_ms / 1e3)
        self.logits = self.engine.prefill(PROMPT)

    def step(self) -> tuple[float, float, float]:
        """One traced step: (ms, ms blocked in blocking waits, ms blocked in delayed waits)."""
        e, ex = self.engine, self.ex
        dist.barrier()  # start together: time the step, not the other rank's lag
        ex.trace()
        t0 = time.perf_counter()
        tok = sample_sharded(
            ex, self.logits, self, None, self.model.vocab_offset, e.place.vocab_sizes
        )
        self.logits = self.model(tok.view(1, 1), cache=e.cache)[0, -1]
        took = (time.perf_counter() - t0) * 1e3
        self.trace = ex.events + [dict(rank=ex.rank, tag="step", blocked_ms=took)]
        ex.trace(False)
        late = sum(x["blocked_ms"] for x in self.trace[:-1] if x["kind"] == "dtp")
        now = sum(x["blocked_ms"] for x in self.trace[:-1] if x["kind"] != "dtp")
        return took, now, late


def _rank(rank: int, world: int, device: str, path: str, args) -> dict:
    """Both modes loaded side by side and stepped in turn, so both see the same machine load."""
    n = args.warmup + args.steps
    dec = {}
    for mode in ("tp", "dtp"):
        over = {} if mode == "dtp" else {"broadcast_delay": args.layers_of_model}
        model = load_shard(path, rank, world, device="cpu", overrides=over)
        dec[mode] = _Decoder(ParallelEngine(model, max_model_len=len(PROMPT) + n + 4))
    out: dict = {"runs": [], "trace": []}
    hidden = dec["dtp"].engine.cfg.hidden_size
    with torch.inference_mode():
        for ms in args.latencies:
            message_ms = _message_ms(hidden, dec["dtp"].ex)
            got = {mode: [] for mode in dec}
            for d in dec.values():
                d.restart(ms)
            for _ in range(n):
                for mode, d in dec.items():
                    got[mode].append(d.step())
            if ms == args.trace_latency:
                out["trace"] = dec["dtp"].trace
            for mode, d in dec.items():
                kept = got[mode][args.warmup :]
                took, now, late = (statistics.median(c) for c in zip(*kept, strict=True))
                out["runs"].append(
                    dict(mode=mode, latency_ms=ms, ms_per_token=took, blocked_now_ms=now)
                )
                out["runs"][-1].update(blocked_late_ms=late, messages=d.messages)
                out["runs"][-1].update(blocking=d.blocking, message_ms=message_ms)
    return out


def _message_ms(hidden: int, ex, reps: int = 40) -> float:
    """Median ms of one blocking all-reduce of a (hidden,) fp32 message, latency included."""
    t = torch.ones(hidden)
    took = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        ex.all_reduce(t, "probe")
        took.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(took)


def _tables(ranks: list[dict], args) -> tuple[str, str, list[dict]]:
    rows = ["| rank | message | kind | issued ms | done ms | waited at ms | blocked ms | by |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for r in ranks:
        for e in r["trace"]:
            if e["tag"] == "step":
                rows.append(f"| {e['rank']} | whole step | | | | | {e['blocked_ms']:.3f} | |")
                continue
            rows.append(
                f"| {e['rank']} | {e['tag']} | {e['kind']} | {e['issued_ms']:.3f} | "
                f"{e['done_ms']:.3f} | {e['wait_ms']:.3f} | {e['blocked_ms']:.3f} | "
                f"{e['consumer']} |"
            )
    delayed = [e for r in ranks for e in r["trace"] if e.get("kind") == "dtp"]
    if delayed and args.trace_latency:  # the share hidden of the injected latency
        blocked = sum(e["blocked_ms"] for e in delayed)
        injected = len(delayed) * args.trace_latency
        rows.append(
            f"\nDelayed messages in this step: {len(delayed)} over {len(ranks)} ranks, blocked "
            f"{blocked:.2f} ms of {injected:g} ms injected ({1 - blocked / injected:.1%} hidden)."
        )
    runs = ranks[0]["runs"]
    base = {r["mode"]: r["ms_per_token"] for r in runs if r["latency_ms"] == 0}
    lat = [
        "| latency ms | TP ms/token | TP added | TP blocked | DTP ms/token | DTP added "
        "| DTP blocked: present + pick | DTP blocked: delayed | delayed hidden |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for ms in args.latencies:
        tp, dtp = (
            next(r for r in runs if r["mode"] == m and r["latency_ms"] == ms) for m in ("tp", "dtp")
        )
        row = dict(latency_ms=ms, tp=tp, dtp=dtp)
        row["tp_added"] = tp["ms_per_token"] - base.get("tp", tp["ms_per_token"])
        row["dtp_added"] = dtp["ms_per_token"] - base.get("dtp", dtp["ms_per_token"])
        delayed = dtp["messages"] - dtp["blocking"]
        if ms and delayed:
            row["delayed_hidden"] = 1 - dtp["blocked_late_ms"] / (delayed * ms)
        summary.append(row)
        hidden = f"{row['delayed_hidden']:.1%}" if "delayed_hidden" in row else ""
        lat.append(
            f"| {ms:g} | {tp['ms_per_token']:.1f} | {row['tp_added']:+.1f} | "
            f"{tp['blocked_now_ms']:.1f} ({tp['messages']} waits) | {dtp['ms_per_token']:.1f} | "
            f"{row['dtp_added']:+.1f} | {dtp['blocked_now_ms']:.1f} ({dtp['blocking']} waits) | "
            f"{dtp['blocked_late_ms']:.2f} ({delayed} waits) | {hidden} |"
        )
    return "\n".join(rows), "\n".join(lat), summary


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The random model's shape (random_checkpoint)."""
    for name, v in (("layers", 8), ("hidden", 1024), ("ffn", 4096), ("heads", 8)):
        p.add_argument(f"--{name}", type=int, default=v)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--delay", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Laneformer checkpoint (default: a random one)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--latencies", default="0,2,5,10", help="ms added per message, comma list")
    p.add_argument("--trace-latency", type=float, default=5.0, help="latency of the traced step")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    add_shape_arguments(p)
    rendezvous.add_arguments(p)  # one rank per host: --nnodes, --node-rank, --rdzv-endpoint
    args = p.parse_args(argv)
    rdzv = rendezvous.from_args(args, args.devices)
    args.latencies = [float(x) for x in args.latencies.split(",")]
    if args.trace_latency not in args.latencies:
        args.latencies.append(args.trace_latency)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_checkpoint(args, tmp)
        args.layers_of_model = ModelConfig.from_json(f"{path}/config.json").num_layers
        ranks = spawn(
            _rank, args.devices, path, args, device="cpu", threads=args.threads, rdzv=rdzv
        )
    if rdzv is not None and rdzv.node_rank > 0:
        return 0  # node 0 reports
    trace, lat, summary = _tables(ranks, args)
    when = datetime.date.today().isoformat()
    print(
        f"## One decode step per rank ({args.devices} gloo ranks, latency "
        f"{args.trace_latency:g} ms, {when})\n\n{trace}\n"
    )
    print(f"## Injected latency per message: TP vs DTP (median ms/token)\n\n{lat}\n")
    record = dict(
        bench="dtp_trace", date=when, devices=args.devices, backend="gloo", config=vars(args),
        latency=summary, trace=[e for r in ranks for e in r["trace"]],
    )  # fmt: skip
    record["config"].pop("latencies", None)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
