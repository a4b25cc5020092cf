"""Engine unsloth: the plan's rules and refusals (default tier, any environment) and real Unsloth training on the
CPU (`unsloth` tier: `scripts/test.sh --unsloth`, in .venv-unsloth where Unsloth and its pinned stack live)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import (
    REPO,
    freeze_worker,
    ftrun,
    has_checkpoint,
    metrics,
    polled_status,
    prepared_run,
    read_state,
    wait_for,
    wait_until_ended,
)
from launcher.errors import PlanError
from launcher.plan.hardware import from_spec
from launcher.plan.plan import make_plan
from launcher.recipe_loading import validate_recipe
from tests.conftest import recipe_file

HAVE_UNSLOTH = importlib.util.find_spec("unsloth") is not None
needs_unsloth = pytest.mark.skipif(not HAVE_UNSLOTH, reason="Unsloth is not installed (scripts/test.sh --unsloth)")
QUICK = ("smoke.enabled=false", "export=[]")
VISION_DATA = REPO / "recipes" / "data" / "tiny-vision.jsonl"
DATA = SimpleNamespace(
    examples=400,
    total_tokens=400 * 120,
    mean_tokens=120.0,
    max_tokens=256,
    over_max_length=0,
    tokens_source="tokenizer",
)


def cpu_box(cores=2):
    return from_spec("cpu").__class__((), "none", cores, 24.0, "detected")


def _plan(tmp_path, model, hw, unsloth, **fields):
    base = {
        "model": str(model),
        "method": "lora",
        "data": "d.jsonl",
        "max_length": 256,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 12,
    }
    base.update(fields)
    return make_plan(validate_recipe(base, tmp_path, "r"), hw, DATA, unsloth_available=unsloth)


# --- default tier: the plan ---------------------------------------------------------------------------


def test_prequantized_repos_only_for_qlora_hub_ids(tiny_model):
    from launcher.plan.models import prequantized_repo
    from launcher.worker.engines.unsloth import target_modules

    assert prequantized_repo("Qwen/Qwen3-8B", "qlora") == "unsloth/Qwen3-8B-bnb-4bit"
    assert (
        prequantized_repo("meta-llama/Llama-3.1-8B-Instruct", "qlora") == "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit"
    )
    assert prequantized_repo("Qwen/Qwen3-8B", "lora") is None  # LoRA trains on the 16-bit weights
    assert prequantized_repo(str(tiny_model), "qlora") is None  # local folders load as they are
    assert prequantized_repo("someone/unknown-model", "qlora") is None
    assert target_modules("all-linear") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert target_modules(["q_proj", "v_proj"]) == ["q_proj", "v_proj"]


def test_gpu_plan_says_which_prequantized_repo_unsloth_loads(tmp_path):
    p = _plan(tmp_path, "Qwen/Qwen3-8B", from_spec("1xL40S"), True, method="qlora", max_length=2048)
    assert p.engine == "unsloth"  # auto picks Unsloth on one GPU for LoRA/QLoRA when it is installed
    assert any("unsloth/Qwen3-8B-bnb-4bit" in r for r in p.reasons), p.reasons
    p = _plan(tmp_path, "Qwen/Qwen3-8B", from_spec("1xL40S"), False, method="qlora", max_length=2048)
    # trl loads the recipe's model (the plan's download line may point at the smaller repo, as a hint)
    assert p.engine == "trl" and not any("bnb-4bit instead of" in r for r in p.reasons), p.reasons


def test_cpu_plan_auto_never_picks_unsloth_but_allows_it_forced_where_installed(tmp_path, tiny_model):
    assert _plan(tmp_path, tiny_model, cpu_box(), True).engine == "trl"
    p = _plan(tmp_path, tiny_model, cpu_box(), True, engine="unsloth")
    assert (p.engine, p.device, p.num_processes) == ("unsloth", "cpu", 1)
    assert any("Unsloth's CPU path" in r for r in p.reasons)
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, tiny_model, cpu_box(), True, engine="unsloth", method="full")
    assert "LoRA/QLoRA only" in err.value.message


def test_gpu_plan_takes_unsloths_vision_path_when_asked_sized_with_trls_terms(tmp_path):
    """A vision-language model on one GPU: Unsloth's vision path with engine: unsloth, its memory and speed TRL's
    (for a text model Unsloth's own terms make them differ); engine auto keeps TRL, saying why (no GPU has run the
    vision path in ftrun's checks yet); a preference objective is refused for Unsloth."""
    from launcher.plan.vision import QWEN25_VL_7B

    model = tmp_path / "qwen2.5-vl-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_VL_7B))
    hw, fields = from_spec("1xL40S"), dict(method="qlora", max_length=2048)
    u, t = _plan(tmp_path, model, hw, True, engine="unsloth", **fields), _plan(tmp_path, model, hw, True, **fields)
    assert (u.engine, u.device, u.num_processes, t.engine) == ("unsloth", "cuda", 1, "trl")
    assert any("Unsloth's vision path (engine: unsloth) has not been run on a GPU" in r for r in t.reasons)
    said = next(r for r in u.reasons if r.startswith("engine unsloth"))
    assert "Unsloth's vision path" in said and "estimated from TRL's terms" in said and "fastest" not in said
    assert u.memory == t.memory and u.estimate == t.estimate
    assert any(r.startswith("loss (Unsloth's vision path, estimated as TRL's): TRL's fused") for r in u.reasons)
    text_u, text_t = (_plan(tmp_path, "Qwen/Qwen3-8B", hw, True, engine=e, **fields) for e in ("unsloth", "trl"))
    assert text_u.memory["per_gpu_gb"] < text_t.memory["per_gpu_gb"]  # text: Unsloth's own terms
    missing = _plan(tmp_path, model, hw, False, **fields)
    assert missing.engine == "trl" and not any("Unsloth not installed" in r for r in missing.reasons)
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, model, hw, True, engine="unsloth", objective="dpo", **fields)
    assert "engine unsloth: ftrun runs Unsloth for objective" in err.value.message


