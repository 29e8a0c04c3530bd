#!/usr/bin/env bash
# Test hosts on one machine: Linux network namespaces on a private bridge, each
# with its own address and hostname, so that an MPI job spread over them runs
# the way it would over real machines (TCP between hosts, no shared-memory path,
# mpirun reaching each host through an rsh agent). Needs root and iproute2.
#
#   deploy/netns_hosts.sh up [N]                 # hosts pdh1..pdhN (default 3) + client pdhc
#   deploy/netns_hosts.sh down                   # remove them (kills what still runs in them)
#   deploy/netns_hosts.sh exec HOST CMD [ARG...] # run CMD on HOST (its network, its hostname)
#   deploy/netns_hosts.sh rsh HOST CMDLINE...    # mpirun's rsh agent (ssh-like; see below)
#   deploy/netns_hosts.sh throttle HOST RATE [DELAY]   # e.g. throttle pdh2 1gbit 1ms
#   deploy/netns_hosts.sh unthrottle HOST
#   deploy/netns_hosts.sh addr HOST              # print HOST's address
#
# Launch a cluster over them (router on pdh1, prefill on pdh2, two decode ranks on pdh3;
# --insecure: the router serves 10.213.77.1, not loopback, with no http.api_key, which
# launch.sh otherwise refuses; see docs/CLUSTER.md):
#   printf 'pdh1 slots=1\npdh2 slots=1\npdh3 slots=2\n' > /tmp/hosts
#   deploy/netns_hosts.sh exec pdh1 deploy/launch.sh --prefill 1 --decode 2 --threads 1 \
#       --hostfile /tmp/hosts --host 10.213.77.1 --insecure \
#       --mca plm_rsh_agent "$PWD/deploy/netns_hosts.sh rsh" \
#       --mca oob_tcp_if_include 10.213.77.0/24 --mca btl_tcp_if_include 10.213.77.0/24 \
#       --mca pml ob1 --mca btl tcp,self,vader &
#   deploy/netns_hosts.sh exec pdhc curl -s http://10.213.77.1:8000/health   # once it is up
#
# Environment: PDH_PREFIX (default pdh: namespaces pdh1.., pdhc, bridge pdh-br),
# PDH_SUBNET (first three octets of a free /24, default 10.213.77; host i is .i,
# the client .100). Each namespace gets /etc/netns/NS/hosts naming every host,
# which `ip netns exec` mounts over /etc/hosts (the cluster's "DNS").
set -euo pipefail
PREFIX="${PDH_PREFIX:-pdh}"
SUBNET="${PDH_SUBNET:-10.213.77}"
BRIDGE="$PREFIX-br"
CLIENT="${PREFIX}c"
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
die() { echo "netns_hosts.sh: $*" >&2; exit 2; }

hosts() {  # the namespaces of this prefix that exist now
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}([0-9]+|c)\$" || true
}
addr_of() {
  case "$1" in
    "$CLIENT") echo "$SUBNET.100" ;;
    "$PREFIX"[0-9]*) local i="${1#"$PREFIX"}"; [[ "$i" =~ ^[0-9]+$ && "$i" -ge 1 && "$i" -le 99 ]] || die "bad host '$1'"
                     echo "$SUBNET.$i" ;;
    *) die "unknown host '$1' (hosts are ${PREFIX}1..${PREFIX}N and $CLIENT)" ;;
  esac
}
need_host() { [[ -e "/run/netns/$1" ]] || die "no host '$1' (run: $0 up)"; }
host_link() { echo "$PREFIX-v${1#"$PREFIX"}"; }  # the bridge-side end of HOST's link

down() {
  local ns pid
  for ns in $(hosts); do
    # Whatever still runs "on" the host (ranks, orteds of a crashed run) dies with it.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 50); do [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]] && break; sleep 0.1; done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rmdir /etc/netns 2>/dev/null || true  # only if nothing else uses it
  ip link del "$BRIDGE" 2>/dev/null || true
  # veth ends left in the root namespace (normally gone with their namespace)
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$PREFIX-v[0-9c]+\$"); do
    ip link del "$l" 2>/dev/null || true
  done
}

