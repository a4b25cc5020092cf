"""KTO (objective kto, TRL's KTOTrainer): unpaired answers marked desirable or undesirable (prompt/completion/label),
the label refused everywhere else, the recipe's keys, the plan's KL sequences and classes, and end to end on the tiny
model: KTO from the demo's chat data made unpaired (scripts/make_preference_data.py --unpaired), kill -9 + resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, _load_script
from helpers import adapter_tensors, article_plan, freeze_worker, ftrun, metrics, polled_status, wait_for
from helpers import wait_until_ended

CHATS = REPO / "recipes" / "data" / "tiny-chat.jsonl"
SAID = ("time", "tokens_per_second", "peak_memory_gb", "eval_seconds")  # wall-clock values


def _lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _turn(role: str, text: str) -> dict:
    return {"role": role, "content": text}


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory) -> Path:
    """The demo's chat data as KTO's unpaired answers: each conversation's last answer as it is (desirable) and with a
    chatty closing line (undesirable), built by the script that builds the demo's pairs."""
    out = tmp_path_factory.mktemp("kto-data") / "tiny-kto.jsonl"
    _load_script("make_preference_data").main(str(CHATS), str(out), unpair=True)
    return out


# ---------------------------------------------------------------------------------------------
# The format (launcher/data/formats.py "unpaired") and the label refused elsewhere


def test_unpaired_answers_conversational_and_plain_become_one_form(tmp_path, unpaired):
    from launcher.data.dataset import load_data, to_dataset

    data = load_data(unpaired)
    assert data.form == "unpaired" and len(data.examples) == 800
    labels = [e["label"] for e in data.examples]
    assert labels.count(True) == labels.count(False) == 400
    plain = load_data(
        _lines(
            tmp_path / "plain.jsonl",
            [
                {"prompt": "2+2?", "completion": "4", "label": True},
                {"prompt": "2+2?", "completion": "5", "label": False},
            ],
        )
    )
    assert plain.form == "unpaired" and plain.examples[1] == {"prompt": "2+2?", "completion": "5", "label": False}
    assert "objective kto" in plain.describe()
    # a CSV cell holds the label as JSON text
    csv = tmp_path / "kto.csv"
    csv.write_text("prompt,completion,label\n2+2?,4,true\n2+2?,5,false\n")
    assert [e["label"] for e in load_data(csv).examples] == [True, False]
    # TRL batches the label as a bool column (DataCollatorForUnpairedPreference: torch.tensor of the labels)
    assert str(to_dataset(plain.examples).features["label"]) == "Value('bool')"


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"prompt": "2+2?", "completion": "5", "label": "no"}, "'label' must be true (a desirable answer) or false"),
        ({"prompt": "2+2?", "completion": "5", "label": 0}, "found 0"),
        (
            {
                "prompt": [_turn("user", "2+2?")],
                "completion": [_turn("user", "again"), _turn("assistant", "5")],
                "label": False,
            },
            "it is the answer alone",
        ),
        ({"prompt": [_turn("user", "2+2?")], "completion": "5", "label": True}, "must both be strings"),
    ],
)
def test_a_bad_unpaired_record_is_refused_with_its_line(tmp_path, bad, said):
    from launcher.data.dataset import load_data
    from launcher.errors import DataError

    good = {"prompt": "2+2?", "completion": "4", "label": True}
    if isinstance(bad["prompt"], list):
        good = {"prompt": [_turn("user", "2+2?")], "completion": [_turn("assistant", "4")], "label": True}
    with pytest.raises(DataError) as err:
        load_data(_lines(tmp_path / "kto.jsonl", [good, good, bad]))
    assert "kto.jsonl line 3" in str(err.value) and said in str(err.value), str(err.value)


