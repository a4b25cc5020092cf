"""The statistics of the recipe's data that the plan and the run use: what trains, the eval split's examples left
out."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from launcher import methods
from launcher.data import formats
from launcher.data import images
from launcher.data import loss_view
from launcher.data import rewards
from launcher.data import split
from launcher.data import task_examples
from launcher.data.image_stats import image_stats
from launcher.data.dataset import compute_stats, example_lengths, load_data
from launcher.data.dataset import identity as data_identity
from launcher.errors import DataError, RecipeError


def data_stats(recipe: Any):
    if images.data_has_images(recipe.data):  # conversations with images: their own reading and sizing
        return image_stats(recipe)
    # an objective that samples keeps each record's other columns: its rewards read them (launcher/data/rewards.py)
    data = load_data(recipe.data, recipe.seed, columns=methods.OBJECTIVES[recipe.objective].generates)
    objective_fits(recipe, data.form, "data")
    if methods.OBJECTIVES[recipe.objective].generates:
        return _prompt_stats(recipe, data)
    examples = data.examples
    lengths, source = example_lengths(examples, recipe.model, data.where)
    # the statistics (plan, ETA) count what trains: the eval split's held-out examples do not (launcher/data/split.py)
    parts = split.for_recipe(examples, recipe)
    train = parts.train
    trains = [examples[i] for i in train]
    stats = compute_stats(trains, [lengths[i] for i in train], source, recipe.max_length, data, _splits(recipe))
    # what the loss sees, every training example marked as TRL masks it (a DataError: loss_view.py)
    origin = [data.origin[i] for i in train] if data.origin else [0] * len(train)
    sequences = _sequences(trains, [data.where[i] for i in train], origin, [str(s.get("source")) for s in data.sources])
    seen = loss_view.check(recipe.model, loss_view.Settings.of(recipe), *sequences)
    trained_each = seen.pop("trained_each", None) if seen else None
    if seen and any(isinstance(ex, dict) and "chosen" in ex for ex in examples):
        seen["pairs"] = pair_stats(trained_each)
    stats = replace(stats, loss_view=seen, held_out=len(parts.held_out), held_out_lines=len(examples) - len(train))
    if data.form == "unpaired":
        stats = replace(stats, labels=class_balance(recipe, trains))
    eval_examples = split.load_eval_data(recipe) if recipe.eval.data else None  # a broken eval file stops here
    _task_settings_fit(recipe, examples, lengths, parts, eval_examples)
    if recipe.eval.data:
        objective_fits(recipe, load_data(recipe.eval.data, recipe.seed).form, "eval.data")
        # a resume on changed eval data is refused like one on changed training data
        stats = replace(stats, sha256=data_identity(stats.sha256, load_data(recipe.eval.data, recipe.seed).sha256))
    return examples, lengths, stats


def _splits(recipe: Any) -> bool:
    """Packing that splits a sequence over max_length rather than cut it (trl 1.16 pack_dataset: bfd_split, wrapped)."""
    return bool(recipe.packing) and recipe.trainer.get("packing_strategy", "bfd") in ("bfd_split", "wrapped")


def _prompt_stats(recipe: Any, data: Any):
    """GRPO's data: each prompt counts its tokens plus grpo.max_completion_length. Refused: lengths that leave no room
    in max_length (TRL does not truncate prompts), and rewards that cannot score the data (rewards.py `refusals`)."""
    examples = data.examples
    parts = split.for_recipe(examples, recipe)
    train = parts.train
    probed = rewards.refusals(recipe, [examples[i] for i in train], [data.where[i] for i in train])
    prompts = [rewards.prompt_and_reference(e) for e in examples]
    as_text = [{"messages": p["prompt"]} if isinstance(p["prompt"], list) else {"text": p["prompt"]} for p in prompts]
    prompt_lengths, source = example_lengths(as_text, recipe.model, data.where)
    longest = max(train, key=lambda i: prompt_lengths[i])
    sized = completion_length(recipe, [prompts[i]["reference"] for i in train], prompt_lengths[longest])
    answer = sized["tokens"]
    if answer >= recipe.max_length:
        raise RecipeError(
            f"grpo.max_completion_length {answer:,}"
            + ("" if sized["why"] == "the recipe's" else f" ({sized['why']})")
            + f" is not below max_length {recipe.max_length:,}: the sampled answer alone fills a whole sequence, "
            "and no prompt fits beside it",
            fix=f"lower grpo.max_completion_length below {recipe.max_length:,} (the longest prompt of the data is "
            f"{prompt_lengths[longest]:,} tokens, {data.where[longest]}), or raise max_length to at least "
            f"{prompt_lengths[longest] + answer:,}",
        )
    room = recipe.max_length - answer
    if prompt_lengths[longest] > room:
        over = sum(prompt_lengths[i] > room for i in train)
        raise DataError(
            f"{data.where[longest]} is a prompt of {prompt_lengths[longest]:,} tokens, and max_length "
            f"{recipe.max_length:,} leaves {room:,} beside grpo.max_completion_length {answer:,}"
            + (f" ({sized['why']})" if sized["derived"] else "")
            + f" ({over} of {len(train)} prompts are longer): TRL's GRPOTrainer does not cut prompts",
            fix=f"raise max_length to at least {prompt_lengths[longest] + answer:,}, lower "
            "grpo.max_completion_length, or shorten those prompts",
        )
    lengths = [n + answer for n in prompt_lengths]
    stats = compute_stats([examples[i] for i in train], [lengths[i] for i in train], source, recipe.max_length, data)
    held = dict(held_out=len(parts.held_out), held_out_lines=len(examples) - len(train))
    stats = replace(stats, **held, rewards=tuple(probed), completion_length=sized)
    _task_settings_fit(recipe, examples, lengths, parts, None)
    return examples, lengths, stats


# A completion length sized from the references is at least this many tokens
SHORTEST_COMPLETION = 16


def completion_length(recipe: Any, references: list[Optional[str]], longest_prompt: int) -> dict[str, Any]:
    """grpo.max_completion_length as the run samples with it: {"tokens", "derived", "why"}: the recipe's; else, with
    task-metric rewards and references, twice the longest reference within max_length's room; else the default."""
    s = recipe.grpo
    if "max_completion_length" in s.model_fields_set:
        return {"tokens": s.max_completion_length, "derived": False, "why": "the recipe's"}
    refs = [r for r in references if r is not None]
    if not refs:
        why = "the default: the data has no references to size the answers from"
        return {"tokens": s.max_completion_length, "derived": False, "why": why}
    if not all(r.kind.reads_reference for r in recipe.rewards):
        why = (
            "the default: a reward function of yours may want answers longer than the references (a reasoning "
            "before the answer); set grpo.max_completion_length to size them"
        )
        return {"tokens": s.max_completion_length, "derived": False, "why": why}
    tokens, counted = _reference_tokens(recipe.model, refs)
    longest = max(tokens) + 1  # its end-of-text token, which ends the sampled answer
    sized = max(SHORTEST_COMPLETION, -(-2 * longest // 8) * 8)
    room = recipe.max_length - longest_prompt
    if sized > room >= longest:
        sized = room
    why = (
        f"sized from the references: the longest is {longest - 1:,} {counted} (+1 for the end of text), twice that"
        + (f", at least {SHORTEST_COMPLETION}" if sized == SHORTEST_COMPLETION else "")
        + (f", within the {room:,} tokens max_length leaves beside the longest prompt" if sized == room else "")
        + f"; the default {s.max_completion_length} where the recipe leaves it out and nothing sizes it"
    )
    return {"tokens": sized, "derived": True, "why": why}


def _reference_tokens(model: str, references: list[str]) -> tuple[list[int], str]:
    """Each reference's tokens with the model's tokenizer, else estimated (4 characters to a token), and which."""
    from launcher.data.tokenizer import read_tokenizer, tokenizer_dir

    folder, _ = tokenizer_dir(model)
    read = read_tokenizer(folder) if folder is not None else None
    if read is None:
        return [len(r) // 4 + 1 for r in references], "tokens (estimated from its characters: no tokenizer here)"
    return [len(read.tokenizer.encode(r, add_special_tokens=False).ids) for r in references], "tokens"


def with_data_defaults(recipe: Any, stats: Any) -> Any:
    """The recipe with the settings its data sized where it left them out (plan, recipe.yaml, worker)."""
    if getattr(stats, "images", None) and recipe.padding_free:  # left to its default: image data trains padded
        recipe = recipe.model_copy(update={"padding_free": False})
    sized = getattr(stats, "completion_length", None)
    if not sized or not sized["derived"] or sized["tokens"] == recipe.grpo.max_completion_length:
        return recipe
    return recipe.model_copy(update={"grpo": recipe.grpo.model_copy(update={"max_completion_length": sized["tokens"]})})


def _task_settings_fit(recipe: Any, examples: list, lengths: list[int], parts: Any, eval_examples: Any) -> None:
    """A RecipeError naming every eval.task setting the data cannot honour (task_examples.refusals)."""
    problems = task_examples.refusals(
        recipe.eval.task, examples, lengths, parts.held_out, parts.train, recipe.max_length, recipe.seed, eval_examples
    )
    if problems:
        raise RecipeError(
            "the task evaluation cannot honour "
            + ("these settings:\n- " + "\n- ".join(problems) if len(problems) > 1 else problems[0]),
            fix="change or remove the eval.task keys named (docs/task_eval.md)",
        )


def objective_fits(recipe: Any, form: str, key: str) -> None:
    """A DataError when the recipe's objective does not train data of this form, naming the formats that would fit."""
    objective = methods.OBJECTIVES[recipe.objective]
    if form in objective.forms:
        return
    fitting = [name for name, f in formats.FORMATS.items() if f.form in objective.forms]
    others = [o.name for o in methods.OBJECTIVES.values() if form in o.forms]
    raise DataError(
        f"{key} is {form.replace('_', '/')} data, which objective {recipe.objective} does not train "
        f"({recipe.objective} trains {', '.join(formats.describe(f) for f in fitting)})",
        fix=(
            f"set objective: {others[0]}"
            + (f" ({formats.FORMS[form].reads_as} train with {' or '.join(others)})" if len(others) > 1 else "")
            + f", or give {key} in one of: {', '.join(formats.example(f) for f in fitting[:2])}"
        )
        if others
        else f"give {key} in one of the formats {', '.join(fitting)} (docs/data.md).",
    )


def _sequences(examples: list[Any], where: list[str], origin: list[int], sources: list[str]):
    """The examples as the sequences that train (formats.sequences), each side of a pair one "source" of its own."""
    if not any(isinstance(ex, dict) and "chosen" in ex for ex in examples):
        return examples, where, origin, sources
    flat, places, kinds = [], [], []
    for ex, w, k in zip(examples, where, origin):
        for j, (side, seq) in enumerate(formats.sides(ex)):
            flat.append(seq)
            places.append(f"{w} ({side})")
            kinds.append(len(formats.SIDES) * k + j)
    return flat, places, kinds, [name for name in sources for _ in formats.SIDES]


def pair_stats(trained: list[int]) -> dict[str, Any]:
    """The pairs' mean answer lengths and the share whose chosen answer is longer (DPO's length bias)."""
    chosen, rejected = trained[0::2], trained[1::2]
    n = max(len(chosen), 1)
    return {
        "pairs": len(chosen),
        "chosen_mean_tokens": round(sum(chosen) / n, 1),
        "rejected_mean_tokens": round(sum(rejected) / n, 1),
        "chosen_longer": round(sum(c > r for c, r in zip(chosen, rejected)) / n, 4),
    }


# KTO's class balance (trl 1.16 kto_trainer.py _prepare_dataset; docs/data.md, "KTO's classes") and the refusal's
BALANCE_RANGE = (1.0, 4 / 3)
FAR_OFF = 1.5


def class_balance(recipe: Any, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """The training split's classes with the recipe's weights and the ratio TRL checks; a DataError where a class is
    missing or the ratio is far off, naming the weights that fit."""
    desirable = sum(1 for ex in examples if ex.get(formats.LABEL) is True)
    undesirable = len(examples) - desirable
    dw, uw = recipe.preference.desirable_weight, recipe.preference.undesirable_weight
    if not desirable or not undesirable:
        missing = "undesirable (label: false)" if desirable else "desirable (label: true)"
        raise DataError(
            f"the training data holds no {missing} answers ({desirable:,} desirable, {undesirable:,} undesirable): "
            "KTO learns from both, each against the other class and the KL estimate",
            fix="add answers of the missing class; answers that are all desirable train with objective: sft "
            "(as prompt/completion records without a label)",
        )
    ratio = dw * desirable / (uw * undesirable)
    low, high = BALANCE_RANGE
    d_range = (low * uw * undesirable / desirable, high * uw * undesirable / desirable)
    u_range = (dw * desirable / (high * undesirable), dw * desirable / (low * undesirable))
    record = {
        "desirable": desirable,
        "undesirable": undesirable,
        "desirable_weight": dw,
        "undesirable_weight": uw,
        "ratio": round(ratio, 4),
        "in_range": low - 1e-9 <= ratio <= high + 1e-9,
        "desirable_weight_range": [round(x, 2) for x in d_range],
        "undesirable_weight_range": [round(x, 2) for x in u_range],
    }
    if ratio < low / FAR_OFF or ratio > high * FAR_OFF:
        raise DataError(
            f"the training data holds {desirable:,} desirable and {undesirable:,} undesirable answers, and with "
            f"preference.desirable_weight {dw:g} and undesirable_weight {uw:g} the desirable side weighs {ratio:.2f} "
            f"times the undesirable one, far from the {low:g} to {high:.2f} TRL recommends for KTO (trl's "
            "KTOTrainer only warns, after the model loaded): one class would drown the other",
            fix=f"set preference.desirable_weight between {d_range[0]:.2f} and {d_range[1]:.2f}, or "
            f"preference.undesirable_weight between {u_range[0]:.2f} and {u_range[1]:.2f} (one of them, not both), "
            "or balance the classes in the data",
        )
    return record


def data_record(stats) -> dict[str, Any]:
    """data.json in the run: the resolved data (sources with their sha256 or revision, format, count, tokens)."""
    return {
        "description": stats.description,
        "sha256": stats.sha256,
        "sources": list(stats.sources),
        "examples": stats.examples,
        "total_tokens": stats.total_tokens,
        "mean_tokens": stats.mean_tokens,
        "max_tokens": stats.max_tokens,
        "tokens_source": stats.tokens_source,
        **({"loss_view": stats.loss_view} if stats.loss_view else {}),
        **({"labels": stats.labels} if stats.labels else {}),
    }
