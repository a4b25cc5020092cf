"""GRPO's rewards: each of the recipe's `reward:` entries as the function TRL's GRPOTrainer calls, and the probe that
refuses one at plan time.

How TRL calls a reward: docs/engines.md, "GRPO (issue 45)" (trl 1.16 grpo_trainer.py `_calculate_rewards`); the
columns are `reference` and every other column of the data's records. A metric reward scores with the task
evaluation's own scorer (task_metrics.py). A function is FILE.py:NAME or MODULE:NAME (trl.rewards:NAME).

Every reward is probed before any GPU time (`refusals`, reward_probe.py) on a few prompts answered right, wrong and
empty, in several forms. Refused: a function that cannot be loaded, takes a column the data lacks, raises, returns the
wrong count, a non-number or a non-finite value (NaN advantages in TRL); a reward that scores every probe alike; one
that does not score the right answers above the wrong ones, unless `scores: form`; a recipe whose every reward scores
the form. Pure (no torch): the plan and the worker both build them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from launcher.data import formats, task_examples, task_metrics
from launcher.data.reward_probe import Probe
from launcher.errors import RecipeError
from launcher.errors import close_name

# What TRL's GRPOTrainer passes every reward function besides the data's columns (`_calculate_rewards`).
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def prompt_and_reference(example: dict[str, Any]) -> Optional[dict[str, Any]]:
    """{"prompt": ..., "reference": ...} for GRPO from an example: a prompt row as it is, else the turns before the
    last answer with that answer as the reference (a chat without one: no reference). None when nothing is left."""
    if "prompt" in example and "completion" not in example:
        return {"prompt": example["prompt"], "reference": example.get("reference")}
    pr = task_examples.prompt_and_reference(example)
    if pr is not None:
        return {"prompt": pr["text"] if "text" in pr else pr["messages"], "reference": pr["reference"]}
    messages = example.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") != "assistant":
        return {"prompt": messages, "reference": None}
    return None


def prompt_row(example: dict[str, Any]) -> Optional[dict[str, Any]]:
    """GRPO's dataset row for an example: its prompt, its reference and the record's other columns (or None)."""
    pr = prompt_and_reference(example)
    return None if pr is None else {**pr, **formats.other_columns(example)}


def prompt_rows(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every example as its GRPO row, each with every column (None where its record had none, as a dataset has)."""
    rows = [prompt_row(e) for e in examples]
    names = list(dict.fromkeys(k for r in rows if r for k in r))
    return [{k: r.get(k) for k in names} for r in rows]


def answer_text(completion: Any) -> str:
    """A sampled completion's text: TRL passes conversational completions as [{"role": "assistant", ...}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def resolved_metric(metric: str, references: list[Optional[str]]) -> str:
    """`auto` as the task evaluation chooses it from the references (task_metrics.choose); a named metric as is."""
    return metric if metric != task_metrics.AUTO else task_metrics.choose([r for r in references if r is not None])[0]


def metric_reward(metric: str) -> Callable[..., list[Optional[float]]]:
    """TRL's reward function for a task metric: each answer's score against its reference (None without one)."""

    def reward(prompts, completions, reference=None, **_):
        refs = reference if reference is not None else [None] * len(completions)
        out: list[Optional[float]] = [None] * len(completions)
        scored = [k for k, r in enumerate(refs) if r is not None]
        answers = [answer_text(completions[k]) for k in scored]
        per = task_metrics.score(metric, answers, [refs[k] for k in scored])["per_example"] if scored else []
        for k, value in zip(scored, per):
            out[k] = float(value)
        return out

    reward.__name__ = f"metric_{metric}"  # TRL's log names: rewards/metric_exact/mean
    return reward


def is_module_path(target: str) -> bool:
    """MODULE:NAME's MODULE (dotted names, `trl.rewards`), as against a FILE.py."""
    return not target.endswith(".py") and all(part.isidentifier() for part in target.split("."))


def load_function(spec: str) -> Callable:
    """The function FILE.py:NAME or MODULE:NAME names (FILE made absolute by recipe_loading.py); a file inside an
    installed package is imported as its module, so its relative imports work."""
    target, _, name = spec.rpartition(":")
    module_name = target if is_module_path(target) else _package_module(Path(target))
    if module_name is not None:
        module, where = _import_module(spec, module_name), f"module {module_name}"
    else:
        module, where = _import_file(spec, Path(target)), Path(target).name
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        if hasattr(module, "__all__"):  # a package that imports lazily (trl.rewards): what it exports
            found = sorted(module.__all__) or found
        near = close_name(name, found)
        raise RecipeError(
            f"reward function {spec}: {where} has no function {name!r}"
            + (f" (did you mean '{near}'?)" if near else "")
            + (f" (it defines {', '.join(found[:8])})" if found and not near else ""),
            fix=f"name a function {where} defines, as {target}:NAME",
        )
    return fn


