"""The model's tokenizer as training reads it: published tokenizer_config.json layouts (Mistral, Llama 2, Gemma, with
`add_bos_token` and AddedToken objects) load, count tokens as transformers does, and plan without a crash."""

import json
import shutil

import pytest

from chat_templates import FAMILIES, PUBLISHED_CONFIGS, build_tokenizer, conversation, publish_config
from helpers import ftrun
from launcher.data.dataset import token_counter
from launcher.data.loss_view import LossView, Settings
from launcher.data.tokenizer import read_tokenizer


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {
        layout: publish_config(build_tokenizer(root / layout, family), layout)
        for layout, (family, _) in PUBLISHED_CONFIGS.items()
    }


# AutoTokenizer loads the Llama-class layouts of these byte-level test tokenizers as TokenizersBackend (transformers
# 5.24 models/auto/tokenization_auto.py: a LlamaTokenizer whose tokenizer.json is ByteLevel), as ftrun reads them; it
# rebuilds GemmaTokenizer around Gemma's own space normalizer, which a byte-level vocabulary does not have (the real
# Gemma tokenizer.json has it), so there only the special tokens and the rendered text are compared.
SAME_ENCODING = {"mistral", "llama2"}


@pytest.mark.parametrize("layout", sorted(PUBLISHED_CONFIGS))
def test_published_config_reads_special_tokens_as_transformers_does(published, layout):
    from transformers import AutoTokenizer

    family = FAMILIES[PUBLISHED_CONFIGS[layout][0]]
    declared = PUBLISHED_CONFIGS[layout][1]
    read = read_tokenizer(published[layout])
    reference = AutoTokenizer.from_pretrained(str(published[layout]))
    assert read.special == {k: v for k, v in reference.special_tokens_map.items() if declared.get(k) is not None}
    assert read.special["bos_token"] == family.bos and read.special["eos_token"] == family.eos
    assert all(isinstance(v, str) for v in read.special.values())
    if layout in SAME_ENCODING:
        text = "The capital of France is Paris."
        assert read.tokenizer.encode(text, add_special_tokens=True).ids == reference(text).input_ids


@pytest.mark.parametrize("layout", sorted(PUBLISHED_CONFIGS))
def test_published_config_counts_and_marks_a_conversation(published, layout):
    from transformers import AutoTokenizer

    family = PUBLISHED_CONFIGS[layout][0]
    example = conversation(family)
    folder = str(published[layout])
    count, source = token_counter(folder)
    assert count is not None, source
    reference = AutoTokenizer.from_pretrained(folder)
    text = reference.apply_chat_template(example["messages"], tokenize=False)
    assert text.startswith(FAMILIES[family].bos)  # the template saw bos_token
    view = LossView(folder, Settings(max_length=4096))
    marked = view.mark(example)
    assert "".join(marked.pieces) == text
    assert count(example) == len(marked.ids) == len(view.tokenizer.encode(text, add_special_tokens=False).ids)
    if layout in SAME_ENCODING:
        assert (
            marked.ids
            == reference.apply_chat_template(example["messages"], tokenize=True, return_dict=True)["input_ids"]
        )
    assert any(marked.trained) and not marked.empty


def test_plan_reads_a_model_whose_config_has_add_bos_token(tmp_path, tiny_model, write_recipe):
    """The crash of issue 31: `add_bos_token: true` and AddedToken objects in tokenizer_config.json, as Llama 2
    publishes them, stopped `ftrun plan` with an internal error."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "legacy": False,
            "sp_model_kwargs": {},
            "pad_token": None,
            "eos_token": {
                "__type": "AddedToken",
                "content": cfg["eos_token"],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            },
        }
    )
    cfg_path.write_text(json.dumps(cfg))
    recipe = write_recipe(model=str(model))
    out = ftrun("plan", str(recipe), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "internal error" not in out.stdout + out.stderr
