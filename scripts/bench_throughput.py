#!/usr/bin/env python3
"""Training tokens/s: a plain TRL script against `ftrun RECIPE --foreground` on the same model, data and settings.

Variants, run in alternating order (round r starts at variant r mod n), each a fresh process:
  plain      the article's script: SFTTrainer + PEFT LoRA, written out below as a user would write it. It sets
             bf16=True, as the article does: on a CPU that makes TRL train under bf16 autocast.
  plain-fp32 the same script with bf16=False: fp32, the precision ftrun trains in on a CPU (ftrun picks the
             precision from the device; on a GPU both sides train in bf16)
  ftrun      ftrun on a recipe with the same settings (its own defaults that change the batches turned off)
  defaults   ftrun with its defaults (whatever launcher/recipe.py and train.py turn on by default)
Reported: real (non-padding) training tokens/s of each, medians over rounds, and the ratios to plain and to
plain-fp32 (the like-for-like one for `ftrun` on a CPU).
Tokens/s is measured the same way on every side: the trainer's non-padding token count and the wall
clock at each logged step, from the first logged step (warm-up excluded) to the last.

    .venv/bin/python scripts/bench_throughput.py            # model m (~10M), 800 examples, 3 rounds (long on 2 busy
    cores)
    .venv/bin/python scripts/bench_throughput.py --quick    # model s (~1.8M), 200 examples, 1 round (~2-3 min quiet)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

# The hyperparameters both sides train with (the article's LoRA example, scaled to a CPU).
SETTINGS = dict(
    max_length=512,
    micro_batch_size=8,
    gradient_accumulation_steps=2,
    epochs=1,
    learning_rate=2e-4,
    lora_r=16,
    lora_alpha=16,
    logging_steps=2,
    seed=42,
)


def plain_trl(model_dir: str, data: str, out_dir: str, metrics_path: str, s: dict) -> None:
    """The plain user's script. Only `Timing` and the token count are ours: they measure, they change nothing."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = load_dataset("json", data_files=data, split="train")
    peft_config = LoraConfig(
        r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    args = SFTConfig(
        output_dir=out_dir,
        max_length=s["max_length"],
        per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=s["gradient_accumulation_steps"],
        num_train_epochs=s["epochs"],
        learning_rate=s["learning_rate"],
        gradient_checkpointing=True,
        logging_steps=s["logging_steps"],
        save_strategy="no",
        seed=s["seed"],
        bf16=s.get("bf16", True),  # the article's script sets bf16=True
        use_cpu=True,
        report_to="none",
        include_num_input_tokens_seen="non_padding",  # measurement: count real tokens, as ftrun does
    )

    class Timing(TrainerCallback):  # measurement: the same rows ftrun writes to metrics.jsonl
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                with open(metrics_path, "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "step": state.global_step,
                                "time": time.time(),
                                "tokens_seen": state.num_input_tokens_seen,
                                "loss": logs["loss"],
                            }
                        )
                        + "\n"
                    )

    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Timing()],
    )
    trainer.train()
    trainer.save_model(out_dir)


# The plain script's variants: what each changes in SETTINGS.
PLAIN = {"plain": {}, "plain-fp32": {"bf16": False}}


def recipe_fields(model: Path, data: Path, output_dir: Path, same_settings: bool) -> dict:
    s = SETTINGS
    fields = dict(
        model=str(model),
        method="lora",
        data=str(data),
        output_dir=str(output_dir),
        max_length=s["max_length"],
        micro_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=s["gradient_accumulation_steps"],
        epochs=s["epochs"],
        learning_rate=s["learning_rate"],
        lora={"r": s["lora_r"], "alpha": s["lora_alpha"]},
        logging_steps=s["logging_steps"],
        seed=s["seed"],
        checkpoint_every_minutes=60,
        smoke={"enabled": False},
        export=["adapter"],
    )
    if same_settings:
        fields["padding_free"] = False  # what plain TRL does: random batches padded to their longest example
    return fields