def _site_folders() -> list[Path]:
    """Where installed packages live: site-packages (system, user, the virtual environment's)."""
    folders = list(site.getsitepackages()) + [site.getusersitepackages()]
    folders += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return [Path(f).resolve() for f in dict.fromkeys(folders) if f and Path(f).is_dir()]


def _package_module(path: Path) -> Optional[str]:
    """The module name of a .py file inside an installed package; None for a file of the user's."""
    if path.is_absolute():
        resolved = path.resolve()
        for folder in _site_folders():
            if resolved.is_relative_to(folder):
                parts = resolved.relative_to(folder).with_suffix("").parts
                inside = all((folder.joinpath(*parts[:k]) / "__init__.py").is_file() for k in range(1, len(parts)))
                return ".".join(parts) if len(parts) > 1 and inside else None
        return None
    parts = path.with_suffix("").parts
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return None
    dotted = ".".join(parts)
    try:
        found = importlib.util.find_spec(parts[0]) is not None and importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        found = False
    return dotted if found else None


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise RecipeError(
            f"reward function {spec}: no module {missing!r} is installed where ftrun runs",
            fix=f"install the package that provides {missing} into ftrun's environment (pip install ...; the box "
            "that trains needs it too), or give a file of yours as FILE.py:NAME (relative to the recipe's folder)",
        ) from None
    except Exception as exc:  # the module's own import error, named
        raise RecipeError(
            f"reward function {spec}: importing {module_name} raised {type(exc).__name__}: {exc}",
            fix=f"check that `python -c 'import {module_name}'` runs where ftrun runs (the installed versions)",
        ) from None


def _import_file(spec: str, path: Path) -> Any:
    if not path.is_absolute() or not path.is_file():  # a relative one was not found beside the recipe
        where = "in the recipe's folder" if not path.is_absolute() else ""
        raise RecipeError(
            f"reward function {spec}: the file {path} does not exist{' ' + where if where else ''}, nor is it a file "
            "of an installed package",
            fix="give the reward's file relative to the recipe's folder, as FILE.py:NAME, or an installed module's "
            "function as MODULE:NAME (trl.rewards:think_format_reward)",
        )
    module_name = f"ftrun_reward_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up by name
    try:
        loader.loader.exec_module(module)
    except ImportError as exc:
        relative = "relative import" in str(exc)
        raise RecipeError(
            f"reward function {spec}: importing {path.name} raised {type(exc).__name__}: {exc}",
            fix=(
                f"{path.name} imports relative to a package: import from the package by name instead (from "
                "mypackage.x import y), or name the function by its module (MODULE:NAME)"
                if relative
                else f"install what {path.name} imports into ftrun's environment (the box that trains needs it too)"
            ),
        ) from None
    except Exception as exc:  # the user's module: any error it raises is theirs to fix, named here
        raise RecipeError(
            f"reward function {spec}: importing {path.name} raised {type(exc).__name__}: {exc}",
            fix=f"fix {path.name} so that `python {path}` runs without error",
        ) from None
    return module


def build(recipe: Any, examples: list[dict[str, Any]]) -> tuple[list[Callable], list[float]]:
    """The recipe's rewards as TRL's reward_funcs and reward_weights (GRPO's prompts in `examples`)."""
    references = [e.get("reference") for e in examples]
    funcs = [r.kind.scorer(r.value, references) for r in recipe.rewards]
    return funcs, [float(r.weight) for r in recipe.rewards]


