"""The vs-trl step: ftrun against a plain TRL SFTTrainer on the same variable-length data and the same model (random
weights at Qwen3-0.6B's shape; the dry run's tiny shape on a CPU), the same micro-batch, LoRA and padding-free
layout; tokens/s on each side counted alike (the Trainer's num_input_tokens_seen, non-padding, over the same
steps), and the plain side again with cuDNN attention disabled."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_check.common import REPO, Context, child_env, last_line, module_cmd, read_json
from gpu_check.product import budget, cli, missing_packages, tiny_model, train_rows

SHAPE = {"cuda": "qwen3-0.6b", "cpu": "tiny"}
# Steps, the untimed first ones (the first shapes' one-time costs and the optimizer's state), micro-batch.
RUN = {"cuda": dict(steps=30, warmup=5, micro_batch=16), "cpu": dict(steps=6, warmup=2, micro_batch=4)}
DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"
LORA = dict(r=16, alpha=16)
LEARNING_RATE = 1e-4


def build_model(ctx: Context) -> Path:
    """Random weights at the shape, saved with the tiny model's tokenizer and chat template: token ids stay below
    the tiny vocabulary, the embedding and LM head have the shape's full size."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpu_check.training import _hf_config, architecture

    target = ctx.work / f"vs-trl-{SHAPE[ctx.device]}"
    if (target / "config.json").is_file():
        return target
    arch = architecture(Context(**{**vars(ctx), "shape": SHAPE[ctx.device]}))
    config = _hf_config(arch)
    config.use_cache = True
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(target)
    tiny = tiny_model(ctx)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, target / name)
    return target


def rate(points: list[tuple[int, float, int]], warmup: int) -> dict[str, Any]:
    """(step, seconds, tokens seen) at each step's end: tokens/s over the steps after `warmup`."""
    timed = [p for p in points if p[0] >= warmup]
    if len(timed) < 2:
        return {"tokens_per_second": None, "why": f"only {len(timed)} steps past the warm-up"}
    (s0, t0, n0), (s1, t1, n1) = timed[0], timed[-1]
    return {
        "tokens_per_second": round((n1 - n0) / (t1 - t0), 1),
        "timed_steps": s1 - s0,
        "timed_tokens": n1 - n0,
        "timed_seconds": round(t1 - t0, 3),
        "step_seconds": [round(b[1] - a[1], 4) for a, b in zip(timed, timed[1:])],
    }


