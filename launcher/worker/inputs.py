"""The worker's data, read back as the launcher checked it (training examples, held-out examples, sample prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from launcher.data import split
from launcher.store.rundir import RunDir
from launcher.worker import samples


def _data_spec(run: RunDir, recipe):
    """The recipe's data, Hub datasets pinned at the revisions the launcher read (data.json)."""
    from launcher.data.sources import pinned

    record = run.root / "data.json"
    return pinned(recipe.data, json.loads(record.read_text()).get("sources", [])) if record.is_file() else recipe.data


def _data_changed(run: RunDir, recipe, data_sha256: str) -> Optional[str]:
    """Why the data read now is not what the launcher recorded (data.json), or None: a restart after a crash."""
    from launcher.data.dataset import identity, load_data

    record = run.root / "data.json"
    recorded = json.loads(record.read_text()).get("sha256") if record.is_file() else None
    if not recorded:
        return None
    eval_sha = load_data(recipe.eval.data, recipe.seed).sha256 if recipe.eval.data else None
    now = identity(data_sha256, eval_sha)
    if now == recorded:
        return None
    return (
        f"the data changed since the launch checked it (sha256 {recorded[:12]}... -> {now[:12]}...): not "
        "training on other examples than the run started with; restore the data and run the same command "
        "again (it resumes), or add --allow-changes / --fresh"
    )


def _local_data(spec) -> bool:
    from launcher.data.sources import sources_of

    return all(s.local and Path(s.path).exists() for s in sources_of(spec))


def _eval_and_prompts(run: RunDir, recipe, mode: str, examples: list) -> tuple[list, list[dict[str, Any]]]:
    """The eval examples and the sample prompts: split here, or as the smoke test's launcher wrote them."""
    from launcher.data.dataset import load_data

    if mode == "smoke":
        held = run.smoke_work / "eval.jsonl"
        asked = run.smoke_work / "prompts.json"
        return (
            load_data(held, recipe.seed).examples if held.is_file() else [],
            json.loads(asked.read_text()) if asked.is_file() else [],
        )
    parts = split.for_recipe(examples, recipe)
    if recipe.eval.data:
        held_examples = split.load_eval_data(recipe)
        everything = list(range(len(held_examples)))
        source = split.source_name(recipe.eval.data)
        return held_examples, samples.pick(held_examples, everything, [], recipe.eval.samples, recipe.seed, source)
    prompts = samples.pick(
        examples, parts.held_out, parts.train, recipe.eval.samples, recipe.seed, split.source_name(recipe.data)
    )
    return [examples[i] for i in parts.held_out], prompts


def _trained_tokens(examples: list, prepared, sample: int = 2000) -> str:
    """What TRL made of the data: its form and the share of tokens the loss is computed on."""
    from launcher.data.formats import FORMS, example_form

    if examples and examples[0].get("images") is not None:
        # trl 1.16 leaves image data to its collator (sft_trainer.py _skip_prepare_dataset)
        count = sum(len(e["images"]) for e in examples)
        what, unit, each = ("chat with images", "examples", "")
        if example_form(examples[0]) == "preference":
            what, unit = "preference pairs with images", "pairs"
            each = " (its prompt and images before the chosen and the rejected answer)"
        return (
            f"data as TRL takes it: {what}, {len(prepared):,} {unit}, {count:,} images; each batch rendered{each}, its "
            "images read and tokenized by the model's processor as it trains (the plan counted the image tokens)"
        )
    rows = prepared.select(range(min(sample, len(prepared))))
    first = f", first {len(rows):,} pairs" if len(rows) < len(prepared) else ""
    if example_form(examples[0]) == "preference":
        # DPO keeps prompt_ids/chosen_ids/rejected_ids (trl 1.16 dpo_trainer.py tokenize_fn; the loss is on the
        # answers); ORPO prompt_input_ids and chosen_/rejected_labels (-100 on the prompt; orpo_trainer.py tokenize_row)
        cols = rows.column_names
        if "chosen_ids" in cols:
            prompt = sum(len(x) for x in rows["prompt_ids"])
            answers = sum(len(x) for x in rows["chosen_ids"]) + sum(len(x) for x in rows["rejected_ids"])
        else:
            prompt = sum(len(x) for x in rows["prompt_input_ids"])
            answers = sum(
                sum(t != -100 for t in row) for side in ("chosen_labels", "rejected_labels") for row in rows[side]
            )
        total = 2 * prompt + answers
        return (
            f"data as TRL prepared it: preference pairs, {len(prepared):,} pairs (two sequences each: the prompt "
            f"with the chosen and with the rejected answer); loss on the answers' {answers:,} of {total:,} tokens "
            f"({answers / max(total, 1):.1%}{first})"
        )
    if example_form(examples[0]) == "unpaired":
        # KTO keeps prompt_ids, completion_ids, KL_completion_ids (trl 1.16 kto_trainer.py tokenize_fn)
        prompt = sum(len(x) for x in rows["prompt_ids"])
        answers = sum(len(x) for x in rows["completion_ids"])
        desirable = sum(bool(x) for x in prepared["label"])
        return (
            f"data as TRL prepared it: unpaired answers, {len(prepared):,} examples ({desirable:,} desirable, "
            f"{len(prepared) - desirable:,} undesirable), each with its KL sequence; loss on the answers' {answers:,} "
            f"of {prompt + answers:,} tokens ({answers / max(prompt + answers, 1):.1%}{first})"
        )
    form = FORMS[example_form(examples[0])].reads_as
    ids = rows["input_ids"]
    # trl 1.16 keeps the loss masks as columns (assistant_masks, completion_mask); a row's first token is never a
    # target (the labels are shifted), as launcher/data/loss_view.py counts them
    mask = next((rows[c] for c in ("labels", "assistant_masks", "completion_mask") if c in rows.column_names), None)
    if mask is None:
        mask = [[1] * len(x) for x in ids]
    elif "labels" in rows.column_names:
        mask = [[int(t != -100) for t in row] for row in mask]
    total = sum(len(x) for x in ids)
    trained = sum(sum(row[1:]) for row in mask)
    return (
        f"data as TRL prepared it: {form}, {len(prepared):,} examples; loss on {trained:,} of {total:,} tokens "
        f"({trained / max(total, 1):.1%}{f', first {len(rows):,} examples' if len(rows) < len(prepared) else ''})"
    )


def templated(examples: list, tokenizer) -> list:
    """Conversational pairs rendered to text by trl 1.16 data_utils.py maybe_apply_chat_template, as ORPO does."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

    from launcher.data.formats import PAIR_KEYS

    rows = [maybe_apply_chat_template(maybe_extract_prompt(dict(ex)), tokenizer) for ex in examples]
    return [{k: row[k] for k in PAIR_KEYS} for row in rows]
