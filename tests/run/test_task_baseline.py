"""The task evaluation as the launcher says it: the verdict's wording from hand-written task_eval.json files (pays, may
not be needed, not applicable, too few), `ftrun baseline --json` (only JSON on stdout), the launch's baseline step
(said, never a stop; not again on a resume), and the scores table in the end summary and `ftrun status`.

The worker (launcher/worker/task_eval.py) is replaced by a small script here where a test checks the launcher's side
(task_baseline.worker_argv); the test of the real module skips until it exists."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.cli import main
from launcher.run import facts, summary_view, task_baseline, task_eval_view
from launcher.store.rundir import RunDir

BASE = {
    "metric": "exact",
    "metric_reason": "the 40 references are 4 distinct short labels (at most 1 words): "
    "accuracy after whitespace and case normalisation",
    "examples": 40,
    "shots": 3,
}


def _run(
    tmp_path: Path, record: dict, *, final: dict | None = None, plan: dict | None = None, state: str = "planned"
) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    run.recipe.write_text(yaml.safe_dump({"model": "m", "data": "d.jsonl", "output_dir": str(run.root)}))
    run.state.write_text(json.dumps({"state": state, "history": [{"state": state, "at": time.time()}]}))
    run.task_eval.write_text(json.dumps(record))
    if final is not None:
        run.final.mkdir()
        (run.final / run.task_eval.name).write_text(json.dumps(final))
    if plan is not None:
        run.plan.write_text(json.dumps(plan))
    return run


def _verdict(tmp_path: Path, record: dict, **kw) -> str:
    return task_eval_view.task_verdict(facts.task_eval(_run(tmp_path, record, **kw), base_only=True))


def test_a_base_model_wrong_in_one_case_of_five_pays_for_a_fine_tune(tmp_path):
    record = {**BASE, "scores": {"base_zero_shot": 0.1, "base_few_shot": 0.6}, "fine_tune_pays": True}
    assert _verdict(tmp_path, record) == "base model with 3 examples: wrong in 2 of 5 (60% exact): fine-tuning pays"


@pytest.mark.parametrize(
    "metric, score, said",
    [
        ("json", 0.55, "base model with 3 examples: fields wrong in 2 of 5 (55% field match): fine-tuning pays"),
        ("text", 0.41, "base model with 3 examples: 41% chrF, below the 80% a prompt would need: fine-tuning pays"),
    ],
)
def test_each_metric_says_its_own_score(tmp_path, metric, score, said):
    record = {
        **BASE,
        "metric": metric,
        "scores": {"base_zero_shot": 0.0, "base_few_shot": score},
        "fine_tune_pays": True,
    }
    assert _verdict(tmp_path, record) == said


def test_a_base_model_right_often_may_need_only_a_prompt_and_the_fine_tune_has_a_price(tmp_path):
    record = {**BASE, "scores": {"base_zero_shot": 0.7, "base_few_shot": 0.92}, "fine_tune_pays": False}
    plan = {"estimate": {"hours": 0.5, "cost_eur": 1.25}}
    assert _verdict(tmp_path, record, plan=plan) == (
        "base model with 3 examples: right in 92%: a prompt with "
        "examples may be enough; fine-tuning would cost ~1.25 EUR"
    )


def test_without_a_price_the_fine_tune_is_said_in_time(tmp_path):
    record = {
        **BASE,
        "metric": "text",
        "scores": {"base_zero_shot": 0.8, "base_few_shot": 0.85},
        "fine_tune_pays": False,
    }
    verdict = _verdict(tmp_path, record, plan={"estimate": {"hours": 2.0, "cost_eur": None}})
    assert verdict == (
        "base model with 3 examples: 85% chrF: a prompt with examples may be enough; fine-tuning would take ~2.0 h"
    )


def test_the_verdict_reads_the_base_models_better_prompt(tmp_path):
    """A model the examples confuse (measured: a run's own merged output, right in 90% zero-shot and 15% with three
    ticket examples before the prompt): its better prompt decides, and the verdict says which it was."""
    from launcher.worker import task_eval

    record = {**BASE, "scores": {"base_zero_shot": 0.9, "base_few_shot": 0.15}, "fine_tune_pays": False}
    assert _verdict(tmp_path, record) == "base model zero-shot: right in 90%: a prompt may be enough"
    task = {"metric": "exact", "metric_reason": "labels", "prompts": [{}] * 20, "shots": [{}] * 3, "max_new_tokens": 8}
    for name, score in (("base_zero_shot", 0.9), ("base_few_shot", 0.15)):
        out = task_eval.record(
            tmp_path, task, name, {"score": score, "details": {}, "seconds": 1.0, "new_tokens": 1, "tokens_per_s": 1.0}
        )
    assert (
        out["fine_tune_pays"] is False
        and out["verdict"] == "base model zero-shot: right in 90%: a prompt may be enough"
    )


def test_no_shots_is_a_zero_shot_verdict(tmp_path):
    record = {**BASE, "shots": 0, "scores": {"base_zero_shot": 0.2}, "fine_tune_pays": True}
    assert _verdict(tmp_path, record).startswith("base model zero-shot: wrong in 4 of 5 (20% exact)")


def test_data_without_answers_is_not_applicable_and_too_few_names_the_fix(tmp_path):
    why = "no example has an answer to score: plain text has no reference answer"
    assert (
        _verdict(tmp_path / "a", {"not_applicable": why}) == f"the task evaluation does not apply to this data: {why}"
    )
    few = _verdict(
        tmp_path / "b",
        {
            "too_few": 4,
            "why": "only 4 held-out example(s) have an answer to score",
            "fix": "hold out more: raise eval.fraction",
        },
    )
    assert few == (
        "too few examples to score the task: only 4 held-out example(s) have an answer to score; "
        "fix: hold out more: raise eval.fraction"
    )


FINISHED = {
    **BASE,
    "scores": {"base_zero_shot": 0.0, "base_few_shot": 0.35, "fine_tuned": 1.0, "merged": 0.975, "gguf-q4_k_m": 0.95},
    "generation": {"fine_tuned": {"seconds": 2.0, "new_tokens": 240, "tokens_per_s": 120.0}},
    "fine_tune_pays": True,
}


def test_answers_cut_by_a_setting_before_the_references_end_are_said_with_both_numbers(tmp_path):
    """Issue 46: the demo's task answers are capped at 24 new tokens (eval.max_new_tokens) while its references run to
    71 words; the table says so, with the setting, both numbers and the value that lets the answers finish."""
    from types import SimpleNamespace

    from launcher.data.task_examples import build_task

    long = " ".join(["word"] * 70)
    examples = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"{long} {i}"}]}
        for i in range(30)
    ]
    settings = SimpleNamespace(examples=20, metric="auto", shots=0, max_new_tokens=None)
    task = build_task(examples, list(range(20)), list(range(20, 30)), settings, 42, max_new_tokens_cap=24)
    assert task["max_new_tokens"] == 24 and task["capped"]["key"] == "eval.max_new_tokens"
    needed = task["capped"]["reference_tokens"]
    assert needed > 200
    t = {**BASE, "metric": "text", "capped": task["capped"], "scores": {"base_zero_shot": 0.08}}
    text = task_eval_view.format_task_eval(t)
    assert (
        f"answers cut at 24 new tokens (eval.max_new_tokens) while the longest reference runs to about {needed} "
        f"tokens: the scores are capped by that setting; eval.task.max_new_tokens: {needed} lets the answers "
        "finish"
    ) in text, text
    roomy = build_task(examples, list(range(20)), list(range(20, 30)), settings, 42, max_new_tokens_cap=1024)
    assert "capped" not in roomy


def test_a_step_from_a_parent_adapter_is_judged_against_it_with_the_noise_of_its_examples(tmp_path):
    """DPO from an SFT adapter (issue 46): the gain says whether it is within the noise of the n examples (two standard
    errors of the per-example differences), and the verdict speaks of this run's step, not of the base model."""
    same = [0.1, 0.3, 0.2, 0.4, 0.25] * 4
    step = {
        **BASE,
        "metric": "text",
        "examples": 20,
        "starting_point": "the base model with the adapter of sft",
        "scores": {"base_zero_shot": 0.20, "base_few_shot": 0.15, "fine_tuned": 0.19},
        "metric_reason": "the 20 references are free text",
        "per_example": {"base_zero_shot": same, "fine_tuned": [0.3, 0.1, 0.4, 0.2, 0.2] * 4},
    }
    run = _run(tmp_path, step, final=step, state="succeeded")
    table = summary_view.format_end_summary(facts.end_summary(run))
    assert (
        "gain      fine-tuned 19% against 20% for the parent adapter zero-shot (-1 point, within the ±8-point "
        "noise of 20 examples)" in table
    ), table
    assert "verdict   this run against the parent adapter zero-shot: no measurable change on the task" in table
    assert "fine-tuning pays" not in table
    better = {
        **step,
        "scores": {**step["scores"], "fine_tuned": 0.40},
        "per_example": {
            "base_zero_shot": same,
            "fine_tuned": [x + 0.2 + (0.05 if i % 2 else -0.05) for i, x in enumerate(same)],
        },
    }
    assert task_eval_view.task_verdict(better) == (
        "this run against the parent adapter zero-shot: better on the task (40% "
        "against 20% chrF, +20 points, beyond the ±2-point noise of 20 examples)"
    )


