"""The FSDP exercise, under torchrun on CPU processes (gloo): the worker's own model sharded with plain `fully_shard`
(accelerate turns an FSDP config into DDP on a CPU, so the Trainer cannot show sharding here), trained against an
unsharded copy on every rank's batch, and the worker's final save (launcher/worker/engines/fsdp.py save_full)
checked against the unsharded model's save_pretrained. Run by tests/worker/test_engines.py and
test_vision_engines.py: `python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_exercise.py
--run-dir RUN ...`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from launcher.worker.engines import fsdp


def shard_worker_model(model) -> list:
    """fully_shard each decoder layer, then the root: the layout accelerate's TRANSFORMER_BASED_WRAP makes."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(fsdp._base(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return layers


def exercise(run_dir: Path, steps: int, out: Optional[Path], final_dir: Optional[Path] = None) -> int:
    """Under torchrun: shard the worker's model with fully_shard over gloo, train `steps` steps against an unsharded
    copy on every rank's batch (and with `final_dir`, check the final save); rank 0 writes JSON; 0 when equal."""
    import copy
    import os

    import torch
    import torch.distributed as dist

    from launcher.recipe_loading import load_recipe
    from launcher.worker.loading import load_model_and_tokenizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = load_recipe(Path(run_dir) / "recipe.yaml")
    torch.manual_seed(recipe.seed)
    model, tokenizer = load_model_and_tokenizer(recipe, "cpu", torch.float32)
    if hasattr(model, "config"):
        model.config.use_cache = False
    reference = copy.deepcopy(model)  # the same initial weights (LoRA included), never sharded
    layers = shard_worker_model(model)
    report = fsdp.sharding_report(model)

    per_rank = 2
    slices = _fixed_batches(recipe, tokenizer, model, per_rank, world)

    def opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=recipe.learning_rate, foreach=False)

    o_shard, o_ref = opt(model), opt(reference)
    sharded_losses, ref_losses = [], []
    for _ in range(steps):  # one batch, repeated: the loss must fall
        loss = model(**slices[rank]).loss
        loss.backward()
        o_shard.step()
        o_shard.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        sharded_losses.append(t.item() / world)
        # the mean of the ranks' mean losses: the gradient FSDP's reduce-scatter averages
        ref = sum(reference(**s).loss for s in slices) / world
        ref.backward()
        o_ref.step()
        o_ref.zero_grad()
        ref_losses.append(ref.item())
    diff = max(abs(a - b) for a, b in zip(sharded_losses, ref_losses))
    ok = (
        report["sharded"] == report["parameters"]
        and report["local_values"] < report["global_values"]
        and diff < 1e-4
        and sharded_losses[-1] < sharded_losses[0]
    )
    result = {
        "ok": ok,
        "world_size": world,
        "wrapped_layers": len(layers),
        "wrapped_classes": sorted({type(m).__name__.removeprefix("FSDP") for m in layers}),
        "images": int(sum(len(s.get("image_grid_thw", ())) for s in slices)),
        **report,
        "losses_sharded": sharded_losses,
        "losses_unsharded": ref_losses,
        "max_loss_diff": diff,
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if final_dir is not None:
        saved = _final_save_check(model, reference, recipe, Path(final_dir), rank)
        # the worker's _save_final takes the gathering save exactly when this says the model is sharded
        saved["dispatch"] = dispatch = fsdp.is_sharded(model) and not fsdp.is_sharded(reference)
        result["final_save"] = saved
        result["ok"] = ok = ok and dispatch and (saved["ok"] if rank == 0 else saved["gathered"] == 0)
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # rank 0 writes the result: it must know the others' verdict
        result["ok"] = ok = bool(flag.item())
    if rank == 0:
        text = json.dumps(result, indent=2)
        print(text, flush=True)
        if out:
            Path(out).write_text(text)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _fixed_batches(recipe, tokenizer, model, per_rank: int, world: int) -> list[dict]:
    """Each rank's fixed micro-batch: a VLM's first examples with their images (TRL's collator), else random tokens."""
    import torch

    from launcher.worker.loading import reads_images

    if reads_images(recipe.model):
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

        from launcher.data.dataset import load_data

        examples = load_data(recipe.data, recipe.seed).examples[: per_rank * world]
        collate = DataCollatorForVisionLanguageModeling(tokenizer, max_length=recipe.max_length)
        return [collate(examples[r * per_rank : (r + 1) * per_rank]) for r in range(world)]
    gen = torch.Generator().manual_seed(recipe.seed)
    ids = torch.randint(0, int(fsdp._base(model).config.vocab_size), (per_rank * world, 32), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids.split(per_rank)]


def _final_save_check(model, reference, recipe, final_dir: Path, rank: int) -> dict[str, Any]:
    """The worker's FSDP final save against the unsharded copy's save_pretrained, checked on rank 0."""
    import torch

    from launcher.store import final
    from launcher.worker import saving

    kind = final.kind(recipe.method)
    sharded_dir, reference_dir = final_dir / "sharded", final_dir / "reference"
    dtype = saving.final_dtype(recipe)[0]
    gathered = fsdp.save_full(model, sharded_dir, write=rank == 0, dtype=dtype)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    # the same values by another road: each sharded parameter's own all-gather (DTensor.full_tensor, collective)
    from torch.distributed.tensor import DTensor

    own = {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for k, p in model.named_parameters()
        if kind == final.MODEL or p.requires_grad
    }
    if rank != 0:
        return {"gathered": len(gathered)}
    reference.save_pretrained(str(reference_dir))
    from safetensors.torch import load_file

    name = final.ADAPTER_WEIGHTS if kind == final.ADAPTER else final.MODEL_WEIGHTS
    a, b = load_file(str(sharded_dir / name)), load_file(str(reference_dir / name))
    same_keys = sorted(a) == sorted(b) and len(a) > 0
    same_shapes = same_keys and all(a[k].shape == b[k].shape for k in a)
    # the two trainings differ by float rounding: cast to the saved dtype, a value may differ by one step of it
    saved = next(iter(a.values())).dtype if a else torch.float32
    step = torch.finfo(saved).eps if saved != torch.float32 else 0.0
    worst, within, unequal, count = float("inf"), False, 0, 0
    if same_shapes:
        diffs = {k: (a[k].float() - b[k].to(saved).float()).abs() for k in a}
        worst = max(d.max().item() for d in diffs.values())
        within = all(bool((d <= 1e-4 + step * b[k].float().abs()).all()) for k, d in diffs.items())
        unequal = sum(int((d > 0).sum()) for d in diffs.values())
        count = sum(d.numel() for d in diffs.values())

    from launcher.worker.loading import model_class

    if kind == final.ADAPTER:
        from peft import PeftModel

        base = model_class(recipe.model).from_pretrained(recipe.model, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, str(sharded_dir))
        mine = {k: v for k, v in loaded.named_parameters() if "lora_" in k}
    else:
        loaded = model_class(recipe.model).from_pretrained(str(sharded_dir), dtype=torch.float32)
        mine = dict(loaded.named_parameters())
    # what reloads is exactly what the sharded model holds, cast to the saved dtype
    reload_diff = (
        max(((mine[k] - own[k].to(saved).float()).abs().max().item() for k in own if k in mine), default=float("inf"))
        if set(mine) == set(own)
        else float("inf")
    )
    # trained values, not the initial ones: LoRA B starts at zero, full weights at the base's
    moved = kind != final.ADAPTER or any(
        not torch.equal(v, torch.zeros_like(v)) for k, v in mine.items() if "lora_B" in k
    )
    verdict = (
        final.verify_adapter(sharded_dir, recipe.lora.target_modules, final.base_weights(recipe.model))
        if kind == final.ADAPTER
        else final.verify_model(sharded_dir, final.base_weights(recipe.model))
    )
    config = json.loads((sharded_dir / "config.json").read_text()) if kind == final.MODEL else {}
    architectures = config.get("architectures") if kind == final.MODEL else None
    # a whole model in the base's dtype, and config.json saying so (the export reads it)
    expected = str(dtype).replace("torch.", "") if dtype is not None else None
    tensor_dtypes = sorted(str(t.dtype).replace("torch.", "") for t in {id(v): v for v in a.values()}.values())
    dtype_ok = kind == final.ADAPTER or (set(tensor_dtypes) == {expected} and config.get("dtype") == expected)
    # a PEFT model gathers its trainable tensors (the adapter), not the frozen base
    extra = sorted(set(gathered) - trainable)
    gathered_ok = trainable <= set(gathered) if kind == final.ADAPTER else len(gathered) >= len(a)
    ok = (
        same_shapes
        and within
        and reload_diff == 0.0
        and moved
        and verdict.ok
        and gathered_ok
        and dtype_ok
        and (architectures is None or not architectures[0].startswith("FSDP"))
    )
    return {
        "ok": ok,
        "kind": kind,
        "gathered": len(gathered),
        "trainable_tensors": len(trainable),
        "gathered_frozen": extra if kind == final.ADAPTER else None,
        "tensors": len(a),
        "same_keys": same_keys,
        "same_shapes": same_shapes,
        "max_abs_diff": worst,
        "within_rounding": within,
        "values_unequal": unequal,
        "values": count,
        "reload_max_abs_diff": reload_diff,
        "trained_values": moved,
        "verified": verdict.reason,
        "verified_ok": verdict.ok,
        "architectures": architectures,
        "expected_dtype": expected,
        "tensor_dtypes": sorted(set(tensor_dtypes)),
        "config_dtype": config.get("dtype"),
        "dtype_ok": dtype_ok,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tests/fsdp_exercise.py",
        description="Shard the worker's model with fully_shard and check it trains "
        "like the unsharded model (run under torchrun).",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="a run directory (its recipe.yaml is used)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--final-dir", type=Path, help="also check the final save of the sharded model here")
    ns = parser.parse_args(argv)
    return exercise(ns.run_dir, ns.steps, ns.out, ns.final_dir)


if __name__ == "__main__":
    from launcher.worker.process import leave_rank

    leave_rank(main())  # always a torchrun rank; its process group destroyed in exercise()
