"""(Recipe, Hardware, DataStats) -> Plan: engine, memory, tokens, time, cost, with reasons; refuses with advice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from launcher.plan import attention
from launcher.plan import gguf_readiness
from launcher.plan import packing
from launcher.plan import sizing, sizing_constants
from launcher.plan import loss_head
from launcher.plan import throughput
from launcher.plan import sampling
from launcher.plan import speed
from launcher.plan import vision
from launcher.errors import MissingSoftware, PlanError, RecipeError
from launcher.methods import is_adapter
from launcher.plan import engine as engine_choice
from launcher.plan.advice import (
    _box_rows,
    _fixes_here,
    _missing_message,
    _pick_alternatives,
    _refusal_message,
    _refusal_options,
    cheapest_rental,
)
from launcher.plan import engine_software
from launcher.plan.choice import SHARDING_ENGINES, WORKDAY_HOURS, Choice
from launcher.plan.engine import choose
from launcher import methods
from launcher.plan.figures import UNIT, _fmt_hours, _fmt_tokens
from launcher.plan.hardware import Hardware
from launcher.plan.job import Job, _job, _steps_and_tokens
from launcher.plan.mfu import _mfu_basis
from launcher.plan.models import Architecture, load_architecture
from launcher.plan.plan_records import _apply_smoke, _gpus_dict, _memory_dict, _model_dict
from launcher.plan.task_eval_forecast import _task_eval_note, _task_eval_time
from launcher.recipe import TOKENS_MEANING


SETUP_MINUTES = 5.0  # a rented box's start, image pull or pip install (the article: 5-10 min with the download)


@dataclass
class Plan:
    fits: bool
    engine: str
    device: str  # "cuda" | "cpu"
    num_processes: int
    gpus: dict[str, Any]  # {name, count, memory_gb}
    model: dict[str, Any]
    method: str
    memory: dict[str, Any]
    tokens: dict[str, Any]
    estimate: dict[str, Any]  # {hours, cost_eur}
    price_per_hour_eur: float | None  # the whole box; None when no price is known
    total_steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_every_steps: int
    # the recipe's checkpoint_every_minutes: checkpoints follow the clock, checkpoint_every_steps is its estimate
    checkpoint_every_minutes: float | None = None
    reasons: list[str] = field(default_factory=list)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    offload_params: bool = False  # parameters in CPU RAM (fsdp_offload_params; DeepSpeed's offload_param)
    offload_optimizer: bool = False  # DeepSpeed ZeRO-3 offload_optimizer (launcher/worker/engines/deepspeed.py)
    offload_activations: bool = False  # TRL's activation_offloading (launcher/worker/trainer_config.py)
    refusal: dict[str, Any] = field(default_factory=dict)  # when fits is False: message, why, missing, options
    cheapest_rental: dict[str, Any] | None = None  # the catalog box that runs the job for the least money
    speed: dict[str, Any] | None = None  # the faster settings the plan chose (launcher/plan/speed.py record)
    # what the job needs that this box lacks although it fits (llama.cpp for a GGUF export): {"message", "fix"}
    blocked: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("refusal", "cheapest_rental", "speed", "blocked"):
            d[key] = d[key] or None
        return {"fits": d.pop("fits"), "units": UNIT, **d}


def make_plan(recipe: Any, hardware: Hardware, *args: Any, **kwargs: Any) -> Plan:
    """plan_for's plan, raised when it does not fit (PlanError) or needs software this machine lacks
    (MissingSoftware): the fix in .fix, the plan in .plan."""
    plan = plan_for(recipe, hardware, *args, **kwargs)
    if not plan.fits:
        missing = plan.refusal.get("missing")
        err_type = MissingSoftware if missing else PlanError
        options = plan.refusal["options"]
        # one option on the Fix: line itself, several listed under it (never a Fix: line with nothing on it)
        fix = options[0] if len(options) == 1 else "one of:\n  - " + "\n  - ".join(options) if options else None
        err = err_type(plan.refusal["message"], fix=fix)
        err.plan = plan
        raise err
    if plan.blocked:
        err = MissingSoftware(plan.blocked["message"], fix=plan.blocked["fix"])
        err.plan = plan
        raise err
    return plan


def _price(recipe: Any, hardware: Hardware, price: float | None) -> tuple[float | None, str]:
    if price is not None:
        return price, "--price"
    if recipe.price_per_hour_eur is not None:
        return recipe.price_per_hour_eur, "recipe price_per_hour_eur"
    if hardware.is_cpu_only:
        return 0.0, "a CPU box, no GPU price"
    if hardware.price_per_hour_eur is not None:
        return hardware.price_per_hour_eur, f"catalog: {hardware.count} x {hardware.gpu.name}"
    return None, "unknown"


def _download(recipe: Any, arch: Architecture, engine: str, allow_network: bool) -> tuple[Any, list[str]]:
    """What the run downloads, and the plan's lines about it (which 4-bit repository, and why)."""
    from launcher.plan.models import download_size, prequantized_repo

    repo = prequantized_repo(recipe.model, recipe.method)
    lines = []
    if repo and engine == "unsloth":
        got = download_size(recipe.model, arch, repo, allow_network)
        lines.append(
            f"weights: the pre-quantized 4-bit repository {repo} instead of {recipe.model} (same model, "
            "NF4 already: about a quarter of the download, no quantization at load)"
        )
        return got, lines
    got = download_size(recipe.model, arch, None, allow_network)
    if repo:
        lines.append(
            f"weights: {recipe.model} in 16-bit, quantized to 4 bits while loading ({engine} loads the "
            f"recipe's model); the pre-quantized {repo} is about a quarter of the download: "
            f"model={repo} to use it"
        )
    return got, lines


