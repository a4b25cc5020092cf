"""GRPO's rewards: each of the recipe's `reward:` entries as the function TRL's GRPOTrainer calls, and the probe that
refuses one at plan time.

TRL calls a reward function as `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...)` and takes one float (or None) per completion (trl 1.16 grpo_trainer.py
`_calculate_rewards`: every dataset column but "prompt", "completion" and "completion_ids", one value per completion).
Here the columns are `reference` (what a metric reward scores against) and every other column of the data's records
(launcher/data/dataset.py keeps them for an objective that samples). A metric reward scores each sampled answer against
its prompt's reference with the task evaluation's own scorer (launcher/data/task_metrics.py), so what the run is
rewarded for is what its task score measures. A function is named FILE.py:NAME (a file of the user's, or one inside an
installed package, imported as its module) or MODULE:NAME (`trl.rewards:think_format_reward`).

Every reward is probed here, before any GPU time (`refusals`): called as TRL calls it on a few prompts of the data,
each answered with its right answer (the reference, or the column the function reads), a wrong one and an empty one,
each plain, boxed, after a <think> block and in <answer> tags. Refused: a function that cannot be loaded, takes a
column the data does not have, raises, returns the wrong number of values, something that is not a number, or a value
that is not finite (one infinite reward makes its group's advantages NaN in TRL); a reward that scores every probe
answer alike (it has nothing to teach); a metric that scores the right answer like a wrong one. What was probed is
said in the plan.

Pure (no torch): the plan and the worker both build them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.data import formats, task_examples, task_metrics
from launcher.errors import RecipeError
from launcher.errors import close_name

# What TRL's GRPOTrainer passes every reward function besides the data's columns (trl 1.16 grpo_trainer.py
# `_calculate_rewards`); a data column of one of these names would be passed twice.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# The prompts a function is probed on (the first ones with different right answers)
PROBE_PROMPTS = 4
# Each right and wrong answer is probed as these texts: as it is, and as reasoning models and TRL's and Unsloth's
# reward functions expect it (a boxed answer: trl.rewards accuracy_reward; a <think> block: think_format_reward; the
# <reasoning>/<answer> tags of Unsloth's GRPO notebooks)
DRESSINGS = (
    "{}",
    "The answer is {}.",
    "The answer is $\\boxed{{{}}}$.",
    "<think>\nLet me work it out.\n</think>\n{}",
    "<reasoning>\nLet me work it out.\n</reasoning>\n<answer>\n{}\n</answer>\n",
)


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


def prompt_row(example: dict[str, Any]) -> Optional[dict[str, Any]]:
    """GRPO's dataset row for an example: its prompt, its reference and the record's other columns, which TRL hands
    the rewards by name (None when nothing is left to prompt with)."""
    pr = prompt_and_reference(example)
    if pr is None:
        return None
    return {**pr, **formats.other_columns(example)}


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


def is_module_path(target: str) -> bool:
    """MODULE:NAME's MODULE (dotted names, `trl.rewards`), as against a FILE.py."""
    return not target.endswith(".py") and all(part.isidentifier() for part in target.split("."))


def load_function(spec: str) -> Callable:
    """The function FILE.py:NAME or MODULE:NAME names. FILE is absolute where it was found beside the recipe
    (launcher/recipe_loading.py resolves it); a file inside an installed package (site-packages/trl/rewards/x.py, or
    trl/rewards/x.py as the package lays it out) is imported as its module, so its relative imports work."""
    target, _, name = spec.rpartition(":")
    module_name = target if is_module_path(target) else _package_module(Path(target))
    if module_name is not None:
        module = _import_module(spec, module_name)
        where = f"module {module_name}"
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
    """The module name of a .py file inside an installed package (each folder down to it holds an __init__.py):
    an absolute path under site-packages, or a relative one as the package lays it out (trl/rewards/x.py). None for a
    file of the user's."""
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
    funcs = [
        load_function(r.function) if r.function else metric_reward(resolved_metric(r.metric, references))
        for r in recipe.rewards
    ]
    return funcs, [float(r.weight) for r in recipe.rewards]


