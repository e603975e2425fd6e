"""Lanes across hosts: ranks in network namespaces joined over TCP, and replicas behind HAProxy.

One set of 4 namespace "hosts" (scripts/netns.sh, veth pairs on a bridge) serves every test;
where namespaces cannot be made (not root, no iproute2, a container without them) every test
skips, saying why. Each rank is its own process inside its own namespace and joins with the
multi-host flags (--nnodes, --node-rank, --rdzv-endpoint), exactly as on separate machines.

- 2 and 4 ranks over the network give one process's logits (1e-4) and greedy tokens, for a
  tiny config of each reduce mode (present + past, no_reduce + past in variant B, no_reduce
  only, Llama tensor parallelism) and the embedded model; then a rank killed mid-request ends
  it on every other rank with GroupLostError from the closed connection (not a timeout), and
  later requests are refused with the same error;
- a wrong --rdzv-endpoint and a node that never arrives: exit 2 within --rdzv-timeout, one
  line naming the flag;
- two `expresslane serve` replicas behind HAProxy (docs/haproxy.cfg), one of them a group of
  ranks on two hosts: both serve; a rank of the group is killed mid-stream, the stream ends
  with a 503 error event, its lead exits with status 1 saying the group must be restarted, and
  every later request succeeds on the other replica (whose /metrics agrees with the router).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from netns import ROOT, Hosts

from expresslane.assets import default_model_dir
from expresslane.checkpoint import load_model, save_model
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT = [1, 17, 40, 5, 88, 23, 9, 61]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
LOGITS_TOL = 1e-4
TIMEOUT_S = 60  # --rdzv-timeout of the groups: a test never waits on it
BASE = dict(
    model_type="laneformer",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_lanes=4,
    max_position_embeddings=128,
    lm_head_type="vocab_parallel",
)
CASES = {  # one tiny config per reduce mode (spec 6.3)
    "present-past": dict(broadcast_delay=1),
    "noreduce-past-B": dict(broadcast_delay=2, use_early_comm=False, dtp_variant="B"),
    "noreduce": dict(broadcast_delay=2, use_comm=False, lm_head_type="replicate"),
    "llama-tp": dict(model_type="llama", num_lanes=1, tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def hosts():
    made, why = Hosts.make(4)
    if made is None:
        pytest.skip(f"no network namespaces here: {why}")
    yield made
    made.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """name -> (folder, one-process logits and greedy tokens)."""
    paths = {"embedded": str(default_model_dir())}
    for i, (name, extra) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(name)
        cfg = ModelConfig.from_hf_dict({**BASE, **extra})
        save_model(init_weights(Laneformer(cfg), seed=i, norm_noise=0.2), path)
        paths[name] = str(path)
    return paths


def _reference(path: str) -> dict:
    model = load_model(path, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]))[0]
    engine = Engine(model, max_model_len=64, prefill_chunk=5)
    return dict(logits=logits, greedy=list(engine.generate(PROMPT, GREEDY)))


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            pytest.fail(f"{p.args[-3:]} hung: {e[-2000:]}")
        out.append((p.returncode, o, e))
    return out


def test_ranks_over_the_network_match_one_process(hosts, checkpoints, tmp_path):
    """2 ranks, then 4, and one of the 4 killed mid-request: one process per host."""
    a0 = hosts.addr(0)
    phases = [
        dict(world=2, endpoint=f"{a0}:29401", cases=checkpoints, out=str(tmp_path / "two")),
        dict(world=4, endpoint=f"{a0}:29402", cases=checkpoints, out=str(tmp_path / "four"),
             kill_path=checkpoints["embedded"], victim=3, after=3),
    ]  # fmt: skip
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(dict(phases=phases, timeout_s=TIMEOUT_S)))
    procs = [hosts.python(r, str(HERE / "netns_rank.py"), str(plan), str(r)) for r in range(4)]
    refs = {name: _reference(path) for name, path in checkpoints.items()}  # while they load
    done = _finish(procs)
    assert [code for code, _, _ in done[:3]] == [0, 0, 0], [e[-3000:] for _, _, e in done]
    assert done[3][0] == 17  # the victim's own exit
    for world, tag in ((2, "two"), (4, "four")):
        ranks = [torch.load(f"{tmp_path / tag}.{r}", weights_only=False) for r in range(world)]
        for name, ref in refs.items():
            got = ranks[0][name]
            err = (got["logits"] - ref["logits"]).abs().max().item()
            assert err <= LOGITS_TOL, f"{name} on {world} hosts: logits differ by {err}"
            assert got["greedy"] == ref["greedy"], f"{name} on {world} hosts: greedy tokens"
            assert all(r[name]["greedy"] == got["greedy"] for r in ranks), name
    for r in range(3):  # every survivor: the lost peer, from its closed connection
        res = torch.load(f"{tmp_path / 'four'}.kill.{r}", weights_only=False)
        assert res["error"] == "GroupLostError", res
        assert "lost a rank" in res["message"] and "restarted" in res["message"], res
        assert "timed out" not in res["message"].lower(), res
        assert res["tokens"] >= 2 and res["refused_after"] == "GroupLostError", res


def _serve(hosts, i: int, *flags: str) -> subprocess.Popen:
    cmd = ["-m", "expresslane", "serve", "--device", "cpu", "--dtype", "float32"]
    return hosts.python(i, *cmd, "--port", "8000", "--host", hosts.addr(i), *flags)


def test_wrong_endpoint_and_missing_node_are_clear_errors(hosts):
    run = ["-m", "expresslane", "run", "--prompt", "a", "--max-tokens", "2", "--device", "cpu"]
    group = ["--devices", "2", "--nnodes", "2", "--rdzv-timeout", "3"]
    wrong = hosts.python(1, *run, *group, "--node-rank", "1", "--rdzv-endpoint", "10.77.0.9:29420")
    alone = hosts.python(
        0, *run, *group, "--node-rank", "0", "--rdzv-endpoint", f"{hosts.addr(0)}:29421"
    )
    (wcode, wout, werr), (acode, aout, aerr) = _finish([wrong, alone], 120)
    wline, aline = werr.strip().splitlines()[-1], aerr.strip().splitlines()[-1]
    assert wcode == 2 and wout == "", werr[-2000:]
    assert wline.startswith("expresslane run: error: --rdzv-endpoint 10.77.0.9:29420: rank 1")
    assert "could not reach node 0 within --rdzv-timeout 3 s" in wline
    assert acode == 2 and aout == "", aerr[-2000:]
    assert "not every rank joined within --rdzv-timeout 3 s" in aline, aline
    assert "1/2" in aline  # how many came


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--devices", "3", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400"],
         ["--devices 3 --nnodes 2", "multiple of --nnodes"]),
        (["--devices", "2", "--nnodes", "2"], ["--nnodes 2", "give --rdzv-endpoint"]),
        (["--devices", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
         ["--node-rank 2", "0..1"]),
        (["--devices", "2", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"],
         ["--rdzv-endpoint '10.0.0.1'", "HOST:PORT"]),
        (["--devices", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"],
         ["--rdzv-timeout 0", "> 0"]),
    ],
)  # fmt: skip
def test_bad_multi_host_flags_exit_2_before_any_process(capsys, flags, words):
    from expresslane.__main__ import main

    assert main(["run", "--prompt", "a", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("expresslane run: error: "), err
    assert all(w in err[0] for w in words), err[0]


def test_idle_worker_keeps_its_group_in_touch_and_outlives_its_loss():
    """The server's worker calls engine.idle() every idle_interval while no job comes (a lead's
    heartbeat to its followers); a lost group is logged, and jobs are still taken."""
    import threading

    from expresslane.parallel.rendezvous import GroupLostError
    from expresslane.serve.metrics import Metrics
    from expresslane.serve.worker import Worker

    class Lead:  # the part of ParallelEngine the worker sees
        idle_interval = 0.01
        beats = 0
        gone = threading.Event()

        def idle(self):
            self.beats += 1
            if self.beats == 3:
                self.idle_interval = None  # as ParallelEngine does once lost
                self.gone.set()
                raise GroupLostError("the process group lost a rank (test)")

    lead = Lead()
    worker = Worker(lead, None, Metrics("m"))
    assert lead.gone.wait(10)
    worker.shutdown()  # the thread still takes jobs: the sentinel ends it
    assert not worker._thread.is_alive() and lead.beats == 3


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed (Debian)")
def test_replicas_behind_haproxy_survive_a_lost_rank(hosts):
    """r1: lead on host 0 + follower on host 1; r2: one process on host 2; HAProxy on host 3."""
    a0 = hosts.addr(0)
    group = ["--devices", "2", "--nnodes", "2", "--rdzv-endpoint", f"{a0}:29411"]
    group += ["--rdzv-timeout", str(TIMEOUT_S)]
    lead = _serve(hosts, 0, *group, "--node-rank", "0")
    follower = _serve(hosts, 1, *group, "--node-rank", "1")
    single = _serve(hosts, 2)
    replicas = [f"{a0}:8000", f"{hosts.addr(2)}:8000"]
    env = dict(LISTEN=f"{hosts.addr(3)}:8080", STATS=f"{hosts.addr(3)}:8404")
    env.update(REPLICA1=replicas[0], REPLICA2=replicas[1])
    proxy = hosts.popen(3, ["haproxy", "-db", "-f", str(ROOT / "docs" / "haproxy.cfg")], env=env)
    client = hosts.python(
        3, str(HERE / "netns_client.py"), f"http://{a0}:8000", f"http://{env['LISTEN']}",
        f"http://{env['STATS']}/stats;csv", *replicas,
    )  # fmt: skip
    events, killed = [], False
    for line in client.stdout:
        events.append(json.loads(line))
        if events[-1].get("chunks") == 5:
            follower.send_signal(signal.SIGKILL)  # a host of r1 goes away mid-stream
            killed = True
    ((ccode, _, cerr),) = _finish([client], 120)
    if not killed:  # no stream to kill: nothing would end r1, so do not wait for it
        for p in (lead, follower, proxy, single):
            p.kill()
        _finish([lead, follower, proxy, single], 30)
        pytest.fail(f"r1 never streamed 5 chunks: {events} {cerr[-2000:]}")
    (code, _, err), (fcode, _, _) = _finish([lead, follower], 30)  # the lead: ~1 s after
    for p in (proxy, single):
        p.send_signal(signal.SIGTERM)
    _finish([proxy, single], 30)
    assert ccode == 0, (events, cerr[-2000:], err[-3000:])
    proxied = [e for e in events if "i" in e]
    # Never a 503 through the router, not even while r1 dies: a request r1 refuses (closed port)
    # or answers 503 (group lost, server not yet stopped) is retried on r2 by docs/haproxy.cfg.
    assert [e["status"] for e in proxied] == [200] * 10, events
    assert {e["server"] for e in proxied[:4]} == {"r1", "r2"}, events  # both served
    assert {e["server"] for e in proxied[4:]} == {"r2"}, events  # r1 is gone: r2 takes all
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503, events
    assert "lost a rank" in errors[0]["message"] and "restarted" in errors[0]["message"]
    assert [e["end"] for e in events if "end" in e][0] >= 5
    assert fcode == -signal.SIGKILL
    assert code == 1, err[-3000:]  # the lead: neither a usage error nor a silent success
    last = err.strip().splitlines()[-1]
    assert last.startswith("expresslane serve: error: the process group lost a rank"), last
    metrics = events[-1]["metrics"]
    assert metrics[replicas[0]] is None  # r1 is down
    assert metrics[replicas[1]] == sum(e["server"] == "r2" for e in proxied)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
