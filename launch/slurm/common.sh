# shellcheck shell=bash
# What deepspeed.sbatch, megatron.sbatch and torchtitan.sbatch share: arguments, site settings, checks, the run
# directory, the launch and the preemption protocol. Sourced, never run. The sourcing script sets
# NTL_JOB_KIND (deepspeed | megatron | torchtitan), NTL_DEFAULT_ENTRY (a script, or -m and a module),
# NTL_DEFAULT_CONFIG and NTL_STOP_SIGNAL (optionally NTL_CONFIG_IS_NAME=1: --config is a name, not a
# file; NTL_STOP_FAILS=1: the entry exits non-zero when stopped on the warning), and
# defines ntl_entry_args (the entry's arguments, from NTL_CONFIG, NTL_RUN_DIR and NTL_EXTRA) and
# ntl_finished (true once the run has reached its last step).

ntl_fail() {
  echo "[ntl-slurm] error: $*" >&2
  exit 2
}

ntl_log() { echo "[ntl-slurm] $*"; }

ntl_usage() {
  cat <<EOF
Usage: sbatch [sbatch options] launch/slurm/$NTL_JOB_KIND.sbatch [options] [-- entry arguments]
       bash launch/slurm/$NTL_JOB_KIND.sbatch --dry-run [--nodes N] [--procs-per-node N] [options]

Runs the $NTL_JOB_KIND training entry as one Slurm task per process (one per GPU), on every node of
the allocation. Nodes come from sbatch --nodes, processes per node from --ntasks-per-node (the
#SBATCH header sets both; override them on the sbatch command line, not here).

Options:
  --config PATH       run config (default: $NTL_DEFAULT_CONFIG; torchtitan: a config_registry name)
  --entry "SCRIPT.."  Python script (and leading arguments) each task runs (default: $NTL_DEFAULT_ENTRY)
  --run-dir DIR       run directory (default: \$NTL_RUNS/<job name>-<job id>; a requeued job keeps it)
  --dry-run           print the commands and exit without launching (works outside Slurm)
  --nodes N           with --dry-run: nodes to plan for (default: the #SBATCH header's)
  --procs-per-node N  with --dry-run: processes per node (default: the #SBATCH header's)
  -h, --help          this text
  -- ARGS             passed to the entry after the config's arguments

Site settings, from the environment or the file \$NTL_SITE_ENV (default launch/slurm/site.env;
see launch/slurm/site.env.example):
  NTL_HOME     the ntl_scale checkout (default: the sbatch submission directory)
  NTL_MODULES  environment modules to load, space separated (needs the 'module' command)
  NTL_VENV     a virtual environment to activate (its bin/activate must exist)
  NTL_PYTHON   the interpreter (default: python3)
  NTL_RUNS     where run directories go (default: \$NTL_HOME/runs)
  NTL_MASTER_PORT  rendezvous port (default: 20000 + job id mod 12000; must be free)

Preemption: the #SBATCH --signal line asks Slurm for a warning signal before the time limit. On it,
the job tells the training processes to checkpoint and stop ($NTL_STOP_SIGNAL), then requeues
itself; the requeued job resumes from the latest checkpoint in the same run directory.
EOF
}

# Fills NTL_* from the command line; $1 is the batch script's own path (for its #SBATCH defaults).
ntl_parse_args() {
  local self=$1
  shift
  NTL_DRY_RUN=0 NTL_CONFIG=$NTL_DEFAULT_CONFIG NTL_ENTRY=$NTL_DEFAULT_ENTRY NTL_RUN_DIR=""
  NTL_PLAN_NODES="" NTL_PLAN_PROCS="" NTL_EXTRA=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      -h | --help) ntl_usage; exit 0 ;;
      --dry-run) NTL_DRY_RUN=1; shift ;;
      --config | --entry | --run-dir | --nodes | --procs-per-node)
        [[ $# -ge 2 ]] || ntl_fail "$1 needs a value (see --help)"
        case $1 in
          --config) NTL_CONFIG=$2 ;;
          --entry) NTL_ENTRY=$2 ;;
          --run-dir) NTL_RUN_DIR=$2 ;;
          --nodes) NTL_PLAN_NODES=$2 ;;
          --procs-per-node) NTL_PLAN_PROCS=$2 ;;
        esac
        shift 2
        ;;
      --)
        shift
        # shellcheck disable=SC2034  # read by the sourcing script's ntl_entry_args
        NTL_EXTRA=("$@")
        break
        ;;
      *) ntl_fail "unknown option '$1' (entry arguments go after --; see --help)" ;;
    esac
  done
  local header_nodes header_procs
  header_nodes=$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$self" | head -n1)
  header_procs=$(sed -n 's/^#SBATCH --ntasks-per-node=\([0-9]*\).*/\1/p' "$self" | head -n1)
  if [[ -n ${SLURM_JOB_ID:-} && $NTL_DRY_RUN == 0 ]]; then
    [[ -z $NTL_PLAN_NODES$NTL_PLAN_PROCS ]] || ntl_fail "--nodes/--procs-per-node are for --dry-run; in a job use sbatch --nodes/--ntasks-per-node"
    NTL_NODES=${SLURM_JOB_NUM_NODES:-0}
    NTL_PROCS=${SLURM_NTASKS_PER_NODE:-}
    NTL_PROCS=${NTL_PROCS%%(*}
    [[ -n $NTL_PROCS ]] || ntl_fail "SLURM_NTASKS_PER_NODE is not set: submit with --ntasks-per-node=<GPUs per node> (without it only one task starts per node)"
  else
    NTL_NODES=${NTL_PLAN_NODES:-$header_nodes}
    NTL_PROCS=${NTL_PLAN_PROCS:-$header_procs}
  fi
  [[ $NTL_NODES =~ ^[0-9]+$ && $NTL_NODES -ge 1 ]] || ntl_fail "nodes = '$NTL_NODES': expected a whole number >= 1 (sbatch --nodes=N, or --nodes N with --dry-run)"
  [[ $NTL_PROCS =~ ^[0-9]+$ && $NTL_PROCS -ge 1 ]] || ntl_fail "processes per node = '$NTL_PROCS': expected a whole number >= 1 (sbatch --ntasks-per-node=N)"
}

