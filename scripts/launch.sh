#!/usr/bin/env bash
# Launch a flame run (or another module, e.g. flame.eval) under torchrun: one GPU, one node or many.
set -euo pipefail

usage() {
  cat <<'TXT'
usage: scripts/launch.sh CONFIG.toml [--section.key=value | --section.key value ...]
       scripts/launch.sh -m MODULE [ARGS ...]

The first form trains (python -m flame.train --config CONFIG.toml ...) on every rank. The second runs
`python -m MODULE ARGS` on every rank instead, e.g. `NPROC=8 scripts/launch.sh -m flame.eval MODEL --data GLOB`:
the same processes, nodes and rendezvous, without the training config check, the run folder lock and the per-rank
log files; the ranks' output comes to this terminal and this script's own lines go to stderr.

Environment (all optional):
  NGPU         processes per node (default: every visible GPU; 1 on a machine without GPU)
  NPROC        same as NGPU, wins over it (e.g. NPROC=2 for two CPU processes with gloo)
  NNODES       number of nodes (default 1, or SLURM_JOB_NUM_NODES under Slurm)
  NODE_RANK    this node's index (default 0, or SLURM_NODEID)
  MASTER_ADDR  rendezvous host (default: this machine; under Slurm the first node of the job)
  MASTER_PORT  rendezvous port (default 29500 on several nodes; a free port on one node)
  RDZV_ID      rendezvous id shared by all nodes (default: SLURM_JOB_ID, or "flame")
  MAX_RESTARTS times torchrun starts every rank again after one fails (a rank killed, a node's process lost):
               the run resumes from its last complete checkpoint unattended (default 0: a failed rank ends the job)
  PYTORCH_ALLOC_CONF  the CUDA allocator's settings (default expandable_segments:True unless it or
               PYTORCH_CUDA_ALLOC_CONF is set)
Stopping: Ctrl-C (SIGINT), SIGTERM or SIGUSR1 sent to this script make every rank finish its step, save a
checkpoint and exit 0; a second Ctrl-C stops at once without saving (exit 130). The ranks and their data workers
never outlive this script, however it ends (SIGKILL included). One run per run folder: a second launch on a folder
in use stops with exit code 2.
Backends: NCCL on GPU, gloo on CPU. Per-rank logs: {job.dump_folder}/logs/. The config is checked first: a bad key
or value stops here with exit code 2.
With -m MODULE, Ctrl-C or SIGTERM stops the ranks at once (exit 130 or 143) and SIGUSR1 is ignored: a module has no
checkpoint to save.
TXT
}
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then usage; [[ $# -ge 1 ]] && exit 0 || exit 2; fi
module=""
if [[ $1 == -m ]]; then
  [[ $# -ge 2 && -n $2 ]] || { echo "launch.sh: -m needs a module name, e.g. -m flame.eval" >&2; exit 2; }
  module=$2; shift 2
  # no cd: the ranks read relative paths (MODEL, --data) from the caller's folder and find flame on PYTHONPATH
  PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
else
  config=$1; shift
  cd "$(dirname "$0")/.."
fi

if [[ -n ${SLURM_JOB_ID:-} ]]; then
  NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
  NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [[ -z ${NGPU:-} && -z ${NPROC:-} ]]; then
  NGPU=$("${PYTHON:-python3}" -c "import torch; print(torch.cuda.device_count())")
fi
NPROC=${NPROC:-$NGPU}
[[ $NPROC -ge 1 ]] || NPROC=1
# Fail fast (exit 2, one line) before any process starts: the config, and its parallel layout on these processes.
[[ -n $module ]] || dump=$("${PYTHON:-python3}" -m flame.check_config --config "$config" "$@" --strict \
  --world-size $((NNODES * NPROC)) --get job.dump_folder)
# Another run holds this folder: exit 2, one line. Rank 0 (on node 0) takes the lock for good once it starts.
[[ -n $module || $NODE_RANK -ne 0 ]] || "${PYTHON:-python3}" -m flame.run_lock "$dump"

if [[ -z $module ]]; then
  logs="$dump/logs/$(date +%Y%m%d-%H%M%S)-node$NODE_RANK"
  mkdir -p "$logs"
  outputs=(--log-dir "$logs" --redirects 3 --tee 3)
  target=(-m flame.train --config "$config" "$@")
else
  outputs=()
  target=(-m "$module" "$@")
fi
if [[ $NNODES -eq 1 && -z ${MASTER_PORT:-} ]]; then
  rdzv=(--standalone)  # one node: c10d rendezvous on a free local port
else
  rdzv=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}"
        --rdzv-id "${RDZV_ID:-flame}" --node-rank "$NODE_RANK")
fi
# NVLink SHARP multicast stays off (see README): it has hung collectives on shared machines.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
# Expandable segments (as torchtitan launches): a step's varying tensor sizes then grow one mapped segment instead of
# leaving cached blocks too small to reuse, which near a full GPU makes the allocator free its cache and retry (a
# device-wide wait). An allocator setting of the user's own (either name) is left as it is.
if [[ -z ${PYTORCH_ALLOC_CONF:-} && -z ${PYTORCH_CUDA_ALLOC_CONF:-} ]]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
if [[ -z $module ]]; then
  echo "launch: $config on $NNODES node(s) x $NPROC process(es); logs in $logs"
else
  echo "launch: $module on $NNODES node(s) x $NPROC process(es)" >&2  # stdout is the module's alone
fi
# SIGINT / SIGTERM / SIGUSR1 (preemption notice) go to the training processes, which save a checkpoint and exit 0;
# sent to torchrun itself, they would make it kill its workers and fail.
# A signal that comes before torchrun has started the ranks is kept and sent once they are there.
torchrun=""
pending=""
forward() { if [[ -n $torchrun ]] && pkill "-$1" -P "$torchrun" 2>/dev/null; then pending=""; else pending=$1; fi; }
interrupts=0
on_interrupt() {
  interrupts=$((interrupts + 1))
  if [[ $interrupts -eq 1 ]]; then
    echo "launch: stopping after the steps under way, with a checkpoint (Ctrl-C again to stop at once, saving" \
      "nothing)" >&2 || true
    forward INT
  else
    echo "launch: stopped at once, nothing saved" >&2 || true
    [[ -z $torchrun ]] || kill -KILL "$torchrun" 2>/dev/null || true  # the ranks and their data workers end with it
    exit 130
  fi
}
stop_now() {  # -m MODULE: nothing to save, so a stop is immediate
  echo "launch: stopped" >&2 || true
  if [[ -n $torchrun ]]; then
    pkill -KILL -P "$torchrun" 2>/dev/null || true  # the ranks, also of a module that does not bind to torchrun
    kill -KILL "$torchrun" 2>/dev/null || true
  fi
  exit "$1"
}
if [[ -z $module ]]; then
  trap 'forward TERM' TERM
  trap 'forward USR1' USR1
  trap on_interrupt INT
else
  trap 'stop_now 143' TERM
  trap '' USR1
  trap 'stop_now 130' INT
fi
trap '' PIPE  # `launch.sh ... | tee log` and Ctrl-C: tee is gone, the run must still stop cleanly
# torchrun runs in a process group of its own (set -m), so that a terminal's Ctrl-C reaches only this script, which
# forwards it; torchrun's own handler would kill the ranks and fail with a traceback. flame.lifeline binds torchrun
# to this script and the ranks to torchrun: whatever ends this script ends them (the ranks run in sessions of their
# own, out of reach of a signal to this script's process group).
set -m
FLAME_PARENT_PID=$$ "${PYTHON:-python3}" -m flame.lifeline torch.distributed.run --nnodes "$NNODES" \
  --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" "${rdzv[@]}" ${outputs[@]+"${outputs[@]}"} "${target[@]}" &
torchrun=$!
set +m
rc=0
while true; do
  if [[ -n $pending ]] && kill -0 "$torchrun" 2>/dev/null; then
    forward "$pending"
    [[ -z $pending ]] || { sleep 0.2; continue; }
  fi
  rc=0
  wait "$torchrun" || rc=$?  # a trapped signal ends `wait` early: keep waiting for torchrun's own exit code
  kill -0 "$torchrun" 2>/dev/null || break
done
exit "$rc"
