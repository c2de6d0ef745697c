#!/usr/bin/env bash
# A local Slurm cluster on one machine, for tests and for trying the batch scripts.
#
#   launch/slurm/local_cluster.sh start            # one node on loopback: munged, slurmctld, slurmd
#   NTL_SLURM_NODES=2 launch/slurm/local_cluster.sh start   # two nodes in network + UTS namespaces
#   eval "$(launch/slurm/local_cluster.sh env)"    # SLURM_CONF for sbatch, squeue, scontrol
#   launch/slurm/local_cluster.sh status
#   launch/slurm/local_cluster.sh stop
#
# Needs root and Debian's slurm-wlm + munge (bash scripts/setup_slurm.sh installs them). Idempotent:
# `start` on a running cluster only waits for the nodes to be idle; `stop` on a stopped one does
# nothing. Everything lives under NTL_SLURM_STATE (default /var/tmp/ntl-slurm, or
# /var/tmp/ntl-slurm-2n for two nodes); the system's own /etc/slurm is never touched. Each node gets
# this machine's CPUs and memory; one partition, "debug", is the default. Daemon logs: $STATE/log/.
#
# Several clusters on one machine (two test suites at once): give each its own NTL_SLURM_STATE, its
# own ports (NTL_SLURMCTLD_PORT, NTL_SLURMD_PORT) and its own job ids (NTL_SLURM_FIRST_JOB_ID: the
# batch scripts derive their rendezvous port from the job id). tests/integration/test_slurm.py does.
# munged is shared; the two-node network (namespaces ntl-n1.., bridge ntlbr0) is one per machine.
#
# Two nodes: each slurmd runs in its own network namespace (ntl-n1, ntl-n2: a veth on the bridge
# ntlbr0, 10.201.0.0/24, made here and removed by `stop`) and UTS namespace (its own hostname), so
# jobs see two hosts with their own addresses and rendezvous over that private network for real.
# slurmctld stays in this namespace on the bridge address; /etc/hosts gets the two node names
# (between marker lines that `stop` removes).
set -euo pipefail

NODES=${NTL_SLURM_NODES:-1}
if [[ $NODES == 1 ]]; then
  STATE=${NTL_SLURM_STATE:-/var/tmp/ntl-slurm}
  CTLD_PORT=${NTL_SLURMCTLD_PORT:-6817}
else
  STATE=${NTL_SLURM_STATE:-/var/tmp/ntl-slurm-${NODES}n}
  CTLD_PORT=${NTL_SLURMCTLD_PORT:-6827}
fi
CONF=$STATE/slurm.conf
HOST=$(hostname -s)
BRIDGE=ntlbr0
SUBNET=10.201.0
MARK="# ntl_scale local Slurm nodes"

die() {
  echo "local_cluster.sh: $*" >&2
  exit 1
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_names() {
  if [[ $NODES == 1 ]]; then echo "$HOST"; else for i in $(seq "$NODES"); do echo "ntl-n$i"; done; fi
}

write_conf() {
  local cpus mem nodes_line ctld
  cpus=$(OMP_NUM_THREADS='' OMP_THREAD_LIMIT='' nproc)  # plain nproc counts OMP_NUM_THREADS (1 in CPU jobs), not CPUs
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9 / '"$NODES"')}' /proc/meminfo)
  if [[ $NODES == 1 ]]; then
    ctld="$HOST(127.0.0.1)"
    nodes_line="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  else
    ctld="$HOST($SUBNET.1)"
    nodes_line="NodeName=ntl-n[1-$NODES] NodeAddr=$(seq -s, -f "$SUBNET.1%g" 1 "$NODES") CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  fi
  mkdir -p "$STATE"/{ctld,log,run}
  cat >"$CONF.tmp" <<EOF
# written by launch/slurm/local_cluster.sh
ClusterName=ntl-local
SlurmctldHost=$ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldPort=$CTLD_PORT
SlurmdPort=${NTL_SLURMD_PORT:-$((CTLD_PORT + 1))}
FirstJobId=${NTL_SLURM_FIRST_JOB_ID:-1}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# schedule at every event, unthrottled: with the defaults (made for busy clusters) a job started 2-3 s after its
# submission or the end of its dependency, about 1 s with these
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=30
JobRequeue=1
$nodes_line
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  mv "$CONF.tmp" "$CONF"
}

