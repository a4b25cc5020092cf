"""Export a finished run: adapter, merged 16-bit model, GGUF, serving commands; every output reloaded and checked.

Run as `python -m launcher.deliver.export --run-dir DIR [--formats adapter,merged,gguf] [--gguf-type q8_0]` or through
`ftrun export`. Writes into the run's `final/`: `merged/`, `gguf/`, `SERVING.md` and `export.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from launcher.notices import quiet_known_notices

quiet_known_notices()  # this process imports transformers and peft: their deprecation notices are not the user's

from launcher.store.checkpoint import atomic_write_json  # noqa: E402
from launcher.errors import FtrunError  # noqa: E402
from launcher.store.rundir import RunDir  # noqa: E402
from launcher.deliver.export_inputs import GGUF_TYPES, Inputs, _model_config, check_inputs  # noqa: E402
from launcher.deliver.export_models import _export_models  # noqa: E402
from launcher.deliver.messages import ExportError, _say, served_line  # noqa: E402
from launcher.deliver.parity import PARITY_PROMPTS, parity_prompts  # noqa: E402
from launcher.deliver.placement import (  # noqa: E402
    Loads,
    available_ram,
    export_dtype,
    free_gpu_memory,
    merge_placement,
    parameter_count,
    parity_placement,
)


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
        if inp.vision:  # a model with a vision tower: its processor's files, the projector GGUF, image prompts
            report["vision"] = True
        _export(inp, report)
        report["ok"] = True
    except FtrunError as exc:
        report["error"] = exc.message
        raise
    except Exception as exc:  # a library failure mid-export: recorded, then shown as an export failure
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise ExportError(
            f"{type(exc).__name__}: {exc}",
            fix="see the lines above; `ftrun export RUN_DIR --debug` shows the traceback.",
        ) from exc
    finally:
        report["seconds"] = round(time.time() - report.pop("started"), 1)
        if run.exists():  # never create files in a folder that is not a run
            run.final.mkdir(exist_ok=True)
            atomic_write_json(report_path, report)
    return report


def _export(inp: Inputs, report: dict[str, Any]) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # no "Loading weights" bar per model between the export's lines (transformers 5.24 utils/logging.py)
    transformers_logging.disable_progress_bar()
    config = _model_config(inp.recipe.model, inp.source, inp.is_adapter)
    dtype = export_dtype(config)
    tokenizer = AutoTokenizer.from_pretrained(str(inp.source))
    if not tokenizer.chat_template:
        raise ExportError(
            f"{inp.source} has no chat template",
            fix="the base model's tokenizer needs one; "
            "a model served without its template answers in the wrong format.",
        )
    from launcher.deliver.served_prompt import ServedPrompt

    # What the training saw of the same held-out prompts: every servable output is held to it (served_prompt.py).
    served = ServedPrompt(inp.recipe, inp.source, PARITY_PROMPTS)
    report["served_prompt"] = served.report
    prompts = parity_prompts(inp.recipe, tokenizer, kwargs=served.kwargs)
    report["parity_prompts"] = [{"tokens": len(p["ids"]), "prompt_tokens": len(p["prompt_ids"])} for p in prompts]
    report["parity_prompts_from"] = prompts[0]["source"] if prompts else None
    # the dtype the merged folder is written in (an adapter keeps training's dtype)
    if "merged" in inp.formats:
        report["export_dtype"] = str(dtype).replace("torch.", "")

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
        _export_models(inp, report, tokenizer, prompts, dtype, parity, merge, loads, served)
    finally:
        report["placement"]["loads"] = loads.log
    _say(served_line(report))


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
