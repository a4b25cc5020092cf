"""The input contract: one fine-tuning job as a frozen, typed `Recipe`, checked field by field.

Its sections (lora:, eval:, ...) are launcher/recipe_sections.py; reading a file into it, launcher/recipe_loading.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, PositiveInt, field_validator, model_validator

from launcher import engine_kinds, export_formats, gguf_types, methods, model_files, notify, tracker_kinds
from launcher.data import formats as data_formats
from launcher.data import loss_view
from launcher.data import sources as data_sources
from launcher.data import task_metrics
from launcher.errors import RecipeError
from launcher.recipe_sections import (
    SECTIONS,
    DataSource,
    EvalSettings,
    ExportFormat,
    GrpoSettings,
    LoraSettings,
    PreferenceSettings,
    PublishSettings,
    RewardSpec,
    Secret,
    SmokeSettings,
    Strict,
    SyncSettings,
    fields,
    is_section,
    secret_keys,
)

Method = Literal[tuple(methods.METHODS)]
ObjectiveName = Literal[tuple(methods.OBJECTIVES)]
Engine = Literal[(engine_kinds.AUTO, *engine_kinds.ENGINES)]
GgufType = Literal[tuple(gguf_types.TYPES)]

# The TRL configuration fields ftrun sets itself (launcher/worker/trainer_config.py), each with the recipe key to use
# instead (or why it is not configured): refused under `trainer:`, where the later one would win in silence.
# OBJECTIVE_TRAINER_KEYS: those set for one objective only.
OWNED_TRAINER_KEYS = {
    "output_dir": "output_dir",
    "max_length": "max_length",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "num_train_epochs": "epochs",
    "max_steps": "max_steps",
    "learning_rate": "learning_rate",
    "gradient_checkpointing": "gradient_checkpointing",
    # transformers 5.24 renamed it (training_args.py __post_init__: the old names are aliases of the new)
    "activation_checkpointing": "gradient_checkpointing",
    "gradient_checkpointing_kwargs": "(set by ftrun: non-reentrant checkpointing, which LoRA and FSDP need)",
    "activation_checkpointing_kwargs": "(set by ftrun: non-reentrant checkpointing, which LoRA and FSDP need)",
    "include_num_input_tokens_seen": "(set by ftrun: the tokens each step trained, which its speed and ETA read)",
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
    # ftrun keeps the newest checkpoints, not a "best" one by eval loss
    "load_best_model_at_end": "(not supported: the final model is the last step's; eval loss per pass in "
    "metrics.jsonl)",
    "metric_for_best_model": "(not supported: the final model is the last step's; eval loss per pass in metrics.jsonl)",
    # a token in the recipe would travel with its snapshot (the run directory, the off-box copy)
    "hub_token": "(HF_TOKEN in the environment, or `hf auth login`: a token does not belong in the recipe)",
}
OBJECTIVE_TRAINER_KEYS: dict[str, dict[str, str]] = {
    "dpo": {
        "beta": "preference.beta",
        "loss_type": "preference.loss_type",
        "precompute_ref_log_probs": "preference.reference (precomputed)",
    },
    "orpo": {"beta": "preference.beta"},
    # trl 1.16 grpo_config.py: the plan checks and sizes these; reward_weights must match the rewards one for one
    "grpo": {
        "num_generations": "grpo.num_generations",
        "max_completion_length": "grpo.max_completion_length",
        "temperature": "grpo.temperature",
        "beta": "grpo.beta",
        "reward_weights": "reward: [{..., weight: W}] (each reward's weight)",
        "use_vllm": "grpo.generation (vllm)",
        "vllm_mode": "grpo.generation (vllm: ftrun runs TRL's colocate mode)",
        "remove_unused_columns": "(kept false by ftrun: the rewards read the data's columns by name)",
    },
}


def owned_trainer_key(key: str, objective: Optional[str]) -> Optional[str]:
    """The recipe key that sets the TRL field `key` for `objective` (None: trainer: may set it)."""
    return OWNED_TRAINER_KEYS.get(key) or OBJECTIVE_TRAINER_KEYS.get(objective or "", {}).get(key)


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


Tracker = Literal[tuple(tracker_kinds.TRACKERS)]


class Recipe(Strict):
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
        description=f"GRPO's rewards (objective grpo): {{metric: {'|'.join(task_metrics.METRICS)}}} scored against "
        "each prompt's "
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
        "(org/name), a {path, split, subset, columns, format, weight, ignore} mapping (LLaMA-Factory: {path: "
        "dataset_info.json, dataset: NAME}; Axolotl: {path, type, field mappings}), or a list of those mixed by "
        "weight. "
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
        f"Default: on for objective {' and '.join(methods.padding_free_objectives())}; "
        f"{', '.join(o for o in methods.OBJECTIVES if o not in methods.padding_free_objectives())} pad their "
        "rows side by side (trl 1.16's DPOTrainer turns padding_free off; GRPO batches its sampled answers).",
    )
    assistant_only_loss: Optional[bool] = Field(
        None,
        description="Train only on the assistant turns of chat data. Left out: on where the chat template marks them "
        "({% generation %} markers, or TRL's training template for it) and the objective trains chat data, as "
        "LLaMA-Factory's train_on_prompt: false and Axolotl's train_on_inputs: false do; else the whole conversation; "
        "the plan says which and why, and the run records it (a resume keeps it). false: the whole conversation; "
        "true: the assistant turns, or refused where the template cannot mark them. Prompt/completion data train "
        "the completion either way (trainer.completion_only_loss: false trains the prompt too).",
    )
    seed: int = Field(42, description="Seed for weights init of LoRA, data order and dropout.")
    output_dir: Optional[str] = Field(
        None, description="Run directory; default runs/<recipe name> in the current folder."
    )
    checkpoint_every_minutes: float = Field(
        20.0, gt=0, description="Wall-clock checkpoint cadence (the article: every 15-30 minutes)."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Checkpoints kept on the box, the newest; older ones are deleted (off the box: sync.keep)."
    )
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
    smoke: SmokeSettings = Field(
        default_factory=SmokeSettings,
        description=f"The {SmokeSettings.model_fields['fraction'].default:.0%}-of-data smoke test.",
    )
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
    on_finish: Secret[list[list[str]]] = Field(
        default_factory=list,
        description="Commands (argument lists) run after the final result is verified off the box, e.g. stopping the "
        "server.",
    )
    notify: Secret[list[str]] = Field(
        default_factory=list,
        description="Apprise URLs told when the smoke test passes (forecast, cost) and when the run ends, however it "
        "ends (state, reason, steps, loss, task score, time, cost, where the result is): slack://, discord://, "
        "tgram://, ntfy://, mailtos://, json:// and the rest of https://appriseit.com/services/. Secret: never "
        "logged, published or sent to a tracker.",
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
        description="Extra fields of the objective's TRL configuration, checked against it and passed through: "
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

    @field_validator("notify")
    @classmethod
    def _notify_urls_apprise_sends_to(cls, value: list[str]) -> list[str]:
        try:  # before any plan or GPU time, for every command; the error names a URL by its place, never its text
            notify.check(value)
        except RecipeError as exc:
            raise ValueError(f"{exc.message}; {exc.fix}") from None
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
        """Left out: on where the objective honours it, else off (a given true is refused: _objective_keys); resolved
        here, so recipe.yaml holds a bool."""
        objective = methods.OBJECTIVES.get(info.data.get("objective"))
        if value is None and objective is not None:  # no objective: its own error says so
            return "padding_free" not in objective.refuses
        return value

    @field_validator("trainer")
    @classmethod
    def _trainer_keys_not_owned(cls, value: dict[str, Any], info) -> dict[str, Any]:
        objective = info.data.get("objective")
        owned = [(k, use) for k in value if (use := owned_trainer_key(k, objective))]
        if owned:
            hints = ", ".join(f"trainer.{k} -> {use}" for k, use in owned)
            raise ValueError(
                f"set these through the recipe's own keys, not trainer: ({hints}); ftrun sets them in TRL's "
                "configuration itself, and its plan counts on them"
            )
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
        if self.micro_batch_size < objective.min_micro_batch:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} is below {objective.min_micro_batch}, the smallest "
                f"objective {self.objective} trains: trl's {objective.trainer} estimates the KL term from each "
                "example's prompt with another example's answer in the same micro-batch; set micro_batch_size: "
                f"{objective.min_micro_batch} or more (lower gradient_accumulation_steps to keep the effective batch)"
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
        """The parent adapter was trained on this recipe's base model and brings its own lora: settings: a lora: key
        given otherwise is refused (it would be ignored), and the recipe then holds the parent's values."""
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

    def public_snapshot(self) -> dict[str, Any]:
        """The snapshot without the fields marked Secret (what publish and the trackers get)."""
        snap = self.snapshot()
        for key in secret_keys(Recipe):
            *section, name = key.split(".")
            owner = snap
            for part in section:
                owner = owner.get(part) or {}
            owner.pop(name, None)
        return snap

    def redact(self, text: str) -> str:
        """`text` with every string held by a field marked Secret replaced by <secret> (what a log line may say)."""
        for key in secret_keys(Recipe):
            value = self
            for part in key.split("."):
                value = getattr(value, part)
            for leaf in sorted(_strings(value), key=len, reverse=True):
                text = text.replace(leaf, "<secret>")
        return text

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
                # scores: (answer or form) is what the plan checks, not what trains: a run of an earlier ftrun resumes
                out["reward"] = [r.model_dump(mode="json", exclude={"scores"}) for r in self.rewards]
        if self.init_from is not None:  # the parent adapter's weights, not only its path
            out["init_from"] = _weights_sha256(parent_adapter(self.init_from))
        return out

    def trajectory_hash(self) -> str:
        blob = json.dumps(self.trajectory(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def parent_adapter(init_from: str) -> Path:
    """The adapter folder `init_from` names: a run directory's final/adapter, or an adapter folder itself; ValueError
    saying what is there otherwise."""
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


def has_adapter(init_from: str) -> bool:
    """Whether parent_adapter finds an adapter where `init_from` points."""
    try:
        parent_adapter(init_from)
    except ValueError:
        return False
    return True


def _strings(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) and value else []


def _weights_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("adapter_model.*")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def explain() -> str:
    """Every recipe key with its default and documentation."""
    rows = []
    for key, field in fields(Recipe):
        if not is_section(field):
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            rows.append(f"{key:32} {default:14} {field.description or ''}")
    return "\n".join(rows)