def refusals(recipe: Any, examples: list[dict[str, Any]], where: list[str]) -> list[str]:
    """A RecipeError for rewards that cannot score this data (module docstring); else the plan's probe lines."""
    rows = [prompt_row(e) for e in examples]
    for k, p in enumerate(rows):
        if p is None:
            raise RecipeError(
                f"{where[k]} leaves nothing to prompt with for objective {recipe.objective} (a conversation that "
                "ends with its only assistant turn and has no turn before it)",
                fix="give each example a user turn before the answer, or a prompt row: " + formats.example("prompt"),
            )
    rows = prompt_rows(examples)
    columns = [k for k in rows[0] if k != "prompt"]
    clash = [c for c in columns if c in TRL_ARGUMENTS]
    if clash:
        raise RecipeError(
            f"the data has a column {clash[0]!r}, the name of an argument TRL's GRPOTrainer passes every reward "
            "function itself: the two would collide",
            fix=f"rename the column {clash[0]!r} in the data (data: {{path: ..., columns: {{...}}}} maps names)",
        )
    lines = []
    for i, spec in enumerate(recipe.rewards):
        key = f"reward[{i}]" if recipe.reward is not None and len(recipe.rewards) > 1 else "reward"
        lines.append(spec.kind.probe(spec.value, key, rows, where, recipe, columns, spec.scores == "form"))
    if all(spec.scores == "form" for spec in recipe.rewards):
        keys = [f"reward[{i}]" for i in range(len(recipe.rewards))] if len(recipe.rewards) > 1 else ["reward"]
        raise RecipeError(
            f"every reward of the recipe says scores: form ({', '.join(keys)}): nothing rewards a right answer, and "
            "GRPO would learn the form alone",
            fix="add a reward that checks the answer (reward: [{metric: auto}, ...] against the references, or a "
            "function of yours that compares with a column of the data), or remove scores: form from one that does",
        )
    return lines


