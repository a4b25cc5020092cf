"""Run under torchrun (gloo): the worker's QLoRA+FSDP loading path on CPU, sharded with fully_shard, against an unsharded copy.

The model comes from launcher.worker.loading exactly as the FSDP worker gets it (engine fsdp: loaded and quantized on
this rank's CPU, quant storage in the compute dtype), then each decoder layer and the root are sharded the way
accelerate's TRANSFORMER_BASED_WRAP does. Rank 0 writes a JSON report: whether the 4-bit weights became sharded
DTensors, what each rank holds, and the loss and LoRA gradients of the sharded model next to the unsharded copy.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path


def main(run_dir: str, dtype_name: str, out: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from launcher.worker.engines.fsdp import shard_worker_model
    from launcher.worker.loading import load_kwargs, load_model_and_tokenizer
    from launcher.recipe import load_recipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    recipe = load_recipe(Path(run_dir) / "recipe.yaml")
    torch.manual_seed(recipe.seed)
    kwargs = load_kwargs(recipe, "cpu", dtype, "fsdp")
    model, _ = load_model_and_tokenizer(recipe, "cpu", dtype, plan={"engine": "fsdp"})
    model.config.use_cache = False
    params4 = {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    loaded = {"params4bit": len(params4),
              "storage_dtypes": sorted({str(p.dtype) for p in params4.values()}),
              "devices": sorted({str(p.device) for p in params4.values()}),
              "quantized": all(p.bnb_quantized for p in params4.values()),
              "bytes_4bit": sum(p.numel() * p.element_size() for p in params4.values()),
              "values_4bit": sum(int(p.quant_state.shape.numel()) for p in params4.values())}
    reference = copy.deepcopy(model)
    shard_worker_model(model)

    names4 = set(params4)
    sharded4 = [n for n, p in model.named_parameters() if n in names4 and isinstance(p, DTensor)]
    local4 = sum(p.to_local().numel() * p.element_size() for n, p in model.named_parameters() if n in names4)

    gen = torch.Generator().manual_seed(recipe.seed)
    ids = torch.randint(0, int(model.get_base_model().config.vocab_size), (2, 24), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = reference(input_ids=ids, labels=ids).loss
    ref.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    diffs = []
    for n, g in grads.items():
        full = g.full_tensor() if isinstance(g, DTensor) else g
        diffs.append(float((full.float() - ref_grads[n].float()).abs().max()))
    result = {"world_size": world, "load_kwargs": {k: str(v) for k, v in kwargs.items()}, **loaded,
              "sharded_4bit": len(sharded4), "local_bytes_4bit": local4,
              "loss_sharded": loss.item(), "loss_unsharded": ref.item(),
              "lora_grads": len(grads), "max_grad_diff": max(diffs) if diffs else None,
              "max_ref_grad": max(float(g.abs().max()) for g in ref_grads.values())}
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
