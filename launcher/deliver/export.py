"""Export a finished run: adapter, merged 16-bit model, GGUF, serving commands; every output reloaded and checked.

Run as `python -m launcher.deliver.export --run-dir DIR [--formats adapter,merged,gguf] [--gguf-type q8_0]` (the
supervisor does, after a successful run) or through `ftrun export`. Writes into the run's `final/`:
`merged/` (safetensors + tokenizer + chat template), `gguf/<name>-<TYPE>.gguf` + `Modelfile`,
`SERVING.md`, and `export.json` with the parity numbers. An output outside its tolerance fails loudly.
"""

from __future__ import annotations

import argparse
import json
import math
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
from launcher.deliver import llamacpp  # noqa: E402
from launcher import gguf_types  # noqa: E402
from launcher.errors import EXIT_RUN_FAILED, FtrunError, UsageError  # noqa: E402
from launcher.store.rundir import RunDir  # noqa: E402

FORMATS = ("adapter", "merged", "gguf")
# GGUF types: llama.cpp's converter writes f32/f16/bf16, its quantizer the rest from the 16-bit file (llamacpp.py).
GGUF_TYPES = tuple(gguf_types.TYPES)

# Prompts taken from the data for the parity checks (held out where the recipe holds some out), and tokens
# compared per prompt.
PARITY_PROMPTS = 3
PARITY_MAX_TOKENS = 128
GREEDY_NEW_TOKENS = 16

# Tolerances, by what is compared. top1 = share of positions (teacher-forced, over the parity prompts) where both
# models pick the same next token; rel = max |logit difference| / std of the reference logits; ppl = relative
# perplexity difference of the two models on the parity texts; greedy = share of prompts whose greedy
# continuations (GREEDY_NEW_TOKENS) are identical. Merging in 16 bit only rounds the merged weights once.
TOLERANCE = {
    "merged": {"min_top1": 0.98, "max_rel": 0.15},
    "full:merged": {"min_top1": 0.98, "max_rel": 0.15},
}
# A GGUF's bounds are its type's tolerance in the GGUF table (launcher/gguf_types.py, where their origin is told).
TOLERANCE.update({f"gguf:{k}": t.tolerance.as_dict() for k, t in gguf_types.TYPES.items()})
# When a model's float32 copy fits neither one GPU nor RAM, both sides of a comparison run in its 16-bit dtype
# (same device, same split): every activation is then rounded to 8 bits of mantissa on both sides, and a
# teacher-forced position whose two best logits are nearly tied can flip. Only the merge's check needs more
# room for that (tiny model, bf16 on the CPU: top-1 agreement 0.975 where float32 gives 0.985); a GGUF in
# F32/F16/BF16 holds the merged weights exactly and stays identical in any dtype.
TOLERANCE_16BIT = {
    "merged": {"min_top1": 0.95, "max_rel": 0.15},
    "full:merged": {"min_top1": 0.95, "max_rel": 0.15},
}


class ExportError(FtrunError):
    """An output was written but failed its check (or could not be written): the run itself is fine."""

    kind = "export failed"
    exit_code = EXIT_RUN_FAILED


def _say(msg: str) -> None:
    print(f"[ftrun export] {msg}", flush=True)


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


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
        raise UsageError(f"{run.root} is not an ftrun run directory (no recipe.yaml)",
                         fix="give the run's output_dir or its recipe file, e.g. `ftrun export runs/tiny-cpu`.")
    recipe = load_recipe(run.recipe)
    formats = list(formats if formats is not None else getattr(recipe, "export", ["adapter"]))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise UsageError(f"unknown export format(s) {', '.join(map(repr, unknown))}",
                         fix=f"choose from {', '.join(FORMATS)}.")
    gguf_type = (gguf_type or getattr(recipe, "gguf_type", gguf_types.DEFAULT_TYPE)).lower()
    if gguf_type not in GGUF_TYPES:
        raise UsageError(f"unknown GGUF type {gguf_type!r}",
                         fix=f"choose one of {', '.join(GGUF_TYPES)} (--gguf TYPE or gguf_type: in the recipe); "
                         "q4_k_m is what Ollama serves by default.")
    is_adapter = recipe.method in ("qlora", "lora")
    source = run.final / ("adapter" if is_adapter else "model")
    weights = ("adapter_model.safetensors",) if is_adapter else ("model.safetensors", "model.safetensors.index.json")
    if not source.is_dir() or not any((source / w).is_file() for w in weights):
        from launcher.store.state import effective_state

        state = effective_state(run)
        raise UsageError(
            f"{run.root} has no final {'adapter' if is_adapter else 'model'} yet (state: {state}); "
            f"export needs {source}",
            fix=("the run finished but its result is not here (deleted, or a fresh box): `ftrun pull RECIPE` "
                 "fetches it from sync.to; then export again." if state == "succeeded" else
                 "wait until the run has finished (`ftrun status " + str(run.root) + "`), then run `ftrun export "
                 + str(run.root) + "`." if state in ("planned", "smoking", "running", "recovering") else
                 "resume the run with `ftrun RECIPE` until it finishes, then export."),
        )
    if "gguf" in formats:
        check_gguf(recipe.model if is_adapter else str(source), gguf_type)
    order = tuple(f for f in FORMATS if f in formats or (f == "merged" and "gguf" in formats))
    return Inputs(run, recipe, source, is_adapter, order, gguf_type)


