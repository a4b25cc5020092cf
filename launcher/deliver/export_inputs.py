"""What an export starts from, checked before any model loads: the run's final result, the formats, the GGUF type."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher import export_formats, gguf_types, methods
from launcher.errors import UsageError
from launcher.plan import gguf_readiness
from launcher.store.rundir import RunDir


FORMATS = tuple(export_formats.FORMATS)  # the recipe's `export:` values, in the order they are made
# GGUF types: llama.cpp's converter writes f32/f16/bf16, its quantizer the rest from the 16-bit one (llamacpp_steps.py).
GGUF_TYPES = tuple(gguf_types.TYPES)


@dataclass(frozen=True)
class Inputs:
    run: RunDir
    recipe: Any
    source: Path  # final/adapter (LoRA methods) or final/model (full fine-tuning)
    is_adapter: bool
    formats: tuple[str, ...]
    gguf_type: str
    vision: bool  # a vision-language model (config.json vision_config): the processor's files, images in its checks


def check_inputs(run_dir: Path, formats: Optional[list[str]] = None, gguf_type: Optional[str] = None) -> Inputs:
    """Everything that can be wrong before loading a model: one `FtrunError` with the fix."""
    from launcher.recipe_loading import load_recipe

    run = RunDir(Path(run_dir))
    if not run.exists():
        raise UsageError(
            f"{run.root} is not an ftrun run directory (no recipe.yaml)",
            fix="give the run's output_dir or its recipe file, e.g. `ftrun export runs/tiny-cpu`.",
        )
    recipe = load_recipe(run.recipe)
    formats = list(formats if formats is not None else getattr(recipe, "export", ["adapter"]))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise UsageError(
            f"unknown export format(s) {', '.join(map(repr, unknown))}", fix=f"choose from {', '.join(FORMATS)}."
        )
    gguf_type = (gguf_type or getattr(recipe, "gguf_type", gguf_types.DEFAULT_TYPE)).lower()
    if gguf_type not in GGUF_TYPES:
        raise UsageError(
            f"unknown GGUF type {gguf_type!r}",
            fix=f"choose one of {', '.join(GGUF_TYPES)} (--gguf TYPE or gguf_type: in the recipe); "
            "q4_k_m is what Ollama serves by default.",
        )
    is_adapter = methods.is_adapter(recipe.method)
    source = run.final / ("adapter" if is_adapter else "model")
    weights = ("adapter_model.safetensors",) if is_adapter else ("model.safetensors", "model.safetensors.index.json")
    if not source.is_dir() or not any((source / w).is_file() for w in weights):
        from launcher.store.state import ACTIVE, effective_state

        state = effective_state(run)
        raise UsageError(
            f"{run.root} has no final {'adapter' if is_adapter else 'model'} yet (state: {state}); "
            f"export needs {source}",
            fix=(
                "the run finished but its result is not here (deleted, or a fresh box): `ftrun pull RECIPE` "
                "fetches it from sync.to; then export again."
                if state == "succeeded"
                else f"wait until the run has finished (`ftrun status {run.root}`), then run `ftrun export {run.root}`."
                if state in ACTIVE + ("planned",)
                else "resume the run with `ftrun RECIPE` until it finishes, then export."
            ),
        )
    model = recipe.model if is_adapter else str(source)
    if "gguf" in formats:
        check_gguf(model, gguf_type)
    from launcher.worker.loading import reads_images

    return Inputs(run, recipe, source, is_adapter, export_formats.made(formats), gguf_type, reads_images(model))


def _model_config(recipe_model: str, source: Path, is_adapter: bool) -> dict[str, Any]:
    cfg = (Path(recipe_model) / "config.json") if is_adapter else (source / "config.json")
    if cfg.is_file():
        return json.loads(cfg.read_text())
    return {}  # a Hub id whose config is not cached: the GGUF step checks again on the merged model


def check_gguf(model: str, gguf_type: str) -> gguf_readiness.Readiness:
    """The GGUF can be made here (llama.cpp installed, architecture and tokenizer supported), else one error."""
    ready = gguf_readiness.readiness(model, gguf_type)
    projector = gguf_readiness.projector_problem(model)  # a vision-language model's mmproj
    if projector:
        ready.problems.append(projector)
    if not ready.ok:
        raise UsageError(
            "a GGUF of this model cannot be made here: " + "; ".join(ready.all_problems),
            fix="fix the above, or export without gguf (the merged folder is what "
            "`ollama create -q q4_K_M` also takes, see SERVING.md).",
        )
    return ready
