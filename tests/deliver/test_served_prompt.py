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
    from launcher.recipe import load_recipe

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
    assert rep["end_of_turn"] == {"ids": [2], "tokens": ["<|im_end|>"], "answers_followed_by_nothing": 0,
                                  "outside_the_loss": 0, "answers_not_written_verbatim": 0}
    for p in served.prompts:  # the prompt ends with the generation prompt, as training tokenized it
        assert served.tokenizer.decode(p["ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_the_exported_template_renders_the_trained_prompt(served, tiny_model):
    entry = served.compare_transformers("vllm_merged", _tokenizer(tiny_model), "vLLM (the merged folder)")
    assert entry["ok"] and entry["identical"] == "3/3" and served.report["checked"] == ["vLLM"]
    stops = served.check_stops("vllm_merged", "vLLM", [2, 0], fix="-")
    assert stops["ok"]


def test_a_template_that_drops_the_end_of_turn_token_fails_with_the_first_differing_token(served, tiny_model):
    from launcher.deliver.messages import ExportError

    bad = _tokenizer(tiny_model, lambda t: t.replace(*DROP_END))
    with pytest.raises(ExportError) as err:
        served.compare_transformers("vllm_adapter", bad, "vLLM (the adapter)")
    msg = err.value.message
    assert "vLLM (the adapter) serves another prompt than the training saw" in msg
    assert "where training had 2 '<|im_end|>'" in msg and "identical 0/3" in msg
    entry = served.report["runtimes"]["vllm_adapter"]
    d = entry["first_difference"]
    assert not entry["ok"] and not served.report["ok"]
    assert d["trained"] == {"id": 2, "token": "<|im_end|>"} and d["served"]["token"] == "Ċ" and d["context"]
    assert served.tokenizer.decode(served.prompts[d["prompt"]]["ids"][:d["position"]]).endswith(d["context"])


@pytest.mark.parametrize("after, taught", [("'\\n'", ["Ċ"]), ("''", [])])
def test_a_training_template_without_an_end_of_turn_teaches_no_stop(tiny_model, tmp_path, after, taught):
    """Trained on a template that closes the answer with a bare newline (or with nothing): the newline is what the
    training taught to end a turn, which no runtime stops on; with nothing after the answer, there is no end at
    all. Either fails the stop check."""
    from helpers import export_recipe

    from launcher.deliver.messages import ExportError
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe import load_recipe

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    jinja = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(jinja.replace(DROP_END[0], f"message['content'] + {after}"))
    recipe = load_recipe(export_recipe(tmp_path / "r.yaml", model, tmp_path / "run"))
    sp = ServedPrompt(recipe, model, 3)
    assert sp.report["end_of_turn"]["tokens"] == taught
    assert sp.report["end_of_turn"]["answers_followed_by_nothing"] == (0 if taught else 3)
    with pytest.raises(ExportError, match="does not stop on the token the training taught to end a turn \\(201 'Ċ'\\)"
                       if taught else "the training taught no token to end a turn"):
        sp.check_stops("vllm_merged", "vLLM", [0, 2], fix="-")


def test_stops_that_miss_the_trained_end_of_turn_fail(served):
    from launcher.deliver.messages import ExportError

    # a base model's generation_config.json that stops on <|endoftext|> only (LLaMA-Factory #7454)
    with pytest.raises(ExportError, match=r"does not stop on the token the training taught to end a turn \(2 '<\|im_end\|>'\)"):
        served.check_stops("vllm_merged", "vLLM (the merged folder)", [0], fix="add it")
    assert served.report["stops"]["vllm_merged"]["ok"] is False


def test_modelfile_stops_are_matched_as_ollama_matches_them(served):
    from launcher.deliver.served_prompt import modelfile_parts

    template, stops = modelfile_parts('FROM ./x.gguf\nTEMPLATE """{{ .Content }}"""\nPARAMETER stop "<|im_end|>"\n'
                                      'PARAMETER stop "</s>"\nPARAMETER num_ctx 256\n')
    assert template == "{{ .Content }}" and stops == ["<|im_end|>", "</s>"]
    assert served.covered_by_stops({2: "<|im_end|>"}, stops) == [2]
    assert served.covered_by_stops({2: "<|im_end|>"}, ["</s>", "<|endoftext|>"]) == []


def test_ending_share_counts_the_first_end_token(served):
    outs = [{"continuation": [5, 6, 2]}, {"continuation": [5, 0, 2]}, {"continuation": [7] * 20}]
    e = served.ending("merged", outs, {0})
    assert e == {"ended_with_end_of_turn": "1/3", "share": 0.3333, "ended_with_another_stop": 1,
                 "tokens_run": [3, 3, 20]}


def test_plain_text_data_has_no_chat_prompt_to_check(tiny_model, tmp_path):
    from helpers import export_recipe

    from launcher.deliver.messages import served_line
    from launcher.deliver.served_prompt import ServedPrompt
    from launcher.recipe import load_recipe

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of plain text"}) + "\n" for i in range(20)))
    sp = ServedPrompt(load_recipe(export_recipe(tmp_path / "r.yaml", tiny_model, tmp_path / "run", data=str(data))),
                      tiny_model, 3)
    assert not sp.chat and "without a chat template" in sp.report["not_applicable"]
    assert served_line({"served_prompt": sp.report}).startswith("served prompt: not checked (the data is text")


def test_served_line_names_what_was_checked():
    from launcher.deliver.messages import served_line

    ok = {"ok": True, "runtimes": {}, "stops": {}}
    assert served_line({"served_prompt": dict(ok, checked=["vLLM", "llama.cpp", "Ollama"]), "outputs": {"gguf": {}}}) \
        == "served prompt = trained prompt (vLLM, llama.cpp, Ollama)"
    assert served_line({"served_prompt": dict(ok, checked=["vLLM"]), "outputs": {"adapter": {}}}) \
        == "served prompt = trained prompt (vLLM); not checked: llama.cpp, Ollama (no GGUF in this export)"
    bad = {"ok": False, "checked": [], "runtimes": {"ollama": {"runtime": "Ollama (the Modelfile's TEMPLATE)", "ok": False}},
           "stops": {}}
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
            p["messages"], tokenize=False, add_generation_prompt=True)


def test_go_template_trims_collates_and_refuses_what_it_cannot_render():
    from launcher.deliver import go_template

    # Ollama's chatml.gotmpl shape: trim markers, .System, a range with an if/else if chain
    tmpl = ('{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
            '{{- range .Messages }}{{- if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
            '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
            '{{ end }}{{- end }}<|im_start|>assistant\n')
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "user", "content": "there"}]
    assert go_template.render(tmpl, msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\n\nthere"
                                              "<|im_end|>\n<|im_start|>assistant\n")
    assert go_template.render("a  {{- .Missing -}}  b{{ if not .System }}!{{ end }}", []) == "ab!"
    for bad in ("{{ template \"x\" }}", "{{ json .Tools }}", "{{ if .System }}open"):
        with pytest.raises(go_template.Unsupported):
            go_template.render(bad, msgs)
