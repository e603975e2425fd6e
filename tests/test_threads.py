"""CPU thread count: the bytes a decode step streams, the cores idle now, and --threads."""

from __future__ import annotations

import pytest
import torch

from expresslane.errors import ConfigError
from expresslane.step import threads

MB = 1 << 20


def test_requested_threads_win_and_must_be_positive():
    assert threads.choose_threads(10 * MB, requested=3, idle=0.0) == 3
    with pytest.raises(ConfigError, match="--threads 0"):
        threads.choose_threads(10 * MB, requested=0)


def test_busy_cores_and_small_models_get_one_thread(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.choose_threads(2000 * MB, idle=0.3) == 1  # the other cores are busy
    assert threads.choose_threads(10 * MB, idle=8.0) == 1  # a fork/join costs more than it brings
    assert threads.choose_threads(100 * MB, idle=8.0) == 3  # one per 32 MB
    assert threads.choose_threads(2000 * MB, idle=5.6) == 6
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert threads.choose_threads(2000 * MB, idle=8.0) == 2


def _cgroups(tmp_path, own: str, files: dict[str, str]):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "self").write_text(own)
    return str(tmp_path / "fs"), str(tmp_path / "self")


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    files = {"fs/cpu.max": "max 100000\n", "fs/kube/cpu.max": "150000 100000\n",
             "fs/kube/pod/cpu.max": "400000 100000\n"}  # fmt: skip
    root, own = _cgroups(tmp_path, "0::/kube/pod\n", files)
    assert threads.cpu_quota(root, own) == 1.5  # the parent's 1.5 cores bind the pod's 4


def test_cgroup_v1_quota_and_a_host_path_the_container_cannot_see(tmp_path):
    files = {"fs/cpu,cpuacct/cpu.cfs_quota_us": "200000", "fs/cpu,cpuacct/cpu.cfs_period_us":
             "100000", "fs/memory/x": ""}  # fmt: skip
    own = "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n"
    root, self_ = _cgroups(tmp_path, own, files)
    assert threads.cpu_quota(root, self_) == 2.0  # read at the mount: the path is the host's


@pytest.mark.parametrize("files", [
    {"fs/cpu/cpu.cfs_quota_us": "-1", "fs/cpu/cpu.cfs_period_us": "100000"},  # v1 unlimited
    {"fs/cpu.max": "max 100000"},  # v2 unlimited
    {"fs/cpu.max": "garbage"},
    {},
])  # fmt: skip
def test_no_quota_is_none(tmp_path, files):
    root, own = _cgroups(tmp_path, "1:cpu:/\n0::/\n", files)
    assert threads.cpu_quota(root, own) is None
    assert threads.cpu_quota(root, str(tmp_path / "missing")) is None


def test_usable_cores_obey_the_quota(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(16)))
    for quota, cores in ((None, 16), (2.0, 2), (1.5, 1), (0.2, 1), (64.0, 16)):
        monkeypatch.setattr(threads, "cpu_quota", lambda q=quota: q)
        assert threads.usable_cores() == cores


def test_idle_cores_is_a_fraction_of_the_machine():
    idle = threads.idle_cores(sample_s=0.05)
    assert 0.0 <= idle <= (threads.os.cpu_count() or 1) + 1e-9


def test_this_process_own_work_counts_as_free(monkeypatch):
    """/proc/stat says 1 of 2 cores was idle; whether the busy one was this process (a server's
    event loop starting beside the load) or another decides between 2 threads and 1."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    tick = threads.os.sysconf("SC_CLK_TCK")
    for own_s, free in ((1.0, 2.0), (0.0, 1.0), (0.25, 1.25)):
        stats = iter([(0, 0), (tick, 2 * tick)])  # one second: 1 core-second idle of 2
        clock = iter([10.0, 10.0 + own_s])
        monkeypatch.setattr(threads, "_cpu_times", stats.__next__)
        monkeypatch.setattr(threads.time, "process_time", clock.__next__)
        assert threads.idle_cores() == pytest.approx(free)


def test_the_governor_follows_the_other_processes_between_requests(monkeypatch):
    """Before each request, the cores other processes left free over the last second: a
    neighbour busy on one of 2 cores takes a thread away, its leaving gives it back, and a
    look shorter than MIN_SAMPLE_S (just started) keeps the count. Applied to torch's count."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    tick = threads.os.sysconf("SC_CLK_TCK")
    now = {"t": 0.0, "idle": 0, "total": 0, "own": 0.0}  # what the fakes below report
    monkeypatch.setattr(threads, "_cpu_times", lambda: (now["idle"], now["total"]))
    monkeypatch.setattr(threads.time, "process_time", lambda: now["own"])
    monkeypatch.setattr(threads.time, "monotonic", lambda: now["t"])

    def advance(seconds: float, idle_cores: float, our_cores: float) -> None:
        for _ in range(round(seconds / threads.PERIOD_S)):  # the watching thread's snapshots
            now["t"] += threads.PERIOD_S
            now["idle"] += round(idle_cores * threads.PERIOD_S * tick)
            now["total"] += round(2 * threads.PERIOD_S * tick)
            now["own"] += our_cores * threads.PERIOD_S
            gov.tick()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gov = threads.ThreadGovernor(step_bytes=1 << 30, watch=False)
        advance(0.25, idle_cores=0.0, our_cores=0.0)  # a neighbour on both cores, too briefly
        assert gov.revise() == 2
        advance(10.0, idle_cores=1.0, our_cores=1.0)  # a long quiet spell, then
        advance(1.0, idle_cores=0.0, our_cores=1.0)  # we decode on one core, a neighbour on one
        assert gov.revise() == 1 and torch.get_num_threads() == 1
        advance(1.0, idle_cores=1.0, our_cores=1.0)  # the neighbour has gone
        assert gov.revise() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cpu_info_reads_the_first_value_of_a_field(tmp_path, monkeypatch):
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f amx_int8\n"
    text += "processor\t: 1\nvendor_id\t: Other\n"
    monkeypatch.setattr(threads, "_read", lambda path: text if path == "/proc/cpuinfo" else None)
    threads.cpu_info.cache_clear()
    try:
        assert threads.cpu_info("vendor_id") == "GenuineIntel"  # the first core's
        assert threads.cpu_info("flags").split() == ["fpu", "avx512f", "amx_int8"]
        assert threads.cpu_info("no such field") == ""
        monkeypatch.setattr(threads, "_read", lambda path: None)  # not Linux
        threads.cpu_info.cache_clear()
        assert threads.cpu_info("vendor_id") == ""
    finally:
        threads.cpu_info.cache_clear()  # the real file's values for later tests