def run_variant(name: str, model: Path, data: Path, work: Path, i: int) -> dict:
    out = bc.fresh_dir(work / f"{name}-{i}")
    if name in PLAIN:
        out.mkdir(parents=True)
        metrics = out / "metrics.jsonl"
        t0 = time.monotonic()
        rc = bc.subprocess.run(
            [
                bc.PYTHON,
                __file__,
                "--plain-run",
                json.dumps([str(model), str(data), str(out / "trainer"), str(metrics), {**SETTINGS, **PLAIN[name]}]),
            ],
            cwd=bc.REPO,
            env=bc.ENV,
            stdout=(out / "log.txt").open("w"),
            stderr=bc.subprocess.STDOUT,
        ).returncode
        wall = time.monotonic() - t0
    else:
        recipe = bc.write_recipe(work / f"{name}.yaml", **recipe_fields(model, data, out, name == "ftrun"))
        rc, wall = bc.ftrun([str(recipe), "--foreground"], log=work / f"{name}-{i}.log")
        metrics = out / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        raise SystemExit(f"{name} run {i} failed (exit {rc}); see {work}")
    rows = bc.read_rows(metrics)
    return {
        "variant": name,
        "round": i,
        "tokens_per_second": bc.tokens_per_second(rows),
        "wall_seconds": wall,
        "final_loss": rows[-1].get("loss"),
        "tokens": rows[-1]["tokens_seen"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="model s, 200 examples, 1 round (a few minutes)")
    p.add_argument("--rounds", type=int, help="rounds of all variants (default 3, --quick 1)")
    p.add_argument("--examples", type=int, help="examples in the data (default 800, --quick 200)")
    p.add_argument(
        "--size", choices=sorted(bc.MODEL_SIZES), help="bench model size (default m, ~10M; --quick s, ~1.8M)"
    )
    p.add_argument("--variants", default="plain,plain-fp32,ftrun,defaults", help="comma-separated subset")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--plain-run", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.plain_run:
        plain_trl(*json.loads(a.plain_run))
        return 0
    rounds = a.rounds or (1 if a.quick else 3)
    examples = a.examples or (200 if a.quick else 800)
    size = a.size or ("s" if a.quick else "m")
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in (*PLAIN, "ftrun", "defaults")]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join((*PLAIN, 'ftrun', 'defaults'))}")
    model, data = bc.bench_model(size), bc.bench_data(examples)
    work = bc.CACHE / "throughput"
    print(f"bench_throughput: {bc.machine()}; model {model.name}, {examples} examples, {rounds} round(s)", flush=True)
    results = []
    for i in range(rounds):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for name in order:
            r = run_variant(name, model, data, work, i)
            results.append(r)
            print(
                f"  round {i} {name:10s} {r['tokens_per_second']:8.0f} tokens/s  wall {r['wall_seconds']:6.1f} s  "
                f"final loss {r['final_loss']:.3f}",
                flush=True,
            )
    med = {v: bc.median([r["tokens_per_second"] for r in results if r["variant"] == v]) for v in variants}
    print("median training tokens/s (real tokens): " + ", ".join(f"{v} {med[v]:.0f}" for v in variants))
    ratios = {}
    for base in (b for b in PLAIN if b in med):
        for v in variants:
            if v in PLAIN:
                continue
            per_round = [
                r["tokens_per_second"] / p_["tokens_per_second"]
                for r in results
                for p_ in results
                if r["variant"] == v and p_["variant"] == base and p_["round"] == r["round"]
            ]
            ratios[f"{v}/{base}"] = {"ratio_of_medians": med[v] / med[base], "median_round_ratio": bc.median(per_round)}
            print(
                f"ratio {v}/{base}: {med[v] / med[base]:.2f}x (median of per-round ratios {bc.median(per_round):.2f}x)"
            )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "machine": bc.machine(),
                    "examples": examples,
                    "rounds": rounds,
                    "settings": SETTINGS,
                    "results": results,
                    "medians": med,
                    "ratios": ratios,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
