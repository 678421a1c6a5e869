# Sourced by the multi-host e2e tests: N "hosts" on this machine, each a network namespace
# with its own hostname (a UTS namespace per process tree), joined by veth pairs to a bridge
# that lives in a namespace of its own (the "switch"), so nothing is added to the machine's
# own network. mpirun runs on host 0 and starts OpenMPI's daemon on the others through an
# rsh agent that enters the host's namespaces instead of ssh-ing; MPI traffic goes over TCP
# (btl tcp,self: no shared memory between hosts), exactly as between real machines.
#
#   source multihost_lib.sh
#   mh_up 2                       # hosts fphost0, fphost1 at 10.99.0.1, 10.99.0.2
#   mh_mpirun -np 2 BIN ARGS...   # mpirun on fphost0, one slot per host by default
#   mh_cut 1 / mh_mend 1          # host 1's link down / up
#   trap 'mh_down; ...' EXIT      # the caller's trap: kills what is left, deletes the namespaces
#
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN): without it mh_up fails loudly; a test that
# cannot build its hosts must fail, not pass.
MH_SUBNET=10.99.0
MH_PREFIX=fp$$
MH_HOSTS=0
MH_DIR=

mh_ns() { echo "${MH_PREFIX}h$1"; }        # namespace of host i
mh_host() { echo "fphost$1"; }             # its hostname (what MPI and foldpar print)
mh_addr() { echo "$MH_SUBNET.$(($1 + 1))"; }

mh_fail() {
  echo "multihost: $*" >&2
  exit 1
}

# mh_up N [SLOTS]: N hosts with SLOTS slots each (default 1) in the hostfile $MH_DIR/hosts.
mh_up() {
  local n=$1 slots=${2:-1} i sw="${MH_PREFIX}sw"
  [ "$(id -u)" = 0 ] || mh_fail "needs root to create network namespaces (running as uid $(id -u))"
  command -v ip >/dev/null && command -v unshare >/dev/null || mh_fail "needs ip (iproute2) and unshare (util-linux)"
  MH_DIR=$(mktemp -d)
  ip netns add "$sw" || mh_fail "cannot create a network namespace (ip netns add): CAP_NET_ADMIN missing?"
  MH_HOSTS=$n
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge || mh_fail "cannot create a bridge"
  ip -n "$sw" link set br0 up
  : >"$MH_DIR/hosts"
  for ((i = 0; i < n; i++)); do
    local ns
    ns=$(mh_ns "$i")
    ip netns add "$ns" || mh_fail "cannot create namespace $ns"
    ip -n "$ns" link set lo up  # OpenMPI and the watchdog also talk over loopback
    ip link add eth0 netns "$ns" type veth peer name "port$i" netns "$sw" || mh_fail "cannot create a veth pair"
    ip -n "$sw" link set "port$i" master br0
    ip -n "$sw" link set "port$i" up
    ip -n "$ns" addr add "$(mh_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    # A cut link should fail TCP connections in seconds, not the default ~15 minutes of
    # retransmissions, so that OpenMPI's daemons notice and exit (docs/RELIABILITY.md).
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2=4
    echo "$(mh_addr "$i") slots=$slots" >>"$MH_DIR/hosts"
  done
  # The rsh agent: OpenMPI calls it as "agent HOST COMMAND...", as it would call ssh.
  {
    echo '#!/bin/sh'
    echo 'host=$1; shift'
    echo 'case $host in'
    for ((i = 0; i < n; i++)); do echo "  $(mh_addr "$i")) ns=$(mh_ns "$i"); name=$(mh_host "$i") ;;"; done
    echo '  *) echo "multihost agent: unknown host $host" >&2; exit 255 ;;'
    echo 'esac'
    echo 'exec ip netns exec "$ns" unshare --uts -- sh -c "hostname $name && $*"'
  } >"$MH_DIR/agent"
  chmod +x "$MH_DIR/agent"
}

# mpirun on host 0 over every host of the hostfile; extra mpirun flags may precede the program.
# Keepalives on OpenMPI's control connections let its daemons notice a dead link (after 10 s
# idle, then 3 probes 3 s apart: 9 s at the earliest), later than a test's watchdog
# (FOLDPAR_COMM_TIMEOUT=3 reports within about 5 s), so the report naming the rank comes first.
mh_mpirun() {
  local env_flags=() v
  for v in OPENBLAS_NUM_THREADS FOLDPAR_COMM_TIMEOUT FOLDPAR_COMM_CHECK FOLDPAR_REDUCE_SCATTER FOLDPAR_LOG; do
    [ -n "${!v+x}" ] && env_flags+=(-x "$v")
  done
  ip netns exec "$(mh_ns 0)" unshare --uts -- sh -c 'hostname "$1" && shift && exec "$@"' sh "$(mh_host 0)" \
    mpirun --allow-run-as-root --hostfile "$MH_DIR/hosts" \
    --mca plm_rsh_agent "$MH_DIR/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self --mca btl_tcp_if_include "$MH_SUBNET.0/24" --mca oob_tcp_if_include "$MH_SUBNET.0/24" \
    --mca oob_tcp_keepalive_time 10 --mca oob_tcp_keepalive_intvl 3 --mca oob_tcp_keepalive_probes 3 \
    "${env_flags[@]}" "$@"
}

mh_cut() { ip -n "$(mh_ns "$1")" link set eth0 down; }
mh_mend() { ip -n "$(mh_ns "$1")" link set eth0 up; }

# Bytes host i has received over its link.
mh_rx_bytes() { ip netns exec "$(mh_ns "$1")" cat /sys/class/net/eth0/statistics/rx_bytes; }

# Pids of the processes named NAME (comm) inside host i's namespace.
mh_pids() {
  local pid
  for pid in $(ip netns pids "$(mh_ns "$1")" 2>/dev/null); do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
  done
  return 0
}

# Every process still inside host i's namespace, as "pid comm" lines.
mh_leftovers() {
  local pid
  for pid in $(ip netns pids "$(mh_ns "$1")" 2>/dev/null); do echo "$pid $(cat "/proc/$pid/comm" 2>/dev/null)"; done
}

mh_down() {
  local i pid
  for ((i = 0; i < MH_HOSTS; i++)); do
    for pid in $(ip netns pids "$(mh_ns "$i")" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$(mh_ns "$i")" 2>/dev/null || true
  done
  ip netns del "${MH_PREFIX}sw" 2>/dev/null || true
  [ -n "$MH_DIR" ] && rm -rf "$MH_DIR"
  return 0
}
