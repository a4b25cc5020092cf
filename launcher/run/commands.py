"""Builds the commands a user is shown to type: the exact resume command (stored at launch), the serving one."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Optional

from launcher.store.rundir import RunDir


def serve_command(run: RunDir, final: Optional[str]) -> Optional[str]:
    """The one command that serves the result (vLLM's OpenAI-compatible server); SERVING.md has the rest."""
    if not final:
        return None
    from launcher.recipe_loading import load_recipe
    from launcher.deliver.serving import served_name, template_switches, vllm_command

    try:
        recipe = load_recipe(run.recipe)
    except Exception:  # a recipe that no longer loads (a package upgrade): the summary still shows the rest
        return None
    name = served_name(run.root)
    switches = {}
    report = run.final / "export.json"
    if report.is_file():  # the chat-template switches the export found the trained prompt under
        try:
            switches = template_switches(json.loads(report.read_text()))
        except (OSError, ValueError):
            switches = {}
    if Path(final).name == "adapter":
        return vllm_command(
            recipe.model,
            lora_module=name + "=" + final,
            lora_rank=recipe.lora.r,
            max_model_len=recipe.max_length,
            switches=switches,
        )
    return vllm_command(final, name=name, max_model_len=recipe.max_length, switches=switches)


def resume_command(
    recipe_path: str, overrides: list[str], memory_limit: Optional[float] = None, nodes: Optional[dict[str, Any]] = None
) -> str:
    """The exact command that resumes a run (stored in state.json at launch): the launch's recipe, overrides, memory
    cap and node settings; not --fresh or --foreground, which are about that one launch."""
    words = [recipe_path, *overrides]
    if memory_limit:
        words += ["--memory-limit", f"{memory_limit:g}GB"]
    for key in ("nnodes", "node_rank", "master_addr", "master_port") if nodes else ():
        words += [f"--{key.replace('_', '-')}", str(nodes[key])]
    return " ".join(["ftrun", *(shlex.quote(x) for x in words)])