def refusals(recipe: Any, examples: list[dict[str, Any]], where: list[str]) -> list[str]:
    """A RecipeError for rewards that cannot score this data (the module docstring lists them); otherwise what was
    probed, one line per reward, for the plan."""
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
        if spec.metric:
            missing = next((k for k, p in enumerate(rows) if p["reference"] is None), None)
            if missing is not None:
                n = sum(p["reference"] is None for p in rows)
                raise RecipeError(
                    f"{key} is the task metric{'' if spec.metric == task_metrics.AUTO else ' ' + spec.metric}, "
                    f"which scores each answer against its prompt's reference, and {where[missing]} has none "
                    f"({n} of {len(rows)} prompts without one)",
                    fix="give those rows a reference (a prompt row's \"reference\", a chat example's last assistant "
                    "turn), or reward them with a function of yours (reward: {function: FILE.py:NAME})",
                )
            metric = resolved_metric(spec.metric, [r["reference"] for r in rows])
            label = f"{key} (the task metric {metric})"
            probe = Probe(metric_reward(metric), label, "reference", rows, where, recipe.model)
            lines.append(probe.check_metric(metric))
        else:
            fn = load_function(spec.function)
            label = f"{key} function {spec.function.rpartition('/')[2]}"
            read = _signature_fits(fn, label, columns, rows[0])
            right = "reference" if any(r["reference"] is not None for r in rows) else None
            named = [c for c in read if c != "reference" and any(r.get(c) is not None for r in rows)]
            if named:  # the column it reads is where it finds the right answer (Unsloth's `answer`, TRL's `solution`)
                right = named[0]
            lines.append(Probe(fn, label, right, rows, where, recipe.model).check_function())
    return lines


