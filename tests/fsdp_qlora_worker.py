"""Run under torchrun (gloo): the worker's QLoRA+FSDP loading path on CPU, sharded with fully_shard, against an
unsharded copy.

`path` once-per-box (the worker's path, launcher.worker.loading.load_model_and_tokenizer with engine fsdp): the first
rank of the box quantizes into <run_dir>/.quantized/ and every rank loads that folder, memory-mapped. `path` per-rank
(the path before issue 21 item 7, kept here to measure against): every rank loads and quantizes the recipe's model on
its own CPU with the same from_pretrained arguments. Then each decoder layer and the root are sharded the way
accelerate's TRANSFORMER_BASED_WRAP does.

Each rank samples its own anonymous and file-backed RSS (/proc/self/status RssAnon, RssFile) every few
milliseconds from just before the load until the model is sharded; rank 0 gathers the samples and writes a JSON
report: the peak per rank and the peak of the box's sum (samples aligned on the wall clock, each above the rank's
baseline before the load), whether the 4-bit weights became sharded DTensors, what each rank holds, and the loss
and LoRA gradients of the sharded model next to the unsharded copy.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

SAMPLE_SECONDS = 0.002


def rss_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


class Sampler:
    """(wall time, RssAnon MB, RssFile MB) of this process every SAMPLE_SECONDS, in a thread, until stopped."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            m = rss_mb()
            self.samples.append((time.time(), m["RssAnon"], m["RssFile"]))
            time.sleep(SAMPLE_SECONDS)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        m = rss_mb()
        self.samples.append((time.time(), m["RssAnon"], m["RssFile"]))
        return False


def box_peak(series: list[list[tuple[float, float, float]]], baselines: list[float]) -> float:
    """The largest sum of every rank's RssAnon above its baseline at one moment (each rank's latest sample)."""
    events = sorted((t, rank, anon - baselines[rank]) for rank, s in enumerate(series) for t, anon, _ in s)
    latest = [0.0] * len(series)
    peak = 0.0
    for _, rank, above in events:
        latest[rank] = above
        peak = max(peak, sum(latest))
    return peak


