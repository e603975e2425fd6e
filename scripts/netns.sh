#!/usr/bin/env bash
# Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge, so
# that ranks and replicas talk over a real TCP/IP stack (ARP, routing, sockets) instead of
# loopback, and the links can be shaped with `tc`. Needs root and Debian's iproute2.
#
#   scripts/netns.sh up N [--name P] [--delay D] [--rate R]   hosts P0..P(N-1), switch Psw
#   scripts/netns.sh shape [--name P] [--delay D] [--rate R]  change every link's shaping
#   scripts/netns.sh down [--name P]                          kill what runs inside, delete all
#   scripts/netns.sh exec I [--name P] -- CMD...              CMD inside host I
#   scripts/netns.sh with N [--name P] [...] -- CMD...        up, CMD (env NETNS_NAME), then down
#   scripts/netns.sh check                                    can namespaces be made here?
#
# Host I is namespace P<I> with interface eth0 = 10.<S>.0.<I+1>/24 (S from --subnet, default 77);
# its peer hI sits in the switch namespace Psw on bridge br0. Hosts also get lo up (torchrun and
# servers bind there too). The prefix P (default "el") keeps concurrent sets apart; they may use
# the same addresses, since every set has its own switch.
#
# Shaping is on each host's egress (eth0), so a packet from one host to another is delayed
# once: --delay D is the one-way delay between two hosts (tc netem, e.g. 50us, 1ms), --rate R a
# bandwidth limit (tc htb, e.g. 10gbit). Where the kernel has no sch_netem, --delay-with auto
# (the default) delays in user space instead: an iptables NFQUEUE rule on eth0 and
# expresslane/bench/delayline.py inside each host (needs iptables; says so on stderr);
# --delay-with netem refuses with exit 3 there, --delay-with nfqueue always uses the fallback.
#
# `up` undoes its own partial work when a step fails (trap); `with` tears down on any exit.
set -euo pipefail

NAME=el
SUBNET=77
DELAY=""
RATE=""
DELAY_WITH=auto
ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "netns.sh: $*" >&2; exit "${CODE:-1}"; }

parse() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --name) NAME=$2; shift 2 ;;
      --subnet) SUBNET=$2; shift 2 ;;
      --delay) DELAY=$2; shift 2 ;;
      --rate) RATE=$2; shift 2 ;;
      --delay-with) DELAY_WITH=$2; shift 2 ;;
      --) shift; REST=("$@"); return ;;
      *) die "unknown option $1 (see the header of $0)" ;;
    esac
  done
}

check() {
  [ "$(id -u)" = 0 ] || { echo "netns.sh: needs root to create network namespaces" >&2; return 1; }
  command -v ip >/dev/null || { echo "netns.sh: 'ip' not found (Debian: apt-get install iproute2)" >&2; return 1; }
  local probe="elprobe$$"
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "netns.sh: cannot create a network namespace here: $err" >&2
    return 1
  fi
  if ! err=$(ip netns exec "$probe" true 2>&1); then
    ip netns del "$probe"
    echo "netns.sh: cannot run a command inside a network namespace here: $err" >&2
    return 1
  fi
  ip netns del "$probe"
}

hosts_of() { ip netns list | awk '{print $1}' | grep -E "^${NAME}([0-9]+|sw)$" || true; }

