"""The final result of a run: its layout (final/adapter or final/model) and its verification.

A run is `succeeded` only when the supervisor's `verify` passed after the worker exited 0. The check reads files only
(JSON, the safetensors layout: an 8-byte header length, a JSON header, the tensor bytes): no torch, no GPU.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from launcher import methods
from launcher.model_files import local_file

ADAPTER, MODEL = "adapter", "model"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"

# Bytes per element of the safetensors dtypes; packed 4-bit types are left out of the size check.
_ITEMSIZE = {f"{t}{bits}": bits // 8 for t in "IU" for bits in (8, 16, 32, 64)}
_ITEMSIZE.update({"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1})
# A float is inf or NaN exactly when its exponent bits are all ones: (unsigned view, mask), so bf16 needs no numpy
# float type. F8_E4M3 ("fn") has no inf; its NaN is every bit but the sign set.
_NON_FINITE = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),
}
_CHUNK = 64 * 1024 * 1024  # bytes scanned at a time: memory stays flat whatever the model's size


class ArtifactError(Exception):
    """A final artifact that is missing, empty, truncated or malformed; the message names the file."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # one line: what was verified, or what is wrong and with which file
    details: dict[str, Any] = field(default_factory=dict)


def kind(method: str) -> str:
    return ADAPTER if methods.is_adapter(method) else MODEL


def path(final_root: Path, method: str) -> Path:
    return Path(final_root) / kind(method)


