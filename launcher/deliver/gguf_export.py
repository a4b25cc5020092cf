"""The GGUF export: the merged folder converted by llama.cpp, read back in llama.cpp, checked against it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from launcher import gguf_types
from launcher.deliver import llamacpp_runtime, llamacpp_steps
from launcher.plan import gguf_readiness
from launcher.deliver.messages import ExportError, _say, human_size
from launcher.deliver.parity import GREEDY_NEW_TOKENS, _check, compare


# The safetensors dtypes of a plain 16-bit model folder: what the merged folder must hold, and what its GGUF converts
SIXTEEN_BIT = frozenset({"BF16", "F16"})


def _safetensors_dtypes(folder: Path) -> set[str]:
    import struct

    seen = set()
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        seen |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return seen


CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "head_count",
    "num_key_value_heads": "head_count_kv",
    "intermediate_size": "feed_forward_length",
    "head_dim": "key_length",
    "rms_norm_eps": "rms_eps",
}


def _config_diff(merged: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """The architecture numbers the GGUF declares that differ from the merged model's config.json."""
    diffs = []
    for key, gkey in CONFIG_KEYS.items():
        want, got = merged.get(key), meta.get(gkey)
        if key == "head_dim" and want is None:
            want = merged["hidden_size"] // merged["num_attention_heads"]
        if want is None or got is None:
            continue
        if (
            (abs(float(want) - float(got)) > 1e-6 * max(abs(float(want)), 1.0))
            if isinstance(want, float)
            else want != got
        ):
            diffs.append(f"{key} {got} (merged: {want})")
    if meta.get("vocab_size") is not None and meta["vocab_size"] != merged.get("vocab_size"):
        diffs.append(f"vocab_size {meta['vocab_size']} (merged: {merged.get('vocab_size')})")
    rope = merged.get("rope_parameters") or merged.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3" and "rope_freqs.weight" not in meta.get("tensor_names", []):
        diffs.append("llama3 rope scaling without its rope_freqs tensor")
    return diffs


