#!/usr/bin/env bash
# The demo: install, build the tiny model, run `ftrun recipes/tiny-cpu.yaml` (CPU, about a minute), show the result;
# then the vision step, `ftrun recipes/tiny-cpu-vision.yaml` on a tiny vision-language model, ending with its task score.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
.venv/bin/python scripts/make_tiny_model.py .cache/tiny-model
RUN=runs/tiny-cpu
# --fresh: a previous demo run is kept, renamed runs/tiny-cpu.<time>
.venv/bin/ftrun recipes/tiny-cpu.yaml --fresh
echo
echo "== following the log until the run ends (Ctrl-C only stops the viewing) =="
.venv/bin/ftrun logs -f "$RUN" | grep --line-buffered -E "step|checkpoint|final|supervisor|export|samples|reference:|before:|after:" || true
echo
.venv/bin/ftrun status "$RUN"
.venv/bin/python - "$RUN" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
train = [r for r in rows if "loss" in r]
evals = [r for r in rows if "eval_loss" in r]  # eval passes have rows of their own
first, last = train[0], train[-1]
print(f"loss: step {first['step']} {first['loss']:.3f} -> step {last['step']} {last['loss']:.3f}")
print(f"eval loss (held out): step {evals[0]['step']} {evals[0]['eval_loss']:.3f} -> "
      f"step {evals[-1]['step']} {evals[-1]['eval_loss']:.3f}")
print(f"before/after samples: {run / 'final' / 'samples.md'}")
adapter = run / "final" / "adapter"
# its weights' size, as `ftrun status` and the export say it (the folder also holds the tokenizer's files)
from launcher.deliver.messages import human_size
print(f"adapter: {adapter} ({human_size((adapter / 'adapter_model.safetensors').stat().st_size)} of weights)")
# The export's check of the served prompt (final/export.json): the runtimes whose rendering of the held-out prompts
# was compared token for token with the training's, and the ones this export has no output for.
from launcher.deliver.messages import served_line
exported = run / "final" / "export.json"
report = json.loads(exported.read_text()) if exported.is_file() else {}
print(served_line(report))
sys.exit(0 if last["loss"] < first["loss"] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
         and (run / "final" / "samples.md").is_file() and report.get("served_prompt", {}).get("ok") else 1)
PY
echo
echo "== the fourth step: a vision-language model on the same rails (ftrun recipes/tiny-cpu-vision.yaml) =="
# a tiny random Qwen2.5-VL learns the colour of the square in small synthetic images; plan, smoke test, detached run,
# checkpoints and the task score with the images in the prompt, as for text
.venv/bin/python scripts/make_tiny_vlm.py .cache/tiny-vlm
VISION=runs/tiny-cpu-vision
.venv/bin/ftrun recipes/tiny-cpu-vision.yaml --fresh
.venv/bin/ftrun logs -f "$VISION" | grep --line-buffered -E "step [0-9]+/|final|supervisor|task eval" || true
.venv/bin/python - "$VISION" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
result = json.loads((run / "task_eval.json").read_text())
scores, task = result["scores"], json.loads((run / "task.json").read_text())
before, after = scores.get("base_zero_shot"), scores.get("fine_tuned")
print(f"task score ({task['metric']} on {len(task['prompts'])} held-out images): "
      f"before {before:.0%} (base model) -> after {after:.0%} (fine-tuned)")
adapter = run / "final" / "adapter"
print(f"adapter with the processor files: {adapter} ({', '.join(sorted(p.name for p in adapter.glob('pre*.json')))})")
sys.exit(0 if after is not None and before is not None and after > before else 1)
PY
echo
echo "ftrun is installed in .venv: \`source .venv/bin/activate\` puts it on your PATH (or call .venv/bin/ftrun);"
echo "then e.g. \`ftrun status runs/tiny-cpu\` or \`ftrun plan recipes/qwen3-8b-qlora.yaml\`;"
echo "the second step, DPO on preference pairs from this run's adapter: \`ftrun recipes/tiny-cpu-dpo.yaml\`;"
echo "the third, GRPO from it, rewarded by the task's own metric (chrF against each prompt's reference), ending with"
echo "the task score before and after: \`ftrun recipes/tiny-cpu-grpo.yaml\`; the fourth, a vision-language model, ran above."
