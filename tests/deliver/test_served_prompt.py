"""The served prompt is the trained prompt (launcher/deliver/served_prompt.py, go_template.py): each check fails on
a deliberately broken case. Fast: the tiny model's tokenizer, no training. The export end to end is in
tests/deliver/test_export.py (vLLM) and tests/deliver/test_gguf.py (llama.cpp, Ollama; -m gguf)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"
DROP_END = ("message['content'] + '<|im_end|>\\n'", "message['content'] + '\\n'")  # the end-of-turn token dropped


@pytest.fixture
def served(tiny_model, tmp_path):
    from helpers import export_recipe

    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(export_recipe(tmp_path / "r.yaml", tiny_model, tmp_path / "run", eval={"fraction": 0.05}))
    return ServedPrompt(recipe, tiny_model, 3)


def _tokenizer(model: Path, template=None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    if template is not None:
        tok.chat_template = template(tok.chat_template)
    return tok


def test_trained_prompts_and_end_of_turn_come_from_the_held_out_examples(served):
    rep = served.report
    assert rep["prompts_from"] == "held out (eval.fraction)" and rep["prompts"] == 3 and served.chat
    assert rep["end_of_turn"] == {
        "ids": [2],
        "tokens": ["<|im_end|>"],
        "answers_followed_by_nothing": 0,
        "outside_the_loss": 0,
        "answers_not_written_verbatim": 0,
    }
    for p in served.prompts:  # what precedes the answer in the training sequence: the assistant turn's header
        assert served.tokenizer.decode(p["ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert p["reference"] == "the tokens in front of the answer in the training sequence"
    # the held-out prompts first, then one of every other shape in the data (tiny-chat.jsonl has six)
    assert [p["from"] for p in served.prompts[:3]] == ["held out"] * 3
    shapes = rep["shapes"]
    assert shapes["found"] == shapes["checked"] == len({p["shape"] for p in served.prompts}) == 6
    assert "system,user,assistant,user,assistant,user" in shapes["each"] and served.kwargs == {}


def test_the_exported_template_renders_the_trained_prompt(served, tiny_model):
    entry = served.compare_transformers("vllm_merged", _tokenizer(tiny_model), "vLLM (the merged folder)")
    n = len(served.prompts)
    assert entry["ok"] and entry["identical"] == f"{n}/{n}" and served.report["checked"] == ["vLLM"]
    stops = served.check_stops("vllm_merged", "vLLM", [2, 0], fix="-")
    assert stops["ok"]


def test_a_template_that_drops_the_end_of_turn_token_fails_with_the_first_differing_token(served, tiny_model):
    from launcher.deliver.messages import ExportError

    bad = _tokenizer(tiny_model, lambda t: t.replace(*DROP_END))
    with pytest.raises(ExportError) as err:
        served.compare_transformers("vllm_adapter", bad, "vLLM (the adapter)")
    msg = err.value.message
    assert "vLLM (the adapter) serves another prompt than the training saw" in msg
    assert "where training had 2 '<|im_end|>'" in msg and f"identical 0/{len(served.prompts)}" in msg
    assert "(prompt 1 of 7, held out, roles user)" in msg
    entry = served.report["runtimes"]["vllm_adapter"]
    d = entry["first_difference"]
    assert not entry["ok"] and not served.report["ok"]
    assert d["trained"] == {"id": 2, "token": "<|im_end|>"} and d["served"]["token"] == "Ċ" and d["context"]
    assert served.tokenizer.decode(served.prompts[d["prompt"]]["ids"][: d["position"]]).endswith(d["context"])


@pytest.mark.parametrize("after, taught", [("'\\n'", ["Ċ"]), ("''", [])])
def test_a_training_template_without_an_end_of_turn_teaches_no_stop(tiny_model, tmp_path, after, taught):
    """Trained on a template that closes the answer with a bare newline (or with nothing): the newline is what the
    training taught to end a turn, which no runtime stops on; with nothing after the answer, there is no end at
    all. Either fails the stop check."""
    from helpers import export_recipe

    from launcher.deliver.messages import ExportError
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    jinja = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(jinja.replace(DROP_END[0], f"message['content'] + {after}"))
    recipe = load_recipe(export_recipe(tmp_path / "r.yaml", model, tmp_path / "run"))
    sp = ServedPrompt(recipe, model, 3)
    assert sp.report["end_of_turn"]["tokens"] == taught
    assert sp.report["end_of_turn"]["answers_followed_by_nothing"] == (0 if taught else 3)
    with pytest.raises(
        ExportError,
        match="does not stop on the token the training taught to end a turn \\(201 'Ċ'\\)"
        if taught
        else "the training taught no token to end a turn",
    ):
        sp.check_stops("vllm_merged", "vLLM", [0, 2], fix="-")


def test_stops_that_miss_the_trained_end_of_turn_fail(served):
    from launcher.deliver.messages import ExportError

    # a base model's generation_config.json that stops on <|endoftext|> only (LLaMA-Factory #7454)
    with pytest.raises(
        ExportError, match=r"does not stop on the token the training taught to end a turn \(2 '<\|im_end\|>'\)"
    ):
        served.check_stops("vllm_merged", "vLLM (the merged folder)", [0], fix="add it")
    assert served.report["stops"]["vllm_merged"]["ok"] is False


def test_modelfile_stops_are_matched_as_ollama_matches_them(served):
    from launcher.deliver.served_prompt import modelfile_parts

    template, stops = modelfile_parts(
        'FROM ./x.gguf\nTEMPLATE """{{ .Content }}"""\nPARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "</s>"\nPARAMETER num_ctx 256\n'
    )
    assert template == "{{ .Content }}" and stops == ["<|im_end|>", "</s>"]
    assert served.covered_by_stops({2: "<|im_end|>"}, stops) == [2]
    assert served.covered_by_stops({2: "<|im_end|>"}, ["</s>", "<|endoftext|>"]) == []


def test_ending_share_counts_the_first_end_token(served):
    outs = [{"continuation": [5, 6, 2]}, {"continuation": [5, 0, 2]}, {"continuation": [7] * 20}]
    e = served.ending("merged", outs, {0})
    assert e == {
        "ended_with_end_of_turn": "1/3",
        "share": 0.3333,
        "ended_with_another_stop": 1,
        "tokens_run": [3, 3, 20],
    }


def test_plain_text_data_has_no_chat_prompt_to_check(tiny_model, tmp_path):
    from helpers import export_recipe

    from launcher.deliver.messages import served_line
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of plain text"}) + "\n" for i in range(20)))
    sp = ServedPrompt(
        load_recipe(export_recipe(tmp_path / "r.yaml", tiny_model, tmp_path / "run", data=str(data))), tiny_model, 3
    )
    assert not sp.chat and "without a chat template" in sp.report["not_applicable"]
    assert served_line({"served_prompt": sp.report}).startswith("served prompt: not checked (the data is text")


def test_served_line_names_what_was_checked():
    from launcher.deliver.messages import served_line

    ok = {"ok": True, "runtimes": {}, "stops": {}}
    assert (
        served_line(
            {
                "served_prompt": dict(ok, checked=["vLLM", "llama-server", "llama.cpp", "Ollama"]),
                "outputs": {"gguf": {}},
            }
        )
        == "served prompt = trained prompt (vLLM, llama-server, llama.cpp, Ollama)"
    )
    assert (
        served_line({"served_prompt": dict(ok, checked=["vLLM"]), "outputs": {"adapter": {}}})
        == "served prompt = trained prompt (vLLM); not checked: llama-server, llama.cpp, Ollama (no GGUF in this "
        "export)"
    )
    # Qwen3 trained without reasoning: served with thinking off, which llama-cpp-python's chat completion cannot
    switched = dict(ok, checked=["vLLM", "llama-server", "Ollama"], chat_template_kwargs={"enable_thinking": False})
    assert served_line({"served_prompt": switched, "outputs": {"gguf": {}}}) == (
        'served prompt = trained prompt (vLLM, llama-server, Ollama) served with {"enable_thinking": false}; not '
        "checked: llama.cpp (llama-cpp-python's chat completion takes no chat-template switches)"
    )
    bad = {
        "ok": False,
        "checked": [],
        "runtimes": {"ollama": {"runtime": "Ollama (the Modelfile's TEMPLATE)", "ok": False}},
        "stops": {},
    }
    assert served_line({"served_prompt": bad}) == "served prompt != trained prompt: Ollama (the Modelfile's TEMPLATE)"


# ---------------------------------------------------------------------------------------------
# Ollama's Go template, rendered as Ollama renders it


def test_ftruns_ollama_template_renders_as_the_jinja_template(served, tiny_model):
    from launcher.data.dataset import load_examples
    from launcher.deliver import go_template
    from launcher.deliver.serving import modelfile
    from launcher.deliver.served_prompt import modelfile_parts

    tok = _tokenizer(tiny_model)
    template, _ = modelfile_parts(modelfile("x.gguf", tok, load_examples(str(TINY_DATA))[:3], 256, {0})["text"])
    for p in served.prompts:
        assert go_template.render(template, p["messages"]) == tok.apply_chat_template(
            p["messages"], tokenize=False, add_generation_prompt=True
        )


def test_go_template_trims_collates_and_refuses_what_it_cannot_render():
    from launcher.deliver import go_template

    # Ollama's chatml.gotmpl shape: trim markers, .System, a range with an if/else if chain
    tmpl = (
        "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
        '{{- range .Messages }}{{- if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
        "{{ end }}{{- end }}<|im_start|>assistant\n"
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "there"},
    ]
    assert go_template.render(tmpl, msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\n\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    assert go_template.render("a  {{- .Missing -}}  b{{ if not .System }}!{{ end }}", []) == "ab!"
    for bad in ('{{ template "x" }}', "{{ json .Tools }}", "{{ if .System }}open"):
        with pytest.raises(go_template.Unsupported):
            go_template.render(bad, msgs)


# ---------------------------------------------------------------------------------------------
# The generation prompt against what the training sequence holds in front of the answer


def _served_for(tmp_path, family: str, records: list, template=None, held=None):
    """ServedPrompt of a tokenizer of `family` (its real template, or `template`) trained on `records`, the
    first three (or `held`) held out as eval.data."""
    from chat_templates import build_tokenizer, write_jsonl
    from helpers import export_recipe

    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe_loading import load_recipe

    folder = build_tokenizer(tmp_path / "tok", family, template=template)
    data = write_jsonl(tmp_path / "train.jsonl", records)
    ev = write_jsonl(tmp_path / "held.jsonl", held if held is not None else records[:3])
    recipe = load_recipe(
        export_recipe(tmp_path / "r.yaml", folder, tmp_path / "run", data=str(data), eval={"data": str(ev)})
    )
    return ServedPrompt(recipe, folder, 3), folder


def _chat(question: str, answer: str, system: bool = True) -> dict:
    return {
        "messages": ([{"role": "system", "content": "Be brief."}] if system else [])
        + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    }


QUESTIONS = ["The capital of France?", "What is 2 + 2?", "Reverse the word lamp."]


def test_qwen3_trained_on_answers_without_reasoning_is_served_with_thinking_off(tmp_path):
    """Qwen3's template writes an empty think block in front of an answer without reasoning, and so does its
    generation prompt only with enable_thinking=false: that switch serves the trained prompt, and a runtime left
    at the default (thinking on) would serve a prompt that ends before the think block."""
    from transformers import AutoTokenizer

    from launcher.deliver.messages import ExportError

    sp, folder = _served_for(tmp_path, "qwen3", [_chat(q, a) for q, a in zip(QUESTIONS, ["Paris.", "4.", "pmal."])])
    assert sp.kwargs == {"enable_thinking": False} == sp.report["chat_template_kwargs"]
    for p in sp.prompts:
        assert sp.tokenizer.decode(p["ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    entry = sp.compare_transformers("vllm_merged", AutoTokenizer.from_pretrained(str(folder)), "vLLM")
    assert entry["ok"] and entry["chat_template_kwargs"] == {"enable_thinking": False}
    sp.kwargs = {}  # a runtime at the template's default
    with pytest.raises(ExportError) as err:
        sp.compare_transformers("vllm_default", AutoTokenizer.from_pretrained(str(folder)), "vLLM (thinking on)")
    assert "it has the end of the prompt where training had" in err.value.message
    assert "'<think>'" in err.value.message


def test_qwen3_trained_on_reasoning_is_served_with_thinking_on(tmp_path):
    """The other direction: answers that reason (a think block in the answer) were trained after the bare
    assistant header, which the default generation prompt is; enable_thinking=false would serve an empty think
    block the model never saw in front of its answers."""
    from transformers import AutoTokenizer

    from launcher.deliver.messages import ExportError

    answers = [
        "<think>\nThe capital of France is Paris.\n</think>\n\nParis.",
        "<think>\nIt is 4.\n</think>\n\n4.",
        "<think>\nReverse it.\n</think>\n\npmal.",
    ]
    sp, folder = _served_for(tmp_path, "qwen3", [_chat(q, a) for q, a in zip(QUESTIONS, answers)])
    assert sp.kwargs == {} and "chat_template_kwargs" not in sp.report
    for p in sp.prompts:
        assert sp.tokenizer.decode(p["ids"]).endswith("<|im_start|>assistant\n")
        assert sp.token(p["answer_first"]) == "<think>"
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert sp.compare_transformers("vllm_merged", tok, "vLLM")["ok"]
    sp.kwargs = {"enable_thinking": False}
    with pytest.raises(ExportError) as err:
        sp.compare_transformers("vllm_no_thinking", tok, "vLLM (enable_thinking=false)")
    msg = err.value.message
    assert "it has " in msg and "'<think>' where training had the answer, whose first token was" in msg


def test_a_generation_prompt_ending_in_a_space_that_the_answer_swallows_in_training_is_refused(tmp_path):
    """`ASSISTANT: ` then `Paris.`: in the training sequence the space belongs to the answer's first token
    (` Paris`), so the model never saw a prompt ending in a lone space; the served prompt does."""
    from transformers import AutoTokenizer

    from launcher.deliver.messages import ExportError

    vicuna = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
        "{% elif m['role'] == 'user' %}USER: {{ m['content'] }}\n"
        "{% else %}ASSISTANT: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
    )
    sp, folder = _served_for(
        tmp_path, "base", [_chat(q, a) for q, a in zip(QUESTIONS, ["Paris.", "It is 4.", "pmal."])], template=vicuna
    )
    first = sp.prompts[0]
    assert first["answer_first_merged"] and sp.token(first["answer_first"]).startswith("ĠPar")
    with pytest.raises(ExportError) as err:
        sp.compare_transformers("vllm_merged", AutoTokenizer.from_pretrained(str(folder)), "vLLM")
    msg = err.value.message
    assert "it has " in msg and "'Ġ' where training had the answer, whose first token was" in msg
    assert f"{sp.token(first['answer_first'])!r} (it begins with the end of the served prompt)" in msg
    assert sp.report["answers_whose_first_token_holds_the_prompts_end"] >= 1


def test_a_header_written_otherwise_for_the_last_turn_is_refused(tmp_path):
    """A template that writes the last assistant turn under another header than its generation prompt: the
    training sequence has that header in front of every answer, the served prompt the other one."""
    from transformers import AutoTokenizer

    from chat_templates import FAMILIES
    from launcher.deliver.messages import ExportError

    last_header = FAMILIES["qwen3"].template.replace(
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' +",
        "{{- '<|im_start|>' + (message.role if not loop.last else 'assistant final') + '\\n<think>\\n' +",
    )
    assert last_header != FAMILIES["qwen3"].template
    multi = [
        {
            "messages": [
                {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        }
    ] * 3
    sp, folder = _served_for(tmp_path, "qwen3", multi, template=last_header)
    with pytest.raises(ExportError) as err:
        sp.compare_transformers("vllm_merged", AutoTokenizer.from_pretrained(str(folder)), "vLLM")
    assert "where training had" in err.value.message and "(prompt 1 of" in err.value.message
    # the header: training continued `assistant` with ` final`, the generation prompt with a newline
    assert err.value.message.split("where training had")[0].endswith("it has 201 'Ċ' ")
    assert "<|im_start|>assistant'" in err.value.message


def test_every_shape_in_the_data_is_checked_and_ollamas_merge_drops_the_template(tmp_path, tiny_model):
    """Two user turns in a row, a system turn in the middle, a tool call and its result: one prompt of each shape
    is checked (the report counts them). Ollama merges consecutive messages of one role, so a Go template ftrun
    derives would render the `user,user` prompt otherwise than the model's template: the Modelfile then carries
    no TEMPLATE, and Ollama 0.30+ renders the GGUF's own template."""
    from transformers import AutoTokenizer

    from launcher.deliver.serving import modelfile

    call = {"type": "function", "function": {"name": "lights", "arguments": {"room": "kitchen"}}}
    records = [_chat(q, a, system=False) for q, a in zip(QUESTIONS, ["Paris.", "4.", "pmal."])] + [
        {
            "messages": [
                {"role": "user", "content": "Hi."},
                {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Lights on in the kitchen, please."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "ok"},
                {"role": "assistant", "content": "Done."},
            ]
        },
    ]
    sp, folder = _served_for(tmp_path, "qwen3", records)
    shapes = sp.report["shapes"]
    assert {"user,user", "system,user,assistant,system,user", "user,assistant(tool call),tool"} <= set(shapes["each"])
    assert shapes["found"] == shapes["checked"] == 4
    tok = AutoTokenizer.from_pretrained(str(folder))
    n = len(sp.prompts)
    assert sp.compare_transformers("vllm_merged", tok, "vLLM")["identical"] == f"{n}/{n}"

    chatml = AutoTokenizer.from_pretrained(str(tiny_model))  # a template uniform per role: ftrun derives a TEMPLATE
    plain = [[{"role": "user", "content": "The capital of France?"}]]
    assert 'TEMPLATE """' in modelfile("x.gguf", chatml, plain, 256, {0})["text"]
    merged = modelfile("x.gguf", chatml, plain + [records[3]["messages"][:2]], 256, {0})
    assert 'TEMPLATE """' not in merged["text"] and "Ollama merges consecutive messages of one role" in merged["text"]
    assert merged["check"]["differs_for"] == ["user,user"] and merged["check"]["ollama"]["path"] == "native"
    assert "renders the GGUF's own chat template" in merged["text"]  # no index entry is near this ChatML template


class _Vocab:
    """The GGUF's vocabulary as export.py reads it (llamacpp_runtime.Vocabulary), from the same tokenizer."""

    def __init__(self, tok):
        self.tok, self.llm = tok, type("Llm", (), {"metadata": {"tokenizer.chat_template": tok.chat_template}})

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self.tok(text, add_special_tokens=add_special)["input_ids"]


def test_chatml_data_with_two_user_turns_is_ollama_identical_only_as_served_with_go_templates_off(tmp_path):
    """Qwen2's ChatML template is in Ollama's index: `ollama create` stores its chatml Go template, which merges
    the two user turns (and writes no default system turn). Ollama as installed is not counted as identical; the
    Modelfile and SERVING.md ask for OLLAMA_GO_TEMPLATE=0, under which Ollama hands the messages to llama-server,
    whose token comparison is then Ollama's."""
    from test_ollama_template import QWEN2
    from transformers import AutoTokenizer

    from launcher.deliver import go_template
    from launcher.deliver.export_serving import _served_by_ollama
    from launcher.deliver.messages import ExportError, served_line
    from launcher.deliver.serving import modelfile

    # a system turn in each conversation, so that Qwen2's default system turn is not what differs
    two = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi."},
            {"role": "user", "content": "The capital of France?"},
            {"role": "assistant", "content": "P."},
        ]
    }
    records = [_chat(q, a) for q, a in zip(QUESTIONS, ["Paris.", "4.", "pmal."])] + [two]
    sp, folder = _served_for(tmp_path, "qwen3", records, template=QWEN2)
    tok = AutoTokenizer.from_pretrained(str(folder))
    mf = modelfile("x.gguf", tok, [p["messages"] for p in sp.prompts], 256, {0}, architecture="qwen2")
    default = mf["check"]["ollama"]
    assert default["path"] == "go" and default["serve_with"] == {"OLLAMA_GO_TEMPLATE": "0"}
    assert default["differs_for"] == ["system,user,user"] and "autodetected chatml" in default["template_from"]
    assert default["identical"] == f"{len(sp.prompts) - 1}/{len(sp.prompts)}"
    assert 'TEMPLATE """' not in mf["text"] and "OLLAMA_GO_TEMPLATE=0" in mf["text"]

    n = len(sp.prompts)
    llama_server = [sp.render_ids(tok, p, {}) for p in sp.prompts]  # the GGUF's own template, one message a turn
    sp.compare("llama_server", "llama-server", llama_server)
    sp.checked("llama-server")
    gguf = {"architecture": "qwen2", "modelfile_template_check": mf["check"]}
    _served_by_ollama(sp, gguf, None, _Vocab(tok))
    entry = sp.report["runtimes"]["ollama"]
    assert entry["ok"] and entry["identical"] == f"{n}/{n}" and entry["serve_with"] == {"OLLAMA_GO_TEMPLATE": "0"}
    installed = entry["as_installed"]
    assert installed["identical"] == f"{n - 1}/{n}" and installed["first_difference"]["prompt"] == n - 1
    assert "Hi.\n\nThe capital" in go_template.render(ollama_template_text(), sp.prompts[-1]["messages"])
    assert "Ollama" in sp.report["checked"] and sp.report["ok"]
    line = served_line({"served_prompt": sp.report, "outputs": {"gguf": {}}})
    assert "Ollama with OLLAMA_GO_TEMPLATE=0" in line

    # had SERVING.md not asked for the setting, Ollama as installed is what is served: the export fails
    sp.report["runtimes"].pop("ollama")
    sp.report["checked"].remove("Ollama")
    with pytest.raises(ExportError) as err:
        _served_by_ollama(sp, {"architecture": "qwen2", "modelfile_template_check": {}}, None, _Vocab(tok))
    assert "Ollama (Ollama's autodetected chatml template" in err.value.message and "Ollama" not in sp.report["checked"]


