#!/usr/bin/env python3
"""The loss's memory: TRL's fused LM head (what ftrun's trl/ddp/fsdp/deepspeed engines compute) against the model's
own loss (the whole logits), measured by the smoke test on the same examples, beside the sizer's prediction for both.

A tiny Qwen3-shaped model with a 150k-token vocabulary and hidden size 64, so that the logits dominate the memory
of a step. Three `ftrun smoke` runs of one recipe, one after the other in fresh processes:
  lean        ftrun as shipped: TRL's fused LM head, computed on the CPU by launcher/worker/cpu_logprob.py
  trl-kernel  the same head with TRL's own kernel (4096 x 32768 tiles folded with torch ops, recomputed in backward),
              to show why the CPU worker replaces it
  plain       the model's own forward with labels (transformers' ForCausalLMLoss): the logits whole, as before TRL 1.x;
              a sitecustomize in the worker's PYTHONPATH makes SFTTrainer.compute_loss return `model(**inputs).loss`
Printed: each run's peak RSS (the smoke test's measurement) and tokens/s; the sizer's prediction of the logits and
loss term for the lean and the plain loss; the measured and predicted differences and ratios.

    .venv/bin/python scripts/bench_lean_loss.py             # about 3 minutes on 2 cores
    .venv/bin/python scripts/bench_lean_loss.py --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

VOCAB = 150_000
MODEL = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "model_vocab": VOCAB}

PLAIN_LOSS = """
# scripts/bench_lean_loss.py: the model's own loss instead of TRL's fused LM head, for the comparison only
import trl.trainer.sft_trainer as _sft

def _plain_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    inputs = dict(inputs)
    inputs["use_cache"] = False
    outputs = model(**inputs)
    return (outputs.loss, outputs) if return_outputs else outputs.loss

_sft.SFTTrainer.compute_loss = _plain_loss
"""

TRL_KERNEL = """
# scripts/bench_lean_loss.py: TRL's own fused-head kernel on the CPU, for the comparison only
import launcher.worker.cpu_logprob as _cpu
_cpu.install = lambda device: False
"""


def model_dir() -> Path:
    out = bc.CACHE / "model-vocab150k"
    bc._script("make_tiny_model").build_tiny_model(out, data=bc.bench_data(2000), **MODEL)
    return out


def smoke(work: Path, name: str, model: Path, data: Path, tokens: int, patch: str | None) -> dict:
    r = bc.write_recipe(
        work / f"{name}.yaml",
        model=str(model),
        data=str(data),
        method="lora",
        max_length=tokens,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=2e-4,
        logging_steps=1,
        packing=True,
        epochs=1,
        output_dir=str(bc.fresh_dir(work / name)),
        smoke={"fraction": 0.01, "min_steps": 8},
    )
    env = dict(bc.ENV)
    if patch:
        site = work / f"site-{name}"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(patch))
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(bc.REPO), env.get("PYTHONPATH", "")])
    import subprocess
    import time

    t0 = time.monotonic()
    with (work / f"{name}.log").open("w") as log:
        rc = subprocess.run(
            bc.FTRUN + ["smoke", str(r)],
            cwd=bc.REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        ).returncode
    if rc != 0:
        raise SystemExit(f"ftrun smoke ({name}) failed with exit {rc}; see {work / f'{name}.log'}")
    result = json.loads((work / name / "smoke.json").read_text())
    result["wall_s"] = time.monotonic() - t0
    return result


BASELINE = """
import resource, torch, transformers, peft, datasets, trl
from trl import SFTTrainer
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30)
"""


def import_baseline() -> float:
    """Peak RSS of a process that only imports what the worker imports (GB = 2**30 bytes, as the smoke test counts)."""
    import subprocess

    out = subprocess.run([bc.PYTHON, "-c", BASELINE], env=bc.ENV, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def predicted(model: Path, tokens: int) -> dict[str, float]:
    from launcher.plan import sizing
    from launcher.plan.models import load_architecture

    arch = load_architecture(str(model))
    out = {}
    for name, loss in (("lean", ""), ("plain", sizing.LOSS_MATERIALIZED)):
        w = sizing.Workload("lora", tokens, 1, True, 8, "all-linear", "trl", 1, "cpu", loss=loss)
        est = sizing.memory(arch, w)
        out[name] = est.breakdown_gb["logits and loss"]
        out[f"{name}_total"] = est.per_gpu_gb
        out[f"{name}_above_runtime"] = est.per_gpu_gb - est.breakdown_gb["runtime"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (packed), default 2048")
    ap.add_argument("--json", type=Path, help="write the raw numbers here as well")
    args = ap.parse_args()
    print(bc.machine(), flush=True)
    work = bc.CACHE / "lean-loss"
    model = model_dir()
    data = bc.bench_data(2000)
    runs = {
        name: smoke(work, name, model, data, args.tokens, patch)
        for name, patch in (("lean", None), ("trl-kernel", TRL_KERNEL), ("plain", PLAIN_LOSS))
    }
    pred = predicted(model, args.tokens)
    base = import_baseline()
    print(
        f"\nmodel: vocabulary {VOCAB:,}, hidden {MODEL['hidden']}, {args.tokens:,} tokens per micro-batch, "
        f"same examples in each run"
    )
    for name, r in runs.items():
        print(
            f"  {name:10s} peak RSS {r['peak_memory_gb']:.3f} GB, {r['tokens_per_second']:,.0f} tokens/s "
            f"({r['steps']} steps)"
        )
    lean, plain, tile = runs["lean"], runs["plain"], runs["trl-kernel"]
    saved = plain["peak_memory_gb"] - lean["peak_memory_gb"]
    print(
        f"\nlogits memory removed (plain - lean peak): measured {saved:.3f} GB, predicted "
        f"{pred['plain'] - pred['lean']:.3f} GB (sizer: plain {pred['plain']:.3f} GB, lean {pred['lean']:.3f} GB "
        "beyond the recomputed layer)"
    )
    for name, r in (("lean", lean), ("plain", plain)):
        above = r["peak_memory_gb"] - base
        print(
            f"{name}: peak {r['peak_memory_gb']:.3f} GB measured, {pred[f'{name}_total']:.3f} GB planned; above the "
            f"imports ({base:.3f} GB; the plan's 1 GB runtime term) {above:.3f} GB measured, "
            f"{pred[f'{name}_above_runtime']:.3f} GB planned ({pred[f'{name}_above_runtime'] / above - 1:+.0%})"
        )
    print(
        f"peak ratio lean / plain: measured {lean['peak_memory_gb'] / plain['peak_memory_gb']:.2f}, predicted "
        f"{pred['lean_total'] / pred['plain_total']:.2f}"
    )
    print(f"peak ratio TRL's kernel / ftrun's on the CPU: {tile['peak_memory_gb'] / lean['peak_memory_gb']:.2f}")
    print(
        f"throughput ratio lean / plain: {lean['tokens_per_second'] / plain['tokens_per_second']:.2f} "
        f"(TRL's kernel / plain: {tile['tokens_per_second'] / plain['tokens_per_second']:.2f})"
    )
    raw = json.dumps({"runs": runs, "predicted": pred, "tokens": args.tokens, "import_baseline_gb": base}, indent=1)
    for path in [work / "result.json"] + ([args.json] if args.json else []):
        path.write_text(raw)


if __name__ == "__main__":
    main()