def plan_for(
    recipe: Any,
    hardware: Hardware,
    data_stats: Any = None,
    tokens: float | None = None,
    unsloth_available: bool | None = None,
    smoke: dict[str, Any] | None = None,
    workday_hours: float = WORKDAY_HOURS,
    arch: Architecture | None = None,
    nnodes: int = 1,
    price: float | None = None,
    box_reason: str | None = None,
    allow_network: bool = True,
    tokens_from: str = "--tokens",
) -> Plan:
    """The plan, fitting or not (Plan.fits False: the memory needed, the reasons, the options in .refusal)."""
    arch = arch or load_architecture(recipe.model)
    unsloth_ok, software = engine_software.software(hardware, unsloth_available)
    job, notes = _job(recipe, arch, data_stats, tokens, tokens_from)
    kernels = attention.box_kernels(hardware)
    job = replace(job, dense_mask=attention.dense_mask(kernels["implementation"], "trl", job.padding_free))
    notes += _positions_note(recipe, arch)
    blocked = None
    try:  # each requested output can be made; a missing install is said after the plan, which it does not change
        notes += gguf_readiness.plan_check(recipe, this_box=hardware.source == "detected")
        sampling.software_check(recipe, this_box=hardware.source == "detected")  # generation: vllm
    except MissingSoftware as exc:
        blocked = {"message": exc.message, "fix": exc.fix}
    notes += vision.notes(arch, recipe, data_stats)  # a vision-language model: its tower, images, LoRA's reach
    notes += _task_eval_note(recipe, data_stats)
    notes += _learning_rate_note(recipe)
    forced = recipe.engine
    wanted = None if recipe.num_processes == "auto" else int(recipe.num_processes)
    offload = getattr(recipe, "offload", "auto")  # a recipe-like namespace (the GPU check's) may not name it
    choice = engine_choice.choose_with_software(
        job, hardware, forced, unsloth_ok, workday_hours, processes=wanted, nnodes=nnodes, offload=offload
    )
    if choice.fits:
        vision.refuse_sharded_without_images(choice.engine, forced, data_stats)
    rows = _box_rows(job, forced if forced in ("auto", *SHARDING_ENGINES) else "auto", True, workday_hours)
    alternatives = _pick_alternatives(rows)
    g = hardware.gpu
    box = [f"box: {box_reason}"] if box_reason else []
    head = [f"model {arch.name}: {_fmt_tokens(arch.params)} params ({arch.source})"] + box + [software]

    est = choice.estimate
    sizable = choice.engine in ("trl", "unsloth", "ddp", *SHARDING_ENGINES)
    if not choice.fits and est is None and choice.device == "cuda" and sizable:
        # a forced engine refused before sizing: the JSON still says what the job needs on it
        est = sizing.memory(job.arch, job.workload(choice.engine, max(1, choice.processes), "cuda"))
    if not choice.fits:
        options = (
            []
            if choice.missing
            else _refusal_options(job, hardware, forced, unsloth_ok, workday_hours, rows, offload, wanted, nnodes)
        )
        if choice.missing:
            options = [
                f"install {choice.missing} on this machine (the fix is above), or plan for a rented box with "
                f"--gpus, which assumes {engine_software.IMAGE_SOFTWARE}"
            ]
            if choice.missing == "unsloth" and forced == "auto":  # or change the recipe so that TRL fits here
                options += _fixes_here(job, hardware, forced, unsloth_ok, workday_hours, offload, wanted, nnodes)
        message = _missing_message(job, choice) if choice.missing else _refusal_message(job, hardware, choice)
        return Plan(
            fits=False,
            **_shared(job, hardware, choice, arch, est, alternatives, notes, rows),
            memory=_memory_dict(est, choice, {}) if est else {"capacity_gb": round(choice.capacity_gb, 1)},
            tokens={"training_tokens": job.training_tokens, "source": job.tokens_source, "seq_len": job.seq_len},
            estimate={"hours": choice.hours, "cost_eur": None},
            price_per_hour_eur=None,
            total_steps=0,
            checkpoint_every_steps=0,
            reasons=head + choice.reasons,
            refusal={"message": message, "why": choice.refusal, "missing": choice.missing or None, "options": options},
        )

    # the card's spare memory buys speed where the recipe leaves the settings to the plan
    sped = speed.faster(
        job,
        choice,
        speed.left_to_plan(recipe),
        lambda j: choose(
            j, hardware, forced, unsloth_ok, workday_hours, processes=wanted, nnodes=nnodes, offload=offload
        ),
    )
    sped_record = speed.record(job, sped)
    if sped:
        job, choice = sped.job, replace(sped.choice, reasons=sped.choice.reasons + sped.reasons)
        est = choice.estimate
    sampling.check_batch(recipe, choice.processes)
    steps, training = _steps_and_tokens(job, choice.processes)
    # one value for every figure that shows it (the time's reason line and "Speed:" printed 1,587 and 1,586)
    tps = round(choice.tokens_per_second, 1)
    reasons = head + choice.reasons
    download, download_lines = _download(recipe, arch, choice.engine, allow_network and choice.device == "cuda")
    reasons += download_lines
    measured: dict[str, Any] = {}
    if smoke:
        applied = _apply_smoke(smoke, choice)
        measured = applied["measured"]
        notes += applied["notes"]
        tps = round(measured.get("tokens_per_second", tps), 1)
    decode = sampling.decode_step(
        job, arch, g if choice.device == "cuda" else None, eager=not sampling.uses_vllm(recipe)
    )
    sampling_s = sampling.generation_seconds_per_step(job, decode)
    if training is None:
        hrs = None
        reasons.append("time and cost unknown: " + _no_tokens_hint(recipe))
    else:
        hrs = throughput.hours(training, tps) + choice.load_hours  # loading that the smoke test does not measure
        if sampling_s and "tokens_per_second" not in measured:  # a measured rate holds the sampling already
            hrs += sampling_s * steps / 3600
    box_price, price_src = _price(recipe, hardware, price)
    if box_price is None:
        notes.append(
            f"no price known for {hardware.gpu.name}: cost not shown; give the box's price with "
            "--price EUR/h (or price_per_hour_eur in the recipe)"
        )
    cost = hrs * box_price if hrs is not None and box_price is not None else None
    kind = "measured by the smoke test" if "tokens_per_second" in measured else "estimated"
    precision = throughput.training_precision(choice.device, g.compute_capability if g else None)
    if precision == "fp16":
        cc = ".".join(map(str, g.compute_capability))
        rate = (
            f"speed and time count {g.tflops_bf16:g} TFLOP/s, its fp16 tensor rate (catalog)"
            if g.tflops_bf16
            else f"it is not in the catalog, so the estimate assumes {throughput.UNKNOWN_GPU_TFLOPS:g} TFLOP/s, more "
            "than cards before Ampere reach; the smoke test measures it"
        )
        reasons.append(
            f"precision fp16 with loss scaling: {g.name} (compute capability {cc}) has no bf16 tensor "
            f"cores (they start at 8.0); {rate}"
        )
        kind += ", fp16"
    attn = attention.implementation(choice.device, precision == "bf16", kernels["flash_attn"], kernels["torch_varlen"])
    dense = attention.dense_mask(attn, choice.engine, job.rows_hold_several_examples)
    attention_line = attention.reason(
        choice.device,
        attn,
        padding_free_rows=dense,
        torch_label=kernels["torch"],
        why_not_varlen=attention.why_not_varlen(precision == "bf16", kernels["torch"]),
    )
    if attention_line:
        reasons.append(attention_line)
    packed = packing.decision(recipe, choice.engine, attn)
    if packed:
        reasons.append(packed)
    reasons.append(_loss_reason(job, choice, est))
    reasons += _objective_reasons(recipe, job, data_stats)
    reasons += sampling.reasons(
        recipe, job, steps, sampling_s, "tokens_per_second" in measured, decode=decode, data_stats=data_stats
    )
    if hrs is not None:
        money = (
            f"cost at {box_price:.2f} EUR/h ({price_src}) = {cost:.2f} EUR"
            if cost is not None
            else "cost unknown (no price: --price EUR/h)"
        )
        sampled = " + sampling" if sampling_s and "tokens_per_second" not in measured else ""
        reasons.append(
            f"time: {training / 1e6:.2f}M training tokens / {tps:,.0f} tokens/s ({kind}){sampled} = "
            f"{_fmt_hours(hrs)}; {money}"
        )
    task_eval = _task_eval_time(recipe, data_stats, arch, g if choice.device == "cuda" else None, box_price)
    if task_eval:
        reasons.append(task_eval["reason"])
    setup_hours = None
    if choice.device == "cuda":
        setup_hours = SETUP_MINUTES / 60 + download.seconds() / 3600
    step_seconds = (job.micro_batch * job.accumulation * choice.processes * job.mean_tokens) / tps if tps else 0
    every = max(1, round(recipe.checkpoint_every_minutes * 60 / step_seconds)) if step_seconds else 1
    if steps:
        every = min(every, steps)
    total_hours = hrs + setup_hours if hrs is not None and setup_hours is not None else hrs

    return Plan(
        fits=True,
        **_shared(job, hardware, choice, arch, est, alternatives, notes, rows),
        memory=_memory_dict(est, choice, measured),
        tokens={
            "training_tokens": int(training) if training is not None else None,
            "meaning": TOKENS_MEANING,
            "tokens_per_second": round(tps, 1),
            "estimated_tokens_per_second": round(choice.tokens_per_second, 1),
            "seq_len": job.seq_len,
            "mean_tokens": round(job.mean_tokens, 1),
            "source": job.tokens_source,
            "precision": precision,
            "tokens_per_second_source": "measured" if "tokens_per_second" in measured else "estimated",
            **_mfu_basis(job, choice, g),
        },
        # to 0.04 s: the Time: line and `ftrun status` print these hours, and a short run shows seconds
        estimate={
            "hours": round(hrs, 5) if hrs is not None else None,
            "cost_eur": round(cost, 2) if cost is not None else None,
            "setup_hours": round(setup_hours, 3) if setup_hours is not None else None,
            "setup": (
                {"minutes": SETUP_MINUTES, "what": "box start and image pull or pip install"}
                if setup_hours is not None
                else None
            ),
            "download": download.to_dict() if choice.device == "cuda" else None,
            "total_hours": round(total_hours, 5) if total_hours is not None else None,
            "total_cost_eur": (
                round(total_hours * box_price, 2) if total_hours is not None and box_price is not None else None
            ),
            "task_eval": ({k: v for k, v in task_eval.items() if k != "reason"} if task_eval else None),
        },
        price_per_hour_eur=round(box_price, 2) if box_price is not None else None,
        total_steps=steps,
        checkpoint_every_steps=every,
        checkpoint_every_minutes=recipe.checkpoint_every_minutes,
        reasons=reasons,
        measured=measured,
        offload_activations=choice.offload_activations or job.offload_activations,
        speed=sped_record,
        blocked=blocked,
    )


