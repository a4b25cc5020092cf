"""Export a finished run: adapter, merged 16-bit model, GGUF, serving commands; every output reloaded and checked.

Run as `python -m launcher.deliver.export --run-dir DIR [--formats adapter,merged,gguf] [--gguf-type q8_0]` (the
supervisor does, after a successful run) or through `ftrun export`. Writes into the run's `final/`:
`merged/` (safetensors + tokenizer + chat template), `gguf/<name>-<TYPE>.gguf` + `Modelfile`,
`SERVING.md`, and `export.json` with the parity numbers. An output outside its tolerance fails loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.notices import quiet_known_notices

quiet_known_notices()  # this process imports transformers and peft: their deprecation notices are not the user's

from launcher.store.checkpoint import atomic_write_json, tree_bytes  # noqa: E402
from launcher.data.task_verdict import FINE_TUNED
from launcher.plan import gguf_readiness  # noqa: E402
from launcher import export_formats, gguf_types, methods  # noqa: E402
from launcher.errors import FtrunError, UsageError  # noqa: E402
from launcher.store.rundir import RunDir  # noqa: E402
from launcher.deliver.messages import ExportError, _say, human_size, served_line  # noqa: E402
from launcher.deliver.parity import PARITY_PROMPTS, _check, compare, model_outputs, parity_prompts  # noqa: E402
from launcher.deliver.placement import (
    Loads,
    Placement,
    _to_export_dtype,
    available_ram,
    export_dtype,  # noqa: E402
    free_gpu_memory,
    load_adapter,
    load_model,
    merge_placement,
    parameter_count,
    parity_placement,
    release,
)
from launcher.deliver.gguf_export import (
    SIXTEEN_BIT,
    _GgufFailed,
    _safetensors_dtypes,
    _stop_ids,  # noqa: E402
    gguf_output,
)

FORMATS = tuple(export_formats.FORMATS)  # the recipe's `export:` values, in the order they are made
# GGUF types: llama.cpp's converter writes f32/f16/bf16, its quantizer the rest from the 16-bit file (llamacpp.py).
GGUF_TYPES = tuple(gguf_types.TYPES)


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Inputs:
    run: RunDir
    recipe: Any
    source: Path  # final/adapter (LoRA methods) or final/model (full fine-tuning)
    is_adapter: bool
    formats: tuple[str, ...]
    gguf_type: str


def check_inputs(run_dir: Path, formats: Optional[list[str]] = None, gguf_type: Optional[str] = None) -> Inputs:
    """Everything that can be wrong before loading a model: one `FtrunError` with the fix."""
    from launcher.recipe import load_recipe

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
                else "wait until the run has finished (`ftrun status "
                + str(run.root)
                + "`), then run `ftrun export "
                + str(run.root)
                + "`."
                if state in ACTIVE + ("planned",)
                else "resume the run with `ftrun RECIPE` until it finishes, then export."
            ),
        )
    if "gguf" in formats:
        check_gguf(recipe.model if is_adapter else str(source), gguf_type)
    order = export_formats.made(formats)
    return Inputs(run, recipe, source, is_adapter, order, gguf_type)


def _model_config(recipe_model: str, source: Path, is_adapter: bool) -> dict[str, Any]:
    cfg = (Path(recipe_model) / "config.json") if is_adapter else (source / "config.json")
    if cfg.is_file():
        return json.loads(cfg.read_text())
    return {}  # a Hub id whose config is not cached: the GGUF step checks again on the merged model


def check_gguf(model: str, gguf_type: str) -> gguf_readiness.Readiness:
    """The GGUF can be made here (llama.cpp installed, architecture and tokenizer supported), else one error."""
    ready = gguf_readiness.readiness(model, gguf_type)
    if not ready.ok:
        raise UsageError(
            "a GGUF of this model cannot be made here: " + "; ".join(ready.all_problems),
            fix="fix the above, or export without gguf (the merged folder is what "
            "`ollama create -q q4_K_M` also takes, see SERVING.md).",
        )
    return ready


# ---------------------------------------------------------------------------------------------
# The steps


def _write_dir_atomically(dst: Path, write: Callable[[Path], None]) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    os.replace(tmp, dst)


def _adapter_file_check(source: Path, tokenizer, why: str) -> dict[str, Any]:
    """What can be checked of an adapter without its base: it parses, and it is not empty (some lora_B non-zero;
    peft initialises B to zero, so an untrained or emptied adapter has none)."""
    from peft import PeftConfig
    from safetensors import safe_open

    config = PeftConfig.from_pretrained(str(source))
    path = source / "adapter_model.safetensors"
    pairs = nonzero = 0
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if "lora_B" in key:
                pairs += 1
                nonzero += int(bool(f.get_tensor(key).abs().max() > 0))
    if not pairs or not nonzero:
        raise ExportError(
            f"the adapter in {source} is empty ({nonzero} of {pairs} lora_B tensors non-zero): it "
            "does not change the base model",
            fix="the training saved an empty adapter; check train.log and metrics.jsonl.",
        )
    size = tree_bytes(path)
    return {
        "path": str(source),
        "bytes": size,
        "size": human_size(size),
        "rank": config.r,
        "changes_base_logits": None,
        "file_check": {"lora_B_nonzero": f"{nonzero}/{pairs}", "why": why},
        "chat_template": (source / "chat_template.jinja").is_file() or bool(tokenizer.chat_template),
    }


def export_run(run_dir: Path, formats: Optional[list[str]] = None, gguf_type: Optional[str] = None) -> dict[str, Any]:
    """Produce and check the requested outputs; writes final/export.json (also on failure) and SERVING.md."""
    run = RunDir(Path(run_dir))
    report: dict[str, Any] = {"run_dir": str(run.root), "started": time.time(), "outputs": {}, "ok": False}
    report_path = run.final / "export.json"
    try:
        inp = check_inputs(run_dir, formats, gguf_type)
        report.update(method=inp.recipe.method, model=inp.recipe.model, formats=list(inp.formats))
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        if Path(inp.recipe.model).is_dir():
            os.environ["HF_HUB_OFFLINE"] = "1"
        _export(inp, report)
        report["ok"] = True
    except FtrunError as exc:
        report["error"] = exc.message
        raise
    except Exception as exc:  # a library failure mid-export: recorded, then shown as an export failure
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise ExportError(
            f"{type(exc).__name__}: {exc}",
            fix="see the lines above; `ftrun export RUN_DIR --debug` shows the traceback.",
        ) from exc
    finally:
        report["seconds"] = round(time.time() - report.pop("started"), 1)
        if run.exists():  # never create files in a folder that is not a run
            run.final.mkdir(exist_ok=True)
            atomic_write_json(report_path, report)
    return report


def _export(inp: Inputs, report: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # Every model the export loads would draw transformers' "Loading weights: 0%|" bar between the export's own
    # lines (transformers 5.24 core_model_loading.py, tqdm(..., desc="Loading weights") through utils/logging.py's
    # tqdm); utils/logging.py disable_progress_bar turns off its bars and huggingface_hub's
    # (huggingface_hub.utils.disable_progress_bars). The export's lines say what is loaded and where.
    transformers_logging.disable_progress_bar()
    config = _model_config(inp.recipe.model, inp.source, inp.is_adapter)
    dtype = export_dtype(config)
    tokenizer = AutoTokenizer.from_pretrained(str(inp.source))
    if not tokenizer.chat_template:
        raise ExportError(
            f"{inp.source} has no chat template",
            fix="the base model's tokenizer needs one; "
            "a model served without its template answers in the wrong format.",
        )
    from launcher.deliver.served_prompt import ServedPrompt

    # What the training saw of the same held-out prompts: every servable output is held to it (served_prompt.py).
    served = ServedPrompt(inp.recipe, inp.source, PARITY_PROMPTS)
    report["served_prompt"] = served.report
    prompts = parity_prompts(inp.recipe, tokenizer, kwargs=served.kwargs)
    report["parity_prompts"] = [{"tokens": len(p["ids"]), "prompt_tokens": len(p["prompt_ids"])} for p in prompts]
    report["parity_prompts_from"] = prompts[0]["source"] if prompts else None
    # the dtype the exported 16-bit weights are written in (the merged folder, which gguf converts); the parity checks
    # load in their own (placement.parity). An adapter-only export writes none: the adapter keeps training's dtype.
    if "merged" in inp.formats:
        report["export_dtype"] = str(dtype).replace("torch.", "")

    # Where each model goes, decided before anything is loaded: a merge the box cannot hold fails here.
    n_params = parameter_count(inp.recipe.model if inp.is_adapter else str(inp.source))
    gpus_free, ram = free_gpu_memory(), available_ram()
    parity = parity_placement(n_params, dtype, gpus_free, ram)
    report["placement"] = {"parameters": n_params, "parity": parity.to_dict()}
    _say(f"parity checks: {parity.reason}")
    merge = None
    if "merged" in inp.formats:
        # a full fine-tune is only rounded to 16 bit, once whatever it is loaded in: float32 would only cost memory
        stored = str(config.get("dtype") or config.get("torch_dtype") or "") if inp.is_adapter else ""
        merge = merge_placement(n_params, dtype, gpus_free, ram, stored_float32=stored.endswith("float32"))
        report["placement"]["merge"] = merge.to_dict()
        _say(f"merge: {merge.reason}")
    loads = Loads()
    try:
        _export_models(inp, report, tokenizer, prompts, dtype, parity, merge, loads, served)
    finally:
        report["placement"]["loads"] = loads.log
    _say(served_line(report))


def _export_models(
    inp: Inputs,
    report: dict[str, Any],
    tokenizer,
    prompts,
    dtype,
    parity: Placement,
    merge: Optional[Placement],
    loads: Loads,
    served,
) -> None:
    """Every model is loaded where its placement says, used, and released before the next one is loaded, so
    the box holds one model at a time (the parity logits, a few MB, are what is kept between them)."""
    final = inp.run.final
    outputs = report["outputs"]
    merged_dir = final / "merged"
    if inp.is_adapter and parity.device_map is None:
        # Nothing here holds the 16-bit base, so its logits cannot be compared: the adapter is checked as a file.
        outputs["adapter"] = _adapter_file_check(inp.source, tokenizer, parity.reason)
        _say(
            f"adapter {outputs['adapter']['size']} (rank {outputs['adapter']['rank']}): checked as a file, not "
            f"by logits ({parity.reason})"
        )
        _served_folder(served, outputs["adapter"], "adapter", tokenizer, inp.recipe.model)
        return _serving(inp, report, tokenizer, served)
    if inp.is_adapter:
        _say(f"loading the base {inp.recipe.model} in {parity.dtype} and the adapter")
        base = load_model(inp.recipe.model, parity, loads)
        base_out = model_outputs(base, prompts, greedy=False)
        model = load_adapter(base, inp.source, parity, loads)
        ref = model_outputs(model, prompts)
        effect = compare(base_out, ref, "merged")
        rank = model.peft_config["default"].r
        del base, model, base_out
        release()
        size = tree_bytes(inp.source / "adapter_model.safetensors")
        outputs["adapter"] = {
            "path": str(inp.source),
            "bytes": size,
            "size": human_size(size),
            "rank": rank,
            # An adapter that does not move the logits is untrained or was saved empty.
            "changes_base_logits": {"mean_kl": effect["mean_kl"], "top1_agreement_with_base": effect["top1_agreement"]},
            "chat_template": (inp.source / "chat_template.jinja").is_file() or bool(tokenizer.chat_template),
        }
        if effect["max_abs_logit_diff"] == 0.0:
            raise ExportError(
                f"the adapter in {inp.source} does not change the base model's output",
                fix="the training saved an empty adapter; check train.log and metrics.jsonl.",
            )
        _say(
            f"adapter {human_size(size)} (rank {rank}), reloads and changes the base "
            f"(top-1 agreement with base {effect['top1_agreement']:.3f})"
        )
        _served_folder(served, outputs["adapter"], "adapter", tokenizer, inp.recipe.model)
        if merge is None:
            return _serving(inp, report, tokenizer, served)
        # both dtypes: the merge's arithmetic and what the merged folder holds (export.json's export_dtype)
        _say(
            f"merging the adapter into the {merge.dtype} base; the merged model is saved in "
            f"{str(dtype).replace('torch.', '')}"
        )
        # A fresh base in the export dtype, where the merge placement says: the merged weights are rounded once,
        # from the adapter's own precision (peft keeps float32 adapter weights over a 16-bit base).
        merged = load_adapter(load_model(inp.recipe.model, merge, loads), inp.source, merge, loads)
        merged = _to_export_dtype(merged.merge_and_unload(), dtype)
        kind = "merged"
    else:
        size = tree_bytes(inp.source)
        outputs["model"] = {"path": str(inp.source), "bytes": size, "size": human_size(size)}
        _served_folder(served, outputs["model"], "model", tokenizer, str(inp.source))
        if merge is None:  # the full model is already servable as it is
            return _serving(inp, report, tokenizer, served)
        _say(f"loading the full fine-tune {inp.source}")
        ref_model = load_model(str(inp.source), parity, loads)
        ref = model_outputs(ref_model, prompts)
        del ref_model
        release()
        merged = _to_export_dtype(load_model(str(inp.source), merge, loads), dtype)
        kind = "full:merged"

    def write_merged(tmp: Path, model=merged) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))

    _write_dir_atomically(merged_dir, write_merged)
    del merged, write_merged  # the merged weights' memory goes back before the reload
    release()
    dtypes = _safetensors_dtypes(merged_dir)
    saved_cfg = json.loads((merged_dir / "config.json").read_text())
    if "quantization_config" in saved_cfg or not dtypes <= SIXTEEN_BIT:
        raise ExportError(
            f"the merged model in {merged_dir} is not plain 16-bit (tensors: {sorted(dtypes)})",
            fix="report this with export.json; do not serve the merged folder.",
        )
    reloaded = load_model(str(merged_dir), parity, loads)
    merged_out = model_outputs(reloaded, prompts, to_end=served.chat)
    task = _task(inp)
    if task is not None:  # what the merged folder scores, as vLLM would serve it (its own tokenizer files)
        from transformers import AutoTokenizer

        from launcher.worker import task_eval

        stamp = (merged_dir / "config.json").stat().st_mtime_ns
        _score_export(
            inp,
            task,
            "merged",
            task_eval.score_model(
                reloaded,
                AutoTokenizer.from_pretrained(str(merged_dir)),
                inp.run.root,
                task,
                "merged",
                identity=f"merged {tree_bytes(merged_dir)} {stamp}",
            ),
        )
    del reloaded
    release()
    result = compare(ref, merged_out, kind, parity.dtype)
    size = tree_bytes(merged_dir)
    outputs["merged"] = {
        "path": str(merged_dir),
        "bytes": size,
        "size": human_size(size),
        "tensor_dtypes": sorted(dtypes),
        "parity_vs_" + ("base_plus_adapter" if inp.is_adapter else "full_model"): result,
    }
    _say(
        f"merged model {human_size(size)} in {merged_dir}: top-1 agreement {result['top1_agreement']:.4f}, "
        f"max |dlogit| {result['max_abs_logit_diff']:.3g}, greedy identical {result['greedy_identical']}"
    )
    _check("the merged model", result)
    del ref
    from transformers import AutoTokenizer

    # the merged folder as vLLM loads it: its own tokenizer files and generation_config.json
    _served_folder(served, outputs["merged"], "merged", AutoTokenizer.from_pretrained(str(merged_dir)), str(merged_dir))
    if served.chat:
        outputs["merged"]["ending"] = served.ending("merged", merged_out, _stop_ids(merged_dir, tokenizer))

    if "gguf" in inp.formats:
        try:
            outputs["gguf"] = gguf_output(
                merged_dir,
                final / "gguf",
                inp.run.root.name,
                inp.gguf_type,
                prompts,
                merged_out,
                tokenizer,
                parity.dtype,
                served=served,
                task=task,
            )
        except _GgufFailed as exc:
            outputs["gguf"] = exc.output  # the numbers of the failed check go into export.json
            raise
        answers = outputs["gguf"].pop("task_answers", None)
        if task is not None and answers is not None:
            _score_export(inp, task, f"gguf-{inp.gguf_type.lower()}", _scored(task, answers))
    _serving(inp, report, tokenizer, served)


def _task(inp: Inputs) -> Optional[dict[str, Any]]:
    """The run's task (RUN/task.json, launcher/worker/task_eval.py) when the recipe scores it and it can be scored:
    each export answers the same held-out prompts as the base and the fine-tuned model."""
    from launcher.worker import task_eval

    if not task_eval.enabled(inp.recipe) or not inp.run.task.is_file():
        return None
    task = json.loads(inp.run.task.read_text())
    return task if task_eval.scores(task) else None


def _scored(task: dict[str, Any], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """A score from answers generated outside transformers (the GGUF in llama.cpp), as task_eval.score_model gives."""
    from launcher.data import task_metrics

    scored = task_metrics.score(
        task["metric"], [a["answer"] for a in answers], [p["reference"] for p in task["prompts"]]
    )
    seconds = sum(a["seconds"] for a in answers)
    new_tokens = sum(a["new_tokens"] for a in answers)
    return {
        "score": scored["score"],
        "details": scored["details"],
        "examples": len(answers),
        "seconds": round(seconds, 3),
        "new_tokens": new_tokens,
        "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }


def _score_export(inp: Inputs, task: dict[str, Any], name: str, result: dict[str, Any]) -> None:
    """An export's score into the run's task_eval.json, final/task_eval.json and samples.md's table, beside the
    base and fine-tuned model's; said with the fine-tuned model's for comparison."""
    from launcher.worker import task_eval
    from launcher.worker.results import publish_scores

    results = task_eval.record(inp.run.root, task, name, result)
    publish_scores(inp.run, results)
    from launcher.worker import trackers

    # a finished run: its last step is its total (worker.json)
    step = int(json.loads(inp.run.worker.read_text()).get("total_steps") or 0) if inp.run.worker.is_file() else 0
    trackers.log_scores(
        inp.run.root, [t for t in inp.recipe.report_to if t != "none"], {name: result["score"]}, step, say=_say
    )
    tuned = results["scores"].get(FINE_TUNED)
    _say(
        f"task eval: {name} {result['score']:.1%} {task['metric']} on {result['examples']} held-out examples"
        + (f" (fine-tuned {tuned:.1%})" if tuned is not None else "")
        + (f", {result['tokens_per_s']:.0f} tokens/s generated" if result.get("tokens_per_s") else "")
    )


def _served_folder(served, output: dict[str, Any], key: str, tokenizer, config_from: str) -> None:
    """An exported folder as vLLM serves it: its chat template renders the held-out prompts to the trained ids,
    and vLLM's stops (the tokenizer's eos and generation_config.json's eos_token_id of `config_from`: the base
    model for an adapter, vllm/sampling_params.py update_from_generation_config) hold the trained end of turn."""
    if not served.chat:
        return
    label = {
        "adapter": "vLLM (the base model with the adapter folder's tokenizer)",
        "model": "vLLM (the fully fine-tuned model folder)",
        "merged": "vLLM (the merged folder)",
    }[key]
    output["served_prompt"] = served.compare_transformers(f"vllm_{key}", tokenizer, label)
    from launcher.model_files import local_file

    gen = local_file(config_from, "generation_config.json") or local_file(config_from, "config.json")
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen else None
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
    stops = sorted(set(gen_eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))
    where = f"{gen}" if gen else f"{config_from} (no generation_config.json on this box)"
    output["stops"] = served.check_stops(
        f"vllm_{key}",
        label,
        stops,
        generation_config=str(gen) if gen else None,
        generation_config_eos=gen_eos,
        tokenizer_eos=tokenizer.eos_token_id,
        fix=f"add the end-of-turn id to eos_token_id in {where} (vLLM stops on those and the tokenizer's eos), "
        "or pass the stop to each request (`stop_token_ids`); otherwise the served model talks past its answer.",
    )


# ---------------------------------------------------------------------------------------------
# Serving commands


def _serving(inp: Inputs, report: dict[str, Any], tokenizer, served=None) -> None:
    from launcher.deliver import serving

    merged_dir = inp.run.final / "merged"
    eos_ids = _stop_ids(merged_dir, tokenizer) if "merged" in report["outputs"] else None
    prompts = [p["messages"] for p in served.prompts] if served is not None and served.chat else None
    text, modelfile = serving.render(inp.run, inp.recipe, report, tokenizer, eos_ids=eos_ids, prompts=prompts)
    (inp.run.final / "SERVING.md").write_text(text)
    report["serving"] = str(inp.run.final / "SERVING.md")
    if modelfile is not None:
        path = inp.run.final / "gguf" / "Modelfile"
        path.write_text(modelfile["text"])
        report["outputs"]["gguf"]["modelfile"] = str(path)
        report["outputs"]["gguf"]["modelfile_template_check"] = modelfile["check"]
        if served is not None and served.chat:
            _served_modelfile(served, report["outputs"]["gguf"], modelfile["text"])
    _say(f"serving commands in {inp.run.final / 'SERVING.md'}")


def _served_modelfile(served, gguf: dict[str, Any], text: str) -> None:
    """The Modelfile as Ollama reads it: the template Ollama renders with it (ollama_template.choose, from the GGUF's
    own tokenizer.chat_template), rendered the Go-template way and tokenized by the GGUF's vocabulary (BOS added as
    the vocabulary says: Ollama's runner encodes with its special tokens), or llama-server's check where Ollama
    hands the messages to llama-server; and its PARAMETER stop values matched against the trained end-of-turn
    token's text."""
    from launcher.deliver import llamacpp
    from launcher.deliver.served_prompt import modelfile_parts

    template, stops = modelfile_parts(text)
    vocab = llamacpp.Vocabulary(Path(gguf["path"]))
    try:
        _served_by_ollama(served, gguf, template, vocab)
        pieces = {i: vocab.piece(i) for i in served.end_ids}
    finally:
        vocab.close()
    covered = served.covered_by_stops(pieces, stops)
    gguf["modelfile_stops"] = served.check_stops(
        "ollama",
        "Ollama with this Modelfile (PARAMETER stop)",
        covered,
        stop=stops,
        end_of_turn_text={str(i): p for i, p in pieces.items()},
        fix=f"add `PARAMETER stop {json.dumps(next(iter(pieces.values()), ''))}` to the Modelfile; Ollama stops on a "
        "stop value found in the generated text.",
    )