up() {
  local n="${1:-3}" names=() ns
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 99 ]] || die "up: N must be 1..99"
  [[ "$(id -u)" == 0 ]] || die "up: needs root"
  command -v ip >/dev/null || die "up: 'ip' not found (apt-get install iproute2)"
  down
  for i in $(seq 1 "$n"); do names+=("$PREFIX$i"); done
  names+=("$CLIENT")
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  for ns in "${names[@]}"; do
    local outer; outer="$(host_link "$ns")"
    ip netns add "$ns"
    ip link add "$outer" type veth peer name eth0 netns "$ns"
    ip link set "$outer" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(addr_of "$ns")/24" dev eth0
    ip -n "$ns" link set eth0 up
    mkdir -p "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"; for h in "${names[@]}"; do echo "$(addr_of "$h") $h"; done; } > "/etc/netns/$ns/hosts"
  done
  echo "netns_hosts.sh: hosts ${names[*]} on $SUBNET.0/24 (bridge $BRIDGE)"
}

# tc on both ends of HOST's link (out of the namespace, and into it).
throttle() {
  local host="$1" rate="$2" delay="${3:-}" outer; need_host "$host"; outer="$(host_link "$host")"
  unthrottle "$host"
  local netem=(netem rate "$rate"); [[ -n "$delay" ]] && netem=(netem delay "$delay" rate "$rate" limit 100000)
  if ip netns exec "$host" tc qdisc add dev eth0 root "${netem[@]}" 2>/dev/null; then
    tc qdisc add dev "$outer" root "${netem[@]}"
    echo "netns_hosts.sh: $host's link: ${netem[*]} (both directions)"
    return
  fi
  # No sch_netem in this kernel: a token bucket gives the rate; the delay cannot be emulated.
  local tbf=(tbf rate "$rate" burst 256kb latency 50ms)
  ip netns exec "$host" tc qdisc add dev eth0 root "${tbf[@]}" || die "throttle: tc failed (no netem, no tbf?)"
  tc qdisc add dev "$outer" root "${tbf[@]}"
  echo "netns_hosts.sh: $host's link: ${tbf[*]} (both directions; no netem in this kernel${delay:+, so no $delay delay})"
}
unthrottle() {
  local host="$1"; need_host "$host"
  ip netns exec "$host" tc qdisc del dev eth0 root 2>/dev/null || true
  tc qdisc del dev "$(host_link "$host")" root 2>/dev/null || true
}

cmd="${1:-}"; [[ $# -gt 0 ]] && shift
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  exec)
    [[ $# -ge 2 ]] || die "exec HOST CMD [ARG...]"
    host="$1"; shift; need_host "$host"
    # New UTS namespace: the host's own hostname, as MPI and the ranks see it.
    exec ip netns exec "$host" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$host" "$@" ;;
  rsh)
    # Called by mpirun (--mca plm_rsh_agent "PATH/netns_hosts.sh rsh") as an ssh
    # would be: [options] HOST COMMAND-LINE...; the command line is joined and
    # run by sh on HOST, as sshd would.
    while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
    [[ $# -ge 2 ]] || die "rsh HOST CMDLINE..."
    host="$1"; shift; need_host "$host"
    exec ip netns exec "$host" unshare --uts -- sh -c "hostname '$host' && exec sh -c \"\$0\"" "$*" ;;
  throttle) [[ $# -ge 2 ]] || die "throttle HOST RATE [DELAY]"; throttle "$@" ;;
  unthrottle) [[ $# -eq 1 ]] || die "unthrottle HOST"; unthrottle "$1" ;;
  addr) [[ $# -eq 1 ]] || die "addr HOST"; addr_of "$1" ;;
  -h|--help|help) sed -n '2,25p' "$SELF" | sed 's/^# \{0,1\}//' ;;
  *) sed -n '2,25p' "$SELF" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
