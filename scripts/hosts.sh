#!/usr/bin/env bash
# Hosts as network namespaces, for tests and for trying hxfer across hosts on one machine.
#
#   scripts/hosts.sh up [N]        N namespaces (default 3) hxh-1 .. hxh-N, each a "host" with
#                                  its own address 10.231.7.<i>/24 on a veth into one bridge
#                                  (hxh-br, 10.231.7.254 in the root namespace); loopback up
#   scripts/hosts.sh down          removes them (and the bridge); idempotent
#   scripts/hosts.sh probe         exit 0 when namespaces can be made here (root, iproute2,
#                                  veth and bridge), 77 when not (what ctest reports as skipped)
#   scripts/hosts.sh exec I CMD..  runs CMD on host I (ip netns exec hxh-I CMD..)
#   scripts/hosts.sh addr I        prints host I's address
#   scripts/hosts.sh link I up|down   the host's link (its veth end on the bridge)
#   scripts/hosts.sh netem I ARGS..   tc netem on the host's link, e.g. `delay 50ms loss 1%`;
#                                     `netem I off` removes it (kernels without sch_netem
#                                     refuse it: tc exits non-zero)
#   scripts/hosts.sh rate I RATE      a token bucket (tc tbf) limiting the host's link, e.g.
#                                     `rate 1 200mbit`; `rate I off` removes it
#   scripts/hosts.sh relink I         host I's veth again (after scripts/slowlink.py, the
#                                     user-space delay and loss for kernels without netem)
#   scripts/hosts.sh forget           every host forgets the others' MAC addresses
# Shared memory between namespaces works (one kernel), but shm's Unix sockets are per
# namespace: a rank on one host cannot reach another host's shm address, as across machines.
set -euo pipefail
prefix=hxh
subnet=10.231.7

addr() { echo "$subnet.$1"; }

down() {
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-[0-9]*$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
             grep "^$prefix-" || true); do
    ip link del "$l" 2>/dev/null || true
  done
}

up() {
  local n=${1:-3}
  down
  ip link add "$prefix-br" type bridge
  ip addr add "$subnet.254/24" dev "$prefix-br"  # this (root) namespace reaches every host
  ip link set "$prefix-br" up
  # A host's bridge filtering (br_netfilter with a DROP forward policy) must not see this.
  if [[ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]]; then
    echo 0 > /proc/sys/net/bridge/bridge-nf-call-iptables || true
  fi
  for i in $(seq 1 "$n"); do
    ip netns add "$prefix-$i"
    ip -n "$prefix-$i" link set lo up
    relink "$i"
  done
}

# Host i's link: a veth pair, one end on the bridge, the other in the namespace with the
# host's address (again, after scripts/slowlink.py replaced it).
relink() {
  local ns="$prefix-$1"
  ip link del "$ns-h" 2>/dev/null || true
  ip -n "$ns" link del "$ns-n" 2>/dev/null || true
  ip link add "$ns-h" type veth peer name "$ns-n"
  ip link set "$ns-h" master "$prefix-br" up
  ip link set "$ns-n" netns "$ns"
  ip -n "$ns" addr add "$(addr "$1")/24" dev "$ns-n"
  ip -n "$ns" link set "$ns-n" up
  forget
}

# The host's link has another MAC address now: every host forgets the old one (else it sends
# to it until its neighbour entry goes stale, some 30 s).
forget() {
  for other in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-[0-9]*$" || true); do
    ip -n "$other" neigh flush all 2>/dev/null || true
  done
  ip neigh flush dev "$prefix-br" 2>/dev/null || true
}

probe() {
  [[ $(id -u) -eq 0 ]] || { echo "hosts: not root" >&2; exit 77; }
  command -v ip >/dev/null || { echo "hosts: no iproute2" >&2; exit 77; }
  local ns="$prefix-probe$$"
  if ! ip netns add "$ns" 2>/dev/null; then echo "hosts: cannot create namespaces" >&2; exit 77; fi
  local ok=1
  ip link add "$prefix-p$$" type veth peer name "$prefix-q$$" 2>/dev/null || ok=0
  ip link del "$prefix-p$$" 2>/dev/null || true
  ip netns del "$ns"
  [[ $ok == 1 ]] || { echo "hosts: no veth" >&2; exit 77; }
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  probe) probe ;;
  exec) i=$1; shift; exec ip netns exec "$prefix-$i" "$@" ;;
  addr) addr "$1" ;;
  link) ip link set "$prefix-$1-h" "$2" ;;
  relink) relink "$1" ;;
  forget) forget ;;
  netem)
    if [[ ${2:-} == off ]]; then
      tc qdisc del dev "$prefix-$1-h" root 2>/dev/null || true
    else
      i=$1; shift
      tc qdisc replace dev "$prefix-$i-h" root netem "$@"
    fi ;;
  rate)
    if [[ ${2:-} == off ]]; then
      tc qdisc del dev "$prefix-$1-h" root 2>/dev/null || true
    else
      tc qdisc replace dev "$prefix-$1-h" root tbf rate "$2" burst 256kb latency 500ms
    fi ;;
  *) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
