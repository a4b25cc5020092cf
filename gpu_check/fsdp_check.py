"""The fsdp step: FSDP2 via the worker's accelerate config, one step, the final save reloaded (fsdp_child: a rank)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from launcher.engine_kinds import ENGINES
from gpu_check.common import Context, child_env, read_json, worker_recipe, write_json


def fsdp_child(model: Path, out_dir: Path, work: Path, device_name: str) -> int:
    """Under `accelerate launch --config_file <generated FSDP2 config>`: the worker's model and an optimizer
    prepared together, one training step, then the worker's final save (engines/fsdp.save_full) and the
    adapter reloaded onto a fresh base with the trained values.

    accelerate 1.15 `Accelerator.prepare` refuses a model without its optimizer under FSDP2 ("a model and
    optimizer must be passed together"): `_prepare_fsdp2` swaps the optimizer's parameters for the DTensors
    fully_shard creates. On CPU accelerate silently makes the config DDP/plain (STACK-FACTS), the expected
    CPU outcome; the step and the save still run.
    """
    import torch
    from accelerate import Accelerator
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from launcher.worker.loading import is_main_process, load_kwargs, load_model_and_tokenizer, select_device
    from launcher.worker.engines import die_with_parent
    from launcher.worker.engines import fsdp

    die_with_parent()  # accelerate launch's ranks run in their own sessions: a timed-out step takes them along

    device, dtype = select_device() if device_name == "cuda" else ("cpu", torch.float32)
    acc = Accelerator(cpu=device == "cpu")
    recipe = worker_recipe(model)
    torch.manual_seed(0)
    m, _ = load_model_and_tokenizer(recipe, device, dtype, plan={"engine": "fsdp"})
    m.config.use_cache = False
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    wrapped, opt = acc.prepare(m, opt)
    params = list(wrapped.parameters())
    dtensors = sum(isinstance(p, DTensor) for p in params)
    model_params = {id(p) for p in params}
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    optimizer_follows = all(id(p) in model_params for p in opt_params) and len(opt_params) > 0
    is_fsdp = isinstance(wrapped, FSDPModule)
    vocab = fsdp._base(m).config.vocab_size
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0)).to(acc.device)
    loss = wrapped(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    result: dict[str, Any] = {
        "device": device,
        "distributed_type": str(acc.distributed_type),
        "wrapper": type(wrapped).__name__,
        "fsdp2_module": is_fsdp,
        "dtensor_parameters": dtensors,
        "parameters": len(params),
        "optimizer_holds_model_parameters": optimizer_follows,
        "world_size": acc.num_processes,
        "loss": loss.item(),
        "load_kwargs": {k: str(v) for k, v in load_kwargs(recipe, device, dtype, "fsdp").items()},
        **{f"report_{k}": v for k, v in fsdp.sharding_report(wrapped).items()},
    }
    final_dir = work / "fsdp-final"
    save_full = getattr(fsdp, "save_full", None)
    if save_full is None:
        result["final_save"] = {"ok": False, "error": "launcher/worker/engines/fsdp.py has no save_full yet"}
    else:
        # FSDP2 shards in place (unwrap_model returns the model itself); on CPU it unwraps accelerate's DDP
        target = acc.unwrap_model(wrapped)
        trained = _trained_lora(target)  # every rank: gathering a DTensor is a collective
        gathered = save_full(target, final_dir, write=is_main_process())
        result["final_save"] = {
            "gathered_tensors": len(gathered) if isinstance(gathered, (list, tuple)) else gathered,
            "sharded": fsdp.is_sharded(target) if hasattr(fsdp, "is_sharded") else None,
        }
        if is_main_process():
            result["final_save"].update(_reload_adapter(recipe, trained, final_dir))
    acc.wait_for_everyone()
    if is_main_process():
        on_gpu = is_fsdp and dtensors == len(params)
        result["expected"] = (
            "FSDP2 module with DTensor parameters"
            if device == "cuda"
            else "not FSDP: accelerate on CPU falls back silently (the worker refuses this)"
        )
        result["ok"] = (
            (on_gpu if device == "cuda" else not is_fsdp)
            and optimizer_follows
            and result["final_save"].get("ok") is True
        )
        write_json(out_dir / "fsdp-child.json", result)
    acc.end_training()
    return 0


def _trained_lora(model) -> dict[str, Any]:
    """The LoRA tensors as trained, whole (a DTensor gathered: every rank must call this)."""
    from torch.distributed.tensor import DTensor

    trained = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            trained[name] = full.detach().float().cpu()
    return trained


def _reload_adapter(recipe, trained: dict[str, Any], final_dir: Path) -> dict[str, Any]:
    """The saved adapter onto a fresh base: its LoRA tensors equal the trained ones, and the supervisor's
    verification (launcher/store/final.py, where present) accepts the folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(recipe.model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(final_dir))
    mine = {n: p.detach().float() for n, p in loaded.named_parameters() if "lora_" in n}

    def key(n: str) -> str:  # wrappers' prefixes (FSDP, checkpointing) differ; the module path after them does not
        return n.split("base_model.model.", 1)[-1].replace("_checkpoint_wrapped_module.", "").replace(".default", "")

    a, b = {key(n): v for n, v in trained.items()}, {key(n): v for n, v in mine.items()}
    same = sorted(a) == sorted(b) and len(a) > 0
    diff = max(((a[k] - b[k]).abs().max().item() for k in a), default=float("inf")) if same else float("inf")
    moved = any(v.abs().sum().item() > 0 for k, v in b.items() if "lora_B" in k)
    out = {
        "adapter_files": sorted(p.name for p in final_dir.iterdir()),
        "tensors_saved": len(b),
        "tensors_trained": len(a),
        "same_names": same,
        "reload_max_abs_diff": diff,
        "trained_values": moved,
    }
    verified = None
    try:
        from launcher.store import final
    except ImportError:
        out["verified"] = "launcher/store/final.py not present"
    else:
        verdict = final.verify_adapter(final_dir, recipe.lora.target_modules, final.base_weights(recipe.model))
        verified = verdict.ok
        out["verified"] = verdict.reason
    out["ok"] = same and diff <= 1e-6 and moved and verified is not False
    return out


def step_fsdp(ctx: Context) -> dict[str, Any]:
    """FSDP2 through the worker's generated accelerate config (one process: a mesh of 1), model and optimizer
    prepared together, one step, the final full-state-dict save, the adapter reloaded."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("peft") is None:
        return {
            "ok": None,
            "skipped": "accelerate or peft not installed",
            "line": "skipped: accelerate or peft missing",
        }
    import yaml

    from launcher.worker.engines.fsdp import accelerate_config

    cfg = accelerate_config({"num_processes": 1, "device": ctx.device}, activation_checkpointing=True)
    config_path = ctx.out / ENGINES["fsdp"].config_file
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    child_out = ctx.out / "fsdp-child.json"
    child_out.unlink(missing_ok=True)
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config_path),
            "--main_process_port",
            "29534",
            "-m",
            "gpu_check",
            "fsdp-child",
            "--model",
            str(ctx.work / "tiny-model"),
            "--out",
            str(ctx.out),
            "--work",
            str(ctx.work),
            "--device",
            ctx.device,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    (ctx.out / "fsdp-child.log").write_text(proc.stdout + proc.stderr)
    got = read_json(child_out)
    if got is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        return {
            "ok": False,
            "exit": proc.returncode,
            "error": tail[0][:300],
            "line": f"accelerate launch exit {proc.returncode}: {tail[0][:160]}",
        }
    save = got.get("final_save", {})
    line = (
        f"{got['wrapper']} ({got['distributed_type']}), {got['dtensor_parameters']}/{got['parameters']} DTensor "
        f"params, optimizer follows: {got['optimizer_holds_model_parameters']}, loss {got['loss']:.3f}; final "
        f"save: {save.get('tensors_saved', '?')} adapter tensors, reload diff {save.get('reload_max_abs_diff', '?')}"
        f", {save.get('verified') or save.get('error', '')}"
    )
    return {**got, "exit": proc.returncode, "line": line}
