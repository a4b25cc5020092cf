"""GRPO's rewards: each of the recipe's `reward:` entries as the function TRL's GRPOTrainer calls, and the check that
refuses one at plan time.

TRL calls a reward function as `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...)` and takes one float (or None) per completion (trl 1.16 grpo_trainer.py
`_calculate_rewards`); `columns` are the dataset's other columns, here `reference`. A metric reward scores each
sampled answer against its prompt's reference with the task evaluation's own scorer (launcher/data/task_metrics.py),
so what the run is rewarded for is what its task score measures. A function of the user's is called once here, before
any GPU time (`refusals`).

Pure (no torch): the plan and the worker both build them.
"""

from __future__ import annotations

import importlib.util
import numbers
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.data import formats, task_examples, task_metrics
from launcher.errors import RecipeError


def prompt_and_reference(example: dict[str, Any]) -> Optional[dict[str, Any]]:
    """{"prompt": ..., "reference": ...} for GRPO from an example of a form it trains (launcher/methods.py grpo
    forms): a prompt row as it is, a chat example's turns before its last assistant turn with that turn as the
    reference (a chat without one: its turns, no reference), a prompt/completion pair's prompt with the completion
    as the reference. None when nothing is left to prompt with."""
    if "prompt" in example and "completion" not in example:
        return {"prompt": example["prompt"], "reference": example.get("reference")}
    pr = task_examples.prompt_and_reference(example)
    if pr is not None:
        return {"prompt": pr["text"] if "text" in pr else pr["messages"], "reference": pr["reference"]}
    messages = example.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") != "assistant":
        return {"prompt": messages, "reference": None}
    return None


