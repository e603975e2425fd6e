"""A userspace stand-in for `tc netem delay`: hold every outgoing packet for a fixed time.

Kernels built without sch_netem (CONFIG_NET_SCH_NETEM unset, as in some VMs and CI runners)
cannot delay packets in tc. This does the same job from user space: an iptables rule queues
each packet leaving a namespace's interface to NFQUEUE, and this process gives the kernel the
"accept" verdict `delay` after the packet arrived, in arrival order (packets are released in
batches with one NFQNL_MSG_VERDICT_BATCH). The packet never leaves the kernel; only its id
comes up (NFQNL_COPY_META). Stdlib only, spoken over a raw netlink socket (no libnetfilter).

    iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass
    python3 expresslane/bench/delayline.py --queue 0 --delay 200us

scripts/netns.sh starts it (in each namespace) when netem is missing. `--echo PORT` and `--ping
HOST:PORT` measure what a link really does: the median round trip of a 4 KB TCP message
(docs/multi-host.md lists them per delay; each packet pays some tens of microseconds on top).
The last `--spin-us` of each wait spin instead of sleeping (a sleeping process wakes up tens of
microseconds late), and the process runs under SCHED_FIFO (`--realtime`): on a busy CPU an
ordinary process is woken milliseconds late, which stretched a 200 us delay to several ms.
The kernel's real-time throttling (95% of each second by default) keeps it from starving the
machine.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 2, 3
CFG_CMD, CFG_PARAMS = 1, 2  # NFQA_CFG_* attributes
CMD_BIND, COPY_META = 1, 1
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def parse_delay(text: str) -> float:
    """netem's syntax ('50us', '1ms', '0.2ms', '1s', '0') -> seconds."""
    t = text.strip().lower()
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return float(t[: -len(unit)]) * scale
    if t.replace(".", "", 1).isdigit() and float(t) == 0:
        return 0.0
    raise ValueError(f"--delay {text!r}: expected a time like 50us, 1ms or 0")


def _attr(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * (-n % 4)


def _message(kind: int, payload: bytes, queue: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + payload
    kind |= NFNL_SUBSYS_QUEUE << 8
    return struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST, 0, 0) + body


def _packet_ids(data: bytes):
    """The packet ids in a batch of netlink messages from the queue."""
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if kind == NLMSG_ERROR and struct.unpack_from("=i", data, off + 16)[0]:
            raise OSError(-struct.unpack_from("=i", data, off + 16)[0], "nfqueue config refused")
        if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
            a = off + 20  # nlmsghdr (16) + nfgenmsg (4)
            while a + 4 <= off + length:
                alen, akind = struct.unpack_from("=HH", data, a)
                if akind & 0x7FFF == ATTR_PACKET_HDR:
                    yield struct.unpack_from(">I", data, a + 4)[0]
                a += max(4, (alen + 3) & ~3)
        off += max(16, (length + 3) & ~3)


class DelayLine:
    def __init__(self, queue: int, delay_s: float, spin_s: float = 60e-6):
        self.queue, self.delay, self.spin = queue, delay_s, min(spin_s, delay_s)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        bind = _attr(CFG_CMD, struct.pack("=BxH", CMD_BIND, 0))
        self.sock.send(_message(MSG_CONFIG, bind, queue))
        meta = _attr(CFG_PARAMS, struct.pack(">IB", 0, COPY_META))  # ids only, no payload
        self.sock.send(_message(MSG_CONFIG, meta, queue))
        self.held: collections.deque[tuple[float, int]] = collections.deque()

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.perf_counter()
            self.held.extend((now + self.delay, pid) for pid in _packet_ids(data))

    def _release(self) -> None:
        """Accept every packet that is due, with one batch verdict (ids <= the last one)."""
        now, last = time.perf_counter(), None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
        if last is not None:
            verdict = _attr(ATTR_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))
            self.sock.send(_message(MSG_VERDICT_BATCH, verdict, self.queue))

    def run(self) -> None:
        while True:
            wait = None
            if self.held:
                wait = max(0.0, self.held[0][0] - self.spin - time.perf_counter())
            ready, _, _ = select.select([self.sock], [], [], wait)
            if ready:
                self._receive()
            elif self.held:  # the first packet is almost due: spin the rest
                while time.perf_counter() < self.held[0][0]:
                    pass
            self._release()


def echo(port: int) -> None:
    """Send back whatever one client sends, until it closes."""
    with socket.create_server(("0.0.0.0", port), reuse_port=True) as srv:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1 << 16):
            conn.sendall(data)


def ping(endpoint: str, size: int = 4096, reps: int = 200) -> float:
    """Median round trip in microseconds of `size` bytes to an `echo` server."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    took = []
    with conn:
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(b"x" * size)
            got = 0
            while got < size:
                got += len(conn.recv(1 << 16))
            took.append((time.perf_counter() - t0) * 1e6)
    return sorted(took)[len(took) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, default=0, help="NFQUEUE number of the iptables rule")
    p.add_argument("--delay", default="0", help="one-way delay, netem syntax (50us, 1ms)")
    p.add_argument("--spin-us", type=float, default=60.0)
    p.add_argument(
        "--realtime", type=int, default=10, help="SCHED_FIFO priority (0: an ordinary process)"
    )
    p.add_argument("--echo", type=int, help="only serve a TCP echo on this port (see --ping)")
    p.add_argument("--ping", help="only print the median 4 KB round trip (us) to HOST:PORT")
    args = p.parse_args(argv)
    if args.echo:
        echo(args.echo)
        return 0
    if args.ping:
        print(f"{ping(args.ping):.1f}")
        return 0
    try:
        delay = parse_delay(args.delay)
    except ValueError as e:
        p.error(str(e))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK 1 ns: wake when asked, not 50 us later
    if args.realtime:  # netem runs in softirq, ahead of every process: so must its stand-in
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.realtime))
        except OSError as e:
            print(f"delayline: no real-time priority ({e}); delays stretch on a busy CPU",
                  file=sys.stderr)  # fmt: skip
    try:
        line = DelayLine(args.queue, delay, args.spin_us * 1e-6)
    except OSError as e:
        print(f"delayline: cannot open NFQUEUE {args.queue}: {e}", file=sys.stderr)
        return 1
    try:
        line.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
