"""How each export is served: SERVING.md, the Modelfile, each runtime's prompt checked against the trained one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from launcher.deliver.export_inputs import Inputs
from launcher.deliver.gguf_export import _stop_ids
from launcher.deliver.messages import _say


def _served_folder(served, output: dict[str, Any], key: str, tokenizer, config_from: str) -> None:
    """An exported folder as vLLM serves it: its prompts, and its stops (vllm/sampling_params.py
    update_from_generation_config) against the trained end of turn."""
    from launcher.worker.loading import reads_images

    if key == "adapter" and reads_images(config_from):
        from launcher.deliver.vision_serving import lora_reach

        output.update(lora_reach(Path(output["path"])))
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


def _serving(inp: Inputs, report: dict[str, Any], tokenizer, served=None) -> None:
    from launcher.deliver import serving, vision_serving

    merged_dir = inp.run.final / "merged"
    eos_ids = _stop_ids(merged_dir, tokenizer) if "merged" in report["outputs"] else None
    prompts = [p["messages"] for p in served.prompts] if served is not None and served.chat else None
    if inp.vision:  # each server's command with its images (vllm --limit-mm-per-prompt, llama-server --mmproj)
        text, modelfile = vision_serving.serving_md(inp.run, inp.recipe, report), None
    else:
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
    """The Modelfile as Ollama reads it: its prompt, and its PARAMETER stop values against the end of turn."""
    from launcher.deliver import llamacpp_runtime
    from launcher.deliver.served_prompt import modelfile_parts

    template, stops = modelfile_parts(text)
    vocab = llamacpp_runtime.Vocabulary(Path(gguf["path"]))
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
    """Ollama's prompt against the trained one, counted as checked only where tokens were compared."""
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