# Site settings: the env file, modules, venv, interpreter, paths. Checks each before anything runs.
ntl_site() {
  NTL_HOME=${NTL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
  [[ -f $NTL_HOME/launch/slurm/common.sh ]] || ntl_fail "NTL_HOME=$NTL_HOME is not an ntl_scale checkout: submit from the checkout or set NTL_HOME"
  local site=${NTL_SITE_ENV:-$NTL_HOME/launch/slurm/site.env}
  if [[ -n ${NTL_SITE_ENV:-} && ! -f $NTL_SITE_ENV ]]; then
    ntl_fail "NTL_SITE_ENV=$NTL_SITE_ENV does not exist: point it at your site file (template: launch/slurm/site.env.example)"
  fi
  if [[ -f $site ]]; then
    # shellcheck source=/dev/null
    source "$site"
  fi
  if [[ -n ${NTL_MODULES:-} ]]; then
    command -v module >/dev/null || ntl_fail "NTL_MODULES='$NTL_MODULES' but this node has no 'module' command: unset NTL_MODULES or load your module system first"
    # shellcheck disable=SC2086
    module load $NTL_MODULES || ntl_fail "module load $NTL_MODULES failed"
  fi
  if [[ -n ${NTL_VENV:-} ]]; then
    [[ -f $NTL_VENV/bin/activate ]] || ntl_fail "NTL_VENV=$NTL_VENV has no bin/activate: create it (python3 -m venv \$NTL_VENV && bash scripts/setup.sh) or fix the path"
    # shellcheck source=/dev/null
    source "$NTL_VENV/bin/activate"
  fi
  NTL_PYTHON=${NTL_PYTHON:-python3}
  command -v "$NTL_PYTHON" >/dev/null || ntl_fail "NTL_PYTHON=$NTL_PYTHON not found on PATH"
  NTL_RUNS=${NTL_RUNS:-$NTL_HOME/runs}
  if [[ -n $NTL_CONFIG && ${NTL_CONFIG_IS_NAME:-0} != 1 ]]; then
    [[ $NTL_CONFIG == /* ]] || NTL_CONFIG=$NTL_HOME/$NTL_CONFIG
    [[ -f $NTL_CONFIG ]] || ntl_fail "config '$NTL_CONFIG' does not exist: pass --config PATH (relative to $NTL_HOME or absolute)"
  fi
  read -r -a NTL_ENTRY_WORDS <<<"$NTL_ENTRY"
  [[ ${#NTL_ENTRY_WORDS[@]} -gt 0 ]] || ntl_fail "--entry is empty"
  local script=${NTL_ENTRY_WORDS[0]}
  if [[ $script == -m ]]; then
    [[ ${#NTL_ENTRY_WORDS[@]} -ge 2 ]] || ntl_fail "--entry '-m' names no module"
    return
  fi
  [[ $script == /* ]] || script=$NTL_HOME/$script
  [[ -f $script ]] || ntl_fail "entry script '$script' does not exist"
}

# The rendezvous: first node of the allocation, a job-unique port that must be free there.
ntl_rendezvous() {
  local job=${SLURM_JOB_ID:-0}
  if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
  else
    MASTER_ADDR=${MASTER_ADDR:-localhost}
  fi
  # 20000-31999: below Linux's ephemeral range (32768-60999), where another process's outgoing connection
  # can hold the port between the check below and the rendezvous
  MASTER_PORT=${NTL_MASTER_PORT:-$((20000 + job % 12000))}
  [[ $MASTER_PORT =~ ^[0-9]+$ && $MASTER_PORT -ge 1024 && $MASTER_PORT -le 65535 ]] ||
    ntl_fail "NTL_MASTER_PORT='$MASTER_PORT': expected a port number in 1024-65535"
  if [[ $NTL_DRY_RUN == 0 ]] && ! "$NTL_PYTHON" - "$MASTER_PORT" <<'PY'; then
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore: TIME_WAIT is no conflict
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(1)
PY
    ntl_fail "port $MASTER_PORT is in use on $(hostname): set NTL_MASTER_PORT to a free port"
  fi
  export MASTER_ADDR MASTER_PORT
}

# Run directory: resolved settings, the exact command, the environment; the job log linked in.
ntl_prepare_run_dir() {
  NTL_RUN_DIR=${NTL_RUN_DIR:-$NTL_RUNS/${SLURM_JOB_NAME:-ntl-$NTL_JOB_KIND}-${SLURM_JOB_ID:-dryrun}}
  [[ $NTL_RUN_DIR == /* ]] || NTL_RUN_DIR=$NTL_HOME/$NTL_RUN_DIR
  NTL_ENTRY_ARGS=()
  ntl_entry_args
  NTL_LAUNCH=(srun --kill-on-bad-exit=1 --nodes="$NTL_NODES" --ntasks-per-node="$NTL_PROCS"
    "$NTL_HOME/launch/slurm/task.sh" "$NTL_PYTHON" "${NTL_ENTRY_WORDS[@]}" "${NTL_ENTRY_ARGS[@]}")
  if [[ $NTL_DRY_RUN == 1 ]]; then
    echo "# $NTL_JOB_KIND job: $NTL_NODES node(s) x $NTL_PROCS process(es) = $((NTL_NODES * NTL_PROCS)) ranks"
    echo "export MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
    echo "mkdir -p $NTL_RUN_DIR"
    printf '%q ' "${NTL_LAUNCH[@]}"
    echo
    exit 0
  fi
  mkdir -p "$NTL_RUN_DIR/logs"
  local attempt=${SLURM_RESTART_COUNT:-0}
  [[ -z $NTL_CONFIG || ${NTL_CONFIG_IS_NAME:-0} == 1 ]] || cp "$NTL_CONFIG" "$NTL_RUN_DIR/$(basename "$NTL_CONFIG")"
  {
    echo "# job $SLURM_JOB_ID attempt $attempt on $SLURM_JOB_NODELIST, $(date -Is)"
    echo "export MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
    printf '%q ' "${NTL_LAUNCH[@]}"
    echo
  } >>"$NTL_RUN_DIR/command.sh"
  env | sort >"$NTL_RUN_DIR/logs/env-$SLURM_JOB_ID-$attempt.txt"
  local log
  log=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n1)
  [[ -z $log || ! -f $log ]] || ln -sfn "$log" "$NTL_RUN_DIR/logs/$(basename "$log")"
  ntl_log "run directory $NTL_RUN_DIR (attempt $attempt), $NTL_NODES node(s) x $NTL_PROCS process(es), rendezvous $MASTER_ADDR:$MASTER_PORT"
}

# Launch, forward the time-limit warning as NTL_STOP_SIGNAL, requeue when stopped early.
ntl_launch() {
  NTL_WARNED=0
  NTL_SRUN_PID=""
  trap ntl_on_warning USR1
  "${NTL_LAUNCH[@]}" &
  NTL_SRUN_PID=$!
  local rc=0
  wait "$NTL_SRUN_PID" || rc=$?
  while kill -0 "$NTL_SRUN_PID" 2>/dev/null; do  # a trapped signal interrupts wait; wait again
    rc=0
    wait "$NTL_SRUN_PID" || rc=$?
  done
  if [[ $rc != 0 && ! ($NTL_WARNED == 1 && ${NTL_STOP_FAILS:-0} == 1) ]]; then
    ntl_log "training exited with status $rc"
    exit "$rc"
  fi
  if [[ $NTL_WARNED == 1 ]] && ! ntl_finished; then
    ntl_log "checkpointed before the time limit: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || ntl_fail "scontrol requeue $SLURM_JOB_ID failed: resubmit with the same --run-dir to resume"
    exit 0
  fi
  ntl_log "done"
}

ntl_on_warning() {
  NTL_WARNED=1
  ntl_log "time-limit warning: asking the training processes to checkpoint and stop (SIG$NTL_STOP_SIGNAL)"
  [[ -z $NTL_SRUN_PID ]] || kill -s "$NTL_STOP_SIGNAL" "$NTL_SRUN_PID" 2>/dev/null || true
}

ntl_main() {
  ntl_parse_args "$@"
  ntl_site
  ntl_rendezvous
  ntl_prepare_run_dir
  ntl_launch
}