def test_cpu_plan_refuses_unsloths_vision_path_it_has_no_cpu_backend_for(tmp_path, tiny_vlm):
    from launcher.plan.cpu_engine import UNSLOTH_VISION_CPU

    for installed in (True, False):
        with pytest.raises(PlanError) as err:
            _plan(tmp_path, tiny_vlm, cpu_box(), installed, engine="unsloth")
        assert UNSLOTH_VISION_CPU in err.value.message
    assert _plan(tmp_path, tiny_vlm, cpu_box(), True).engine == "trl"


@pytest.mark.parametrize("tower", [False, True])
def test_unsloths_vision_lora_reaches_the_layers_engine_trl_adapts(tmp_path, tiny_vlm, tower):
    """FastVisionModel.get_peft_model's arguments (launcher/worker/engines/unsloth.py) adapt exactly the layers the
    TRL path's LoRA does, the ones the plan counts: the language model, the tower too where the recipe asks."""
    import re

    from launcher.recipe_loading import load_recipe
    from launcher.worker.engines.unsloth import vision_peft_arguments
    from launcher.worker.loading import add_lora, model_class

    lora = {"r": 8, "alpha": 16, "vision_tower": tower, "target_modules": ["q_proj", "v_proj"]}
    recipe = load_recipe(recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data=str(VISION_DATA), lora=lora))
    model = model_class(recipe.model).from_pretrained(recipe.model)
    args = vision_peft_arguments(model, recipe)
    assert (args["finetune_vision_layers"], args["finetune_language_layers"], args["bias"]) == (tower, True, "none")
    assert (args["r"], args["lora_alpha"], args["lora_dropout"]) == (8, 16, recipe.lora.dropout)
    assert args["use_gradient_checkpointing"] == ("unsloth" if recipe.gradient_checkpointing else False)
    ours = {n for n, _ in model.named_modules() if re.fullmatch(args["target_modules"], n)}
    trl = {
        n.rsplit(".lora_A", 1)[0].removeprefix("base_model.model.")
        for n, _ in add_lora(model, recipe).named_parameters()
        if ".lora_A." in n
    }
    assert ours == trl and any(".visual." in n for n in ours) == tower


