"""The task evaluation's answers and scores (launcher/worker/task_eval.py): batched greedy answers equal to one at a
time, the per-example answers file and its resume, the results file, the base phase's command line; the slow tier
trains the tiny model on a label task through `ftrun` and reads final/task_eval.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, ftrun, write_ticket_labels


@pytest.fixture(scope="module")
def loaded(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


def _task(tmp_path: Path, n: int = 12) -> dict:
    """A label task over n ticket prompts of different lengths (left padding has work to do)."""
    from launcher.data.task_examples import prompt_and_reference

    data = write_ticket_labels(tmp_path / "t.jsonl", n + 3)
    examples = [json.loads(line) for line in data.read_text().splitlines()]
    prompts = [{"index": i, **prompt_and_reference(e)} for i, e in enumerate(examples[:n])]
    for k, p in enumerate(prompts[::3]):  # some prompts longer, with a system turn
        p["messages"] = [{"role": "system", "content": "Sort it. " * (k + 1)}] + p["messages"]
    shots = [{"index": n + i, **prompt_and_reference(e)} for i, e in enumerate(examples[n:])]
    return {"metric": "exact", "metric_reason": "labels", "prompts": prompts, "shots": shots, "max_new_tokens": 6}


def test_batched_answers_equal_one_at_a_time_and_each_is_kept(loaded, tmp_path):
    import torch

    from launcher.worker import samples, task_eval

    model, tokenizer = loaded
    task = _task(tmp_path)
    one = samples.generate(model, tokenizer, task["prompts"], task["max_new_tokens"])  # no padding at all
    state = torch.get_rng_state()
    model.train()
    result = task_eval.score_model(model, tokenizer, tmp_path, task, "m", batch_size=5)
    assert model.training and torch.equal(state, torch.get_rng_state())  # left as they were
    rows = [json.loads(line) for line in (tmp_path / "task_eval" / "m.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(12))
    by_index = {r["index"]: r["answer"] for r in rows}
    assert [by_index[p["index"]] for p in task["prompts"]] == one
    assert all(0 < r["new_tokens"] <= task["max_new_tokens"] for r in rows)
    assert result["examples"] == 12 and result["new_tokens"] == sum(r["new_tokens"] for r in rows)
    assert result["score"] == sum(a == p["reference"] for a, p in zip(one, task["prompts"])) / 12
    assert result["seconds"] > 0 and result["tokens_per_s"] > 0
    few = task_eval.score_model(model, tokenizer, tmp_path, task, "m_shots", shots=True, batch_size=12)
    assert few["examples"] == 12 and (tmp_path / "task_eval" / "m_shots.jsonl").is_file()


def test_a_rerun_answers_only_what_the_file_misses_and_scores_the_same(loaded, tmp_path, monkeypatch):
    from launcher.worker import task_eval

    model, tokenizer = loaded
    task = _task(tmp_path)
    task["prompts"][0]["reference"] = task_eval.answer(model, tokenizer, task["prompts"][:1], 6, tmp_path / "x.jsonl")[
        0
    ]["answer"]
    first = task_eval.score_model(model, tokenizer, tmp_path, task, "m", batch_size=4)
    assert first["score"] > 0
    path = tmp_path / "task_eval" / "m.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])  # half kept, then a line cut by kill -9
    asked: list[int] = []
    real = task_eval.generate_batch
    monkeypatch.setattr(
        task_eval, "generate_batch", lambda m, t, texts, *a, **k: asked.append(len(texts)) or real(m, t, texts, *a, **k)
    )
    again = task_eval.score_model(model, tokenizer, tmp_path, task, "m", batch_size=4)
    assert sum(asked) == 6  # only the missing half
    assert (again["score"], again["details"], again["examples"]) == (first["score"], first["details"], 12)
    answers = task_eval.read_answers(path)
    assert sorted(answers) == list(range(12))
    asked.clear()
    task_eval.score_model(model, tokenizer, tmp_path, task, "m", batch_size=4)
    assert asked == []  # all there: nothing generated
    changed = {**task, "prompts": [{**task["prompts"][0], "messages": [{"role": "user", "content": "other"}]}]}
    task_eval.score_model(model, tokenizer, tmp_path, changed, "m")
    assert asked == [1]  # a kept answer counts only for the very text asked
    asked.clear()
    task_eval.score_model(model, tokenizer, tmp_path, task, "m", identity="trained further", batch_size=12)
    assert asked == [12]  # and for the same model


def test_an_answer_ends_at_the_end_of_turn(loaded):
    """Stops at the tokenizer's eos and the model's generation_config eos ids; the tokens after are not counted."""
    import torch

    from launcher.worker import task_eval

    tok = loaded[1]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    word = tok("billing", add_special_tokens=False)["input_ids"]

    class Stub:
        device = torch.device("cpu")
        training = False
        generation_config = type("G", (), {"eos_token_id": [im_end, tok.eos_token_id]})()

        def generate(self, input_ids, attention_mask, eos_token_id, **kw):
            assert set(eos_token_id) == {im_end, tok.eos_token_id} and kw["do_sample"] is False
            assert bool((attention_mask[:, 0] == 0).any())  # left padding
            after = word + [im_end] + [kw["pad_token_id"]] * (2 * len(word) - 1)  # finished: padded
            tail = torch.tensor([after, word + word + word], dtype=input_ids.dtype)
            return torch.cat([input_ids, tail[: len(input_ids)]], dim=1)

        def eval(self):
            pass

        def train(self, mode=True):
            pass

    got = task_eval.generate_batch(Stub(), tok, ["<|im_start|>user\nhi<|im_end|>\n", "a much longer prompt here"], 9)
    assert got == [("billing", len(word) + 1), ("billingbillingbilling", 3 * len(word))]


def test_the_results_file_merges_names_and_says_the_rule(tmp_path):
    from launcher.worker import samples, task_eval

    task = {
        "metric": "exact",
        "metric_reason": "labels",
        "prompts": [{"index": 0}] * 10,
        "shots": [{}] * 3,
        "max_new_tokens": 8,
    }
    r = {
        "score": 0.4,
        "details": {"exact": 0.4},
        "examples": 10,
        "seconds": 2.0,
        "new_tokens": 40,
        "tokens_per_s": 20.0,
    }
    out = task_eval.record(tmp_path, task, "base_zero_shot", r)
    assert out["fine_tune_pays"] is None and out["examples"] == 10 and out["shots"] == 3
    task_eval.record(tmp_path, task, "base_few_shot", {**r, "score": 0.9})
    out = task_eval.record(tmp_path, task, "fine_tuned", {**r, "score": 1.0})
    assert out["scores"] == {"base_zero_shot": 0.4, "base_few_shot": 0.9, "fine_tuned": 1.0}
    assert out["fine_tune_pays"] is False and out["generation"]["fine_tuned"]["tokens_per_s"] == 20.0
    assert out["verdict"] == "base model with 3 examples: right in 90%: a prompt with examples may be enough"
    assert json.loads((tmp_path / "task_eval.json").read_text()) == out
    final = tmp_path / "final"
    final.mkdir()
    (final / samples.MARKDOWN).write_text("# Before and after: r\n\nanswers\n")
    samples.append_scores(final, out)
    text = samples.append_scores(final, out).read_text()  # again: replaced, not repeated
    assert text.startswith("# Before and after") and text.count(samples.SCORES_HEADING) == 1
    assert "| base model, 3 examples in the prompt | 90.0% |" in text and "| fine-tuned | 100.0% |" in text
    gone = task_eval.record(tmp_path, {"not_applicable": "plain text has no reference"})
    assert gone == {
        "not_applicable": "plain text has no reference",
        "verdict": "the task evaluation does not apply to this data: plain text has no reference",
    }
    (tmp_path / "f2").mkdir()
    assert "Not scored: plain text" in samples.append_scores(tmp_path / "f2", gone).read_text()


def test_the_task_is_built_once_from_the_runs_split(tmp_path, write_recipe):
    from launcher.data import split
    from launcher.recipe_loading import load_recipe
    from launcher.store.rundir import RunDir
    from launcher.worker import task_eval

    data = write_ticket_labels(tmp_path / "t.jsonl", 120)
    recipe = load_recipe(write_recipe(data=str(data), eval={"fraction": 0.1, "task": {"examples": 8}}))
    examples = [json.loads(line) for line in data.read_text().splitlines()]
    run = RunDir(tmp_path / "run")
    task = task_eval.task_for_run(run, recipe, examples)
    assert task["too_few"] == 8 and task["fix"]  # 8 asked, under the minimum of 10: said, not scored
    recipe = load_recipe(write_recipe(data=str(data), eval={"fraction": 0.1, "task": {"examples": 200}}))
    run.task.unlink()
    task = task_eval.task_for_run(run, recipe, examples)
    held = set(split.for_recipe(examples, recipe).held_out)
    assert task["metric"] == "exact" and {p["index"] for p in task["prompts"]} == held
    assert all(s["index"] not in held for s in task["shots"]) and len(task["shots"]) == 3
    assert task_eval.task_for_run(run, recipe, []) == task  # read back: the data is not asked again


def _run_dir(tmp_path: Path, tiny_model: Path, **eval_fields) -> Path:
    from conftest import recipe_file

    run = tmp_path / "run"
    run.mkdir()
    data = write_ticket_labels(tmp_path / "t.jsonl", 120)
    recipe_file(run / "recipe.yaml", tiny_model, run, data=str(data), eval={"fraction": 0.1, **eval_fields})
    return run


def _base(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher.worker.task_eval", "--run-dir", str(run), "--phase", "base"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_base_phase_scores_zero_and_few_shot(tmp_path, tiny_model):
    run = _run_dir(tmp_path, tiny_model)
    res = _base(run)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("[ftrun task eval] base_")]
    assert [line.split(":")[0] for line in lines] == [
        "[ftrun task eval] base_zero_shot",
        "[ftrun task eval] base_few_shot",
    ]
    out = json.loads((run / "task_eval.json").read_text())
    assert out["metric"] == "exact" and out["examples"] == 12 and out["shots"] == 3
    assert set(out["scores"]) == {"base_zero_shot", "base_few_shot"} and out["fine_tune_pays"] is True  # random weights
    task = json.loads((run / "task.json").read_text())
    assert (
        len(task["prompts"]) == 12 and len((run / "task_eval" / "base_few_shot.jsonl").read_text().splitlines()) == 12
    )


def test_the_base_phase_on_bad_input_exits_2_in_one_line(tmp_path, tiny_model):
    res = _base(tmp_path / "nowhere")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    run = _run_dir(tmp_path, tiny_model)
    (tmp_path / "t.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    res = _base(run)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "[ftrun task eval]" in res.stderr, (
        res.stderr
    )


def test_plain_text_is_not_scored_and_says_why(tmp_path, tiny_model):
    run = _run_dir(tmp_path, tiny_model)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(40)))
    res = _base(run)
    assert res.returncode == 0 and "not scored" in res.stdout, res.stdout + res.stderr
    assert "no example has an answer" in json.loads((run / "task_eval.json").read_text())["not_applicable"]


@pytest.mark.slow
def test_a_label_task_is_learned_and_scored_after_training(tmp_path, tiny_model):
    """The issue's ticket sorting: 200 chats, 4 labels, 20 held out; LoRA for 5 epochs lifts exact match from the base
    model's 0 to most of the 20 (90% measured), and final/task_eval.json says so with the base scores beside it."""
    from conftest import recipe_file

    data = write_ticket_labels(tmp_path / "t.jsonl", 200)
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        tmp_path / "run",
        data=str(data),
        max_steps=None,
        epochs=5,
        micro_batch_size=16,
        learning_rate=1e-2,
        assistant_only_loss=True,
        export=["adapter", "merged"],
        checkpoint_every_minutes=5,
        eval={"fraction": 0.1, "samples": 2, "every_minutes": 60},
    )
    res = ftrun(recipe, "--foreground", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    final = tmp_path / "run" / "final"
    out = json.loads((final / "task_eval.json").read_text())
    assert out["metric"] == "exact" and out["examples"] == 20, out
    assert {"base_zero_shot", "base_few_shot", "fine_tuned"} <= set(out["scores"])
    assert out["scores"]["base_zero_shot"] <= 0.1 and out["fine_tune_pays"] is True
    assert out["scores"]["fine_tuned"] >= out["scores"]["base_zero_shot"] + 0.5, out["scores"]
    assert out["details"]["fine_tuned"]["exact"] == out["scores"]["fine_tuned"]
    # the merged folder, scored by the export on the same 20 prompts, answers as the fine-tuned model did
    assert abs(out["scores"]["merged"] - out["scores"]["fine_tuned"]) <= 0.05, out["scores"]
    assert out["verdict"].endswith("fine-tuning pays")

    # the run's merged output as the base of a second recipe: already good at the task, so a prompt with examples
    # may be enough (the verdict never stops a run; `ftrun baseline` says it before any training)
    import yaml

    again = yaml.safe_load(recipe.read_text())
    again.update(model=str(final / "merged"), output_dir=str(tmp_path / "run2"))
    (tmp_path / "r2.yaml").write_text(yaml.safe_dump(again))
    res = ftrun("baseline", tmp_path / "r2.yaml", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    second = json.loads(res.stdout)
    # measured: 90% zero-shot, 15% with three ticket examples before the prompt (the verdict reads the better one)
    assert second["fine_tune_pays"] is False and max(second["scores"].values()) >= 0.8, second
    assert "may be enough" in second["verdict"]
    text = (final / "samples.md").read_text()
    assert "**Before** (base model)" in text and "| fine-tuned |" in text


@pytest.mark.slow
def test_a_kill_9_during_the_evaluation_after_training_resumes_it_with_the_same_scores(tmp_path, tiny_model):
    """The worker is killed (SIGKILL) after the fine-tuned model's first batch of answers is kept: the supervisor
    restarts it from the final checkpoint, nothing is left to train, and the evaluation answers only the examples
    the file misses. The kept answers are not asked again, and the score is the one a fresh scoring of the final
    adapter gives."""
    import signal

    from conftest import recipe_file
    from helpers import freeze_worker, wait_until_ended

    from launcher.worker import task_eval

    data = write_ticket_labels(tmp_path / "t.jsonl", 120)
    run = tmp_path / "run"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        run,
        data=str(data),
        max_steps=6,
        micro_batch_size=8,
        eval={"fraction": 0.2, "samples": 0, "task": {"examples": 24, "baseline": "skip"}},
    )
    res = ftrun(recipe, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    answers = run / "task_eval" / "fine_tuned.jsonl"

    def first_batch_kept(r: Path) -> bool:
        return answers.is_file() and 0 < len(answers.read_text().splitlines()) < 24

    st = freeze_worker(run, first_batch_kept)
    kept = answers.read_text().splitlines()
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_until_ended(run, tmp_path)
    lines = answers.read_text().splitlines()
    assert lines[: len(kept)] == kept and len(lines) == 24, (len(kept), len(lines))  # the kept ones not asked again
    assert len({json.loads(l)["index"] for l in lines}) == 24
    log = (run / "train.log").read_text()
    assert "nothing left to train" in log
    out = json.loads((run / "final" / "task_eval.json").read_text())

    # a fresh scoring of the final adapter, with no kept answer, gives the same score
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32), str(run / "final" / "adapter")
    )
    task = json.loads((run / "task.json").read_text())
    fresh = task_eval.score_model(
        model,
        AutoTokenizer.from_pretrained(str(run / "final" / "adapter")),
        tmp_path / "again",
        task,
        "fresh",
        write=False,
    )
    assert fresh["score"] == out["scores"]["fine_tuned"], (fresh["score"], out["scores"])