def _shared(job: Job, hardware, choice: Choice, arch, est, alternatives, notes, rows) -> dict[str, Any]:
    """The fields a plan that fits and one refused both have, alike."""
    return dict(
        engine=choice.engine,
        device=choice.device,
        num_processes=choice.processes,
        gpus=_gpus_dict(hardware, choice),
        model=_model_dict(arch, est),
        method=job.method,
        micro_batch_size=job.micro_batch,
        gradient_accumulation_steps=job.accumulation,
        alternatives=alternatives,
        hardware=hardware.to_dict(),
        notes=notes + list(hardware.notes),
        offload_params=choice.offload_params,
        offload_optimizer=choice.offload_optimizer,
        cheapest_rental=cheapest_rental(rows),
    )


def _loss_reason(job: Job, choice: Choice, est: Any) -> str:
    """Which loss the engine computes and what it holds (sizing.memory's "logits and loss" term)."""
    c = choice
    w = job.workload(c.engine, c.processes, c.device, c.offload_params, c.offload_optimizer, c.offload_activations)
    t, vocab = w.tokens_per_micro_batch, job.arch.vocab
    whole = loss_head.whole_logits_bytes(t, vocab, choice.device) / sizing_constants.GB
    if w.loss_kind == sizing.LOSS_UNSLOTH:
        return (
            f"loss: Unsloth's fused cross-entropy, in chunks with the gradient in place "
            f"({est.breakdown_gb.get('logits and loss', 0.0):.2f} GB for {t:,} tokens x {vocab:,} vocabulary)"
        )
    trainer = methods.OBJECTIVES[job.objective].trainer
    if w.loss_kind == sizing.LOSS_MATERIALIZED:  # an objective whose loss reads the model's logits (methods.Objective)
        return (
            f"loss: the model's whole logits (trl's {trainer} takes them, not TRL's fused LM head): "
            f"{est.breakdown_gb.get('logits and loss', 0.0):.2f} GB for {t:,} tokens x {vocab:,} vocabulary "
            "(the logits, a copy for the loss, their gradient)"
        )
    head = loss_head.fused_head_bytes(job.arch, w) / sizing_constants.GB
    on = (
        "; on a CPU, a frozen head through ftrun's kernel, launcher/worker/cpu_logprob.py"
        if choice.device == "cpu" and is_adapter(job.method)
        else ""
    )
    as_trl = " (Unsloth's vision path, estimated as TRL's)" if choice.engine == "unsloth" else ""
    return (
        f"loss{as_trl}: TRL's fused LM head (trl's {trainer}{on}): the {t:,} x {vocab:,} logits of a micro-batch "
        f"are never whole, {head:.2f} GB at its peak instead of {whole:.1f} GB for the model's own loss; "
        # KTO's head returns no top-1 (trl 1.16 kto_trainer.py add_fused_lm_head outputs)
        + ("the entropy is" if methods.OBJECTIVES[job.objective].kl_forward else "token accuracy and entropy are")
        + " still logged (computed in the same pass)"
    )