def _model_config(recipe_model: str, source: Path, is_adapter: bool) -> dict[str, Any]:
    cfg = (Path(recipe_model) / "config.json") if is_adapter else (source / "config.json")
    if cfg.is_file():
        return json.loads(cfg.read_text())
    return {}  # a Hub id whose config is not cached: the GGUF step checks again on the merged model


def check_gguf(model: str, gguf_type: str) -> llamacpp.Readiness:
    """The GGUF can be made here (llama.cpp installed, architecture and tokenizer supported), else one error."""
    ready = llamacpp.readiness(model, gguf_type)
    if not ready.ok:
        raise UsageError("a GGUF of this model cannot be made here: " + "; ".join(ready.all_problems),
                         fix="fix the above, or export without gguf (the merged folder is what "
                         "`ollama create -q q4_K_M` also takes, see SERVING.md).")
    return ready


# ---------------------------------------------------------------------------------------------
# Parity: the same prompts through two models, compared by next-token logits and greedy tokens

def parity_examples(recipe) -> tuple[list[list[dict[str, Any]]], str]:
    """The conversations the parity checks use, and where they come from: held out when the recipe holds some
    out (eval.data, or the seeded eval.fraction draw of launcher/data/split.py), else the training data."""
    from launcher.data import formats as data_formats
    from launcher.data.dataset import load_data, load_examples

    ev = getattr(recipe, "eval", None)
    if ev is not None and getattr(ev, "data", None):
        return load_examples(ev.data), "held out (eval.data)"
    raw = load_data(recipe.data, getattr(recipe, "seed", 42)).examples  # the mix as trained, split as the worker splits it
    examples = [data_formats.conversation(e) for e in raw]
    if ev is not None and getattr(ev, "fraction", None):
        from launcher.data.split import for_recipe

        held = for_recipe(raw, recipe).held_out
        if held:
            return [examples[i] for i in held], "held out (eval.fraction)"
    return examples, "training data (the recipe holds nothing out)"


def parity_prompts(recipe, tokenizer, n: int = PARITY_PROMPTS) -> list[dict[str, Any]]:
    """The first n parity conversations: full text (teacher-forced logits) and prompt (greedy decoding)."""
    examples, source = parity_examples(recipe)
    out = []
    for messages in examples[:n]:
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        prompt_msgs = messages[:last_assistant] or messages[:1]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(full, add_special_tokens=False)["input_ids"][:PARITY_MAX_TOKENS]
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-PARITY_MAX_TOKENS:]
        out.append({"text": full, "ids": ids, "prompt_ids": prompt_ids, "source": source})
    return out


def model_outputs(model, prompts: list[dict[str, Any]], greedy: bool = True) -> list[dict[str, Any]]:
    """Per prompt: next-token logits over the whole text (float32) and the greedy continuation."""
    import torch

    device = input_device(model)
    results = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["ids"]], device=device)
            logits = model(input_ids=ids).logits[0].float().cpu()
            tokens = None
            if greedy:
                pid = torch.tensor([p["prompt_ids"]], device=device)
                # plain argmax, as the llama.cpp side decodes: generate() fills every unset option from the model's
                # generation_config (transformers 5.24 generation/utils.py _prepare_generation_config), and instruct
                # models ship a repetition_penalty (Qwen2.5: 1.05) or n-gram rules that change greedy tokens
                gen = model.generate(input_ids=pid, attention_mask=torch.ones_like(pid), max_new_tokens=GREEDY_NEW_TOKENS,
                                     do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                     min_new_tokens=0, pad_token_id=model.config.eos_token_id
                                     if isinstance(model.config.eos_token_id, int) else 0)
                tokens = gen[0, pid.shape[1]:].tolist()
            results.append({"logits": logits, "greedy": tokens, "ids": list(p["ids"])})
    return results


def input_device(model):
    """Where the token ids go: the compute device of a dispatched model (its offloaded weights sit on the meta
    device, so the first parameter says nothing), else the device of its weights."""
    import torch

    devices = [d for d in (getattr(model, "hf_device_map", None) or {}).values() if str(d) not in ("cpu", "disk")]
    if devices:
        d = devices[0]
        return torch.device(f"cuda:{d}" if isinstance(d, int) else d)
    if getattr(model, "hf_device_map", None):
        return torch.device("cpu")
    return next(model.parameters()).device


