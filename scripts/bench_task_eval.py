#!/usr/bin/env python3
"""What the task evaluation costs on CPU with the demo's model: 200 held-out examples of the demo's data answered
greedily, in batches as ftrun answers them (launcher/worker/task_eval.py, 8 prompts a generate call on a CPU) and
one at a time, side by side in one run; then the whole evaluation (the base model zero-shot and with 3 examples,
the fine-tuned model, the merged folder) priced from the measured speed.

    .venv/bin/python scripts/bench_task_eval.py [--examples 200 | --quick] [--threads N]

The model is the demo's (scripts/make_tiny_model.py, built into .cache/tiny-model when missing), random weights:
its answers run to the token limit more often than a trained model's, so the figures bound the cost from above.
docs/BENCHMARKS.md, "The task evaluation", holds a run of it and the GPU expectation.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODEL = REPO / ".cache" / "tiny-model"
DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="40 examples (a check that it runs, about a minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.quick:
        args.examples = 40
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(MODEL)], check=True)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.data.dataset import load_data
    from launcher.data.task_examples import build_task
    from launcher.worker import task_eval

    if args.threads:
        torch.set_num_threads(args.threads)
    examples = load_data(str(DATA), 42).examples
    order = list(range(len(examples)))
    random.Random(42).shuffle(order)
    held, train = order[: args.examples], order[args.examples :]
    settings = SimpleNamespace(examples=args.examples, metric="auto", shots=3, baseline="run", max_new_tokens=None)
    task = build_task(examples, held, train, settings, 42)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    print(
        f"{len(task['prompts'])} examples, metric {task['metric']}, up to {task['max_new_tokens']} new tokens, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {torch.get_num_threads()} threads"
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch in (("batched", task_eval.BATCH["cpu"]), ("one at a time", 1)):
            t0 = time.monotonic()
            r = task_eval.score_model(model, tok, Path(tmp), task, name.replace(" ", "-"), batch_size=batch)
            wall = time.monotonic() - t0
            rows[name] = {"seconds": wall, "new_tokens": r["new_tokens"], "score": r["score"]}
            print(
                f"  {name:<14} batch {batch:>2}: {wall:6.1f} s, {r['new_tokens']:>6,} new tokens, "
                f"{r['new_tokens'] / wall:7.0f} tokens/s, score {r['score']:.3f}"
            )
        few_t0 = time.monotonic()
        task_eval.score_model(model, tok, Path(tmp), task, "few-shot", shots=True)
        few_wall = time.monotonic() - few_t0
    b, o = rows["batched"], rows["one at a time"]
    print(
        f"batched / one at a time: {o['seconds'] / b['seconds']:.2f}x faster, the same score: "
        f"{b['score'] == o['score']}"
    )
    print(
        f"  with {task['shots'] and len(task['shots'])} examples in each prompt (the base model's few-shot score): "
        f"{few_wall:.1f} s, {few_wall / b['seconds']:.2f}x the zero-shot time"
    )
    whole = 2 * b["seconds"] + few_wall + b["seconds"]  # zero-shot, fine-tuned, merged; few-shot as measured
    print(
        f"the whole evaluation (base zero-shot, base with examples, fine-tuned, merged): about {whole:.0f} s on "
        "this CPU"
    )
    print(
        json.dumps(
            {
                "examples": len(task["prompts"]),
                "batched": b,
                "one_at_a_time": o,
                "few_shot_seconds": round(few_wall, 2),
                "whole_seconds": round(whole, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
