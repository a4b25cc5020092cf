"""Engine unsloth: the model loaded by Unsloth, then the same TRL trainer, checkpoints and resume as engine trl.
Imported first (it patches transformers/trl/peft), in its own environment (docs/engines.md, "Why Unsloth has its own
environment")."""

from __future__ import annotations

import sys
from typing import Any

from launcher.methods import is_quantized
from launcher.plan.models import LINEAR_MODULES, prequantized_repo


def target_modules(targets: Any) -> list[str]:
    """LoRA targets for get_peft_model: "all-linear" is PEFT's shorthand, Unsloth wants the names."""
    if targets in (None, "all-linear", "all_linear"):
        return list(LINEAR_MODULES)
    if isinstance(targets, str):
        return [targets]
    return list(targets)


class UnslothUnavailable(RuntimeError):
    """`import unsloth` failed in the worker: the plan said unsloth, nothing else may train instead."""


def import_unsloth():
    """Import Unsloth before transformers/trl/peft (it patches them on import); raise with the reason if it fails."""
    late = [m for m in ("transformers", "trl", "peft") if m in sys.modules]
    try:
        import unsloth  # noqa: F401
    except Exception as exc:  # ImportError, or e.g. a CUDA torchvision's "operator torchvision::nms does not exist"
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:400]
        hint = ""
        if "torchvision" in text:
            hint = (
                " - a torchvision built for another torch (Unsloth pulls a CUDA build); on a CPU box "
                "`pip uninstall -y torchvision`, on a GPU box install the torchvision matching torch"
            )
        raise UnslothUnavailable(f"the plan says engine unsloth but `import unsloth` failed: {text}{hint}") from exc
    if late:
        print(
            f"[ftrun worker] warning: {', '.join(late)} imported before unsloth; Unsloth may not patch them fully",
            file=sys.stderr,
            flush=True,
        )
    return sys.modules["unsloth"]


def version() -> str:
    try:
        from importlib.metadata import version as _v

        return _v("unsloth")
    except Exception:
        return "unknown"


def load_model_and_tokenizer(recipe, device: str, dtype):
    """(model, tokenizer, source) from FastLanguageModel + get_peft_model, or FastVisionModel for a VLM."""
    if "unsloth" not in sys.modules:
        import_unsloth()
    from launcher.worker.loading import reads_images

    source = prequantized_repo(recipe.model, recipe.method) or recipe.model
    if reads_images(recipe.model):
        return (*_load_vision(recipe, source, dtype), source)
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=source, max_seq_length=recipe.max_length, load_in_4bit=is_quantized(recipe.method), dtype=dtype
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = recipe.lora
    model = FastLanguageModel.get_peft_model(
        model,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules(lora.target_modules),
        bias="none",
        use_gradient_checkpointing="unsloth" if recipe.gradient_checkpointing else False,
        random_state=recipe.seed,
    )
    return model, tokenizer, source


def _load_vision(recipe, source: str, dtype):
    """Unsloth 2026.10.9's FastVisionModel (unsloth/models/loader.py, vision.py): model and processor, LoRA."""
    from unsloth import FastVisionModel

    model, processor = FastVisionModel.from_pretrained(
        model_name=source,
        max_seq_length=recipe.max_length,
        load_in_4bit=is_quantized(recipe.method),
        dtype=dtype,
        use_gradient_checkpointing="unsloth" if recipe.gradient_checkpointing else False,
    )
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    model = FastVisionModel.get_peft_model(model, **vision_peft_arguments(model, recipe))
    return FastVisionModel.for_training(model), processor


def vision_peft_arguments(model, recipe) -> dict[str, Any]:
    """get_peft_model's arguments, with engine trl's modules: Unsloth's switches alone leave the patch merger out
    (unsloth_zoo/peft_utils.py get_peft_regex)."""
    from launcher.worker.loading import vision_targets

    lora = recipe.lora
    return dict(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        bias="none",
        finetune_vision_layers=bool(lora.vision_tower),
        finetune_language_layers=True,
        target_modules=vision_targets(model, lora),
        use_gradient_checkpointing="unsloth" if recipe.gradient_checkpointing else False,
        random_state=recipe.seed,
    )


# ChatML's turn openings, as Unsloth's Qwen2-VL notebooks pass them to UnslothVisionDataCollator
CHATML_PARTS = {"instruction_part": "<|im_start|>user\n", "response_part": "<|im_start|>assistant\n"}


def vision_collator(model, processor, recipe, args, collator_class=None):
    """UnslothVisionDataCollator (unsloth/trainer.py); resize="max" keeps the plan's image tokens; assistant_only_loss
    becomes its train_on_responses_only (trl 1.15 sft_trainer.py refuses it for images). `collator_class`: tests'."""
    if collator_class is None:
        from unsloth.trainer import UnslothVisionDataCollator as collator_class
    kwargs: dict[str, Any] = {"max_seq_length": recipe.max_length, "resize": "max"}
    if recipe.assistant_only_loss:
        turns = [{"role": r, "content": [{"type": "text", "text": r}]} for r in ("user", "assistant")]
        if not all(p in processor.apply_chat_template(turns, tokenize=False) for p in CHATML_PARTS.values()):
            raise ValueError(
                "assistant_only_loss: true with engine unsloth needs a ChatML chat template (<|im_start|>assistant): "
                "Unsloth's vision collator finds the answers by their turn openings; set engine: trl"
            )
        kwargs.update(train_on_responses_only=True, **CHATML_PARTS)
        args.assistant_only_loss = False
    return collator_class(model, processor, **kwargs)


def patched_modules(model) -> list[str]:
    """Names of module classes whose forward comes from Unsloth (its fast attention/MLP/norm kernels, GPU path)."""
    forwards = {type(m).__name__: getattr(type(m), "forward", None) for m in model.modules()}
    return sorted(name for name, fwd in forwards.items() if "unsloth" in (getattr(fwd, "__module__", "") or ""))


def markers(model, trainer=None) -> list[str]:
    """What shows that Unsloth built this model (its patched forwards, or FastCPUModel's marks on a CPU)."""
    found = []
    patched = patched_modules(model)
    if patched:
        found.append("patched forwards: " + ", ".join(patched[:6]))
    if any(vars(m).get("_unsloth_cpu_chunked_ce", False) for m in model.modules()):
        found.append("FastCPUModel chunked cross-entropy forward")
    attached = getattr(getattr(model, "for_training", None), "__func__", None)
    if "FastCPUModel" in getattr(attached, "__qualname__", ""):
        found.append("FastCPUModel methods")
    if getattr(getattr(model, "push_to_hub", None), "__name__", "") == "unsloth_push_to_hub":  # GPU: unsloth/save.py
        found.append("Unsloth's saving methods (patch_saving_functions)")
    if trainer is not None and getattr(type(trainer).compute_loss, "_unsloth_cpu", False):
        found.append("SFTTrainer.compute_loss patched by Unsloth (CPU)")
    return found


def checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """Before step 1: the model really was built by Unsloth, not by plain transformers (no silent fallback)."""
    loaded = "unsloth" in sys.modules
    model = trainer.model
    found = markers(model, trainer) if loaded else []
    # the model marks are required; the trainer patch alone would not make it an Unsloth model
    ok = loaded and any(not f.startswith("SFTTrainer") for f in found)
    if ok:
        seen = f"Unsloth {version()}: " + "; ".join(found)
    elif not loaded:
        seen = "unsloth is not imported in this worker"
    else:
        seen = "plain transformers modules (no Unsloth-patched forward, no FastCPUModel marks)"
    return [{"check": "model loaded by Unsloth", "ok": ok, "seen": seen}]