def compare(ref: list[dict[str, Any]], out: list[dict[str, Any]], kind: str, compute: str = "float32") -> dict[str, Any]:
    """Numbers for export.json, and whether they are within the tolerance of kind for the compute dtype."""
    import torch

    agree = total = 0
    max_abs = 0.0
    max_rel = 0.0
    kl_sum = 0.0
    greedy_same = greedy_n = 0
    first_diverge = []
    nll_ref = nll_out = 0.0
    n_nll = 0
    for r, o in zip(ref, out):
        a, b = r["logits"], o["logits"]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        diff = float((a - b).abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / max(float(a.std()), 1e-6))
        kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
        kl_sum += float(kl)
        ids = r.get("ids")
        if ids is not None and len(ids) > 1:
            target = torch.tensor(ids[1:])
            nll_ref += float(torch.nn.functional.cross_entropy(a[:-1], target, reduction="sum"))
            nll_out += float(torch.nn.functional.cross_entropy(b[:-1], target, reduction="sum"))
            n_nll += len(ids) - 1
        if r["greedy"] is not None and o["greedy"] is not None:
            greedy_n += 1
            if r["greedy"] == o["greedy"]:
                greedy_same += 1
            else:
                first_diverge.append(next(i for i, (x, y) in enumerate(zip(r["greedy"] + [None], o["greedy"] + [None]))
                                          if x != y))
    tol = TOLERANCE[kind] if compute == "float32" else TOLERANCE_16BIT.get(kind, TOLERANCE[kind])
    top1 = agree / max(total, 1)
    ppl_ref = math.exp(nll_ref / n_nll) if n_nll else None
    ppl_out = math.exp(nll_out / n_nll) if n_nll else None
    ppl_rel = (ppl_out / ppl_ref - 1.0) if n_nll else None
    greedy_share = greedy_same / greedy_n if greedy_n else None
    mean_kl = kl_sum / max(len(ref), 1)
    ok = (top1 >= tol["min_top1"] and max_rel <= tol.get("max_rel", math.inf) and mean_kl <= tol.get("max_kl", math.inf)
          and (ppl_rel is None or abs(ppl_rel) <= tol.get("max_ppl", math.inf))
          and (greedy_share is None or greedy_share >= tol.get("min_greedy", 0.0)))
    return {
        "prompts": len(ref),
        "positions": total,
        "top1_agreement": round(top1, 5),
        "max_abs_logit_diff": round(max_abs, 6),
        "max_rel_logit_diff": round(max_rel, 6),
        "mean_kl": round(mean_kl, 8),
        "perplexity_reference": round(ppl_ref, 4) if ppl_ref else None,
        "perplexity": round(ppl_out, 4) if ppl_out else None,
        "perplexity_rel_diff": round(ppl_rel, 6) if ppl_rel is not None else None,
        "greedy_identical": f"{greedy_same}/{greedy_n}",
        "greedy_first_divergence": first_diverge,
        "compute_dtype": compute,
        "tolerance": tol,
        "ok": ok,
    }


def _check(name: str, result: dict[str, Any], fix: Optional[str] = None) -> None:
    if not result["ok"]:
        tol = result["tolerance"]
        parts = [f"top-1 agreement {result['top1_agreement']:.4f} (needs >= {tol['min_top1']})"]
        if "max_kl" in tol:
            parts.append(f"mean KL divergence {result['mean_kl']:.4g} (needs <= {tol['max_kl']})")
        if "max_rel" in tol:
            parts.append(f"max relative logit difference {result['max_rel_logit_diff']:.4g} (needs <= {tol['max_rel']})")
        if "max_ppl" in tol and result["perplexity_rel_diff"] is not None:
            parts.append(f"perplexity {result['perplexity']:.4g} against {result['perplexity_reference']:.4g} "
                         f"({result['perplexity_rel_diff']:+.2%}, needs within {tol['max_ppl']:.1%})")
        if "min_greedy" in tol:
            parts.append(f"greedy continuations identical {result['greedy_identical']} (needs >= {tol['min_greedy']:.0%})")
        raise ExportError(
            f"{name} does not match its reference: " + ", ".join(parts) + "; the numbers are in final/export.json",
            fix=fix or "do not serve this output. Re-run `ftrun export RUN_DIR` (a truncated write or a full disk "
            "shows like this); if it repeats, report it with export.json.",
        )


