"""A recipe: YAML checked into a frozen, typed `Recipe`; `key=value` overrides; every error at once.

Precedence, lowest first: the defaults below < the recipe file < `key=value` on the command line.
Relative paths (`data`, `output_dir`, a local `model` directory) resolve against the recipe's folder; the same keys
given on the command line resolve against the working directory.
"""

from __future__ import annotations

import difflib
import re
import typing
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from launcher import engine_kinds, export_formats, gguf_types, methods, model_files, tracker_kinds
from launcher.data import formats as data_formats
from launcher.data import loss_view
from launcher.data import sources as data_sources
from launcher.data import task_metrics
from launcher.store.sync import kinds as sync_kinds
from launcher.errors import RecipeError, UsageError

Method = Literal[tuple(methods.METHODS)]  # the method table, launcher/methods.py
ObjectiveName = Literal[tuple(methods.OBJECTIVES)]  # the objective table, launcher/methods.py
Engine = Literal[(engine_kinds.AUTO, *engine_kinds.ENGINES)]  # the engine table, launcher/engine_kinds.py
ExportFormat = Literal[tuple(export_formats.FORMATS)]  # the export table, launcher/export_formats.py
GgufType = Literal[tuple(gguf_types.TYPES)]  # the GGUF table, launcher/gguf_types.py

# Settings the recipe owns at top level: passing them again under `trainer:` would make two
# surfaces for one setting, so they are refused there with a pointer to the top-level key.
OWNED_TRAINER_KEYS = {
    "output_dir": "output_dir",
    "max_length": "max_length",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "num_train_epochs": "epochs",
    "max_steps": "max_steps",
    "learning_rate": "learning_rate",
    "gradient_checkpointing": "gradient_checkpointing",
    "packing": "packing",
    "padding_free": "padding_free",
    "assistant_only_loss": "assistant_only_loss",
    "seed": "seed",
    "data_seed": "seed",
    "save_steps": "checkpoint_every_minutes",
    "save_strategy": "checkpoint_every_minutes",
    "save_total_limit": "keep_checkpoints",
    "logging_steps": "logging_steps",
    "use_cpu": "(detected, not configured)",
    "bf16": "(chosen from the GPU, not configured)",
    "fp16": "(chosen from the GPU, not configured)",
    "resume_from_checkpoint": "resume",
    "report_to": "report_to",
    # the evaluation runs on the recipe's eval: split, by wall clock (launcher/data/split.py)
    "do_eval": "eval.fraction or eval.data",
    "eval_strategy": "eval.every_minutes",
    "eval_steps": "eval.every_minutes",
    "eval_on_start": "eval (it evaluates at the start)",
    "eval_delay": "eval.every_minutes",
    # ftrun saves by wall clock and keeps the newest checkpoints: a "best" one by eval loss is not kept apart, so
    # these would do nothing (the eval loss of every pass is in metrics.jsonl, beside each checkpoint's step)
    "load_best_model_at_end": "(not supported: the final model is the last step's; eval loss per pass in "
    "metrics.jsonl)",
    "metric_for_best_model": "(not supported: the final model is the last step's; eval loss per pass in metrics.jsonl)",
}


# One definition of a token count for planning, used by the recipe's `tokens:`, `ftrun plan --tokens` and the plan.
TOKENS_MEANING = "training tokens in all: every epoch together (3 epochs over 5M tokens of data = 15M)"


def parse_token_count(value: Any, where: str = "--tokens") -> int:
    """15M, 250k, 1.5B, 1500000 -> a count; RecipeError naming `where` otherwise."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    text = str(value).strip().lower().replace("_", "").replace(",", "")
    units = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
    try:
        count = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(float(text))
    except (ValueError, KeyError):
        count = 0
    if count <= 0:
        raise RecipeError(
            f"{where} {value!r} is not a token count", fix=f"write it like 15M, 250k or 1500000 ({TOKENS_MEANING})."
        )
    return count


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraSettings(_Strict):
    r: int = Field(16, gt=0, description="LoRA rank; 16-64 gets most of the gain for style and format.")
    alpha: int = Field(16, gt=0, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA path.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' or a list such as [q_proj, v_proj]."
    )

    @field_validator("target_modules")
    @classmethod
    def _something_to_adapt(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        # PEFT would fail after the model loaded (tuners_utils: "Target modules [] not found in the base model")
        if isinstance(value, list) and not [m for m in value if str(m).strip()]:
            raise ValueError(
                "an empty list adapts nothing: LoRA needs modules to put its matrices on; write "
                "all-linear (every linear layer but the head) or names such as [q_proj, v_proj]"
            )
        return value


class PreferenceSettings(_Strict):
    """The preference objectives' settings (launcher/methods.py OBJECTIVES names which apply to which)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo: how far the policy may move from the reference (TRL's beta; "
        "higher stays closer); orpo: the weight of the odds-ratio term (ORPO's lambda).",
    )
    loss_type: str = Field(
        "sigmoid",
        description="dpo: TRL's DPO loss (sigmoid is the DPO paper's; ipo, hinge, "
        "robust, ... as the installed trl names them).",
    )
    reference: Literal["auto", "precomputed"] = Field(
        "auto",
        description="dpo: the reference's log-probabilities. auto: computed beside each step (LoRA: the base "
        "with the adapter switched off, or the parent adapter's frozen copy under init_from, no second model; full: a "
        "frozen copy of the model); precomputed: computed once over the data before training (one forward per "
        "example, no reference model kept in memory).",
    )