def test_ollama_is_not_counted_without_a_token_comparison(tmp_path):
    """No llama-server comparison to stand for Ollama's, or a template ftrun does not model: Ollama is named as
    not checked, with the reason, in export.json and the export line."""
    from test_ollama_template import QWEN2
    from transformers import AutoTokenizer

    from launcher.deliver.export_serving import _served_by_ollama
    from launcher.deliver.messages import served_line

    sp, folder = _served_for(tmp_path, "qwen3", [_chat(q, "Paris.") for q in QUESTIONS], template=QWEN2)
    tok = AutoTokenizer.from_pretrained(str(folder))
    _served_by_ollama(sp, {"architecture": "gemma4", "modelfile_template_check": {}}, None, _Vocab(tok))
    entry = sp.report["runtimes"]["ollama"]
    assert (
        entry["identical"] is None and "own renderer" in entry["not_checked"] and "Ollama" not in sp.report["checked"]
    )
    sp.compare_transformers("vllm_merged", tok, "vLLM")
    line = served_line({"served_prompt": sp.report, "outputs": {"gguf": {}}})
    assert line.startswith("served prompt = trained prompt (vLLM)") and "Ollama (Ollama renders gemma4" in line


def ollama_template_text() -> str:
    from launcher.deliver.ollama_template import _data

    return _data()["templates"]["chatml"]["template"]
