"""The software an engine needs: whether this machine has Unsloth or DeepSpeed, what a rented box runs, the fix."""

from __future__ import annotations

import importlib.util

from launcher.methods import OBJECTIVES
from launcher.plan.hardware import Hardware


# What a box named for planning (--gpus, the recipe's box:) runs: ftrun's Docker image, docker/requirements.txt.
IMAGE_SOFTWARE = (
    "ftrun's Docker image (docker/requirements.txt: DeepSpeed, bitsandbytes, llama.cpp; "
    "docker/requirements-unsloth.txt: Unsloth)"
)


# Called through this module (engine_software._deepspeed_installed), never imported by name: tests stand in for it here.
def _deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _unsloth_installed() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def software(hardware: Hardware, unsloth_available: bool | None) -> tuple[bool, str]:
    """Whether Unsloth can be used, and the plan's line about the software it assumes."""
    if unsloth_available is not None:
        return unsloth_available, f"software: Unsloth {'available' if unsloth_available else 'not available'} (given)"
    if not hardware.is_cpu_only and not hardware.is_this_machine:
        return True, f"software: planned with {IMAGE_SOFTWARE}, what a rented box runs; not this machine's installation"
    here = _unsloth_installed()
    return here, f"software: as installed on this machine (Unsloth {'installed' if here else 'not installed'})"


# Unsloth pins older transformers/trl/datasets than ftrun's default stack: its own environment (docs/engines.md).
UNSLOTH_FIX = (
    "Unsloth pins transformers<=5.17, trl<=1.15 and datasets<5.0, so it lives in its own virtual environment: "
    "python3 -m venv .venv-unsloth && .venv-unsloth/bin/pip install 'ftrun[train,unsloth]' (scripts/test.sh "
    "--unsloth builds it here), then run ftrun from that environment; ftrun's Docker image has it as a second "
    "environment (docker run --entrypoint ftrun-unsloth ...)"
)
UNSLOTH_MISSING = (
    "engine: unsloth needs Unsloth, which is not installed in this environment. " + UNSLOTH_FIX + "; or set engine: trl"
)


# ftrun's Unsloth engine loads, checkpoints and resumes through its SFT path only (launcher/worker/engines/unsloth.py)
UNSLOTH_NOT_FOR = (
    "engine unsloth: ftrun runs Unsloth for objective "
    + " and ".join(name for name, o in OBJECTIVES.items() if o.unsloth)
    + " only, and this recipe's objective is {}: its trainer (TRL's) is not the one ftrun's Unsloth "
    "engine loads, checkpoints and resumes"
)
