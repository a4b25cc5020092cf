"""Which template Ollama renders a chat with (launcher/deliver/ollama_template.py): its detection by edit distance
against its template index, its choice between a Go template and the GGUF's own, and its collate."""

from __future__ import annotations

import random

import pytest

from launcher.deliver import go_template, ollama_template

# Qwen2-Instruct's ChatML template, as Ollama's template/testdata/templates.jsonl holds it (a `chatml` example)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system"
    "\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>"
    "assistant\n' }}{% endif %}"
)


def _levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_the_distance_is_levenshtein_over_code_points_below_the_limit():
    rng = random.Random(0)
    for _ in range(400):
        a, b = ("".join(rng.choice("ab\u00e9\U0001f600") for _ in range(rng.randint(0, 25))) for _ in range(2))
        limit = rng.randint(1, 15)
        d = _levenshtein(a, b)
        assert ollama_template.distance_below(a, b, limit) == (d if d < limit else None)
    assert ollama_template.distance_below("\u00e9", "e", 5) == 1  # one code point, as Go's []rune, not two bytes
    with pytest.raises(ValueError):
        ollama_template.distance_below("x" * 65536, "x", 100)


def test_every_index_entry_is_detected_as_its_own_name():
    """Ollama's TestNamed (template/template_test.go) over testdata/templates.jsonl, which the index holds."""
    data = ollama_template._data()
    assert data["source"]["commit"].startswith("fb30760") and data["threshold"] == 100 and len(data["index"]) == 37
    for k, entry in enumerate(data["index"]):
        found = ollama_template.named(entry["template"])
        assert found["name"] == entry["name"] and found["distance"] == 0 and found["template"], k


def test_detection_takes_the_nearest_entry_under_100_and_the_first_of_equals():
    found = ollama_template.named(QWEN2)
    assert (found["name"], found["distance"], found["index_entry"]) == ("chatml", 0, 7)
    assert found["stop"] == ["<|im_start|>", "<|im_end|>"]
    near = ollama_template.named(QWEN2.replace("helpful", "kind"))  # 7 edits from entry 7, 8 from entry 8
    assert (near["index_entry"], near["distance"]) == (7, 7)
    assert ollama_template.named(QWEN2 + "{# " + "x" * 100 + " #}") is None  # 106 edits from every entry


def test_ollamas_choice_between_a_go_template_and_the_ggufs_own():
    from chat_templates import FAMILIES

    choose = ollama_template.choose
    chatml = ollama_template._data()["templates"]["chatml"]["template"]
    assert choose(QWEN2, None, "qwen2") == dict(choose(QWEN2, None, "qwen2"), path="go", template=chatml)
    assert choose(QWEN2, None, "qwen2", go_template_env=False)["path"] == "native"
    assert choose(QWEN2, None, "qwen2", go_template_env=True)["path"] == "go"
    qwen3 = FAMILIES["qwen3"].template  # tools and thinking, no index entry near it
    assert choose(qwen3, None, "qwen3")["path"] == "native" and "no Go template" in choose(qwen3, None, "qwen3")["why"]
    mine = choose(QWEN2, "{{ range .Messages }}{{ .Content }}{{ end }}", "qwen2")
    assert mine["path"] == "go" and mine["from"] == "the Modelfile's TEMPLATE"
    # a GGUF template offering tools against a Go template without: Ollama prefers the GGUF's (images.go 793)
    tools = QWEN2 + "{# tool_call #}"
    assert choose(tools, "{{ range .Messages }}{{ .Content }}{{ end }}", "qwen2")["path"] == "native"
    assert choose(tools, "{{ range .Messages }}{{ .Content }}{{ end }}", "qwen2", go_template_env=True)["path"] == "go"
    assert choose(QWEN2, None, "gemma4")["path"] == "not modelled"
    assert choose(QWEN2, "{{ if .Tools }}{{ .Tools }}{{ end }}", "qwen2")["path"] == "not modelled"


def test_collate_merges_one_roles_consecutive_messages_but_not_tool_results():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    system, collated = go_template.collate(msgs)
    assert system == "" and [(m["Role"], m["Content"]) for m in collated] == [
        ("user", "a\n\nb"),
        ("tool", "1"),
        ("tool", "2"),
    ]
    chatml = ollama_template._data()["templates"]["chatml"]["template"]
    assert go_template.render(chatml, msgs[:2]) == "<|im_start|>user\na\n\nb<|im_end|>\n<|im_start|>assistant\n"
