"""The task evaluation's metric: chosen from the references with its reason, scored as stated (exact labels, JSON
fields, chrF from sacrebleu), and the examples and few-shot prompts it scores."""

from types import SimpleNamespace

import pytest

from launcher.data import task_examples, task_metrics

LABELS = ["account", "billing", "bug", "feature"]


def test_short_labels_are_scored_by_exact_match_after_normalisation():
    refs = [LABELS[i % 4] for i in range(20)]
    metric, why = task_metrics.choose(refs)
    assert metric == "exact" and "4 distinct short labels" in why
    answers = [r.upper() + "  " if i % 2 else r for i, r in enumerate(refs)]
    answers[0] = "bug"  # one wrong of 20
    s = task_metrics.score("exact", answers, refs)
    assert s["score"] == pytest.approx(19 / 20) and s["per_example"][0] == 0.0


def test_json_references_report_parse_rate_keys_and_field_match():
    refs = ['{"name": "Ada", "city": "Paris"}', '{"name": "Bo", "city": "Lima"}']
    metric, why = task_metrics.choose(refs)
    assert metric == "json" and "JSON objects" in why
    answers = ['```json\n{"name": "Ada", "city": "Rome"}\n```', "not json"]
    s = task_metrics.score("json", answers, refs)
    assert s["details"]["parses"] == 0.5 and s["details"]["has_keys"] == 0.5
    assert s["score"] == s["details"]["field_match"] == pytest.approx(0.25)


def test_free_text_is_scored_by_chrf_from_sacrebleu():
    from sacrebleu.metrics import CHRF

    refs = [f"The capital of country number {i} is a city with a long and old history." for i in range(12)]
    metric, _ = task_metrics.choose(refs)
    assert metric == "text"
    answers = [r if i % 3 else "Something else entirely." for i, r in enumerate(refs)]
    s = task_metrics.score("text", answers, refs)
    assert s["score"] == pytest.approx(CHRF().corpus_score(answers, [refs]).score / 100)
    assert s["details"]["exact"] == pytest.approx(8 / 12) and 0 < s["score"] < 1


def test_the_verdict_rule_is_the_articles_one_in_five():
    assert task_metrics.fine_tune_pays(0.6) and task_metrics.fine_tune_pays(0.79)
    assert not task_metrics.fine_tune_pays(0.8) and not task_metrics.fine_tune_pays(0.92)


def _chat(question, answer, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]
    return {"messages": msgs}


def test_shots_come_before_the_prompt_as_earlier_turns_with_the_system_turn_first():
    prompt = task_examples.prompt_and_reference(_chat("Ticket 1: login", "account", system="Sort tickets."))
    shots = [task_examples.prompt_and_reference(_chat(f"Ticket {i}: x", LABELS[i])) for i in range(2)]
    msgs = task_examples.with_shots(prompt, shots)["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == LABELS[0] and msgs[-1]["content"] == "Ticket 1: login"


def _settings(**kw):
    return SimpleNamespace(**{"examples": 200, "metric": "auto", "shots": 3, "max_new_tokens": None, **kw})


def test_the_task_is_drawn_from_held_out_examples_and_refuses_what_it_cannot_score():
    examples = [_chat(f"Ticket {i}", LABELS[i % 4]) for i in range(60)]
    task = task_examples.build_task(examples, list(range(40, 60)), list(range(40)), _settings(), seed=0)
    assert task["metric"] == "exact" and len(task["prompts"]) == 20
    assert {p["index"] for p in task["prompts"]} <= set(range(40, 60)) and len(task["shots"]) == 3
    assert all(s["index"] < 40 for s in task["shots"])
    few = task_examples.build_task(examples, list(range(55, 60)), list(range(55)), _settings(), seed=0)
    assert few["too_few"] == 5 and "eval.fraction" in few["fix"]
    text = [{"text": "just text"} for _ in range(30)]
    assert (
        "no example has an answer"
        in task_examples.build_task(text, list(range(20, 30)), list(range(20)), _settings(), seed=0)["not_applicable"]
    )
    assert (
        "holds no examples out"
        in task_examples.build_task(examples, [], list(range(60)), _settings(), seed=0)["not_applicable"]
    )
