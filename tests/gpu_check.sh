#!/usr/bin/env bash
# The checks only a machine with NVIDIA GPUs can make, as one command, from the repository root:
#
#   bash tests/gpu_check.sh 0,1          # the physical GPU ids to use, as nvidia-smi numbers them
#   bash tests/gpu_check.sh 5 runs/gc    # one GPU is enough for most checks; the folder is optional
#
# It trains on the synthetic data with 1 rank (the first id) and with every id given, and while the ranks
# run it asks `nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory` which card each of the job's
# processes holds memory on: every rank only on its own card, no DataLoader worker or launcher on any.
# Then it resumes across precisions (fp16 after bf16 and bf16 after fp16; on GPUs without bf16 tensor
# cores, --amp bf16 must be refused instead) and AdamW from fp16 into fp32 in another memory format (the
# fused kernels' step counts and strides), and evaluates the result with `evaluate.py --gpu`, watched
# the same way. One verdict line per check (PASS, FAIL or SKIP) and a summary; exit code 1 if any failed.
# About 5 minutes on one modern GPU. Logs of every run stay in the folder (default runs/gpu_check).
set -uo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  [[ $# -ge 1 ]] && exit 0 || exit 2
fi
ids=$1
work=${2:-runs/gpu_check}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here" || exit 2
PYTHON=${PYTHON:-python3}
passed=0 failed=0 skipped=0
pass() { echo "PASS  $*"; passed=$((passed + 1)); }
fail() { echo "FAIL  $*"; failed=$((failed + 1)); }
skip() { echo "SKIP  $*"; skipped=$((skipped + 1)); }
finish() {
  echo
  echo "gpu_check: $passed passed, $failed failed, $skipped skipped (logs in $work)"
  ((failed == 0))
  exit $?
}

IFS=, read -r -a gpus <<<"$ids"
first=${gpus[0]}
n=${#gpus[@]}
command -v nvidia-smi >/dev/null 2>&1 || { fail "nvidia-smi not found: this script needs NVIDIA GPUs"; finish; }
declare -A uuid_of=()  # physical index -> GPU UUID, in nvidia-smi's (PCI bus) numbering
while IFS=', ' read -r index uuid; do
  [[ -n $index ]] && uuid_of[$index]=$uuid
done < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader)
for id in "${gpus[@]}"; do
  [[ -n ${uuid_of[$id]:-} ]] || { fail "GPU $id is not among the ${#uuid_of[@]} GPU(s) nvidia-smi lists"; finish; }
done
if ! CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$first "$PYTHON" -c \
  'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  fail "PyTorch sees no CUDA GPU with CUDA_VISIBLE_DEVICES=$first: install a CUDA build of torch"
  finish
fi
bf16=$(CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$first "$PYTHON" -c \
  'import torch; print(int(torch.cuda.get_device_capability(0) >= (8, 0)))')
mkdir -p "$work"
echo "gpu_check: GPUs ${ids} ($(nvidia-smi --query-gpu=name --format=csv,noheader -i "$first")), bf16 tensor cores: $bf16"

# Every run shares one synthetic dataset and cache; each run is short.
common=(--synthetic-dir "$work/synthetic" --cache-dir "$work/cache" --samples-per-epoch 16)

descendants() {  # every process below pid $1
  ps -eo pid=,ppid= | awk -v root="$1" '
    { parent[$1] = $2 }
    END { for (p in parent) { q = p; while (q in parent && q != root && q > 1) q = parent[q]; if (q == root) print p } }'
}

watched() {  # watched LOG CMD...: run CMD, sampling which GPUs its processes hold memory on into LOG.gpu
  local log=$1
  shift
  : >"$log.gpu"
  "$@" >"$log" 2>&1 &
  local root=$!
  while kill -0 "$root" 2>/dev/null; do
    local ours
    ours=" $(descendants "$root" | tr '\n' ' ') $root "
    nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      while IFS=', ' read -r pid uuid mib; do
        [[ $ours == *" $pid "* ]] && echo "$pid $uuid $mib" >>"$log.gpu"
      done
    sleep 0.5
  done
  wait "$root"
}

check_memory() {  # check_memory NAME OUT IDS: each rank of the run in OUT held memory only on its own card
  local name=$1 out=$2
  IFS=, read -r -a mine <<<"$3"
  declare -A rank_of=()
  local rank pid uuid mib
  while read -r rank pid; do rank_of[$pid]=$rank; done < <(
    sed -n 's/.*=== rank \([0-9]*\) pid \([0-9]*\) .*/\1 \2/p' "$out"/logs/rank*.log 2>/dev/null
  )
  [[ -s $out/run.log.gpu ]] || {
    skip "$name: nvidia-smi listed no process of this job (a container's PID namespace?): memory placement unchecked"
    return
  }
  local bad=0 seen=""
  while read -r pid uuid mib; do
    rank=${rank_of[$pid]:-}
    if [[ -z $rank ]]; then
      fail "$name: pid $pid, not a rank (a DataLoader worker or the launcher), holds $mib MiB on $uuid"
      bad=1
    elif [[ $uuid != "${uuid_of[${mine[$rank]}]}" ]]; then
      fail "$name: rank $rank (pid $pid) holds $mib MiB on $uuid, not only on its own GPU ${mine[$rank]}"
      bad=1
    else
      [[ $seen == *"rank $rank "* ]] || seen+="rank $rank -> GPU ${mine[$rank]} ($mib MiB) "
    fi
  done < <(sort -u "$out/run.log.gpu")
  ((bad)) || pass "$name: every process held memory only on its own card: $seen"
}

train() {  # train NAME IDS OUT [options]: launch.sh, watched; returns its exit code
  local name=$1 which=$2 out=$3
  shift 3
  mkdir -p "$out"
  watched "$out/run.log" bash launch.sh "$which" --out-dir "$out" "${common[@]}" "$@"
  local rc=$?
  cat "$out/run.log" >>"$out/all.log"
  cp "$out/run.log.gpu" "$out/run.log.gpu.$(date +%s%N)" 2>/dev/null
  if ((rc != 0)); then
    fail "$name: exit code $rc; last lines of $out/run.log:"
    tail -n 15 "$out/run.log" | sed 's/^/      /'
  fi
  return $rc
}

# 1. One rank on the first GPU: no process group, no DDP, memory only on that card.
out=$work/one
rm -rf "$out"
if train "1 rank on GPU $first" "$first" "$out" --epochs 1; then
  grep -q "running alone" "$out/run.log" && pass "1 rank: runs alone (no process group, no DDP)" ||
    fail "1 rank: the log does not say it runs alone"
  check_memory "1 rank" "$out" "$first"
fi

# 2. Every GPU given, one rank each.
out=$work/many
rm -rf "$out"
if ((n < 2)); then
  skip "$n rank(s): give two or more GPU ids to check several ranks (e.g. bash tests/gpu_check.sh 0,1)"
elif train "$n ranks on GPUs $ids" "$ids" "$out" --epochs 1; then
  grep -q "world size $n, " "$out/run.log" && pass "$n ranks: world size $n" || fail "$n ranks: wrong world size"
  check_memory "$n ranks" "$out" "$ids"
fi

# 3. Resuming across precisions: a checkpoint from one precision continues in the other.
epoch_ok() { grep -q "epoch $2/$2: loss [0-9]" "$1" && ! grep -qi "loss nan" "$1"; }
if ((bf16)); then
  out=$work/fp16_then_bf16
  rm -rf "$out"
  if train "fp16" "$ids" "$out" --epochs 1 --amp fp16 && train "bf16 resumed" "$ids" "$out" --epochs 2 --amp bf16; then
    grep -q "resumed from" "$out/run.log" && epoch_ok "$out/run.log" 2 &&
      pass "resume: an fp16 checkpoint continues in bf16" || fail "resume fp16 -> bf16: see $out/run.log"
  fi
  out=$work/bf16_then_fp16
  rm -rf "$out"
  if train "bf16" "$ids" "$out" --epochs 1 --amp bf16 && train "fp16 resumed" "$ids" "$out" --epochs 2 --amp fp16; then
    grep -q "holds no GradScaler state" "$out/run.log" && epoch_ok "$out/run.log" 2 &&
      pass "resume: a bf16 checkpoint (no GradScaler state) continues in fp16" ||
      fail "resume bf16 -> fp16: see $out/run.log"
  fi
else
  out=$work/bf16_refused
  rm -rf "$out"
  bash launch.sh "$ids" --out-dir "$out" "${common[@]}" --epochs 1 --amp bf16 >"$out.log" 2>&1
  rc=$?
  # the refusal comes from the ranks (the pre-flight never asks the GPU), and torchrun exits 1, not 2, when they fail
  ((rc != 0)) && grep -q "has no bf16 tensor cores" "$out.log" &&
    pass "--amp bf16 refused on a GPU without bf16 tensor cores" || fail "--amp bf16 not refused (exit $rc): $out.log"
  out=$work/fp16
  rm -rf "$out"
  if train "fp16" "$ids" "$out" --epochs 1 --amp fp16 && train "fp16 resumed" "$ids" "$out" --epochs 2 --amp fp16; then
    epoch_ok "$out/run.log" 2 && pass "resume: fp16 continues" || fail "resume fp16: see $out/run.log"
  fi
  skip "bf16 resumes: no bf16 tensor cores on GPU $first"
fi

# AdamW across kernels and layouts: under fp16 it steps with the foreach kernels (step counts on the CPU),
# in fp32 with the fused ones, which need the step counts on the GPU and buffers with the weights' strides.
out=$work/adamw_kernels
rm -rf "$out"
if train "adamw fp16" "$ids" "$out" --epochs 1 --amp fp16 --optimizer adamw --memory-format channels_last &&
  train "adamw fp32 resumed" "$ids" "$out" --epochs 2 --amp off --optimizer adamw --memory-format contiguous; then
  grep -q "resumed from" "$out/run.log" && epoch_ok "$out/run.log" 2 &&
    pass "resume: AdamW from fp16 (foreach, channels_last) continues fused in fp32, contiguous" ||
    fail "resume AdamW fp16 -> fp32: see $out/run.log"
fi

# 4. evaluate.py --gpu FIRST: masked to that card (cuda:0 inside), reproduces the training's validation.
run=$work/one
if [[ -f $run/checkpoints/best.pt ]]; then
  ev=$run/eval
  rm -rf "$ev"
  mkdir -p "$ev"
  watched "$ev/run.log" "$PYTHON" evaluate.py --checkpoint "$run/checkpoints/best.pt" --split val --gpu "$first" \
    --out-dir "$ev"
  rc=$?
  if ((rc != 0)); then
    fail "evaluate.py --gpu $first: exit code $rc (see $ev/run.log)"
  else
    verdict=$("$PYTHON" - "$run/checkpoints/best.pt" "$ev/summary.json" <<'EOF'
import json, sys, torch
best = torch.load(sys.argv[1], map_location="cpu", weights_only=True)["best_metric"]
summary = json.load(open(sys.argv[2]))
device, dice = summary["inference"]["device"], summary["mean_dice"]
ok = device == "cuda:0" and abs(dice - best) < 1e-3
print(("ok " if ok else "bad ") + f"device {device}, mean Dice {dice:.4f}, training's validation {best:.4f}")
EOF
    )
    [[ $verdict == ok* ]] && pass "evaluate.py --gpu $first: ${verdict#ok }" || fail "evaluate.py --gpu $first: ${verdict#bad }"
    bad=0
    if [[ -s $ev/run.log.gpu ]]; then
      while read -r pid uuid mib; do
        [[ $uuid == "${uuid_of[$first]}" ]] || { fail "evaluate.py (pid $pid) holds $mib MiB on $uuid"; bad=1; }
      done < <(sort -u "$ev/run.log.gpu")
      ((bad)) || pass "evaluate.py --gpu $first held memory only on GPU $first"
    else
      skip "evaluate.py: nvidia-smi listed no process of it: memory placement unchecked"
    fi
  fi
else
  skip "evaluate.py --gpu: the 1-rank run left no best.pt"
fi
finish
