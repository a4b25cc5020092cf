"""A vision-language run's GGUF export through llama.cpp (gguf tier: `scripts/test.sh --gguf`): the text GGUF and the
projector GGUF written by the pinned converter, read back through llama.cpp's multimodal path (libmtmd in
llama-cpp-python 0.3.36) and held to the merged model on the held-out images.

The run is built directly, not trained: the tiny Qwen2.5-VL of scripts/make_tiny_vlm.py with a 3-block vision tower
(the converter cannot map a 2-block tower's merger, launcher/plan/gguf_readiness.py projector_problem) and a LoRA on
its language model with non-zero weights, saved as final/adapter with the processor files, and the run's task.json:
the layout vision training writes, exported through the same code as a text model's.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gguf


@pytest.fixture(scope="module")
def vision_run(tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_vlm import build_tiny_vlm

    from launcher.worker.processor import save_processor_files

    built = build_tiny_vlm(REPO / ".cache" / "tiny-vlm3-tests", vision_layers=3)
    # llama.cpp runs a Qwen2.5-VL tower with 112-pixel attention windows (the published models'); the tiny model's
    # are 56 (projector_problem refuses that): the copy here says 112, which changes no weight
    tiny = tmp_path_factory.mktemp("tiny-vlm3-window112")
    shutil.copytree(built, tiny, dirs_exist_ok=True)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["vision_config"]["window_size"] = 112
    (tiny / "config.json").write_text(json.dumps(cfg, indent=2))
    run = tmp_path_factory.mktemp("vision-run")
    final = run / "final"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", init_lora_weights=False
    )
    model = get_peft_model(model, config)
    model.save_pretrained(final / "adapter")
    save_processor_files(tiny, final / "adapter")
    recipe = {
        "model": str(tiny),
        "method": "lora",
        "data": str(REPO / "recipes" / "data" / "tiny-vision.jsonl"),
        "max_length": 64,
        "micro_batch_size": 8,
        "output_dir": str(run),
        "export": ["adapter", "merged", "gguf"],
        "gguf_type": "f32",
        "eval": {"fraction": 0.2, "max_new_tokens": 4, "task": {"examples": 10}},  # the fewest a task scores
        "smoke": {"enabled": False},
    }
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    from launcher.data.dataset import load_data
    from launcher.recipe_loading import load_recipe
    from launcher.store.rundir import RunDir
    from launcher.worker.task_eval import task_for_run

    loaded = load_recipe(run / "recipe.yaml")
    task_for_run(RunDir(run), loaded, load_data(loaded.data, loaded.seed).examples)  # the task training writes
    return run


@pytest.fixture(scope="module")
def exported(vision_run):
    from launcher.deliver.export import export_run

    report = export_run(vision_run)
    return vision_run, report


def test_text_gguf_and_projector_written_by_llama_cpps_converter(exported):
    run, report = exported
    gguf = report["outputs"]["gguf"]
    assert "preprocessor_config.json" in report["outputs"]["merged"]["processor_files"]
    assert Path(gguf["path"]).is_file() and Path(gguf["mmproj"]).is_file()
    assert Path(gguf["mmproj"]).name.startswith("mmproj-")
    assert gguf["architecture"] == "qwen2vl"
    assert gguf["projector"]["architecture"] == "clip"
    assert gguf["projector"]["projector_type"] == "qwen2.5vl_merger"
    assert gguf["projector"]["block_count"] == 3 and gguf["projector"]["projection_dim"] == 64
    assert "convert_mmproj" in gguf["steps"]
    on_disk = json.loads((run / "final" / "export.json").read_text())
    assert on_disk["ok"] is True and on_disk["vision"] is True


def test_parity_through_mtmd_on_the_held_out_images(exported):
    _, report = exported
    parity = report["outputs"]["gguf"]["parity_vs_merged"]
    n = report["held_out_image_prompts"]
    assert n == 10 and parity["prompts"] == n  # the task's prompts
    # llama-server's prompt, each image chunk as its count of <|image_pad|>, is the processor's, token for token
    assert parity["prompt_identical"] == f"{n}/{n}" and parity["image_tokens_identical"] == f"{n}/{n}"
    # an F32 pair holds the merged float32 weights: where the merged model's first token is decided (leads its
    # runner-up by more than the two sides' logit difference), llama.cpp picks it; the distributions stay close
    assert parity["first_token_top1_agreement_where_decided"] == 1.0
    assert parity["first_token_mean_kl"] < 5e-4 and parity["first_token_max_abs_logit_diff"] < 0.5
    # the pair answered the task's prompts: its score beside the merged model's in the run's task_eval.json
    scores = json.loads((exported[0] / "task_eval.json").read_text())["scores"]
    assert 0.0 <= scores["gguf-f32"] <= 1.0 and 0.0 <= scores["merged"] <= 1.0
    assert report["outputs"]["gguf"]["image_token_bounds"] == {
        "processor": [4, 16],
        "llama_cpp_default": [8, 4096],
        "given_to_mtmd": True,
    }


def test_serving_md_has_each_servers_command(exported):
    run, report = exported
    text = (run / "final" / "SERVING.md").read_text()
    cmds = report["serving_commands"]
    assert "--limit-mm-per-prompt" in cmds["vllm"] and "--enable-lora" in cmds["vllm_lora"]
    assert f"--mmproj {report['outputs']['gguf']['mmproj']}" in cmds["llama_server"]
    assert "--image-min-tokens 4 --image-max-tokens 16" in cmds["llama_server"]
    for c in (cmds["vllm"], cmds["vllm_lora"], cmds["llama_server"], cmds["llama_mtmd_cli"]):
        assert c in text
    assert report["outputs"]["adapter"]["served_by_vllm_as_lora"] is True


def test_llama_cpps_own_image_bounds_change_the_served_prompt(vision_run, exported, tmp_path):
    """Without the processor's bounds, llama.cpp sizes a 56 x 56 image to its own minimum of 8 tokens where the
    processor makes 4: the served-prompt check sees the difference (and the export gives mtmd the bounds)."""
    from PIL import Image

    from launcher.deliver import vision_gguf

    merged, gguf = vision_run / "final" / "merged", vision_run / "final" / "gguf"
    exported_files = sorted(gguf.glob("*.gguf"))
    assert exported_files, "the export's files"
    text = next(f for f in exported_files if not f.name.startswith("mmproj-"))
    mmproj = next(f for f in exported_files if f.name.startswith("mmproj-"))
    img = tmp_path / "small.png"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(img)
    ex = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}],
                },
                {"role": "assistant", "content": "red."},
            ],
            "images": [str(img)],
        }
    ]
    ref = vision_gguf.transformers_side(merged, ex, 2)
    assert ref[0]["image_tokens"] == [4]
    own = vision_gguf.mtmd_side(text, mmproj, ex, 2, None, ref[0]["pad_id"])
    assert own["outputs"][0]["image_tokens"][0] >= 8
    assert vision_gguf.compare(ref, own["outputs"], set(own["eog_ids"]))["prompt_identical"] == "0/1"
    given = vision_gguf.mtmd_side(text, mmproj, ex, 2, vision_gguf.bounds_of(merged), ref[0]["pad_id"])
    assert vision_gguf.compare(ref, given["outputs"], set(given["eog_ids"]))["prompt_identical"] == "1/1"


def test_shipped_projector_table_is_the_installed_converters():
    from launcher.plan import gguf_readiness as g

    conv = g.converter()
    assert conv is not None and conv.version == g.PINNED
    assert g.supported_architectures(conv.folder, "MMPROJ_MODEL_MAP") == g.shipped_projectors()


def test_export_refuses_a_tower_the_converter_cannot_map(tiny_vlm):
    from launcher.deliver.export_inputs import check_gguf
    from launcher.errors import UsageError

    with pytest.raises(UsageError) as exc:
        check_gguf(str(tiny_vlm), "f16")
    assert "visual.merger.mlp.2" in exc.value.message


def test_a_build_without_mtmd_checks_the_text_gguf_on_text_only_prompts(vision_run, exported, monkeypatch, tmp_path):
    from launcher.deliver import vision_gguf

    monkeypatch.setattr(vision_gguf, "mtmd_missing", lambda: "llama-cpp-python 0.3.x has no libmtmd binding (test)")
    from launcher.recipe_loading import load_recipe

    ex, _ = vision_gguf.held_out(load_recipe(vision_run / "recipe.yaml"))
    out = vision_gguf.vision_gguf_output(vision_run / "final" / "merged", tmp_path, "t", "f32", ex[:2], 3)
    assert out["parity_through"].startswith("the text GGUF alone on text-only prompts (llama-cpp-python 0.3.x")
    assert "without libmtmd" in out["runtime"]
    p = out["parity_vs_merged"]
    assert (
        p["prompts"] == 2
        and p["prompt_identical"] == "2/2"
        and p["image_tokens"][0] == {"transformers": [], "llama_cpp": []}
    )
    assert p["first_token_max_abs_logit_diff"] < 0.05
