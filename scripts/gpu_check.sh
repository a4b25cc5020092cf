#!/usr/bin/env bash
# GPU checks for one short GPU loan (gpu_check/): device and dtype, per-rank placement, the
# memory cap, peak memory, out-of-memory classification, the LM head's loss (the model's own against TRL's fused head),
# predicted vs measured memory and tokens/s for LoRA and
# full fine-tuning at an 8B shape (random weights, no download), padded vs padding-free, FSDP2 with the final save;
# the launch's environment (one GPU for a single-process Trainer, each rank's CPU threads, two FSDP launches at once).
#   OUT=/some/dir scripts/gpu_check.sh            on the GPU box (torch + transformers; peft, accelerate if there)
#   scripts/gpu_check.sh --dry-run                the same steps on CPU with CPU expectations and a tiny shape (CI)
# Every step is its own process with its own timeout; a step that fails, crashes or hangs is recorded with the
# reason and the next one runs. Each step writes $OUT/<step>.json as soon as it has results, and
# $OUT/summary.json is rewritten after every step. The whole run stays within GPU_CHECK_BUDGET_S (default 525 s
# on a GPU, 1800 s dry; counted from the script's start); one line per step goes to stdout, each step's full output
# to $OUT/<step>.log. First the preflight measures the box, skips the steps its card cannot hold or whose imports fail,
# and prints each step's estimate; a step's time is what is left less the later steps' estimates, never less than its
# own estimate. At the end, what the call decides (each step's "decides": issue 55's "Done when").
# The product steps (issues 43, 55) run ftrun itself on the tiny model: GPU_CHECK_STEPS=product selects what one
# call of 540 s runs on a lent GPU (docs/BENCHMARKS.md, "The next GPU loan").
# Settings: GPU_CHECK_SHAPE (a launcher/plan/models.py catalog name, default qwen3-8b), GPU_CHECK_STEPS (a comma
# list of steps and presets to run a subset), GPU_CHECK_TIMEOUTS (per-step timeouts, "bench-full=200,fsdp=60";
# the defaults are runner.py's TIMEOUTS),
# GPU_CHECK_WORK (where the tiny model, the product runs and the FSDP save are built, default a temporary folder: not
# in $OUT, which comes back from the box).
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
export GPU_CHECK_MODE=$MODE GPU_CHECK_STARTED=$(date +%s)  # the budget counts from here: the wheels' install too
# The wheels a lent box lacks (trl, datasets, pydantic, bitsandbytes, sacrebleu, ...: scripts/device_wheels.sh,
# carried as .cache/device-wheels) are installed into a folder of their own and put on the path, on a GPU only: here
# the virtualenv has them, and the wheels are for the box's Python 3.12.
WHEELS=${FTRUN_DEVICE_WHEELS:-.cache/device-wheels}
if [ "$MODE" = gpu ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=${GPU_CHECK_SITE:-/tmp/ftrun-site}
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  then
    PYTHONPATH="$PYTHONPATH:$SITE"
    echo "gpu_check: installed $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE in $(( $(date +%s) - GPU_CHECK_STARTED )) s"
  else
    echo "gpu_check: installing the carried wheels from $WHEELS failed; steps that need them say skipped" >&2
  fi
fi
if [ "$MODE" = dry-run ]; then
  # the carried set, where one is here, installed as the box will install it (into a temporary folder)
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    bash scripts/device_wheels.sh --check "$WHEELS" || echo "gpu_check: the call's wheels in $WHEELS would not install" >&2
  else
    echo "gpu_check: no wheels in $WHEELS to try (scripts/device_wheels.sh makes the call's set)"
  fi
  export CUDA_VISIBLE_DEVICES=""  # CPU expectations even where a GPU is present
  export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-1800}  # the product steps train through the CLI: minutes each
