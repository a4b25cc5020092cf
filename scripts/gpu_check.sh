#!/usr/bin/env bash
# GPU checks for the engines (launcher/backends/gpu_check.py): one prepared script for a short GPU loan.
# The box needs torch, transformers, peft and accelerate; no trl, datasets, bitsandbytes or network.
#   scripts/gpu_check.sh            on the GPU box (fails without CUDA)
#   scripts/gpu_check.sh --dry-run  the same steps on CPU with CPU expectations (run it before spending GPU time)
# Results (JSON) go to $OUT (or a temporary folder); exit 0 only when every check gave the expected outcome.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[ "${1:-}" = "--dry-run" ] && DEVICE=cpu
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
RESULTS=${OUT:-$(mktemp -d)}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU here: use --dry-run')"
fi
"$PY" -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"

step() { echo "== $1"; }
step "tiny model (built locally, no download)"
"$PY" scripts/make_tiny_model.py "$RESULTS/tiny-model" >/dev/null

step "worker: load_model_and_tokenizer + one LoRA step on $DEVICE"
"$PY" -m launcher.backends.gpu_check worker --model "$RESULTS/tiny-model" --device "$DEVICE" --out "$RESULTS/worker.json"

step "FSDP2: the generated accelerate config, the worker's model prepared by accelerate on $DEVICE"
"$PY" -m launcher.backends.gpu_check fsdp-config --model "$RESULTS/tiny-model" --device "$DEVICE" \
  --out "$RESULTS/accelerate_fsdp.yaml"
OMP_NUM_THREADS=1 "$PY" -m accelerate.commands.launch --config_file "$RESULTS/accelerate_fsdp.yaml" \
  -m launcher.backends.gpu_check fsdp-prepare --model "$RESULTS/tiny-model" --device "$DEVICE" \
  --out "$RESULTS/fsdp.json"

step "sizing against the box: predicted vs measured peak memory and tokens/s (scripts/gpu_bench.py: plan + smoke)"
if "$PY" -c "import trl, datasets" 2>/dev/null; then
  if [ "$DEVICE" = cpu ]; then
    "$PY" scripts/gpu_bench.py --dry-run --methods lora --json "$RESULTS/gpu_bench.json"
  else  # rows that fail (bitsandbytes missing for qlora/full-8bit, say) are reported with their reason
    timeout 300 "$PY" scripts/gpu_bench.py --json "$RESULTS/gpu_bench.json" || echo "gpu_bench ended with exit $?"
  fi
else
  echo "not run: trl and datasets are not installed here (the smoke test needs them; carry their wheels)"
fi
echo "all engine checks passed on $DEVICE; results in $RESULTS"
