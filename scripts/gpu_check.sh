#!/usr/bin/env bash
# GPU checks for one short GPU loan (launcher/worker/gpu_check/): device and dtype, per-rank placement, the
# memory cap, peak memory, out-of-memory classification, the LM head's loss (the model's own against TRL's fused head),
# predicted vs measured memory and tokens/s for LoRA and
# full fine-tuning at an 8B shape (random weights, no download), padded vs padding-free, FSDP2 with the final save;
# the launch's environment (one GPU for a single-process Trainer, each rank's CPU threads, two FSDP launches at once).
#   OUT=/some/dir scripts/gpu_check.sh            on the GPU box (torch + transformers; peft, accelerate if there)
#   scripts/gpu_check.sh --dry-run                the same steps on CPU with CPU expectations and a tiny shape (CI)
# Every step is its own process with its own timeout; a step that fails, crashes or hangs is recorded with the
# reason and the next one runs. Each step writes $OUT/<step>.json as soon as it has results, and
# $OUT/summary.json is rewritten after every step. The whole run stays within GPU_CHECK_BUDGET_S (default 450 s
# on a GPU, 600 s dry); one line per step goes to stdout, each step's full output to $OUT/<step>.log.
# Settings: GPU_CHECK_SHAPE (a launcher/plan/models.py catalog name, default qwen3-8b), GPU_CHECK_STEPS (a comma list
# to run a subset), GPU_CHECK_TIMEOUTS (per-step timeouts, "bench-full=200,fsdp=60"), GPU_CHECK_WORK (where the
# tiny model and the FSDP save are built, default a temporary folder: not in $OUT, which comes back from the box).
# Exit 0 only when every step passed or was skipped for a missing package; a step left out for lack of time fails it.
set -uo pipefail  # no -e: a failed step is a result, not the end of the run
cd "$(dirname "$0")/.."
MODE=gpu
DRY=()
[ "${1:-}" = "--dry-run" ] && { MODE=dry-run; DRY=(--dry-run); }
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-$(mktemp -d)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# Pure-Python wheels carried to a box that lacks them import from the wheel file itself (the loss-head step reads
# trl's kernel this way): pip download --no-deps trl==1.16.0 -d .cache/device-wheels, carried with the call.
for wheel in "${FTRUN_DEVICE_WHEELS:-.cache/device-wheels}"/*.whl; do
  [ -f "$wheel" ] && PYTHONPATH="$PYTHONPATH:$PWD/$wheel"
done
export GPU_CHECK_MODE=$MODE GPU_CHECK_STARTED=$(date +%s)
if [ "$MODE" = dry-run ]; then
  export CUDA_VISIBLE_DEVICES=""  # CPU expectations even where a GPU is present
  export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-600}
else
  export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); on a CPU box use --dry-run" >&2
    exit 2
  fi
fi
DEADLINE=$((GPU_CHECK_STARTED + GPU_CHECK_BUDGET_S))
"$PY" -m launcher.worker.gpu_check start --out "$OUT" || exit 2
echo "gpu_check $MODE: results in $OUT, budget ${GPU_CHECK_BUDGET_S} s"

# step NAME TIMEOUT_GPU TIMEOUT_DRY: run it under timeout(1) (which kills its whole process group, children
# included) for at most what is left of the budget, then record and print its result.
FAILED=0
step() {
  local name=$1 limit=$2
  [ "$MODE" = dry-run ] && limit=$3
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then return; fi
  local pair spec=${GPU_CHECK_TIMEOUTS:-}
  for pair in ${spec//,/ }; do [ "${pair%%=*}" = "$name" ] && limit=${pair#*=}; done
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    "$PY" -m launcher.worker.gpu_check finish "$name" --out "$OUT" --not-run "out of time (budget ${GPU_CHECK_BUDGET_S} s)"
    FAILED=$((FAILED + 1))  # not run is not passed
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  local rc=0
  GPU_CHECK_STEP_BUDGET=$limit timeout -k 10 "$limit" "$PY" -m launcher.worker.gpu_check step "$name" \
    --out "$OUT" ${DRY[@]+"${DRY[@]}"} >"$OUT/$name.log" 2>&1 || rc=$?
  "$PY" -m launcher.worker.gpu_check finish "$name" --out "$OUT" --rc "$rc" --limit "$limit" || rc=1
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
  return 0
}

#    name          GPU  dry-run timeouts (s)
step tiny-model     60   90
step device         45   60
step launch-env     90  150
step placement      90  120
step memory-cap     45   60
step peak-memory    45   60
step oom            60   60
step loss-head      60   90
step bench-lora    120  120
step bench-full    150  120
step bench-padding 120  120
step fsdp          120  150
step smoke-bench   300  300
echo "gpu_check $MODE: $FAILED step(s) failed in $(( $(date +%s) - GPU_CHECK_STARTED )) s; summary: $OUT/summary.json"
[ "$FAILED" -eq 0 ]
