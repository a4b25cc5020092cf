"""Data checks name the line and the problem; token statistics use the model's chat template."""

import json

import pytest

from launcher.data import compute_stats, example_lengths, load_examples, smoke_sample
from launcher.errors import DataError

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return p


@pytest.mark.parametrize(
    "line, expected",
    [
        ("{not json", "line 2: not valid JSON"),
        ({"msgs": []}, "line 2: no 'messages' key (keys present: msgs)"),
        ({"messages": []}, "line 2: 'messages' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "line 2: messages[0].role is 'bot'; allowed: system, user, assistant"),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
         "line 2: messages[0] (user) has empty content"),
        ({"messages": [{"role": "user", "content": "q"}]}, "line 2: no assistant turn"),
        ({"messages": [{"role": "user", "content": 3}]}, "line 2: messages[0].content must be a string, found int"),
        ([1, 2], "line 2: expected a JSON object, found list"),
    ],
)
def test_bad_line_is_named(tmp_path, line, expected):
    with pytest.raises(DataError) as err:
        load_examples(_write(tmp_path, [GOOD, line, GOOD]))
    assert expected in err.value.message
    assert "1 bad line" in err.value.message and err.value.fix


def test_many_bad_lines_are_counted(tmp_path):
    with pytest.raises(DataError, match=r"has 20 bad lines:(.|\n)*and 12 more"):
        load_examples(_write(tmp_path, ["{"] * 20))


def test_missing_file_names_the_recipe_key(tmp_path):
    with pytest.raises(DataError, match=r"recipe key 'data'"):
        load_examples(tmp_path / "missing.jsonl")


def test_blank_lines_are_skipped(tmp_path):
    assert len(load_examples(_write(tmp_path, [GOOD, "", GOOD]))) == 2


def test_token_stats_use_the_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ex = [GOOD["messages"], [{"role": "system", "content": "be brief"}] + GOOD["messages"]]
    lengths, source = example_lengths(ex, str(tiny_model))
    assert source == "tokenizer"
    expected = [len(tok.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in ex]
    assert lengths == expected
    stats = compute_stats(ex, lengths, source, max_length=expected[0])
    assert stats.over_max_length == 1 and stats.total_tokens == 2 * expected[0] and stats.max_tokens == expected[1]


def test_unknown_model_falls_back_to_characters():
    lengths, source = example_lengths([GOOD["messages"]], "nobody/no-such-model-xyz")
    assert source == "characters" and lengths[0] > 0


def test_smoke_sample_includes_the_longest():
    lengths = list(range(1000))
    idx = smoke_sample(lengths, 0.01, 20, seed=1)
    assert len(idx) == 20 and 999 in idx
    assert smoke_sample(lengths, 0.01, 20, seed=1) == idx  # seeded
    assert len(smoke_sample(lengths, 0.5, 2, seed=1)) == 500


def test_smoke_sample_holds_one_batch_of_the_longest_and_a_random_rest():
    lengths = list(range(1000))
    idx = smoke_sample(lengths, 0.2, 20, seed=3, longest=8)
    assert len(idx) == 200 and set(range(992, 1000)) <= set(idx)
    rest = [lengths[i] for i in idx if i < 992]
    assert 400 < sum(rest) / len(rest) < 600  # the data's usual lengths (mean 499.5), not the long tail