# ---------------------------------------------------------------------------------------------
# Models: where each one is loaded, decided from its size and the memory the box has free
#
# Sources relied on (installed versions: accelerate 1.15, transformers 5.24, peft 0.21, torch 2.13):
# - A model loaded with a device_map that sends any module to "cpu" (beside a GPU) or "disk" is dispatched
#   with hooks; its `.to()` / `.cuda()` are wrapped and raise "You can't move a model that has some modules
#   offloaded to cpu or disk." as soon as a parameter is on the meta device (`accelerate/big_modeling.py`,
#   dispatch_model, add_warning). So every model here is loaded in the dtype it is used in, and never moved.
# - PeftModel.from_pretrained on such a base removes the hooks and dispatches again with the device_map and
#   max_memory it is given, "auto" by the box's real free memory otherwise (`peft/peft_model.py`,
#   from_pretrained and load_adapter): the base's own split is passed on. For disk-offloaded modules it
#   rebuilds the offload index and re-saves safetensors files next to the originals (_update_offload, which
#   names the copy by a "--" path component, as in the Hub cache); with a tied lm_head wholly on disk the
#   forward then fails ("File does not contain tensor base_model.model.lm_head.weight", seen with the tiny
#   model). So the parity checks split a model over GPUs and RAM only, never the disk.
# - peft's merge of a disk-offloaded layer keeps the merged weights in RAM (`peft/tuners/tuners_utils.py`,
#   onload_layer re-makes the hook's weights_map as CPU tensors): a merge needs the whole 16-bit model in
#   memory wherever it runs, so it runs on one GPU or on the CPU, or is refused when neither holds it.
# - transformers' GGUF reader dequantizes every tensor and casts it to the requested dtype before loading
#   (`transformers/modeling_gguf_pytorch_utils.py`, load_gguf_checkpoint): the read-back holds the whole model
#   in that dtype in RAM once, like the merge.

# Margins over the weights themselves (policy, not measurements): transient copies while loading and
# allocator fragmentation scale with the model; the CUDA context and one prompt's activations, or the Python
# process with torch, transformers and peft imported plus the kept logits, are a fixed reserve.
HEADROOM = 1.15
GPU_RESERVE = 1.5e9
RAM_RESERVE = 2e9


@dataclass(frozen=True)
class Placement:
    """Where a model is loaded and computed, as from_pretrained's device_map / max_memory and a dtype."""

    device_map: Any  # {"": "cpu"}, {"": "cuda:N"}, "auto" (split over GPUs and RAM by accelerate), None: nowhere
    dtype: str  # torch dtype name: "float32", "bfloat16", "float16"
    reason: str
    max_memory: Optional[dict[Any, int]] = None  # with "auto": bytes per GPU index and for "cpu"; the rest to disk

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def load_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"dtype": self.torch_dtype, "device_map": self.device_map}
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        where = self.device_map if not isinstance(self.device_map, dict) else self.device_map[""]
        out = {"device": where, "dtype": self.dtype, "reason": self.reason}
        if self.max_memory is not None:
            out["max_memory"] = {str(k): v for k, v in self.max_memory.items()}
        return out


def free_gpu_memory() -> list[int]:
    """Free bytes on each visible GPU (cudaMemGetInfo: what other processes hold counts as used); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def available_ram() -> int:
    """Bytes of RAM the box can give without swapping (MemAvailable), not its total."""
    import psutil

    return int(psutil.virtual_memory().available)


def _gpu_that_holds(nbytes: float, gpus_free: list[int]) -> Optional[int]:
    best = max(range(len(gpus_free)), key=lambda i: gpus_free[i], default=None)
    if best is not None and nbytes * HEADROOM + GPU_RESERVE <= gpus_free[best]:
        return best
    return None


def _ram_holds(nbytes: float, ram: int) -> bool:
    return nbytes * HEADROOM + RAM_RESERVE <= ram


def parity_placement(n_params: int, dtype, gpus_free: list[int], ram: int) -> Placement:
    """One placement for every model of the parity checks, so each comparison is on one device and one dtype.

    float32 first, on one GPU or else on the CPU: the TOLERANCE table is set for float32 logits, and float32 on
    both sides leaves only the difference being checked (the merge's rounding, the GGUF type). Only a model
    whose float32 copy fits neither is compared in its 16-bit dtype, spread by accelerate over the GPUs, RAM and
    disk; both sides of a comparison then run in that dtype with that split.
    """
    f32 = 4 * n_params
    gpu = _gpu_that_holds(f32, gpus_free)
    if gpu is not None:
        return Placement({"": f"cuda:{gpu}"}, "float32",
                         f"float32 ({human_size(f32)}) fits GPU {gpu} ({human_size(gpus_free[gpu])} free)")
    if _ram_holds(f32, ram):
        return Placement({"": "cpu"}, "float32", f"float32 ({human_size(f32)}) fits RAM ({human_size(ram)} "
                         "available)" + (", not one GPU" if gpus_free else ""))
    name = str(dtype).replace("torch.", "")
    size16 = n_params * _itemsize(dtype)
    head = f"float32 ({human_size(f32)}) fits neither one GPU nor RAM ({human_size(ram)} available): "
    if _ram_holds(size16, ram) and not gpus_free:
        return Placement({"": "cpu"}, name, head + f"{name} ({human_size(size16)}) on the CPU")
    budget = {i: int(max(free - GPU_RESERVE, 0) / HEADROOM) for i, free in enumerate(gpus_free)}
    budget["cpu"] = int(max(ram - RAM_RESERVE, 0) / HEADROOM)
    if size16 > sum(budget.values()):
        return Placement(None, name, head + f"nor does {name} ({human_size(size16)}) fit the GPUs and RAM together")
    return Placement("auto", name, head + f"{name} ({human_size(size16)}) split over the GPUs and RAM",
                     max_memory=budget)


def merge_placement(n_params: int, dtype, gpus_free: list[int], ram: int, stored_float32: bool = False) -> Placement:
    """Where the merge runs, on one device (never split, so the merged model can be cast): one GPU when it holds the
    model, else the CPU; refused when RAM is short too.

    A base stored in float32 is merged in float32 where that fits and rounded to 16 bit once, after the merge:
    loading it in 16 bit first rounds every weight twice (measured on the tiny model: max relative logit
    difference 0.075 against 0.038). A 16-bit base loses nothing by being merged in its own dtype.
    """
    name = str(dtype).replace("torch.", "")
    for dt, size in ([("float32", 4 * n_params)] if stored_float32 else []) + [(name, n_params * _itemsize(dtype))]:
        gpu = _gpu_that_holds(size, gpus_free)
        if gpu is not None:
            return Placement({"": f"cuda:{gpu}"}, dt, f"{dt} ({human_size(size)}) fits GPU {gpu} "
                             f"({human_size(gpus_free[gpu])} free)")
        if _ram_holds(size, ram):
            return Placement({"": "cpu"}, dt, f"{dt} ({human_size(size)}) fits RAM ({human_size(ram)} available)"
                             + (", not one GPU: merged on the CPU" if gpus_free else ""))
    size16 = n_params * _itemsize(dtype)
    need = size16 * HEADROOM + RAM_RESERVE
    raise ExportError(
        f"merging needs the whole {name} model ({human_size(size16)}) in one place: about {human_size(need)} of "
        f"RAM, and this box has {human_size(ram)} available"
        + (f" and at most {human_size(max(gpus_free))} free on one GPU" if gpus_free else ""),
        fix="export the adapter alone (`export: [adapter]`; vLLM serves it with --enable-lora, see SERVING.md), or "
        f"run `ftrun export RUN_DIR --merged` on a box with at least {human_size(need)} of free RAM.")


def _itemsize(dtype) -> int:
    return 4 if "float32" in str(dtype) else 2


def parameter_count(path: str) -> int:
    """Parameters of the model at path (local folder or cached Hub id), counted on the meta device (no weights)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def export_dtype(config: dict[str, Any]):
    """The 16-bit dtype of the merged model: the base's own when it is 16-bit, else bfloat16."""
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "").replace("torch.", "")
    return torch.float16 if name == "float16" else torch.bfloat16