@pytest.mark.slow
def test_a_json_extraction_task_reports_parse_rate_and_field_match(tmp_path, tiny_model):
    """References that parse as JSON choose the json metric: for each scorer, the share of answers that parse, that
    have the reference's keys, and the field-level match (the score), beside exact match."""
    import random

    from conftest import recipe_file

    rng = random.Random(3)
    names, cities = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo"], ["Oslo", "Rome", "Lima", "Kyiv", "Pune"]
    rows = []
    for _ in range(100):
        n, a, c = rng.choice(names), rng.randint(20, 60), rng.choice(cities)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Extract the person: {n} is {a} and lives in {c}."},
                    {"role": "assistant", "content": json.dumps({"name": n, "age": a, "city": c})},
                ]
            }
        )
    data = tmp_path / "people.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        tmp_path / "run",
        data=str(data),
        max_steps=12,
        micro_batch_size=16,
        learning_rate=1e-2,
        assistant_only_loss=True,
        smoke={"enabled": False},
        eval={"fraction": 0.15, "samples": 0, "task": {"examples": 12}},
    )
    # the SDPA backends' override (launcher/plan/attention.py) reaches the worker, the base phase and the export
    res = ftrun(recipe, "--foreground", cwd=tmp_path, timeout=600, env={"FTRUN_SDPA_BACKENDS": "efficient,math"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "run" / "final" / "task_eval.json").read_text())
    assert out["metric"] == "json" and "JSON" in out["metric_reason"] and out["examples"] == 12
    chosen = {"cudnn": False, "flash": False, "efficient": True, "math": True, "source": "FTRUN_SDPA_BACKENDS"}
    assert json.loads((tmp_path / "run" / "worker.json").read_text())["sdpa_backends"] == chosen
    assert {"base_zero_shot", "base_few_shot", "fine_tuned"} <= set(out["generation"]), out["generation"]
    assert all(g["sdpa_backends"] == chosen for g in out["generation"].values()), out["generation"]
    for name in ("base_zero_shot", "base_few_shot", "fine_tuned"):
        d = out["details"][name]
        assert set(d) == {"parses", "has_keys", "field_match", "exact"}, d
        assert 0 <= d["exact"] <= d["field_match"] <= 1 and d["has_keys"] <= d["parses"]
        assert out["scores"][name] == d["field_match"]
    print("json task:", {n: out["details"][n] for n in out["details"]})


@pytest.mark.slow
def test_baseline_skip_scores_the_base_after_training_with_the_adapter_off(tmp_path, tiny_model):
    """eval.task.baseline: skip (issue 46): nothing is scored before training, and the LoRA run still ends with the
    comparison, the base scored with its adapter switched off, as docs/task_eval.md says."""
    from conftest import recipe_file

    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        tmp_path / "run",
        max_steps=4,
        checkpoint_every_minutes=5,
        eval={"fraction": 0.1, "samples": 0, "task": {"examples": 10, "baseline": "skip"}},
    )
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "scoring the base model before training" not in res.stdout
    out = json.loads((tmp_path / "run" / "final" / "task_eval.json").read_text())
    assert {"base_zero_shot", "base_few_shot", "fine_tuned"} <= set(out["scores"]), out
    assert "gain      fine-tuned" in res.stdout and "has not been scored" not in res.stdout
