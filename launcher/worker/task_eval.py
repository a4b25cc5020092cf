"""The task evaluation: a loaded model answers the task's held-out prompts greedily, in batches, and the answers are
scored by the task's metric (launcher/data/task_metrics.py). Files (launcher/store/rundir.py): task.json, what is
asked, built once so every scorer and a resume ask the same; task_eval/<name>.jsonl, one scorer's answers, appended
per batch so a rerun after a kill answers only what is missing; task_eval.json, every scorer's score (`record`).

`python -m launcher.worker.task_eval --run-dir RUN --phase base` scores the base model before training; the worker
scores the fine-tuned model after it (worker/results.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.data import task_metrics
from launcher.data.task_examples import with_shots
from launcher.data.task_verdict import BARE_BASE, BASE_FEW_SHOT, BASE_ZERO_SHOT, base_score, stored_name, verdict
from launcher.store.checkpoint import atomic_write_json
from launcher.store.rundir import RunDir
from launcher.worker.samples import inference, prompt_text

from launcher.plan.throughput import GENERATION_BATCH as BATCH  # prompts per generate call, by device (one home)

PREFIX = "[ftrun task eval]"
# task_eval.json's fields keyed by score name
_BY_NAME = ("scores", "details", "generation", "per_example", "exact_beside")


def enabled(recipe) -> bool:
    return recipe.eval.task.examples > 0


def scores(task: dict[str, Any]) -> bool:
    """Whether the task can be scored (not {"not_applicable"} / {"too_few"})."""
    return "prompts" in task


def task_for_run(run: RunDir, recipe, examples: list, write: bool = True, tokenizer=None) -> dict[str, Any]:
    """The run's task (task.json, read if it exists), built from all of the recipe's `examples` with the worker's
    split. `write`: store it (the main process). With `tokenizer`, the chat-template switches training used
    (launcher/data/chat_prompt.py) go in as chat_template_kwargs: every scorer asks with them, as the export serves."""
    from launcher.data import split
    from launcher.data.task_examples import build_task

    if run.task.is_file():
        return json.loads(run.task.read_text())
    parts = split.for_recipe(examples, recipe)
    eval_examples = split.load_eval_data(recipe) if recipe.eval.data else None
    task = build_task(
        examples,
        parts.held_out,
        parts.train,
        recipe.eval.task,
        recipe.seed,
        eval_examples,
        max_new_tokens_cap=recipe.eval.max_new_tokens,
    )
    if tokenizer is not None and scores(task):
        from launcher.data.chat_prompt import task_switches

        from launcher.worker.processor import text_tokenizer

        switched = task_switches(text_tokenizer(tokenizer), task["prompts"])  # the template's text, not the images
        if switched:
            task["chat_template_kwargs"] = switched
    if getattr(recipe, "init_from", None):
        # the "base" rows score where this run starts: the base with the parent run's adapter (load_base)
        task["starting_point"] = f"the base model with the adapter of {Path(recipe.init_from).name} (init_from)"
    if write:
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.task, task)
    return task


# --- answering ---------------------------------------------------------------------------------------------------


def _eos_ids(model, tokenizer) -> list[int]:
    """Where an answer ends: the tokenizer's eos and generation_config's eos ids (a chat model's end of turn)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = [tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])]
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def generate_batch(
    model,
    tokenizer,
    texts: list[str],
    max_new_tokens: int,
    synced: bool = False,
    images: Optional[list[list[str]]] = None,
) -> list[tuple[str, int]]:
    """(answer, new tokens up to and including its end) for each text: one greedy, left-padded generate call.
    `images`: each text's image files (`tokenizer` is then the processor). The caller holds `inference`."""
    import torch

    from launcher.worker.processor import encode, text_tokenizer

    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)
    device = getattr(model, "device", None) or next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"  # the answers start right after each prompt's last token
    if pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # masked out: any token pads
    try:
        enc = encode(processor, texts, images, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(device)
        pad = tokenizer.pad_token_id
    finally:
        tokenizer.padding_side = side
        if pad_token is None:
            tokenizer.pad_token = None
    out = model.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad,
        eos_token_id=eos or None,
        synced_gpus=synced,
    )
    new = out[:, enc["input_ids"].shape[1] :]
    ended = torch.isin(new, torch.tensor(eos, dtype=new.dtype, device=new.device))
    results = []
    for row, stops in zip(new, ended):
        first = int(stops.nonzero()[0]) + 1 if bool(stops.any()) else len(row)
        results.append((tokenizer.decode(row[:first], skip_special_tokens=True).strip(), first))
    return results


