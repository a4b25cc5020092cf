"""The final model's files in the base model's own dtype, whatever dtype training kept the weights in (fp32 master
weights, FSDP2's upcast, the CPU): docs/engines.md, "A full fine-tune's final model in its base's dtype". trl/ddp cast
tensor by tensor on rank 0 (`save_model`), FSDP per parameter (engines/fsdp.py save_full), ZeRO-3's 16-bit output is
recast file by file where it differs (`recast_folder`). LoRA adapters are left as PEFT writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

CONFIG = "config.json"
# safetensors dtype names of the float types a published model comes in
_SAFETENSORS_FLOAT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# what a model says nothing about is most likely published in (and what export_dtype assumes)
DEFAULT_DTYPE = "bfloat16"


def base_dtype_name(model: str) -> tuple[str, str]:
    """(dtype name, where it was read) of the base model: config.json's `dtype` (or `torch_dtype`), else its first
    floating safetensors tensor, as dtype="auto" does (transformers `modeling_utils.py`, _get_dtype), else bfloat16."""
    config = _read_config(model)
    if config is not None:
        for section in (config, config.get("text_config") or {}):
            name = str(section.get("dtype") or section.get("torch_dtype") or "").replace("torch.", "")
            if name in _SAFETENSORS_FLOAT.values():
                return name, "the base model's config.json"
    name = _weights_dtype(model)
    if name is not None:
        return name, "the base model's weights"
    return DEFAULT_DTYPE, "assumed: the base model's config.json and weights say nothing"


def final_dtype(recipe) -> tuple[Any, str]:
    """(torch dtype, where it was read) final/model is written in; (None, ...) for an adapter."""
    import torch

    from launcher.store import final

    if final.kind(recipe.method) != final.MODEL:
        return None, "an adapter keeps PEFT's dtype"
    name, source = base_dtype_name(recipe.model)
    return getattr(torch, name), source


def _read_config(model: str) -> Optional[dict[str, Any]]:
    path = _local_file(model, CONFIG)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _local_file(model: str, name: str) -> Optional[Path]:
    from launcher.model_files import local_file

    return local_file(model, name)


def _weights_dtype(model: str) -> Optional[str]:
    from launcher.store.final import MODEL_INDEX, MODEL_WEIGHTS, ArtifactError, read_header

    first = _local_file(model, MODEL_WEIGHTS)
    if first is None:
        index = _local_file(model, MODEL_INDEX)
        try:
            shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0] if index else None
        except (OSError, ValueError, KeyError, IndexError):
            shard = None
        first = _local_file(model, shard) if shard else None
    if first is None:
        return None
    try:
        header = read_header(first)
    except ArtifactError:
        return None
    return next((_SAFETENSORS_FLOAT[t["dtype"]] for t in header.values() if t.get("dtype") in _SAFETENSORS_FLOAT), None)


def cast_state_dict(state: dict[str, Any], dtype) -> dict[str, Any]:
    """In place: every floating tensor replaced by a CPU copy in `dtype`, one at a time; tied tensors share the copy
    (save_pretrained finds ties by storage, `remove_tied_weights_from_state_dict`)."""
    import torch

    copies: dict[tuple, Any] = {}
    for key in list(state):
        t = state[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        ident = (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident not in copies:
            copies[ident] = t.detach().to(device="cpu", dtype=dtype)
        state[key] = copies[ident]
    return state


def set_config_dtype(folder: Path, dtype) -> None:
    """config.json says the dtype the weights were written in (save_pretrained wrote the training dtype)."""
    path = Path(folder) / CONFIG
    config = json.loads(path.read_text())
    name = str(dtype).replace("torch.", "")

    def put(section: dict) -> None:
        section.pop("torch_dtype", None)
        section["dtype"] = name
        for value in section.values():  # composite models keep one per sub-config (text_config, vision_config)
            if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
                put(value)

    put(config)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def save_model(model, out_dir: Path, dtype) -> None:
    """The whole unsharded model written in `dtype` by save_pretrained; not collective (the writing rank only)."""
    state = cast_state_dict(model.state_dict(), dtype)
    model.save_pretrained(str(out_dir), state_dict=state)
    set_config_dtype(out_dir, dtype)


def weight_files(folder: Path) -> list[Path]:
    from launcher.store.final import MODEL_INDEX, MODEL_WEIGHTS

    folder = Path(folder)
    if (folder / MODEL_INDEX).is_file():
        index = json.loads((folder / MODEL_INDEX).read_text())
        return [folder / name for name in sorted(set(index["weight_map"].values()))]
    return [folder / MODEL_WEIGHTS] if (folder / MODEL_WEIGHTS).is_file() else []


def tensor_dtypes(folder: Path) -> set[str]:
    from launcher.store.final import read_header

    return {t["dtype"] for f in weight_files(folder) for t in read_header(f).values()}


def recast_folder(folder: Path, dtype) -> bool:
    """A model folder rewritten in `dtype`, one weight file at a time, and config.json set to it. Returns whether any
    file was rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from launcher.store.final import MODEL_INDEX, read_header

    want = next(k for k, v in _SAFETENSORS_FLOAT.items() if v == str(dtype).replace("torch.", ""))
    changed = False
    for path in weight_files(folder):
        header = read_header(path)
        if all(t["dtype"] == want for t in header.values() if t["dtype"] in _SAFETENSORS_FLOAT):
            continue
        out: dict[str, Any] = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
                del t
        tmp = path.with_name(path.name + ".tmp")
        save_file(out, str(tmp), metadata=metadata)
        del out
        os.replace(tmp, path)
        changed = True
    index = Path(folder) / MODEL_INDEX
    if changed and index.is_file():  # the index's total_size counts the bytes as they are now
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(
            t["data_offsets"][1] - t["data_offsets"][0] for f in weight_files(folder) for t in read_header(f).values()
        )
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, index)
    set_config_dtype(folder, dtype)
    return changed
