"""The recipe's sections: each nested mapping of a recipe (lora:, grpo:, eval:, ...) as a frozen, typed model."""

from __future__ import annotations

import re
from typing import Annotated, Any, Iterator, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from launcher import export_formats
from launcher.data import formats as data_formats
from launcher.data import rewards
from launcher.data import task_metrics
from launcher.store.sync import kinds as sync_kinds

ExportFormat = Literal[tuple(export_formats.FORMATS)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The mark of a recipe field whose value stays in the run directory: publish, the trackers' config and the logs leave
# it out (Recipe.public_snapshot, Recipe.redact). One word at the declaration: `on_finish: Secret[list[list[str]]]`.
SECRET = "secret"
Secret = Annotated[TypeVar("T"), SECRET]


def fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every field of `model` by its dotted key (lora.r), each section's own key before its fields'."""
    for name, field in model.model_fields.items():
        yield prefix + name, field
        if is_section(field):
            yield from fields(field.annotation, f"{prefix}{name}.")


def is_section(field: Any) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def secret_keys(model: type[BaseModel]) -> list[str]:
    """The dotted keys of `model`'s fields marked Secret, its sections' included."""
    return [key for key, field in fields(model) if SECRET in field.metadata]


class LoraSettings(Strict):
    r: int = Field(16, gt=0, description="LoRA rank; 16-64 gets most of the gain for style and format.")
    alpha: int = Field(16, gt=0, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA path.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="'all-linear' or a list such as [q_proj, v_proj]."
    )
    vision_tower: bool = Field(
        False,
        description="A vision-language model: adapt the vision tower's linear layers too. Off: the language model "
        "only, which vLLM serves as LoRA; on: the adapter is served merged (launcher/plan/vision.py).",
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


class PreferenceSettings(Strict):
    """The preference objectives' settings (launcher/methods.py OBJECTIVES names which apply to which)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo, kto: how far the policy may move from the reference (TRL's beta; "
        "higher stays closer); orpo: the weight of the odds-ratio term (ORPO's lambda).",
    )
    loss_type: str = Field(
        "sigmoid",
        description="dpo: TRL's DPO loss (sigmoid is the DPO paper's; ipo, hinge, "
        "robust, ... as the installed trl names them).",
    )
    desirable_weight: float = Field(
        1.0,
        gt=0,
        description="kto: the weight of the desirable answers' loss (TRL's desirable_weight); with unequal classes "
        "TRL recommends desirable_weight x desirable answers / (undesirable_weight x undesirable answers) between 1 "
        "and 4/3 (the KTO paper's Eq. 8), which the plan checks.",
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="kto: the weight of the undesirable answers' loss (TRL's undesirable_weight)."
    )
    reference: Literal["auto", "precomputed"] = Field(
        "auto",
        description="dpo, kto: the reference's log-probabilities. auto: computed beside each step (LoRA: the base "
        "with the adapter switched off, or the parent adapter's frozen copy under init_from, no second model; full: a "
        "frozen copy of the model); precomputed: computed once over the data before training (one forward per "
        "example, no reference model kept in memory).",
    )


