"""The chat template families people fine-tune, as small tokenizers built locally: a byte-level BPE `tokenizers`
tokenizer trained on a few lines, the family's real Jinja chat template and its special tokens. For the data check
(tests/data/test_loss_view.py) and the served-prompt checks of the export.

The templates are the families' own: Qwen3 (ChatML with thinking), Qwen2.5 (ChatML with tools), Llama 3.1 (with
tools), Gemma (no system role) as trl 1.16 ships them for its identity comparison (trl/chat_templates/: the exact
strings of the Hub repositories, so TRL swaps in its training templates for them as it does for the real models);
Mistral 7B Instruct v0.1's [INST] template as its tokenizer_config.json holds it; and a base model with no template
(EOS only).

    folder = build_tokenizer(tmp_path / "tok", "llama3")     # tokenizer.json, tokenizer_config.json,
    chat_template.jinja
    FAMILIES["llama3"].end_of_turn                          # '<|eot_id|>'
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


def _trl_template(name: str) -> str:
    spec = importlib.util.find_spec("trl")  # found, not imported (trl imports torch)
    return (Path(list(spec.submodule_search_locations)[0]) / "chat_templates" / f"{name}.jinja").read_text(
        encoding="utf-8"
    )


# mistralai/Mistral-7B-Instruct-v0.1, tokenizer_config.json "chat_template"
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    template: Optional[str]  # None: a base model
    specials: tuple[str, ...]  # special tokens, the first ones named below
    bos: Optional[str]
    eos: str
    pad: str
    end_of_turn: str  # the token that ends an assistant turn
    add_bos: bool = False  # the tokenizer adds BOS to plain text (post-processor), as Llama's and Gemma's do
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen3's <think>)
    system: bool = True  # the template takes a system message
    tools: bool = False  # the template renders tool schemas and calls
    broken: dict = field(default_factory=dict)  # {text in the template: replacement} that drops the end of turn


FAMILIES = {
    "qwen3": Family(
        "qwen3",
        _trl_template("qwen3"),
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None,
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
        added=("<think>", "</think>", "<tool_call>", "</tool_call>"),
        tools=True,
        broken={"<|im_end|>": ""},
    ),
    "qwen2_5": Family(
        "qwen2_5",
        _trl_template("qwen2_5"),
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None,
        "<|im_end|>",
        "<|endoftext|>",
        "<|im_end|>",
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        tools=True,
        broken={"<|im_end|>": ""},
    ),
    "llama3": Family(
        "llama3",
        _trl_template("llama3_1"),
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        add_bos=True,
        tools=True,
        broken={"<|eot_id|>": ""},
    ),
    "gemma": Family(
        "gemma",
        _trl_template("gemma"),
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        "<pad>",
        "<end_of_turn>",
        add_bos=True,
        system=False,
        broken={"<end_of_turn>": ""},
    ),
    "mistral": Family(
        "mistral",
        MISTRAL_TEMPLATE,
        ("<unk>", "<s>", "</s>"),
        "<s>",
        "</s>",
        "</s>",
        "</s>",
        add_bos=True,
        system=False,
        broken={" + eos_token": ""},
    ),
    "base": Family("base", None, ("<|endoftext|>",), None, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>"),
}
CHAT_FAMILIES = [f for f in FAMILIES if FAMILIES[f].template is not None]

_CORPUS = [
    "The capital of France is Paris.",
    "What is 2 + 2? It is 4.",
    "Reverse the word lamp: pmal.",
    "Be brief. Answer the question, then stop.",
    "Lights on in the kitchen, please.",
    "system user assistant",
    "model tool ipython function name arguments parameters Environment Cutting Knowledge Date Today",
    '[INST] [/INST] <think> </think> <tool_call> </tool_call> {"name": "lights", "room": "kitchen"}',
]


def build_tokenizer(folder: Path, family: str, template: Optional[str] = None, vocab: int = 400) -> Path:
    """A tokenizer of the family saved in `folder` (tokenizer.json, tokenizer_config.json, chat_template.jinja);
    `template` replaces the family's (a broken variant). The same arguments give the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[family]
    folder = Path(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(fam.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 3, trainer=trainer)
    if fam.added:
        tok.add_tokens(list(fam.added))
    if fam.add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A",
            pair=f"{fam.bos} $A {fam.bos} $B",
            special_tokens=[(fam.bos, tok.token_to_id(fam.bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    named = {"eos_token": fam.eos, "pad_token": fam.pad, **({"bos_token": fam.bos} if fam.bos else {})}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        extra_special_tokens=[t for t in fam.specials if t not in named.values()],
        **named,
    )
    chat = template if template is not None else fam.template
    if chat is not None:
        fast.chat_template = chat
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def broken_template(family: str) -> str:
    """The family's template with the end-of-turn token after an assistant turn taken out."""
    fam = FAMILIES[family]
    out = fam.template
    for old, new in fam.broken.items():
        assert old in out, (family, old)
        out = out.replace(old, new)
    return out


def conversation(family: str, answer: str = "Paris.", question: str = "The capital of France?", turns: int = 1) -> dict:
    """A chat example the family's template renders: a system message where it takes one, tools where it renders
    them (Llama 3.1 puts them in the first user message), `turns` question/answer pairs."""
    fam = FAMILIES[family]
    msgs = [{"role": "system", "content": "Be brief."}] if fam.system else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    example = {"messages": msgs}
    if fam.tools:
        example["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "lights",
                    "description": "Switch the lights",
                    "parameters": {"type": "object", "properties": {"room": {"type": "string"}}},
                },
            }
        ]
    return example


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _added(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


# tokenizer_config.json as the Hub repositories publish it (their keys and value types; the template and the long
# added_tokens_decoder left to the built tokenizer): `add_bos_token` and `add_eos_token` are booleans, Llama 2's
# tokens are AddedToken objects, `sp_model_kwargs` an object, `pad_token` null.
PUBLISHED_CONFIGS = {
    # mistralai/Mistral-7B-Instruct-v0.2
    "mistral": (
        "mistral",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "additional_special_tokens": [],
            "bos_token": "<s>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "legacy": True,
            "model_max_length": 1000000000000000019884624838656,
            "pad_token": None,
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        },
    ),
    # meta-llama/Llama-2-7b-chat-hf (same special tokens as Mistral's tokenizer)
    "llama2": (
        "mistral",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": _added("<s>"),
            "clean_up_tokenization_spaces": False,
            "eos_token": _added("</s>"),
            "legacy": False,
            "model_max_length": 1000000000000000019884624838656,
            "pad_token": None,
            "padding_side": "right",
            "sp_model_kwargs": {},
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": _added("<unk>"),
        },
    ),
    # google/gemma-7b-it
    "gemma": (
        "gemma",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
            "bos_token": "<bos>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<eos>",
            "legacy": None,
            "model_max_length": 1000000000000000019884624838656,
            "pad_token": "<pad>",
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        },
    ),
}


def publish_config(folder: Path, layout: str) -> Path:
    """`folder`'s tokenizer_config.json replaced by the published layout `layout` (PUBLISHED_CONFIGS)."""
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(PUBLISHED_CONFIGS[layout][1], indent=2))
    return Path(folder)
