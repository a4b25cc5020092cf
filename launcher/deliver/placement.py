"""Where each model of the export is loaded, decided from its size against the memory the box has free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.deliver.messages import ExportError, human_size

# Sources relied on (accelerate 1.15, transformers 5.24, peft 0.21, torch 2.13):
# - a model dispatched with modules on "cpu" (beside a GPU) or "disk" refuses `.to()` (`accelerate/big_modeling.py`,
#   dispatch_model, add_warning): every model is loaded in the dtype it is used in, and never moved;
# - PeftModel.from_pretrained re-dispatches such a base (`peft/peft_model.py`, from_pretrained): the base's split is
#   passed on; its disk offload (_update_offload) fails for a tied lm_head wholly on disk, so the parity checks
#   split over GPUs and RAM only;
# - peft's merge of an offloaded layer keeps the merged weights in RAM (`peft/tuners/tuners_utils.py`, onload_layer):
#   a merge runs on one GPU or the CPU, or is refused.

# Margins over the weights (policy, not measurements): copies and fragmentation scale with the model; the CUDA
# context and activations, or the Python process and kept logits, are a fixed reserve.
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
    """Bytes of RAM the box can give without swapping (MemAvailable), within a container's memory limit."""
    import psutil

    from launcher.plan.cgroup import memory_headroom_bytes

    available = int(psutil.virtual_memory().available)
    headroom = memory_headroom_bytes()
    return min(available, headroom) if headroom is not None else available


def _gpu_that_holds(nbytes: float, gpus_free: list[int]) -> Optional[int]:
    best = max(range(len(gpus_free)), key=lambda i: gpus_free[i], default=None)
    if best is not None and nbytes * HEADROOM + GPU_RESERVE <= gpus_free[best]:
        return best
    return None


def _ram_holds(nbytes: float, ram: int) -> bool:
    return nbytes * HEADROOM + RAM_RESERVE <= ram


def parity_placement(n_params: int, dtype, gpus_free: list[int], ram: int) -> Placement:
    """One placement for every model of the parity checks, so each comparison is on one device and one dtype: float32
    (the TOLERANCE table's) on one GPU, else the CPU; only where float32 fits neither, the 16-bit dtype split by
    accelerate over the GPUs and RAM."""
    f32 = 4 * n_params
    gpu = _gpu_that_holds(f32, gpus_free)
    if gpu is not None:
        return Placement(
            {"": f"cuda:{gpu}"},
            "float32",
            f"float32 ({human_size(f32)}) fits GPU {gpu} ({human_size(gpus_free[gpu])} free)",
        )
    if _ram_holds(f32, ram):
        return Placement(
            {"": "cpu"},
            "float32",
            f"float32 ({human_size(f32)}) fits RAM ({human_size(ram)} "
            "available)" + (", not one GPU" if gpus_free else ""),
        )
    name = str(dtype).replace("torch.", "")
    size16 = n_params * _itemsize(dtype)
    head = f"float32 ({human_size(f32)}) fits neither one GPU nor RAM ({human_size(ram)} available): "
    if _ram_holds(size16, ram) and not gpus_free:
        return Placement({"": "cpu"}, name, head + f"{name} ({human_size(size16)}) on the CPU")
    budget = {i: int(max(free - GPU_RESERVE, 0) / HEADROOM) for i, free in enumerate(gpus_free)}
    budget["cpu"] = int(max(ram - RAM_RESERVE, 0) / HEADROOM)
    if size16 > sum(budget.values()):
        return Placement(None, name, head + f"nor does {name} ({human_size(size16)}) fit the GPUs and RAM together")
    return Placement(
        "auto", name, head + f"{name} ({human_size(size16)}) split over the GPUs and RAM", max_memory=budget
    )