def read_answers(path: Path) -> dict[int, dict[str, Any]]:
    """The answers kept so far, by example index; a line cut short by a kill is skipped (answered again)."""
    kept: dict[int, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            row = json.loads(line)
            kept[int(row["index"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        fh.flush()
        os.fsync(fh.fileno())


def _repair(path: Path) -> None:
    """A kill in the middle of a write leaves a line without its end: end it, so the next append starts a line."""
    try:
        with path.open("rb+") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    except OSError:
        pass


def answer(
    model,
    tokenizer,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    path: Path,
    *,
    identity: str = "",
    batch_size: Optional[int] = None,
    synced: bool = False,
    write: bool = True,
    on_batch: Optional[Callable[[int, int], None]] = None,
    template_kwargs: Optional[dict[str, Any]] = None,
) -> list[dict[str, Any]]:
    """Each prompt's answer row, in order: read from `path` where kept for the same `identity` (model, step) and
    text, else generated longest first and appended after each batch (`write`: the main process). RNG and train mode
    are left as they were. `synced`: every rank calls this alike (ZeRO-3, FSDP). `on_batch(done, total)`: heartbeat."""
    import torch

    texts = {int(p["index"]): prompt_text(tokenizer, p, template_kwargs) for p in prompts}
    pictures = {int(p["index"]): list(p.get("images") or []) for p in prompts}  # image data: each prompt's files
    asked = {
        i: hashlib.sha256("\0".join([identity, t, *pictures[i]]).encode()).hexdigest()[:16] for i, t in texts.items()
    }
    kept = {i: r for i, r in read_answers(path).items() if asked.get(i) == r.get("prompt")}
    missing = [i for i in texts if i not in kept]
    if missing:
        device = getattr(model, "device", None) or next(model.parameters()).device
        size = batch_size or BATCH.get(torch.device(device).type, BATCH["cpu"])
        order = sorted(missing, key=lambda i: -len(texts[i]))
        if write:
            _repair(path)
        with inference(model):
            for start in range(0, len(order), size):
                batch = order[start : start + size]
                t0 = time.monotonic()
                images = [pictures[i] for i in batch] if any(pictures[i] for i in batch) else None
                got = generate_batch(model, tokenizer, [texts[i] for i in batch], max_new_tokens, synced, images=images)
                share = (time.monotonic() - t0) / len(batch)
                rows = [
                    {"index": i, "answer": a, "new_tokens": n, "seconds": round(share, 4), "prompt": asked[i]}
                    for i, (a, n) in zip(batch, got)
                ]
                if write:
                    _append(path, rows)
                kept.update({r["index"]: r for r in rows})
                if on_batch is not None:
                    on_batch(len(prompts) - len(missing) + start + len(batch), len(prompts))
    return [kept[int(p["index"])] for p in prompts]


def score_model(
    model,
    tokenizer,
    run_root: Path,
    task: dict[str, Any],
    name: str,
    shots: bool = False,
    *,
    identity: str = "",
    batch_size: Optional[int] = None,
    synced: bool = False,
    write: bool = True,
    on_batch: Optional[Callable[[int, int], None]] = None,
) -> dict[str, Any]:
    """The model's score: {"score", "details", "examples", "per_example", "seconds", "new_tokens", "tokens_per_s",
    "sdpa_backends"}. `name`: its answers file (task_eval/<name>.jsonl, resumed: see `answer`); `shots`: the task's
    shots before each prompt. seconds and tokens count earlier attempts' answers too."""
    from launcher.worker.loading import apply_sdpa_backends

    backends = apply_sdpa_backends()  # the export's process loads its models without select_device
    prompts = task["prompts"]
    if shots:
        prompts = [with_shots(p, task["shots"]) for p in prompts]
    rows = answer(
        model,
        tokenizer,
        prompts,
        task["max_new_tokens"],
        RunDir(Path(run_root)).task_answers / f"{name}.jsonl",
        identity=identity,
        batch_size=batch_size,
        synced=synced,
        write=write,
        on_batch=on_batch,
        template_kwargs=task.get("chat_template_kwargs"),
    )
    return {**summary(task, prompts, rows), "sdpa_backends": backends}


def summary(task: dict[str, Any], prompts: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The score of answer rows ({"answer", "seconds", "new_tokens"}) to `prompts`, with the generation's figures."""
    scored = task_metrics.score(task["metric"], [r["answer"] for r in rows], [p["reference"] for p in prompts])
    seconds = sum(float(r.get("seconds") or 0.0) for r in rows)
    new_tokens = sum(int(r.get("new_tokens") or 0) for r in rows)
    return {
        "score": scored["score"],
        "details": scored["details"],
        "examples": len(rows),
        "per_example": [round(x, 4) for x in scored["per_example"]],  # the noise of a difference (task_verdict)
        "seconds": round(seconds, 3),
        "new_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }


# --- the results file --------------------------------------------------------------------------------------------


def read_results(run_root: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(RunDir(Path(run_root)).task_eval.read_text())
    except (OSError, ValueError):
        return None


def record(
    run_root: Path, task: dict[str, Any], name: Optional[str] = None, result: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """task_eval.json with `name`'s result merged in (only the task's statement when it cannot be scored), written
    atomically; returns it. fine_tune_pays is null until base_few_shot is scored."""
    path = RunDir(Path(run_root)).task_eval
    name = stored_name(task, name) if name is not None else None  # init_from: the parent's rows named for it
    if not scores(task):
        statement = {k: v for k, v in task.items() if k in ("not_applicable", "too_few", "why", "fix")}
        atomic_write_json(path, {**statement, "verdict": verdict(statement)})
        return read_results(run_root) or {}
    old = read_results(run_root) or {}
    if "scores" not in old or old.get("metric") != task["metric"]:
        old = {}  # a statement written before, or another task: start over
    if task.get("starting_point"):  # a file written before the parent's rows had their own names: renamed here
        renamed = {
            k: {stored_name(task, n): v for n, v in old[k].items()} for k in _BY_NAME if isinstance(old.get(k), dict)
        }
        old = {**old, **renamed}
    results = {
        "metric": task["metric"],
        "metric_reason": task["metric_reason"],
        "examples": len(task["prompts"]),
        "shots": len(task["shots"]),
        "max_new_tokens": task["max_new_tokens"],
        **{k: task[k] for k in ("chat_template_kwargs", "starting_point", "capped") if task.get(k)},
        **{k: dict(old.get(k, {})) for k in ("scores", "details", "generation", "per_example")},
    }
    if name is not None and result is not None:
        results["scores"][name] = result["score"]
        if result.get("per_example") is not None:
            results["per_example"][name] = result["per_example"]
        results["details"][name] = result["details"]
        results["generation"][name] = {
            k: result[k] for k in ("seconds", "new_tokens", "tokens_per_s", "sdpa_backends") if k in result
        }
    if task["metric"] != "exact" and task_metrics.single_tokens([p["reference"] for p in task["prompts"]]):
        # single-word or numeric references under another metric (chrF, json): exact match beside it, each scorer's,
        # so a chrF gain of shared characters ("2." against "12") is not read as right answers (task_verdict)
        results["exact_beside"] = {
            n: d["exact"] for n, d in results["details"].items() if isinstance(d, dict) and d.get("exact") is not None
        }
    best, _ = base_score(results)  # the base model's better prompt (data/task_verdict.py)
    results["fine_tune_pays"] = (
        task_metrics.fine_tune_pays(best)
        if results["scores"].get(stored_name(task, BASE_FEW_SHOT)) is not None
        else None
    )
    results["verdict"] = verdict(results)
    atomic_write_json(path, results)
    return results


def progress_line(name: str, task: dict[str, Any], result: dict[str, Any]) -> str:
    speed = f", {result['tokens_per_s']:.0f} tokens/s" if result.get("tokens_per_s") else ""
    return (
        f"{PREFIX} {name}: {result['score']:.1%} ({task['metric']}, {result['examples']} examples, "
        f"{result['seconds']:.1f} s{speed})"
    )


# --- before training: the base model ---------------------------------------------------------------------------


def load_base(recipe, with_parent: bool = True):
    """The base model in 16-bit (select_device's dtype; fp32 on the CPU), whatever the method trains in, and its
    tokenizer; under init_from with the parent adapter merged in, unless `with_parent` is False."""
    from launcher.worker.loading import attention_implementation, device_map, load_tokenizer, model_class, select_device

    device, dtype = select_device()
    kwargs: dict[str, Any] = {"dtype": dtype, "device_map": device_map(device, "trl")}
    attn = attention_implementation(device, dtype)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    model = model_class(recipe.model).from_pretrained(recipe.model, **kwargs)
    if with_parent and getattr(recipe, "init_from", None):
        # its "base" scores are the parent's: "did this step help?"
        from peft import PeftModel

        from launcher.recipe import parent_adapter

        model = PeftModel.from_pretrained(model, str(parent_adapter(recipe.init_from))).merge_and_unload()
    return model, load_tokenizer(recipe)


def score_base(
    run: RunDir,
    recipe,
    task: dict[str, Any],
    model,
    tokenizer,
    say: Callable[[str], None] = print,
    batch_size: Optional[int] = None,
) -> dict[str, Any]:
    """base_zero_shot and base_few_shot into task_eval.json (parent_* under init_from: `record`); returns it."""
    results: dict[str, Any] = {}
    for name, shots in ((BASE_ZERO_SHOT, False), (BASE_FEW_SHOT, True)):
        result = score_model(
            model, tokenizer, run.root, task, name, shots=shots, identity=recipe.model, batch_size=batch_size
        )
        results = record(run.root, task, name, result)
        say(progress_line(stored_name(task, name), task, result))
    return results


def _base_phase(run_dir: Path, batch_size: Optional[int]) -> int:
    from launcher.data.dataset import load_data
    from launcher.errors import FtrunError
    from launcher.recipe_loading import load_recipe
    from launcher.worker.inputs import _data_spec

    run = RunDir(run_dir)
    try:
        recipe = load_recipe(run.recipe)
        from launcher.notices import quiet_scoring_notices
        from launcher.worker.unused_libraries import keep_out, unused_when_scoring

        keep_out(unused_when_scoring(recipe))  # before transformers and PEFT are imported
        quiet_scoring_notices()
        if not enabled(recipe):
            print(f"{PREFIX} off (eval.task.examples is 0)", flush=True)
            return 0
        from launcher.worker.loading import load_tokenizer

        examples = [] if run.task.is_file() else load_data(_data_spec(run, recipe), recipe.seed).examples
        task = task_for_run(run, recipe, examples, tokenizer=load_tokenizer(recipe))
    except FtrunError as exc:  # a recipe or data the launcher would refuse: said in one line
        fix = f" Fix: {exc.fix}" if exc.fix else ""
        print(f"{PREFIX} {' '.join((exc.message + fix).split())}", file=sys.stderr, flush=True)
        return 2
    if not scores(task):
        record(run.root, task)
        print(f"{PREFIX} not scored: {task.get('not_applicable') or task['why']}", flush=True)
        return 0
    from transformers.utils import logging as transformers_logging

    # no "Loading weights" bar: the next line says what loaded and how long it took
    transformers_logging.disable_progress_bar()
    t0 = time.monotonic()
    model, tokenizer = load_base(recipe)
    parent = f" with the adapter of {Path(recipe.init_from).name} (init_from)" if recipe.init_from else ""
    print(
        f"{PREFIX} base model {recipe.model}{parent} loaded in {time.monotonic() - t0:.1f} s; "
        f"{len(task['prompts'])} examples, metric {task['metric']}: {task['metric_reason']}",
        flush=True,
    )
    score_base(run, recipe, task, model, tokenizer, say=lambda line: print(line, flush=True), batch_size=batch_size)
    if recipe.init_from:
        # the chain against the bare base too (task_verdict.BARE_BASE)
        del model
        model, tokenizer = load_base(recipe, with_parent=False)
        result = score_model(model, tokenizer, run.root, task, BARE_BASE, identity=recipe.model, batch_size=batch_size)
        record(run.root, task, BARE_BASE, result)
        print(progress_line(BARE_BASE, task, result), flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.worker.task_eval",
        description="Score a run's task (task.json) with the base model, before training.",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory (holds recipe.yaml)")
    parser.add_argument(
        "--phase",
        required=True,
        choices=["base"],
        help="base: the base model in 16-bit, zero-shot and with the task's shots",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"prompts per generate call (default {BATCH['cpu']} on the CPU, {BATCH['cuda']} on a GPU)",
    )
    args = parser.parse_args(argv)
    if not RunDir(args.run_dir).recipe.is_file():
        print(f"{PREFIX} {args.run_dir} is not a run directory (no recipe.yaml)", file=sys.stderr, flush=True)
        return 2
    if args.batch_size is not None and args.batch_size < 1:
        print(f"{PREFIX} --batch-size must be at least 1", file=sys.stderr, flush=True)
        return 2
    return _base_phase(args.run_dir, args.batch_size)


if __name__ == "__main__":
    sys.exit(main())
