"""Before and after: a few held-out prompts (a seeded draw; from the training data when there is no eval split)
answered greedily by the base model, once before the first step (samples-before.json, carried by every checkpoint),
and by the fine-tuned one after training, into final/samples.md and final/samples.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from launcher.data import task_examples
from launcher.data.images import text_of
from launcher.data.task_verdict import BARE_BASE, BARE_BASE_LABEL, start_name

BEFORE_FILE = "samples-before.json"  # in the run directory, and copied into each checkpoint
MARKDOWN = "samples.md"  # in final/
DATA = "samples.json"  # in final/


def pick(
    examples: list, held_out: list[int], train: list[int], n: int, seed: int, file: Optional[str] = None
) -> list[dict[str, Any]]:
    """n prompts (an example's messages before its last assistant turn, that turn the reference), seeded, from the
    held-out examples, else the training data. `file`: where the examples' numbers count from."""
    pool, source = (held_out, "eval split") if held_out else (train, "training data")
    return [
        {"index": p.pop("index"), "source": source, "file": file, **p}
        for p in task_examples.pick(examples, pool, n, seed, salt="samples")
    ]


def prompt_text(tokenizer, prompt: dict[str, Any], template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """What the model reads: plain text as it is, messages through its chat template (with `template_kwargs`)."""
    if "text" in prompt:
        return prompt["text"]
    return tokenizer.apply_chat_template(
        prompt["messages"], tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )


@contextmanager
def inference(model) -> Iterator[None]:
    """Eval mode without gradients; the random number generators and the train/eval mode as they were after."""
    import torch

    was_training = model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)


def generate(model, tokenizer, prompts: list[dict[str, Any]], max_new_tokens: int, synced: bool = False) -> list[str]:
    """Greedy answers, one prompt at a time (no padding to get wrong); RNG and train mode are left as they were.
    `synced`: every process calls this alike (ZeRO-3, FSDP)."""
    from launcher.worker.processor import encode, text_tokenizer

    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)  # a vision-language model's processor reads images
    device = getattr(model, "device", None) or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers = []
    with inference(model):
        for p in prompts:
            pictures = [p["images"]] if p.get("images") else None
            text = prompt_text(processor, p)
            enc = encode(processor, [text], pictures, return_tensors="pt", add_special_tokens=False).to(device)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=pad,
                synced_gpus=synced,
            )
            answers.append(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    return answers


def read_before(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_before(
    path: Path, prompts: list[dict[str, Any]], answers: list[str], max_new_tokens: int, seconds: float
) -> None:
    from launcher.store.checkpoint import atomic_write_json

    rows = [{**p, "before": a} for p, a in zip(prompts, answers)]
    record = {"max_new_tokens": max_new_tokens, "seconds": round(seconds, 3), "generated": time.time()}
    atomic_write_json(path, {**record, "samples": rows})


def before_callback(
    path: Path,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    tokenizer,
    writes: bool,
    synced: bool,
    say: Callable[[str], None],
):
    """A trainer callback: at step 0 (LoRA's B still zero) answer the prompts unless samples-before.json exists."""
    from transformers import TrainerCallback

    class Before(TrainerCallback):
        seconds: Optional[float] = None

        def on_train_begin(self, args, state, control, model=None, **kw):
            if state.global_step != 0 or not prompts or path.is_file() or model is None or not (writes or synced):
                return
            t0 = time.monotonic()
            try:
                answers = generate(model, tokenizer, prompts, max_new_tokens, synced)
            except Exception as exc:  # evidence, not training: a failure is said once and training goes on
                say(
                    f"samples: the base model's answers could not be generated ({type(exc).__name__}: {exc}); "
                    "final/samples.md will have only the answers after training"
                )
                return
            self.seconds = time.monotonic() - t0
            if writes:
                write_before(path, prompts, answers, max_new_tokens, self.seconds)
                say(
                    f"samples: the base model answered {len(answers)} prompt(s) in {self.seconds:.1f} s "
                    f"({path.name}; answered again after training)"
                )

    return Before()


def write_after(
    final: Path,
    before: Optional[dict[str, Any]],
    prompts: list[dict[str, Any]],
    answers: list[str],
    *,
    run_name: str,
    step: int,
    max_new_tokens: int,
    start: str = "base model",
) -> Path:
    """final/samples.md and final/samples.json from the before record and the answers after training. `start`: what
    answered before (init_from: the parent adapter)."""
    from launcher.store.checkpoint import atomic_write_json

    by_index = {s["index"]: s.get("before") for s in (before or {}).get("samples", [])}
    rows = [{**p, "before": by_index.get(p["index"]), "after": a} for p, a in zip(prompts, answers)]
    final.mkdir(parents=True, exist_ok=True)
    atomic_write_json(final / DATA, {"step": step, "max_new_tokens": max_new_tokens, "samples": rows})
    source = rows[0]["source"] if rows else "eval split"
    where = (
        "held out in the eval split: never trained on"
        if source == "eval split"
        else "from the training data (the recipe has no eval split): the model trained on these"
    )
    lines = [
        f"# Before and after: {run_name}",
        "",
        f"{len(rows)} prompt(s) {where}, answered greedily (at most {max_new_tokens} new tokens) by the {start} "
        f"before training and by the fine-tuned model after step {step}.",
        "",
    ]
    for k, r in enumerate(rows, start=1):
        lines += [f"## {k}. example {r['index'] + 1} of {r.get('file') or 'the data'}", "", "**Prompt**", ""]
        lines += _quote("\n\n".join(f"[{m['role']}] {text_of(m['content'])}" for m in r["messages"]))
        lines += ["", "**Reference**", ""] + _quote(r["reference"])
        lines += ["", f"**Before** ({start})", ""] + (
            _quote(r["before"]) if r["before"] is not None else ["_(not recorded)_"]
        )
        lines += ["", f"**After** (step {step})", ""] + _quote(r["after"]) + [""]
    path = final / MARKDOWN
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
    return path


SCORES_HEADING = "## Task evaluation"
# the rows of the scores' table, in this order (others, e.g. exports, after them)
SCORE_ROWS = {
    BARE_BASE: BARE_BASE_LABEL,
    "base_zero_shot": "base model, zero-shot",
    "base_few_shot": "base model, {shots} examples in the prompt",
    "parent_zero_shot": "parent adapter, zero-shot",
    "parent_few_shot": "parent adapter, {shots} examples in the prompt",
    "fine_tuned": "fine-tuned",
}


def scores_table(results: dict[str, Any]) -> list[str]:
    """The task evaluation's scores (task_eval.json) as a markdown section: the metric and why, one row a model."""
    if "scores" not in results:
        why = results.get("not_applicable") or results.get("why") or "not scored"
        return [SCORES_HEADING, "", f"Not scored: {why}" + (f" ({results['fix']})" if results.get("fix") else ""), ""]
    scores, details, speed = results["scores"], results.get("details", {}), results.get("generation", {})
    names = [n for n in SCORE_ROWS if n in scores] + [n for n in scores if n not in SCORE_ROWS]
    lines = [
        SCORES_HEADING,
        "",
        f"{results['examples']} held-out examples, answered greedily; metric **{results['metric']}**: "
        f"{results['metric_reason']}.",
        "",
        "| model | score | details | tokens/s |",
        "|---|---:|---|---:|",
    ]
    for n in names:
        label = SCORE_ROWS.get(n, n).format(shots=results.get("shots"))
        if n in ("base_zero_shot", "base_few_shot"):  # init_from, written before parent_: the parent's (task_verdict)
            label = label.replace("base model", start_name(results))
        sub = ", ".join(f"{k} {v:.1%}" for k, v in (details.get(n) or {}).items())
        tps = (speed.get(n) or {}).get("tokens_per_s")
        lines.append(f"| {label} | {scores[n]:.1%} | {sub} | {f'{tps:,.0f}' if tps else '-'} |")
    return lines + [""]


def append_scores(final: Path, results: dict[str, Any]) -> Path:
    """The scores' table at the end of final/samples.md (replacing an earlier one; the file begun if absent)."""
    path = final / MARKDOWN
    text = path.read_text() if path.is_file() else ""
    kept = ("\n" + text).split(f"\n{SCORES_HEADING}\n")[0].strip("\n")
    body = (kept + "\n\n" if kept else "") + "\n".join(scores_table(results))
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(body)
    tmp.replace(path)
    return path


def _quote(text: str) -> list[str]:
    """A blockquote: any text (code fences, headings) stays inside it."""
    if not text.strip():
        return ["> _(empty)_"]
    return [f"> {line}" if line else ">" for line in text.splitlines()]


def summary(rows: list[dict[str, Any]], width: int = 70) -> list[str]:
    """One line per sample for the log's end: reference, before, after, each cut to `width` characters."""

    def cut(text: Optional[str]) -> str:
        one = " ".join((text or "-").split())
        return one if len(one) <= width else one[: width - 3] + "..."

    return [
        line
        for k, r in enumerate(rows, start=1)
        for line in (
            f"{k}. reference: {cut(r['reference'])}",
            f"   before:    {cut(r.get('before'))}",
            f"   after:     {cut(r.get('after'))}",
        )
    ]
