"""The generation step: tokens/s of ftrun's own task-evaluation generation (launcher/worker/task_eval.py `answer`:
batched greedy answers) for a batch of the demo's task prompts on the tiny model, with the SDPA backends the worker
leaves enabled and again with cuDNN attention forced on, each in its own process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gpu_check.common import REPO, Context, child_env, last_line, module_cmd, read_json
from gpu_check.product import tiny_model

PROMPTS = {"cuda": 64, "cpu": 16}  # two batches of the task evaluation's size (launcher/plan/sizing.py)
MAX_NEW_TOKENS = 24  # the demo recipe's eval.max_new_tokens
VARIANTS = {"default": {}, "cudnn-on": {"FTRUN_SDPA_BACKENDS": "cudnn,flash,efficient,math"}}
# Issue 55's target: ten times the 74 tokens/s the first H200 loan's task evaluation generated (docs/engines.md).
FIRST_LOAN_TOKENS_PER_SECOND = 74.0
TARGET_FACTOR = 10


def decode_calls(device: str) -> int:
    """Prefill and decode calls the step makes (for its estimate, preflight.py): per variant run, two passes over
    the prompts in batches of the task evaluation's size, each batch a prefill and a call per new token."""
    import math

    from launcher.plan import throughput

    variants = len(VARIANTS) if device == "cuda" else 1
    batches = math.ceil(PROMPTS[device] / throughput.GENERATION_BATCH[device])
    return variants * 2 * batches * (1 + MAX_NEW_TOKENS)


def prompts(count: int) -> list[dict[str, Any]]:
    """The demo data's conversations up to their last assistant turn, as task.json asks them."""
    rows = [
        json.loads(x)["messages"]
        for x in (REPO / "recipes" / "data" / "tiny-chat.jsonl").read_text().splitlines()
        if x.strip()
    ]
    out = []
    for i, messages in enumerate(rows[:count]):
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        out.append({"index": i, "messages": messages[:last]})
    return out


def sdpa_flags() -> dict[str, bool]:
    import torch

    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def generation_child(model_dir: Path, out: Path, force_cudnn: bool) -> int:
    """Load the tiny model as the worker does (loading.select_device, its attention kernel), answer the prompts with
    task_eval.answer twice (the first pass pays every new shape's one-time cost, the second shows the steady rate)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.worker import loading, task_eval

    device, dtype = loading.select_device()
    if force_cudnn and device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)  # whatever the worker's policy chose: the comparison's other side
    attn = loading.attention_implementation(device, dtype) or "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    asked = prompts(PROMPTS[device])
    passes = []
    for n in range(2):
        path = out.with_name(f"{out.stem}.{n}.jsonl")
        t0 = time.perf_counter()
        rows = task_eval.answer(model, tokenizer, asked, MAX_NEW_TOKENS, path, write=False)
        seconds = time.perf_counter() - t0
        tokens = sum(r["new_tokens"] for r in rows)
        passes.append(
            {
                "prompts": len(rows),
                "new_tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_second": round(tokens / seconds, 1),
            }
        )
    out.write_text(
        json.dumps(
            {
                "device": device,
                "dtype": str(dtype),
                "attn_implementation": attn,
                "batch": task_eval.BATCH.get(device),
                "sdpa_enabled": sdpa_flags() if device == "cuda" else None,
                "passes": passes,
            },
            indent=2,
        )
    )
    return 0


def step_generation(ctx: Context) -> dict[str, Any]:
    budget = float(os.environ.get("GPU_CHECK_STEP_BUDGET", "90"))
    model = tiny_model(ctx)
    results: dict[str, Any] = {}
    runs = [name for name in VARIANTS if name != "cudnn-on" or ctx.device == "cuda"]
    for name, env in VARIANTS.items():
        if name not in runs:
            results[name] = {"skipped": "cuDNN attention exists on CUDA only"}
            continue
        path = ctx.out / f"generation.{name}.json"
        args = module_cmd("generation-child", "--model", str(model), "--out", str(path))
        if name == "cudnn-on":
            args.append("--force-cudnn")
        # the step's budget shared by the children that run (on a busy CPU one child's imports alone took 54 s)
        timeout = budget * 0.9 / len(runs)
        proc = subprocess.run(args, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
        got = read_json(path)
        if proc.returncode != 0 or got is None:
            results[name] = {"error": last_line(proc)}
            continue
        path.unlink()
        results[name] = got
    rates = {k: v["passes"][-1]["tokens_per_second"] for k, v in results.items() if "passes" in v}
    ok = "default" in rates
    line = (
        "; ".join(
            f"{k} {v:.0f} tok/s (first pass {results[k]['passes'][0]['tokens_per_second']:.0f})"
            for k, v in rates.items()
        )
        or f"failed: {results.get('default', {}).get('error')}"
    )
    if len(rates) == 2:
        results["default_over_cudnn"] = round(rates["default"] / rates["cudnn-on"], 2)
        line += f"; default/cudnn {results['default_over_cudnn']}x"
    out: dict[str, Any] = {"ok": ok, "variants": results, "line": line}
    if ok and ctx.device == "cuda":
        target = FIRST_LOAN_TOKENS_PER_SECOND * TARGET_FACTOR
        out["decides"] = {
            "generation": {
                "value": rates["default"],
                "target": f">= {target:.0f} tokens/s ({TARGET_FACTOR}x the first loan's "
                f"{FIRST_LOAN_TOKENS_PER_SECOND:.0f})",
                "met": rates["default"] >= target,
                "says": f"generation {rates['default']:.0f} tokens/s (steady pass, the worker's backends) against "
                f"{target:.0f}",
            }
        }
    return out