make_network() {
  command -v ip >/dev/null || die "two nodes need iproute2's 'ip' (apt-get install iproute2)"
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  local i
  for i in $(seq "$NODES"); do
    if ! ip netns list | grep -qw "ntl-n$i"; then
      ip netns add "ntl-n$i"
      ip link add "ntl-n$i-h" type veth peer name eth0 netns "ntl-n$i"
      ip link set "ntl-n$i-h" master "$BRIDGE" up
      ip netns exec "ntl-n$i" ip addr add "$SUBNET.1$i/24" dev eth0
      ip netns exec "ntl-n$i" ip link set eth0 up
      ip netns exec "ntl-n$i" ip link set lo up
    fi
  done
  if ! grep -qF "$MARK" /etc/hosts; then
    {
      echo "$MARK"
      for i in $(seq "$NODES"); do echo "$SUBNET.1$i ntl-n$i"; done
      echo "$MARK end"
    } >>/etc/hosts
  fi
}

remove_network() {
  local i
  for i in $(seq "$NODES"); do
    ip netns del "ntl-n$i" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if grep -qF "$MARK" /etc/hosts; then
    sed -i "/^$MARK\$/,/^$MARK end\$/d" /etc/hosts
  fi
}

wait_idle() {
  local state node
  for node in $(node_names); do
    for _ in $(seq 60); do
      state=$(SLURM_CONF=$CONF sinfo -h -n "$node" -o %T 2>/dev/null || true)
      case $state in
        idle* | mixed* | allocated*) continue 2 ;;
        down* | drain*) SLURM_CONF=$CONF scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
      esac
      sleep 1
    done
    die "node $node did not become idle (state '${state:-unknown}'); see $STATE/log/"
  done
}

start() {
  [[ $(id -u) == 0 ]] || die "run as root (the daemons run as root on this test cluster)"
  [[ $NODES =~ ^[1-9]$ ]] || die "NTL_SLURM_NODES=$NODES: expected 1 to 9"
  for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || die "$tool not found: install Debian's slurm-wlm and munge (bash scripts/setup_slurm.sh)"
  done
  if ! pgrep -x munged >/dev/null; then
    if [[ ! -f /etc/munge/munge.key ]]; then
      command -v mungekey >/dev/null || die "/etc/munge/munge.key is missing and there is no mungekey to create it"
      mungekey --create --keyfile=/etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge/munge.key
    chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
  fi
  [[ -f $CONF ]] || write_conf
  [[ $NODES == 1 ]] || make_network
  if ! pid_alive "$STATE/run/slurmctld.pid"; then
    slurmctld -f "$CONF" -c -i
  fi
  local node i=0
  for node in $(node_names); do
    i=$((i + 1))
    pid_alive "$STATE/run/slurmd-$node.pid" && continue
    if [[ $NODES == 1 ]]; then
      slurmd -f "$CONF" -N "$node"
    else  # its own network and hostname; the daemon and its jobs keep both
      # nsenter, not 'ip netns exec', which remounts /sys and hides the cgroup tree slurmd reads
      nsenter --net=/run/netns/ntl-n$i unshare --uts sh -c "hostname $node && exec slurmd -f '$CONF' -N $node"
    fi
  done
  wait_idle
  echo "local Slurm cluster up: $NODES node(s) ($(node_names | tr '\n' ' ')), $(nproc) CPUs each; eval \"\$($0 env)\" to use it"
}

stop() {
  local pidfile
  for pidfile in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid"; do
    [[ -f $pidfile ]] || continue
    if pid_alive "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 30); do pid_alive "$pidfile" || break; sleep 0.5; done
    fi
    rm -f "$pidfile"
  done
  [[ $NODES == 1 ]] || remove_network
  rm -f "$CONF"  # the next start writes it again for this machine
  echo "local Slurm cluster stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF sinfo && SLURM_CONF=$CONF squeue ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: [NTL_SLURM_NODES=N] $0 start|stop|status|env" >&2; exit 2 ;;
esac
