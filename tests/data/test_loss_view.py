"""What the loss sees: the marked tokens equal TRL's own labels on every chat template family, and the data check
refuses, with the example that shows it, data that trains nothing, never teaches the model to stop, or loses its
answers to max_length."""

from pathlib import Path

import pytest

from chat_templates import CHAT_FAMILIES, FAMILIES, broken_template, build_tokenizer, conversation, write_jsonl
from launcher.data import loss_view
from launcher.data.loss_view import CUT_SHARE_LIMIT, EMPTY_SHARE_LIMIT, LossView, Settings, check, render_segments
from launcher.errors import DataError

LONG = " ".join(["the capital of France is Paris and the capital of Chile is Santiago"] * 12)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: str(build_tokenizer(root / name, name)) for name in FAMILIES}


def _example(family: str, answer: str = "Paris.", question: str = "The capital of France?", turns: int = 1) -> dict:
    if FAMILIES[family].template is None:
        return {"prompt": question + " ", "completion": answer}
    return conversation(family, answer, question, turns)


def _prompt_completion(family: str, prompt: str, completion: str) -> dict:
    if FAMILIES[family].template is None:
        return {"prompt": prompt, "completion": completion}
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": completion}],
    }


def _check(model, examples, **settings):
    settings.setdefault("max_length", 4096)
    where = [f"d.jsonl line {i + 1}" for i in range(len(examples))]
    return check(model, Settings(**settings), examples, where)


def _refusal(model, examples, **settings) -> str:
    with pytest.raises(DataError) as err:
        _check(model, examples, **settings)
    assert err.value.fix and err.value.exit_code == 2
    return err.value.message + "\n" + err.value.fix


# -- the marks are TRL's labels --------------------------------------------------------------------------------


