"""DTP across hosts: ms/token of DTP and TP over a real network stack with delayed links.

`python -m expresslane.bench.dtp_hosts [--devices 2] [--delays 0,50us,200us,1ms]` (root, Linux)
makes N namespace "hosts" with scripts/netns.sh (veth pairs on a bridge) and runs `python -m
expresslane.bench.dtp_trace` with one rank per host, joined over TCP with the multi-host flags,
no latency injected: its rank 0 sets every one-way link delay D in turn (tc netem, or the
user-space delay line where the kernel has no netem), `--rounds` times over, so that all delays
see the same (drifting) machine load. Every dtp_trace option after `--` is passed on (model
shape, --steps, --model).

Tables, then one JSON line. Per delay: `RTT`, the median round trip of 4 KB over TCP between
two hosts (delayline.py --ping: what the link really does); `all-reduce`, the median blocking
all-reduce of one hidden-size message on idle ranks; median ms/token of TP (the same weights,
an all-reduce after every module) and of DTP, and their ratio (both step in turn: the ratio is
the figure a drifting machine load disturbs least); the ms per token each blocks in waits
(message counts in brackets); `TP per message`, TP's blocked time over its messages (what one
message costs when waited on at once, under the decode's own CPU load); and `delayed hidden`,
the share of the delayed messages' added cost that never reached the token:

    hidden = 1 - (DTP delayed blocked(D) - (same at 0)) / (delayed messages x (TP per message(D)
             - (same at 0)))

Then the projection (`--project MODEL:GPU:COUNT`, default laneformer-2b:h200:8, context 1024):
bench/ceiling.py's latency model for that node at NVLink-class message latencies (3 and 8 us)
with and without a 2 us dead gap per kernel (10 kernels a layer), and its DTP figure again with
the delayed messages exposed as measured here at the largest delay (1 - hidden share of them,
each costing the full message latency).

Timings on a shared CPU are noisy; the namespaces share the machine's cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "netns.sh"
PORT = 29450


def _netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def _trace(name: str, devices: int, delays: list[str], how: str, passed: list[str]) -> dict:
    """One dtp_trace run with a rank on each host, visiting every delay; node 0's record."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    shape = f"bash {SCRIPT} shape --name {name} --delay {{delay}} --delay-with {how}"
    base = [sys.executable, "-m", "expresslane.bench.dtp_trace", "--link-delays", ",".join(delays)]
    base += ["--shape-cmd", shape, "--devices", str(devices), "--nnodes", str(devices)]
    base += ["--rdzv-endpoint", f"10.77.0.1:{PORT}", "--rdzv-timeout", "600", *passed]
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", f"{name}{r}", *base, "--node-rank", str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(devices)
    ]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"dtp_trace rank failed ({p.returncode}): {err[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _rtt_us(name: str, port: int) -> float:
    """Median 4 KB TCP round trip from host 0 to host 1 (delayline.py --echo / --ping)."""
    tool = [sys.executable, str(Path(__file__).with_name("delayline.py"))]
    echo = subprocess.Popen(["ip", "netns", "exec", f"{name}1", *tool, "--echo", str(port)])
    try:
        got = subprocess.run(
            ["ip", "netns", "exec", f"{name}0", *tool, "--ping", f"10.77.0.2:{port}"],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
    finally:
        echo.kill()
        echo.wait()
    return float(got.stdout)


def _row(delay: str, point: dict, base: dict | None, rtt_us: float) -> dict:
    tp, dtp = point["tp"], point["dtp"]
    row = dict(delay=delay, rtt_us=rtt_us, message_ms=dtp["message_ms"], tp_ms=tp["ms_per_token"])
    row.update(dtp_ms=dtp["ms_per_token"], dtp_blocked_late_ms=dtp["blocked_late_ms"])
    row.update(dtp_blocked_now_ms=dtp["blocked_now_ms"], tp_blocked_ms=tp["blocked_now_ms"])
    row["delayed_messages"] = dtp["messages"] - dtp["blocking"]
    row["blocking_messages"] = {"tp": tp["messages"], "dtp": dtp["blocking"]}
    row["tp_per_message_ms"] = tp["blocked_now_ms"] / tp["messages"]
    if base is not None:
        row["tp_added_ms"] = row["tp_ms"] - base["tp_ms"]
        row["dtp_added_ms"] = row["dtp_ms"] - base["dtp_ms"]
        extra = row["tp_per_message_ms"] - base["tp_per_message_ms"]  # what the link added
        late = row["dtp_blocked_late_ms"] - base["dtp_blocked_late_ms"]
        if extra > 0 and row["delayed_messages"]:
            row["delayed_hidden"] = 1 - late / (row["delayed_messages"] * extra)
    return row


def _table(rows: list[dict]) -> str:
    out = [
        "| one-way delay | RTT us | all-reduce ms | TP ms/token | DTP ms/token | TP / DTP "
        "| TP blocked ms/token | TP per message ms | DTP blocked: blocking + delayed "
        "| delayed hidden |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hidden = f"{r['delayed_hidden']:.0%}" if "delayed_hidden" in r else ""
        n = r["blocking_messages"]
        out.append(
            f"| {r['delay']} | {r['rtt_us']:.0f} | {r['message_ms']:.2f} | {r['tp_ms']:.1f} | "
            f"{r['dtp_ms']:.1f} | {r['tp_ms'] / r['dtp_ms']:.2f} | {r['tp_blocked_ms']:.1f} "
            f"({n['tp']}) | {r['tp_per_message_ms']:.2f} | {r['dtp_blocked_now_ms']:.1f} "
            f"({n['dtp']}) + {r['dtp_blocked_late_ms']:.2f} ({r['delayed_messages']}) | {hidden} |"
        )
    return "\n".join(out)


def projection(hidden: float, spec: str = "laneformer-2b:h200:8", context: int = 1024) -> list:
    """ceiling()'s TP and DTP tokens/s on a node, and DTP with a share `hidden` of its delayed
    messages hidden (the rest costing a full message latency each)."""
    from ..presets import load_model_config
    from .ceiling import ceiling

    model, gpu, count = spec.split(":")
    cfg = load_model_config(model)
    delayed = 2 * sum(  # modules whose partials travel to a later layer (not present)
        cfg.broadcasts(i) and cfg.reduce_mode(i) != "present" for i in range(cfg.num_layers)
    )
    rows = []
    for latency in (3.0, 8.0):
        for gap in (0.0, 2.0):
            c = ceiling(cfg, gpu, int(count), context=context, message_latency_us=latency,
                        kernel_overhead_us=gap)  # fmt: skip
            exposed = (1 - hidden) * delayed * latency
            rows.append(dict(latency_us=latency, kernel_gap_us=gap, stream_us=c["stream_us"],
                             tp_tok_s=c["tp"]["tok_s"], dtp_tok_s=c["dtp"]["tok_s"],
                             delayed_messages=delayed, dtp_measured_hidden_tok_s=1e6 /
                             (c["dtp"]["token_us"] + exposed)))  # fmt: skip
    return rows


def _projection_table(rows: list[dict], hidden: float) -> str:
    out = [
        "| message latency | kernel gap | TP tok/s | DTP tok/s (model: all hidden) "
        f"| DTP tok/s ({hidden:.0%} of delayed hidden, as measured) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['latency_us']:g} us | {r['kernel_gap_us']:g} us x 10/layer | "
            f"{r['tp_tok_s']:,.0f} | {r['dtp_tok_s']:,.0f} | "
            f"{r['dtp_measured_hidden_tok_s']:,.0f} |"
        )
    return "\n".join(out)


def _trace_table(events: list[dict]) -> str:
    out = ["| rank | message | kind | issued | done | waited at | blocked | consumed by |"]
    out.append("|---|---|---|---|---|---|---|---|")
    for e in events:
        if e["tag"] == "step":
            out.append(f"| {e['rank']} | whole step | | | | | {e['blocked_ms']:.2f} | |")
        else:
            out.append(
                f"| {e['rank']} | {e['tag']} | {e['kind']} | {e['issued_ms']:.2f} | "
                f"{e['done_ms']:.2f} | {e['wait_ms']:.2f} | {e['blocked_ms']:.2f} | "
                f"{e['consumer']} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="hosts, one rank each")
    p.add_argument("--delays", default="0,50us,200us,1ms", help="one-way link delays (netem)")
    p.add_argument("--delay-with", default="auto", choices=["auto", "netem", "nfqueue"])
    p.add_argument("--rounds", type=int, default=3, help="cycles through all delays")
    p.add_argument("--project", default="laneformer-2b:h200:8", help="MODEL:GPU:COUNT")
    args = p.parse_args(argv)
    delays = args.delays.split(",")
    if delays[0] not in ("0", "0us", "0ms"):
        delays.insert(0, "0")  # the reference of every "added"
    if not SCRIPT.exists():
        p.error(f"{SCRIPT} not found: run from a checkout of the repository")
    name = f"elb{os.getpid() % 100000}"
    made = _netns("up", str(args.devices), "--name", name)
    if made.returncode:
        p.error(f"cannot make namespaces: {made.stderr.strip()}")
    notes, rtts = [], []
    try:
        for i, delay in enumerate(delays):  # what each delay does to a plain TCP round trip
            shaped = _netns("shape", "--name", name, "--delay", delay,
                            "--delay-with", args.delay_with)  # fmt: skip
            if shaped.returncode:
                p.error(f"--delay {delay}: {shaped.stderr.strip()}")
            notes += [ln for ln in shaped.stderr.splitlines() if ln not in notes]
            rtts.append(_rtt_us(name, PORT + 100 + i))
        _netns("shape", "--name", name)
        with tempfile.TemporaryDirectory(prefix="expresslane-dtp-hosts-") as tmp:
            if "--model" not in passed:  # one random checkpoint for every rank
                passed += ["--model", _checkpoint(passed, tmp)]
            passed += ["--rounds", str(args.rounds)]
            rec = _trace(name, args.devices, delays, args.delay_with, passed)
    finally:
        _netns("down", "--name", name)
    rows = []
    for delay, point, rtt in zip(delays, rec["latency"], rtts, strict=True):
        rows.append(_row(delay, point, rows[0] if rows else None, rtt))
    when = datetime.date.today().isoformat()
    print(f"## DTP vs TP across {args.devices} namespace hosts (gloo over veth, {when})\n")
    for n in notes:
        print(f"note: {n.removeprefix('netns.sh: ')}")
    print(f"\n{_table(rows)}\n")
    print(f"### One DTP decode step at {delays[-1]} (rank: ms from the step's start)\n")
    print(f"{_trace_table(rec['trace'])}\n")
    hidden = min(1.0, rows[-1].get("delayed_hidden", 1.0))
    proj = projection(hidden, args.project)
    print(f"### Projected with bench/ceiling.py's model: {args.project}, context 1024\n")
    print(f"{_projection_table(proj, hidden)}\n")
    cfg = {k: v for k, v in rec["config"].items() if k not in ("model", "shape_cmd")}
    record = dict(bench="dtp_hosts", date=when, devices=args.devices, delays=delays,
                  delay_with=args.delay_with, notes=notes, config=cfg, rows=rows,
                  projection=dict(spec=args.project, hidden=hidden, rows=proj))  # fmt: skip
    print(json.dumps(record))
    return 0


def _checkpoint(passed: list[str], tmp: str) -> str:
    """dtp_trace's random checkpoint, written once, with the shape flags passed on."""
    from .dtp_trace import add_shape_arguments, random_checkpoint

    p = argparse.ArgumentParser()
    add_shape_arguments(p)
    shape, _ = p.parse_known_args(passed)
    return random_checkpoint(shape, str(Path(tmp) / "model"))


if __name__ == "__main__":
    raise SystemExit(main())
