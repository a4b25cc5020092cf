"""The validation split and the before/after samples: the split, the recipe's eval: key, the ETA's eval part,
samples.md, the status line; and one run of the tiny model through the smoke test and the full run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ftrun, metrics, status

TINY_DATA = Path(__file__).resolve().parents[2] / "recipes" / "data" / "tiny-chat.jsonl"


def test_the_split_is_seeded_disjoint_and_the_same_every_time():
    from launcher.data.split import split

    a, b = split(400, 0.05, 42), split(400, 0.05, 42)
    assert a == b and len(a.held_out) == 20 and len(a.train) == 380
    assert set(a.train).isdisjoint(a.held_out) and sorted(a.train + a.held_out) == list(range(400))
    assert split(400, 0.05, 7).held_out != a.held_out  # another seed, another draw
    assert split(400, None, 42).held_out == [] and split(3, 0.01, 42).held_out != []  # at least one held out
    assert split(2, 0.4, 42).train  # at least one trains


def test_copies_of_an_example_are_held_out_or_trained_together(tmp_path):
    """A source mixed with weight 2 repeats its examples (launcher/data/dataset.py): a held-out example must not train
    through its copy. Without duplicates the split is split()'s own."""
    from launcher.data.dataset import load_data
    from launcher.data.split import for_recipe, split

    recipe = _recipe(tmp_path, eval={"fraction": 0.1})
    distinct = [{"text": f"example {i}"} for i in range(50)]
    assert for_recipe(distinct, recipe) == split(50, 0.1, 42)
    key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
    plain = load_data(str(TINY_DATA), 42).examples
    n = len({key(e) for e in plain})
    assert n < len(plain)  # the demo data has lines that occur twice: the same rule holds for them
    mixed = load_data([{"path": str(TINY_DATA), "weight": 2}], 42).examples
    assert len(mixed) == 2 * len(plain)
    for examples in (plain, mixed):
        parts = for_recipe(examples, recipe)
        held = {key(examples[i]) for i in parts.held_out}
        assert len(held) == len(parts.held_out) == round(0.1 * n)  # one copy of each held-out example is evaluated
        assert not held & {key(examples[i]) for i in parts.train}  # and no copy of it trains
    assert for_recipe(mixed, recipe).held_out != [] and for_recipe(mixed, recipe) == for_recipe(mixed, recipe)


def _recipe(tmp_path, **fields):
    from launcher.recipe_loading import validate_recipe

    raw = {"model": "/m", "method": "lora", "data": str(TINY_DATA), **fields}
    return validate_recipe(raw, tmp_path, "r")