def _objective_reasons(recipe: Any, job: Job, data_stats: Any = None) -> list[str]:
    """What a preference objective changes in the plan: its sequences, KTO's KL and classes, reference, parent."""
    objective = methods.OBJECTIVES[getattr(recipe, "objective", methods.DEFAULT_OBJECTIVE)]
    lines = []
    if objective.kl_forward:
        through = "the policy"
        if job.reference and sizing.REFERENCES[job.reference][1]:
            through = "the policy and the reference"
        elif job.reference:
            through = "the policy (the reference's log-probabilities of it are precomputed)"
        lines.append(
            f"objective {objective.name} (trl's {objective.trainer}): each example is one answer marked desirable or "
            f"undesirable, trained after its prompt; its KL sequence (the prompt with the answer of the micro-batch's "
            f"previous example, KTO's estimate of the policy's KL to the reference) runs forward without a gradient "
            f"through {through}: a micro-batch of {job.micro_batch} examples runs {job.micro_batch} sequences with "
            f"a gradient and {job.micro_batch} KL sequences; the data is shuffled once with the recipe's seed, then "
            "read in order (TRL's sequential sampler keeps each micro-batch's KL pairs)"
        )
        labels = getattr(data_stats, "labels", None)
        if labels:
            low, high = labels["desirable_weight_range"]
            ulow, uhigh = labels["undesirable_weight_range"]
            lines.append(
                f"classes: {labels['desirable']:,} desirable and {labels['undesirable']:,} undesirable answers, "
                f"preference.desirable_weight {labels['desirable_weight']:g} and undesirable_weight "
                f"{labels['undesirable_weight']:g}: the desirable side weighs {labels['ratio']:.2f} times the "
                + (
                    "undesirable one, within the 1 to 1.33 TRL recommends"
                    if labels["in_range"]
                    else f"undesirable one, outside the 1 to 1.33 TRL recommends (it warns): desirable_weight "
                    f"{low:g} to {high:g}, or undesirable_weight {ulow:g} to {uhigh:g}, would be inside"
                )
            )
    if objective.sequences_per_example > 1:
        lines.append(
            f"objective {objective.name} (trl's {objective.trainer}): each example is a pair, {job.sequences} "
            f"sequences "
            f"(the prompt with the chosen and with the rejected answer) in one batch: a micro-batch of "
            f"{job.micro_batch} pairs runs {job.micro_batch * job.sequences} sequences, and the tokens count both"
        )
    if job.reference:
        what, per_step = sizing.REFERENCES[job.reference]
        lines.append(
            f"reference: {what}; time counts its forward over every token "
            + ("each step" if per_step else "(once, before the first step)")
        )
    elif objective.preference:
        lines.append(f"reference: none ({objective.name} needs no reference model)")
    if getattr(recipe, "init_from", None):
        from launcher.recipe import parent_adapter

        lines.append(
            f"init_from: the adapter of {recipe.init_from} ({parent_adapter(recipe.init_from)}), LoRA "
            f"r={job.lora_r} as it was trained, trains on"
        )
    return lines