class Loads:
    """Where each model of the export went, for export.json."""

    def __init__(self):
        self.log: list[dict[str, Any]] = []

    def record(self, what: str, placement: Placement, model) -> None:
        self.log.append({"model": what, "device": placement.to_dict()["device"], "dtype": placement.dtype,
                         "offloaded_to": offloaded(model)})


def load_model(path: str, placement: Placement, loads: Loads, **kwargs):
    """A model loaded in place and in its compute dtype, never quantized (a merge into 4-bit weights loses the
    adapter's precision), never moved afterwards (see the sources above)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **{**placement.load_kwargs(), **kwargs})
    loads.record(path, placement, model)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False) \
            or getattr(model.config, "quantization_config", None):
        raise ExportError(f"{path} loaded as a quantized model; merging needs the 16-bit base",
                          fix="point the recipe's model at the original 16-bit checkpoint, not a 4-bit one "
                          "(e.g. Qwen/Qwen3-8B instead of unsloth/Qwen3-8B-bnb-4bit).")
    return model.eval()


def load_adapter(base, source: Path, placement: Placement, loads: Loads):
    """The adapter on top of a loaded base, under the base's own placement (peft re-dispatches an offloaded base)."""
    from peft import PeftModel

    kwargs = {}
    if placement.max_memory is not None:
        # The base's own split, not a new one: peft would otherwise place the modules again, and a module it
        # moves onto the disk finds no entry in the base's offload index (a tied lm_head has none).
        split = {("base_model.model." + k).rstrip("."): v for k, v in base.hf_device_map.items()}
        kwargs = {"device_map": split, "max_memory": placement.max_memory}
    model = PeftModel.from_pretrained(base, str(source), **kwargs).eval()
    loads.record(f"{source} on that base", placement, model)
    return model


def offloaded(model) -> list[str]:
    """The devices a dispatched model keeps weights on outside its compute device ("cpu" beside a GPU, "disk")."""
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    gpu = any(d not in ("cpu", "disk") for d in devices)
    return sorted(d for d in devices if d == "disk" or (d == "cpu" and gpu))


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
        raise ExportError(f"the adapter in {source} is empty ({nonzero} of {pairs} lora_B tensors non-zero): it "
                          "does not change the base model", fix="the training saved an empty adapter; check "
                          "train.log and metrics.jsonl.")
    size = tree_bytes(path)
    return {"path": str(source), "bytes": size, "size": human_size(size), "rank": config.r,
            "changes_base_logits": None, "file_check": {"lora_B_nonzero": f"{nonzero}/{pairs}", "why": why},
            "chat_template": (source / "chat_template.jinja").is_file() or bool(tokenizer.chat_template)}


