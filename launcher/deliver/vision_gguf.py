"""A vision-language model's GGUF export: the text GGUF and the projector GGUF (`mmproj`) written by llama.cpp's own
converter from the merged folder, read back through llama.cpp's multimodal path (mtmd) and held to the merged model
in transformers on the held-out images (docs/evaluation.md, "The parity through llama.cpp's multimodal path").

The converter: llama-cpp-python 0.3.36's convert_hf_to_gguf.py, run once for the language model (conversion/qwenvl.py
Qwen2VLModel) and once with `--mmproj` (Qwen2VLVisionModel; the converter's MMPROJ_MODEL_MAP lists the architectures).
The runtime: libmtmd through llama_cpp/mtmd_cpp.py, driven as llama-server drives it (tools/server: an image part
becomes the media marker; mtmd.cpp mtmd_tokenize, mtmd-helper.cpp mtmd_helper_eval_chunks).
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from launcher import gguf_types
from launcher.deliver import llamacpp_runtime, llamacpp_steps
from launcher.deliver.messages import ExportError, _say, human_size
from launcher.deliver.vision_serving import LLAMACPP_IMAGE_TOKENS, ImageBounds, bounds_of
from launcher.plan import gguf_readiness

# The image part of a message as the data and the chat templates write it (launcher/data/images.py)
IMAGE_PART = "image"


def convert_pair(merged_dir: Path, gguf_dir: Path, name: str, gguf_type: str) -> dict[str, Any]:
    """The text GGUF (write_gguf) and the projector GGUF in F16 (llama.cpp does not quantize a projector)."""
    from launcher.deliver.gguf_export import conversion_failed, write_gguf

    steps: dict[str, Any] = {}
    text = write_gguf(merged_dir, gguf_dir, name, gguf_type, steps)
    conv = gguf_readiness.converter()
    mmproj = gguf_dir / f"mmproj-{name}-F16.gguf"
    _say(f"writing the vision projector {mmproj.name} with llama.cpp's converter (--mmproj)")
    tmp = gguf_dir / f".{mmproj.name}.tmp"
    try:
        steps["convert_mmproj"] = llamacpp_steps.convert(conv, merged_dir, tmp, "f16", mmproj=True).to_dict()
    except llamacpp_steps.StepFailed as exc:
        tmp.unlink(missing_ok=True)
        raise conversion_failed(exc, merged_dir) from None
    os.replace(tmp, mmproj)
    return {"text": text, "mmproj": mmproj, "projector_type": "f16", "steps": steps, "source": conv.source}


def projector_metadata(path: Path) -> dict[str, Any]:
    """What the projector GGUF declares (the gguf package's reader)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def f(key: str):
        x = r.fields.get(key)
        return None if x is None else x.contents()

    return {
        "architecture": f("general.architecture"),
        "projector_type": f("clip.projector_type") or f("clip.vision.projector_type"),
        "projection_dim": f("clip.vision.projection_dim"),
        "block_count": f("clip.vision.block_count"),
        "patch_size": f("clip.vision.patch_size"),
        "tensors": len(r.tensors),
    }


def mtmd_missing() -> Optional[str]:
    """Why the llama.cpp runtime has no multimodal path (llama_cpp/mtmd_cpp.py, libmtmd), or None."""
    try:
        import llama_cpp.mtmd_cpp as mtmd

        mtmd.mtmd_default_marker()
    except (ImportError, OSError, AttributeError) as exc:
        return (
            f"llama-cpp-python {gguf_readiness.runtime_version()} has no libmtmd binding ({type(exc).__name__}: {exc})"
        )
    return None


def text_only(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out prompts without their images: what the text GGUF alone can be held to."""
    out = []
    for ex in examples:
        msgs = [{**m, "content": [p for p in _parts(m) if p.get("type") != IMAGE_PART]} for m in ex["messages"]]
        out.append({"messages": msgs, "images": []})
    return out


def _prompt(example: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str], str]:
    """The turns before the last assistant turn, the images they hold (in order), and that turn's text."""
    msgs = example["messages"]
    prompt, last = msgs[:-1], msgs[-1]
    n = sum(1 for m in prompt for p in _parts(m) if p.get("type") == IMAGE_PART)
    content = last["content"]
    reference = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return prompt, list(example["images"][:n]), reference


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    c = message["content"]
    return [{"type": "text", "text": c}] if isinstance(c, str) else c


def transformers_side(merged_dir: Path, examples: list[dict[str, Any]], max_new: int) -> list[dict[str, Any]]:
    """Per held-out example, through the merged folder as vLLM loads it: the prompt ids the processor builds, the
    image tokens of each image, the next-token logits after the prompt and the greedy answer."""
    import torch
    from transformers import AutoModelForImageTextToText
    from trl.data_utils import prepare_multimodal_messages

    from launcher.worker.processor import load_processor

    processor = load_processor(merged_dir, say=lambda _: None)  # how it is built: said once, by the served prompt
    model = AutoModelForImageTextToText.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    pad = model.config.image_token_id
    eos = model.generation_config.eos_token_id
    out = []
    for ex in examples:
        prompt, images, _ = _prompt(ex)
        msgs = prepare_multimodal_messages(prompt, images=images)
        inputs = processor.apply_chat_template(
            [msgs], tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
        )
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1].float()
            gen = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
        grid = inputs.get("image_grid_thw")
        merge = processor.image_processor.merge_size
        per_image = [int(t * h * w) // merge**2 for t, h, w in grid.tolist()] if grid is not None else []
        out.append(
            {
                "ids": ids,
                "image_tokens": per_image,
                "logits": logits,
                "greedy": gen[0, len(ids) :].tolist(),
                "answer": processor.tokenizer.decode(gen[0, len(ids) :], skip_special_tokens=True).strip(),
                "pad_id": pad,
            }
        )
    del model
    return out


def _server_text(llm, prompt: list[dict[str, Any]], marker: str) -> str:
    """The prompt text llama-server renders, each image part as the media marker's text."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    msgs = [
        {**m, "content": [{"type": "text", "text": marker} if p.get("type") == IMAGE_PART else p for p in _parts(m)]}
        for m in prompt
    ]
    template = llm.metadata.get("tokenizer.chat_template")
    eos, bos = llm.token_eos(), llm.token_bos()
    formatter = Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
    )
    text = formatter(messages=msgs).prompt
    bos_text = llm._model.token_get_text(bos) if bos != -1 else ""
    if llamacpp_runtime.special_adds(llm)["bos"] and bos_text and text.startswith(bos_text):
        text = text[len(bos_text) :]
    return text


def mtmd_side(
    text_gguf: Path,
    mmproj: Path,
    examples: list[dict[str, Any]],
    max_new: int,
    bounds: Optional[ImageBounds],
    pad_id: int,
    threads: Optional[int] = None,
) -> dict[str, Any]:
    """transformers_side's figures through llama.cpp's mtmd (each image chunk written as its count of `pad_id`);
    `bounds`: the processor's image-token bounds, given as --image-min-tokens/--image-max-tokens do."""
    import numpy as np
    import torch
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    from llama_cpp import Llama
    from llama_cpp._utils import suppress_stdout_stderr

    n_ctx = 4096
    with suppress_stdout_stderr(disable=False):
        llm = Llama(
            model_path=str(text_gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_ubatch=512,
            logits_all=True,
            n_threads=threads or os.cpu_count(),
            n_gpu_layers=0,
            verbose=False,
            seed=0,
        )
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.warmup = False
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = threads or os.cpu_count() or 1
        if bounds is not None:
            params.image_min_tokens = bounds.min_tokens
            params.image_max_tokens = bounds.max_tokens
        ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    if not ctx:
        llm.close()
        raise ExportError(
            f"llama.cpp's mtmd could not load {mmproj.name} with {text_gguf.name}",
            fix="report this with export.json; the pair cannot be served by llama-server --mmproj.",
        )
    eog = set(llamacpp_runtime.eog_ids(llm))
    marker = mtmd.mtmd_default_marker().decode()
    n_vocab = llm.n_vocab()
    out = []
    try:
        for ex in examples:
            prompt, images, _ = _prompt(ex)
            text = _server_text(llm, prompt, marker)
            bitmaps = []
            chunks = mtmd.mtmd_input_chunks_init()
            t0 = time.monotonic()
            try:
                for path in images:
                    bm = mtmd.mtmd_helper_bitmap_init_from_file(ctx, str(path).encode(), False)
                    if not bm:
                        raise ExportError(f"llama.cpp's mtmd could not read the image {path}", fix="report this.")
                    bitmaps.append(bm)
                raw = text.encode("utf-8")
                inp = mtmd.mtmd_input_text()
                inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), True, True
                arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
                with suppress_stdout_stderr(disable=False):
                    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
                if rc != 0:
                    raise ExportError(
                        f"llama.cpp's mtmd_tokenize failed ({rc}): {len(images)} image(s), "
                        f"{text.count(marker)} marker(s) in the rendered prompt",
                        fix="the GGUF's chat template does not place one image per image part; report this.",
                    )
                ids: list[int] = []
                per_image: list[int] = []
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                    if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        n = ctypes.c_size_t()
                        ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                        ids += [int(ptr[j]) for j in range(n.value)]
                    else:
                        k = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                        per_image.append(k)
                        ids += [pad_id] * k
                llm.reset()
                llm._ctx.kv_cache_clear()
                n_past = llama_cpp.llama_pos(0)
                with suppress_stdout_stderr(disable=False):  # mtmd's per-chunk log lines are not the user's
                    rc = mtmd.mtmd_helper_eval_chunks(
                        ctx, llm.ctx, chunks, 0, 0, llm.n_batch, True, ctypes.byref(n_past)
                    )
                if rc != 0:
                    raise ExportError(f"llama.cpp's mtmd_helper_eval_chunks failed ({rc})", fix="report this.")
                first = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bm in bitmaps:
                    mtmd.mtmd_bitmap_free(bm)
            # the text after the image continues at mtmd's M-RoPE position, which Llama.eval takes from n_tokens
            llm.n_tokens = n_past.value
            tokens = _greedy(llm, first, max_new, eog)
            out.append(
                {
                    "ids": ids,
                    "image_tokens": per_image,
                    "logits": torch.from_numpy(first.astype(np.float32)),
                    "greedy": tokens,
                    "answer": llm.detokenize([t for t in tokens if t not in eog]).decode("utf-8", "replace").strip(),
                    "seconds": round(time.monotonic() - t0, 3),
                    "text": text,
                }
            )
    finally:
        mtmd.mtmd_free(ctx)
        llm.close()
    return {"outputs": out, "eog_ids": sorted(eog)}


def text_side(text_gguf: Path, examples: list[dict[str, Any]], max_new: int, threads: Optional[int] = None):
    """The text GGUF alone on image-free prompts (a build without mtmd), as llama-server serves them."""
    import numpy as np
    import torch

    llm = llamacpp_runtime._open(text_gguf, 4096, threads)
    eog = set(llamacpp_runtime.eog_ids(llm))
    out = []
    try:
        for ex in examples:
            prompt, _, _ = _prompt(ex)
            ids = llamacpp_runtime.server_prompt(llm, prompt)["ids"]
            t0 = time.monotonic()
            llm.reset()
            llm.eval(ids)
            first = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
            tokens = _greedy(llm, first, max_new, eog)
            answer = llm.detokenize([t for t in tokens if t not in eog]).decode("utf-8", "replace").strip()
            out.append(
                {
                    "ids": list(ids),
                    "image_tokens": [],
                    "logits": torch.from_numpy(first),
                    "greedy": tokens,
                    "answer": answer,
                    "seconds": round(time.monotonic() - t0, 3),
                }
            )
    finally:
        llm.close()
    return {"outputs": out, "eog_ids": sorted(eog)}


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], eog: set[int]) -> dict[str, Any]:
    """The served prompts, the first answer token's distribution and the greedy answers of the two sides."""
    import torch

    from launcher.deliver.gguf_export import _until_end

    kls, top1, diffs, same_prompt, same_images, same_answer, decisive = [], [], [], [], [], [], []
    for r, g in zip(ref, got):
        same_prompt.append(r["ids"] == g["ids"])
        same_images.append(r["image_tokens"] == g["image_tokens"])
        p = torch.log_softmax(r["logits"].double(), -1)
        q = torch.log_softmax(g["logits"].double(), -1)
        kls.append(float((p.exp() * (p - q)).sum()))
        top1.append(int(r["logits"].argmax()) == int(g["logits"].argmax()))
        diffs.append(float((r["logits"] - g["logits"]).abs().max()))
        # a first answer token is decided where the merged model's choice leads its runner-up by more than the two
        # sides' largest logit difference: there, no computing difference of this size can change the choice
        two = r["logits"].topk(2).values
        decisive.append(float(two[0] - two[1]) > diffs[-1])
        same_answer.append(_until_end(r["greedy"], eog) == _until_end(g["greedy"], eog))
    n = max(1, len(ref))
    decided = [t for t, d in zip(top1, decisive) if d]
    return {
        "prompts": len(ref),
        "prompt_identical": f"{sum(same_prompt)}/{len(ref)}",
        "image_tokens_identical": f"{sum(same_images)}/{len(ref)}",
        "image_tokens": [{"transformers": r["image_tokens"], "llama_cpp": g["image_tokens"]} for r, g in zip(ref, got)],
        "first_token_mean_kl": sum(kls) / n,
        "first_token_top1_agreement": sum(top1) / n,
        "first_token_decided": f"{len(decided)}/{len(ref)}",
        "first_token_top1_agreement_where_decided": sum(decided) / len(decided) if decided else None,
        "first_token_max_abs_logit_diff": max(diffs, default=0.0),
        "greedy_identical": sum(same_answer) / n,
        "_same_prompt": same_prompt,
    }


