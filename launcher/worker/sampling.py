"""GRPO's sampling in the worker: the prompts TRL's GRPOTrainer answers (every column but "prompt" goes to the rewards:
trl 1.16 grpo_trainer.py `_calculate_rewards`), its reward functions, and the time its generation takes.
"""

from __future__ import annotations

import time
from typing import Any

from launcher.data import rewards


def prompt_rows(examples: list) -> list[dict[str, Any]]:
    """Each example as GRPO's {"prompt", "reference", ...} row, with every other column of its record."""
    return rewards.prompt_rows(examples)


def trainer_arguments(recipe, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """GRPOTrainer's reward functions (their weights: trainer_config.py grpo_fields)."""
    funcs, _ = rewards.build(recipe, rows)
    return {"reward_funcs": funcs}


def timed(trainer_cls: type) -> type:
    """`trainer_cls` adding up the seconds of its `_generate` (trl 1.16: one generation batch) in `sampling_seconds`,
    and each call's longest answer, what a batch costs, in `sampling_longest` (launcher/run/smoke.py
    sampled_step_seconds)."""

    class TimedSampling(trainer_cls):
        sampling_seconds = 0.0
        sampling_longest: list[int] = []

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                out = super()._generate(prompts)
            finally:
                self.sampling_seconds += time.perf_counter() - start
            self.sampling_longest = [*self.sampling_longest, max((len(c) for c in out[1]), default=0)]
            return out

    TimedSampling.__name__ = TimedSampling.__qualname__ = f"TimedSampling{trainer_cls.__name__}"
    return TimedSampling


def described(rows: list[dict[str, Any]], recipe) -> str:
    """What the trainer takes, for the log (the SFT and preference runs say what TRL prepared)."""
    with_ref = sum(r["reference"] is not None for r in rows)
    g = recipe.grpo
    return (
        f"data as TRL takes it: {len(rows):,} prompts ({with_ref:,} with a reference), each answered "
        f"{g.num_generations} times (at most {g.max_completion_length} tokens); the loss is on the sampled answers"
    )
