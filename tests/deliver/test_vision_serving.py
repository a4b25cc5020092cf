"""A vision-language model's export, the parts that need no llama.cpp: the plan-time refusals of a projector the pinned
converter cannot write, the image-token bounds each server uses, and the serving commands' text (vLLM with
--limit-mm-per-prompt and LoRA only where it adapts the language model alone, llama-server --mmproj, Ollama per
architecture). The conversion and the parity through llama.cpp's mtmd: tests/deliver/test_vision_gguf.py (gguf tier).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.deliver import vision_serving as vs
from launcher.errors import RecipeError
from launcher.plan import gguf_readiness
from launcher.plan.vision import LANGUAGE_MODEL_ONLY, WITH_TOWER


def _model(tmp_path: Path, arch: str, model_type: str, depth: int = 32, vision: bool = True) -> Path:
    folder = tmp_path / arch
    folder.mkdir()
    cfg = {"architectures": [arch], "model_type": model_type}
    if vision:
        cfg["vision_config"] = {"depth": depth}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_projector_refused_where_the_pinned_converter_has_no_mmproj_class(tmp_path):
    model = _model(tmp_path, "PaliGemmaForConditionalGeneration", "paligemma")
    why = gguf_readiness.projector_problem(str(model))
    assert "cannot convert the vision projector (mmproj) of architecture 'PaliGemmaForConditionalGeneration'" in why
    assert "MMPROJ_MODEL_MAP" in why
    # the plan refuses it before training, naming the architecture
    recipe = SimpleNamespace(model=str(model), export=["adapter", "gguf"], gguf_type="q8_0")
    with pytest.raises(RecipeError) as exc:
        gguf_readiness.plan_check(recipe, this_box=False)
    assert "PaliGemmaForConditionalGeneration" in exc.value.message and "gguf" in exc.value.message


def test_projector_of_a_two_block_tower_refused_with_the_converters_reason(tiny_vlm):
    # the tiny model's tower has 2 blocks: the converter's name map stops before visual.merger.mlp.2
    why = gguf_readiness.projector_problem(str(tiny_vlm))
    assert why is not None and "visual.merger.mlp.2" in why and "depth 2" in why


def test_projector_refused_where_llama_cpp_would_use_other_attention_windows(tmp_path):
    model = _model(tmp_path, "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")
    cfg = json.loads((model / "config.json").read_text())
    cfg["vision_config"]["window_size"] = 56
    (model / "config.json").write_text(json.dumps(cfg))
    why = gguf_readiness.projector_problem(str(model))
    assert why is not None and "uses 112 pixels" in why and "window_size is 56" in why


def test_projector_accepted_for_qwen2_5_vl_and_ignored_for_text_models(tmp_path):
    qwen25 = _model(tmp_path, "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", depth=32)
    assert gguf_readiness.projector_problem(str(qwen25)) is None
    assert (
        gguf_readiness.projector_problem(str(_model(tmp_path, "Qwen2VLForConditionalGeneration", "qwen2_vl"))) is None
    )
    assert gguf_readiness.projector_problem(str(tmp_path / "not-here")) is None  # checked where the config is
    text = _model(tmp_path, "Qwen3ForCausalLM", "qwen3", vision=False)
    assert gguf_readiness.projector_problem(str(text)) is None
    recipe = SimpleNamespace(model=str(qwen25), export=["adapter"], gguf_type="q8_0")
    assert gguf_readiness.plan_check(recipe, this_box=False) == []  # no gguf asked: nothing checked


def test_shipped_projector_table_holds_the_qwen_vl_family():
    table = gguf_readiness.shipped_projectors()
    for arch in (
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
    ):
        assert arch in table
    assert "PaliGemmaForConditionalGeneration" not in table


def test_processor_bounds_in_tokens():
    # the published Qwen2.5-VL preprocessor_config.json: 3136 to 12845056 pixels, 28 x 28 pixels a token
    b = vs.processor_bounds(3136, 12845056, 14, 2)
    assert (b.min_tokens, b.max_tokens, b.exact) == (4, 16384, True)
    assert vs.llamacpp_flags("qwen2_5_vl", b) == ["--image-min-tokens", "4", "--image-max-tokens", "16384"]
    # llama.cpp's own bounds for the family (clip.cpp set_limit_image_tokens(8, 4096)): no flags needed
    assert vs.llamacpp_flags("qwen2_5_vl", vs.processor_bounds(8 * 784, 4096 * 784, 14, 2)) == []
    inexact = vs.processor_bounds(3000, 12845000, 14, 2)
    assert (inexact.min_tokens, inexact.max_tokens, inexact.exact) == (4, 16383, False)


def _commands(**over):
    args = dict(
        merged="/runs/v/final/merged",
        base="/models/Qwen2.5-VL-7B-Instruct",
        adapter="/runs/v/final/adapter",
        lora_servable=True,
        lora_why=LANGUAGE_MODEL_ONLY,
        name="v",
        max_images=2,
        max_len=2048,
        text_gguf="/runs/v/final/gguf/v-Q8_0.gguf",
        mmproj="/runs/v/final/gguf/mmproj-v-F16.gguf",
        model_type="qwen2_5_vl",
        architecture="Qwen2_5_VLForConditionalGeneration",
        bounds=vs.processor_bounds(3136, 12845056, 14, 2),
    )
    args.update(over)
    return vs.commands(**args)


def test_vllm_commands_take_the_image_limit_as_json_and_lora_only_for_the_language_model():
    c = _commands()
    for key in ("vllm", "vllm_lora"):
        argv = shlex.split(c[key])
        limit = argv[argv.index("--limit-mm-per-prompt") + 1]
        assert json.loads(limit) == {"image": 2, "video": 0}
    assert "--enable-lora" in c["vllm_lora"] and "v=/runs/v/final/adapter" in c["vllm_lora"]
    assert shlex.split(c["vllm"])[2] == "/runs/v/final/merged"
    tower = _commands(lora_servable=False, lora_why=WITH_TOWER)
    assert "vllm_lora" not in tower and "vllm" in tower
    assert any("no vLLM LoRA command" in n and "serve the merged model" in n for n in tower["notes"])


def test_llama_cpp_commands_carry_the_projector_and_the_processors_image_bounds():
    c = _commands()
    server = shlex.split(c["llama_server"])
    assert server[:5] == [
        "llama-server",
        "-m",
        "/runs/v/final/gguf/v-Q8_0.gguf",
        "--mmproj",
        "/runs/v/final/gguf/mmproj-v-F16.gguf",
    ]
    assert server[server.index("--image-min-tokens") + 1] == "4"
    assert server[server.index("--image-max-tokens") + 1] == "16384"
    assert "--jinja" in server
    assert c["llama_mtmd_cli"].startswith("llama-mtmd-cli -m ") and "--image-min-tokens 4" in c["llama_mtmd_cli"]
    assert any("(8, 4096)" in n for n in c["notes"])
    no_gguf = _commands(text_gguf=None, mmproj=None)
    assert "llama_server" not in no_gguf and "llama_mtmd_cli" not in no_gguf


def test_ollama_said_per_architecture():
    assert "ollama create from the merged folder" in _commands()["ollama"]
    assert "not the llama.cpp GGUF + mmproj pair" in _commands()["ollama"]
    other = _commands(architecture="PaliGemmaForConditionalGeneration")["ollama"]
    assert other.startswith("PaliGemmaForConditionalGeneration is not in the architectures")
    text = vs.serving_text(_commands())
    assert "--mmproj" in text and "--limit-mm-per-prompt" in text and "Ollama: ollama create" in text


def test_lora_reach_read_from_the_adapter(tmp_path):
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "adapter_config.json").write_text(
        json.dumps({"target_modules": "^(model\\.language_model\\.layers\\.0\\.self_attn\\.q_proj)$"})
    )
    assert vs.lora_reach(lm) == {"lora_reach": LANGUAGE_MODEL_ONLY, "served_by_vllm_as_lora": True}
    tower = tmp_path / "tower"
    tower.mkdir()
    (tower / "adapter_config.json").write_text(
        json.dumps({"target_modules": ["model.visual.blocks.0.attn.qkv", "q_proj"]})
    )
    assert vs.lora_reach(tower) == {"lora_reach": WITH_TOWER, "served_by_vllm_as_lora": False}


def test_processor_files_copied_beside_merged_weights(tiny_vlm, tmp_path):
    from launcher.worker.processor import save_processor_files

    save_processor_files(tiny_vlm, tmp_path)
    got = {f.name for f in tmp_path.iterdir()}
    assert {"preprocessor_config.json", "chat_template.jinja", "tokenizer.json"} <= got
    assert "config.json" not in got and not (tmp_path / "model.safetensors").exists()