else
  # one 540-s call (docs/BENCHMARKS.md): 15 s left for the last step's kill grace (timeout -k 10) and the packing
  export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-525}
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); on a CPU box use --dry-run" >&2
    exit 2
  fi
fi
DEADLINE=$((GPU_CHECK_STARTED + GPU_CHECK_BUDGET_S))
"$PY" -m gpu_check start --out "$OUT" || exit 2
echo "gpu_check $MODE: results in $OUT, budget ${GPU_CHECK_BUDGET_S} s"
# The preflight (gpu_check/preflight.py): what this box has, the steps it cannot hold (recorded as
# skipped before they start) and each step's estimate, printed; then the steps to run, one "NAME LIMIT FLOOR" a line
# in the order they run (GPU_CHECK_STEPS may name presets: runner.py PRESETS).
PLAN=$("$PY" -m gpu_check preflight --out "$OUT" ${DRY[@]+"${DRY[@]}"}) || exit 2
mapfile -t ROWS <<<"$PLAN"
[ -z "$PLAN" ] && ROWS=()

# step NAME LIMIT FLOOR RESERVE: run it under timeout(1) (which kills its whole process group, children included)
# for at most LIMIT seconds, and on a GPU no more than what is left of the budget less RESERVE (the later steps'
# estimates), though never less than its own estimate FLOOR and a half (runner.py step_limit); then record and print
# its result. The dry run (CI, a budget of its own) gives each step its timeout, as long as the budget lasts.
FAILED=0
step() {
  local name=$1 limit=$2 floor=$3 reserve=$4
  local pair spec=${GPU_CHECK_TIMEOUTS:-}
  for pair in ${spec//,/ }; do [ "${pair%%=*}" = "$name" ] && limit=${pair#*=}; done
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    "$PY" -m gpu_check finish "$name" --out "$OUT" --not-run "out of time (budget ${GPU_CHECK_BUDGET_S} s)"
    FAILED=$((FAILED + 1))  # not run is not passed
    return 0
  fi
  [ "$MODE" = dry-run ] && [ "${GPU_CHECK_RESERVE:-0}" != 1 ] && reserve=0
  limit=$("$PY" -m gpu_check limit "$name" "$limit" "$floor" "$left" "$reserve") || limit=$left
  local rc=0
  GPU_CHECK_STEP_BUDGET=$limit timeout -k 10 "$limit" "$PY" -m gpu_check step "$name" \
    --out "$OUT" ${DRY[@]+"${DRY[@]}"} >"$OUT/$name.log" 2>&1 || rc=$?
  "$PY" -m gpu_check finish "$name" --out "$OUT" --rc "$rc" --limit "$limit" || rc=1
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
  return 0
}

for i in "${!ROWS[@]}"; do
  read -r name limit floor <<<"${ROWS[$i]}"
  reserve=0
  for later in "${ROWS[@]:$((i + 1))}"; do reserve=$((reserve + ${later##* })); done
  step "$name" "$limit" "$floor" "$reserve"
done
"$PY" -m gpu_check report --out "$OUT"
echo "gpu_check $MODE: $FAILED step(s) failed in $(( $(date +%s) - GPU_CHECK_STARTED )) s; summary: $OUT/summary.json"
# A call brings back at most 8 files: every step's JSON and log go into one tarball beside summary.json. On a GPU
# the packed files are removed, so that the two are what comes back; a call cut short leaves them unpacked.
packed=$(cd "$OUT" && ls | grep -v -e '^summary\.json$' -e '^gpu_check\.tar\.gz$' || true)
if [ -n "$packed" ]; then
  (cd "$OUT" && tar czf gpu_check.tar.gz $packed) && echo "gpu_check: results packed into $OUT/gpu_check.tar.gz"
  [ "$MODE" = gpu ] && [ "${GPU_CHECK_KEEP_FILES:-0}" != 1 ] && (cd "$OUT" && rm -rf $packed)
fi
[ "$FAILED" -eq 0 ]
