"""The recipe's job as sizing sees it: sequence length, batch shape, examples, tokens, steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.plan.models import Architecture
from launcher.plan.sizing import Workload


# Without data statistics, an example is assumed to be this long (capped at max_length).
ASSUMED_MEAN_TOKENS = 500


@dataclass(frozen=True)
class Job:
    """The recipe's numbers that sizing needs, resolved once (with where each came from)."""

    arch: Architecture
    method: str
    seq_len: int  # longest micro-batch sequence: min(max_length, longest example) unless packing
    mean_tokens: float  # per example (or per packed sequence)
    examples: int | None
    training_tokens: float | None
    tokens_source: str
    micro_batch: int
    accumulation: int
    epochs: float
    max_steps: int | None
    gradient_checkpointing: bool
    lora_r: int
    lora_targets: Any
    packing: bool
    offload_activations: bool = False  # the recipe's trainer: activation_offloading

    def workload(self, engine: str, num_gpus: int, device: str, offload: bool = False,
                 offload_optimizer: bool = False, offload_activations: bool = False) -> Workload:
        """`offload`: parameters in CPU RAM (FSDP's fsdp_offload_params, DeepSpeed's offload_param);
        `offload_optimizer`: DeepSpeed's optimizer offload (docs/sizing.md, "CPU offload"); `offload_activations`:
        TRL's activation_offloading (also when the recipe's trainer: section sets it)."""
        return Workload(self.method, self.seq_len, self.micro_batch, self.gradient_checkpointing,
                        self.lora_r, self.lora_targets, engine, num_gpus, device, offload, offload_optimizer,
                        self.accumulation,
                        offload_activations=offload_activations or self.offload_activations)


def _job(recipe: Any, arch: Architecture, data_stats: Any, tokens: float | None,
         tokens_from: str = "--tokens") -> tuple[Job, list[str]]:
    notes = []
    max_length = recipe.max_length
    examples = None
    if data_stats is not None:
        examples = int(data_stats.examples)
        mean = float(data_stats.mean_tokens)
        longest = min(int(data_stats.max_tokens), max_length)
        per_epoch = float(data_stats.total_tokens)
        src = "tokenizer" if getattr(data_stats, "tokens_source", "tokenizer") == "tokenizer" else "characters"
        source = f"{examples:,} examples x {mean:.0f} tokens (from the {src}" + \
                 (", about 4 characters per token: no tokenizer available)" if src == "characters" else ")")
    else:
        longest = max_length
        mean = min(ASSUMED_MEAN_TOKENS, max_length)
        per_epoch = None
        source = tokens_from if tokens else "unknown"
    seq_len = max_length if recipe.packing else longest
    if recipe.packing:
        mean_seq = max_length  # packed sequences are full
    else:
        mean_seq = mean
    training = None
    if recipe.max_steps is not None:
        # max_steps overrides epochs (as in the HF Trainer); tokens follow from the batch shape.
        training = None  # filled in once the process count is known
        source += f"; max_steps={recipe.max_steps} decides the length"
    elif per_epoch is not None:
        training = per_epoch * recipe.epochs
        source += f" x {recipe.epochs:g} epochs"
    elif tokens:
        training = float(tokens)
    if tokens and data_stats is not None:
        notes.append("--tokens ignored: the data's own token count is used")
    if data_stats is None and tokens:
        notes.append(f"examples not known (data not read): steps assume {mean:.0f} tokens per example")
    job = Job(arch, recipe.method, seq_len, mean_seq, examples, training, source, recipe.micro_batch_size,
              recipe.gradient_accumulation_steps, recipe.epochs, recipe.max_steps, recipe.gradient_checkpointing,
              recipe.lora.r, recipe.lora.target_modules, recipe.packing,
              bool((getattr(recipe, "trainer", None) or {}).get("activation_offloading")))
    return job, notes


def _steps_and_tokens(job: Job, processes: int) -> tuple[int, float | None]:
    per_step_examples = job.micro_batch * job.accumulation * processes
    if job.max_steps is not None:
        steps = job.max_steps
        return steps, steps * per_step_examples * job.mean_tokens
    if job.examples is not None:
        steps = math.ceil(job.examples / per_step_examples) * job.epochs
        return max(1, math.ceil(steps)), job.training_tokens
    if job.training_tokens:
        return max(1, math.ceil(job.training_tokens / (per_step_examples * job.mean_tokens))), job.training_tokens
    return 0, None