def _stop_ids(merged_dir: Path, tokenizer) -> set[int]:
    """The ids transformers' generate stops after: generation_config.json's eos_token_id (one or a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = merged_dir / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
            if ids:
                break
    return ids or ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def write_gguf(
    merged_dir: Path, gguf_dir: Path, name: str, gguf_type: str, steps: dict[str, Any], intermediate=None
) -> Path:
    """gguf_dir/NAME-TYPE.gguf: converted, or converted to 16 bits and quantized; each step into `steps`."""
    conv = gguf_readiness.converter()
    kind = gguf_types.TYPES[gguf_type]
    gguf_dir.mkdir(parents=True, exist_ok=True)
    path = gguf_dir / f"{name}-{kind.name}.gguf"
    tmp, sixteen = gguf_dir / f".{path.name}.tmp", intermediate
    try:
        if kind.converter:
            _say(f"writing {path.name} with llama.cpp's converter ({conv.source})")
            steps["convert"] = llamacpp_steps.convert(conv, merged_dir, tmp, kind.converter).to_dict()
        else:
            if sixteen is None or not sixteen.is_file():
                dtype = (_safetensors_dtypes(merged_dir) & SIXTEEN_BIT or {"BF16"}).pop().lower()
                sixteen = gguf_dir / f".{name}-{dtype.upper()}.tmp.gguf"
                _say(
                    f"converting the merged model to a {dtype.upper()} GGUF with llama.cpp's converter ({conv.source})"
                )
                steps["convert"] = llamacpp_steps.convert(conv, merged_dir, sixteen, dtype).to_dict()
            _say(f"quantizing to {kind.name} with llama.cpp's quantizer")
            steps["quantize"] = llamacpp_steps.quantize(sixteen, tmp, gguf_type).to_dict()
            if intermediate is None:
                sixteen.unlink()
    except llamacpp_steps.StepFailed as exc:
        for f in (tmp, sixteen if intermediate is None else None):
            if f is not None:
                f.unlink(missing_ok=True)
        raise conversion_failed(exc, merged_dir) from None
    os.replace(tmp, path)
    return path


def conversion_failed(exc: Exception, merged_dir: Path) -> ExportError:
    return ExportError(
        str(exc),
        fix="the lines above are llama.cpp's; `ftrun llamacpp check "
        f"{merged_dir}` says whether this model is supported.",
    )


def gguf_output(
    merged_dir: Path,
    gguf_dir: Path,
    name: str,
    gguf_type: str,
    prompts: list[dict[str, Any]],
    merged_out: list[dict[str, Any]],
    tokenizer,
    compute: str = "float32",
    intermediate: Optional[Path] = None,
    served=None,
    task: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Convert the merged folder with llama.cpp (write_gguf), read the file back and compare it with merged_out.
    `served` (ServedPrompt): the served prompts, stops and serving smoke test are checked (_served_checks); `task`
    (RUN/task.json): its prompts answered as llama-server serves them, in out["task_answers"]."""
    conv = gguf_readiness.converter()
    kind = gguf_types.TYPES[gguf_type]
    steps: dict[str, Any] = {}
    path = write_gguf(merged_dir, gguf_dir, name, gguf_type, steps, intermediate)
    fname = path.name
    meta = llamacpp_runtime.metadata(path)
    _say(f"reading {fname} back in llama.cpp")
    t0 = time.monotonic()
    stop_ids = _stop_ids(merged_dir, tokenizer)
    chat = served.prompts if served is not None and served.chat else None
    switches = served.kwargs if chat else {}
    # llama-cpp-python's create_chat_completion takes no chat-template switches: with them, no serving smoke test
    smoke = _smoke_index(prompts, chat) if chat and not switches else None
    run = llamacpp_runtime.run_gguf(
        path,
        prompts,
        GREEDY_NEW_TOKENS,
        stop_ids,
        to_end=chat is not None,
        chat=chat,
        smoke=smoke,
        template_kwargs=switches,
        task=task,
    )
    gguf_out, same_tokens = run["outputs"], run["same_tokens"]
    steps["llama_cpp_prompts_seconds"] = round(time.monotonic() - t0, 2)
    config_diff = _config_diff(json.loads((merged_dir / "config.json").read_text()), meta)
    result = compare(merged_out, gguf_out, f"gguf:{gguf_type}", compute)
    size = path.stat().st_size
    out = {
        "path": str(path),
        "type": kind.name,
        "bytes": size,
        "size": human_size(size),
        "written_by": f"llama.cpp {conv.source}"
        + ("" if kind.converter else f" + quantizer ({gguf_readiness.DIST} {gguf_readiness.runtime_version()})"),
        "converter_gguf_py": conv.gguf_py,
        "steps": steps,
        "architecture": meta["architecture"],
        "tokenizer_pre": meta["tokenizer_pre"],
        "tensor_types": meta["tensor_types"],
        "chat_template_included": meta.get("chat_template") == tokenizer.chat_template,
        "tokenizer_identical": f"{sum(same_tokens)}/{len(same_tokens)}",
        "config_differences": config_diff,
        "parity_vs_merged": result,
    }
    if "task_answers" in run:
        out["task_answers"] = run["task_answers"]
    ppl = result["perplexity_rel_diff"]
    _say(
        f"GGUF {human_size(size)} {fname} ({', '.join(f'{k} x{v}' for k, v in meta['tensor_types'].items())}): "
        f"in llama.cpp top-1 agreement {result['top1_agreement']:.4f}, perplexity "
        f"{'-' if ppl is None else f'{ppl:+.2%}'}, greedy identical {result['greedy_identical']}, "
        f"tokenizer identical {out['tokenizer_identical']}"
    )
    try:
        if config_diff:
            raise ExportError(
                f"{fname} describes a different model than the merged one: " + "; ".join(config_diff),
                fix="do not serve this GGUF; report it with export.json.",
            )
        if not all(same_tokens):
            raise ExportError(
                f"llama.cpp splits the parity prompts into other tokens with {fname} than the model's own tokenizer",
                fix="do not serve this GGUF: Ollama would see other tokens than "
                "training did; report it with export.json (tokenizer_pre says which split rule it has).",
            )
        if chat:  # first: it names the first token a differing template changes
            _served_checks(served, run, out, meta, merged_out, kind, smoke)
        if not out["chat_template_included"]:
            raise ExportError(
                f"{fname} does not carry the model's chat template",
                fix="report this with export.json; Ollama would fall back to a wrong template.",
            )
        higher = gguf_types.advised_above(gguf_type)
        _check(
            f"the GGUF {fname} (in llama.cpp)",
            result,
            fix="do not serve this file; a type with more bits keeps closer to the model: "
            + (f"`ftrun export RUN_DIR --gguf {higher}`" if higher else "report it with export.json")
            + ".",
        )
    except ExportError as exc:
        out["error"] = exc.message
        raise _GgufFailed(exc, out) from None
    return out


def _smoke_index(prompts: list[dict[str, Any]], chat: list[dict[str, Any]]) -> int:
    """The held-out prompt the serving smoke test asks: the first whose parity prompt is whole and trained."""
    whole = [not p.get("prompt_truncated") and list(p["prompt_ids"]) == c["ids"] for p, c in zip(prompts, chat)]
    return whole.index(True) if True in whole else 0


def _until_end(tokens: list[int], ends: set[int], n: Optional[int] = None) -> list[int]:
    """A greedy continuation as a chat completion returns it: up to and with its first end token, n at most."""
    head = list(tokens[:n])
    return head[: next((i + 1 for i, t in enumerate(head) if t in ends), len(head))]


def _server_fix(adds: dict[str, bool], switches: dict[str, Any]) -> str:
    """What to do when llama-server's prompt is not the trained one."""
    if adds["eos"]:
        return (
            "do not serve this GGUF as it is: its vocabulary adds EOS to every tokenized text "
            "(tokenizer.ggml.add_eos_token), so llama-server and Ollama end every chat prompt with EOS, which "
            "training never put in front of an answer. With llama-server, add `--override-kv "
            "tokenizer.ggml.add_eos_token=bool:false`; the model folder's tokenizer (tokenizer.json's "
            "post-processor, tokenizer_config.json add_eos_token) is where the converter took it from."
        )
    return (
        "do not serve this GGUF as it is: llama-server renders the GGUF's own template another way than the "
        "training did"
        + (f" even with {json.dumps(switches)}" if switches else "")
        + "; report it with export.json (served_prompt)."
    )