def main(run_dir: str, dtype_name: str, out: str, path: str = "once-per-box", check: str = "equal") -> int:
    began = time.monotonic()
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from launcher.recipe_loading import load_recipe
    from fsdp_exercise import shard_worker_model
    from launcher.worker.loading import add_lora, load_kwargs, load_model_and_tokenizer

    # what a load imports lazily (bitsandbytes, the model's module, PEFT) is runtime, not the model: import it first
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers.integrations.bitsandbytes  # noqa: F401
    from accelerate.utils import extract_model_from_parallel
    from transformers import AutoModelForCausalLM

    # save_pretrained (the quantizing rank's) unwraps the model through accelerate's extract_model_from_parallel,
    # which imports deepspeed where it is installed (accelerate 1.x utils/other.py: `from deepspeed import
    # DeepSpeedEngine`), and deepspeed imports mlflow, wandb and fastapi: about 90 MB of modules, measured
    # 2026-12-02. Runtime, paid once per process whatever the model's size: imported here, before the baseline.
    extract_model_from_parallel(torch.nn.Linear(1, 1))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    recipe = load_recipe(Path(run_dir) / "recipe.yaml")
    torch.manual_seed(recipe.seed)
    kwargs = load_kwargs(recipe, "cpu", dtype, "fsdp")
    dist.barrier()
    baseline = rss_mb()
    started = time.monotonic()
    phases = {"imports": round(started - began, 1)}
    with Sampler() as sampler:
        if path == "per-rank":
            model = AutoModelForCausalLM.from_pretrained(recipe.model, **kwargs)
            model = add_lora(model, recipe)
        else:
            model, _ = load_model_and_tokenizer(recipe, "cpu", dtype, plan={"engine": "fsdp"}, run_dir=run_dir)
        loaded_at = rss_mb()
        load_seconds = time.monotonic() - started
        model.config.use_cache = False
        # held until the model is sharded, as accelerate's fsdp2_prepare_model holds the state dict it takes first
        params4 = {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
        loaded = {
            "params4bit": len(params4),
            "storage_dtypes": sorted({str(p.dtype) for p in params4.values()}),
            "devices": sorted({str(p.device) for p in params4.values()}),
            "quantized": all(p.bnb_quantized for p in params4.values()),
            "bytes_4bit": sum(p.numel() * p.element_size() for p in params4.values()),
            "values_4bit": sum(int(p.quant_state.shape.numel()) for p in params4.values()),
            # the packed bytes and the LoRA initialisation, to compare across ranks and between the paths
            "sum_4bit": sum(int(p.data.view(torch.int16).sum(dtype=torch.int64)) for p in params4.values()),
            "sum_lora": sum(float(p.detach().double().sum()) for p in model.parameters() if p.requires_grad),
        }
        shard_worker_model(model)
        dist.barrier()
    phases["load_and_shard"] = round(time.monotonic() - started, 1)
    sharded_at = rss_mb()
    names4 = set(params4)
    sharded4 = [n for n, p in model.named_parameters() if n in names4 and isinstance(p, DTensor)]
    local4 = sum(p.to_local().numel() * p.element_size() for n, p in model.named_parameters() if n in names4)
    del params4
    result = {}
    if check == "equal":
        result = _compare_with_unsharded(model, recipe, kwargs)
    phases["reference_and_step"] = round(time.monotonic() - started - phases["load_and_shard"], 1)
    mine = {
        "rank": rank,
        "sums": [loaded["sum_4bit"], loaded["sum_lora"]],
        "baseline": baseline,
        "loaded": loaded_at,
        "sharded": sharded_at,
        "samples": sampler.samples,
        "load_seconds": load_seconds,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    series = [r["samples"] for r in everyone]
    anon0 = [r["baseline"]["RssAnon"] for r in everyone]
    file0 = [r["baseline"]["RssFile"] for r in everyone]
    result = {
        **result,
        "world_size": world,
        "path": path,
        "same_weights_on_every_rank": all(r["sums"] == everyone[0]["sums"] for r in everyone),
        "load_kwargs": {k: str(v) for k, v in kwargs.items()},
        **loaded,
        "quantized_dir": str(Path(run_dir) / ".quantized") if (Path(run_dir) / ".quantized").is_dir() else None,
        "sharded_4bit": len(sharded4),
        "local_bytes_4bit": local4,
        "rss_mb": {
            "box_peak_anon": box_peak(series, anon0),
            "rank_peak_anon": [max(a for _, a, _ in s) - anon0[i] for i, s in enumerate(series)],
            "rank_peak_file": [max(f for _, _, f in s) - file0[i] for i, s in enumerate(series)],
            "rank_loaded_anon": [r["loaded"]["RssAnon"] - anon0[i] for i, r in enumerate(everyone)],
            "rank_loaded_file": [r["loaded"]["RssFile"] - file0[i] for i, r in enumerate(everyone)],
            "rank_sharded_anon": [r["sharded"]["RssAnon"] - anon0[i] for i, r in enumerate(everyone)],
            "samples": [len(s) for s in series],
        },
        "load_seconds": [round(r["load_seconds"], 2) for r in everyone],
        "phases_rank0": phases,
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _compare_with_unsharded(model, recipe, kwargs) -> dict:
    """Loss and LoRA gradients of the sharded model and of the unsharded reference on the same batch."""
    import torch
    from torch.distributed.tensor import DTensor

    reference = _unsharded_reference(model, recipe, kwargs)
    gen = torch.Generator().manual_seed(recipe.seed)
    ids = torch.randint(0, int(model.get_base_model().config.vocab_size), (2, 16), generator=gen)
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
    return {
        "loss_sharded": loss.item(),
        "loss_unsharded": ref.item(),
        "lora_grads": len(grads),
        "max_grad_diff": max(diffs) if diffs else None,
        "max_ref_grad": max(float(g.abs().max()) for g in ref_grads.values()),
    }


def _unsharded_reference(model, recipe, kwargs):
    """The same model unsharded, in this process, by the independent road: the recipe's model quantized here
    (what every rank did before: no saved copy involved) and given the sharded model's LoRA weights (gathered).
    Its loss and gradients equal the sharded model's only if the saved-and-mapped 4-bit copy is exact and the
    sharding is."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from launcher.worker.loading import add_lora

    with torch.random.fork_rng(devices=[]):
        ref = add_lora(AutoModelForCausalLM.from_pretrained(recipe.model, **kwargs), recipe)
    ref.config.use_cache = False
    sharded = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.requires_grad:
                s = sharded[name]
                p.copy_(s.full_tensor() if isinstance(s, DTensor) else s)
    return ref


if __name__ == "__main__":
    from launcher.worker.process import leave_rank

    leave_rank(main(*sys.argv[1:6]))  # as the worker's ranks leave: no interpreter teardown after the group
