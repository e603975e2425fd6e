"""Joining ranks across hosts: torchrun's multi-node flags, bounded waits, and plain errors.

`expresslane run|serve --devices N --nnodes M --node-rank R --rdzv-endpoint HOST:PORT` starts
N / M ranks on this host (global ranks R*N/M ...), which meet the other hosts' ranks at
HOST:PORT (node 0 hosts the TCP store there); the same flags mean the same as torchrun's, and a
torchrun launch (RANK/WORLD_SIZE/MASTER_ADDR in the environment) is joined the same way.

What this file adds to `torch.distributed.init_process_group`:

- every wait is bounded by `--rdzv-timeout`: a wrong endpoint or a node that never arrives is
  a `RendezvousError` naming the flag and what to check, not a hang; the same timeout bounds
  every collective afterwards, so a host that goes silent is declared lost;
- gloo's network interface is the one that routes to the rendezvous host (unless
  GLOO_SOCKET_IFNAME is set): gloo otherwise advertises the address its hostname resolves to,
  which is 127.0.0.1 on many machines (Debian's /etc/hosts), and every peer on another host
  then connects to itself;
- `GroupLostError`: what a collective raises once a peer is gone. Every rank holds a slice of
  every layer, so no subset of ranks can go on; a collective library cannot repair its group
  in place either. The error says so, and the command exits with status 1 (serve: after
  answering the request in flight with 503), leaving the restart to torchrun --max-restarts,
  systemd or the cluster, and the traffic to the other replicas behind the router.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from ..errors import ConfigError, ExpressLaneError

DEFAULT_TIMEOUT_S = 300.0  # joining can wait for slow hosts; collectives normally take ms
_JOINED = {"timeout_s": DEFAULT_TIMEOUT_S}  # the timeout of the group this process joined


class RendezvousError(ConfigError):
    """The ranks could not meet: wrong endpoint, a node that did not come, a bad interface."""


class GroupLostError(ExpressLaneError):
    """A peer rank is gone (or silent past the timeout): this group cannot decode any more."""

    status_code = 503  # the server's answer: a router retries elsewhere
    exit_code = 1  # not a usage error: the group must be restarted


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks of a multi-host group meet (torchrun's flags)."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def init_method(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def local_ranks(self, world: int) -> range:
        """The global ranks this node runs: world / nnodes consecutive ones."""
        per = world // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's multi-node flags (same names, same meaning), for run and serve."""
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="hosts the --devices ranks are spread over (each runs devices/nnodes ranks)",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT where the ranks meet; node 0 listens there (its address)",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for every rank to join, and at most at any collective "
        f"(a silent host is then declared lost; default {DEFAULT_TIMEOUT_S:g})",
    )


