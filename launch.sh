#!/usr/bin/env bash
# Launch train_ddp.py with torchrun on exactly the GPUs named (physical ids, as nvidia-smi shows them),
# or on the CPU. See `bash launch.sh --help`.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: bash launch.sh GPU_IDS|cpu[:N] [train_ddp.py options]

  GPU_IDS   comma-separated physical GPU indices as `nvidia-smi -L` lists them, e.g. 5,6,7.
            The launcher exports CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES=5,6,7 before
            Python starts and runs one process per GPU; inside, rank i uses cuda:i (5 -> cuda:0,
            6 -> cuda:1, 7 -> cuda:2), so no process ever touches another card.
  cpu[:N]   N processes on the CPU with the gloo backend (default 2), OMP_NUM_THREADS set to share
            the cores among them.

Every other argument goes to train_ddp.py unchanged; `python train_ddp.py --help` lists them.
Before starting the ranks, `train_ddp.py --prepare-only` checks the dataset and the checkpoint to resume
from (and builds the preprocessing cache), so bad input stops the job once, with one message.

Environment:
  MAX_RESTARTS      torchrun restarts all ranks this many times after a failure (default 3); every
                    restart resumes from the last checkpoint
  NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
                    multi-node: run launch.sh on every node with the same GPU ids; ranks meet through
                    torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT (default port 29500); two
                    jobs whose first node is the same need ports of their own. NODE_RANK 0 hosts
                    the rendezvous store, so MASTER_ADDR must be node 0's address (any interface's)
  RDZV_ID           rendezvous id shared by the nodes (default: $SLURM_JOB_ID, else unet3d)
  RDZV_TIMEOUT      seconds a node waits for the others to reach the rendezvous (default 600): each
                    node's pre-flight (a first run's preprocessing) comes before it
  OMP_NUM_THREADS   threads per process (default: CPUs / processes)
  NVIDIA_SMI_TIMEOUT  seconds to wait for `nvidia-smi -L` (default 60; a hung driver stops the launch)
  PYTHON            the interpreter (default python3): one process of it checks the job (the pre-flight)
                    and then, once it passes, runs torchrun's agent, whose ranks run under it too
  TORCHRUN          a torchrun command to start the ranks instead (words split on blanks, e.g.
                    "python3.11 -m torch.distributed.run"); the pre-flight then runs alone under PYTHON
EOF
}

die() {
  echo "launch.sh: $*" >&2
  exit 2
}

