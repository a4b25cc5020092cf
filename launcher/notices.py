"""Notices the libraries print that say nothing about the run: kept out of the console and train.log.

Called at the top of the processes that import the training libraries (launcher/worker/train.py,
launcher/deliver/export.py; the base model's scoring, launcher/worker/task_eval.py, narrowly), before those imports,
so that a notice printed at import time is caught too.
"""

from __future__ import annotations

import logging


class _Drop(logging.Filter):
    def __init__(self, *phrases: str):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p in record.getMessage() for p in self.phrases)


def quiet_scoring_notices() -> None:
    """The base model's scoring before training (launcher/worker/task_eval.py, `ftrun baseline`), narrowly: PEFT 0.21
    reads `model.is_gradient_checkpointing` in PeftModel.__init__ (peft_model.py), which transformers 5.24 deprecated
    for is_activation_checkpointing (modeling_utils.py: a FutureWarning on every load of a parent adapter), and
    bitsandbytes' CPU notice where a quantized checkpoint needs it. Any other warning still shows."""
    import warnings

    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning, module="transformers"
    )
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Drop("from kernels-community"))


def quiet_known_notices() -> None:
    """Deprecation notices (FutureWarning) are for the code, not the user; two notices say nothing about the run:
    bitsandbytes' CPU path asking for the optional `kernels` package on every LoRA/QLoRA import, and DeepSpeed's
    "Setting accelerator to CPU" on any run that imports it (accelerate and TRL do, whatever the engine).
    Everything else these loggers say still shows."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)

    # Logger-level filters: bitsandbytes logs through its module's logger (backends/cpu/ops.py), DeepSpeed through
    # the "DeepSpeed" logger (accelerator/real_accelerator.py uses deepspeed.utils.logger)
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Drop("from kernels-community"))
    logging.getLogger("DeepSpeed").addFilter(_Drop("Setting accelerator to CPU"))