def _signature_fits(fn: Callable, label: str, columns: list[str], row: dict[str, Any]) -> list[str]:
    """The data columns `fn` names among its parameters; a RecipeError where TRL's call cannot bind: a parameter no
    column fills, or an argument TRL passes that it takes no parameter (nor **kwargs) for."""
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
    """A RecipeError for a function that makes a reward function rather than being one (TRL's
    get_repetition_penalty_reward, get_cosine_scaled_reward): it takes no completions, and its result is callable."""
    try:
        params = inspect.signature(fn).parameters.values()
        product = fn() if all(p.default is not p.empty for p in params) else None
    except Exception:  # whatever it raises, it is no factory this can call without arguments
        product = None
    name = getattr(fn, "__name__", "make_reward")
    returns = getattr(inspect.signature(fn).return_annotation, "__name__", "")
    if (
        not callable(product)
        and "Callable" not in str(inspect.signature(fn).return_annotation)
        and returns != "Callable"
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


@dataclass
class Probe:
    """One reward called as TRL calls it on the first prompts of the data, each with its right answer (the column
    `right` holds it; None: no right answer is known), a wrong one and an empty one, in each of DRESSINGS."""

    fn: Callable
    label: str
    right: Optional[str]
    rows: list[dict[str, Any]]
    where: list[str]
    model: str

    def __post_init__(self) -> None:
        known = [k for k, r in enumerate(self.rows) if self.right and r.get(self.right) is not None]
        picked, seen = [], set()
        for k in known:  # different right answers first: a wrong answer is easy to tell then
            if str(self.rows[k][self.right]) not in seen:
                picked.append(k)
                seen.add(str(self.rows[k][self.right]))
        picked += [k for k in known if k not in picked]
        self.picked = (picked or list(range(len(self.rows))))[:PROBE_PROMPTS]
        self.rights = {k: str(self.rows[k][self.right]) for k in self.picked if k in known}
        others = list(
            dict.fromkeys(str(r[self.right]) for r in self.rows if self.right and r.get(self.right) is not None)
        )
        self.answers: list[tuple[int, str, str]] = []  # (row, what it is, text)
        for k in self.picked:
            right = self.rights.get(k)
            if right is None:
                self.answers += [(k, "an answer", d.format("4")) for d in DRESSINGS]
            else:
                wrong = _wrong(right, others)
                self.answers += [(k, "right", d.format(right)) for d in DRESSINGS]
                self.answers += [(k, "wrong", d.format(wrong)) for d in DRESSINGS]
            self.answers.append((k, "empty", ""))

    def call(self, subset: Optional[list[int]] = None) -> list[Any]:
        """The reward's values for the answers (their indices in `subset`), as TRL's GRPOTrainer asks them."""
        chosen = [self.answers[j] for j in (subset if subset is not None else range(len(self.answers)))]
        prompts = [self.rows[k]["prompt"] for k, _, _ in chosen]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] if conversational else t for _, _, t in chosen]
        columns = {c: [self.rows[k][c] for k, _, _ in chosen] for c in self.rows[0] if c != "prompt"}
        return self.fn(
            prompts=prompts,
            completions=completions,
            completion_ids=[_token_ids(self.model, t) for _, _, t in chosen],
            trainer_state=None,
            log_extra=lambda *a, **k: None,
            log_metric=lambda *a, **k: None,
            **columns,
        )

    def values(self) -> list[Optional[float]]:
        """Each answer's value; a RecipeError where the reward raises or returns what TRL cannot use."""
        n = len(self.answers)
        asked = f"{len(self.picked)} prompt{'s' if len(self.picked) > 1 else ''} of the data with {n} answers"
        try:
            values = self.call()
        except Exception as exc:  # the user's code: whatever it raises is refused with its words
            raise self._raised(exc, asked) from None
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array (TRL takes it too)
            values = values.tolist()
        bad = None
        if not isinstance(values, (list, tuple)):
            bad = f"returned {type(values).__name__} {str(values)[:60]}, not a list"
        elif len(values) != n:
            bad = f"returned {len(values)} values for {n} completions"
        else:
            wrong = [v for v in values if not _is_number(v)]
            if wrong:
                bad = f"returned {wrong[0]!r} ({type(wrong[0]).__name__}), not a number"
        if bad:
            raise RecipeError(
                f"{self.label} {bad} (called on {asked}, as TRL's GRPOTrainer calls it)",
                fix="return a list with one float per completion (None for one that cannot be scored)",
            )
        values = [None if v is None else float(v) for v in values]
        for (k, what, text), v in zip(self.answers, values):
            if v is not None and not math.isfinite(v):
                raise RecipeError(
                    f"{self.label} returned {v} for {_answer_words(what, text)} to the prompt of {self.where[k]}: "
                    "TRL's GRPOTrainer subtracts each group's mean reward, and one infinite or NaN reward makes every "
                    "advantage of its group NaN",
                    fix="return a finite number for every answer (clamp it, or return 0.0 for an empty answer; None "
                    "for one that cannot be scored)",
                )
        return values

    def _raised(self, exc: Exception, asked: str) -> RecipeError:
        """The refusal for a reward that raised, naming the answer that makes it raise where one alone does."""
        culprit = None
        for j in range(len(self.answers)):
            try:
                self.call([j])
            except Exception:  # this answer alone makes it raise
                culprit = j
                break
        k, what, text = self.answers[culprit] if culprit is not None else self.answers[0]
        on = (
            f"for {_answer_words(what, text)} to the prompt of {self.where[k]}"
            if culprit is not None
            else f"when called on {asked}"
        )
        message = f"{self.label} raised {type(exc).__name__}: {exc} {on}, as TRL's GRPOTrainer calls it"
        if isinstance(exc, ImportError):
            return RecipeError(
                message,
                fix="install what it names into ftrun's environment, here and on the box that trains (TRL's "
                "accuracy_reward: pip install math-verify)",
            )
        if not isinstance(self.rows[k]["prompt"], list):
            as_chat = [[{"role": "assistant", "content": t}] for _, _, t in self.answers[:1]]
            try:
                self.fn(
                    prompts=[[{"role": "user", "content": "?"}]],
                    completions=as_chat,
                    completion_ids=[[]],
                    trainer_state=None,
                    log_extra=lambda *a, **k: None,
                    log_metric=lambda *a, **k: None,
                    **{c: [self.rows[k][c]] for c in self.rows[0] if c != "prompt"},
                )
            except Exception:  # it fails on message lists too: the generic fix below
                pass
            else:
                return RecipeError(
                    message + '; it reads each completion as a list of messages (completion[0]["content"]), which '
                    "TRL passes only for prompts that are message lists, and this data's prompts are plain text",
                    fix='give the prompts as message lists ({"prompt": [{"role": "user", "content": "..."}]}), or '
                    "a reward that reads plain-text completions",
                )
        return RecipeError(
            message, fix="fix the function so that it returns a number (or None) for every answer, an empty one too"
        )

    def _scores(self, values: list[Optional[float]]) -> dict[int, dict[str, list[Optional[float]]]]:
        out: dict[int, dict[str, list[Optional[float]]]] = {}
        for (k, what, _), v in zip(self.answers, values):
            out.setdefault(k, {}).setdefault(what, []).append(v)
        return out

    def _tells(self, values: list[Optional[float]]) -> bool:
        """Some right answer scores differently from the wrong one in the same dressing."""
        return any(
            r is not None and w is not None and r != w
            for s in self._scores(values).values()
            for r, w in zip(s.get("right", []), s.get("wrong", []))
        )

    def _what(self) -> str:
        n, places = len(self.picked), _places([self.where[k] for k in self.picked])
        return (
            f"{n} prompt{'s' if n > 1 else ''} of the data ({places}), each with "
            + ("its right answer, a wrong one and an empty one" if self.rights else "an answer and an empty one")
            + ", plain, boxed, after a <think> block and in <answer> tags"
        )

    def check_metric(self, metric: str) -> str:
        values = self.values()
        if not self._tells(values):
            k = self.picked[0]
            right = self.rights[k]
            wrong = _wrong(right, list(self.rights.values()))
            got = next(v for (j, what, _), v in zip(self.answers, values) if j == k and what == "right")
            raise RecipeError(
                f"{self.label} scores the reference answer like a wrong one on every probe: on {self._what()}, it "
                f"gave {right!r} (the reference of {self.where[k]}) and {wrong!r} the same {got}: every group's "
                "answers would score alike, and GRPO learns nothing from a group without differences",
                fix=f"choose a metric that fits the references ({task_metrics.described()}; auto chooses from the "
                "references), or a reward function of yours",
            )
        return f"{self.label}: tells the reference from a wrong answer (on {self._what()})"

    def check_function(self) -> str:
        values = self.values()
        numbers_ = {v for v in values if v is not None}
        if len(numbers_) <= 1:
            said = f"{next(iter(numbers_))}" if numbers_ else "None (TRL leaves the answer out)"
            raise RecipeError(
                f"{self.label} returned {said} for every answer on {self._what()}: a reward that scores every answer "
                "alike gives GRPO nothing to learn from (its advantages are all 0)",
                fix="make it score a good answer above a bad one (check the column it compares with and how it "
                "reads the completions: "
                + (
                    "message lists, [{'role': 'assistant', 'content': ...}]"
                    if isinstance(self.rows[0]["prompt"], list)
                    else "plain strings"
                )
                + ")",
            )
        if not self.rights:
            return (
                f"{self.label}: runs and returns finite numbers that vary on {self._what()}; whether it tells a right "
                "answer from a wrong one was not probed: the data has no reference and it reads no column of it"
            )
        source = "reference" if self.right == "reference" else f"column {self.right!r}"
        if self._tells(values):
            return f"{self.label}: tells the right answer (the {source}) from a wrong one (on {self._what()})"
        return (
            f"{self.label}: scores the right answer (the {source}) like a wrong one on {self._what()}, but not "
            "every answer alike: it shapes the answers (their form or length), it does not check them"
        )