down() {
  local ns
  for ns in $(hosts_of); do
    # End the processes still inside (they keep a deleted namespace alive), then the namespace.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

stop_delayline() {  # the user-space delay line of NS, if any: its process and its rule
  local ns=$1 pid
  for pid in $(ip netns pids "$ns" 2>/dev/null); do
    if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "bench/delayline.py"; then
      kill "$pid" 2>/dev/null || true
    fi
  done
  ip netns exec "$ns" iptables -D OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass \
    2>/dev/null || true
}

start_delayline() {  # start_delayline NS: packets leaving eth0 wait $DELAY in user space
  local ns=$1
  command -v iptables >/dev/null || CODE=3 die "no sch_netem in this kernel and no iptables" \
    "for the user-space delay line (Debian: apt-get install iptables)"
  ip netns exec "$ns" iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass
  ip netns exec "$ns" setsid "${PYTHON:-python3}" "$ROOT/expresslane/bench/delayline.py" \
    --queue 0 --delay "$DELAY" </dev/null >/dev/null 2>&1 &
  local i  # until it has bound the queue (packets pass undelayed before: --queue-bypass)
  for i in $(seq 100); do
    ip netns exec "$ns" grep -qE '^ *0 ' /proc/net/netfilter/nfnetlink_queue 2>/dev/null && return
    sleep 0.05
  done
  CODE=3 die "the delay line in $ns did not bind NFQUEUE 0 (run it by hand to see why)"
}

netem_ok() {  # can this kernel delay in tc? (probed once, on the first host)
  if [ -z "${NETEM_OK:-}" ]; then
    NETEM_OK=no
    if ip netns exec "$1" tc qdisc add dev lo root handle 1: netem delay 1us 2>/dev/null; then
      NETEM_OK=yes
      ip netns exec "$1" tc qdisc del dev lo root
    fi
  fi
  [ "$NETEM_OK" = yes ]
}

shape_one() {  # shape_one NS: replace eth0's root qdisc with netem and/or htb, or none
  local ns=$1
  ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
  stop_delayline "$ns"
  if [ -n "$RATE" ]; then
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: htb default 1
    ip netns exec "$ns" tc class add dev eth0 parent 1: classid 1:1 htb rate "$RATE"
  fi
  if [ -n "$DELAY" ] && [ "$DELAY" != 0 ] && [ "$DELAY_WITH" != netem ] \
      && { [ "$DELAY_WITH" = nfqueue ] || ! netem_ok "$ns"; }; then
    [ -n "${SAID:-}" ] || echo "netns.sh: delaying $DELAY in user space (NFQUEUE +" \
      "expresslane/bench/delayline.py): $([ "$DELAY_WITH" = nfqueue ] && echo asked ||
      echo this kernel has no sch_netem)" >&2
    SAID=1
    start_delayline "$ns"
  elif [ -n "$DELAY" ] && [ "$DELAY" != 0 ]; then
    local parent="root"
    [ -n "$RATE" ] && parent="parent 1:1"
    local err
    # shellcheck disable=SC2086
    if ! err=$(ip netns exec "$ns" tc qdisc add dev eth0 $parent handle 10: netem delay "$DELAY" 2>&1); then
      CODE=3 die "tc netem delay $DELAY on $ns failed: $err (this kernel has no sch_netem:" \
        "CONFIG_NET_SCH_NETEM); use a kernel with netem, or inject latency in the exchange"
    fi
  fi
}

shape() {
  [[ -z "$DELAY" || "$DELAY" =~ ^[0-9.]+(us|ms|s)?$ ]] || die "--delay $DELAY: expected e.g. 50us, 1ms"
  case "$DELAY_WITH" in auto|netem|nfqueue) ;; *) die "--delay-with $DELAY_WITH: auto, netem or nfqueue" ;; esac
  local ns
  for ns in $(hosts_of); do
    [ "$ns" = "${NAME}sw" ] || shape_one "$ns"
  done
}

up() {
  local n=$1 i
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || die "up N: N must be 1..250, got '$n'"
  check || exit 2
  [ -z "$(hosts_of)" ] || die "namespaces ${NAME}* exist already: '$0 down --name $NAME' first"
  trap 'down' ERR
  ip netns add "${NAME}sw"
  ip -n "${NAME}sw" link add br0 type bridge
  ip -n "${NAME}sw" link set br0 up
  for i in $(seq 0 $((n - 1))); do
    local ns="${NAME}${i}"
    ip netns add "$ns"
    ip link add eth0 netns "$ns" type veth peer name "h$i" netns "${NAME}sw"
    ip -n "${NAME}sw" link set "h$i" master br0 up
    ip -n "$ns" addr add "10.${SUBNET}.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  shape
  trap - ERR
  for i in $(seq 0 $((n - 1))); do  # the bridge learns every port before anyone relies on it
    ip -n "${NAME}${i}" link show eth0 | grep -q "state UP" || sleep 0.2
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
REST=()
case "$cmd" in
  check) check ;;
  up) N=${1:-}; shift || true; parse "$@"; up "$N" ;;
  shape) parse "$@"; [ -n "$(hosts_of)" ] || die "no namespaces ${NAME}*"; shape ;;
  down) parse "$@"; down ;;
  exec)
    I=${1:-}; shift || true; parse "$@"
    [ ${#REST[@]} -gt 0 ] || die "exec I -- CMD: no command"
    exec ip netns exec "${NAME}${I}" "${REST[@]}" ;;
  with)
    N=${1:-}; shift || true; parse "$@"
    [ ${#REST[@]} -gt 0 ] || die "with N -- CMD: no command"
    trap 'down' EXIT INT TERM
    up "$N"
    NETNS_NAME=$NAME "${REST[@]}" ;;
  *) die "usage: $0 check | up N | shape | down | exec I -- CMD | with N -- CMD (options:" \
    "--name P --subnet S --delay D --rate R --delay-with auto|netem|nfqueue)" ;;
esac
