"""A JSON parse error in words (launcher/errors.py json_problem): its place said once, a broken string placed where it
starts (issue 33: "Invalid control character at at column 362")."""

from __future__ import annotations

import json

import pytest

from launcher.errors import json_problem


def _problem(text: str, lines: bool = True) -> str:
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    return json_problem(err.value, lines=lines)


@pytest.mark.parametrize(
    "text, start, says",
    [
        ('{"messages": [{"role": "user", "content": "a\tb"}]}', 43, "holds a tab (column 45) as a raw character"),
        ('{"a": "x\ny"}', 7, "holds a line break (column 9)"),
        ('{"a": "x\ry"}', 7, "holds a carriage return (column 9)"),
        ('{"a": "x\x01y"}', 7, "holds the control character U+0001 (column 9)"),
    ],
)
def test_a_raw_control_character_names_where_its_string_starts_once(text, start, says):
    problem = _problem(text)
    assert says in problem and "at at" not in problem and problem.count(" at ") == 1, problem
    assert f"the string that starts at line 1, column {start} " in problem, problem
    assert "write it as \\" in problem  # the escape JSON wants instead


def test_the_string_is_found_past_escaped_quotes_and_on_its_own_line():
    text = '{"q": "say \\"hi\\"",\n "a": "ok",\n  "b": "x\ty"}'
    problem = _problem(text)
    assert problem.startswith("the string that starts at line 3, column 8 holds a tab (column 10)"), problem
    assert _problem(text, lines=False).startswith("the string that starts at column 8 holds a tab"), problem


def test_an_unterminated_string_is_placed_where_it_starts():
    problem = _problem('{"a": "never closed}')
    assert problem == "the string that starts at line 1, column 7 never ends (its closing quote is missing)"
    assert "at at" not in _problem('[1, "x', lines=False) and "column 5" in _problem('[1, "x', lines=False)


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"a": 1,}', "Expecting property name enclosed in double quotes at line 1, column 9"),
        ('{"a" 1}', "Expecting ':' delimiter at line 1, column 6"),
        ("{}\n{}", "Extra data at line 2, column 1"),
    ],
)
def test_other_problems_keep_pythons_words_with_one_place(text, says):
    problem = _problem(text)
    assert problem == says and "at at" not in problem
