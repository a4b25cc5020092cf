"""GRPO's sampling as the plan sees it: the batch TRL can split into answer groups, the time its generation adds to
each step, and the Why lines that say both.

Each optimizer step of TRL's GRPOTrainer first samples the answers its micro-batches train on (trl 1.16
grpo_trainer.py `_prepare_inputs`: one generation batch of per_device_train_batch_size x steps_per_generation answers
per process, steps_per_generation defaulting to gradient_accumulation_steps), then trains on them. The training
tokens/s of the plan's speed model count the forward and backward; generation is priced here from the decode
roofline (launcher/plan/throughput.py generation_tokens_per_second), each answer at its longest. The smoke test runs
real steps, generation inside, so a measured tokens/s already holds both.
"""

from __future__ import annotations

from typing import Any, Optional

from launcher import methods
from launcher.errors import RecipeError
from launcher.plan import throughput
from launcher.plan.figures import _fmt_hours


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
    """`generation: vllm` on the box that trains needs the vllm package (TRL 1.16 grpo_trainer.py imports it when
    use_vllm is set, after the model loaded): MissingSoftware before any training, as a GGUF export without
    llama.cpp. A plan for a rented box says it in its Why lines instead (`reasons`)."""
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


def generation_seconds_per_step(job: Any, arch: Any, gpu: Any) -> Optional[float]:
    """Seconds one optimizer step spends sampling on a GPU the catalog knows the bandwidth of (every answer at
    grpo.max_completion_length: an upper bound); None on a CPU or an unknown card (the smoke test measures it)."""
    if not job.completion_tokens or gpu is None:
        return None
    batch = job.micro_batch * job.accumulation
    tps = throughput.generation_tokens_per_second(arch, gpu.memory_bandwidth_gb_s, gpu.tflops_bf16, batch=batch)
    if not tps:
        return None
    return batch * job.completion_tokens / tps


def reasons(
    recipe: Any, job: Any, steps: int, per_step: Optional[float], measured: bool, data_stats: Any = None
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
        lines.append(
            f"sampling time: {batch} answers x {s.max_completion_length} tokens per step at the decode roofline = "
            f"{per_step:.1f} s a step, {_fmt_hours(per_step * steps / 3600)} over {steps:,} steps (every answer at "
            "its longest; the smoke test measures it)"
        )
    else:
        lines.append("sampling time: not estimated on this device; the smoke test measures it with the steps")
    return lines


def _reward_words(spec: Any) -> str:
    weight = "" if spec.weight == 1 else f"{spec.weight:g} x "
    if spec.function:
        return f"{weight}{spec.function.rpartition('/')[2]}"
    return f"{weight}the task metric {spec.metric}"