def _served_checks(
    served,
    run: dict[str, Any],
    out: dict[str, Any],
    meta: dict[str, Any],
    merged_out: list[dict[str, Any]],
    kind,
    smoke: Optional[int],
) -> None:
    """The served prompt, the stop tokens, the ending share and the serving smoke test of one GGUF (into `out`)."""
    rendered, fname = run["chat"], Path(out["path"]).name
    adds = run["adds"]
    served.compare(
        "llama_server",
        f"llama-server --jinja with {fname} (and Ollama 0.30+ without a Go template)",
        [r["ids"] or [] for r in run["server"]],
        adds_bos=adds["bos"],
        adds_eos=adds["eos"],
        fix=_server_fix(adds, served.kwargs),
    )
    served.checked("llama-server")
    if served.kwargs:
        served.report["runtimes"]["llama_cpp"] = {
            "runtime": "llama-cpp-python",
            "ok": True,
            "identical": None,
            "note": "not compared: llama-cpp-python's create_chat_completion takes no chat-template switches "
            f"({json.dumps(served.kwargs)}); serve with llama-server",
        }
    else:
        served.compare(
            "llama_cpp",
            f"llama.cpp ({fname}'s own chat template through llama-cpp-python's Jinja2ChatFormatter)",
            [r["ids"] or [] for r in rendered],
            bos_eos_ids=run["bos_eos"],
        )
        served.checked("llama.cpp")
    eog = set(run["eog_ids"])
    served.check_stops(
        "llama_cpp",
        f"llama.cpp with {Path(out['path']).name}",
        sorted(eog),
        fix="do not serve this GGUF: llama.cpp and Ollama would not stop at the end of an answer. "
        "The converter takes the end tokens from the merged folder's tokenizer_config.json and "
        "generation_config.json; report it with export.json.",
        eos_token_id=meta.get("eos_token_id"),
        end_of_generation_ids=sorted(eog)[:16],
    )
    out["ending"] = served.ending("gguf", run["outputs"], eog)
    if smoke is None or "smoke" not in run:
        return
    s = run["smoke"]
    n = GREEDY_NEW_TOKENS
    own = _until_end(run["outputs"][smoke]["continuation"], eog, n)
    merged = _until_end(merged_out[smoke].get("continuation") or merged_out[smoke]["greedy"] or [], eog, n)
    exact = kind.bits >= 16  # a 16-bit or f32 file holds the merged weights: its answer is the merged model's
    smoke_out = {
        "runtime": "llama-cpp-python Llama.create_chat_completion (temperature 0)",
        "prompt": smoke + 1,
        "seconds": s["seconds"],
        "answer": s["answer"],
        "finish_reason": s["finish_reason"],
        "tokens": s["tokens"],
        "prompt_is_trained_prompt": s["prompt_ids"] == served.prompts[smoke]["ids"],
        "same_as_llama_cpp_greedy": s["tokens"] == own,
        "same_as_merged_greedy": s["tokens"] == merged,
        "must_equal": "the merged model's and llama.cpp's greedy continuation"
        if exact
        else "llama.cpp's greedy continuation (a quantized file's answer may leave the merged model's)",
    }
    out["serving_smoke"] = smoke_out
    ok = (
        smoke_out["prompt_is_trained_prompt"]
        and smoke_out["same_as_llama_cpp_greedy"]
        and (smoke_out["same_as_merged_greedy"] or not exact)
    )
    smoke_out["ok"] = ok
    _say(
        f"serving smoke test: llama-cpp-python's chat completion answered held-out prompt {smoke + 1} in "
        f"{s['seconds']:.2f} s ({len(s['tokens'])} tokens, {s['finish_reason']}); "
        + ("the parity's greedy continuation" if ok else "NOT the parity's greedy continuation")
    )
    if not ok:
        want = merged if exact and s["tokens"] != merged else own
        i = next((k for k, (a, b) in enumerate(zip(s["tokens"] + [None], want + [None])) if a != b), 0)
        raise ExportError(
            f"llama-cpp-python's chat completion with {Path(out['path']).name} does not answer as the checked model: "
            + (
                "its prompt is not the trained prompt"
                if not smoke_out["prompt_is_trained_prompt"]
                else f"token {i} of its answer differs ({s['tokens'][i : i + 1]} where the parity's greedy "
                f"continuation has {want[i : i + 1]})"
            ),
            fix="do not serve this GGUF; report it with export.json (outputs.gguf.serving_smoke).",
        )


class _GgufFailed(ExportError):
    """A GGUF that was written but failed a check: its numbers still go into export.json."""

    def __init__(self, exc: ExportError, out: dict[str, Any]):
        super().__init__(exc.message, fix=exc.fix)
        self.output = out
