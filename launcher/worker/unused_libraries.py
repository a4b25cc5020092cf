"""The optional libraries a run has installed but does not use, kept out of the worker's imports.

A worker's start is mostly imports (py-spy over a two-process DDP test, 2026-12-05: 78% of a training process's
samples before the first step), paid again by every rank, every smoke test and every restart. Three of them come from
libraries the run never calls:

- bitsandbytes: PEFT 0.21 imports it with itself wherever it is installed (peft/helpers.py, `import bitsandbytes as
  bnb` under try), and bitsandbytes 0.50 imports torch's inductor with it (backends/default/ops.py): 2.3 s of the
  10.2 s of CPU that peft, TRL's trainers and datasets take to import, measured 2026-12-05 on the CPU box. A run
  calls it only for a 4-bit base (qlora), an 8-bit optimizer (full-8bit, or one `trainer:` passes to TRL, as
  `optim: paged_adamw_8bit`: a run with a `trainer:` section keeps it), a checkpoint saved quantized, or on the
  Unsloth engine (which imports it itself); every other run imports the libraries without it (`keep_out`).
  With wandb below, a whole tiny LoRA run (`ftrun --foreground`, its CLI and plot included) fell from 13.2 to 11.0 s
  of CPU, three runs each.
- wandb: TRL 1.16 imports it with its trainers wherever it is installed (trainer/base_trainer.py, for the model
  card's link to a W&B run): 0.35 s of CPU per process; a run whose report_to does not name it never starts one.
- DeepSpeed: accelerate 1.15 utils/other.py extract_model_from_parallel, which TRL 1.16's trainers call at their
  start (through accelerate.utils.is_peft_model), imports DeepSpeed wherever it is installed only to test isinstance
  against DeepSpeedEngine: 1.1 s of CPU per process (MLflow comes with it, through DeepSpeed's autotuner), measured
  2026-12-05. A run on another engine never holds a DeepSpeedEngine (`skip_deepspeed_unwrapping`).
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
    """The libraries the base model's scoring before training never calls (launcher/worker/task_eval.py base phase):
    it loads the base in 16 bits whatever the method, the parent adapter merged into it, and reports to no tracker.
    bitsandbytes, which PEFT would import with itself (and whose CPU backend prints its missing `kernels` package on
    every `ftrun baseline`), only for a checkpoint saved quantized."""
    return tuple(n for n in ("bitsandbytes", "wandb") if n != "bitsandbytes" or not _saved_quantized(recipe.model))


def _saved_quantized(model: str) -> bool:
    """The checkpoint's config.json names a quantization (bitsandbytes' 4-bit of a `-bnb-4bit` repository, say),
    which transformers loads through that library; a config not found or not read here counts as quantized."""
    from launcher.worker.saving import _read_config

    config = _read_config(model)
    return config is None or "quantization_config" in config


def keep_out(names: Iterable[str]) -> None:
    """For the rest of this process, `import NAME` raises ImportError and importlib.util.find_spec(NAME) answers None
    (a None entry in sys.modules; Python 3.11 importlib/util.py), which is how PEFT 0.21 (`try: import
    bitsandbytes` in helpers.py; import_utils.is_bnb_available, lru-cached and first asked by get_peft_model),
    transformers 5.24 and accelerate 1.15 (`_is_package_available`) ask whether it is installed: the libraries come
    up as on a box without it, and stay so. Called before they are imported. The name stays in sys.modules, so TRL
    1.16's activation offloading (`"bitsandbytes" in sys.modules`: it empties the CUDA cache at each step) does on a
    GPU what it did while PEFT imported bitsandbytes into every run."""
    for name in names:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def skip_deepspeed_unwrapping(engine: str) -> None:
    """accelerate's check for a DeepSpeedEngine, answered without importing DeepSpeed for a run on another engine.
    That module's own name is the only one replaced; it is not read elsewhere."""
    if engine == "deepspeed":
        return
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False