def test_a_fine_tune_that_did_not_beat_the_base_is_not_told_that_fine_tuning_pays(tmp_path):
    """Issue 46: an SFT run scored 2% against the base's 8% (beyond the noise) ended "fine-tuning pays". After
    training the verdict says the base's shortfall and that this run did not deliver; a run that did keeps it."""
    from launcher.data import task_verdict

    text = {"metric": "text", "examples": 20, "shots": 0}
    worse = {
        **text,
        "scores": {"base_zero_shot": 0.08, "fine_tuned": 0.02},
        "per_example": {"base_zero_shot": [0.08 + 0.01 * (i % 3) for i in range(20)], "fine_tuned": [0.02] * 20},
    }
    said = task_verdict.verdict(worse)
    assert said.startswith("base model zero-shot: 8% chrF, below the 80% a prompt would need, so fine-tuning should")
    assert "this run did not: worse on the task (2% against 8% chrF, -6 points, beyond the" in said
    assert "fine-tuning pays" not in said
    same = {**worse, "scores": {"base_zero_shot": 0.08, "fine_tuned": 0.09}, "per_example": {}}
    assert "this run did not: no measurable change on the task (9% against 8% chrF, +1 point" in (
        task_verdict.verdict(same)
    )
    before = {**text, "scores": {"base_zero_shot": 0.08}}
    assert task_verdict.verdict(before).endswith("a prompt would need: fine-tuning pays")
    parent = {**before, "starting_point": "the base model with the adapter of sft"}
    assert task_verdict.verdict(parent).endswith("a prompt would need: training on from it pays")