def test_recipe_eval_key_and_the_trainer_settings_it_owns(tmp_path):
    from launcher.errors import RecipeError

    plain = _recipe(tmp_path)
    assert plain.eval.fraction is None and plain.eval.samples == 4
    # without a split the trajectory (and so every existing run's resume) is what it was
    assert "eval.fraction" not in plain.trajectory()
    held = _recipe(tmp_path, eval={"fraction": 0.02})
    assert held.trajectory_hash() != plain.trajectory_hash()  # which examples train: a resume must not change it
    assert _recipe(tmp_path, eval={"fraction": 0.02, "every_minutes": 5}).trajectory_hash() == held.trajectory_hash()
    other = _recipe(tmp_path, eval={"data": "held.jsonl"})
    assert other.eval.data == str((tmp_path / "held.jsonl").resolve())  # relative to the recipe's folder
    with pytest.raises(RecipeError, match="not both"):
        _recipe(tmp_path, eval={"fraction": 0.1, "data": "x.jsonl"})
    with pytest.raises(RecipeError) as exc:
        _recipe(tmp_path, trainer={"eval_strategy": "steps", "eval_steps": 10})
    assert "trainer.eval_strategy -> eval.every_minutes" in exc.value.message
    assert "trainer.eval_steps -> eval.every_minutes" in exc.value.message
    with pytest.raises(RecipeError, match="load_best_model_at_end -> .not supported"):  # would silently do nothing
        _recipe(tmp_path, trainer={"load_best_model_at_end": True, "metric_for_best_model": "eval_loss"})
    # eval settings ftrun does not decide pass through to TRL
    assert _recipe(tmp_path, trainer={"per_device_eval_batch_size": 2}).trainer == {"per_device_eval_batch_size": 2}


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_eval_data_is_given_like_data(tmp_path, write_recipe):
    """eval.data takes what data takes: a Hub id stays an id, a mapping keeps split and columns, a list mixes;
    a local source converts like data's, in any format. Then one run evaluates on it (metrics.jsonl)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.data.split import load_eval_data, source_name

    assert _recipe(tmp_path, eval={"data": "acme/support-eval"}).eval.data == "acme/support-eval"
    hub = _recipe(
        tmp_path,
        eval={"data": {"path": "acme/support-eval", "split": "validation", "columns": {"messages": "conversation"}}},
    ).eval.data
    assert (hub.path, hub.split, hub.columns) == ("acme/support-eval", "validation", {"messages": "conversation"})
    rows = [{"question": f"What is {i} plus {i}?", "input": "", "output": f"{2 * i}."} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "held.parquet")  # Alpaca, its instruction column renamed
    spec = {"path": "held.parquet", "columns": {"instruction": "question"}}
    r = _recipe(tmp_path, eval={"data": spec})
    held = load_eval_data(r)
    assert len(held) == 12 and held[0]["messages"][-1] == {"role": "assistant", "content": "0."}
    assert source_name(r.eval.data) == "held.parquet"

    recipe = write_recipe(
        max_steps=2, logging_steps=1, **{"smoke": {"enabled": False}}, eval={"data": spec, "samples": 0}
    )
    res = ftrun(recipe, "--foreground", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    evals = [m for m in metrics(tmp_path / "run") if "eval_loss" in m]
    assert len(evals) >= 2  # at the start and at the end, on the 12 held-out examples


def test_the_eta_counts_every_eval_pass_and_the_samples(tmp_path):
    from launcher.data.dataset import DataStats
    from launcher.run.smoke import estimate

    recipe = _recipe(
        tmp_path,
        max_steps=100,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        eval={"fraction": 0.05, "every_minutes": 1},
    )
    stats = DataStats(
        examples=100,
        total_tokens=10_000,
        mean_tokens=100.0,
        max_tokens=100,
        over_max_length=0,
        tokens_source="tokenizer",
        max_length=2048,
    )
    measured = {"tokens_per_second": 100.0, "measured_seconds": 10.0, "checkpoint_seconds": 0.0}
    base = estimate(measured, 60.0, recipe, stats, 1, 0)
    assert base["eval_seconds"] == 0.0
    # the smoke evaluated 200 of the held-out set's 1,000 tokens in 2 s; it spent 5 s on the base model's answers
    timed = {**measured, "eval_seconds": 2.0, "eval_tokens": 200, "eval_full_tokens": 1000, "samples_seconds": 5.0}
    parts = estimate(timed, 60.0, recipe, stats, 1, 0)
    # 100 s of training (10,000 tokens at 100/s): passes at the start, after 1 min, at the end; 10 s each
    assert parts["train_seconds"] == pytest.approx(100.0)
    assert parts["eval_seconds"] == pytest.approx(3 * 10.0)
    assert parts["samples_seconds"] == 5.0
    assert parts["startup_seconds"] == pytest.approx(base["startup_seconds"] - 7.0)  # no longer counted there
    assert parts["estimated_seconds"] == pytest.approx(base["estimated_seconds"] + 30.0 + 5.0 - 7.0)
    from launcher.run.views import format_smoke  # the forecast as printed names both parts

    line = format_smoke(
        {
            **parts,
            "measured_steps": 2,
            "tokens_per_second": 100.0,
            "peak_memory_gb": 1.0,
            "device": "cpu",
            "training_tokens": 10_000,
            "price_per_hour_eur": 0.0,
        }
    )
    assert "evaluation 30 s" in line and "samples 5 s" in line, line


def test_samples_md_holds_prompt_reference_before_and_after(tmp_path):
    from launcher.worker import samples

    examples = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(10)
    ] + [{"prompt": "plain prompt", "completion": "plain answer"}, {"text": "no prompt"}]
    picked = samples.pick(examples, [3, 10, 11], [0, 1, 2], 5, 42, "d.jsonl")
    assert {p["index"] for p in picked} == {3, 10}  # plain text has nothing to prompt with
    plain = next(p for p in picked if p["index"] == 10)
    assert plain["text"] == "plain prompt" and plain["reference"] == "plain answer"  # no chat template, as it trained
    assert samples.pick(examples, [3, 10, 11], [0, 1, 2], 5, 42) == samples.pick(
        examples, [3, 10, 11], [0, 1, 2], 5, 42
    )
    before = {"samples": [{**p, "before": f"base says {p['index']}"} for p in picked]}
    path = samples.write_after(
        tmp_path / "final", before, picked, ["```\nfenced\n```", ""], run_name="r", step=7, max_new_tokens=16
    )
    text = path.read_text()
    assert text.count("**Prompt**") == text.count("**Reference**") == text.count("**Before** (base model)") == 2
    assert "> base says 3" in text and "> ```" in text and "_(empty)_" in text and "after step 7" in text
    assert "never trained on" in text and "example 4 of d.jsonl" in text
    data = json.loads((tmp_path / "final" / samples.DATA).read_text())
    assert [r["after"] for r in data["samples"]] == ["```\nfenced\n```", ""]
    trained = samples.pick(examples, [], [0, 1, 2], 2, 42)
    text = samples.write_after(
        tmp_path / "f2", None, trained, ["x", "y"], run_name="r", step=1, max_new_tokens=4
    ).read_text()
    assert "the model trained on these" in text and "_(not recorded)_" in text
    assert len(samples.summary(data["samples"])) == 6


def test_samples_md_of_a_run_from_a_parent_adapter_labels_its_rows_as_the_parent(tmp_path):
    """Issue 46: a DPO run from an SFT adapter answered "before" with that adapter; samples.md says so, in the answers
    and in the scores' table (task_eval.json's starting_point)."""
    from launcher.worker import samples

    examples = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(6)
    ]
    picked = samples.pick(examples, [4, 5], [0, 1, 2, 3], 2, 42, "d.jsonl")
    before = {"samples": [{**p, "before": "sft says"} for p in picked]}
    final = tmp_path / "final"
    samples.write_after(
        final, before, picked, ["x", "y"], run_name="dpo", step=3, max_new_tokens=8, start="parent adapter, tiny-cpu"
    )
    samples.append_scores(
        final,
        {
            "metric": "text",
            "metric_reason": "free text",
            "examples": 20,
            "shots": 3,
            "starting_point": "the base model with the adapter of tiny-cpu (init_from)",
            "scores": {"base_zero_shot": 0.2, "base_few_shot": 0.15, "fine_tuned": 0.19},
        },
    )
    text = (final / samples.MARKDOWN).read_text()
    assert text.count("**Before** (parent adapter, tiny-cpu)") == 2 and "(base model)" not in text
    assert "by the parent adapter, tiny-cpu before training" in text
    assert "| parent adapter, zero-shot | 20.0% |" in text and "| parent adapter, 3 examples in the prompt |" in text
    assert "base model" not in text


def test_the_newest_training_row_and_the_newest_eval_row_are_found_apart(tmp_path):
    from launcher.store.state import last_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_loss": 3.0}] + [{"step": s, "loss": 10.0 / s, "pad": "x" * 100} for s in range(1, 200)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the eval row lies far before the last 4 KB
    assert last_metrics(path, "loss")["step"] == 199 and last_metrics(path, "eval_loss") == {
        "step": 0,
        "eval_loss": 3.0,
    }
    assert last_metrics(path, "grad_norm") == {} and last_metrics(path)["step"] == 199
    with path.open("a") as fh:
        fh.write(json.dumps({"step": 199, "eval_loss": 2.5}) + "\n" + '{"step": 200, "lo')  # a half-written line
    assert last_metrics(path, "loss")["step"] == 199 and last_metrics(path, "eval_loss")["eval_loss"] == 2.5


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_a_run_with_an_eval_split_reports_eval_loss_and_before_after_samples(write_recipe, tmp_path):
    """Smoke test (one eval pass, the base model's answers) then the full run (eval at the start and the end,
    the answers after training): metrics.jsonl, status, TensorBoard, loss.png, final/samples.md."""
    recipe = write_recipe(
        max_steps=4,
        checkpoint_every_minutes=30,
        logging_steps=2,
        eval={"fraction": 0.05, "every_minutes": 30, "samples": 2, "max_new_tokens": 6},
        trainer={"per_device_eval_batch_size": 4},
    )
    res = ftrun(recipe, "--foreground", cwd=tmp_path, timeout=600)  # 57 s alone, 197 s at load 4-10
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    from launcher.data.dataset import load_data
    from launcher.data.split import for_recipe

    parts = for_recipe(load_data(str(TINY_DATA), 42).examples, _recipe(tmp_path, eval={"fraction": 0.05}))
    held = parts.held_out

    # the smoke test: one eval pass on held-out examples only, priced in the ETA; the base model answered there
    smoke = json.loads((run / "smoke.json").read_text())
    measured = json.loads((run / "smoke" / "result.json").read_text())  # the worker's timings, before rounding
    assert measured["eval_seconds"] > 0 and measured["samples_seconds"] > 0 and smoke["eval_full_tokens"] > 0
    # the forecast's parts, rounded to 0.1 s (the tiny model answers its prompts in a few hundredths)
    assert smoke["samples_seconds"] == round(measured["samples_seconds"], 1) and smoke["eval_seconds"] > 0
    lines = TINY_DATA.read_text().splitlines()
    held_lines = {json.dumps(json.loads(lines[i]), ensure_ascii=False) for i in held}
    smoke_train = {
        json.dumps(json.loads(line), ensure_ascii=False)
        for line in (run / "smoke" / "data.jsonl").read_text().splitlines()
    }
    smoke_eval = {
        json.dumps(json.loads(line), ensure_ascii=False)
        for line in (run / "smoke" / "eval.jsonl").read_text().splitlines()
    }
    assert smoke_eval and smoke_eval <= held_lines and not smoke_train & held_lines
    # (the printed forecast names only parts of half a second or more: the tiny model evaluates in 0.1 s;
    # test_the_eta_counts_every_eval_pass_and_the_samples checks the printed parts)
    assert f"evaluation: {len(held)} held-out examples" in res.stdout

    # the full run: trained on the rest, evaluated at the start and at the end, after the last log
    log = res.stdout.split("starting worker")[1]  # --foreground: the full run's worker writes here
    assert "the base model answered 2 prompt(s)" in (run / "smoke" / "smoke.log").read_text()
    assert f"training on {len(parts.train)} examples, evaluating on {len(held)} held-out examples" in log
    assert "the base model answered" not in log  # the smoke test's answers are reused
    rows = metrics(run)
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 4] and all(r["eval_loss"] > 0 for r in evals)
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    s = status(run, tmp_path)
    assert s["eval_loss"] == evals[-1]["eval_loss"] and s["loss"] == rows[-2]["loss"]  # each from its own row
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert f"eval loss {evals[-1]['eval_loss']:.4f} (step 4" in text

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, 4]
    assert (run / "loss.png").stat().st_size > 0

    import torch

    args = torch.load(next((run / "checkpoints").glob("step-*")) / "training_args.bin", weights_only=False)
    assert args.per_device_eval_batch_size == 4 and args.eval_strategy == "no"  # trainer: passes eval batch through

    # before (the smoke test's, on the base model) and after, for prompts of the held-out examples
    before = json.loads((run / "samples-before.json").read_text())
    data = json.loads((run / "final" / "samples.json").read_text())
    assert [r["index"] for r in data["samples"]] == [r["index"] for r in before["samples"]]
    assert len(data["samples"]) == 2 and all(r["index"] in held for r in data["samples"])
    assert [r["before"] for r in data["samples"]] == [r["before"] for r in before["samples"]]
    md = (run / "final" / "samples.md").read_text()
    assert md.count("**After** (step 4)") == 2 and "never trained on" in md
    assert "samples: before and after training in" in log and "reference:" in log