def _recipe(ctx: Context, model: Path, run: dict[str, int]) -> Path:
    path = ctx.work / "vs-trl.yaml"
    lines = [
        f"model: {model}",
        "method: lora",
        f"data: {DATA}",
        "max_length: 512",
        f"micro_batch_size: {run['micro_batch']}",
        "gradient_accumulation_steps: 1",
        f"max_steps: {run['steps']}",
        f"learning_rate: {LEARNING_RATE}",
        f"lora: {{r: {LORA['r']}, alpha: {LORA['alpha']}}}",
        "logging_steps: 1",
        "checkpoint_every_minutes: 60",
        "smoke: {enabled: false}",
        "export: []",
        "eval: {every_minutes: 60, samples: 0, task: {examples: 0}}",
        f"output_dir: {ctx.work / 'runs' / 'vs-trl'}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def trl_child(model_dir: Path, settings: Path, out: Path, cudnn: bool) -> int:
    """A plain SFTTrainer, as a user writes one, with ftrun's resolved settings (`settings`: micro-batch, gradient
    checkpointing, padding-free, max_length): the step ends' times and tokens into `out`. Padding-free as a user asks
    for it, `padding_free=True` with `max_length=None`: trl 1.16 refuses a max_length there without packing
    (trl/trainer/sft_trainer.py, SFTTrainer.__init__; ftrun passes TRL's padding-free collator instead,
    launcher/worker/trainer_config.py padding_free_collator), and no example of the demo data is longer than 512."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    s = json.loads(settings.read_text())
    cuda = torch.cuda.is_available()
    if cuda and not cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    points: list[tuple[int, float, int]] = []

    class Times(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            points.append((state.global_step, time.perf_counter(), int(state.num_input_tokens_seen)))

    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa"
    )
    config = SFTConfig(
        output_dir=str(out.parent / "vs-trl-plain"),
        per_device_train_batch_size=s["micro_batch"],
        gradient_accumulation_steps=s["accumulation"],
        max_steps=s["steps"],
        learning_rate=LEARNING_RATE,
        logging_steps=1,
        bf16=cuda,
        use_cpu=not cuda,
        padding_free=s["padding_free"],
        max_length=None if s["padding_free"] else s["max_length"],
        gradient_checkpointing=s["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="no",
        report_to=[],
        include_num_input_tokens_seen="non_padding",
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list([{"messages": r["messages"]} for r in rows]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Times()],
        peft_config=LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    flags = (
        {
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        }
        if cuda
        else None
    )
    out.write_text(json.dumps({"points": points, "peak_memory_gb": peak, "sdpa_enabled": flags}))
    return 0


def step_vs_trl(ctx: Context) -> dict[str, Any]:
    skipped = missing_packages()
    if skipped:
        return skipped
    total = budget(180)
    t_end = time.monotonic() + total - 10
    run = RUN[ctx.device]
    model = build_model(ctx)
    recipe = _recipe(ctx, model, run)
    run_dir = ctx.work / "runs" / "vs-trl"
    code, secs, out = cli(
        [str(recipe), "--foreground", "--fresh"], ctx.work, t_end - time.monotonic(), ctx.out / "vs-trl.cli.log"
    )
    if code != 0:
        lines = [x for x in out.splitlines() if x.strip()]
        return {"ok": False, "line": f"ftrun failed (exit {code}): {lines[-1][:200] if lines else ''}"}
    rows = train_rows(run_dir)
    plan = read_json(run_dir / "plan.json") or {}
    import yaml

    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    settings = {
        "micro_batch": plan.get("micro_batch_size", run["micro_batch"]),
        "accumulation": plan.get("gradient_accumulation_steps", 1),
        "steps": run["steps"],
        "padding_free": bool(resolved.get("padding_free", True)),
        "max_length": resolved.get("max_length", 512),
        "gradient_checkpointing": bool(resolved.get("gradient_checkpointing", True)),
    }
    worker = read_json(run_dir / "worker.json") or {}
    peak = max((r.get("peak_memory_gb") or 0 for r in rows), default=None)
    sides: dict[str, Any] = {
        "ftrun": {
            **rate([(r["step"], r["time"], r["tokens_seen"]) for r in rows], run["warmup"]),
            "wall_seconds": round(secs, 1),
            "sdpa_backends": worker.get("sdpa_backends"),
            "attention": worker.get("attention"),
            "peak_memory_gb": peak,
        }
    }
    ctx.progress(settings=settings, sides=sides)
    (ctx.work / "vs-trl.settings.json").write_text(json.dumps(settings))
    variants = {"trl": True, "trl-cudnn-off": False} if ctx.device == "cuda" else {"trl": True}
    for name, cudnn in variants.items():
        path = ctx.work / f"{name}.points.json"
        args = module_cmd(
            "trl-child", "--model", str(model), "--settings", str(ctx.work / "vs-trl.settings.json"), "--out", str(path)
        ) + ([] if cudnn else ["--no-cudnn"])
        t0 = time.perf_counter()
        left = t_end - time.monotonic()
        if left < 20:
            sides[name] = {"skipped": "out of the step's time"}
            continue
        proc = subprocess.run(args, env=child_env(), capture_output=True, text=True, timeout=left)
        (ctx.out / "vs-trl.cli.log").open("a").write(f"$ {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
        got = read_json(path)
        if proc.returncode != 0 or got is None:
            sides[name] = {"error": last_line(proc)}
            continue
        sides[name] = {
            **rate([tuple(p) for p in got["points"]], run["warmup"]),
            "wall_seconds": round(time.perf_counter() - t0, 1),
            "peak_memory_gb": got["peak_memory_gb"],
            "sdpa_enabled": got["sdpa_enabled"],
        }
    said = {k: v.get("tokens_per_second") for k, v in sides.items()}
    ok = all(isinstance(v, (int, float)) for v in said.values())
    line = f"{SHAPE[ctx.device]}, micro-batch {settings['micro_batch']}: " + ", ".join(
        f"{k} {v:,.0f} tok/s"
        if isinstance(v, (int, float))
        else f"{k} {sides[k].get('error') or sides[k].get('skipped') or sides[k].get('why')}"
        for k, v in said.items()
    )
    if ok and said.get("trl"):
        line += f"; ftrun/trl {said['ftrun'] / said['trl']:.2f}x"
    return {
        "ok": ok,
        "shape": SHAPE[ctx.device],
        "settings": settings,
        "sides": sides,
        "counted": "Trainer num_input_tokens_seen (non_padding) over the same steps, warm-up excluded",
        "line": line,
    }