def read_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file, after checking that its size and each tensor's bytes are as promised."""
    file = Path(file)
    if not file.is_file():
        raise ArtifactError(f"{file.name} is missing")
    size = file.stat().st_size
    if size == 0:
        raise ArtifactError(f"{file.name} is empty (0 bytes)")
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ArtifactError(f"{file.name} is truncated ({size} bytes, shorter than a safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ArtifactError(
                f"{file.name} is truncated: its header says {n:,} bytes of header, the file has {size:,} bytes"
            )
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise ArtifactError(f"{file.name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{file.name} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    end = 0
    for name, t in header.items():
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
            shape = [int(d) for d in t["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{file.name}: tensor {name} has no valid dtype/shape/data_offsets") from None
        numel = math.prod(shape)
        item = _ITEMSIZE.get(t.get("dtype"))
        if item is not None and stop - begin != numel * item:
            raise ArtifactError(
                f"{file.name}: tensor {name} {t.get('dtype')}{shape} should take {numel * item:,} "
                f"bytes, its offsets give {stop - begin:,}"
            )
        end = max(end, stop)
    if size != 8 + n + end:
        raise ArtifactError(
            f"{file.name} is truncated: {size:,} bytes, its header describes {8 + n + end:,}"
            if size < 8 + n + end
            else f"{file.name} has {size - 8 - n - end:,} bytes after its last tensor"
        )
    return header


def non_finite(file: Path, header: dict[str, dict[str, Any]]) -> list[str]:
    """Names of the float tensors holding inf or NaN, read in chunks through a memory map."""
    import mmap

    import numpy as np

    bad = []
    with Path(file).open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        base = 8 + n
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name, t in header.items():
                how = _NON_FINITE.get(t["dtype"])
                if how is None:
                    continue
                dtype, mask = np.dtype(how[0]), how[1]
                begin, stop = (base + int(x) for x in t["data_offsets"])
                step = _CHUNK - _CHUNK % dtype.itemsize
                for at in range(begin, stop, step):
                    count = min(step, stop - at) // dtype.itemsize
                    bits = np.frombuffer(mm, dtype=dtype, count=count, offset=at)
                    hit = bool(np.any((bits & dtype.type(mask)) == dtype.type(mask)))
                    del bits  # a view pins the map: released before the next chunk and before the map closes
                    if hit:
                        bad.append(name)
                        break
    return bad


def _all_zero(file: Path, header: dict[str, dict[str, Any]], names: list[str]) -> bool:
    import mmap

    import numpy as np

    with Path(file).open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name in names:
                begin, stop = (8 + n + int(x) for x in header[name]["data_offsets"])
                # +0.0 and -0.0 are the only floats whose bits other than the sign are all zero
                raw = np.frombuffer(mm, dtype=np.uint8, count=stop - begin, offset=begin)
                nonzero = bool(np.any(raw))
                del raw
                if nonzero:
                    return False
    return True


def base_weights(model: str) -> Optional[dict[str, list[int]]]:
    """{name: shape} of the base model's safetensors (a local folder or the Hugging Face cache), else None."""
    files: list[Path] = []
    index = local_file(model, MODEL_INDEX)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, OSError):
            return None
        for shard in shards:
            p = local_file(model, shard)
            if p is None:
                return None
            files.append(p)
    else:
        single = local_file(model, MODEL_WEIGHTS)
        if single is None:
            return None
        files.append(single)
    out: dict[str, list[int]] = {}
    try:
        for f in files:
            out.update({k: list(v["shape"]) for k, v in read_header(f).items()})
    except ArtifactError:
        return None
    return out


_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PEFT_PREFIX = "base_model.model."
# MoE experts fused into one parameter (transformers 5) are not Linear modules: PEFT adapts none of them.
_EXPERTS = re.compile(r"\.experts\.")


def _matches(module: str, targets: Union[str, list[str]]) -> bool:
    # PEFT's rule (peft 0.21 tuners_utils.py check_target_module_exists): a list names a module or its last parts;
    # a string is a regular expression the whole name must match (a vision-language model's, worker/loading.py)
    if isinstance(targets, str):
        name = module[len(_PEFT_PREFIX) :] if module.startswith(_PEFT_PREFIX) else module
        return re.fullmatch(targets, name) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


# A vision-language checkpoint's weight names as transformers loads them, where PEFT's names come from (transformers
# 5.24 conversion_mapping.py "Qwen2VLForConditionalGeneration"); applied only to an adapter whose targets are a
# regular expression, as the worker writes them for a vision-language model alone.
_LOADED_NAMES = ((r"^visual", "model.visual"), (r"^model(?!\.(language_model|visual))", "model.language_model"))


def _loaded_name(name: str) -> str:
    for pattern, target in _LOADED_NAMES:
        name = re.sub(pattern, target, name)
    return name


def _missing(folder: Path, name: str) -> Verdict:
    where = f"final/{folder.name}"
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if present:
        return Verdict(False, f"{where}/{name} is missing ({where} holds only {', '.join(present)})")
    return Verdict(False, f"{where}/{name} is missing ({where} {'is empty' if folder.is_dir() else 'does not exist'})")


def verify_adapter(
    folder: Path, target_modules: Union[str, list[str]], base: Optional[dict[str, list[int]]] = None
) -> Verdict:
    """The adapter's config and weights: LoRA A/B pairs for every target module, ranks that agree, finite, trained;
    with the base model's weight names (`base`), every adapted module in the base and every targeted one adapted."""
    folder = Path(folder)
    where = f"final/{folder.name}"
    weights = f"{where}/{ADAPTER_WEIGHTS}"
    cfg_path = folder / ADAPTER_CONFIG
    if not cfg_path.is_file():
        return _missing(folder, ADAPTER_CONFIG)
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError:
        return Verdict(False, f"{where}/{ADAPTER_CONFIG} is not valid JSON")
    try:
        header = read_header(folder / ADAPTER_WEIGHTS)
    except ArtifactError as exc:
        return Verdict(False, f"{where}/{exc}")
    if not header:
        return Verdict(False, f"{weights} holds no tensors")
    empty = [k for k, t in header.items() if 0 in t["shape"]]
    if empty:
        return Verdict(False, f"{weights}: {len(empty)} empty tensor(s), e.g. {empty[0]}")
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, t in header.items():
        m = _LORA.match(name)
        if m:
            pairs.setdefault(m["module"], {})[m["ab"]] = list(t["shape"])
    if not pairs:
        shown = ", ".join(sorted(header)[:3])
        return Verdict(False, f"{weights} holds no LoRA tensors (lora_A/lora_B); its tensors: {shown}")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            return Verdict(False, f"{weights}: {module} has lora_{''.join(ab)} without its pair")
        if len(ab["A"]) != 2 or len(ab["B"]) != 2 or ab["A"][0] != ab["B"][1]:
            return Verdict(False, f"{weights}: {module} lora_A {ab['A']} and lora_B {ab['B']} do not share a rank")
    recorded = cfg.get("target_modules") or []
    if isinstance(recorded, str):  # PEFT's regular expression: the modules the worker chose, by their full names
        targets: Union[str, list[str]] = recorded
    else:  # "all-linear" is resolved by PEFT into the modules it adapted, recorded in the adapter's config
        targets = list(target_modules) if isinstance(target_modules, (list, tuple)) else list(recorded)
    if isinstance(targets, str):  # a regular expression: it must have adapted something
        missing = [] if any(_matches(m, targets) for m in pairs) else [targets]
    else:
        missing = [t for t in targets if not any(_matches(m, [t]) for m in pairs)]
    if missing:
        missing_words = f"{', '.join(missing)} (it adapts {len(pairs)} module(s))"
        return Verdict(False, f"{weights} has no LoRA tensors for target module(s) {missing_words}")
    cross = "base model's weight names not found on this machine: not cross-checked"
    if base is not None and isinstance(targets, str):
        base = {_loaded_name(k): v for k, v in base.items()}
    if base is not None:
        names = {m[len(_PEFT_PREFIX) :] if m.startswith(_PEFT_PREFIX) else m for m in pairs}
        unknown = sorted(n for n in names if f"{n}.weight" not in base)
        linear = [k[: -len(".weight")] for k in base if k.endswith(".weight") and not _EXPERTS.search(k)]
        targeted = {k for k in linear if _matches(k, targets)}
        uncovered = sorted(targeted - names)
        if unknown:
            return Verdict(
                False, f"{weights} adapts {len(unknown)} module(s) the base model does not have, e.g. {unknown[0]}"
            )
        if uncovered:
            adapted = f"{len(targeted) - len(uncovered)} of the base model's {len(targeted)} target modules"
            return Verdict(False, f"{weights} adapts {adapted}; missing e.g. {uncovered[0]}")
        cross = f"all {len(targeted)} targeted modules of the base model adapted"
    bad = non_finite(folder / ADAPTER_WEIGHTS, header)
    if bad:
        return Verdict(False, f"{weights}: {len(bad)} tensor(s) hold inf/NaN, e.g. {bad[0]}")
    b_names = [f"{m}.lora_B.weight" for m in pairs]
    if _all_zero(folder / ADAPTER_WEIGHTS, header, b_names):
        return Verdict(
            False,
            f"{weights}: every lora_B is zero, the untrained initialisation (the trained values were not saved)",
            # the supervisor tells a run that learned nothing (GRPO without reward variance) from a failed save
            {"untrained": True},
        )
    r = sorted({ab["A"][0] for ab in pairs.values()})
    details = {
        "kind": ADAPTER,
        "path": str(folder),
        "lora_modules": len(pairs),
        "tensors": len(header),
        "rank": r[0] if len(r) == 1 else r,
        "bytes": (folder / ADAPTER_WEIGHTS).stat().st_size,
        "cross_check": cross,
    }
    return Verdict(True, f"{where}: {len(pairs)} LoRA modules (r={details['rank']}), finite; {cross}", details)


def verify_model(folder: Path, base: Optional[dict[str, list[int]]] = None) -> Verdict:
    """config.json and the safetensors weights (one file, or an index and its shards): complete files, finite
    values, and, with the base model's weights (`base`), every base weight present with its shape."""
    folder = Path(folder)
    where = f"final/{folder.name}"
    if not (folder / MODEL_CONFIG).is_file():
        return _missing(folder, MODEL_CONFIG)
    try:
        config = json.loads((folder / MODEL_CONFIG).read_text())
    except ValueError:
        return Verdict(False, f"{where}/{MODEL_CONFIG} is not valid JSON")
    index_path = folder / MODEL_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError):
            return Verdict(False, f"{where}/{MODEL_INDEX} is not a valid index (no weight_map)")
        files = sorted(set(weight_map.values()))
    elif (folder / MODEL_WEIGHTS).is_file():
        weight_map, files = None, [MODEL_WEIGHTS]
    else:
        return Verdict(False, f"{where} has no weights: neither {MODEL_WEIGHTS} nor {MODEL_INDEX}")
    saved: dict[str, list[int]] = {}
    headers = {}
    for name in files:
        try:
            headers[name] = read_header(folder / name)
        except ArtifactError as exc:
            return Verdict(False, f"{where}/{exc}")
        for k, t in headers[name].items():
            saved[k] = list(t["shape"])
    if not saved:
        return Verdict(False, f"{where}: the weights hold no tensors")
    if weight_map is not None:
        absent = sorted(k for k, f in weight_map.items() if k not in headers[f])
        if absent:
            return Verdict(
                False,
                f"{where}/{MODEL_INDEX} lists {len(absent)} tensor(s) its shards lack, "
                f"e.g. {absent[0]} in {weight_map[absent[0]]}",
            )
    empty = [k for k, s in saved.items() if 0 in s]
    if empty:
        return Verdict(False, f"{where}: {len(empty)} empty tensor(s), e.g. {empty[0]}")
    cross = "base model's weights not found on this machine: names not cross-checked"
    if base is not None:
        expected = {k: s for k, s in base.items() if not k.endswith(".inv_freq")}  # buffers of old checkpoints
        if config.get("tie_word_embeddings", False) or (config.get("text_config") or {}).get("tie_word_embeddings"):
            expected.pop("lm_head.weight", None)  # a tied head is saved once, as the embedding
        missing = sorted(k for k in expected if k not in saved)
        if missing:
            return Verdict(
                False, f"{where} lacks {len(missing)} of the base model's {len(expected)} weights, e.g. {missing[0]}"
            )
        wrong = sorted(k for k in expected if saved[k] != expected[k])
        if wrong:
            return Verdict(
                False,
                f"{where}: {len(wrong)} weight(s) have another shape than in the base model, e.g. "
                f"{wrong[0]} {saved[wrong[0]]} instead of {expected[wrong[0]]}",
            )
        cross = f"all {len(expected)} weights of the base model present with their shapes"
    for name in files:
        bad = non_finite(folder / name, headers[name])
        if bad:
            return Verdict(False, f"{where}/{name}: {len(bad)} tensor(s) hold inf/NaN, e.g. {bad[0]}")
    details = {
        "kind": MODEL,
        "path": str(folder),
        "tensors": len(saved),
        "files": len(files),
        "bytes": sum((folder / f).stat().st_size for f in files),
        "cross_check": cross,
    }
    return Verdict(True, f"{where}: {len(saved)} tensors in {len(files)} file(s), finite; {cross}", details)


def verify(final_root: Path, method: str, target_modules: Union[str, list[str]], base_model: str) -> Verdict:
    """The run's final result as its recipe expects it (adapter or model), checked from its files."""
    base = base_weights(base_model)
    folder = path(final_root, method)
    return verify_adapter(folder, target_modules, base) if kind(method) == ADAPTER else verify_model(folder, base)
