"""The Trainer's configuration: the objective's TRL configuration (SFTConfig, DPOConfig, ORPOConfig: launcher/methods.py
OBJECTIVES) that a recipe, its plan and the mode make, with its data collator."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from launcher.methods import METHODS, trl_class
from launcher.store.rundir import RunDir
from launcher.worker.process import _rank


def trainer_config(
    recipe,
    run: RunDir,
    mode: str,
    device: str,
    dtype,
    max_steps: Optional[int],
    output_dir: Path,
    engine_fields: Optional[dict] = None,
    eval_fields: Optional[dict] = None,
):
    import torch

    Config = trl_class(recipe.objective, "config")
    objective = recipe.objective_row

    fields: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_length=recipe.max_length,
        per_device_train_batch_size=recipe.micro_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        num_train_epochs=recipe.epochs if mode == "full" else 1,
        max_steps=max_steps if max_steps else -1,
        learning_rate=recipe.learning_rate,
        packing=recipe.packing,
        assistant_only_loss=bool(recipe.assistant_only_loss),  # recipe.yaml holds it resolved (run/prepare.py)
        seed=recipe.seed,
        data_seed=recipe.seed,
        logging_steps=recipe.logging_steps if mode == "full" else 1,
        save_strategy="no",  # ftrun saves by wall clock (callback), not every N steps
        save_only_model=False,
        **_trackers(run, recipe, mode),
        include_num_input_tokens_seen="non_padding",
        use_cpu=device == "cpu",
        bf16=device == "cuda" and dtype == torch.bfloat16,
        fp16=device == "cuda" and dtype == torch.float16,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    import dataclasses

    known = {f.name for f in dataclasses.fields(Config)}
    # transformers 5.2x renamed gradient_checkpointing (the old name warns); Unsloth's pinned release knows only it
    ac = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    fields[ac] = recipe.gradient_checkpointing
    fields[f"{ac}_kwargs"] = {"use_reentrant": False}
    if mode == "smoke":
        # the smoke sample is longest batch first: an out-of-memory shows in step 1. GRPO's sampler reads
        # shuffle_dataset instead (trl 1.16 grpo_trainer.py _get_train_sampler); fields Config lacks are dropped below
        fields.update(train_sampling_strategy="sequential", shuffle_dataset=False)
    if METHODS[recipe.method].eight_bit_optimizer:
        fields["optim"] = "adamw_bnb_8bit"
    # otherwise TRL's default (fused AdamW), as a plain TRL script gets
    for key, value in (engine_fields or {}).items():
        fields[ac if key == "activation_checkpointing" else key] = value
    for key in objective.refuses:  # SFTConfig's switches an objective's configuration lacks (methods.Objective)
        fields.pop(key, None)
    if objective.preference:
        passed = ("beta", "loss_type", "desirable_weight", "undesirable_weight")  # the DPOConfig/KTOConfig fields
        fields.update({k: getattr(recipe.preference, k) for k in objective.settings if k in passed})
        if "reference" in objective.settings:
            # trl 1.16 dpo_trainer.py: computed in __init__, before a resume loads the checkpoint: initial weights
            fields["precompute_ref_log_probs"] = recipe.preference.reference == "precomputed"
    if objective.generates:
        fields.update(grpo_fields(recipe))
        # GRPOTrainer counts tokens itself (grpo_trainer.py _generate); the Trainer's count would warn at every step
        fields["include_num_input_tokens_seen"] = "no"
    # ftrun's defaults this configuration lacks go (GRPOConfig: max_length); trainer: fields were checked at plan time
    fields = {k: v for k, v in fields.items() if k in known}
    fields.update(eval_fields or {})  # launcher/data/split.py; trainer: may still set the eval batch and the like
    fields["ddp_timeout"] = process_group_seconds(recipe, run, mode)
    fields.update(recipe.trainer)
    if device == "cpu" and fields.pop("activation_offloading", False):
        # trl 1.16's OffloadActivations reads torch.accelerator.current_accelerator().type, None on a CPU
        print(
            "[ftrun worker] trainer.activation_offloading ignored on the CPU: activations already live in CPU RAM",
            file=sys.stderr,
            flush=True,
        )
    return Config(**fields)


def grpo_fields(recipe) -> dict[str, Any]:
    """GRPOConfig's fields from the recipe's grpo: section and rewards (trl 1.16 grpo_config.py)."""
    s = recipe.grpo
    fields: dict[str, Any] = {
        "num_generations": s.num_generations,
        "max_completion_length": s.max_completion_length,
        "beta": s.beta,
        "temperature": s.temperature,
        "reward_weights": [float(r.weight) for r in recipe.rewards],
        "use_vllm": s.generation == "vllm",
        # TRL's default, stated: the data's columns reach the rewards (launcher/data/rewards.py)
        "remove_unused_columns": False,
    }
    if s.generation == "vllm":
        fields["vllm_mode"] = "colocate"  # vLLM in the training process: no second server to start and watch
    return fields


def padding_free_collator(recipe, tokenizer):
    """The micro-batch as one row without padding (position_ids mark the examples), or None for TRL's default (padded
    rows, BFD packing, a processor's vision collator). TRL's `padding_free=True` refuses a max_length without
    packing; its collator passed here keeps the truncation. The loss is the same as padded."""
    if not recipe.padding_free or recipe.packing or not hasattr(tokenizer, "pad_token_id"):
        return None
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)


def process_group_seconds(recipe, run: RunDir, mode: str) -> int:
    """The process group's timeout in seconds (SFTConfig's ddp_timeout, engines.create_process_group): the recipe's
    trainer: ddp_timeout, else the plan's backstop in the full run, else TrainingArguments' default (smoke)."""
    if "ddp_timeout" in recipe.trainer:
        return int(recipe.trainer["ddp_timeout"])
    if mode == "full":
        return _process_group_timeout(run)
    from transformers import TrainingArguments

    return int(TrainingArguments.__dataclass_fields__["ddp_timeout"].default)


def _process_group_timeout(run: RunDir) -> int:
    """The plan's backstop above the supervisor's watchdog (launcher/plan/deadlines.py): a rank waiting for a dead
    peer ends by itself."""
    import json

    from launcher.plan.deadlines import process_group_timeout

    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            return {}

    return process_group_timeout(read(run.plan), read(run.smoke))


def _trackers(run: RunDir, recipe, mode: str) -> dict[str, Any]:
    """SFTConfig's report_to and run_name/project, the trackers' environment set (launcher/worker/trackers.py)."""
    from launcher.worker import trackers

    report_to, fields = trackers.prepare(run.root, recipe, mode, _rank())
    return {"report_to": report_to, **fields}
