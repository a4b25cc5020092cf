"""The recipe's pass-through TRL settings (`trainer:`, preference.loss_type) checked against the installed TRL."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Optional

from launcher import methods
from launcher.errors import RecipeError, close_name
from launcher.recipe import Recipe


def check_trainer_fields(recipe: Recipe) -> None:
    """Check `trainer:` against the installed TRL's configuration of the recipe's objective (SFTConfig, DPOConfig,
    ORPOConfig), and preference.loss_type against the losses the installed DPOTrainer computes (imports trl: call
    only where we train)."""
    objective = recipe.objective_row
    if "loss_type" in objective.settings:
        losses = dpo_loss_types()
        if losses and recipe.preference.loss_type not in losses:
            near = close_name(recipe.preference.loss_type, losses)
            raise RecipeError(
                f"preference.loss_type {recipe.preference.loss_type!r} is not a loss the installed trl's DPOTrainer "
                "computes" + (f" (did you mean '{near}'?)" if near else ""),
                fix=f"use one of: {', '.join(losses)} (sigmoid is the DPO paper's loss).",
            )
    strategy = recipe.trainer.get("train_sampling_strategy", "sequential")
    if objective.kl_forward and strategy != "sequential" and recipe.trainer.get("loss_type") != "apo_zero_unpaired":
        # trl 1.16 kto_trainer.py KTOTrainer.__init__ raises it after the model loaded: refused here, before
        raise RecipeError(
            f"trainer.train_sampling_strategy {strategy!r}: objective {recipe.objective}'s KL term pairs each prompt "
            f"with another answer of its micro-batch when the data is prepared, so trl's {objective.trainer} reads "
            "the data in order (sequential) and refuses any other order",
            fix="remove trainer.train_sampling_strategy (ftrun shuffles the examples once with the recipe's seed "
            "before they are read in order)",
        )
    if not recipe.trainer:
        return
    import dataclasses

    Config = methods.trl_class(recipe.objective, "config")
    name = objective.config
    fields = {f.name: f for f in dataclasses.fields(Config)}
    bad = [k for k in recipe.trainer if k not in fields]
    if bad:
        lines = []
        for k in bad:
            near = close_name(k, sorted(fields))
            lines.append(
                f"- trainer.{k} is not a field of TRL's {name}" + (f" (did you mean '{near}'?)" if near else "")
            )
        raise RecipeError(
            "the recipe's trainer: section has unknown fields:\n" + "\n".join(lines),
            fix=f"use {name} field names of the installed trl (objective {recipe.objective}; "
            f"python -c 'import {objective.module}; help({objective.module}.{name})').",
        )
    hints = typing.get_type_hints(Config)
    wrong = [line for k, v in recipe.trainer.items() if (line := _trainer_value_problem(k, v, hints.get(k), fields[k]))]
    if wrong:
        raise RecipeError(
            "the recipe's trainer: section has values the installed trl/transformers do not take:\n" + "\n".join(wrong),
            fix="use one of the values named (they come from the installed libraries' own choices), or leave the key "
            "out for its default.",
        )


def dpo_loss_types() -> list[str]:
    """The loss names the installed DPOTrainer computes, read from its own loss function (trl 1.16 dpo_trainer.py
    `_compute_loss` branches on `loss_type == "..."`; its DPOConfig lists them only in a help text, and an unknown
    one fails at the first step, after the model loaded). The module's file is read, not imported: importing it
    takes about 18 s on 2 cores, before any check could answer."""
    import importlib.util
    import re

    objective = methods.OBJECTIVES["dpo"]
    spec = importlib.util.find_spec(f"{objective.module}.trainer.dpo_trainer")
    if spec is None or not spec.origin:
        return []
    source = Path(spec.origin).read_text()
    return sorted(set(re.findall(r'loss_type == "([a-z_0-9]+)"', source)))


def _trainer_value_problem(key: str, value: Any, hint: Any, field: Any) -> Optional[str]:
    """Why `value` does not fit the SFTConfig field `key`, from the field's own declaration: its enum types
    (transformers' SchedulerType, OptimizerNames, IntervalStrategy, ...: their values are the names
    TrainingArguments.__post_init__ accepts), its `choices` metadata (TRL's loss_type, packing_strategy, ...), or its
    plain type (bool, int, float). None when it fits or the field takes a shape this does not check."""
    import enum

    options = [a for a in typing.get_args(hint)] if typing.get_args(hint) else [hint]
    if value is None:
        return None if type(None) in options else f"- trainer.{key}: null, which it does not take"
    choices = list(field.metadata.get("choices") or [])
    enums = [o for o in options if isinstance(o, type) and issubclass(o, enum.Enum)]
    choices += [m.value for e in enums for m in e]
    if choices and isinstance(value, str):
        if value in choices:
            return None
        near = close_name(value, [str(c) for c in choices])
        return (
            f"- trainer.{key}: {value!r} is not one of "
            + ", ".join(str(c) for c in choices)
            + (f" (did you mean '{near}'?)" if near else "")
        )
    plain = [o for o in options if o is not type(None)]  # Optional[float] is a float where a value is given
    if plain == [bool] and not isinstance(value, bool):
        return f"- trainer.{key}: {value!r} is not true or false"
    if plain == [int] and (isinstance(value, bool) or not isinstance(value, int)):
        return f"- trainer.{key}: {value!r} is not a whole number"
    if plain == [float] and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"- trainer.{key}: {value!r} is not a number"
    return None