if [[ $# -lt 1 ]]; then
  usage >&2
  exit 2
fi
case "$1" in
  -h | --help)
    usage
    exit 0
    ;;
esac

spec=$1
shift
[[ ${1:-} != -- ]] || shift  # `launch.sh cpu -- --epochs 1`: the separator is not train_ddp.py's
UNET3D_LAUNCH_TIME=$(date +%s.%N)  # --time-limit counts from here
export UNET3D_LAUNCH_TIME

PYTHON=${PYTHON:-python3}
MAX_RESTARTS=${MAX_RESTARTS:-3}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
number() { [[ $1 =~ ^0*[0-9]{1,6}$ ]] && echo $((10#$1)); }  # decimal, as torchrun reads it (08 is 8)
restarts=$(number "$MAX_RESTARTS") || die "MAX_RESTARTS must be a number >= 0, got '$MAX_RESTARTS'"
nodes=$(number "$NNODES") && ((nodes >= 1)) || die "NNODES must be a positive number, got '$NNODES'"
node_rank=$(number "$NODE_RANK") && ((node_rank < nodes)) ||
  die "NODE_RANK must be in 0..$((nodes - 1)), got '$NODE_RANK'"
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
rdzv_timeout=$(number "$RDZV_TIMEOUT") && ((rdzv_timeout >= 1)) ||
  die "RDZV_TIMEOUT must be a positive number of seconds, got '$RDZV_TIMEOUT'"
MAX_RESTARTS=$restarts NNODES=$nodes NODE_RANK=$node_rank
if ((NNODES > 1)); then
  [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of the node that hosts the rendezvous)"
fi
port=$(number "${MASTER_PORT:-29500}") && ((port >= 1 && port <= 65535)) ||
  die "MASTER_PORT must be a port number, 1 to 65535, got '$MASTER_PORT'"

torchrun=()  # none given: the pre-flight's process goes on as torchrun's agent, its ranks under $PYTHON
[[ -z ${TORCHRUN:-} ]] || read -r -a torchrun <<<"$TORCHRUN"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then  # train_ddp.py's options, once (not from every rank)
    exec "$PYTHON" "$here/train_ddp.py" --help
  fi
done
cpus=$(nproc)
who=rank
((NNODES == 1)) || who="node $NODE_RANK local rank"

if [[ $spec =~ ^cpu(:(.*))?$ ]]; then
  nproc_per_node=2
  [[ -z ${BASH_REMATCH[1]} ]] || nproc_per_node=${BASH_REMATCH[2]}
  [[ $nproc_per_node =~ ^0*[1-9][0-9]{0,3}$ ]] ||
    die "cpu:N needs a positive number of processes, got '$nproc_per_node' (1 to 9999)"
  nproc_per_node=$((10#$nproc_per_node))  # 010 is 10 processes, as torchrun reads it
  export CUDA_VISIBLE_DEVICES=""  # hide every GPU: the ranks use gloo on the CPU
  export UNET3D_EXPECT_CUDA=0
  threads=$((cpus / nproc_per_node))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
  echo "launch.sh: $nproc_per_node CPU process(es), gloo backend, OMP_NUM_THREADS=$OMP_NUM_THREADS"
  for ((i = 0; i < nproc_per_node; i++)); do
    echo "  $who $i -> cpu"
  done
else
  [[ -n $spec ]] || die "empty GPU list; give ids like 5,6,7 or cpu[:N]"
  [[ $spec != -* || $spec =~ ^-[0-9] ]] || die "the first argument must be GPU ids or cpu[:N], got option '$spec'"
  # (a newline too: `read` below takes one line, and "$(nvidia-smi --query-gpu=index ...)" trained on the first)
  [[ $spec != *[[:space:]]* ]] || die "GPU list '${spec//$'\n'/\\n}' holds a space or a line break: give ids separated by commas alone, e.g. 5,6,7"
  IFS=, read -r -a ids <<<"$spec,"
  [[ ${#ids[@]} -ge 1 ]] || die "empty GPU list '$spec'"
  declare -A seen=()
  for i in "${!ids[@]}"; do
    id=${ids[$i]}
    [[ -n $id ]] || die "empty entry in GPU list '$spec'"
    [[ $id =~ ^-[0-9]+$ ]] && die "negative GPU id '$id' in '$spec'"
    [[ $id =~ ^[0-9]+$ ]] || die "GPU id '$id' in '$spec' is not a number"
    [[ $id =~ ^0*[0-9]{1,6}$ ]] || die "GPU id '$id' in '$spec' is too large"
    id=$((10#$id))  # 05 is 5: CUDA would read 5,05 as a repeated ordinal and hide every GPU
    [[ -z ${seen[$id]:-} ]] || die "GPU id $id appears twice in '$spec'"
    seen[$id]=1
    ids[$i]=$id
  done
  spec=$(IFS=,; echo "${ids[*]}")
  command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: no NVIDIA driver? Use 'cpu' to train on the CPU"
  smi=(nvidia-smi -L)
  wait_s=$(number "${NVIDIA_SMI_TIMEOUT:-60}") && ((wait_s >= 1)) ||  # (timeout 0 would wait for ever)
    die "NVIDIA_SMI_TIMEOUT must be a positive number of seconds, got '$NVIDIA_SMI_TIMEOUT'"
  # a hung driver: a message, no hang (-k: SIGKILL 5 s after a SIGTERM it ignores; not --foreground, with which
  # only nvidia-smi would be signalled, and a process it started could hold the output open for ever)
  command -v timeout >/dev/null 2>&1 && smi=(timeout -k 5 "$wait_s" nvidia-smi -L)
  # In the background, so that Ctrl-C or a scheduler's signal is acted on at once while it hangs (bash runs a
  # trap during `wait`, but only after a foreground command has ended)
  listed=$(mktemp "${TMPDIR:-/tmp}/unet3d-smi.XXXXXX" 2>/dev/null || mktemp /tmp/unet3d-smi.XXXXXX) ||
    die "cannot create a temporary file in ${TMPDIR:-/tmp} or /tmp"
  # The traps come first: a signal between starting it and trapping ended the launch and left it running.
  smi_pid=''
  stop_waiting() {  # $1: the signal's name, $2: its number
    local pid=${smi_pid:-${!:-}}  # ($!: started, its pid not yet kept)
    [[ -z $pid ]] || kill -s TERM "$pid" 2>/dev/null || true
    rm -f "$listed"
    echo "launch.sh: SIG$1 while waiting for nvidia-smi -L: the job ends" >&2 || true
    exit $((128 + $2))
  }
  trap 'stop_waiting INT 2' INT
  trap 'stop_waiting TERM 15' TERM
  trap 'stop_waiting HUP 1' HUP
  "${smi[@]}" >"$listed" 2>/dev/null &
  smi_pid=$!
  smi_status=0
  wait "$smi_pid" || smi_status=$?
  trap - INT TERM HUP
  listing=$(<"$listed")
  rm -f "$listed"
  ((smi_status == 0)) || die "nvidia-smi -L failed or did not answer within ${wait_s} s; is the NVIDIA driver loaded?"
  declare -A gpus=()  # by the index each line names (a card nvidia-smi cannot query prints another line)
  while IFS= read -r line; do
    [[ $line =~ ^GPU\ ([0-9]+):\ (.*)$ ]] && gpus[$((10#${BASH_REMATCH[1]}))]=${BASH_REMATCH[2]}
  done <<<"$listing"
  for id in "${ids[@]}"; do
    [[ -n ${gpus[$id]+x} ]] || die "GPU id $id is not among the ${#gpus[@]} GPU(s) that nvidia-smi -L lists"
  done
  nproc_per_node=${#ids[@]}
  if [[ -n ${CUDA_VISIBLE_DEVICES+x} && $CUDA_VISIBLE_DEVICES != "$spec" ]]; then  # (a SLURM allocation's?)
    echo "launch.sh: warning: CUDA_VISIBLE_DEVICES was '$CUDA_VISIBLE_DEVICES'; the ids given are physical (as nvidia-smi -L numbers them), so it becomes $spec. Inside a SLURM allocation give the ids it set (slurm/train.sbatch does)" >&2
  fi
  export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA numbers GPUs as nvidia-smi does
  export CUDA_VISIBLE_DEVICES=$spec
  export UNET3D_EXPECT_CUDA=1  # the pre-flight and every rank refuse to run on the CPU instead
  threads=$((cpus / nproc_per_node))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
  echo "launch.sh: CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES, $nproc_per_node process(es), nccl backend"
  for i in "${!ids[@]}"; do
    echo "  $who $i -> cuda:$i -> physical GPU ${ids[$i]}: ${gpus[${ids[$i]}]}"
  done
fi

children() {  # the processes whose parent is $1: the pre-flight's workers, torchrun's ranks
  local stat fields ppid
  for stat in /proc/[0-9]*/stat; do
    read -r fields 2>/dev/null <"$stat" || continue  # (gone meanwhile)
    fields=${fields##*) }  # past "pid (command) "
    read -r _ ppid _ <<<"$fields"
    if [[ $ppid == "$1" ]]; then
      stat=${stat#/proc/}
      echo "${stat%/stat}"
    fi
  done
}
# Made before the pre-flight, so a TMPDIR that does not exist (a login node's, exported) fails nothing late.
UNET3D_STOP_FILE=$(mktemp "${TMPDIR:-/tmp}/unet3d-stop.XXXXXX" 2>/dev/null || mktemp /tmp/unet3d-stop.XXXXXX) ||
  die "cannot create a temporary file in ${TMPDIR:-/tmp} or /tmp"
export UNET3D_STOP_FILE
# (.end-*: the ranks' "end the job" marks; .agent: the pre-flight passed, torchrun's agent runs in its process)
trap 'rm -f "$UNET3D_STOP_FILE" "$UNET3D_STOP_FILE".end-* "$UNET3D_STOP_FILE".agent' EXIT

# A fresh store for every torchrun restart: with the agent's shared store, a restarted gloo group can read
# the killed round's peer addresses and fail to connect ("Connection refused") or hang.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
if ((NNODES == 1)) && [[ -z ${MASTER_ADDR:-} ]]; then
  rendezvous=(--standalone)
else
  rendezvous=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$port" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-unet3d}}"
    --rdzv-conf "is_host=$((NODE_RANK == 0)),join_timeout=$rdzv_timeout,read_timeout=$rdzv_timeout")
  # Node 0 hosts the store by its rank: torchrun's own guess matches MASTER_ADDR against the hostname's
  # addresses only, so an address on another interface (a cluster's InfiniBand IP) made every node a client,
  # and the job waited for a store that nobody started.
fi

# Pre-flight: the dataset, the plan, the cache and the checkpoint are checked in one process, no GPU touched
# (PyTorch asks NVML, not CUDA, whether GPUs exist), and that process goes on as torchrun's agent once they
# pass (`train_ddp.py --torchrun`; with TORCHRUN given, it ends and that command starts). In the background,
# so that a signal meanwhile (bash runs traps only between foreground commands) ends it and its workers with
# the job at once, instead of leaving it to go on preprocessing without us.
preflight_pid=''
before_training() {  # $1: the signal's name, $2: its number
  echo "launch.sh: SIG$1 before training: the job ends" >&2 || true
  local pid=${preflight_pid:-${!:-}}  # ($!: started, its pid not yet kept; else nvidia-smi's, ended)
  if [[ -n $pid && $pid != "${smi_pid:-}" ]]; then
    # shellcheck disable=SC2046  # one pid per word
    kill -s TERM "$pid" $(children "$pid") 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  exit $((128 + $2))
}
# Stopping. The first SIGTERM, SIGINT or SIGHUP to reach this script (`kill PID`, a scheduler signalling the
# batch shell, Ctrl-C) goes to torchrun as SIGTERM, after which it never restarts the ranks: it passes the
# signal on, the ranks finish their step, save and exit 0, and torchrun exits 1 with a SignalException. The
# ranks get the signal from here as well, in case torchrun, signalled twice (Ctrl-C reaches it directly
# too), stops passing it on. Every rank that stopped and saved appends "<torchrun restart> <rank>" to
# UNET3D_STOP_FILE; once the ranks have ended, if all of this node's did so in torchrun's last attempt (the
# one whose ranks started training last), the stop was graceful: exit code 0. A second signal goes to the ranks alone, and ends them at once.
signals=0 trapped=0 pending='' torchrun_pid='' ranks='' exited=0
forward() {  # $1: the signal received
  trapped=1
  if [[ -z $torchrun_pid ]]; then  # torchrun is being started: handled once it has a pid
    pending=$1
    return
  fi
  signals=$((signals + 1))
  local now=$ranks
  if ((!exited)); then  # (once torchrun has ended, its pid may be another process's)
    now=$(children "$torchrun_pid")
    [[ -z $now ]] || ranks=$now
    ((signals > 1)) || kill -s TERM "$torchrun_pid" 2>/dev/null || true
  fi
  if [[ -n $now ]]; then
    # shellcheck disable=SC2086  # one pid per word
    kill -s "$1" $now 2>/dev/null || true
  fi
  if ((signals == 1)); then  # last: a terminal gone or a full disk must not keep the signal from torchrun
    echo "launch.sh: SIG$1: stopping (the ranks finish their step and save; a second signal ends them)" >&2 || true
  fi
}
agent=("${rendezvous[@]}" --nproc-per-node "$nproc_per_node" --max-restarts "$MAX_RESTARTS" "$here/train_ddp.py" "$@")
if ((${#torchrun[@]})); then  # TORCHRUN given: the pre-flight in a process of its own, then that command
  trap 'before_training INT 2' INT
  trap 'before_training TERM 15' TERM
  trap 'before_training HUP 1' HUP
  WORLD_SIZE=$((nproc_per_node * NNODES)) LOCAL_WORLD_SIZE=$nproc_per_node PYTORCH_NVML_BASED_CUDA_CHECK=1 \
    "$PYTHON" "$here/train_ddp.py" "$@" --prepare-only &
  preflight_pid=$!
  status=0
  wait "$preflight_pid" || status=$?
  ((status == 0)) || exit "$status"
  trap 'forward INT' INT
  trap 'forward TERM' TERM HUP
  "${torchrun[@]}" "${agent[@]}" &
else  # one process: the pre-flight, then torchrun's agent (unet3d/training/agent.py), one torch import fewer
  signalled() {  # $1: the signal's name, $2: its number. Until the pre-flight has passed it ends the job
    if [[ ! -e $UNET3D_STOP_FILE.agent ]]; then
      before_training "$1" "$2"
    elif [[ $1 == INT ]]; then
      forward INT
    else
      forward TERM  # (HUP too, as with TORCHRUN given)
    fi
  }
  trap 'signalled INT 2' INT
  trap 'signalled TERM 15' TERM
  trap 'signalled HUP 1' HUP
  UNET3D_NVML_CHECK_WAS=${PYTORCH_NVML_BASED_CUDA_CHECK+set:$PYTORCH_NVML_BASED_CUDA_CHECK} PYTORCH_NVML_BASED_CUDA_CHECK=1 \
    "$PYTHON" "$here/train_ddp.py" --torchrun "${agent[@]}" &
  preflight_pid=$!
fi
torchrun_pid=$!
trap '' PIPE  # (after starting torchrun, which must not inherit it): a reader of our output gone is no end
[[ -z $pending ]] || forward "$pending"
rc=0 waited=0
while :; do
  trapped=0 status=0
  wait "$torchrun_pid" || status=$?
  ((status == 127 && waited)) && break  # collected already, before a trap made the loop go round again
  rc=$status waited=1
  ((trapped && rc > 128)) || break  # else a signal's trap interrupted the wait (128 + the signal)
done
exited=1
deadline=$((SECONDS + 120))
for pid in $ranks; do  # ranks that a twice-signalled torchrun left behind finish their save first
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
done
# Each rank writes "<restart> -1" when it starts training and "<restart> <rank>" once it stopped and saved:
# count the ranks that stopped in torchrun's last attempt (the file may be gone: /tmp cleaned meanwhile).
stopped=0
if ((rc != 0)); then
  stopped=$(awk 'NF == 2 { r = $1 + 0; if (r > last) { last = r; n = 0; split("", seen) }
    if (r == last && $2 >= 0 && !($2 in seen)) { seen[$2] = 1; n++ } } END { print n + 0 }' \
    "$UNET3D_STOP_FILE" 2>/dev/null) || stopped=0
fi
if ((rc != 0 && stopped == nproc_per_node)); then
  echo "launch.sh: torchrun ended on the signal after all $nproc_per_node rank(s) had stopped and saved" >&2
  rc=0
fi
exit "$rc"