class GrpoSettings(Strict):
    """GRPO's settings (objective grpo; launcher/methods.py OBJECTIVES names them): what TRL's GRPOConfig takes."""

    num_generations: int = Field(
        4,
        ge=2,
        description="Answers sampled per prompt; each is rewarded against its group's mean (TRL's num_generations, "
        "at least 2). micro_batch_size x gradient_accumulation_steps x the GPUs counts answers and must be a "
        "multiple of it.",
    )
    max_completion_length: int = Field(
        256,
        gt=0,
        description="Longest sampled answer in tokens; longer ones are cut (and said: clipped_ratio). Left out, where "
        "every reward is a metric and the data has references: twice the longest reference, at least 16 (the plan "
        "says so); else 256.",
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


class _Reward(Strict):
    """One reward GRPO trains on, of one kind of launcher/data/rewards.py KINDS (its fields, one per kind, come from
    there): a task metric against each prompt's reference, or a function of yours."""

    @model_validator(mode="after")
    def _one_source(self) -> "_Reward":
        given = [k for k in rewards.KINDS.values() if getattr(self, k.key) is not None]
        if len(given) != 1:
            kinds = " or ".join(f"a {k.key} ({k.key}: {k.example})" for k in rewards.KINDS.values())
            raise ValueError(f"a reward is either {kinds}: give one")
        wrong = given[0].form(getattr(self, given[0].key))
        if wrong:
            raise ValueError(wrong)
        if self.scores == "form" and given[0].reads_reference:
            raise ValueError(
                f"{given[0].key}: {getattr(self, given[0].key)} scores each answer against its reference, which is "
                "scores: answer; remove scores: form, or name a function of yours that rewards the form (function: "
                "rewards.py:NAME)"
            )
        return self

    @property
    def kind(self) -> rewards.RewardKind:
        return next(k for k in rewards.KINDS.values() if getattr(self, k.key) is not None)

    @property
    def value(self) -> Any:
        return getattr(self, self.kind.key)

    @property
    def name(self) -> str:
        """How the logs name it (TRL's rewards/<name>/mean)."""
        return self.kind.name(self.value)


RewardSpec = create_model(
    "RewardSpec",
    __base__=_Reward,
    **{k.key: (Optional[k.annotation], Field(None, description=k.scores)) for k in rewards.KINDS.values()},
    weight=(float, Field(1.0, description="Its weight in the sum of rewards (TRL's reward_weights).")),
    scores=(
        Literal["answer", "form"],
        Field(
            "answer",
            description="answer: it rewards right answers; the plan probes it with each probe prompt's right answer "
            "and a wrong one of the same form (same length, case and punctuation) and refuses it where both score "
            "alike (no signal: json on numbers, a length reward, a function that checks nothing). form: it rewards "
            "the answers' form (a format, think tags, length: trl.rewards:think_format_reward), which is probed only "
            "to vary; at least one reward of the recipe must score the answer.",
        ),
    ),
)


class SmokeSettings(Strict):
    enabled: bool = Field(True, description="Run the smoke test before the full run.")
    fraction: float = Field(0.01, gt=0.0, le=1.0, description="Share of the examples the smoke test trains on.")
    min_steps: int = Field(8, ge=2, description="At least this many optimizer steps, whatever the fraction.")
    max_minutes: float = Field(15.0, gt=0, description="Stop the smoke test after this long and extrapolate.")


DataFormat = Literal[tuple(data_formats.FORMATS)]


class DataSource(Strict):
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
    ignore: list[str] = Field(
        default_factory=list,
        description="Keys at the top of each record to leave out (an id, a source name): any other key a format does "
        "not read is refused, never dropped in silence; the plan names those left out.",
    )
    dataset: Optional[str] = Field(
        None,
        description="LLaMA-Factory: the dataset_info.json entry to read, as its `dataset:` names it; path: is then "
        "that dataset_info.json (or its folder, LLaMA-Factory's dataset_dir). The entry's file_name or hf_hub_url, "
        "formatting, ranking, columns and tags are read as LLaMA-Factory reads them.",
    )
    type: Optional[str] = Field(
        None,
        description="Axolotl: the dataset type (alpaca, completion, input_output, chat_template, chatml.intel, "
        "llama3.prompt_pairs, ..., launcher/data/axolotl.py), read as Axolotl reads it, with its field mappings below.",
    )
    # Axolotl's field mappings for type:, spelt as Axolotl spells them (launcher/data/axolotl.py OPTION_DEFAULTS)
    field_messages: Optional[str] = Field(None, description="Axolotl (type chat_template): the record's messages key.")
    message_property_mappings: Optional[dict[str, str]] = Field(
        None,
        description="Axolotl (type chat_template): message property -> the message's key, e.g. {role: from, "
        "content: value}.",
    )
    message_field_role: Optional[str] = Field(None, description="Axolotl (older): the message's role key.")
    message_field_content: Optional[str] = Field(None, description="Axolotl (older): the message's content key.")
    roles: Optional[dict[str, list[str]]] = Field(
        None, description="Axolotl (type chat_template): role -> the names the data gives it, e.g. {assistant: [gpt]}."
    )
    roles_to_train: Optional[list[str]] = Field(
        None, description="Axolotl: only [assistant] (answers-only loss; assistant_only_loss: false trains every turn)."
    )
    train_on_eos: Optional[str] = Field(
        None, description="Axolotl: only turn (each answer's end-of-turn token trains)."
    )
    field_system: Optional[str] = Field(None, description="Axolotl (type chat_template): the record's system key.")
    field_tools: Optional[str] = Field(None, description="Axolotl (type chat_template): the record's tool schemas key.")
    drop_system_message: Optional[bool] = Field(
        None, description="Axolotl (type chat_template): drop a first system turn."
    )
    field: Optional[str] = Field(None, description="Axolotl (type completion): the record's text key.")
    field_chosen: Optional[str] = Field(
        None, description="Axolotl (type chat_template.default): the chosen answer's key."
    )
    field_rejected: Optional[str] = Field(
        None, description="Axolotl (type chat_template.default): the rejected answer's key."
    )


class SyncSettings(Strict):
    to: Optional[str] = Field(None, description=f"Where checkpoints are copied: {sync_kinds.forms()}.")
    keep: int = Field(3, ge=1, description="Checkpoints kept at sync.to, and the final (on the box: keep_checkpoints).")
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


class TaskSettings(Strict):
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
        description="Training examples placed before each prompt, as earlier turns, for the base model's few-shot "
        "score (the reference article's first question: is a prompt with examples enough?).",
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


class EvalSettings(Strict):
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


class PublishSettings(Strict):
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
SECTIONS: dict[str, type[Strict]] = {"preference": PreferenceSettings, "grpo": GrpoSettings}