def test_the_end_summary_and_status_show_one_table_of_the_scores(tmp_path, capsys, monkeypatch):
    run = _run(
        tmp_path, {**BASE, "scores": {"base_zero_shot": 0.0, "base_few_shot": 0.35}}, final=FINISHED, state="succeeded"
    )
    text = summary_view.format_end_summary(facts.end_summary(run))
    table = text[text.index("  task ") :]
    rows = [line.split() for line in table.splitlines()]
    assert ["base", "model,", "zero-shot", "0%"] in rows and ["base", "model,", "3", "examples", "35%"] in rows
    assert ["merged", "98%"] in rows and ["gguf-q4_k_m", "95%"] in rows
    assert "fine-tuned               100%   (120 tokens/s generated)" in table
    assert [line.split()[0] for line in table.splitlines()] == [
        "task",
        "base",
        "base",
        "fine-tuned",
        "merged",
        "gguf-q4_k_m",
        "gain",
        "verdict",
    ]
    assert "40 held-out examples, scored by exact: the 40 references are 4 distinct short labels" in table
    assert (
        "gain      fine-tuned 100% against 35% for the base model with 3 examples (+65 points, one example of 40 "
        "being worth 2)"
    ) in table
    assert "verdict   base model with 3 examples: wrong in 3 of 5 (35% exact): fine-tuning pays" in table
    monkeypatch.chdir(tmp_path)
    assert main(["status", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert table in out and out.count("  task ") == 1
    assert main(["status", str(run.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["task_eval"]["scores"]["fine_tuned"] == 1.0


def test_the_summary_reads_the_base_scores_before_the_final_ones_exist(tmp_path):
    run = _run(
        tmp_path,
        {**BASE, "scores": {"base_zero_shot": 0.5, "base_few_shot": 0.9}, "fine_tune_pays": False},
        state="stopped",
    )
    text = summary_view.format_end_summary(facts.end_summary(run))
    assert "verdict   base model with 3 examples: right in 90%: a prompt with examples may be enough" in text
    assert "fine-tuned" not in text and "gain" not in text


# ---------------------------------------------------------------------------------------------
# The worker as a process: a stand-in script where the launcher's side is tested

FAKE_WORKER = """
import json, os, sys
from pathlib import Path
run = Path(sys.argv[sys.argv.index("--run-dir") + 1])
assert sys.argv[sys.argv.index("--phase") + 1] == "base"
Path(os.environ["FAKE_TASK_EVAL_CALLS"]).open("a").write("called\\n")
print("[ftrun task eval] base model: 40 prompts, zero-shot and with 3 examples", flush=True)
record = json.loads(os.environ["FAKE_TASK_EVAL"])
if record:
    (run / "task_eval.json").write_text(json.dumps(record))
if os.environ.get("FAKE_TASK_EVAL_RC", "0") == "2":
    print("[ftrun task eval] eval.task.shots=500: the training data holds only 40 examples", file=sys.stderr)
sys.exit(int(os.environ.get("FAKE_TASK_EVAL_RC", "0")))
"""


@pytest.fixture
def write_recipe(tmp_path, tiny_model):
    """The shared recipe writer with the task evaluation at its defaults (tests/conftest.py turns it off)."""
    from conftest import recipe_file

    def write(name: str = "r.yaml", **fields) -> Path:
        fields.setdefault("output_dir", str(tmp_path / "run"))
        fields.setdefault("eval", {"samples": 0})
        return recipe_file(tmp_path / name, tiny_model, **fields)

    return write


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    """The task evaluation's worker replaced by a script: `set(record, rc)`; `calls()` counts its runs."""
    script = tmp_path / "fake_task_eval.py"
    script.write_text(FAKE_WORKER)
    calls = tmp_path / "calls.txt"
    monkeypatch.setattr(
        task_baseline,
        "worker_argv",
        lambda run: [sys.executable, str(script), "--run-dir", str(run.root), "--phase", "base"],
    )
    monkeypatch.setenv("FAKE_TASK_EVAL_CALLS", str(calls))

    class Fake:
        @staticmethod
        def set(record: dict, rc: int = 0) -> None:
            monkeypatch.setenv("FAKE_TASK_EVAL", json.dumps(record))
            monkeypatch.setenv("FAKE_TASK_EVAL_RC", str(rc))

        @staticmethod
        def calls() -> int:
            return len(calls.read_text().splitlines()) if calls.is_file() else 0

    Fake.set({**BASE, "scores": {"base_zero_shot": 0.1, "base_few_shot": 0.6}, "fine_tune_pays": True})
    return Fake


def test_ftrun_baseline_json_prints_only_json_on_stdout(write_recipe, tmp_path, fake_worker, capsys):
    recipe = write_recipe()
    assert main(["baseline", str(recipe), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "metric": "exact",
        "examples": 40,
        "scores": {"base_zero_shot": 0.1, "base_few_shot": 0.6},
        "verdict": "base model with 3 examples: wrong in 2 of 5 (60% exact): fine-tuning pays",
        "fine_tune_pays": True,
    }
    # the preparation's text and the worker's lines went to stderr
    assert "data:" in captured.err and "[ftrun task eval] base model: 40 prompts" in captured.err
    run = RunDir(tmp_path / "run")
    assert run.plan.is_file() and json.loads(run.state.read_text())["state"] == "planned"
    # the text form says the table; scored once, not again
    assert main(["baseline", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "verdict   base model with 3 examples: wrong in 2 of 5 (60% exact): fine-tuning pays" in out
    assert fake_worker.calls() == 1


def test_ftrun_baseline_on_data_it_does_not_apply_to_says_so_and_exits_0(write_recipe, fake_worker, capsys):
    why = "no example has an answer to score"
    fake_worker.set({"not_applicable": why})
    assert main(["baseline", str(write_recipe()), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["not_applicable"] == why and out["verdict"] == f"the task evaluation does not apply to this data: {why}"


def test_ftrun_baseline_with_too_few_examples_says_the_fix(write_recipe, fake_worker, capsys):
    fake_worker.set({"too_few": 4, "why": "only 4 held-out example(s)", "fix": "raise eval.fraction"})
    assert main(["baseline", str(write_recipe())]) == 2
    assert (
        "task      too few examples to score the task: only 4 held-out example(s); fix: raise eval.fraction"
        in capsys.readouterr().out
    )


def test_ftrun_baseline_bad_input_is_the_workers_one_line(write_recipe, fake_worker, capsys):
    fake_worker.set({}, rc=2)
    assert main(["baseline", str(write_recipe())]) == 2
    err = capsys.readouterr().err
    assert (
        "ftrun: usage error: the task evaluation refused its input: eval.task.shots=500: the training data holds "
        "only 40 examples"
        in err
        and "Traceback" not in err
    )


def test_ftrun_baseline_with_the_task_eval_off_is_refused_before_anything(write_recipe, tmp_path, capsys):
    assert main(["baseline", str(write_recipe()), "eval.task.examples=0"]) == 2
    assert "eval.task.examples is 0" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_launch_step_says_its_failure_in_one_line_and_goes_on(tmp_path, fake_worker, write_recipe):
    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(write_recipe())
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    said: list[str] = []
    fake_worker.set({}, rc=1)
    task_baseline.launch_baseline(run, recipe, {"num_processes": 1}, said.append)
    assert said[-1] == (
        "task evaluation: the base model was not scored (its worker exited with code 1: base model: "
        "40 prompts, zero-shot and with 3 examples); the launch goes on without "
        "the verdict (`ftrun baseline RECIPE` tries again)"
    )
    fake_worker.set({**BASE, "scores": {"base_zero_shot": 0.5, "base_few_shot": 0.9}, "fine_tune_pays": False})
    task_baseline.launch_baseline(run, recipe, {"num_processes": 1}, said.append)
    assert "verdict   base model with 3 examples: right in 90%: a prompt with examples may be enough" in said[-1]
    calls = fake_worker.calls()
    task_baseline.launch_baseline(run, recipe, {"num_processes": 1}, said.append)  # scored: not again
    skip = load_recipe(write_recipe(eval={"samples": 0, "task": {"baseline": "skip"}}))
    run.task_eval.unlink()
    task_baseline.launch_baseline(run, skip, {"num_processes": 1}, said.append)  # baseline: skip
    assert fake_worker.calls() == calls == 2


def test_a_resume_after_training_began_does_not_score_the_base_again(tmp_path, fake_worker, write_recipe):
    from launcher.recipe_loading import load_recipe

    run = _run(tmp_path, {}, state="running")
    run.task_eval.unlink()
    said: list[str] = []
    task_baseline.launch_baseline(run, load_recipe(write_recipe()), {"num_processes": 1}, said.append)
    assert said == [] and fake_worker.calls() == 0


@pytest.mark.skipif(
    importlib.util.find_spec("launcher.worker.task_eval") is None,
    reason="launcher/worker/task_eval.py (the worker's scoring) is not written yet",
)
def test_ftrun_baseline_json_with_the_real_worker(write_recipe, capsys):
    recipe = write_recipe(eval={"samples": 0, "fraction": 0.05, "task": {"examples": 12}})
    assert main(["baseline", str(recipe), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # stdout holds the JSON alone; the preparation and the worker spoke on stderr
    assert set(out) == {"metric", "examples", "scores", "verdict", "fine_tune_pays"} and out["examples"] == 12
    assert all(0.0 <= out["scores"][n] <= 1.0 for n in ("base_zero_shot", "base_few_shot"))
    assert out["verdict"].startswith("base model with 3 examples: ") and isinstance(out["fine_tune_pays"], bool)
    assert "[ftrun task eval]" in captured.err and "data:" in captured.err


@pytest.mark.slow
def test_the_launch_says_the_verdict_before_the_smoke_test(write_recipe, tmp_path, fake_worker, capsys):
    recipe = write_recipe(max_steps=4, eval={"samples": 0, "fraction": 0.05})
    assert main([str(recipe), "--foreground"]) == 0
    out = capsys.readouterr().out
    verdict = out.index("verdict   base model with 3 examples: wrong in 2 of 5 (60% exact): fine-tuning pays")
    assert verdict < out.index("smoke test:")
    assert out.count("  task      ") == 2  # before the smoke test, and in the end summary
    assert main([str(recipe)]) == 0 and fake_worker.calls() == 1  # finished: nothing runs again


def test_fresh_scores_the_base_again_though_the_run_it_moved_aside_had_trained(
    tmp_path, fake_worker, write_recipe, monkeypatch, capsys
):
    # `ftrun RECIPE --fresh` over a finished run: the history read before the move (a past `running`) is not the new
    # run's, whose verdict needs its own baseline (the demo's GRPO step said "the parent adapter was not scored")
    from launcher.run import pipeline

    recipe = write_recipe()
    old = _run(tmp_path, {}, state="succeeded")
    old.state.write_text(json.dumps({"state": "succeeded", "history": [{"state": "running"}, {"state": "succeeded"}]}))
    old.task_eval.unlink()

    class Smoked(Exception):
        pass

    def no_smoke(*args, **kwargs):
        raise Smoked

    monkeypatch.setattr(pipeline, "_smoke", no_smoke)
    main([str(recipe), "--fresh"])  # stops where the smoke test would start
    out = capsys.readouterr().out
    assert "--fresh: the previous run was moved to" in out
    assert fake_worker.calls() == 1
    assert "verdict   base model with 3 examples: wrong in 2 of 5 (60% exact): fine-tuning pays" in out