def _to_export_dtype(model, dtype):
    """The merged model rounded to its 16-bit dtype: a cast in place, allowed because a merge placement is one
    device (a dispatched model refuses `.to`, see the sources above)."""
    if offloaded(model) or len(set(map(str, (getattr(model, "hf_device_map", None) or {"": 0}).values()))) > 1:
        raise ExportError("the merge was placed over several devices", fix="report this with export.json.")
    return model if model.dtype == dtype else model.to(dtype)


def release() -> None:
    """Give a deleted model's memory back before the next load (the caller drops its references first)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def _safetensors_dtypes(folder: Path) -> set[str]:
    import struct

    seen = set()
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        seen |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return seen


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
        raise ExportError(f"{type(exc).__name__}: {exc}",
                          fix="see the lines above; `ftrun export RUN_DIR --debug` shows the traceback.") from exc
    finally:
        report["seconds"] = round(time.time() - report.pop("started"), 1)
        if run.exists():  # never create files in a folder that is not a run
            run.final.mkdir(exist_ok=True)
            atomic_write_json(report_path, report)
    return report


def _export(inp: Inputs, report: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    config = _model_config(inp.recipe.model, inp.source, inp.is_adapter)
    dtype = export_dtype(config)
    tokenizer = AutoTokenizer.from_pretrained(str(inp.source))
    if not tokenizer.chat_template:
        raise ExportError(f"{inp.source} has no chat template", fix="the base model's tokenizer needs one; "
                          "a model served without its template answers in the wrong format.")
    prompts = parity_prompts(inp.recipe, tokenizer)
    report["parity_prompts"] = [{"tokens": len(p["ids"]), "prompt_tokens": len(p["prompt_ids"])} for p in prompts]
    report["parity_prompts_from"] = prompts[0]["source"] if prompts else None
    report["dtype"] = str(dtype).replace("torch.", "")

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
        _export_models(inp, report, tokenizer, prompts, dtype, parity, merge, loads)
    finally:
        report["placement"]["loads"] = loads.log


def _export_models(inp: Inputs, report: dict[str, Any], tokenizer, prompts, dtype, parity: Placement,
                   merge: Optional[Placement], loads: Loads) -> None:
    """Every model is loaded where its placement says, used, and released before the next one is loaded, so
    the box holds one model at a time (the parity logits, a few MB, are what is kept between them)."""
    final = inp.run.final
    outputs = report["outputs"]
    merged_dir = final / "merged"
    if inp.is_adapter and parity.device_map is None:
        # Nothing here holds the 16-bit base, so its logits cannot be compared: the adapter is checked as a file.
        outputs["adapter"] = _adapter_file_check(inp.source, tokenizer, parity.reason)
        _say(f"adapter {outputs['adapter']['size']} (rank {outputs['adapter']['rank']}): checked as a file, not "
             f"by logits ({parity.reason})")
        return _serving(inp, report, tokenizer)
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
            "path": str(inp.source), "bytes": size, "size": human_size(size), "rank": rank,
            # An adapter that does not move the logits is untrained or was saved empty.
            "changes_base_logits": {"mean_kl": effect["mean_kl"], "top1_agreement_with_base": effect["top1_agreement"]},
            "chat_template": (inp.source / "chat_template.jinja").is_file() or bool(tokenizer.chat_template),
        }
        if effect["max_abs_logit_diff"] == 0.0:
            raise ExportError(f"the adapter in {inp.source} does not change the base model's output",
                              fix="the training saved an empty adapter; check train.log and metrics.jsonl.")
        _say(f"adapter {human_size(size)} (rank {rank}), reloads and changes the base "
             f"(top-1 agreement with base {effect['top1_agreement']:.3f})")
        if merge is None:
            return _serving(inp, report, tokenizer)
        _say(f"merging the adapter into the {merge.dtype} base")
        # A fresh base in the export dtype, where the merge placement says: the merged weights are rounded once,
        # from the adapter's own precision (peft keeps float32 adapter weights over a 16-bit base).
        merged = load_adapter(load_model(inp.recipe.model, merge, loads), inp.source, merge, loads)
        merged = _to_export_dtype(merged.merge_and_unload(), dtype)
        kind = "merged"
    else:
        size = tree_bytes(inp.source)
        outputs["model"] = {"path": str(inp.source), "bytes": size, "size": human_size(size)}
        if merge is None:  # the full model is already servable as it is
            return _serving(inp, report, tokenizer)
        _say(f"loading the full fine-tune {inp.source}")
        ref_model = load_model(str(inp.source), parity, loads)
        ref = model_outputs(ref_model, prompts)
        del ref_model
        release()
        merged = _to_export_dtype(load_model(str(inp.source), merge, loads), dtype)
        kind = "full:merged"

    def write_merged(tmp: Path) -> None:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))

    _write_dir_atomically(merged_dir, write_merged)
    del merged
    release()
    dtypes = _safetensors_dtypes(merged_dir)
    saved_cfg = json.loads((merged_dir / "config.json").read_text())
    if "quantization_config" in saved_cfg or not dtypes <= {"BF16", "F16"}:
        raise ExportError(f"the merged model in {merged_dir} is not plain 16-bit (tensors: {sorted(dtypes)})",
                          fix="report this with export.json; do not serve the merged folder.")
    reloaded = load_model(str(merged_dir), parity, loads)
    merged_out = model_outputs(reloaded, prompts)
    del reloaded
    release()
    result = compare(ref, merged_out, kind, parity.dtype)
    size = tree_bytes(merged_dir)
    outputs["merged"] = {"path": str(merged_dir), "bytes": size, "size": human_size(size),
                         "tensor_dtypes": sorted(dtypes), "parity_vs_" + ("base_plus_adapter" if inp.is_adapter else "full_model"): result}
    _say(f"merged model {human_size(size)} in {merged_dir}: top-1 agreement {result['top1_agreement']:.4f}, "
         f"max |dlogit| {result['max_abs_logit_diff']:.3g}, greedy identical {result['greedy_identical']}")
    _check("the merged model", result)
    del ref

    if "gguf" in inp.formats:
        try:
            outputs["gguf"] = gguf_output(merged_dir, final / "gguf", inp.run.root.name, inp.gguf_type, prompts,
                                          merged_out, tokenizer, parity.dtype)
        except _GgufFailed as exc:
            outputs["gguf"] = exc.output  # the numbers of the failed check go into export.json
            raise
    _serving(inp, report, tokenizer)


CONFIG_KEYS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
               "num_attention_heads": "head_count", "num_key_value_heads": "head_count_kv",
               "intermediate_size": "feed_forward_length", "head_dim": "key_length", "rms_norm_eps": "rms_eps"}


def _config_diff(merged: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """The architecture numbers the GGUF declares that differ from the merged model's config.json."""
    diffs = []
    for key, gkey in CONFIG_KEYS.items():
        want, got = merged.get(key), meta.get(gkey)
        if key == "head_dim" and want is None:
            want = merged["hidden_size"] // merged["num_attention_heads"]
        if want is None or got is None:
            continue
        if (abs(float(want) - float(got)) > 1e-6 * max(abs(float(want)), 1.0)) if isinstance(want, float) else want != got:
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


