"""GRPO's sampling as the plan sees it: the batch TRL can split into answer groups, the time its generation adds to
each step (per decode step, every answer at its longest: docs/sizing.md, "Sampling"), and the Why lines that say both.
Each step of trl 1.16's GRPOTrainer samples micro_batch x gradient accumulation answers per process first
(grpo_trainer.py _prepare_inputs); the smoke test's measured tokens/s holds both and replaces this forecast.
"""

from __future__ import annotations

from typing import Any, Optional

from launcher import methods
from launcher.errors import RecipeError
from launcher.plan import throughput
from launcher.plan.figures import _fmt_hours
from launcher.plan.sizing_constants import EAGER_OP_SECONDS


def generates(recipe: Any) -> bool:
    return methods.OBJECTIVES[getattr(recipe, "objective", methods.DEFAULT_OBJECTIVE)].generates


def check_batch(recipe: Any, processes: int) -> None:
    """TRL's rule (grpo_config.py __post_init__): the generation batch, micro_batch_size x processes x
    gradient_accumulation_steps answers, holds whole groups of num_generations answers of one prompt."""
    if not generates(recipe):
        return
    g = recipe.grpo.num_generations
    batch = recipe.micro_batch_size * processes * recipe.gradient_accumulation_steps
    if batch % g:
        per = recipe.micro_batch_size * processes
        fits = next(k for k in range(1, g + 1) if (per * k) % g == 0)
        raise RecipeError(
            f"grpo.num_generations {g} does not divide the batch of answers each step samples: micro_batch_size "
            f"{recipe.micro_batch_size} x {processes} process{'es' if processes > 1 else ''} x "
            f"gradient_accumulation_steps {recipe.gradient_accumulation_steps} = {batch} (TRL's GRPOTrainer groups "
            f"the {g} answers of each prompt within it)",
            fix=f"set gradient_accumulation_steps to a multiple of {fits}, or grpo.num_generations to a divisor of "
            f"{batch}",
        )


def software_check(recipe: Any, this_box: bool) -> None:
    """`generation: vllm` on the box that trains needs the vllm package (TRL 1.16 grpo_trainer.py imports it after the
    model loaded): MissingSoftware before any training. A plan for a rented box says it in `reasons` instead."""
    if not generates(recipe) or recipe.grpo.generation != "vllm" or not this_box:
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        from launcher.errors import MissingSoftware

        raise MissingSoftware(
            "grpo.generation: vllm needs the vllm package on this box, and it is not installed (TRL's GRPOTrainer "
            "would fail to import it after the model loaded)",
            fix="pip install vllm (a version TRL 1.16 supports, on a box with a GPU), or set grpo.generation: "
            "generate (transformers' generate, no vLLM needed)",
        )


def uses_vllm(recipe: Any) -> bool:
    """Whether the run samples answers with vLLM (grpo.generation vllm) rather than transformers' eager generate."""
    return generates(recipe) and recipe.grpo.generation == "vllm"


def decode_step(job: Any, arch: Any, gpu: Any, eager: bool = True) -> Optional[tuple[float, str]]:
    """One decode step of the generation batch and what bounds it (throughput.decode_step_seconds, the cache at the
    prompt and half the answer); None without answers or the card's bandwidth. `eager` False: vLLM's CUDA graphs."""
    if not job.completion_tokens or gpu is None or not gpu.memory_bandwidth_gb_s:
        return None
    context = max(0, job.seq_len - job.completion_tokens) + job.completion_tokens // 2
    batch = job.micro_batch * job.accumulation
    return throughput.decode_step_seconds(
        arch, gpu.memory_bandwidth_gb_s, gpu.tflops_bf16, batch, context, _lora_modules(job), launches=eager
    )


def _lora_modules(job: Any) -> int:
    """The adapted linears per layer, each one unmerged module in the decode (0 for full fine-tuning)."""
    return len(job.arch.resolve_targets(job.lora_targets)) if methods.is_adapter(job.method) else 0


def generation_seconds_per_step(job: Any, decode: Optional[tuple[float, str]]) -> Optional[float]:
    """Seconds one optimizer step spends sampling, every answer at its longest; None where decode_step is."""
    return None if decode is None else decode[0] * job.completion_tokens


def reasons(
    recipe: Any,
    job: Any,
    steps: int,
    per_step: Optional[float],
    measured: bool,
    decode: Optional[tuple[float, str]] = None,
    data_stats: Any = None,
) -> list[str]:
    """What GRPO changes in the plan: the answers per prompt, their longest length and where it comes from, what the
    probe of each reward found (launcher/data/rewards.py), where the answers are generated, what their time costs."""
    if not generates(recipe):
        return []
    s = recipe.grpo
    batch = job.micro_batch * job.accumulation
    lines = [
        f"objective grpo (trl's GRPOTrainer): each prompt is answered {s.num_generations} times (at most "
        f"{s.max_completion_length} tokens, temperature {s.temperature:g}) and each answer is rewarded by "
        + " + ".join(_reward_words(r) for r in recipe.rewards)
        + f"; a step samples {batch} answers ({batch // s.num_generations} prompts) per process, then trains on them"
    ]
    sized = getattr(data_stats, "completion_length", None)
    if sized and sized["why"] != "the recipe's":
        lines.append(f"grpo.max_completion_length {sized['tokens']}: {sized['why']}")
    lines += [f"probed {line}" for line in getattr(data_stats, "rewards", None) or ()]
    if s.generation == "vllm":
        lines.append(
            "generation: vllm (TRL's colocate mode: vLLM shares the card with training); the vllm package must be "
            "installed on the box, which ftrun's image does not include; the memory above leaves vLLM's share out"
        )
    else:
        lines.append("generation: transformers' generate in the training process (no vLLM needed)")
    if measured:
        lines.append("sampling time: inside the smoke test's measured steps (tokens/s counts generation and training)")
    elif per_step is not None:
        step_s, bound = decode or (per_step / s.max_completion_length, "")
        why = {
            "launch": f"bound by launching {throughput.decode_kernels(job.arch, _lora_modules(job), batch):,} "
            f"kernels a step from Python at {EAGER_OP_SECONDS * 1e6:g} us each, transformers' eager generate"
            + (f" with {_lora_modules(job)} unmerged LoRA modules a layer" if _lora_modules(job) else ""),
            "memory": "bound by reading the weights and the KV cache once a step",
            "compute": "bound by the batch's matrix products",
        }.get(bound)
        lines.append(
            f"sampling time: {batch} answers x {s.max_completion_length} tokens per step, {step_s * 1000:.1f} ms a "
            f"decode step{f' ({why})' if why else ''} = {per_step:.1f} s a step, {_fmt_hours(per_step * steps / 3600)} "
            f"over {steps:,} steps (every answer at its longest; the smoke test measures it)"
        )
    else:
        lines.append("sampling time: not estimated on this device; the smoke test measures it with the steps")
    return lines


def _reward_words(spec: Any) -> str:
    return f"{'' if spec.weight == 1 else f'{spec.weight:g} x '}{spec.kind.words(spec.value)}"