def _signature_fits(fn: Callable, label: str, columns: list[str], row: dict[str, Any]) -> list[str]:
    """The data columns `fn` names among its parameters; a RecipeError where TRL's call cannot bind."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the call itself tells
        return []
    passed = set(TRL_ARGUMENTS) | set(columns)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
        and (p.name not in passed or p.kind is p.POSITIONAL_ONLY)
    ]
    shown = ", ".join(columns) if columns else "none"
    if missing and "completions" not in named and not var_kw:
        _factory_refusal(fn, label)
    if missing:
        name = missing[0]
        near = close_name(name, columns + list(TRL_ARGUMENTS))
        example = formats.example("prompt").split("}")[0].rstrip()
        raise RecipeError(
            f"{label} takes {name!r}, which the data has no column of: TRL's GRPOTrainer passes each column of the "
            f"data by its name, and this data's are {shown} (beside {', '.join(TRL_ARGUMENTS)})",
            fix=(f"rename the parameter {name!r} to {near!r}, or " if near else "")
            + f'add a "{name}" to each record of the data beside its prompt ({example}, "{name}": ...}}), or give '
            f"the parameter a default",
        )
    if not var_kw:
        extra = [k for k in list(TRL_ARGUMENTS) + columns if k not in named]
        if "completions" not in named and "completion_ids" not in named:
            _factory_refusal(fn, label)
        if extra:
            raise RecipeError(
                f"{label} takes no {', '.join(extra)}, which TRL's GRPOTrainer passes every reward function "
                f"({', '.join(TRL_ARGUMENTS)}, and each column of the data by name: {shown})",
                fix="add **kwargs to its parameters: def f(prompts, completions, **kwargs)",
            )
    return [n for n in named if n in columns]


def _factory_refusal(fn: Callable, label: str) -> None:
    """A RecipeError for a function that makes a reward function (TRL's get_cosine_scaled_reward, ...)."""
    try:
        params = inspect.signature(fn).parameters.values()
        product = fn() if all(p.default is not p.empty for p in params) else None
    except Exception:  # whatever it raises, it is no factory this can call without arguments
        product = None
    name = getattr(fn, "__name__", "make_reward")
    annotation = inspect.signature(fn).return_annotation
    if (
        not callable(product)
        and "Callable" not in str(annotation)
        and getattr(annotation, "__name__", "") != "Callable"
    ):
        return
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("ftrun_reward_"):
        source = f"from the file it is in (say rewards.py, then: from rewards import {name})"
    else:
        source = f"from {module.rsplit('.', 1)[0] if module.startswith('trl.rewards.') else module} import {name}"
    params = str(inspect.signature(fn))
    raise RecipeError(
        f"{label} makes a reward function rather than being one: {name}{params} returns the function TRL calls "
        "(it takes no completions itself)",
        fix=f"call it in a file of yours and name what it returns: in my_rewards.py, `{source}` then "
        f"`penalty = {name}()` (with the arguments you want), and give reward: {{function: my_rewards.py:penalty}}",
    )


def _probe_metric(
    metric: str, key: str, rows: list[dict], where: list[str], recipe: Any, columns: list[str], form: bool
) -> str:
    missing = next((k for k, p in enumerate(rows) if p["reference"] is None), None)
    if missing is not None:
        n = sum(p["reference"] is None for p in rows)
        raise RecipeError(
            f"{key} is the task metric{'' if metric == task_metrics.AUTO else ' ' + metric}, "
            f"which scores each answer against its prompt's reference, and {where[missing]} has none "
            f"({n} of {len(rows)} prompts without one)",
            fix="give those rows a reference (a prompt row's \"reference\", a chat example's last assistant "
            "turn), or reward them with a function of yours (reward: {function: FILE.py:NAME})",
        )
    metric = resolved_metric(metric, [r["reference"] for r in rows])
    label = f"{key} (the task metric {metric})"
    fix = (
        f"choose a metric that fits the references ({task_metrics.described()}; auto chooses from the references), "
        "or a reward function of yours"
    )
    return Probe(metric_reward(metric), label, "reference", rows, where, recipe.model).check(form, fix, fix)


def _probe_function(
    spec: str, key: str, rows: list[dict], where: list[str], recipe: Any, columns: list[str], form: bool
) -> str:
    fn = load_function(spec)
    label = f"{key} function {spec.rpartition('/')[2]}"
    read = _signature_fits(fn, label, columns, rows[0])
    named = [c for c in read if c != "reference" and any(r.get(c) is not None for r in rows)]
    # the column it reads is where it finds the right answer (Unsloth's `answer`, TRL's `solution`)
    right = named[0] if named else "reference" if any(r["reference"] is not None for r in rows) else None
    conversational = isinstance(rows[0]["prompt"], list)
    reads = "message lists, [{'role': 'assistant', 'content': ...}]" if conversational else "plain strings"
    if form:
        fix = alike = f"make it score answers of a different form differently (it reads the completions as {reads})"
    else:
        fix = (
            f"if it rewards the answers' form (a format, tags, length) rather than right answers, say so: scores: form "
            f"under {key} (and keep a reward that checks the answer beside it); if it should check the answer, make it "
            f"score the right one above a wrong one (check the column it compares with and how it reads the "
            f"completions: {reads})"
        )
        alike = (
            "make it score a good answer above a bad one (check the column it compares with and how it reads the "
            f"completions: {reads})"
        )
    return Probe(fn, label, right, rows, where, recipe.model).check(form, fix, alike)


def _function_form(spec: str) -> Optional[str]:
    target, _, name = spec.rpartition(":")
    if (target.endswith(".py") or (target and is_module_path(target))) and name.isidentifier():
        return None
    return (
        f"function {spec!r} is neither FILE.py:NAME nor MODULE:NAME; write it like rewards.py:score (the file "
        "relative to the recipe) or trl.rewards:think_format_reward (an installed module)"
    )


@dataclass(frozen=True)
class RewardKind:
    """One kind of reward: the recipe key that names it (reward: {KEY: VALUE}) and what ftrun does with it."""

    key: str
    annotation: Any  # what the recipe takes as its value
    example: str  # one value, for the recipe's errors
    scores: str  # what it scores, with what it needs from the data: the recipe's help
    reads_reference: bool  # it scores against each prompt's reference (the answers' length is sized from them)
    form: Callable[[str], Optional[str]]  # what is wrong with a value the annotation takes (None: nothing)
    name: Callable[[str], str]  # TRL's log name (rewards/<name>/mean)
    words: Callable[[str], str]  # how the plan names it
    scorer: Callable[[str, list], Callable]  # TRL's reward function, from the value and the prompts' references
    probe: Callable[..., str]  # the plan's probe on the data: a RecipeError, or the line saying what was probed


# The recipe's RewardSpec, `build`, `refusals` and the plan's words derive from it; tests/data/test_rewards.py walks it.
KINDS: dict[str, RewardKind] = {
    k.key: k
    for k in (
        RewardKind(
            "metric",
            Literal[(task_metrics.AUTO, *task_metrics.METRICS)],
            "exact",
            f"A task metric scored against each prompt's reference answer, which the data must give "
            f"({', '.join(task_metrics.METRICS)}; {task_metrics.AUTO}: the task evaluation's choice), with the task "
            "evaluation's own code.",
            True,
            lambda value: None,
            lambda value: f"metric_{value}",
            lambda value: f"the task metric {value}",
            lambda value, references: metric_reward(resolved_metric(value, references)),
            _probe_metric,
        ),
        RewardKind(
            "function",
            str,
            "rewards.py:score",
            "FILE.py:NAME (a file of yours, relative to the recipe) or MODULE:NAME (an installed module's: "
            "trl.rewards:think_format_reward), a function called as NAME(prompts, completions, **columns) that "
            "returns one float per completion (TRL's reward function; columns: the reference and every other column "
            "of the data, by name: each parameter it names must be one); probed on a few prompts of the data at plan "
            "time.",
            False,
            _function_form,
            lambda value: value.rpartition(":")[2],
            lambda value: value.rpartition("/")[2],
            lambda value, references: load_function(value),
            _probe_function,
        ),
    )
}