def gguf_output(merged_dir: Path, gguf_dir: Path, name: str, gguf_type: str, prompts: list[dict[str, Any]],
                merged_out: list[dict[str, Any]], tokenizer, compute: str = "float32",
                intermediate: Optional[Path] = None) -> dict[str, Any]:
    """Convert the merged folder with llama.cpp's converter, quantize with its quantizer, read the file back in
    llama.cpp and compare it with the merged model's outputs (merged_out, computed by transformers).

    The steps run one after the other, each streaming from disk in its own process (llamacpp.py); the 16-bit
    GGUF a quantized type is made from is written beside the result and removed after (unless `intermediate`
    names one to reuse: tests quantize one conversion to several types)."""
    conv = llamacpp.converter()
    kind = gguf_types.TYPES[gguf_type]
    gguf_dir.mkdir(parents=True, exist_ok=True)
    fname = f"{name}-{kind.name}.gguf"
    path = gguf_dir / fname
    tmp = gguf_dir / f".{fname}.tmp"
    steps: dict[str, Any] = {}
    try:
        if kind.converter:
            _say(f"writing {fname} with llama.cpp's converter ({conv.source})")
            steps["convert"] = llamacpp.convert(conv, merged_dir, tmp, kind.converter).to_dict()
        else:
            sixteen = intermediate
            if sixteen is None or not sixteen.is_file():
                # the merged model's own 16-bit type, so the conversion itself rounds nothing
                dtype = (_safetensors_dtypes(merged_dir) & {"BF16", "F16"} or {"BF16"}).pop().lower()
                sixteen = gguf_dir / f".{name}-{dtype.upper()}.tmp.gguf"
                _say(f"converting the merged model to a {dtype.upper()} GGUF with llama.cpp's converter ({conv.source})")
                steps["convert"] = llamacpp.convert(conv, merged_dir, sixteen, dtype).to_dict()
            _say(f"quantizing to {kind.name} with llama.cpp's quantizer")
            steps["quantize"] = llamacpp.quantize(sixteen, tmp, gguf_type).to_dict()
            if intermediate is None:
                sixteen.unlink()
    except llamacpp.StepFailed as exc:
        tmp.unlink(missing_ok=True)
        raise ExportError(str(exc), fix="the lines above are llama.cpp's; `python -m launcher.deliver.llamacpp check "
                          f"{merged_dir}` says whether this model is supported.") from None
    os.replace(tmp, path)
    meta = llamacpp.metadata(path)
    _say(f"reading {fname} back in llama.cpp")
    t0 = time.monotonic()
    gguf_out, same_tokens = llamacpp.run_prompts(path, prompts, GREEDY_NEW_TOKENS, _stop_ids(merged_dir, tokenizer))
    steps["llama_cpp_prompts_seconds"] = round(time.monotonic() - t0, 2)
    config_diff = _config_diff(json.loads((merged_dir / "config.json").read_text()), meta)
    result = compare(merged_out, gguf_out, f"gguf:{gguf_type}", compute)
    size = path.stat().st_size
    out = {"path": str(path), "type": kind.name, "bytes": size, "size": human_size(size),
           "written_by": f"llama.cpp {conv.source}" + ("" if kind.converter else f" + quantizer ({llamacpp.DIST} "
                                                       f"{llamacpp.runtime_version()})"),
           "converter_gguf_py": conv.gguf_py, "steps": steps, "architecture": meta["architecture"],
           "tokenizer_pre": meta["tokenizer_pre"], "tensor_types": meta["tensor_types"],
           "chat_template_included": meta.get("chat_template") == tokenizer.chat_template,
           "tokenizer_identical": f"{sum(same_tokens)}/{len(same_tokens)}",
           "config_differences": config_diff, "parity_vs_merged": result}
    ppl = result["perplexity_rel_diff"]
    _say(f"GGUF {human_size(size)} {fname} ({', '.join(f'{k} x{v}' for k, v in meta['tensor_types'].items())}): "
         f"in llama.cpp top-1 agreement {result['top1_agreement']:.4f}, perplexity "
         f"{'-' if ppl is None else f'{ppl:+.2%}'}, greedy identical {result['greedy_identical']}, "
         f"tokenizer identical {out['tokenizer_identical']}")
    try:
        if config_diff:
            raise ExportError(f"{fname} describes a different model than the merged one: " + "; ".join(config_diff),
                              fix="do not serve this GGUF; report it with export.json.")
        if not all(same_tokens):
            raise ExportError(f"llama.cpp splits the parity prompts into other tokens with {fname} than the model's "
                              "own tokenizer", fix="do not serve this GGUF: Ollama would see other tokens than "
                              "training did; report it with export.json (tokenizer_pre says which split rule it has).")
        if not out["chat_template_included"]:
            raise ExportError(f"{fname} does not carry the model's chat template",
                              fix="report this with export.json; Ollama would fall back to a wrong template.")
        higher = gguf_types.advised_above(gguf_type)
        _check(f"the GGUF {fname} (in llama.cpp)", result,
               fix="do not serve this file; a type with more bits keeps closer to the model: "
               + (f"`ftrun export RUN_DIR --gguf {higher}`" if higher else "report it with export.json") + ".")
    except ExportError as exc:
        out["error"] = exc.message
        raise _GgufFailed(exc, out) from None
    return out