class GrpoSettings(_Strict):
    """GRPO's settings (objective grpo; launcher/methods.py OBJECTIVES names them): what TRL's GRPOConfig takes."""

    num_generations: int = Field(
        4,
        ge=2,
        description="Answers sampled per prompt; each is rewarded against its group's mean (TRL's num_generations, "
        "at least 2). micro_batch_size x gradient_accumulation_steps x the GPUs counts answers and must be a "
        "multiple of it.",
    )
    max_completion_length: int = Field(
        256, gt=0, description="Longest sampled answer in tokens; longer ones are cut (and said: clipped_ratio)."
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL coefficient against the starting model (TRL's default 0: no reference kept; DeepSeek-R1 "
        "used 0.001). Above 0: LoRA keeps the starting adapter as a frozen copy, full fine-tuning a frozen model.",
    )
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the answers.")
    generation: Literal["generate", "vllm"] = Field(
        "generate",
        description="generate: transformers' generate in the training process (every box); vllm: TRL's vLLM "
        "colocate mode, faster at 8B and above, needs the vllm package and a GPU.",
    )


class RewardSpec(_Strict):
    """One reward GRPO trains on: a task metric against each prompt's reference, or a function of yours."""

    metric: Optional[Literal[(task_metrics.AUTO, *task_metrics.METRICS)]] = Field(
        None,
        description=f"A task metric scored against each prompt's reference answer ({', '.join(task_metrics.METRICS)};"
        f" {task_metrics.AUTO}: the task evaluation's choice), with the task evaluation's own code.",
    )
    function: Optional[str] = Field(
        None,
        description="FILE.py:NAME, a function of yours called as NAME(prompts, completions, **columns) that returns "
        "one float per completion (TRL's reward function); checked on one example at plan time.",
    )
    weight: float = Field(1.0, description="Its weight in the sum of rewards (TRL's reward_weights).")

    @model_validator(mode="after")
    def _one_source(self) -> "RewardSpec":
        if (self.metric is None) == (self.function is None):
            raise ValueError(
                "a reward is either a metric (metric: exact) or a function (function: rewards.py:score): give one"
            )
        if self.function is not None:
            file, _, name = self.function.rpartition(":")
            if not file.endswith(".py") or not name.isidentifier():
                raise ValueError(
                    f"function {self.function!r} is not FILE.py:NAME; write it like rewards.py:score (the file "
                    "relative to the recipe)"
                )
        return self

    @property
    def name(self) -> str:
        """How the logs name it (TRL's rewards/<name>/mean)."""
        return f"metric_{self.metric}" if self.metric else self.function.rpartition(":")[2]


class SmokeSettings(_Strict):
    enabled: bool = Field(True, description="Run the smoke test before the full run.")
    fraction: float = Field(0.01, gt=0.0, le=1.0, description="Share of the examples the smoke test trains on.")
    min_steps: int = Field(8, ge=2, description="At least this many optimizer steps, whatever the fraction.")
    max_minutes: float = Field(15.0, gt=0, description="Stop the smoke test after this long and extrapolate.")


DataFormat = Literal[tuple(data_formats.FORMATS)]  # the format table, launcher/data/formats.py


class DataSource(_Strict):
    """One data source (launcher/data/sources.py); docs/data.md has the formats."""

    path: str = Field(
        description="A .jsonl/.json/.parquet/.csv file, a folder of them, a dataset saved with "
        "datasets (save_to_disk), or a Hub dataset id (org/name, read through the HF cache)."
    )
    split: str = Field("train", description="The split to read (Hub and saved datasets).")
    subset: Optional[str] = Field(None, description="The Hub dataset's subset (configuration) name.")
    revision: Optional[str] = Field(None, description="The Hub dataset's revision (branch, tag or commit).")
    columns: dict[str, str] = Field(
        default_factory=dict, description="The format's field -> this source's column, e.g. {messages: conversation}."
    )
    format: Optional[DataFormat] = Field(
        None, description=f"{data_formats.listed(' or ')}; default: detected from the first records."
    )
    weight: float = Field(1.0, gt=0, description="Times each example is used in the mix (0.5: a seeded half).")


class SyncSettings(_Strict):
    to: Optional[str] = Field(None, description=f"Where checkpoints are copied: {sync_kinds.forms()}.")
    keep: int = Field(3, ge=1, description="Checkpoints kept off the box (plus the final result).")
    every_seconds: float = Field(10.0, gt=0, description="How often the background copier looks for a new checkpoint.")

    @field_validator("to")
    @classmethod
    def _no_secrets_in_url(cls, value: Optional[str]) -> Optional[str]:
        if value and re.search(r"://[^/@]+:[^/@]+@", value):
            raise ValueError(
                "credentials do not belong in the recipe; use the environment (AWS_*, HF_TOKEN) "
                "or ~/.ssh/config instead"
            )
        wrong = sync_kinds.problem(value) if value else None  # the scheme, the bucket/repo/host: before any copy
        if wrong:
            raise ValueError(wrong)
        return value


class TaskSettings(_Strict):
    examples: int = Field(
        200,
        ge=0,
        description="Held-out examples the task evaluation scores (a seeded draw; 0 turns "
        "it off): each one's last assistant turn is the reference, answered greedily from the turns "
        "before it by the base model, the fine-tuned model and each export.",
    )
    metric: Literal[(task_metrics.AUTO, *task_metrics.METRICS)] = Field(
        task_metrics.AUTO,
        description=f"{task_metrics.AUTO}: chosen from the references, the reason stated; or "
        f"force one. {task_metrics.described()}.",
    )
    shots: int = Field(
        3,
        ge=0,
        description="Training examples placed before each prompt, as earlier turns, for the "
        "base model's few-shot score (the reference article's first question: is a prompt with "
        "examples enough?).",
    )
    baseline: Literal["run", "skip"] = Field(
        "run",
        description="run: the launch scores the base model (zero- and few-shot) before the smoke test and "
        "states whether fine-tuning pays (it never stops the run); skip: not before training.",
    )
    max_new_tokens: Optional[int] = Field(
        None,
        gt=0,
        description="Longest answer generated; default: from the longest reference (about 2 tokens per "
        "3 characters, twice over, at least 8), at most eval.max_new_tokens.",
    )


class EvalSettings(_Strict):
    fraction: Optional[float] = Field(
        None,
        gt=0.0,
        lt=0.5,
        description="Share of the data held out for evaluation (a seeded draw, the same at "
        "every resume; these examples never train).",
    )
    data: Optional[Union[str, DataSource, list[Union[str, DataSource]]]] = Field(
        None,
        description="Separate evaluation data instead of a share, given like data: a file or folder, a Hub "
        "dataset (org/name, or {path, split, subset, columns}), or a list of them.",
    )
    every_minutes: float = Field(
        20.0, gt=0, description="Wall-clock cadence of the eval loss, plus at the start and the end."
    )
    samples: int = Field(
        4,
        ge=0,
        description="Held-out prompts answered greedily by the base model before training "
        "and by the fine-tuned one after (final/samples.md); from the training data without a split.",
    )
    max_new_tokens: int = Field(128, gt=0, description="Longest answer generated for each sample.")
    task: TaskSettings = Field(
        default_factory=TaskSettings,
        description="The scored task evaluation (final/task_eval.json; `ftrun baseline` before training).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "EvalSettings":
        if self.fraction is not None and self.data is not None:
            raise ValueError(
                "give either eval.fraction (a share of data held out) or eval.data (a separate file), not both"
            )
        return self


Tracker = Literal[tuple(tracker_kinds.TRACKERS)]  # the tracker table, launcher/tracker_kinds.py


class PublishSettings(_Strict):
    to: Optional[str] = Field(None, description="Hugging Face repo the verified result is pushed to: hf://user/repo.")
    private: bool = Field(True, description="Create the repo private (an existing repo keeps its visibility).")
    what: list[ExportFormat] = Field(
        default_factory=lambda: ["adapter"],
        description="What is pushed, each after the export checked it: adapter, merged, gguf (each also in export:).",
    )

    @field_validator("to")
    @classmethod
    def _hub_repo(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return value
        if re.search(r"://[^/@]+:[^/@]+@", value):
            raise ValueError("credentials do not belong in the recipe; set HF_TOKEN or run `hf auth login`")
        parts = value[len("hf://") :].strip("/").split("/") if value.startswith("hf://") else []
        if len(parts) != 2 or not all(parts):
            raise ValueError("publish.to is a Hugging Face model repo: write hf://USER/REPO")
        return value


# The recipe sections that hold an objective's settings (launcher/methods.py Objective.section), by key.
SECTIONS: dict[str, type[_Strict]] = {"preference": PreferenceSettings, "grpo": GrpoSettings}


class Recipe(_Strict):
    """One fine-tuning job. Field descriptions are the documentation (`ftrun explain` prints them)."""

    model: str = Field(description="Hugging Face model id or a local model directory.")
    method: Method = Field(description=methods.described())
    objective: ObjectiveName = Field(methods.DEFAULT_OBJECTIVE, description=methods.objectives_described())
    preference: PreferenceSettings = Field(
        default_factory=PreferenceSettings,
        description=f"Preference tuning's settings (objective {' or '.join(methods.preference_objectives())}).",
    )
    grpo: GrpoSettings = Field(
        default_factory=GrpoSettings, description="GRPO's settings (objective grpo): sampling and the reference."
    )
    reward: Optional[list[RewardSpec]] = Field(
        None,
        description="GRPO's rewards (objective grpo): {metric: exact|json|text} scored against each prompt's "
        "reference, {function: FILE.py:NAME}, or a list of them with weights. Left out: the task metric "
        "(eval.task.metric, chosen from the references when auto).",
    )
    init_from: Optional[str] = Field(
        None,
        description="Start from an earlier run's adapter: its run directory (final/adapter) or an adapter "
        "folder; the usual chain is SFT, then DPO on the same base (lora, qlora). The plan and the model card name it.",
    )
    data: Union[str, DataSource, list[Union[str, DataSource]]] = Field(
        description=f"The training data: a file ({', '.join(data_sources.EXTENSIONS)}), a folder of them, a Hub "
        f"dataset "
        "(org/name), a {path, split, subset, columns, format, weight} mapping, or a list of those mixed by weight. "
        f"Formats (detected): {'; '.join(f.description for f in data_formats.FORMATS.values())} (docs/data.md)."
    )
    max_length: int = Field(2048, gt=0, description="Tokens per example; longer ones are truncated.")
    max_length_may_cut: float = Field(
        loss_view.CUT_SHARE_LIMIT,
        ge=0.0,
        le=1.0,
        description="Share of the examples whose trained part max_length may cut (the answer loses its end and its "
        "end-of-turn token) before the data check refuses; 0: none.",
    )
    micro_batch_size: int = Field(2, gt=0, description="Examples per GPU per forward pass.")
    gradient_accumulation_steps: int = Field(4, gt=0, description="Micro-batches per optimizer step.")
    epochs: float = Field(3.0, gt=0, description="Passes over the data (ignored when max_steps is set).")
    max_steps: Optional[int] = Field(None, gt=0, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA settings (qlora, lora).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations to save memory.")
    packing: bool = Field(False, description="Pack several examples into one sequence of max_length.")
    padding_free: Optional[bool] = Field(
        None,
        validate_default=True,
        description="Concatenate each micro-batch into one row without padding (same examples, same loss; "
        "no compute spent on pad tokens). Off: rows padded to the batch's longest example, as plain TRL does. "
        "Default: on for objective sft; dpo and orpo pad their pairs (trl 1.16's DPOTrainer turns padding_free off).",
    )
    assistant_only_loss: bool = Field(
        False, description="Train only on assistant turns (needs {% generation %} markers in the chat template)."
    )
    seed: int = Field(42, description="Seed for weights init of LoRA, data order and dropout.")
    output_dir: Optional[str] = Field(
        None, description="Run directory; default runs/<recipe name> in the current folder."
    )
    checkpoint_every_minutes: float = Field(
        20.0, gt=0, description="Wall-clock checkpoint cadence (the article: every 15-30 minutes)."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Local checkpoints kept; older ones are deleted.")
    logging_steps: int = Field(10, gt=0, description="Log loss and throughput every N optimizer steps.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts within any hour of a worker or rank that crashed, was killed or hung, each from "
        "the newest verified checkpoint (a traceback that repeats at the same step is never restarted).",
    )
    resume: Union[Literal["auto"], bool] = Field(
        "auto", description="auto: continue if a checkpoint exists; true: fail if none; false: refuse to reuse a run."
    )
    smoke: SmokeSettings = Field(default_factory=SmokeSettings, description="The 1%-of-data smoke test.")
    engine: Engine = Field(
        engine_kinds.AUTO,
        description=f"{engine_kinds.AUTO} lets the plan choose; or force {', '.join(engine_kinds.ENGINES)}.",
    )
    # Not part of the trajectory's keys: a DeepSpeed checkpoint is refused on another layout (worker/engines).
    offload: Literal["auto", "none", "optimizer", "optimizer+params"] = Field(
        "auto",
        description="DeepSpeed ZeRO-3 CPU offload: auto adds it (optimizer, then parameters) only when "
        "nothing else fits the cards; none never offloads; optimizer or optimizer+params forces it (engine deepspeed). "
        "Under offload the optimizer is DeepSpeed's CPU AdamW (fp32 states in RAM), also for method full-8bit.",
    )
    # Not part of the trajectory: a LoRA/DDP run may resume on another process count (the worker says so).
    num_processes: Union[Literal["auto"], PositiveInt] = Field(
        "auto",
        description="Worker processes (one per GPU; gloo processes on CPU): auto lets the plan choose; "
        "a number is honoured or refused with the reason.",
    )
    price_per_hour_eur: Optional[float] = Field(
        None, ge=0, description="Price of the whole box per hour; default from the GPU catalog."
    )
    # box and tokens are for planning only: not part of the trajectory.
    box: Optional[str] = Field(
        None,
        description="The box this recipe is meant for, e.g. 1xRTX4090 or 8xH100-80GB: `ftrun plan` plans for it "
        "unless --gpus names another or this machine has GPUs.",
    )
    tokens: Optional[int] = Field(
        None,
        gt=0,
        description=TOKENS_MEANING.capitalize()
        + ", e.g. 15M: what `ftrun plan` sizes time and cost with when the data "
        "file is not on this machine (the data's own count wins when it is; --tokens wins over both).",
    )
    sync: SyncSettings = Field(default_factory=SyncSettings, description="Copying checkpoints off the box.")
    auto_adjust: list[Literal["batch", "checkpointing", "optimizer", "method", "shard"]] = Field(
        default_factory=lambda: ["batch", "checkpointing", "shard"],
        description="What the smoke test may change after running out of memory, cheapest first: batch "
        "(halve micro_batch_size, double accumulation), checkpointing, optimizer (full -> full-8bit), "
        "method (lora -> qlora), shard (FSDP over the box's GPUs, from one card or from DDP, accumulation "
        "lowered to keep the effective batch; the box is billed whole; on CPU only under --memory-limit, "
        "DeepSpeed ZeRO-3 x 2); [] to stop with advice instead.",
    )
    grace_seconds: float = Field(
        60.0,
        gt=0,
        description="After SIGTERM (preemption, `ftrun stop`): time to checkpoint before the worker is killed.",
    )
    on_finish: list[list[str]] = Field(
        default_factory=list,
        description="Commands (argument lists) run after the final result is verified off the box, e.g. stopping the "
        "server.",
    )
    export: list[ExportFormat] = Field(
        default_factory=lambda: ["adapter"],
        description=f"Outputs made after training, each reloaded and checked: {export_formats.described()}.",
    )
    gguf_type: GgufType = Field(
        gguf_types.DEFAULT_TYPE, description=f"GGUF type, made by llama.cpp: {gguf_types.described()}."
    )
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Validation split and before/after samples.")
    report_to: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers the trainer reports to (rank 0 only), named after the run, with the recipe as "
        f"config: {tracker_kinds.described()}; [] for none. docs/tracking.md.",
    )
    publish: PublishSettings = Field(
        default_factory=PublishSettings,
        description="Pushing the verified result to the Hugging Face Hub, with a model card.",
    )
    trainer: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra fields of the objective's TRL "
        "configuration, checked against it and passed through: "
        + ", ".join(f"{o.config} ({o.name})" for o in methods.OBJECTIVES.values())
        + ".",
    )

    @field_validator("model")
    @classmethod
    def _model_is_not_a_file(cls, value: str) -> str:
        wrong = model_files.not_a_model(value)  # a GGUF above all: refused here, before any download or GPU time
        if wrong:
            raise ValueError(f"{wrong[0].removeprefix(f'model {value} is ')}; {wrong[1]}")
        return value

    @field_validator("init_from")
    @classmethod
    def _init_from_an_adapter(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parent_adapter(value)  # an earlier run without its adapter, or a folder that is none: here, before the plan
        return value

    @field_validator("reward", mode="before")
    @classmethod
    def _one_reward_is_a_list_of_one(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_count(cls, value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse_token_count(value, "tokens:")
        except RecipeError as exc:
            raise ValueError(f"not a token count: write it like 15M, 250k or 1500000 ({TOKENS_MEANING})") from exc

    @field_validator("padding_free")
    @classmethod
    def _padding_free_where_the_trainer_honours_it(cls, value: Optional[bool], info) -> Optional[bool]:
        """Left out: on for sft, off where a preference trainer pads its chosen and rejected rows side by side (a
        given true is refused there, _objective_keys). Resolved here, so the run's recipe.yaml holds a bool, as it
        did when true was the default for every objective."""
        objective = methods.OBJECTIVES.get(info.data.get("objective"))
        if value is None and objective is not None:  # no objective: its own error says so
            return "padding_free" not in objective.refuses
        return value

    @field_validator("trainer")
    @classmethod
    def _trainer_keys_not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = [k for k in value if k in OWNED_TRAINER_KEYS]
        if owned:
            hints = ", ".join(f"trainer.{k} -> {OWNED_TRAINER_KEYS[k]}" for k in owned)
            raise ValueError(f"set these through the recipe's own keys, not trainer: ({hints})")
        return value

    @model_validator(mode="after")
    def _objective_keys(self) -> "Recipe":
        objective = methods.OBJECTIVES[self.objective]
        for section, model in SECTIONS.items():
            applies = objective.settings if objective.section == section else ()
            # set to another value than the default: the run folder's recipe snapshot writes every key with its value
            given = sorted(
                k
                for k, f in model.model_fields.items()
                if k not in applies and getattr(getattr(self, section), k) != f.default
            )
            if given:
                where = "it applies to " + ", ".join(
                    o.name for o in methods.OBJECTIVES.values() if o.section == section and set(given) & set(o.settings)
                )
                mine = ", ".join(f"{objective.section}.{k}" for k in objective.settings)
                raise ValueError(
                    f"{section}.{', {section}.'.join(given)} does not apply to objective {self.objective} "
                    f"({where}; objective {self.objective} takes {mine or 'no preference: or grpo: keys'}); "
                    "remove it, or set the objective it is for"
                )
        if self.reward is not None and not objective.generates:
            takers = ", ".join(o.name for o in methods.OBJECTIVES.values() if o.generates)
            raise ValueError(
                f"reward: applies to objective {takers}, which samples answers and scores them; objective "
                f"{self.objective} learns from the data's own answers: remove reward:, or set objective: {takers}"
            )
        refused = sorted(k for k in objective.refuses if getattr(self, k))
        if refused:
            takers = ", ".join(o.name for o in methods.OBJECTIVES.values() if not set(refused) & set(o.refuses))
            raise ValueError(
                f"{', '.join(refused)} apply to objective {takers}; {self.objective}: "
                f"{objective.refuses_why}: remove {'them' if len(refused) > 1 else 'it'}"
            )
        if self.init_from is not None and not methods.is_adapter(self.method):
            raise ValueError(
                f"init_from starts from an adapter, and method {self.method} trains every weight: give the "
                "earlier run's merged model as model: (RUN/final/merged, made with export: [merged]) "
                "instead"
            )
        if self.init_from is not None:
            self._fits_the_parent()
        return self

    def _fits_the_parent(self) -> None:
        """The parent adapter was trained on this recipe's base model, and it brings its own lora: settings: a lora:
        key the recipe gives is refused unless it is the parent's (it would be ignored), whatever its value; the
        recipe then holds the parent's values, so the plan, the serving commands and the run's recipe.yaml say one
        rank, the parent's."""
        folder = parent_adapter(self.init_from)
        config = json.loads((folder / "adapter_config.json").read_text())
        base = config.get("base_model_name_or_path")
        if base and base != self.model and Path(base).name != Path(self.model).name:
            raise ValueError(
                f"the adapter in {folder} was trained on {base}, and this recipe's model is {self.model}: "
                f"an adapter fits the base it was trained on; set model: {base}"
            )
        modules = config.get("target_modules")
        parent = {
            "r": config.get("r"),
            "alpha": config.get("lora_alpha"),
            "dropout": config.get("lora_dropout"),
            "target_modules": sorted(modules) if isinstance(modules, (list, set, tuple)) else modules,
        }

        def same(key: str, value: Any) -> bool:
            mine = getattr(self.lora, key)
            return sorted(mine) == value if key == "target_modules" and isinstance(mine, list) else mine == value

        def shown(value: Any) -> str:  # PEFT stores every module's name: hundreds on a real model
            return (
                f"{len(value)} modules: {', '.join(value[:3])}, ..."
                if isinstance(value, list) and len(value) > 4
                else str(value)
            )

        given = self.lora.model_fields_set
        ignored = [
            f"lora.{k} {shown(getattr(self.lora, k))} (the parent's: {shown(v)})"
            for k, v in parent.items()
            if k in given and v is not None and not same(k, v)
        ]
        if ignored:
            raise ValueError(
                f"init_from continues the adapter in {folder} with its own settings, so "
                f"{', '.join(ignored)} would be ignored; remove the lora: keys (or start a new adapter "
                "without init_from)"
            )
        # the recipe is frozen once checked; this is its check, resolving the values it holds
        object.__setattr__(
            self, "lora", self.lora.model_copy(update={k: v for k, v in parent.items() if v is not None})
        )

    @model_validator(mode="after")
    def _cross_field(self) -> "Recipe":
        if self.assistant_only_loss and self.packing:
            raise ValueError("assistant_only_loss and packing together are not supported by TRL; turn one off")
        if self.publish.to:
            if not methods.is_adapter(self.method) and "adapter" in self.publish.what:
                raise ValueError(
                    "publish.what has 'adapter', but a full fine-tune has none: publish merged "
                    "(the 16-bit model, with merged in export:) or gguf"
                )
            exported = set(export_formats.made(self.export))
            missing = [w for w in self.publish.what if w not in exported]
            if missing:
                raise ValueError(
                    f"publish.what has {missing}, which export: does not make (and check) first; "
                    f"add {missing} to export:"
                )
        return self

    # -- derived values, one place each --------------------------------------------------
    @property
    def objective_row(self) -> methods.Objective:
        return methods.OBJECTIVES[self.objective]

    @property
    def name(self) -> str:
        return Path(self.output_dir or "run").name

    @property
    def rewards(self) -> list[RewardSpec]:
        """GRPO's rewards as a list; left out, the task metric (eval.task.metric, auto: chosen from the references)."""
        return list(self.reward) if self.reward is not None else [RewardSpec(metric=self.eval.task.metric)]

    def snapshot(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what is written to the run directory)."""
        return self.model_dump(mode="json")

    def trajectory(self) -> dict[str, Any]:
        """The settings that decide the training trajectory; a resume must not change them."""
        keep = (
            "model method data max_length micro_batch_size gradient_accumulation_steps epochs max_steps "
            "learning_rate lora gradient_checkpointing packing assistant_only_loss seed trainer"
        ).split()
        snap = self.snapshot()
        out = {k: snap[k] for k in keep}
        if self.eval.fraction is not None:  # the held-out share decides which examples train (absent: as before)
            out["eval.fraction"] = self.eval.fraction
        if self.objective != methods.DEFAULT_OBJECTIVE:  # absent: a run of an earlier ftrun resumes with its hash
            out["objective"] = self.objective
            if self.objective_row.section:
                out[self.objective_row.section] = {
                    k: snap[self.objective_row.section][k] for k in self.objective_row.settings
                }
            if self.objective_row.generates:
                out["reward"] = [r.model_dump(mode="json") for r in self.rewards]
        if self.init_from is not None:  # the parent adapter's weights, not only its path
            out["init_from"] = _weights_sha256(parent_adapter(self.init_from))
        return out

    def trajectory_hash(self) -> str:
        blob = json.dumps(self.trajectory(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def parent_adapter(init_from: str) -> Path:
    """The adapter folder `init_from` names: a run directory's final/adapter, or an adapter folder itself. ValueError
    saying what is there otherwise (the recipe check words it)."""
    path = Path(init_from)
    for folder in (path / "final" / "adapter", path):
        if (folder / "adapter_config.json").is_file():
            return folder
    if not path.exists():
        raise ValueError(f"{path} does not exist: give the earlier run's directory (runs/NAME) or an adapter folder")
    if (path / "state.json").is_file() or (path / "checkpoints").is_dir():
        raise ValueError(
            f"{path} is a run without a final adapter (final/adapter/adapter_config.json): let it finish "
            "(`ftrun status` says where it is), or give one of its checkpoints' folders"
        )
    raise ValueError(
        f"{path} holds no adapter_config.json: give a run directory (with final/adapter) or a PEFT adapter folder"
    )


def _weights_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("adapter_model.*")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# Loading


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, prefix + name + "."))
    return keys


# Names people bring from other tools, for keys whose spelling is not close to ftrun's.
KEY_ALIASES = {
    "lr": "learning_rate",
    "batch_size": "micro_batch_size",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "max_seq_length": "max_length",
    "base_model": "model",
    "dataset": "data",
}
# "Did you mean" only for close spellings: difflib's ratio 2*matches/(len a + len b); 'lr' vs 'lora' is 0.67,
# 'learnig_rate' vs 'learning_rate' 0.96, 'max_len' vs 'max_length' 0.82.
SUGGEST_CUTOFF = 0.75


def close_name(name: str, options: list[str]) -> Optional[str]:
    """The option a misspelt name most likely meant, or None when none is close."""
    near = difflib.get_close_matches(name, options, n=1, cutoff=SUGGEST_CUTOFF)
    return near[0] if near else None


def _suggest(loc: str) -> str:
    options = _all_keys(Recipe)
    if KEY_ALIASES.get(loc) in options:
        return f" (did you mean '{KEY_ALIASES[loc]}'?)"
    close = close_name(loc, options)
    if not close:  # a typo in the last part of a nested key: compare the leaf names
        leaf = loc.rsplit(".", 1)[-1]
        leaves = {o.rsplit(".", 1)[-1]: o for o in options if o.count(".") == loc.count(".")}
        near = close_name(leaf, list(leaves))
        close = leaves[near] if near else None
    return f" (did you mean '{close}'?)" if close else ""


def _format_errors(err: ValidationError, source: str) -> RecipeError:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"- unknown key '{loc}'{_suggest(loc)}")
        elif e["type"] == "missing":
            doc = _field_doc(loc)
            lines.append(f"- '{loc}' is required" + (f": {doc}" if doc else ""))
        else:
            value = e.get("input")
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"- '{loc or '(top level)'}' = {shown}: {msg}")
    n = len(lines)
    return RecipeError(
        f"{source} has {n} problem{'s' if n > 1 else ''}:\n" + "\n".join(lines),
        fix="correct the keys above in the recipe (or the key=value arguments); `ftrun explain` lists every key.",
    )


def _field_doc(loc: str) -> str:
    model: type[BaseModel] = Recipe
    parts = loc.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return ""
        if i == len(parts) - 1:
            return field.description or ""
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    return ""


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


def _unread_words(words: list[str]) -> list[str]:
    """Each word of the command line's overrides (in the order typed) that is not key=value, with the form that would
    have worked: `max_steps 20`, `epochs = 1`, `epochs =1`, `epochs= 1` -> `max_steps=20`, `epochs=1`;
    `learning_rate:1e-4` -> `learning_rate=1e-4`. One line each; [] when every word is key=value."""
    lines, i = [], 0
    while i < len(words):
        word, after = words[i], words[i + 1 :]
        key, sep, _ = word.partition("=")
        if sep and key and _KEY.fullmatch(key):  # key=value (key= sets the key to null)
            if word.endswith("=") and after and "=" not in after[0]:  # `epochs= 1`: the value stood apart
                lines.append(f"- '{word} {after[0]}': the value stands apart from its key; write {word}{after[0]}")
                i += 2
                continue
            i += 1
            continue
        if sep and key:
            lines.append(
                f"- '{word}': '{key}' is not a key (a recipe key is a name or a dotted path such as lora.r); "
                f"write it like lora.r=8"
            )
        elif sep:  # `=1` or `=`: no key before '=' (a key given apart from it is named by the branch below)
            lines.append(f"- '{word}': no key before '='; write it like max_steps=20")
        elif ":" in word and _KEY.fullmatch(word.partition(":")[0]):
            name, _, value = word.partition(":")
            lines.append(
                f"- '{word}': ':' between key and value is the recipe file's form; on the command line "
                f"write {name}={value}"
            )
        elif _KEY.fullmatch(word) and Path(word).suffix.lower() in (".yaml", ".yml"):
            lines.append(f"- '{word}': a second recipe; ftrun reads one recipe per command, run it on its own")
        elif _KEY.fullmatch(word):
            nxt = after[0] if after else None
            if nxt == "=" and len(after) > 1:  # `epochs = 1`
                lines.append(f"- '{word} = {after[1]}': spaces around '='; write {word}={after[1]}")
                i += 3
                continue
            if nxt is not None and nxt.startswith("=") and nxt != "=":  # `epochs =1`
                lines.append(f"- '{word} {nxt}': a space before '='; write {word}{nxt}")
                i += 2
                continue
            if nxt is not None and "=" not in nxt:  # `max_steps 20`
                lines.append(f"- '{word} {nxt}': a key and its value as two words; write {word}={nxt}")
                i += 2
                continue
            lines.append(f"- '{word}': a key without a value; write {word}=VALUE")
        else:
            lines.append(f"- '{word}': not key=value; write overrides like max_steps=20 lora.r=8")
        i += 1
    return lines


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`lora.r=8 max_steps=20` -> nested dict; values are parsed as YAML scalars. `pairs` are the command line's words
    after the recipe in the order typed: a word that is not key=value is refused by name, never dropped."""
    unread = _unread_words(pairs)
    if unread:
        head = "is neither an option nor a key=value override (ftrun would have run without it)"
        raise UsageError(
            (
                f"{unread[0][2:].replace(': ', f' {head}: ', 1)}"
                if len(unread) == 1
                else f"{len(unread)} parts of the command line are neither options nor key=value overrides (ftrun "
                f"would have "
                f"run without them):\n" + "\n".join(unread)
            ),
            fix="write each override as key=value, no spaces around '=' (quote a value with spaces: key='a b'); "
            "`ftrun explain` lists the keys.",
        )
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override '{pair}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.count("/") != 1


def _resolve_data(value: Any, base_dir: Path) -> Any:
    """Local data paths against the recipe's folder; a Hub id (org/name, no such file or folder here) as it is."""
    if isinstance(value, list):
        return [_resolve_data(v, base_dir) for v in value]
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": _resolve_data(value["path"], base_dir)}
    if isinstance(value, str):
        candidate = base_dir / Path(value).expanduser()
        if _looks_local(value) or candidate.exists() or Path(value).suffix.lower() in data_sources.EXTENSIONS:
            return str(candidate.resolve())
    return value


def _resolve_reward(value: Any, base_dir: Path) -> Any:
    """A reward function's FILE.py made absolute against the recipe's folder (FILE.py:NAME keeps its NAME)."""
    if isinstance(value, list):
        return [_resolve_reward(v, base_dir) for v in value]
    if isinstance(value, dict) and isinstance(value.get("function"), str) and ":" in value["function"]:
        file, _, name = value["function"].rpartition(":")
        return {**value, "function": f"{(base_dir / Path(file).expanduser()).resolve()}:{name}"}
    return value


def _resolve_paths(raw: dict[str, Any], base_dir: Path, default_name: str) -> dict[str, Any]:
    out = dict(raw)
    if out.get("data") is not None:
        out["data"] = _resolve_data(out["data"], base_dir)
    if isinstance(out.get("eval"), dict) and out["eval"].get("data") is not None:
        out["eval"] = {**out["eval"], "data": _resolve_data(out["eval"]["data"], base_dir)}  # the same forms as data
    if isinstance(out.get("model"), str):
        model = out["model"]
        candidate = base_dir / Path(model).expanduser()
        # "org/name" is a Hub id unless such a folder (or a file, refused by name then) exists next to the recipe.
        if _looks_local(model) or candidate.exists():
            out["model"] = str(candidate.resolve())
    if isinstance(out.get("init_from"), str):
        out["init_from"] = str((base_dir / Path(out["init_from"]).expanduser()).resolve())
    if out.get("reward"):
        out["reward"] = _resolve_reward(out["reward"], base_dir)
    if out.get("output_dir") is None:
        out["output_dir"] = str((Path.cwd() / "runs" / default_name).resolve())
    elif isinstance(out.get("output_dir"), str):
        out["output_dir"] = str((base_dir / Path(out["output_dir"]).expanduser()).resolve())
    return out


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"the key {key!r} is written twice (lines {first} and {again})")
        self.key, self.first, self.again = key, first, again


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (YAML leaves it to the loader, and PyYAML's
    own keeps the last one in silence): checked in construct_mapping, the hook PyYAML builds every mapping with,
    before merge keys (<<) are flattened into it."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _command_line_paths(over: dict[str, Any]) -> dict[str, Any]:
    """The paths of the command line's overrides (output_dir=, data=, eval.data=, model=) against the working
    directory, as a shell user expects of every path typed there; the recipe file's own paths resolve against its
    folder afterwards (_resolve_paths), which leaves these, absolute by then, as they are."""
    resolved = _resolve_paths(over, Path.cwd(), default_name="")
    return {k: v if v is None else resolved[k] for k, v in over.items()}  # `output_dir=` keeps meaning the default


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, merge overrides, resolve paths, validate: one `Recipe`, or one `RecipeError` listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(
            f"recipe file '{path}' does not exist",
            fix="give the path of a recipe YAML, e.g. `ftrun recipes/tiny-cpu.yaml` (see recipes/).",
        )
    try:
        raw = yaml.load(path.read_text(), Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise RecipeError(
            f"{path}: {exc}; YAML would keep only the last value",
            fix=f"keep one '{exc.key}' (line {exc.first} or {exc.again}) and delete the other.",
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(
            f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}",
            fix="check indentation and quoting on that line.",
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path} must be a mapping of keys to values, found a {type(raw).__name__}",
            fix="write the recipe as `key: value` lines (see recipes/tiny-cpu.yaml).",
        )
    merged = _merge(raw, _command_line_paths(parse_overrides(overrides or [])))
    return validate_recipe(merged, path.parent.resolve(), path.stem, source=str(path))


def validate_recipe(raw: dict[str, Any], base_dir: Path, default_name: str, source: str = "the recipe") -> Recipe:
    try:
        return Recipe.model_validate(_resolve_paths(raw, base_dir, default_name))
    except ValidationError as err:
        raise _format_errors(err, source) from None


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


def explain() -> str:
    """Every recipe key with its default and documentation."""
    rows = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, prefix + name + ".")
                continue
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append(f"{prefix + name:32} {default:14} {field.description or ''}")

    walk(Recipe, "")
    return "\n".join(rows)
