"""Each model an export makes, loaded where its placement says, written, reloaded, compared: one at a time."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.worker.processor import PROCESSOR_FILES, save_processor_files
from launcher.deliver.export_inputs import Inputs
from launcher.deliver.export_scores import _score_export, _scored, _task
from launcher.deliver.export_serving import _served_folder, _serving
from launcher.deliver.gguf_export import SIXTEEN_BIT, _GgufFailed, _safetensors_dtypes, _stop_ids, gguf_output
from launcher.deliver.messages import ExportError, _say, human_size
from launcher.deliver.parity import _check, compare, model_outputs
from launcher.deliver.placement import Loads, Placement, _to_export_dtype, load_adapter, load_model, release
from launcher.store.checkpoint import tree_bytes


def _write_dir_atomically(dst: Path, write: Callable[[Path], None]) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    os.replace(tmp, dst)


def _adapter_file_check(source: Path, tokenizer, why: str) -> dict[str, Any]:
    """An adapter checked without its base: it parses and some lora_B is non-zero (peft starts B at zero)."""
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
    """Every model loaded where its placement says, used and released before the next: one at a time."""
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
        # a fresh base where the merge placement says: the merged weights are rounded once, from the fp32 adapter
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
        if inp.vision:  # served with its processor's files: vLLM and llama.cpp's converter size images by them
            save_processor_files(inp.recipe.model, tmp)
            if not (tmp / "preprocessor_config.json").is_file():
                raise ExportError(
                    f"{inp.recipe.model} has no preprocessor_config.json: a server would not know how to size images",
                    fix=f"copy the processor files of {inp.recipe.model} beside its weights, then export again.",
                )

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
        from launcher.worker.processor import load_processor

        stamp = (merged_dir / "config.json").stat().st_mtime_ns
        if inp.vision:  # a vision-language model answers with the images in the prompt, read by its processor
            reader = load_processor(merged_dir, say=lambda _: None)
        else:
            reader = AutoTokenizer.from_pretrained(str(merged_dir))
        identity = f"merged {tree_bytes(merged_dir)} {stamp}"
        scored = task_eval.score_model(reloaded, reader, inp.run.root, task, "merged", identity=identity)
        _score_export(inp, task, "merged", scored)
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
    if inp.vision:
        outputs["merged"]["processor_files"] = sorted(n for n in PROCESSOR_FILES if (merged_dir / n).is_file())
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
            if inp.vision:  # the text GGUF and its projector, held to the merged model on held-out images
                from launcher.deliver import vision_gguf

                examples, max_new = vision_gguf.held_out(inp.recipe, task)
                report["held_out_image_prompts"] = len(examples)
                outputs["gguf"] = vision_gguf.vision_gguf_output(
                    merged_dir, final / "gguf", inp.run.root.name, inp.gguf_type, examples, max_new
                )
                vision_gguf.served_checks(served, outputs["gguf"])
            else:
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
