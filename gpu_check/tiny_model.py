"""The tiny-model step: the random-weight model with its own tokenizer that the loading checks load (no download)."""

from __future__ import annotations

from typing import Any

from gpu_check.common import REPO, Context


def step_tiny_model(ctx: Context) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = ctx.work / "tiny-model"
    module.build_tiny_model(target)
    ok = (target / "config.json").is_file()
    return {"ok": ok, "path": str(target), "line": f"tiny model built at {target}"}
