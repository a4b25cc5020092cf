"""Architecture from config.json / catalog, parameter counts against published numbers, offline errors."""

from __future__ import annotations

import json

import pytest

from launcher.plan import models
from launcher.errors import ModelError
from launcher.plan.models import catalog_key, from_catalog, load_architecture

# Published parameter counts (model cards / safetensors metadata), in billions.
PUBLISHED = [
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03),
    ("meta-llama/Llama-3.2-1B", 1.24),
    ("meta-llama/Llama-3.2-3B-Instruct", 3.21),
    ("meta-llama/Llama-3.3-70B-Instruct", 70.55),
    ("Qwen/Qwen3-0.6B", 0.60),  # 0.6B incl. tied embeddings (the card's 0.44B excludes them)
    ("Qwen/Qwen3-8B", 8.19),
    ("Qwen/Qwen3-32B", 32.76),
    ("Qwen/Qwen2.5-0.5B-Instruct", 0.49),
    ("Qwen/Qwen2.5-7B-Instruct", 7.62),
    ("Qwen/Qwen2.5-72B-Instruct", 72.71),
    ("mistralai/Mistral-7B-Instruct-v0.3", 7.25),
    ("google/gemma-2-9b-it", 9.24),
    ("google/gemma-2-27b-it", 27.23),
]


@pytest.mark.parametrize("model,billions", PUBLISHED)
def test_catalog_parameter_counts_match_published(model, billions):
    arch = from_catalog(model)
    assert arch is not None, model
    assert arch.params / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize(
    "name,key",
    [
        ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "llama-3.1-8b"),
        ("unsloth/Qwen3-8B-unsloth-bnb-4bit", "qwen3-8b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("google/gemma-3-27b-it", "gemma-3-27b"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
    ],
)
def test_catalog_key_ignores_variant_suffixes(name, key):
    assert catalog_key(name) == key


@pytest.mark.parametrize(
    "r,targets,expected",
    [
        (32, ["q_proj", "v_proj"], 9_175_040),  # the hand calculation for Llama-3.2-3B
        (16, "all-linear", 16 * 28 * ((3072 + 3072) + 2 * (3072 + 1024) + (3072 + 3072) + 3 * (3072 + 8192))),
    ],
)
def test_lora_parameter_count_llama_3_2_3b(r, targets, expected):
    assert from_catalog("meta-llama/Llama-3.2-3B").lora_params(r, targets) == expected


def test_lora_unknown_target_names_the_valid_ones():
    with pytest.raises(ModelError, match="qkv") as err:
        from_catalog("Qwen/Qwen3-8B").lora_params(16, ["qkv"])
    assert "q_proj" in err.value.fix


def test_local_config_directory(tmp_path):
    cfg = {  # a tiny Qwen3-shaped config like scripts/make_tiny_model.py writes
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = load_architecture(str(tmp_path))
    assert (arch.layers, arch.hidden, arch.kv_heads, arch.head_dim, arch.vocab) == (2, 64, 2, 16, 1000)
    assert arch.qk_norm and arch.tied_embeddings
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 16 + 2 * 64
    assert arch.params == 1000 * 64 + 2 * per_layer + 64
    assert "local config.json" in arch.source


def test_local_dir_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_architecture(str(tmp_path))


def test_multimodal_text_config_is_used():
    cfg = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 262208,
        },
    }
    arch = models.from_config(cfg, "g", "test")
    assert arch.params == from_catalog("google/gemma-3-4b-it").params


def test_hf_cache_is_read_before_catalog(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snap = tmp_path / "models--org--mymodel" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(
        json.dumps({"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 500})
    )
    (tmp_path / "models--org--mymodel" / "refs").mkdir()
    (tmp_path / "models--org--mymodel" / "refs" / "main").write_text("abc")
    # huggingface_hub reads HF_HUB_CACHE when it is imported (tests/plan/test_hf_cache.py sets it in a subprocess)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    arch = load_architecture("org/mymodel")
    assert arch.layers == 3 and "cache" in arch.source


def test_unknown_model_offline_lists_three_fixes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as err:
        load_architecture("someone/unknown-model-7b")
    text = err.value.render()
    assert "someone/unknown-model-7b" in text
    assert "(1)" in text and "(2)" in text and "(3)" in text
    assert "config.json" in text and "catalog" in text