def _trl_labels(folder: str, examples: list, tmp_path, **fields):
    """TRL 1.16's own preparation (SFTTrainer._prepare_dataset, the function the worker's trainer runs) of the
    examples, and the chat template the trainer would use (its __init__: the training template for
    assistant_only_loss)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    from launcher.data.dataset import to_dataset

    tok = AutoTokenizer.from_pretrained(folder)
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **fields)
    swap = args.assistant_only_loss and not has_generation_markers(tok.chat_template)
    trainer = SimpleNamespace(
        _tokenizer=tok,
        chat_template=get_training_chat_template(tok) if swap else None,
        completion_only_loss=("prompt" in examples[0])
        if args.completion_only_loss is None
        else args.completion_only_loss,
    )
    prepared = SFTTrainer._prepare_dataset(trainer, to_dataset(examples), tok, args, args.packing, None, "train")
    return [(row["input_ids"], [lab != -100 and i > 0 for i, lab in enumerate(row["labels"])]) for row in prepared]


CASES = (
    [(f, "chat", False) for f in CHAT_FAMILIES]
    + [("qwen3", "chat", True), ("gemma", "chat", True)]
    + [(f, "prompt_completion", False) for f in FAMILIES]
    + [("base", "text", False)]
)


@pytest.mark.parametrize("family,form,assistant_only", CASES)
def test_marks_equal_what_trl_trains(tokenizers, tmp_path, family, form, assistant_only):
    if form == "chat":
        examples = [_example(family, turns=2), _example(family, "It is 4.", "What is 2 + 2?")]
    elif form == "prompt_completion":
        examples = [
            _prompt_completion(family, "The capital of France is", " Paris."),
            _prompt_completion(family, "Reverse lamp:", " pmal"),
        ]
    else:
        examples = [{"text": "The capital of France is Paris."}, {"text": "Reverse the word lamp: pmal."}]
    # truncation included: max_length cuts the end of the first example's last answer
    short = (
        LossView(tokenizers[family], Settings(max_length=None, assistant_only_loss=assistant_only))
        .mark(examples[0])
        .length
        - 3
    )
    view = LossView(tokenizers[family], Settings(max_length=short, assistant_only_loss=assistant_only))
    ours = [view.mark(e) for e in examples]
    assert ours[0].cut and not any(m.empty for m in ours)
    theirs = _trl_labels(tokenizers[family], examples, tmp_path, max_length=short, assistant_only_loss=assistant_only)
    assert len(theirs) == len(ours)
    for m, (ids, trained) in zip(ours, theirs):
        assert m.ids == ids
        assert m.trained == trained
        assert "".join(m.pieces).strip()  # the pieces read as the text


# -- no token trained ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_examples_that_train_nothing_are_refused_above_the_limit(tokenizers, family):
    ok = [_prompt_completion(family, "The capital of France is", " Paris.")] * 99
    long_prompt = _prompt_completion(family, LONG, " Paris.")
    # one in a hundred (the limit) passes, with the count in the statistics
    record = _check(tokenizers[family], ok + [long_prompt], max_length=160)
    assert record["stats"]["empty"] == 1 and 1 / 100 <= EMPTY_SHARE_LIMIT
    msg = _refusal(tokenizers[family], ok[:90] + [long_prompt] * 10, max_length=160)
    assert msg.startswith("d.jsonl line 91: no token of this example is trained")
    assert "10 of 100 examples" in msg and "1%" in msg and "max_length=" in msg
    assert loss_view.OPEN not in msg.split(":\n", 1)[1].split("\n")[0]  # the example shown has no trained span


def test_assistant_only_loss_on_an_example_without_an_assistant_turn(tokenizers):
    bad = {"messages": [{"role": "user", "content": "hello"}]}
    msg = _refusal(tokenizers["qwen3"], [_example("qwen3"), bad], assistant_only_loss=True)
    assert msg.startswith("d.jsonl line 2: no token is trained") and "TRL stops at the first" in msg


def test_assistant_only_loss_needs_generation_markers_trl_can_supply(tokenizers):
    # Llama 3.1's template has no {% generation %} markers and TRL 1.16 has no training template for it
    msg = _refusal(tokenizers["llama3"], [_example("llama3")], assistant_only_loss=True)
    assert "no {% generation %} markers" in msg


# -- the end of turn -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_each_family_ends_its_trained_turns_with_its_end_of_turn_token(tokenizers, family):
    view = LossView(tokenizers[family], Settings(max_length=4096))
    assert view.eot == FAMILIES[family].end_of_turn
    record = _check(tokenizers[family], [_example(family, turns=2)])
    assert record["end_of_turn"] == FAMILIES[family].end_of_turn


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_a_template_that_drops_the_end_of_turn_token_is_refused(tmp_path, family):
    folder = build_tokenizer(tmp_path / family, family, template=broken_template(family))
    msg = _refusal(str(folder), [_example(family)] * 3)
    assert msg.startswith("d.jsonl line 1: the trained part of an assistant turn ends with")
    assert "never learns to stop" in msg and "no end-of-turn token" in msg
    assert "Paris." in msg  # the example


def test_an_end_of_turn_token_outside_the_generation_block_is_refused(tmp_path):
    # the classic: {% generation %} around the content only, <|im_end|> after it (TRL 1.16 only warns)
    template = FAMILIES["qwen3"].template
    template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{%- generation %}{{- m.content }}{%- endgeneration %}{{- '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}"
    )
    folder = build_tokenizer(tmp_path / "chatml", "qwen3", template=template)
    msg = _refusal(str(folder), [_example("qwen3")], assistant_only_loss=True)
    assert "ends with 'Paris.'" in msg and "<|im_end|> is not in the trained part" in msg
    assert "[[Paris.]]<|im_end|>" in msg


def test_a_base_model_whose_eos_is_not_one_token_is_refused(tmp_path):
    import json

    folder = build_tokenizer(tmp_path / "base", "base")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "</eos>"}))  # not in the vocabulary
    msg = _refusal(str(folder), [{"text": "The capital of France is Paris."}])
    assert "'</eos>' is not one token" in msg


def test_a_chat_dataset_on_a_model_without_a_chat_template_is_refused(tokenizers):
    msg = _refusal(tokenizers["base"], [conversation("qwen3")])
    assert "has no chat template" in msg


# -- max_length cuts the answers -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_max_length_that_cuts_too_many_answers_is_refused(tokenizers, family):
    short = [_example(family)] * 95
    long = _example(family, LONG)
    limit = LossView(tokenizers[family], Settings(max_length=None)).mark(short[0]).length + 20
    record = _check(tokenizers[family], short + [long] * 5, max_length=limit)  # 5 of 100: the limit
    assert record["stats"]["cut"] == 5 and 5 / 100 <= CUT_SHARE_LIMIT
    msg = _refusal(tokenizers[family], short[:90] + [long] * 10, max_length=limit)
    assert msg.startswith(
        f"d.jsonl line 91: max_length {limit} cuts the trained part of 10 of 100 examples (10.0%, "
        "more than max_length_may_cut=0.05 allows)"
    )
    longest = LossView(tokenizers[family], Settings(max_length=None)).mark(long).length
    assert f"{longest} keeps all of them" in msg and "(p99)" in msg and "max_length_may_cut=0.10" in msg
    # the recipe's key allows more, or none
    assert _check(tokenizers[family], short[:90] + [long] * 10, max_length=limit, may_cut=0.1)["stats"]["cut"] == 10
    assert "more than max_length_may_cut=0 allows" in _refusal(
        tokenizers[family], short + [long], max_length=limit, may_cut=0.0
    )


# -- the example shown, the statistics -------------------------------------------------------------------------


def test_one_example_per_source_and_the_statistics(tokenizers, tmp_path):
    from launcher.data.dataset import load_data

    a = write_jsonl(tmp_path / "a.jsonl", [_example("qwen3")] * 3)
    b = write_jsonl(tmp_path / "b.jsonl", [_example("qwen3", "It is 4.", "What is 2 + 2?")] * 2)
    data = load_data([str(a), str(b)])
    record = check(
        tokenizers["qwen3"],
        Settings(max_length=4096, assistant_only_loss=True),
        data.examples,
        data.where,
        data.origin,
        [s["source"] for s in data.sources],
    )
    assert [e["where"] for e in record["examples"]] == ["a.jsonl line 1", "b.jsonl line 1"]
    stats = record["stats"]
    assert stats["examples"] == 5 and 0 < stats["trained_share"] < 0.5
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] and stats["truncated"] == 0
    plain = render_segments(record["examples"][1]["segments"])
    assert "It is 4.<|im_end|>\n]]" in plain and "\x1b[" not in plain
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n[[" in plain  # the prompt is not trained
    coloured = render_segments(record["examples"][1]["segments"], color=True)
    assert "It is 4.<|im_end|>\n" + loss_view.RESET in coloured and loss_view.TRAINED_STYLE in coloured
    assert "[[" not in coloured


def test_no_tokenizer_no_view(tmp_path):
    assert _check(str(tmp_path / "nothing-here"), [_example("qwen3")]) is None


def test_a_long_example_is_shown_compactly():
    text = render_segments([("a" * 3000, False), ("b" * 3000, True)], limit=300)
    assert len(text) < 400 and "characters) ..." in text and text.endswith("]]")


# -- the commands ----------------------------------------------------------------------------------------------


def test_ftrun_data_shows_the_example_and_the_statistics(write_recipe, capsys):
    from launcher.cli import main

    recipe = write_recipe(assistant_only_loss=True, max_length=512)
    assert main(["data", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "--- tiny-chat.jsonl line 1:" in out and "[[" in out and "\x1b[" not in out  # a pipe: brackets
    assert "length in tokens: p50 " in out and "truncated by max_length 512: 0" in out


def test_a_refused_launch_exits_2_and_touches_nothing(write_recipe, tmp_path, capsys):
    from launcher.cli import main

    recipe = write_recipe(max_length=64)  # cuts most of the tiny data's answers
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "ftrun: data error: tiny-chat.jsonl line " in err and "max_length 64 cuts the trained part" in err
    assert "Fix: raise max_length: " in err
    assert not (tmp_path / "run").exists()


def test_the_data_line_says_how_many_train_and_how_many_are_held_out(tmp_path):
    """`ftrun data` and the launch open with the data's count; the tokens are the training examples': the line
    says how many train and how many are held out, copies of a held-out example included (they leave training
    with it), so no count on the screen contradicts another."""
    from launcher.data.stats import data_stats
    from launcher.recipe_loading import load_recipe
    from launcher.run.data_view import data_line

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml")
    _, _, stats = data_stats(recipe)
    line = data_line(stats)
    assert stats.examples + stats.held_out_lines == 400 and stats.held_out_lines >= stats.held_out > 0
    assert f"400 examples; {stats.examples} train, {stats.held_out} are held out for evaluation" in line
    extra = stats.held_out_lines - stats.held_out
    assert (f"and {extra} cop" in line) == (extra > 0), line
    assert f"{stats.total_tokens:,} tokens per epoch" in line


# What the loss trains when the recipe leaves assistant_only_loss out: the answers, where the template can mark them


def test_left_out_the_answers_train_where_the_template_marks_them(tokenizers):
    seen = _check(tokenizers["qwen3"], [_example("qwen3")], assistant_only_loss=None)
    assert seen["assistant_only_loss"] is True
    assert seen["mode"].startswith("assistant turns only (the default where the chat template marks the answers")
    assert "LLaMA-Factory (train_on_prompt: false)" in seen["mode"]
    whole = _check(tokenizers["qwen3"], [_example("qwen3")], assistant_only_loss=False)
    assert seen["stats"]["trained_tokens"] < whole["stats"]["trained_tokens"]
    assert whole["mode"] == "the whole conversation (assistant_only_loss: false)" and not whole["assistant_only_loss"]


def test_left_out_the_whole_conversation_trains_where_the_template_cannot_mark_answers_and_says_why(tokenizers):
    # Mistral v0.1's template has no {% generation %} blocks and TRL has no training template for it: with
    # assistant_only_loss: true that is refused (test above); left out, the whole conversation trains, said
    seen = _check(tokenizers["mistral"], [_example("mistral")], assistant_only_loss=None)
    assert seen["assistant_only_loss"] is False
    assert "the whole conversation (assistant_only_loss left out, and answers-only loss cannot be had: " in seen["mode"]
    assert "has no {% generation %} markers and TRL has no training template for it" in seen["mode"]
    # Qwen3 multi-turn: TRL's training template writes a thinking block into the earlier answers, which the model's
    # own (served) template leaves out: the whole conversation, said, rather than prompts the model is never asked
    multi = _check(tokenizers["qwen3"], [_example("qwen3"), _example("qwen3", turns=2)], assistant_only_loss=None)
    assert multi["assistant_only_loss"] is False
    assert "TRL's training template for" in multi["mode"] and "renders d.jsonl line 2 otherwise" in multi["mode"]
    # prompt/completion data train the completion either way; packing keeps the whole conversation
    pc = _check(tokenizers["qwen3"], [_prompt_completion("qwen3", "2+2?", "4")], assistant_only_loss=None)
    assert pc["mode"] == "the completion only" and pc["assistant_only_loss"] is False
    packed = _check(tokenizers["qwen3"], [_example("qwen3")], assistant_only_loss=None, packing=True)
    assert "packing: true" in packed["mode"] and packed["assistant_only_loss"] is False


def test_a_run_begun_under_the_old_default_resumes_with_what_it_recorded(tmp_path):
    import yaml

    from launcher.recipe_loading import validate_recipe
    from launcher.run.adjustments import with_adjustments, with_loss_resolved
    from launcher.store.rundir import RunDir

    def recipe(**more):
        return validate_recipe(
            {"model": "Qwen/Qwen3-0.6B", "method": "lora", "data": "d.jsonl", **more},
            base_dir=tmp_path,
            default_name="t",
        )

    left_out = recipe()
    assert left_out.assistant_only_loss is None
    # a run begun when the whole conversation was the default: its recipe.yaml holds assistant_only_loss: false
    old = recipe(assistant_only_loss=False)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text(yaml.safe_dump(old.snapshot()))
    resumed = with_adjustments(run, left_out)
    assert resumed.assistant_only_loss is False and resumed.trajectory_hash() == old.trajectory_hash()
    # a new run records what the data check resolved; a key the recipe gives wins over both
    assert with_loss_resolved(left_out, {"assistant_only_loss": True}).assistant_only_loss is True
    assert with_loss_resolved(left_out, None).assistant_only_loss is False
    assert with_adjustments(run, recipe(assistant_only_loss=True)).assistant_only_loss is True


def test_assistant_only_loss_on_plain_data_is_refused_before_training(tokenizers):
    # trl 1.16 raises on it in SFTTrainer.__init__, after the model has loaded
    with pytest.raises(DataError) as err:
        _check(tokenizers["qwen3"], [{"text": "Once upon a time."}], assistant_only_loss=True)
    assert "TRL marks the assistant turns of conversations only" in str(err.value)