def answer_text(completion: Any) -> str:
    """A sampled completion's text: TRL passes conversational completions as [{"role": "assistant", ...}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def resolved_metric(metric: str, references: list[Optional[str]]) -> str:
    """`auto` as the task evaluation chooses it from the references (task_metrics.choose); a named metric as is."""
    if metric != task_metrics.AUTO:
        return metric
    return task_metrics.choose([r for r in references if r is not None])[0]


def metric_reward(metric: str) -> Callable[..., list[Optional[float]]]:
    """TRL's reward function for a task metric: each answer's own score against its reference (None where a row has
    no reference; TRL counts it as NaN and leaves it out of the means)."""

    def reward(prompts, completions, reference=None, **_):
        refs = reference if reference is not None else [None] * len(completions)
        out: list[Optional[float]] = [None] * len(completions)
        scored = [k for k, r in enumerate(refs) if r is not None]
        if scored:
            per = task_metrics.score(metric, [answer_text(completions[k]) for k in scored], [refs[k] for k in scored])[
                "per_example"
            ]
            for k, value in zip(scored, per):
                out[k] = float(value)
        return out

    reward.__name__ = f"metric_{metric}"  # TRL's log names: rewards/metric_exact/mean
    return reward


def load_function(spec: str) -> Callable:
    """The function FILE.py:NAME names (FILE absolute: launcher/recipe_loading.py resolves it against the recipe's
    folder)."""
    file, _, name = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise RecipeError(
            f"reward function {spec}: the file {path} does not exist",
            fix="give the reward's file relative to the recipe's folder, as FILE.py:NAME",
        )
    module_name = f"ftrun_reward_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up by name
    try:
        loader.loader.exec_module(module)
    except Exception as exc:  # the user's module: any error it raises is theirs to fix, named here
        raise RecipeError(
            f"reward function {spec}: importing {path.name} raised {type(exc).__name__}: {exc}",
            fix=f"fix {path.name} so that `python {path}` runs without error",
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RecipeError(
            f"reward function {spec}: {path.name} has no function {name!r}"
            + (f" (it defines {', '.join(found[:8])})" if found else ""),
            fix="name a function the file defines, as FILE.py:NAME",
        )
    return fn


def build(recipe: Any, examples: list[dict[str, Any]]) -> tuple[list[Callable], list[float]]:
    """The recipe's rewards as TRL's reward_funcs and reward_weights (GRPO's prompts in `examples`)."""
    references = [e.get("reference") for e in examples]
    funcs = [
        load_function(r.function) if r.function else metric_reward(resolved_metric(r.metric, references))
        for r in recipe.rewards
    ]
    return funcs, [float(r.weight) for r in recipe.rewards]


def refusals(recipe: Any, examples: list[dict[str, Any]], where: list[str]) -> None:
    """A RecipeError for rewards that cannot score this data: a metric on rows without a reference (the first such
    line named), a function that cannot be loaded, raises, returns the wrong number of values or something that is
    not a number when called on the first prompt with two answers (its reference and an empty one)."""
    prompts = [prompt_and_reference(e) for e in examples]
    for k, p in enumerate(prompts):
        if p is None:
            raise RecipeError(
                f"{where[k]} leaves nothing to prompt with for objective {recipe.objective} (a conversation that "
                "ends with its only assistant turn and has no turn before it)",
                fix="give each example a user turn before the answer, or a prompt row: " + formats.example("prompt"),
            )
    for i, spec in enumerate(recipe.rewards):
        key = f"reward[{i}]" if recipe.reward is not None and len(recipe.rewards) > 1 else "reward"
        if spec.metric:
            missing = next((k for k, p in enumerate(prompts) if p["reference"] is None), None)
            if missing is not None:
                n = sum(p["reference"] is None for p in prompts)
                raise RecipeError(
                    f"{key} is the task metric{'' if spec.metric == task_metrics.AUTO else ' ' + spec.metric}, "
                    f"which scores each answer against its prompt's reference, and {where[missing]} has none "
                    f"({n} of {len(prompts)} prompts without one)",
                    fix="give those rows a reference (a prompt row's \"reference\", a chat example's last assistant "
                    "turn), or reward them with a function of yours (reward: {function: FILE.py:NAME})",
                )
            continue
        _probe(spec.function, key, prompts[0])


def _probe(spec: str, key: str, example: dict[str, Any]) -> None:
    fn = load_function(spec)
    prompt, reference = example["prompt"], example["reference"]
    answers = [reference or "a sampled answer", ""]
    if isinstance(prompt, list):
        completions: list[Any] = [[{"role": "assistant", "content": a}] for a in answers]
    else:
        completions = answers
    columns = {"reference": [reference] * 2}
    try:
        values = fn(
            prompts=[prompt] * 2,
            completions=completions,
            completion_ids=[[], []],
            trainer_state=None,
            log_extra=lambda *a, **k: None,
            log_metric=lambda *a, **k: None,
            **columns,
        )
    except Exception as exc:  # the user's code: whatever it raises is refused with its words
        raise RecipeError(
            f"{key} function {spec} raised {type(exc).__name__}: {exc} when called on the first prompt with two "
            "answers, as TRL's GRPOTrainer calls it: f(prompts=[...], completions=[...], completion_ids=[...], "
            "reference=[...], trainer_state=..., log_extra=..., log_metric=...)",
            fix="accept those keyword arguments (add **kwargs) and return one float per completion",
        ) from None
    bad = None
    if not isinstance(values, (list, tuple)):
        bad = f"returned {type(values).__name__} {str(values)[:60]}, not a list"
    elif len(values) != 2:
        bad = f"returned {len(values)} values for 2 completions"
    else:
        wrong = [v for v in values if not _is_number(v)]
        if wrong:
            bad = f"returned {wrong[0]!r} ({type(wrong[0]).__name__}), not a number"
    if bad:
        raise RecipeError(
            f"{key} function {spec} {bad} (called on the first prompt with two answers)",
            fix="return a list with one float per completion (None for one that cannot be scored)",
        )


def _is_number(value: Any) -> bool:
    """A float TRL can put in its reward tensor: a real number (numpy's too) or None, not a bool or a string."""
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool))