def from_args(args: argparse.Namespace, devices: int) -> Rendezvous | None:
    """The Rendezvous of the command line (None for one host); ConfigError names the flag."""
    nnodes, node_rank = getattr(args, "nnodes", 1), getattr(args, "node_rank", 0)
    endpoint, timeout = getattr(args, "rdzv_endpoint", None), getattr(args, "rdzv_timeout", None)
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"--rdzv-timeout {timeout}: must be > 0 seconds")
    if nnodes == 1 and endpoint is None and node_rank == 0:
        return None
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes}: must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"--node-rank {node_rank}: must be in 0..{nnodes - 1} for --nnodes {nnodes}"
        )
    if devices % nnodes:
        raise ConfigError(
            f"--devices {devices} --nnodes {nnodes}: --devices counts the ranks of all hosts "
            f"and must be a multiple of --nnodes (each host runs devices/nnodes ranks)"
        )
    if endpoint is None:
        raise ConfigError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT (node 0's address)")
    host, port = parse_endpoint(endpoint)
    return Rendezvous(nnodes, node_rank, host, port, timeout or DEFAULT_TIMEOUT_S)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'10.0.0.1:29400', 'host:29400' or '[fe80::1]:29400' -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    return host, int(port)


# --- the network interface gloo advertises ----------------------------------------------------
def route_source(host: str) -> str | None:
    """This machine's address on the route to `host` (no packet is sent), or None."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the IPv4 interface that holds `address`, or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue
        if got == address:
            return name
    return None


def choose_gloo_interface(host: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface that reaches `host`, unless it is set or local.

    Returns the interface chosen (None when nothing was changed).
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(addr).is_loopback:
        return None  # one host: loopback is right
    src = route_source(addr)
    name = interface_of(src) if src else None
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


# --- joining, with errors that say what to check -------------------------------------------------
def join(
    backend: str,
    rank: int,
    world: int,
    init_method: str,
    timeout_s: float,
    flags: str = "",
) -> None:
    """init_process_group, bounded by `timeout_s`; failures become RendezvousError.

    `flags` names where the endpoint came from in messages (the command line, or torchrun).
    """
    import torch.distributed as dist

    where = init_method.removeprefix("tcp://") if init_method != "env://" else _env_endpoint()
    if backend == "gloo":
        choose_gloo_interface(where.rpartition(":")[0].strip("[]"))
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as e:  # DistError subclasses RuntimeError
        raise RendezvousError(_explain(e, rank, world, where, timeout_s, flags)) from None
    _JOINED["timeout_s"] = timeout_s


def joined_timeout_s() -> float:
    """How long this process's group waits at a collective before declaring a peer lost."""
    return _JOINED["timeout_s"]


def _env_endpoint() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _explain(e: Exception, rank: int, world: int, where: str, timeout_s: float, flags: str) -> str:
    """One line: what failed, at which endpoint, and what to check."""
    said = str(e).splitlines()[0] if str(e) else type(e).__name__
    at = f"{flags or '--rdzv-endpoint'} {where}"
    if "waiting for clients" in said:  # node 0: not everyone came
        return (
            f"{at}: not every rank joined within --rdzv-timeout {timeout_s:g} s ({said}); "
            f"start the missing hosts, and check that they can reach this address"
        )
    low = said.lower()
    if "address already in use" in low or "failed to listen" in low or "bind" in low:
        return f"{at}: node 0 cannot listen there ({said}); use a free port on node 0's address"
    if "connect" in said and rank == 0:
        return (
            f"{at}: node 0 hosts the rendezvous, so this must be one of its own addresses ({said})"
        )
    if "connect" in said and rank > 0:
        return (
            f"{at}: rank {rank} of {world} could not reach node 0 within --rdzv-timeout "
            f"{timeout_s:g} s ({said}); check the address and port, that node 0 is started "
            f"and that no firewall is in between"
        )
    if "connectFullMesh" in said or "Connect timeout" in said:
        return (
            f"{at}: the ranks met but could not connect to each other ({said}); set "
            f"GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) to the interface the hosts share"
        )
    return f"{at}: rank {rank} of {world} could not join ({said})"


# --- a group that lost a rank ------------------------------------------------------------------
_PEER_WORDS = ("gloo", "pair closure", "NCCL", "Connection reset", "Connection closed", "Timed out")


def is_peer_failure(e: BaseException) -> bool:
    """A collective failed because of a peer (gone, or silent past the timeout), not a bug."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and any(w in str(e) for w in _PEER_WORDS)
    )


@contextlib.contextmanager
def group_guard(on_lost=None):
    """Collective failures inside become GroupLostError (after `on_lost(error)`)."""
    try:
        yield
    except GroupLostError:
        raise
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        err = GroupLostError(lost_message(e))
        if on_lost is not None:
            on_lost(err)
        raise err from e


def lost_message(e: BaseException) -> str:
    said = str(e).splitlines()[0] if str(e) else type(e).__name__
    said = said.split("] ", 1)[-1].split(". This is typically")[0]  # gloo's source path, advice
    return (
        f"the process group lost a rank ({said}); every rank holds a slice of every layer, so "
        f"no request can run until the whole group is restarted (all hosts)"
    )