def _served_by_ollama(served, gguf: dict[str, Any], template: Optional[str], vocab) -> None:
    """Ollama's prompt against the trained one, counted as checked only where a token comparison was made: its Go
    template's rendering, or llama-server's (the same messages, the same template and vocabulary) where Ollama
    hands the chat to llama-server, as installed or with the OLLAMA_GO_TEMPLATE=0 SERVING.md asks for."""
    from launcher.deliver import go_template, ollama_template

    arch = gguf.get("architecture")
    own = vocab.llm.metadata.get("tokenizer.chat_template") or ""
    default = (gguf.get("modelfile_template_check") or {}).get("ollama") or {}
    choice = ollama_template.choose(own, template, arch)
    server = served.report["runtimes"].get("llama_server")
    runtimes = served.report["runtimes"]
    if choice["path"] == "go":
        try:
            ids = [vocab.tokenize(go_template.render(choice["template"], p["messages"]), True) for p in served.prompts]
        except go_template.Unsupported as exc:
            choice = {"path": "not modelled", "why": f"{choice['from']}: {exc} is beyond what ftrun renders"}
        else:
            label = f"Ollama ({choice['from']})"
            if not default.get("serve_with"):  # SERVING.md serves it as installed: a difference fails the export
                gguf["modelfile_served_prompt"] = served.compare("ollama", label, ids)
                served.checked("Ollama")
                return
            diffs = [served.difference(p["ids"], s) for p, s in zip(served.prompts, ids)]
            first = next(((n, d) for n, d in enumerate(diffs) if d is not None), None)
            as_installed = {
                "runtime": label,
                "identical": f"{diffs.count(None)}/{len(diffs)}",
                "first_difference": dict(first[1], prompt=first[0]) if first else None,
            }
            choice = dict(
                ollama_template.choose(own, template, arch, go_template_env=False),
                serve_with=default["serve_with"],
                as_installed=as_installed,
            )
    if choice["path"] == "native" and server is not None and server.get("ok"):
        env = " ".join(f"{k}={v}" for k, v in (choice.get("serve_with") or {}).items())
        runtimes["ollama"] = {
            "runtime": "Ollama" + (f" with {env}" if env else "") + ": " + choice["why"],
            "ok": True,
            "identical": server["identical"],
            "compared_as": "llama_server",
            **{k: choice[k] for k in ("serve_with", "as_installed") if k in choice},
        }
        if env:
            served.report["ollama_serve_with"] = choice["serve_with"]
        served.checked("Ollama")
        return
    why = choice["why"] if choice["path"] != "native" else "llama-server's check was not made"
    runtimes["ollama"] = {"runtime": "Ollama", "ok": True, "identical": None, "not_checked": why}