def test_a_label_is_refused_not_dropped_where_kto_does_not_train(write_recipe, tmp_path, unpaired):
    """Issue 59: answers marked label: false were trained on as targets under SFT. Unpaired data under any other
    objective is refused with the objective that trains it; a label on a record of another format is refused by line."""
    from launcher.data.dataset import load_data
    from launcher.data.stats import data_stats
    from launcher.errors import DataError
    from launcher.recipe_loading import load_recipe

    with pytest.raises(DataError, match="unpaired data, which objective sft does not train") as err:
        data_stats(load_recipe(write_recipe(data=str(unpaired))))
    assert "set objective: kto" in err.value.fix
    with pytest.raises(DataError, match="unpaired data, which objective dpo does not train"):
        data_stats(load_recipe(write_recipe(data=str(unpaired), objective="dpo")))
    chat = {"messages": [_turn("user", "2+2?"), _turn("assistant", "4")]}
    labelled = dict(chat, label=False)
    with pytest.raises(DataError) as err:
        load_data(_lines(tmp_path / "chat.jsonl", [chat] * 30 + [labelled]))  # a chat file, one record labelled
    text = str(err.value)
    assert "chat.jsonl line 31" in text and "'label' (False) marks an answer desirable or undesirable" in text
    assert "set objective: kto, or remove 'label'" in text
    # conversations that all carry a label are unpaired answers: their last turn is the answer the label marks
    data = load_data(_lines(tmp_path / "labelled.jsonl", [dict(chat, label=True), labelled]))
    assert data.form == "unpaired" and data.examples[1] == {
        "prompt": [_turn("user", "2+2?")],
        "completion": [_turn("assistant", "4")],
        "label": False,
    }
    with pytest.raises(DataError, match="unpaired data, which objective sft does not train"):
        data_stats(load_recipe(write_recipe(data=str(tmp_path / "labelled.jsonl"))))
    with pytest.raises(DataError, match="which must be the assistant's after at least one turn of prompt"):
        load_data(_lines(tmp_path / "ends.jsonl", [dict(messages=chat["messages"] + [_turn("user", "?")], label=True)]))
    with pytest.raises(DataError, match="chat data, which objective kto does not train"):
        data_stats(load_recipe(write_recipe(objective="kto")))  # the demo's chat data


# ---------------------------------------------------------------------------------------------
# The recipe's keys


@pytest.mark.parametrize(
    "fields, said",
    [
        (dict(micro_batch_size=1), "micro_batch_size 1 is below 2, the smallest objective kto trains"),
        (dict(packing=True), "packing apply to objective sft"),
        (dict(preference={"loss_type": "ipo"}), "preference.loss_type does not apply to objective kto"),
    ],
)
def test_a_kto_recipe_key_that_it_cannot_honour_is_refused(write_recipe, unpaired, fields, said):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(data=str(unpaired), objective="kto", **fields))
    assert said in str(err.value), str(err.value)


def test_the_weights_apply_to_kto_alone_and_reach_ktoconfig(write_recipe, tmp_path, unpaired):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe
    from launcher.store.rundir import RunDir
    from launcher.worker.trainer_config import trainer_config

    with pytest.raises(RecipeError, match="preference.desirable_weight does not apply to objective dpo"):
        load_recipe(write_recipe(objective="dpo", preference={"desirable_weight": 1.2}))
    recipe = load_recipe(
        write_recipe(data=str(unpaired), objective="kto", preference={"desirable_weight": 1.2, "beta": 0.3})
    )
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    config = trainer_config(recipe, run, "smoke", "cpu", None, 5, tmp_path / "out")
    assert type(config).__name__ == "KTOConfig"
    assert (config.beta, config.desirable_weight, config.undesirable_weight) == (0.3, 1.2, 1.0)
    # its KL pairs are built within micro-batches read in order (KTOConfig's own default), not reshuffled by the trainer
    assert type(config).__dataclass_fields__["train_sampling_strategy"].default == "sequential"
    assert config.train_sampling_strategy == "sequential" and config.per_device_train_batch_size == 8


def test_another_data_order_is_refused_before_the_model_loads(write_recipe, unpaired):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe
    from launcher.recipe_trainer import check_trainer_fields

    recipe = load_recipe(
        write_recipe(data=str(unpaired), objective="kto", trainer={"train_sampling_strategy": "random"})
    )
    with pytest.raises(RecipeError, match="reads the data in order .sequential. and refuses any other order"):
        check_trainer_fields(recipe)
    check_trainer_fields(load_recipe(write_recipe(data=str(unpaired), objective="kto", trainer={"warmup_steps": 2})))


def test_an_out_of_memory_replan_keeps_two_examples_per_micro_batch(write_recipe, unpaired):
    from launcher.recipe_loading import load_recipe
    from launcher.run.adjustments import next_adjustment

    four = load_recipe(write_recipe(data=str(unpaired), objective="kto", micro_batch_size=4))
    assert next_adjustment(four, {})[0] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2}
    two = load_recipe(write_recipe(data=str(unpaired), objective="kto", micro_batch_size=2))
    change = next_adjustment(two, {})
    assert change is None or "micro_batch_size" not in change[0]


# ---------------------------------------------------------------------------------------------
# The classes (launcher/data/stats.py class_balance, TRL's recommendation)


