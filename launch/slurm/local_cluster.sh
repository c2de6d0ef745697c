#!/usr/bin/env bash
# A one-node Slurm cluster on loopback, for tests and for trying the batch scripts on one machine.
#
#   launch/slurm/local_cluster.sh start    # installs nothing; starts munged, slurmctld, slurmd
#   eval "$(launch/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch, squeue, scontrol
#   launch/slurm/local_cluster.sh status
#   launch/slurm/local_cluster.sh stop
#
# Needs root and Debian's slurm-wlm + munge (scripts/setup.sh --slurm installs them). Idempotent:
# `start` on a running cluster only waits for the node to be idle; `stop` on a stopped one does
# nothing. Everything lives under NTL_SLURM_STATE (default /var/tmp/ntl-slurm); the system's own
# /etc/slurm is never touched. The node gets this machine's CPUs and memory and one partition,
# "debug", that is the default. Daemon logs: $NTL_SLURM_STATE/log/.
set -euo pipefail

STATE=${NTL_SLURM_STATE:-/var/tmp/ntl-slurm}
CONF=$STATE/slurm.conf
NODE=$(hostname -s)

die() {
  echo "local_cluster.sh: $*" >&2
  exit 1
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local cpus mem
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  mkdir -p "$STATE"/{ctld,spool,log,run}
  cat >"$CONF.tmp" <<EOF
# written by launch/slurm/local_cluster.sh
ClusterName=ntl-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=${NTL_SLURMCTLD_PORT:-6817}
SlurmdPort=${NTL_SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
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
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  mv "$CONF.tmp" "$CONF"
}

wait_idle() {
  local state
  for _ in $(seq 60); do
    state=$(SLURM_CONF=$CONF sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case $state in
      idle* | mixed* | allocated*) return 0 ;;
      down* | drain*) SLURM_CONF=$CONF scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  die "node $NODE did not become idle (state '${state:-unknown}'); see $STATE/log/"
}

start() {
  [[ $(id -u) == 0 ]] || die "run as root (the daemons run as root on this one-node test cluster)"
  for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || die "$tool not found: install Debian's slurm-wlm and munge (scripts/setup.sh --slurm)"
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
  if ! pid_alive "$STATE/run/slurmctld.pid"; then
    slurmctld -f "$CONF" -c -i
  fi
  if ! pid_alive "$STATE/run/slurmd.pid"; then
    slurmd -f "$CONF"
  fi
  wait_idle
  echo "local Slurm cluster up: node $NODE, $(nproc) CPUs; eval \"\$($0 env)\" to use it"
}

stop() {
  local pidfile
  for pidfile in "$STATE/run/slurmd.pid" "$STATE/run/slurmctld.pid"; do
    if pid_alive "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 30); do pid_alive "$pidfile" || break; sleep 0.5; done
    fi
    rm -f "$pidfile"
  done
  rm -f "$CONF"  # the next start writes it again for this machine
  echo "local Slurm cluster stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF sinfo && SLURM_CONF=$CONF squeue ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
