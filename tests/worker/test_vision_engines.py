"""The tiny vision-language model on the multi-process engines, as text runs them on CPU (tests/worker/test_engines.py):
DDP over 2 gloo processes through `ftrun` (the trajectory of one process with twice the accumulation, kill -9 and
resume, a tower that a micro-batch without images skips), FSDP2 with `fully_shard` over gloo on the worker's own model
(the decoder layers and the vision blocks wrapped, image batches from TRL's vision collator), and the plan's refusal
of FSDP on image data with image-less examples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import (
    REPO,
    ftrun,
    has_checkpoint,
    is_training,
    metrics,
    polled_status,
    prepared_run,
    read_state,
    run_in_slices,
    wait_for,
    wait_until_ended,
)
from tests.conftest import recipe_file

from launcher.errors import RecipeError

VISION = REPO / "recipes" / "data" / "tiny-vision"
TRAIN = dict(
    data=str(VISION.with_suffix(".jsonl")),
    max_length=64,
    micro_batch_size=4,
    max_steps=8,
    learning_rate=1e-2,
    lora={"r": 8, "alpha": 16},
    checkpoint_every_minutes=10,  # one save, at the end
    assistant_only_loss=None,
)
QUICK = ("smoke.enabled=false",)
DDP = ("engine=ddp", "num_processes=2")
WALL_CLOCK = ("time", "tokens_per_second", "peak_memory_gb", "train_runtime", "eval_seconds")


def _mixed_data(path: Path, images: int, text_only: int) -> Path:
    """The first `images` examples of the vision data, then `text_only` conversations without an image."""
    rows = (VISION.with_suffix(".jsonl")).read_text().splitlines()[:images]
    rows = [r.replace('"tiny-vision/', f'"{VISION}/') for r in rows]
    chat = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi."}]}
    path.write_text("\n".join(rows + [json.dumps(chat)] * text_only) + "\n")
    return path


def _stats(recipe):
    from launcher.data.stats import data_stats

    return data_stats(recipe)[2]


# --- the plan: FSDP on image data with image-less examples refused ----------------------------------------------


def test_fsdp_on_image_data_with_examples_without_images_is_refused_at_plan_time(tmp_path, tiny_vlm):
    from launcher.plan.hardware import from_spec
    from launcher.plan.plan import make_plan
    from launcher.recipe_loading import load_recipe

    box = from_spec("2xH100-80GB")
    mixed = _mixed_data(tmp_path / "mixed.jsonl", images=8, text_only=3)

    def plan(data, engine):
        fields = {**TRAIN, "data": data, "engine": engine}
        recipe = load_recipe(recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", **fields))
        return make_plan(recipe, box, _stats(recipe), unsloth_available=False)

    with pytest.raises(RecipeError) as err:
        plan(str(mixed), "fsdp")
    text = err.value.render()
    assert (
        "engine: fsdp in the recipe" in text and "3 example(s) hold no image (the first at mixed.jsonl line 9)" in text
    )
    assert "collectives no longer match" in text and "engine: ddp" in err.value.fix
    assert len(text.splitlines()) == 2  # the paragraph and its fix
    # the same data on DDP plans (its unused-parameter search covers the skipped tower), as FSDP does on images only
    assert plan(str(mixed), "ddp").engine == "ddp"
    assert plan(TRAIN["data"], "fsdp").engine == "fsdp"


@pytest.mark.parametrize(
    "fields, searched",
    [
        ({}, False),  # LoRA on the language model: every trainable parameter in every forward
        ({"lora": {"vision_tower": True}}, True),
        ({"method": "full"}, True),
    ],
)
def test_ddp_searches_unused_parameters_where_a_vision_tower_trains(tmp_path, tiny_vlm, tiny_model, fields, searched):
    from launcher.worker.engines import trainer_fields

    for model, want in ((tiny_vlm, searched), (tiny_model, False)):
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model": str(model), "method": "lora", **fields}))
        assert trainer_fields({"engine": "ddp", "num_processes": 2}, tmp_path) == {"ddp_find_unused_parameters": want}


# --- DDP through ftrun ---------------------------------------------------------------------------------------------


def _run(tmp_path: Path, tiny_vlm: Path, name: str, *overrides: str, **fields) -> Path:
    recipe = recipe_file(tmp_path / f"{name}.yaml", tiny_vlm, tmp_path / name, **{**TRAIN, **fields})
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp_path / name


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow  # three runs, one of them on 2 gloo processes
def test_ddp_two_processes_train_the_vision_model_as_one_process_with_twice_the_accumulation(tmp_path, tiny_vlm):
    """DDP 2 x micro-batch 4 == 1 process x micro-batch 4 x accumulation 2, image batches rendered per rank by each
    rank's own processor and collator; the adapter and the processor files from rank 0 load."""
    import torch

    one = _run(tmp_path, tiny_vlm, "one", "gradient_accumulation_steps=2")
    ddp = _run(tmp_path, tiny_vlm, "ddp", *DDP)
    v = read_state(ddp)["verification"]
    assert v["ok"] and v["world_size"] == 2 and v["engine"] == "ddp"
    a, b = metrics(one), metrics(ddp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert max(diffs) < 1e-4, diffs
    assert b[-1]["loss"] < b[0]["loss"] - 1.0  # it trained
    # the comparison can fail: one process with accumulation 1 sees half the images per step and drifts away
    half = _run(tmp_path, tiny_vlm, "half")
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(metrics(half)[1:], b[1:])) > 1e-3
    ta, tb = _adapter(one), _adapter(ddp)
    assert max((ta[k] - tb[k]).abs().max().item() for k in ta) < 1e-4
    adapter = ddp / "final" / "adapter"
    for name in ("adapter_model.safetensors", "preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (adapter / name).is_file(), name
    train_log = (ddp / "train.log").read_text()
    assert train_log.count("built without its video processor") <= 1  # said by rank 0, not by each rank

    from peft import PeftModel

    from launcher.worker.loading import model_class
    from launcher.worker.processor import load_processor

    base = model_class(str(tiny_vlm)).from_pretrained(str(tiny_vlm), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(adapter))
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(lora) == len(tb) and any(
        not torch.equal(v, torch.zeros_like(v)) for k, v in lora.items() if "lora_B" in k
    )
    assert type(load_processor(adapter, say=lambda _: None)).__name__ == "Qwen2_5_VLProcessor"


@pytest.mark.slow
def test_ddp_vision_kill9_then_resume_gives_the_same_losses_and_adapter(tmp_path, tiny_vlm):
    fields = dict(max_steps=16, checkpoint_every_minutes=0.01)
    ref = _run(tmp_path, tiny_vlm, "ref", *DDP, **fields)
    recipe = recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", max_restarts=0, **{**TRAIN, **fields})
    assert ftrun(recipe, *DDP, *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    # machine loss after a checkpoint: SIGKILL the supervisor's process group (torchrun and both ranks), run in slices
    # so that a wall-clock checkpoint comes before the last step on a fast box too
    wait_for(lambda: read_state(run).get("supervisor_pid") and is_training(run), 240, "training to start", 0.05)
    pgid = os.getpgid(read_state(run)["supervisor_pid"])
    run_in_slices((pgid,), lambda: has_checkpoint(run), "a checkpoint", 240, group=True)
    assert not (run / "final").exists(), "the run finished before it could be interrupted"
    os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, *DDP, *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path, timeout=400)
    assert "resuming from step-" in (run / "train.log").read_text()
    strip = lambda rows: [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]  # noqa: E731
    assert strip(metrics(run)) == strip(metrics(ref))
    a, b = _adapter(ref), _adapter(run)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow
def test_ddp_trains_a_vision_tower_that_a_micro_batch_without_images_skips(tmp_path, tiny_vlm):
    """LoRA on the tower, one example per micro-batch, a third of them text-only: a rank's micro-batch without images
    leaves the tower's adapter without gradients, which DDP without its unused-parameter search waited for forever."""
    data = _mixed_data(tmp_path / "mixed.jsonl", images=12, text_only=6)
    run = _run(
        tmp_path,
        tiny_vlm,
        "mixed",
        *DDP,
        data=str(data),
        micro_batch_size=1,
        max_steps=6,
        lora={"r": 8, "alpha": 16, "vision_tower": True},
    )
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    assert any(".visual." in k for k in _adapter(run))


# --- FSDP2: fully_shard over gloo on the worker's own vision model -------------------------------------------------


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("method, tower", [("lora", False), ("lora", True), ("qlora", True)])
def test_fully_shard_wraps_the_vision_blocks_and_trains_on_images_like_unsharded(tmp_path, tiny_vlm, method, tower):
    """LoRA on the language model (the tower frozen in its own units), on the tower too, and QLoRA, whose 4-bit
    tower (bitsandbytes quantizes its linear layers as well) shards like the decoder layers."""
    lora = {"r": 8, "alpha": 16, "vision_tower": tower}
    recipe = recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", **{**TRAIN, "method": method, "lora": lora})
    run = prepared_run(recipe, *DDP)
    out, final_dir = tmp_path / "fsdp.json", tmp_path / "final"
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(REPO / "tests" / "fsdp_exercise.py"), "--run-dir", str(run), "--steps", "4", "--out", str(out)]
        + ["--final-dir", str(final_dir)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    # the model's _no_split_modules: its 2 decoder layers and its 2 vision blocks, each its own FSDP unit
    assert r["ok"] and r["wrapped_layers"] == 4
    assert r["wrapped_classes"] == ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]
    assert r["images"] == 4  # 2 per rank, through the vision tower
    assert r["sharded"] == r["parameters"] > 0 and r["local_values"] < r["global_values"]
    assert r["max_loss_diff"] < 1e-4 and r["losses_sharded"][-1] < r["losses_sharded"][0] - 1.0
    f = r["final_save"]
    assert f["ok"] and f["verified_ok"] and f["trained_values"] and f["gathered_frozen"] == [], f
    from safetensors.torch import load_file

    saved = load_file(str(final_dir / "sharded" / "adapter_model.safetensors"))
    assert any(".visual." in k for k in saved) == tower


def test_accelerates_fsdp2_wrap_from_the_generated_config_takes_the_vision_blocks_as_the_exercise_does(tiny_vlm):
    """On GPUs accelerate wraps (fsdp2_prepare_auto_wrap_policy over the PEFT model's _no_split_modules); on CPU the
    exercise does (shard_worker_model): the same units, the vision blocks among them."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from launcher.worker.engines.fsdp import accelerate_config

    fsdp = accelerate_config({"num_processes": 2, "device": "cuda"}, True)["fsdp_config"]
    model = get_peft_model(
        AutoModelForImageTextToText.from_pretrained(str(tiny_vlm)), LoraConfig(target_modules=["q_proj"])
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp["fsdp_version"], auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower()
    )
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = [type(m).__name__ for m in model.modules() if policy(m)]
    assert sorted(units) == ["Qwen2_5_VLDecoderLayer"] * 2 + ["Qwen2_5_VLVisionBlock"] * 2
    names = set(model.get_base_model()._no_split_modules)  # what shard_worker_model wraps
    assert [type(m).__name__ for m in model.modules() if type(m).__name__ in names] == units