def _classes(write_recipe, tmp_path, desirable: int, undesirable: int, **preference):
    from launcher.data.stats import data_stats
    from launcher.recipe_loading import load_recipe

    rows = [{"prompt": f"Say {i}.", "completion": f"{i}.", "label": True} for i in range(desirable)]
    rows += [{"prompt": f"Say {i}.", "completion": f"{i + 1}.", "label": False} for i in range(undesirable)]
    path = _lines(tmp_path / f"kto-{desirable}-{undesirable}.jsonl", rows)
    recipe = load_recipe(write_recipe(data=str(path), objective="kto", preference=preference or None))
    return data_stats(recipe)[2].labels


def test_the_classes_are_stated_and_refused_far_from_trls_weights(write_recipe, tmp_path):
    from launcher.errors import DataError

    labels = _classes(write_recipe, tmp_path, 60, 60)
    assert (labels["desirable"], labels["undesirable"], labels["ratio"], labels["in_range"]) == (60, 60, 1.0, True)
    from launcher.run.data_view import data_line
    from types import SimpleNamespace as Stats

    line = data_line(
        Stats(description="d", examples=120, total_tokens=900, tokens_source="t", over_max_length=0, labels=labels)
    )
    assert "; 60 desirable and 60 undesirable answers; 900 tokens per epoch" in line  # the plan's and `ftrun data`'s
    # 80 desirable against 40: 2.0 with TRL's default weights, outside its 1 to 4/3 but not far: stated with the fit
    labels = _classes(write_recipe, tmp_path, 80, 40)
    assert labels["ratio"] == 2.0 and not labels["in_range"]
    assert labels["desirable_weight_range"] == [0.5, 0.67] and labels["undesirable_weight_range"] == [1.5, 2.0]
    with pytest.raises(DataError) as err:
        _classes(write_recipe, tmp_path, 100, 20)
    assert "100 desirable and 20 undesirable" in str(err.value) and "weighs 5.00 times" in str(err.value)
    assert "preference.desirable_weight between 0.20 and 0.27" in err.value.fix
    assert "preference.undesirable_weight between 3.75 and 5.00" in err.value.fix
    # the weights TRL recommends make the same data plan
    assert _classes(write_recipe, tmp_path, 100, 20, undesirable_weight=4.0)["in_range"]
    with pytest.raises(DataError, match="holds no undesirable .label: false. answers"):
        _classes(write_recipe, tmp_path, 30, 0)


def test_the_plan_of_an_8b_qlora_kto_job_states_the_kl_sequences_the_classes_and_the_reference(tmp_path):
    same = {"gradient_checkpointing": True, "micro_batch_size": 2, "gradient_accumulation_steps": 4}
    data = SimpleNamespace(
        examples=10_000,
        total_tokens=5_000_000,
        mean_tokens=500.0,
        max_tokens=2048,
        over_max_length=0,
        tokens_source="tokenizer",
        labels={
            "desirable": 8_000,
            "undesirable": 2_000,
            "desirable_weight": 1.0,
            "undesirable_weight": 1.0,
            "ratio": 4.0,
            "in_range": False,
            "desirable_weight_range": [0.25, 0.33],
            "undesirable_weight_range": [3.0, 4.0],
        },
    )
    sft = article_plan(tmp_path, "1xRTX4090", data=data, **same)
    kto = article_plan(tmp_path, "1xRTX4090", objective="kto", data=data, **same)
    dpo = article_plan(tmp_path, "1xRTX4090", objective="dpo", **same)
    text = "\n".join(kto.reasons)
    assert kto.fits and "objective kto (trl's KTOTrainer): each example is one answer" in text
    assert "runs forward without a gradient through the policy and the reference" in text
    assert "a micro-batch of 2 examples runs 2 sequences with a gradient and 2 KL sequences" in text
    assert "8,000 desirable and 2,000 undesirable answers" in text and "undesirable_weight 3 to 4" in text
    assert "reference: the base model with the LoRA adapter switched off" in text
    loss = next(r for r in kto.reasons if r.startswith("loss:"))
    assert "TRL's fused LM head (trl's KTOTrainer" in loss and "the entropy is still logged" in loss
    # memory: one sequence with a gradient per example, as SFT (the KL and reference forwards keep no activations)
    assert kto.memory["breakdown_gb"]["activations"] == pytest.approx(sft.memory["breakdown_gb"]["activations"])
    assert "KL sequence" in kto.memory["explanations"]["activations"]
    # time: a LoRA step costs 3 forwards per token (the forward, the backward as much again, the recomputation); KTO
    # adds the reference's forward and the KL sequence's through the policy and the reference: 6, twice SFT's
    assert kto.estimate["hours"] / sft.estimate["hours"] == pytest.approx(2.0, rel=0.1)
    assert "each step" in text and dpo.fits
    assert any("learning_rate is the recipe's default" in n for n in kto.notes)


