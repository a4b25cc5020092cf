"""The training methods and objectives as tables: one row a method (qlora, lora, full, full-8bit) and one row an
objective (sft, dpo, orpo, kto, grpo); every question about one asks these rows. A root leaf: every stage asks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Method:
    name: str
    adapter: bool  # trains LoRA adapters on a frozen base (saved as an adapter); else every weight (a whole model)
    quantized: bool  # the frozen base is loaded in 4-bit NF4 (bitsandbytes) on a GPU
    eight_bit_optimizer: bool  # AdamW's m and v in 8 bits (bitsandbytes' adamw_8bit)
    # Bytes per trained parameter on a GPU in bf16 (docs/sizing.md): adapter fp32 weight, gradient, AdamW m and v;
    # full bf16 weight and gradient, fp32 master + m and v (12 B) or 8-bit m and v (2 B)
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    mfu: float  # model FLOPs utilization the time estimate assumes before a smoke test measures the real rate
    title: str  # how a model card names it
    help: str  # what it is, for the recipe's help
    lighter: Optional[str] = None  # the method an out-of-memory re-plan switches to (auto_adjust: method/optimizer)
    lighter_by: str = ""  # the auto_adjust entry that allows the switch
    lighter_why: str = ""  # what the switch changes, as the re-plan says it

    @property
    def bitsandbytes(self) -> bool:
        """It needs bitsandbytes (a 4-bit base or an 8-bit optimizer), whose CPU support is limited."""
        return self.quantized or self.eight_bit_optimizer

    @property
    def trained_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        # MFU: 0.28 measured on one H200 (Qwen3-8B, LoRA and full); QLoRA unmeasured, LoRA's x 0.32 / 0.34 from the
        # article's time table (docs/sizing.md, "Time and cost")
        Method(
            "qlora",
            adapter=True,
            quantized=True,
            eight_bit_optimizer=False,
            weight_bytes=4,
            gradient_bytes=4,
            optimizer_bytes=8,
            mfu=0.26,
            title="QLoRA (4-bit base, LoRA adapters)",
            help="4-bit base + LoRA",
        ),
        Method(
            "lora",
            adapter=True,
            quantized=False,
            eight_bit_optimizer=False,
            weight_bytes=4,
            gradient_bytes=4,
            optimizer_bytes=8,
            mfu=0.28,
            title="LoRA",
            help="16-bit base + LoRA",
            lighter="qlora",
            lighter_by="method",
            lighter_why="4-bit base model",
        ),
        Method(
            "full",
            adapter=False,
            quantized=False,
            eight_bit_optimizer=False,
            weight_bytes=2,
            gradient_bytes=2,
            optimizer_bytes=12,
            mfu=0.28,
            title="full fine-tuning",
            help="AdamW",
            lighter="full-8bit",
            lighter_by="optimizer",
            lighter_why="8-bit AdamW states",
        ),
        Method(
            "full-8bit",
            adapter=False,
            quantized=False,
            eight_bit_optimizer=True,
            weight_bytes=2,
            gradient_bytes=2,
            optimizer_bytes=2,
            mfu=0.28,
            title="full fine-tuning with 8-bit AdamW",
            help="8-bit AdamW",
        ),
    )
}


def described() -> str:
    return ", ".join(f"{m.name} ({m.help})" for m in METHODS.values()) + "."


def is_adapter(method: str) -> bool:
    return METHODS[method].adapter


def is_quantized(method: str) -> bool:
    return METHODS[method].quantized


@dataclass(frozen=True)
class Objective:
    name: str
    trainer: str  # TRL's trainer class, in `module`
    config: str  # its configuration class (the recipe's `trainer:` fields are checked against it)
    module: str  # where TRL keeps both (ORPO is in trl.experimental in trl 1.16)
    forms: tuple[str, ...]  # the canonical data forms it trains (launcher/data/formats.py FORMS)
    sequences_per_example: int  # sequences the forward pass runs per example (2 for a chosen/rejected pair)
    preference: bool  # preference tuning: it learns which of two answers is preferred (its `preference:` keys, rewards)
    reference_pass: bool  # a frozen reference model's log-probabilities are computed too (one more forward)
    settings: tuple[str, ...]  # the keys of its recipe section (`section`) that apply (the others are refused)
    logged: tuple[str, ...]  # the trainer's own logged metrics kept in metrics.jsonl (train rows; eval_ on eval rows)
    help: str  # what it is, for the recipe's help
    learning_rate: float  # the learning rate TRL's configuration defaults to, named when a recipe keeps SFT's
    # the trainer's own chat rendering (ORPO: maybe_apply_chat_template) keeps ftrun's Json columns as lists: the
    # worker renders them first with TRL's function
    templated_by_worker: bool = False
    # its loss reads the whole logits, not TRL's fused LM head (trl 1.16 experimental/orpo/orpo_trainer.py
    # concatenated_forward); the plan counts them (launcher/plan/sizing.py LOSS_MATERIALIZED)
    whole_logits: bool = False
    refuses: tuple[str, ...] = ()  # the recipe's switches it cannot honour: each is refused when set true
    refuses_why: str = ""  # why, as the refusal says it
    unsloth: bool = False  # engine unsloth trains it (FastLanguageModel with its own patched TRL trainer)
    section: str = "preference"  # the recipe section that holds its settings (launcher/recipe_sections.py SECTIONS)
    # it samples its own answers while training (scored by `reward:`): the data are prompts, generation is priced
    generates: bool = False
    # it trains on data with images (launcher/data/images.py): trl 1.16 sft_trainer.py
    # DataCollatorForVisionLanguageModeling, dpo_trainer.py DataCollatorForVisionPreference (`_is_vision_dataset`)
    images: bool = False
    # each answer also runs after another example's prompt, without a gradient: KTO's KL estimate (trl 1.16
    # kto_trainer.py add_kl_completion_ids, _compute_kl_logps); the plan prices those forwards
    kl_forward: bool = False
    # the smallest micro-batch it trains (KTOTrainer.__init__ refuses 1 with its KL term)
    min_micro_batch: int = 1


# What the pair trainers cannot honour (trl 1.16 dpo_trainer.py DPOTrainer.__init__ turns padding_free off)
_PAIRS_REFUSE = ("packing", "assistant_only_loss", "padding_free")
_PAIRS_WHY = "it trains a pair's answers after their prompt, padded side by side (TRL's preference collator)"
# What GRPO cannot honour: it batches its sampled answers (grpo_trainer.py _generate_and_score_completions)
_SAMPLES_REFUSE = ("packing", "assistant_only_loss", "padding_free")
_SAMPLES_WHY = "it trains on answers it samples itself, batched by TRL's GRPOTrainer"
# TRL's GRPO figures (grpo_trainer.py _generate_and_score_completions, _compute_loss)
_SAMPLED = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
)
# Each reward apart: rewards/<name>/mean and /std, <name> the function's __name__ (trl/trainer/utils.py
# get_callable_name; launcher/data/rewards.py metric_reward)
_PER_REWARD = ("rewards/", "/mean", "/std")


def is_reward_part(key: str) -> bool:
    """Whether a logged key is one reward's mean or spread (rewards/<name>/mean, /std), not DPO's rewards/margins."""
    prefix, mean, std = _PER_REWARD
    return key.startswith(prefix) and (key.endswith(mean) or key.endswith(std)) and key.count("/") >= 2


def reward_parts(row: dict[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """Each reward's {"mean", "std"} in a logged row, by name, in the row's order (empty for a row without them)."""
    prefix, mean, std = _PER_REWARD
    out: dict[str, dict[str, Optional[float]]] = {}
    for key, value in row.items():
        if not is_reward_part(key):
            continue
        name, _, which = key[len(prefix) :].rpartition("/")
        out.setdefault(name, {"mean": None, "std": None})[which] = value
    return out


# The recipe's default objective, and the one runs trained before objectives existed (their trajectory hash has none)
DEFAULT_OBJECTIVE = "sft"

# TRL's reward metrics for a pair (dpo_trainer.py DPOTrainer._compute_loss, orpo_trainer.py get_batch_loss_metrics)
_REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
# KTO's (trl 1.16 kto_trainer.py KTOTrainer._compute_loss): "chosen" desirable, "rejected" undesirable
_UNPAIRED_REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl", "logps/chosen", "logps/rejected")

OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective(
            "sft",
            trainer="SFTTrainer",
            config="SFTConfig",
            module="trl",
            forms=("chat", "prompt_completion", "text"),
            images=True,
            sequences_per_example=1,
            preference=False,
            reference_pass=False,
            settings=(),
            logged=(),
            help="supervised fine-tuning on examples",
            learning_rate=2e-5,
            unsloth=True,
            section="",
        ),
        Objective(
            "dpo",
            trainer="DPOTrainer",
            config="DPOConfig",
            module="trl",
            forms=("preference",),
            sequences_per_example=2,
            preference=True,
            reference_pass=True,
            settings=("beta", "loss_type", "reference"),
            logged=_REWARDS,
            help="Direct Preference Optimization on chosen/rejected pairs, against a frozen reference",
            learning_rate=1e-6,
            images=True,
            refuses=_PAIRS_REFUSE,
            refuses_why=_PAIRS_WHY,
        ),
        Objective(
            "orpo",
            trainer="ORPOTrainer",
            config="ORPOConfig",
            module="trl.experimental.orpo",
            forms=("preference",),
            sequences_per_example=2,
            preference=True,
            reference_pass=False,
            settings=("beta",),
            logged=_REWARDS + ("nll_loss", "log_odds_ratio"),
            help="ORPO on chosen/rejected pairs: SFT loss plus an odds-ratio term, no reference model",
            learning_rate=1e-6,
            templated_by_worker=True,
            whole_logits=True,
            refuses=_PAIRS_REFUSE,
            refuses_why=_PAIRS_WHY,
        ),
        Objective(
            "kto",
            trainer="KTOTrainer",
            config="KTOConfig",
            module="trl",
            forms=("unpaired",),
            sequences_per_example=1,
            preference=True,
            reference_pass=True,
            settings=("beta", "desirable_weight", "undesirable_weight", "reference"),
            logged=_UNPAIRED_REWARDS,
            help="KTO on unpaired answers, each marked desirable or undesirable (label), against a frozen reference",
            learning_rate=1e-6,
            refuses=_PAIRS_REFUSE,
            refuses_why="it trains each answer after its prompt, padded (TRL's unpaired preference collator)",
            kl_forward=True,
            min_micro_batch=2,
        ),
        Objective(
            "grpo",
            trainer="GRPOTrainer",
            config="GRPOConfig",
            module="trl",
            forms=("chat", "prompt_completion", "prompt"),
            # a micro-batch row is one sampled answer (grpo_config.py __post_init__)
            sequences_per_example=1,
            preference=False,
            reference_pass=False,  # grpo.beta > 0 adds one (launcher/plan/job.py reference_kind)
            settings=("num_generations", "max_completion_length", "beta", "temperature", "generation"),
            section="grpo",
            logged=_SAMPLED,
            help="GRPO: samples grpo.num_generations answers per prompt and learns from their rewards (reward: the "
            "task metric against each prompt's reference, or your function)",
            learning_rate=1e-6,
            # its log-probabilities come from TRL's fused LM head (grpo_trainer.py _get_per_token_logps_and_entropies)
            refuses=_SAMPLES_REFUSE,
            refuses_why=_SAMPLES_WHY,
            generates=True,
        ),
    )
}


def padding_free_objectives() -> tuple[str, ...]:
    """The objectives that honour padding_free (the others refuse it), in table order."""
    return tuple(name for name, o in OBJECTIVES.items() if "padding_free" not in o.refuses)


def preference_objectives() -> tuple[str, ...]:
    return tuple(name for name, o in OBJECTIVES.items() if o.preference)


def objectives_described() -> str:
    return ", ".join(f"{o.name} ({o.help})" for o in OBJECTIVES.values()) + "."


def trl_class(objective: str, what: str):
    """The objective's trainer (what='trainer') or configuration (what='config') class of the installed TRL."""
    import importlib
    import os

    o = OBJECTIVES[objective]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # ORPO's module warns on import that it is experimental
    return getattr(importlib.import_module(o.module), getattr(o, what))
