"""Reward hacking not read as success: on single-word or numeric references `auto` scores exact match, and under
another metric (chrF) exact match is shown beside it in task_eval.json and the summary, so "better on the task"
is never said while exact stayed; a comparison with no variation is said as such, not as "±0-point noise"."""

from __future__ import annotations

import json

from launcher.data import task_metrics, task_verdict
from launcher.run import task_eval_view
from launcher.worker import task_eval

SUMS = [(a, 2 * a + 3) for a in range(27)]  # 27 sums, 27 distinct: too many for labels


def _task(metric: str, reason: str, parent: bool = True) -> dict:
    prompts = [
        {"index": i, "messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "reference": str(a + b)}
        for i, (a, b) in enumerate(SUMS)
    ]
    task = {"metric": metric, "metric_reason": reason, "prompts": prompts, "shots": [], "max_new_tokens": 8}
    if parent:
        task["starting_point"] = "the base model with the adapter of sft (init_from)"
    return task


def _scored(task: dict, answers: list[str]) -> dict:
    s = task_metrics.score(task["metric"], answers, [p["reference"] for p in task["prompts"]])
    return {**s, "examples": len(answers), "seconds": 1.0, "new_tokens": 27}


def test_auto_scores_single_numbers_by_exact_match_with_why():
    references = [str(a + b) for a, b in SUMS]
    metric, why = task_metrics.choose(references)
    assert metric == "exact", why
    assert why.startswith("the 27 references are single numbers (27 distinct): right or wrong") and "chrF" in why
    words = ["Paris", "Rome", "Oslo", "Lima", "Bern", "Kyiv", "Riga", "Baku"] * 3  # 8 distinct of 24: labels
    assert task_metrics.choose(words)[0] == "exact"
    assert task_metrics.choose([f"The capital is {w}, a fine city." for w in words])[0] == "text"


def test_a_chrf_gain_while_exact_stayed_is_not_called_better(tmp_path):
    """The issue's arithmetic run: the model learned to answer "2." to every sum; chrF credits the "2" it shares
    with 12, 22 ...: 0% -> 12% chrF, while exact match stayed 0% -> 0%."""
    task = _task("text", "text, as the recipe sets (eval.task.metric)")
    refs = [p["reference"] for p in task["prompts"]]
    before = _scored(task, ["I think it is a number." for _ in refs])
    after = _scored(task, ["2." for _ in refs])
    assert after["score"] > before["score"] and after["details"]["exact"] == before["details"]["exact"] == 0.0
    task_eval.record(tmp_path, task, "base_zero_shot", before)
    t = task_eval.record(tmp_path, task, "fine_tuned", after)
    saved = json.loads((tmp_path / "task_eval.json").read_text())
    # the parent adapter's rows are named for it (init_from), the old name read still (task_verdict.start_keys)
    assert (
        saved["exact_beside"] == {"parent_zero_shot": 0.0, "fine_tuned": 0.0}
        and "base_zero_shot" not in saved["scores"]
    )

    said = task_verdict.verdict(t)
    assert ": better on the task" not in said, said
    assert said.startswith("this run against the parent adapter zero-shot: no better on the task (")
    assert "; exact 0% -> 0%: the chrF gain is credit for shared characters, not right answers)" in said
    table = task_eval_view.format_task_eval(t)
    assert "parent adapter, zero-shot" in table and "exact   0%" in table, table
    assert f"gain      fine-tuned {task_verdict.pct(after['score'])} against" in table
    assert "; exact 0% against 0%" in table

    # a run that answers more sums right is better on both, and says so with exact beside
    right = _scored(task, [r if i % 3 == 0 else "2." for i, r in enumerate(refs)])
    t = task_eval.record(tmp_path, task, "fine_tuned", right)
    said = task_verdict.verdict(t)
    assert said.startswith("this run against the parent adapter zero-shot: better on the task (") and (
        "; exact 0% -> 33%)" in said
    ), said


def test_free_text_references_show_no_exact_column(tmp_path):
    task = _task("text", "free text")
    for p in task["prompts"]:
        p["reference"] = f"The sum is {p['reference']}."
    task_eval.record(tmp_path, task, "base_zero_shot", _scored(task, ["The sum is 2." for _ in task["prompts"]]))
    t = task_eval.record(tmp_path, task, "fine_tuned", _scored(task, ["The sum is 12." for _ in task["prompts"]]))
    assert "exact_beside" not in t and "exact" not in task_eval_view.format_task_eval(t).split("gain")[1]


def test_a_comparison_without_variation_says_no_example_changed():
    same = [0.0] * 27
    t = {
        "metric": "exact",
        "examples": 27,
        "shots": 0,
        "starting_point": "the base model with the adapter of sft",
        "scores": {"base_zero_shot": 0.0, "fine_tuned": 0.0},
        "per_example": {"base_zero_shot": same, "fine_tuned": same},
    }
    diff = task_verdict.difference(t)
    said = task_verdict.noise_words(diff)
    assert said == "+0 points: each of the 27 examples scored as before" and "±0" not in task_verdict.verdict(t)
    assert "no measurable change on the task (0% against 0% exact, +0 points: each of the 27" in task_verdict.verdict(t)


def test_the_parent_adapters_rows_are_named_for_it_and_old_files_still_read(tmp_path):
    task = _task("exact", "numbers")
    refs = [p["reference"] for p in task["prompts"]]
    task_eval.record(tmp_path, task, "base_zero_shot", _scored(task, ["2"] * 27))
    t = task_eval.record(tmp_path, task, "fine_tuned", _scored(task, refs))
    assert set(t["scores"]) == {"parent_zero_shot", "fine_tuned"} and set(t["per_example"]) == set(t["scores"])
    said = task_verdict.verdict(t)
    assert said.startswith("this run against the parent adapter zero-shot: better on the task (100% against 0%")
    # a task_eval.json written before the rename: base_ names beside a starting_point read as the parent's
    old = {**t, "scores": {"base_zero_shot": 0.0, "fine_tuned": 1.0}, "per_example": {}}
    assert task_verdict.verdict(old).startswith("this run against the parent adapter zero-shot: better on the task")
    assert "parent adapter, zero-shot" in task_eval_view.format_task_eval(old)
    (tmp_path / "task_eval.json").write_text(json.dumps({**old, "per_example": {"base_zero_shot": [0.0] * 27}}))
    merged = task_eval.record(tmp_path, task, "fine_tuned", _scored(task, refs))
    assert set(merged["scores"]) == {"parent_zero_shot", "fine_tuned"} and "base_zero_shot" not in merged["per_example"]
