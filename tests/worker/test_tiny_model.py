"""The locally built tiny model, its tokenizer/chat template and the shipped demo data are fit for offline training."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Before any HF import: without these, TRL telemetry and datasets' download counter hang on a closed network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"


def _load_script(name):
    # scripts/ is not a package; load the file as a module under a private name.
    spec = importlib.util.spec_from_file_location(f"_ftrun_{name}", REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tiny = _load_script("make_tiny_model")
tiny_data = _load_script("make_tiny_data")

CONVO = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Reverse the word cat."},
    {"role": "assistant", "content": "cat reversed is tac."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_module_import_is_light():
    # Tests and `ftrun plan` import the builder; torch must only load when a model is actually built.
    code = (
        "import sys, importlib.util as u;"
        f"s = u.spec_from_file_location('m', {str(REPO / 'scripts' / 'make_tiny_model.py')!r});"
        "m = u.module_from_spec(s); s.loader.exec_module(m);"
        "bad = [n for n in ('torch', 'transformers', 'tokenizers') if n in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loads_offline_with_auto_classes(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert len(tok) == model.config.vocab_size
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    assert tok.decode(tok("Ticket 1234: héllo wörld")["input_ids"]) == "Ticket 1234: héllo wörld"

    # ftrun's planner reads these straight from config.json.
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert key in cfg, key
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]

    out = model.generate(**tok("<|im_start|>user\nhi<|im_end|>\n", return_tensors="pt"), max_new_tokens=3)
    assert out.shape[1] > 0


def test_chat_template_marks_exactly_the_assistant_tokens(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(CONVO, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
        "<|im_start|>user\nReverse the word cat.<|im_end|>\n"
        "<|im_start|>assistant\ncat reversed is tac.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(CONVO[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")

    enc = tok.apply_chat_template(CONVO, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert len(ids) == len(mask)
    # Split the sequence into maximal masked runs: each must be one assistant reply plus its end-of-turn token
    # (trained, so the model learns to stop), and nothing else may be masked.
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [tok.decode(s) for s in spans] == [
        "The capital of France is Paris.<|im_end|>\n",
        "cat reversed is tac.<|im_end|>\n",
    ]
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\nReverse the word cat.<|im_end|>\n<|im_start|>assistant\n"
    )

    # TRL accepts the template as-is for assistant_only_loss (no patching, end-of-turn token trained).
    from trl.chat_template_utils import has_generation_markers, is_chat_template_stop_token_trained

    assert has_generation_markers(tok.chat_template)
    assert is_chat_template_stop_token_trained(tok)


def test_build_is_deterministic_and_reused(tmp_path, model_dir):
    b = tiny.build_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (b / name).read_bytes() == (model_dir / name).read_bytes(), name

    # Same args: the directory is reused untouched; another seed rebuilds the weights but not the tokenizer.
    mtime = (b / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model(b) == b
    assert (b / "model.safetensors").stat().st_mtime_ns == mtime
    tiny.build_tiny_model(b, seed=1)
    assert (b / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (b / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert json.loads((b / tiny.MARKER).read_text())["spec"]["seed"] == 1


def test_bigger_sizes_through_flags(tmp_path):
    out = tiny.build_tiny_model(tmp_path / "m", hidden=128, layers=3, heads=8, kv_heads=4, intermediate=256)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (128, 3, 16)
    assert tiny.count_params(out) > 4 * tiny.count_params(tiny.build_tiny_model(tmp_path / "small"))
    with pytest.raises(ValueError):
        tiny.build_tiny_model(tmp_path / "bad", hidden=64, heads=3)


def test_shipped_data_parses_and_matches_generator():
    lines = DATA.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 400
    for n, line in enumerate(lines, 1):
        msgs = json.loads(line)["messages"]
        roles = [m["role"] for m in msgs]
        assert set(roles) <= {"system", "user", "assistant"}, n
        assert "system" not in roles[1:], n
        assert roles[-1] == "assistant" and "assistant" in roles, n
        assert all(isinstance(m["content"], str) and m["content"] for m in msgs), n
    # The committed file is exactly what the script's defaults produce.
    assert [json.loads(x) for x in lines] == tiny_data.make_examples(400, seed=0)


def test_lora_sft_loss_falls(tmp_path, model_dir):
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_length=256,
        per_device_train_batch_size=8,
        max_steps=40,
        # Measured on the default tiny model: 2e-2 gives 6.69 -> 4.28 in 40 steps (~2.7 after 300 steps);
        # 3e-3 only reaches 5.76 in 40 steps.
        learning_rate=2e-2,
        logging_steps=5,
        report_to="none",
        save_strategy="no",
        activation_checkpointing=False,  # nothing to save on a 140k-parameter model; it only costs time
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=load_dataset("json", data_files=str(DATA), split="train"),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8
    # 0.64 measured; the margin absorbs platform float differences.
    assert losses[-1] < 0.75 * losses[0], losses