def test_image_data_packing_is_refused_for_engine_unsloth_as_for_trl(tmp_path, tiny_vlm):
    recipe = recipe_file(tmp_path / "v.yaml", tiny_vlm, tmp_path / "run", data=str(VISION_DATA), max_length=64)
    res = ftrun("plan", recipe, "engine=unsloth", "packing=true", cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "packing: true with image data" in out and "M-RoPE" in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.skipif(HAVE_UNSLOTH, reason="checks the refusal where Unsloth is missing")
def test_engine_unsloth_is_refused_by_the_plan_when_not_installed(write_recipe, tmp_path):
    res = ftrun("plan", write_recipe(), "engine=unsloth", cwd=tmp_path)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert (
        "missing software" in out and "engine: unsloth needs Unsloth, which is not installed in this environment" in out
    ), out
    assert "transformers<=5.17" in out and "pip install 'ftrun[train,unsloth]'" in out  # why, and the fix
    assert not (tmp_path / "run" / "plan.json").exists()


@pytest.mark.skipif(HAVE_UNSLOTH, reason="checks the worker where Unsloth is missing")
def test_worker_never_falls_back_to_trl_when_the_plan_says_unsloth(write_recipe, tmp_path):
    """A plan made where Unsloth was installed, run where it is not: the worker stops before loading anything."""
    run = prepared_run(write_recipe(max_steps=6))
    plan = json.loads((run / "plan.json").read_text())
    plan["engine"] = "unsloth"
    (run / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, "-m", "launcher.run.supervisor", "--run-dir", str(run)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 5, res.stdout[-3000:] + res.stderr[-3000:]
    st = read_state(run)
    assert st["state"] == "failed" and st.get("restarts", 0) == 0
    assert "`import unsloth` failed" in st["reason"]
    assert not (run / "metrics.jsonl").exists()


# --- unsloth tier: real training with Unsloth on the CPU ------------------------------------------------


def _run(write_recipe, tmp_path, name, *overrides, **fields):
    recipe = write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **fields)
    res = ftrun(recipe, "--foreground", "engine=unsloth", *QUICK, *overrides, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return tmp_path / name, res.stdout + res.stderr  # --foreground: the worker's output is ours


def _check_unsloth_run(run: Path, log: str, steps: int) -> str:
    assert "engine unsloth" in log and "FastLanguageModel loaded" in log, log[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["engine"] == "unsloth" and plan["device"] == "cpu"
    st = read_state(run)
    v = st["verification"]
    checks = {c["check"]: c for c in v["checks"]}
    assert v["ok"] and checks["model loaded by Unsloth"]["ok"], v
    # no GPU: Unsloth's FastCPUModel path, with its own marks (a GPU run shows patched forwards instead)
    assert "FastCPUModel chunked cross-entropy forward" in checks["model loaded by Unsloth"]["seen"]
    assert "Unsloth 20" in checks["model loaded by Unsloth"]["seen"]
    assert "no GPU found, training on CPU" in log
    assert "imported before unsloth" not in log  # Unsloth came first in the worker
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, steps + 1))
    losses = [r["loss"] for r in m]
    k = max(2, steps // 4)
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k - 0.3, losses  # it learns
    assert (run / "final" / "adapter" / "adapter_model.safetensors").is_file()
    print(f"{run.name}: losses {losses[0]:.3f} -> {losses[-1]:.3f}; {checks['model loaded by Unsloth']['seen']}")
    return log


@pytest.mark.unsloth
@needs_unsloth
def test_unsloth_lora_trains_for_real(write_recipe, tmp_path):
    run, out = _run(write_recipe, tmp_path, "lora", max_steps=12)
    log = _check_unsloth_run(run, out, 12)
    assert "linear layers:" in log


@pytest.mark.unsloth
@needs_unsloth
def test_unsloth_qlora_4bit_trains_for_real(write_recipe, tmp_path):
    run, out = _run(write_recipe, tmp_path, "qlora", method="qlora", max_steps=12)
    log = _check_unsloth_run(run, out, 12)
    assert "Linear4bit" in log and "in 4 bit" in log  # the base weights really are 4-bit


@pytest.mark.unsloth
@needs_unsloth
def test_unsloth_kill9_then_resume(write_recipe, tmp_path):
    """Checkpoint, machine loss (kill -9 of supervisor and worker), the same command resumes; compared with an
    uninterrupted Unsloth run of the same recipe."""
    import torch
    from safetensors.torch import load_file

    fields = dict(max_steps=40, checkpoint_every_minutes=0.01, max_restarts=0)  # 40: see helpers.run_in_slices
    ref, _ = _run(write_recipe, tmp_path, "ref", **fields)
    recipe = write_recipe("r.yaml", **fields)
    res = ftrun(recipe, "engine=unsloth", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    st = freeze_worker(run, has_checkpoint, timeout=400)
    assert not (run / "final").exists()
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, "engine=unsloth", *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path, timeout=400)
    log = (run / "train.log").read_text()
    assert "resuming from step-" in log and log.count("FastLanguageModel loaded") == 2
    assert read_state(run)["verification"]["ok"]
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    dl = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    ta = load_file(str(ref / "final" / "adapter" / "adapter_model.safetensors"))
    tb = load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys()
    dt = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    resumed = log.split("resuming from step-")[1].split()[0]
    print(
        f"unsloth kill -9 at step-{resumed} + resume vs uninterrupted: max loss difference {dl:.3g}, "
        f"max adapter difference {dt:.3g}"
    )
    assert dl == 0.0 and dt == 0.0, (dl, dt)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.unsloth
@needs_unsloth
def test_prequantized_names_are_unsloths_own():
    """Every repo of our small mapping is one Unsloth's own mapper knows (it maps them the same way)."""
    from unsloth.models import mapper

    from launcher.plan.models import PREQUANTIZED

    known = {
        name.lower()
        for table in (mapper.INT_TO_FLOAT_MAPPER, mapper.FLOAT_TO_INT_MAPPER)
        for name in [*table.keys(), *[v for vs in table.values() for v in ([vs] if isinstance(vs, str) else vs)]]
    }
    missing = [repo for repo in PREQUANTIZED.values() if repo.lower() not in known]
    assert not missing, missing


# --- unsloth tier: Unsloth's vision path, all that a CPU can run of it ---------------------------------------------


@pytest.mark.unsloth
@needs_unsloth
def test_unsloths_cpu_backend_has_no_vision_path_and_the_plan_says_so(tmp_path, tiny_vlm):
    """Why engine unsloth does not train the tiny vision model here: the installed Unsloth's CPU backend
    (unsloth/_cpu_init.py) raises in FastVisionModel.from_pretrained and in UnslothVisionDataCollator. A release that
    trains vision on a CPU fails this test: then lift the plan's refusal (UNSLOTH_VISION_CPU) and train it here."""
    import unsloth

    from launcher.plan.cpu_engine import UNSLOTH_VISION_CPU

    assert unsloth.DEVICE_TYPE == "cpu"
    with pytest.raises(NotImplementedError, match="vision / audio models are not supported on the CPU backend"):
        unsloth.FastVisionModel.from_pretrained(model_name=str(tiny_vlm))
    from unsloth.trainer import UnslothVisionDataCollator

    with pytest.raises(NotImplementedError, match="not supported on the CPU backend"):
        UnslothVisionDataCollator(None, None)
    recipe = recipe_file(tmp_path / "v.yaml", tiny_vlm, tmp_path / "run", data=str(VISION_DATA), max_length=64)
    res = ftrun("plan", recipe, "engine=unsloth", cwd=tmp_path)
    out = " ".join((res.stdout + res.stderr).split())
    assert res.returncode != 0 and UNSLOTH_VISION_CPU in out and "Traceback" not in out, out[-3000:]


def _tiny_vlm_processor(folder: Path):
    """The tiny model's processor as transformers 5.17 (Unsloth's pin) builds it without torchvision: its
    AutoImageProcessor needs torchvision there, so the PIL image processor is named (on a GPU box, with torchvision,
    FastVisionModel.from_pretrained returns the AutoProcessor)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from launcher.worker.processor import _chat_template, _without_video

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return _without_video(Qwen2_5_VLProcessor)(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=_chat_template(folder, tokenizer),
    )


@pytest.mark.unsloth
@needs_unsloth
def test_the_recipe_maps_onto_unsloths_vision_arguments_and_collator_on_real_batches(tmp_path, tiny_vlm):
    """Everything of the vision path short of FastVisionModel's training step, with the installed Unsloth:
    - get_peft_model's arguments: the same layers as engine trl adapts; Unsloth's own switches
      (unsloth_zoo get_peft_regex) pick the same language-model layers, and with the tower all its layers but the
      patch merger's two, which ftrun adapts and the plan counts (hence the explicit regular expression);
    - UnslothVisionDataCollator (the zoo's class, which unsloth.trainer's extends on a GPU) on the demo's images:
      the rows and pixels TRL's vision collator makes, each image's tokens as the plan counts them, the padding and
      the image tokens out of the labels; with assistant_only_loss only the answer; through trl's SFTTrainer
      dataloader, and one forward and backward of the adapted model on it."""
    import re

    import unsloth  # noqa: F401  (first, as in the worker)
    import torch
    from peft import LoraConfig, get_peft_model
    from PIL import Image
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling
    from unsloth_zoo.peft_utils import get_peft_regex
    from unsloth_zoo.vision_utils import UnslothVisionDataCollator

    from launcher.data.dataset import load_data, to_dataset
    from launcher.data.image_tokens import read_rule
    from launcher.recipe_loading import load_recipe
    from launcher.worker.engines.unsloth import vision_collator, vision_peft_arguments
    from launcher.worker.loading import model_class

    def linears(model, regex):
        return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(regex, n)}

    for tower in (True, False):  # the language-model-only model stays for the batches below
        recipe = load_recipe(
            recipe_file(
                tmp_path / f"{tower}.yaml",
                tiny_vlm,
                tmp_path / "run",
                data=str(VISION_DATA),
                max_length=64,
                lora={"r": 8, "alpha": 16, "vision_tower": tower},
            )
        )
        model = model_class(recipe.model).from_pretrained(recipe.model)
        args = vision_peft_arguments(model, recipe)
        assert (args["finetune_vision_layers"], args["finetune_language_layers"]) == (tower, True)
        assert (args["r"], args["lora_alpha"], args["random_state"]) == (8, 16, recipe.seed)
        ours = linears(model, args["target_modules"])
        switches = {k: v for k, v in args.items() if k.startswith("finetune_")}
        theirs = linears(
            model, get_peft_regex(model, finetune_attention_modules=True, finetune_mlp_modules=True, **switches)
        )
        assert ours and all(".language_model." in n or (tower and ".visual." in n) for n in ours)
        assert any(".visual." in n for n in ours) == tower
        assert ours - theirs == ({"model.visual.merger.mlp.0", "model.visual.merger.mlp.2"} if tower else set())
        assert theirs <= ours

    processor = _tiny_vlm_processor(tiny_vlm)
    examples = load_data(VISION_DATA, recipe.seed).examples[:6]
    config = SFTConfig(
        output_dir=str(tmp_path / "out"), max_length=64, per_device_train_batch_size=6, use_cpu=True, report_to=[]
    )
    batch = vision_collator(model, processor, recipe, config, UnslothVisionDataCollator)(examples)
    trl_batch = DataCollatorForVisionLanguageModeling(processor, max_length=recipe.max_length)(
        [{**e, "images": [Image.open(p) for p in e["images"]]} for e in examples]
    )
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    assert torch.equal(batch["pixel_values"], trl_batch["pixel_values"])
    image_token = model.config.image_token_id
    rule = read_rule(tiny_vlm)
    for row, example in zip(batch["input_ids"], examples):
        (path,) = example["images"]
        assert int((row == image_token).sum()) == rule.tokens(*Image.open(path).size)  # resize="max"
    tokenizer = processor.tokenizer
    labels, ids = batch["labels"], batch["input_ids"]
    assert not (labels[ids == image_token] != -100).any() and not (labels[ids == tokenizer.pad_token_id] != -100).any()
    assert ((trl_batch["labels"] != -100) & (labels == -100) & (ids != image_token)).sum() > 0  # vision markers too
    answer = examples[0]["messages"][-1]["content"]
    assert answer in tokenizer.decode([t for t in labels[0].tolist() if t != -100])  # the whole conversation

    # assistant_only_loss: the collator's train_on_responses_only, the trainer's own setting off (trl 1.15 refuses
    # it for image data under transformers 5.17)
    adapted = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=args["target_modules"]))
    config.assistant_only_loss = True
    answers_only = recipe.model_copy(update={"assistant_only_loss": True})
    collator = vision_collator(adapted, processor, answers_only, config, UnslothVisionDataCollator)
    assert config.assistant_only_loss is False
    trainer = SFTTrainer(
        model=adapted,
        args=config,
        train_dataset=to_dataset(examples),
        processing_class=processor,
        data_collator=collator,
    )
    fed = next(iter(trainer.get_train_dataloader()))
    assert fed["pixel_values"].shape[0] == batch["pixel_values"].shape[0]
    answers = {e["messages"][-1]["content"] + "<|im_end|>" for e in examples}
    assert {tokenizer.decode([t for t in row.tolist() if t != -100]).strip() for row in fed["labels"]} <= answers
    loss = adapted(**fed).loss
    loss.backward()
    grads = [p.grad for n, p in adapted.named_parameters() if "lora_B" in n]
    assert torch.isfinite(loss) and grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    print(f"Unsloth's vision collator: {len(examples)} examples, loss {loss.item():.3f} on its batch (plain forward)")
