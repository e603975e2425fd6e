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
R --rdzv-endpoint HOST:PORT`, one rank each) and node 0 prints. `--link-delays 0,1ms
--shape-cmd CMD` then measures real link delays instead of injected ones: before each point,
rank 0 runs CMD with {delay} filled in (e.g. scripts/netns.sh shape), between two barriers;
`--rounds R` cycles through all points R times, so that a machine whose load drifts loads every
point alike. `python -m expresslane.bench.dtp_hosts` does all that in network namespaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist

from ..checkpoint import save_model
from ..config import ModelConfig
from ..model import Laneformer, init_weights
from ..parallel import ParallelEngine, load_shard, rendezvous
from ..parallel.exchange import sample_sharded
from ..parallel.launch import spawn

PROMPT = [1, 17, 40, 5, 88, 23, 9, 61, 3, 14, 15, 92, 65, 35, 89, 79]
MODES = ("tp", "dtp")


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
    got: dict = {}  # label -> mode -> kept steps
    probes: dict = {}  # label -> message_ms per visit
    with torch.inference_mode():
        for label, ms, link in _points(args):
            if link is not None:
                _set_link(rank, args.shape_cmd, link)
            probes.setdefault(label, []).append(_message_ms(hidden, dec["dtp"].ex))
            for d in dec.values():
                d.restart(ms)
            for i in range(n):
                for mode, d in dec.items():
                    step = d.step()
                    if i >= args.warmup:
                        got.setdefault(label, {}).setdefault(mode, []).append(step)
            if label == args.trace_point:
                out["trace"] = dec["dtp"].trace
    for label, ms, link in dict.fromkeys(_points(args)):
        for mode, d in dec.items():
            took, now, late = (statistics.median(c) for c in zip(*got[label][mode], strict=True))
            out["runs"].append(dict(mode=mode, point=label, latency_ms=ms, link_delay=link))
            out["runs"][-1].update(ms_per_token=took, blocked_now_ms=now, blocked_late_ms=late)
            out["runs"][-1].update(messages=d.messages, blocking=d.blocking)
            out["runs"][-1]["message_ms"] = statistics.median(probes[label])
    return out


def _points(args) -> list[tuple[str, float, str | None]]:
    """(label, injected ms, link delay) of every measured point, in order, --rounds times."""
    if args.link_delays:
        one = [(d, 0.0, d) for d in args.link_delays]
    else:
        one = [(f"{ms:g}", ms, None) for ms in args.latencies]
    return one * args.rounds


def _set_link(rank: int, cmd: str, delay: str) -> None:
    """Rank 0 reshapes the links (everyone quiet between two barriers)."""
    dist.barrier()
    if rank == 0:
        subprocess.run(cmd.format(delay=delay), shell=True, check=True)
    dist.barrier()


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
    first = runs[0]["point"]
    base = {r["mode"]: r["ms_per_token"] for r in runs if r["point"] == first}
    lat = [
        "| point | TP ms/token | TP added | TP blocked | DTP ms/token | DTP added "
        "| DTP blocked: present + pick | DTP blocked: delayed | delayed hidden |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for label in dict.fromkeys(r["point"] for r in runs):
        tp, dtp = (next(r for r in runs if r["mode"] == m and r["point"] == label) for m in MODES)
        ms = tp["latency_ms"]
        row = dict(point=label, latency_ms=ms, link_delay=tp["link_delay"], tp=tp, dtp=dtp)
        row["tp_added"] = tp["ms_per_token"] - base.get("tp", tp["ms_per_token"])
        row["dtp_added"] = dtp["ms_per_token"] - base.get("dtp", dtp["ms_per_token"])
        delayed = dtp["messages"] - dtp["blocking"]
        if ms and delayed:
            row["delayed_hidden"] = 1 - dtp["blocked_late_ms"] / (delayed * ms)
        summary.append(row)
        hidden = f"{row['delayed_hidden']:.1%}" if "delayed_hidden" in row else ""
        lat.append(
            f"| {label} | {tp['ms_per_token']:.1f} | {row['tp_added']:+.1f} | "
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
    p.add_argument("--link-delays", help="real link delays to visit instead (e.g. 0,50us,1ms)")
    p.add_argument("--shape-cmd", help="what rank 0 runs to set a link delay ({delay})")
    p.add_argument("--rounds", type=int, default=1, help="cycles through all points")
    add_shape_arguments(p)
    rendezvous.add_arguments(p)  # one rank per host: --nnodes, --node-rank, --rdzv-endpoint
    args = p.parse_args(argv)
    rdzv = rendezvous.from_args(args, args.devices)
    args.latencies = [float(x) for x in args.latencies.split(",")]
    if args.link_delays:
        if not args.shape_cmd or "{delay}" not in args.shape_cmd:
            p.error("--link-delays needs --shape-cmd with {delay} in it")
        args.link_delays = args.link_delays.split(",")
        args.trace_point, args.trace_latency = args.link_delays[-1], 0.0
    else:
        if args.trace_latency not in args.latencies:
            args.latencies.append(args.trace_latency)
        args.trace_point = f"{args.trace_latency:g}"
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
    what = f"latency {args.trace_point} ms"
    what = f"link delay {args.trace_point}" if args.link_delays else what
    print(f"## One decode step per rank ({args.devices} gloo ranks, {what}, {when})\n\n{trace}\n")
    what = "Link delay" if args.link_delays else "Injected latency per message"
    print(f"## {what}: TP vs DTP (median ms/token)\n\n{lat}\n")
    record = dict(
        bench="dtp_trace", date=when, devices=args.devices, backend="gloo", config=vars(args),
        latency=summary, trace=[e for r in ranks for e in r["trace"]],
    )  # fmt: skip
    record["config"].pop("latencies", None)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