def _positions_note(recipe: Any, arch: Architecture) -> list[str]:
    """max_length against the positions the model's RoPE covers, its scaling said; beyond them a RecipeError."""
    limit, max_length = arch.max_positions, recipe.max_length
    if not limit or max_length <= limit:
        return []
    scaling = arch.rope_scaling
    if scaling is not None:
        kind, factor, original = scaling
        reach = int((original or limit) * factor) if factor else None
        if reach is None or max_length <= reach:
            return [
                f"max_length {max_length:,} is beyond the model's max_position_embeddings {limit:,}; its config's RoPE "
                f"scaling ({kind}"
                + (f", factor {factor:g} over {original or limit:,} positions: up to {reach:,}" if reach else "")
                + ") is what the positions past it rely on: the model trains and is served with that scaling "
                "(vLLM reads it from config.json)"
            ]
        raise RecipeError(
            f"max_length {max_length:,} is beyond what {recipe.model}'s RoPE covers even with its config's scaling "
            f"({kind}, factor {factor:g} over {original or limit:,} positions: {reach:,})",
            fix=f"set max_length: {reach} or less (longer examples are cut "
            "there; plain text can be packed with splitting: packing: true, trainer: {packing_strategy: bfd_split})",
        )
    raise RecipeError(
        f"max_length {max_length:,} is beyond {recipe.model}'s max_position_embeddings {limit:,} (config.json), and "
        "its config has no RoPE scaling: the model has never seen positions past it, and vLLM refuses a "
        "--max-model-len beyond it",
        fix=f"set max_length: {limit} or less (longer examples are cut there, or packed with splitting for plain "
        "text: packing: true, trainer: {packing_strategy: bfd_split}); or train a model with a longer context, or "
        "one whose config.json sets rope_scaling (YaRN) to extend it",
    )


def _learning_rate_note(recipe: Any) -> list[str]:
    """A preference objective left at the recipe's default learning rate, which is SFT's (LoRA): said, with TRL's."""
    objective = methods.OBJECTIVES[getattr(recipe, "objective", methods.DEFAULT_OBJECTIVE)]
    fields_set = getattr(recipe, "model_fields_set", set())
    if not objective.preference or "learning_rate" in fields_set:
        return []
    default = type(recipe).model_fields["learning_rate"].default
    return [
        f"learning_rate is the recipe's default {default:g}, a LoRA SFT rate; TRL's {objective.config} defaults to "
        f"{objective.learning_rate:g} for {objective.name}"
        + (", and DPO with LoRA usually trains at 5e-6 to 5e-5" if objective.name == "dpo" else "")
        + ": set learning_rate: in the recipe (the rewards in `ftrun status` show a rate too high as a margin that "
        + ("swings and a KL estimate that grows)" if objective.kl_forward else "swings and an accuracy that falls)")
    ]


def _no_tokens_hint(recipe: Any) -> str:
    return (
        f"the data file {recipe.data} is not on this machine and no token count was given: add `tokens: 15M` to "
        f"the recipe or pass --tokens 15M ({TOKENS_MEANING})"
    )