def held_out(recipe: Any, task: Optional[dict[str, Any]] = None) -> tuple[list[dict[str, Any]], int]:
    """(the image prompts the pair is checked on, the new tokens an answer may take): the task's prompts, else the
    parity checks' examples (parity.held_out_examples), eval.task.examples of them (16 by default)."""
    if task is not None:
        return [
            {"messages": p["messages"] + [{"role": "assistant", "content": p["reference"]}], "images": p["images"]}
            for p in task["prompts"]
        ], task["max_new_tokens"]
    from launcher.deliver.parity import held_out_examples

    return held_out_examples(recipe)[0][: recipe.eval.task.examples or 16], recipe.eval.max_new_tokens or 16


def vision_gguf_output(
    merged_dir: Path, gguf_dir: Path, name: str, gguf_type: str, examples: list[dict[str, Any]], max_new: int = 8
) -> dict[str, Any]:
    """The text GGUF + mmproj, read back through mtmd and held to the merged model (the served prompt identical, the
    first token within the type's tolerance): export.json's outputs.gguf, with out["task_answers"]."""
    cfg = json.loads((merged_dir / "config.json").read_text())
    model_type = cfg.get("model_type", "")
    files = convert_pair(merged_dir, gguf_dir, name, gguf_type)
    text, mmproj = files["text"], files["mmproj"]
    meta, pmeta = llamacpp_runtime.metadata(text), projector_metadata(mmproj)
    bounds = bounds_of(merged_dir)
    missing = mtmd_missing()
    if missing:
        # no multimodal path in this build: the text GGUF alone, on the prompts without their images
        _say(f"{missing}: the projector is written but not checked; the text GGUF is checked on text-only prompts")
        examples = text_only(examples)
    ref = transformers_side(merged_dir, examples, max_new)
    pad = ref[0]["pad_id"] if ref else int(cfg.get("image_token_id", -1))
    if missing:
        run = text_side(text, examples, max_new)
    else:
        _say(
            f"answering {len(examples)} held-out image prompts through llama.cpp's mtmd with {text.name} + "
            f"{mmproj.name}"
        )
        run = mtmd_side(text, mmproj, examples, max_new, bounds, pad)
    eog = set(run["eog_ids"])
    result = compare(ref, run["outputs"], eog)
    same_prompt = result.pop("_same_prompt")
    kind = gguf_types.TYPES[gguf_type]
    tol = kind.tolerance
    default = LLAMACPP_IMAGE_TOKENS.get(model_type)
    out = {
        "path": str(text),
        "mmproj": str(mmproj),
        "type": kind.name,
        "projector_type": files["projector_type"].upper(),
        "bytes": text.stat().st_size,
        "size": human_size(text.stat().st_size),
        "mmproj_bytes": mmproj.stat().st_size,
        "mmproj_size": human_size(mmproj.stat().st_size),
        "written_by": f"llama.cpp {files['source']} (convert_hf_to_gguf.py, then --mmproj)",
        "steps": files["steps"],
        "architecture": meta["architecture"],
        "projector": pmeta,
        "chat_template_included": bool(meta.get("chat_template")),
        "runtime": f"llama-cpp-python {gguf_readiness.runtime_version()} "
        + ("without libmtmd: the text GGUF only" if missing else "with libmtmd (llama_cpp/mtmd_cpp.py)"),
        "parity_through": f"the text GGUF alone on text-only prompts ({missing})"
        if missing
        else "mtmd, with the images",
        "image_token_bounds": {
            "processor": None if bounds is None else [bounds.min_tokens, bounds.max_tokens],
            "llama_cpp_default": list(default) if default else None,
            "given_to_mtmd": bounds is not None,
        },
        "parity_vs_merged": {**result, "tolerance": tol.as_dict()},
        "answers": [
            {"transformers": r["answer"], "llama_cpp": g["answer"], "seconds": g["seconds"]}
            for r, g in zip(ref, run["outputs"])
        ],
        "task_answers": [
            {"answer": g["answer"], "new_tokens": len(g["greedy"]), "seconds": g["seconds"]} for g in run["outputs"]
        ],
    }
    _say(
        f"GGUF {out['size']} {text.name} + projector {out['mmproj_size']} {mmproj.name}: served prompt identical "
        f"{result['prompt_identical']}, image tokens identical {result['image_tokens_identical']}, first-token "
        f"top-1 agreement {result['first_token_top1_agreement']:.3f}, greedy answers identical "
        f"{result['greedy_identical']:.3f}"
    )
    problems = []
    if not all(same_prompt):
        i = same_prompt.index(False)
        r, g = ref[i]["ids"], run["outputs"][i]["ids"]
        at = next((k for k, (a, b) in enumerate(zip(r + [None], g + [None])) if a != b), 0)
        problems.append(
            f"llama-server's prompt for held-out image prompt {i + 1} is not the one the processor built: it differs "
            f"at token {at} (image tokens per image: llama.cpp {run['outputs'][i]['image_tokens']}, transformers "
            f"{ref[i]['image_tokens']})"
        )
    if result["first_token_mean_kl"] > tol.max_kl:
        problems.append(
            f"the first answer token's distribution differs: mean KL {result['first_token_mean_kl']:.3g} "
            f"(bound {tol.max_kl})"
        )
    decided = result["first_token_top1_agreement_where_decided"]
    if decided is not None and decided < tol.min_top1:
        problems.append(
            f"where the merged model's first answer token is decided ({result['first_token_decided']} prompts), "
            f"llama.cpp picks the same one in {decided:.3f} (floor {tol.min_top1})"
        )
    if problems:
        out["error"] = "; ".join(problems)
        from launcher.deliver.gguf_export import _GgufFailed

        raise _GgufFailed(
            ExportError(
                f"the GGUF pair {text.name} + {mmproj.name} (through llama.cpp's mtmd): " + out["error"],
                fix="do not serve this pair; export.json (outputs.gguf) has the numbers.",
            ),
            out,
        )
    return out


def served_checks(served, gguf: dict[str, Any]) -> None:
    """The pair's served-prompt check in the export's served-prompt record, and what is not checked."""
    served.report["runtimes"]["llama_server"] = {
        "runtime": f"llama-server --mmproj (through {gguf['parity_through']})",
        "ok": True,
        "identical": gguf["parity_vs_merged"]["prompt_identical"],
    }
    served.checked("llama-server")
    served.report["not_checked"] = {
        "llama.cpp": "llama-cpp-python's vision chat handlers render their own template, not the GGUF's",
        "Ollama": "Ollama serves this model from the merged folder with its own engine, not run here",
    }


def _greedy(llm, first, max_new: int, eog: set[int]) -> list[int]:
    """The greedy answer from the prompt's logits `first`, up to `max_new` tokens or an end token (kept)."""
    import numpy as np

    tokens: list[int] = []
    row = first
    for _ in range(max_new):
        tok = int(np.argmax(row))
        tokens.append(tok)
        if tok in eog:
            break
        llm.eval([tok])
        row = llm.scores[llm.n_tokens - 1]
    return tokens