def _wrong(right: str, others: list[str]) -> str:
    """A wrong answer for `right`: the next number for a number, another prompt's different right answer, or a text
    that answers nothing."""
    try:
        number = float(right.strip().replace(",", ""))
    except ValueError:
        number = None
    if number is not None and math.isfinite(number):
        return str(int(number) + 1) if number.is_integer() else f"{number + 1:g}"
    different = [o for o in others if task_metrics.normalise(o) != task_metrics.normalise(right)]
    return different[0] if different else "I do not know."


def _places(where: list[str]) -> str:
    """ "d.jsonl lines 1, 2, 3" for ["d.jsonl line 1", "d.jsonl line 2", "d.jsonl line 3"]; otherwise each in full."""
    heads = {w.rpartition(" line ")[0] for w in where}
    if len(heads) == 1 and all(" line " in w for w in where) and len(where) > 1:
        return f"{heads.pop()} lines " + ", ".join(w.rpartition(" line ")[2] for w in where)
    return ", ".join(where)


def _answer_words(what: str, text: str) -> str:
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    if what == "empty":
        return "the empty answer ''"
    return f"the {what} answer {shown}" if what in ("right", "wrong") else f"the answer {shown}"


_ENCODERS: dict[str, Any] = {}


def _token_ids(model: str, text: str) -> list[int]:
    """The answer's token ids as TRL passes them (completion_ids): the model's own tokenizer where this machine has
    it, else one id per character (the probe needs ids of the answer's length, not the model's)."""
    if model not in _ENCODERS:
        from launcher.data.tokenizer import read_tokenizer, tokenizer_dir

        folder, _ = tokenizer_dir(model)
        read = read_tokenizer(folder) if folder is not None else None
        _ENCODERS[model] = read.tokenizer if read is not None else None
    encoder = _ENCODERS[model]
    if encoder is None:
        return [ord(c) for c in text]
    return list(encoder.encode(text, add_special_tokens=False).ids)


def _is_number(value: Any) -> bool:
    """A float TRL can put in its reward tensor: a real number (numpy's too) or None, not a bool or a string."""
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool))