def merge_placement(n_params: int, dtype, gpus_free: list[int], ram: int, stored_float32: bool = False) -> Placement:
    """Where the merge runs, on one device (so the merged model can be cast): one GPU, else the CPU, else refused. A
    float32 base is merged in float32 where that fits and rounded once after (loading it in 16 bit rounds twice:
    tiny model, max relative logit difference 0.075 against 0.038)."""
    name = str(dtype).replace("torch.", "")
    for dt, size in ([("float32", 4 * n_params)] if stored_float32 else []) + [(name, n_params * _itemsize(dtype))]:
        gpu = _gpu_that_holds(size, gpus_free)
        if gpu is not None:
            return Placement(
                {"": f"cuda:{gpu}"}, dt, f"{dt} ({human_size(size)}) fits GPU {gpu} ({human_size(gpus_free[gpu])} free)"
            )
        if _ram_holds(size, ram):
            return Placement(
                {"": "cpu"},
                dt,
                f"{dt} ({human_size(size)}) fits RAM ({human_size(ram)} available)"
                + (", not one GPU: merged on the CPU" if gpus_free else ""),
            )
    size16 = n_params * _itemsize(dtype)
    need = size16 * HEADROOM + RAM_RESERVE
    raise ExportError(
        f"merging needs the whole {name} model ({human_size(size16)}) in one place: about {human_size(need)} of "
        f"RAM, and this box has {human_size(ram)} available"
        + (f" and at most {human_size(max(gpus_free))} free on one GPU" if gpus_free else ""),
        fix="export the adapter alone (`export: [adapter]`; vLLM serves it with --enable-lora, see SERVING.md), or "
        f"run `ftrun export RUN_DIR --merged` on a box with at least {human_size(need)} of free RAM.",
    )


def _itemsize(dtype) -> int:
    return 4 if "float32" in str(dtype) else 2


def parameter_count(path: str) -> int:
    """Parameters of the model at path (local folder or cached Hub id), counted on the meta device (no weights)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from launcher.worker.loading import model_class  # a vision-language model: image-text-to-text, tower included

    with init_empty_weights():
        model = model_class(path).from_config(AutoConfig.from_pretrained(path))
    # on the meta device tied embeddings are two tensors (transformers 5.24): tied, parameters() counts them once
    model.tie_weights()
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
        where = placement.to_dict()["device"]
        self.log.append({"model": what, "device": where, "dtype": placement.dtype, "offloaded_to": offloaded(model)})


def load_model(path: str, placement: Placement, loads: Loads, **kwargs):
    """A model loaded in place and in its compute dtype, never quantized, never moved afterwards (sources above)."""
    from launcher.worker.loading import apply_sdpa_backends, model_class

    apply_sdpa_backends()  # the parity check's generation takes the worker's attention backends
    model = model_class(path).from_pretrained(path, **{**placement.load_kwargs(), **kwargs})
    loads.record(path, placement, model)
    if (
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model.config, "quantization_config", None)
    ):
        raise ExportError(
            f"{path} loaded as a quantized model; merging needs the 16-bit base",
            fix="point the recipe's model at the original 16-bit checkpoint, not a 4-bit one "
            "(e.g. Qwen/Qwen3-8B instead of unsloth/Qwen3-8B-bnb-4bit).",
        )
    return model.eval()


def load_adapter(base, source: Path, placement: Placement, loads: Loads):
    """The adapter on top of a loaded base, under the base's own placement (peft re-dispatches an offloaded base)."""
    from peft import PeftModel

    kwargs = {}
    if placement.max_memory is not None:
        # the base's own split: peft would place the modules again (sources above)
        split = {("base_model.model." + k).rstrip("."): v for k, v in base.hf_device_map.items()}
        kwargs = {"device_map": split, "max_memory": placement.max_memory}
    model = PeftModel.from_pretrained(base, str(source), **kwargs).eval()
    loads.record(f"{source} on that base", placement, model)
    return model


# The places of an accelerate device_map that are not a compute device (parity.input_device skips them too)
HOST_PLACES = ("cpu", "disk")


def offloaded(model) -> list[str]:
    """The devices a dispatched model keeps weights on outside its compute device ("cpu" beside a GPU, "disk")."""
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    gpu = any(d not in HOST_PLACES for d in devices)
    return sorted(d for d in devices if d == "disk" or (d == "cpu" and gpu))


def _to_export_dtype(model, dtype):
    """The merged model cast to its 16-bit dtype, in place (a merge placement is one device)."""
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