def test_an_undesirable_answer_is_no_reference_for_the_task_score():
    from launcher.data.task_examples import prompt_and_reference

    good = {"prompt": [_turn("user", "2+2?")], "completion": [_turn("assistant", "4")], "label": True}
    assert prompt_and_reference(good) == {"messages": [_turn("user", "2+2?")], "reference": "4"}
    assert prompt_and_reference(dict(good, completion=[_turn("assistant", "5")], label=False)) is None


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model

QUICK = ("smoke.enabled=false",)


def _kto(unpaired: Path) -> dict:
    return dict(
        objective="kto",
        data=str(unpaired),
        max_length=512,
        max_steps=24,
        learning_rate=2e-3,
        logging_steps=4,
        preference={"beta": 0.5},
        eval={
            "fraction": 0.05,
            "every_minutes": 10,
            "samples": 0,
            "task": {"examples": 10, "metric": "text", "baseline": "skip"},
        },
    )


def _train_rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in SAID} for r in metrics(run)]


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory, tiny_model, unpaired) -> Path:
    from conftest import uninterrupted_run

    return uninterrupted_run(tmp_path_factory, tiny_model, "kto", _kto(unpaired), *QUICK)


@pytest.mark.slow
def test_kto_trains_the_tiny_model_apart_from_its_undesirable_answers(kto_run, tmp_path):
    rows = metrics(kto_run)
    evals = [r for r in rows if "eval_rewards/margins" in r]
    train = [r for r in rows if "kl" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval_rewards/margins"] == 0.0  # the policy starts as its reference
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"] + 0.1, evals
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen"} <= set(train[-1])
    log = (kto_run / "train.log").read_text()
    assert "data as TRL prepared it: unpaired answers" in log and "each with its KL sequence" in log
    text = ftrun("status", kto_run, cwd=tmp_path).stdout
    assert "training answers" in text and "accuracy" not in text.split("rewards", 1)[1].split("\n", 1)[0], text
    # the task score: the held-out desirable answers as references (task_examples.prompt_and_reference)
    task = json.loads((kto_run / "final" / "task_eval.json").read_text())
    assert task["metric"] == "text" and task["examples"] == 10 and "fine_tuned" in task["scores"], task


@pytest.mark.slow
def test_the_smoke_test_measures_kto_on_its_longest_examples(write_recipe, tmp_path, unpaired):
    """`ftrun smoke`: the smoke sample (the longest examples first, read in order as KTOTrainer reads) trains its
    measured steps, with each micro-batch's KL sequences, and the smoke test's figures replace the sizer's."""
    recipe = write_recipe(**dict(_kto(unpaired), smoke={"min_steps": 3}))
    res = ftrun("smoke", recipe, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    smoke = json.loads((tmp_path / "run" / "smoke.json").read_text())
    assert smoke["measured_steps"] >= 2 and smoke["tokens_per_second"] > 0 and smoke["peak_memory_gb"] > 0, smoke
    log = (tmp_path / "run" / "smoke" / "smoke.log").read_text()
    assert "data as TRL prepared it: unpaired answers" in log and "each with its KL sequence" in log, log[-2000:]


@pytest.mark.slow
def test_kto_kill9_then_resume_matches_the_uninterrupted_run(write_recipe, tmp_path, kto_run, unpaired):
    recipe = write_recipe(**dict(_kto(unpaired), max_restarts=0, checkpoint_every_minutes=0.0001))
    assert ftrun(recipe, *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"

    def past_a_checkpoint(r: Path) -> bool:
        steps = [int(p.parent.name.split("-")[1]) for p in (r / "checkpoints").glob("step-*/manifest.json")]
        return bool(steps) and 6 <= max(steps) < 20 and max(steps) % 4 != 0  # inside a logging window

    st = freeze_worker(run, past_a_checkpoint, timeout=240)
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    assert "resuming from step-" in (run / "train.log").read_text()
    assert _train_rows(run) == _train_rows(kto_run)  # losses, rewards, KL, eval figures: exact on CPU
    a, b = adapter_tensors(kto_run), adapter_tensors(run)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
