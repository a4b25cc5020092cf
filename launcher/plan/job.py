"""The recipe's job as sizing sees it: sequence length, batch shape, examples, tokens, steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher import methods
from launcher.plan.models import Architecture
from launcher.plan.sizing import LOSS_MATERIALIZED, Workload


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
    sequences: int = 1  # rows per example in a micro-batch (a preference pair: 2); mean_tokens counts them all
    reference: str = ""  # DPO's reference (sizing.REFERENCES), "" without one
    objective: str = methods.DEFAULT_OBJECTIVE  # launcher/methods.py OBJECTIVES
    # GRPO: answers sampled per prompt and the longest in tokens; `examples` then counts answers, as TRL does
    answers_per_prompt: int = 1
    completion_tokens: int = 0
    # padding-free rows, and whether attention over one carries a dense L x L mask (attention.py dense_mask)
    padding_free: bool = False
    dense_mask: bool = False
    kl_forward: bool = False  # KTO: each example's KL sequence, forward only (methods.Objective.kl_forward)
    # a vision-language model: LoRA on the tower too, and the patches of the largest micro-batch
    lora_vision: bool = False
    vision_patches: int = 0

    @property
    def rows_hold_several_examples(self) -> bool:
        """A padding-free micro-batch of one example is one plain causal row (transformers finds no packed sequence
        in it: masking_utils.py find_packed_sequence_indices); packed rows hold several from one example up."""
        return self.padding_free and (self.packing or self.micro_batch * self.sequences > 1)

    def workload(
        self,
        engine: str,
        num_gpus: int,
        device: str,
        offload: bool = False,
        offload_optimizer: bool = False,
        offload_activations: bool = False,
    ) -> Workload:
        """`offload`: parameters in CPU RAM; `offload_optimizer`: DeepSpeed's; `offload_activations`: TRL's."""
        engine = "trl" if engine == "unsloth" and self.arch.vision_tower else engine
        return Workload(
            self.method,
            self.seq_len,
            self.micro_batch,
            self.gradient_checkpointing,
            self.lora_r,
            self.lora_targets,
            engine,
            num_gpus,
            device,
            offload,
            offload_optimizer,
            self.accumulation,
            offload_activations=offload_activations or self.offload_activations,
            sequences=self.sequences,
            reference=self.reference,
            loss=LOSS_MATERIALIZED if methods.OBJECTIVES[self.objective].whole_logits else "",
            generation_batch=self.micro_batch * self.accumulation if self.answers_per_prompt > 1 else 0,
            dense_mask=self.dense_mask and engine != "unsloth" and self.rows_hold_several_examples,
            kl_forward=self.kl_forward,
            lora_vision=self.lora_vision,
            vision_patches=self.vision_patches,
        )


def _job(
    recipe: Any, arch: Architecture, data_stats: Any, tokens: float | None, tokens_from: str = "--tokens"
) -> tuple[Job, list[str]]:
    notes = []
    max_length = recipe.max_length
    examples = None
    if data_stats is not None:
        examples = int(data_stats.examples)
        mean = float(data_stats.mean_tokens)
        longest = min(int(data_stats.max_tokens), max_length)
        per_epoch = float(data_stats.total_tokens)
        src = "tokenizer" if getattr(data_stats, "tokens_source", "tokenizer") == "tokenizer" else "characters"
        source = f"{examples:,} examples x {mean:.0f} tokens (from the {src}" + (
            ", about 4 characters per token: no tokenizer available)" if src == "characters" else ")"
        )
    else:
        longest = max_length
        mean = min(ASSUMED_MEAN_TOKENS, max_length)
        per_epoch = None
        source = tokens_from if tokens else "unknown"
    seq_len = max_length if recipe.packing else longest
    mean_seq = max_length if recipe.packing else mean  # packed sequences are full
    training = None  # with max_steps: filled in once the process count is known
    if recipe.max_steps is not None:  # max_steps overrides epochs (as in the HF Trainer)
        source += f"; max_steps={recipe.max_steps} decides the length"
    elif per_epoch is not None:
        training = per_epoch * recipe.epochs
        source += f" x {recipe.epochs:g} epoch{'' if recipe.epochs == 1 else 's'}"
    elif tokens:
        training = float(tokens)
    if tokens and data_stats is not None:
        notes.append("--tokens ignored: the data's own token count is used")
    if data_stats is None and tokens:
        notes.append(f"examples not known (data not read): steps assume {mean:.0f} tokens per example")
    objective = methods.OBJECTIVES[getattr(recipe, "objective", methods.DEFAULT_OBJECTIVE)]
    answers, completion = 1, 0
    if objective.generates:
        # each prompt trains as num_generations sequences (prompt + sampled answer)
        answers, completion = recipe.grpo.num_generations, recipe.grpo.max_completion_length
        training = training * answers if training is not None and not tokens_given(data_stats, tokens) else training
        if examples is not None:
            source = source.replace(
                f"{examples:,} examples x {mean:.0f} tokens",
                f"{examples:,} prompts x {answers} sampled answers x {mean:.0f} tokens (prompt + at most {completion}"
                " answer tokens)",
            )
            examples *= answers
        else:
            seq_len = min(max_length, seq_len + completion)
            mean_seq = min(max_length, mean_seq + completion)
    r, targets = recipe.lora.r, recipe.lora.target_modules
    parent = _parent_lora(recipe)
    if parent:  # init_from: the parent adapter's own rank and modules train on
        r, targets = parent
    job = Job(
        arch,
        recipe.method,
        seq_len,
        mean_seq,
        examples,
        training,
        source,
        recipe.micro_batch_size,
        recipe.gradient_accumulation_steps,
        recipe.epochs,
        recipe.max_steps,
        recipe.gradient_checkpointing,
        r,
        targets,
        recipe.packing,
        bool((getattr(recipe, "trainer", None) or {}).get("activation_offloading")),
        objective.sequences_per_example,
        reference_kind(recipe),
        objective.name,
        answers,
        completion,
        padding_free=bool(getattr(recipe, "padding_free", False)) or bool(recipe.packing),
        kl_forward=objective.kl_forward,
        lora_vision=bool(getattr(recipe.lora, "vision_tower", False)),
        vision_patches=recipe.micro_batch_size
        * int((getattr(data_stats, "images", None) or {}).get("patches_longest", 0)),
    )
    return job, notes


def tokens_given(data_stats: Any, tokens: float | None) -> bool:
    """The training tokens come from --tokens (the data not read): already every token that trains."""
    return data_stats is None and bool(tokens)


def reference_kind(recipe: Any) -> str:
    """How the reference comes (a key of sizing.REFERENCES), "" without one: DPO's, GRPO's with grpo.beta > 0."""
    objective = methods.OBJECTIVES[getattr(recipe, "objective", methods.DEFAULT_OBJECTIVE)]
    if objective.generates:
        if not recipe.grpo.beta:
            return ""
        if not methods.is_adapter(recipe.method):
            return "frozen copy"
        # trl 1.16 grpo_trainer.py __init__: a PEFT model with beta != 0 gets a "ref" adapter, a copy of its own
        return "parent copy"
    if not objective.reference_pass:
        return ""
    if recipe.preference.reference == "precomputed":
        return "precomputed"
    if not methods.is_adapter(recipe.method):
        return "frozen copy"
    return "parent copy" if getattr(recipe, "init_from", None) else "adapter off"


def _parent_lora(recipe: Any) -> tuple[int, Any] | None:
    """(r, target_modules) of the init_from adapter (its adapter_config.json), None without one."""
    if not getattr(recipe, "init_from", None):
        return None
    import json

    from launcher.recipe import parent_adapter

    config = json.loads((parent_adapter(recipe.init_from) / "adapter_config.json").read_text())
    targets = config.get("target_modules")
    # PEFT writes the modules it found ("model.layers.0.mlp.down_proj", ...): the sizer counts by their leaf names
    leaves = sorted({str(t).rsplit(".", 1)[-1] for t in targets}) if isinstance(targets, list) else targets
    return int(config.get("r", recipe.lora.r)), leaves


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