def _record_export(run: RunDir, formats: Optional[list[str]], started: float, info: dict[str, Any]) -> None:
    """A finished run's state after `ftrun export`: succeeded when the export passed its checks, else
    trained-not-exported (the training result is good; the export is not)."""
    from launcher.store.state import TRAINED, read_state, set_state

    if read_state(run).get("state") not in TRAINED:
        return
    info.update(formats=list(formats or inp_formats(run)), seconds=round(time.time() - started, 1))
    ok = info["state"] == "succeeded"
    set_state(
        run,
        "succeeded" if ok else "trained-not-exported",
        export=info,
        reason="training finished" if ok else f"trained, not exported: {info['reason']}",
    )


def inp_formats(run: RunDir) -> list[str]:
    from launcher.recipe import load_recipe

    return list(getattr(load_recipe(run.recipe), "export", []))


def export_command(run: RunDir, merged: bool = False, gguf: Optional[str] = None) -> int:
    """`ftrun export`: the recipe's export list, or adapter plus what the flags ask for; prints where things went.
    `run`: the run directory the command line named (launcher/cli.py resolves it)."""
    from launcher.store.state import RunLock

    formats = None
    if merged or gguf:
        formats = ["adapter", "merged"] + (["gguf"] if gguf else [])
    check_inputs(run.root, formats, gguf)  # bad input fails here, before the lock and the heavy imports
    lock = RunLock(run).acquire()  # the supervisor holds it while training or exporting
    started = time.time()
    try:
        report = export_run(run.root, formats, gguf)
    except FtrunError as exc:
        _record_export(
            run,
            formats,
            started,
            {"state": "failed", "reason": exc.message.splitlines()[0] + f"; retry with `ftrun export {run.root}`"},
        )
        raise
    finally:
        lock.release()
    outs = ", ".join(f"{k} {v.get('size', '')}".strip() for k, v in report["outputs"].items())
    _record_export(run, formats, started, {"state": "succeeded", "outputs": outs, "serving": report.get("serving")})
    for key, out in report["outputs"].items():
        print(f"{key:8} {out['size']:>9}  {out['path']}")
    print(f"checks   {run.final / 'export.json'}\nserving  {report.get('serving')}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.deliver.export", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--formats", help="comma-separated: adapter,merged,gguf (default: the recipe's export:)")
    parser.add_argument("--gguf-type", help=f"one of {', '.join(GGUF_TYPES)} (default: the recipe's gguf_type)")
    parser.add_argument("--debug", action="store_true")
    ns = parser.parse_args(argv)
    try:
        export_run(ns.run_dir.resolve(), ns.formats.split(",") if ns.formats else None, ns.gguf_type)
    except FtrunError as exc:
        if ns.debug:
            raise
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