class _GgufFailed(ExportError):
    """A GGUF that was written but failed a check: its numbers still go into export.json."""

    def __init__(self, exc: ExportError, out: dict[str, Any]):
        super().__init__(exc.message, fix=exc.fix)
        self.output = out


# ---------------------------------------------------------------------------------------------
# Serving commands

def _serving(inp: Inputs, report: dict[str, Any], tokenizer) -> None:
    from launcher.deliver import serving

    merged_dir = inp.run.final / "merged"
    eos_ids = _stop_ids(merged_dir, tokenizer) if "merged" in report["outputs"] else None
    text, modelfile = serving.render(inp.run, inp.recipe, report, tokenizer, eos_ids=eos_ids)
    (inp.run.final / "SERVING.md").write_text(text)
    report["serving"] = str(inp.run.final / "SERVING.md")
    if modelfile is not None:
        path = inp.run.final / "gguf" / "Modelfile"
        path.write_text(modelfile["text"])
        report["outputs"]["gguf"]["modelfile"] = str(path)
        report["outputs"]["gguf"]["modelfile_template_check"] = modelfile["check"]
    _say(f"serving commands in {inp.run.final / 'SERVING.md'}")


def _record_export(run: RunDir, formats: Optional[list[str]], started: float, info: dict[str, Any]) -> None:
    """A finished run's state after `ftrun export`: succeeded when the export passed its checks, else
    trained-not-exported (the training result is good; the export is not)."""
    from launcher.store.state import TRAINED, read_state, set_state

    if read_state(run).get("state") not in TRAINED:
        return
    info.update(formats=list(formats or inp_formats(run)), seconds=round(time.time() - started, 1))
    ok = info["state"] == "succeeded"
    set_state(run, "succeeded" if ok else "trained-not-exported", export=info,
              reason="training finished" if ok else f"trained, not exported: {info['reason']}")


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
        _record_export(run, formats, started, {"state": "failed", "reason": exc.message.splitlines()[0]
                                               + f"; retry with `ftrun export {run.root}`"})
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
