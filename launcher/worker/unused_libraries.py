"""The optional libraries a run has installed but does not use, kept out of the worker's imports, which every rank,
smoke test and restart pays for (docs/BENCHMARKS.md, "The second cut"; docs/engines.md, "On a CPU box"):
- bitsandbytes: PEFT 0.21 imports it wherever installed (peft/helpers.py), and it imports torch's inductor
  (bitsandbytes 0.50 backends/default/ops.py); used only by a 4-bit base, an 8-bit optimizer (also one `trainer:`
  may name), a checkpoint saved quantized, or the Unsloth engine.
- wandb: TRL 1.16 imports it with its trainers (trainer/base_trainer.py); used only where report_to names it.
- DeepSpeed: accelerate 1.15 utils/other.py extract_model_from_parallel imports it only for an isinstance check
  (`skip_deepspeed_unwrapping`).
"""

from __future__ import annotations

import sys
from typing import Iterable


def unused(recipe, engine: str) -> tuple[str, ...]:
    """The libraries (import names) a run of `recipe` on `engine` never calls."""
    from launcher.methods import METHODS

    names = []
    if (
        engine != "unsloth"
        and not METHODS[recipe.method].bitsandbytes
        and not recipe.trainer  # TRL settings passed through may name one of its optimizers (optim: paged_adamw_8bit)
        and not _saved_quantized(recipe.model)
    ):
        names.append("bitsandbytes")
    if "wandb" not in recipe.report_to:
        names.append("wandb")
    return tuple(names)


def unused_when_scoring(recipe) -> tuple[str, ...]:
    """The libraries the base model's scoring (task_eval.py base phase: 16-bit, no tracker) never calls: bitsandbytes
    unless the checkpoint is saved quantized, and wandb."""
    return tuple(n for n in ("bitsandbytes", "wandb") if n != "bitsandbytes" or not _saved_quantized(recipe.model))


def _saved_quantized(model: str) -> bool:
    """The checkpoint's config.json names a quantization (a `-bnb-4bit` repository); a config not read counts as one."""
    from launcher.worker.saving import _read_config

    config = _read_config(model)
    return config is None or "quantization_config" in config


def keep_out(names: Iterable[str]) -> None:
    """For the rest of this process `import NAME` raises ImportError and find_spec(NAME) answers None (a None entry in
    sys.modules; Python 3.11 importlib/util.py), as PEFT 0.21, transformers 5.24 and accelerate 1.15 ask; called
    before they are imported. The name stays in sys.modules, so TRL 1.16's activation offloading (`"bitsandbytes"
    in sys.modules`) still empties the CUDA cache at each step."""
    for name in names:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def skip_deepspeed_unwrapping(engine: str) -> None:
    """accelerate's check for a DeepSpeedEngine, answered without importing DeepSpeed, off the deepspeed engine."""
    if engine == "deepspeed":
        return
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False
