"""Notices the libraries print that say nothing about the run: kept out of the console and train.log.
Called before the training libraries' imports, so that a notice printed at import time is caught too.
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
    """The base model's scoring (launcher/worker/task_eval.py), narrowly: PEFT 0.21 PeftModel.__init__ reads
    `is_gradient_checkpointing`, which transformers 5.24 deprecated (modeling_utils.py); bitsandbytes' CPU notice."""
    import warnings

    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning, module="transformers"
    )
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Drop("from kernels-community"))


def quiet_known_notices() -> None:
    """FutureWarnings (for the code, not the user), bitsandbytes' CPU path asking for `kernels`, DeepSpeed's "Setting
    accelerator to CPU"; everything else these loggers say still shows."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)

    # bitsandbytes backends/cpu/ops.py logs through its module's logger, deepspeed accelerator/real_accelerator.py
    # through "DeepSpeed"
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Drop("from kernels-community"))
    logging.getLogger("DeepSpeed").addFilter(_Drop("Setting accelerator to CPU"))
