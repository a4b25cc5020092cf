"""The command line's own words: an option given to the wrong command says which command has it; help texts read as
sentences."""

from __future__ import annotations

import argparse

import pytest

from launcher import cli


def test_an_option_of_another_command_names_that_command(capsys, tmp_path):
    recipe = str(tmp_path / "r.yaml")  # never read: the command line is refused first
    assert cli.main([recipe, "--gpus", "8xH100-80GB", "lora.r=8"]) == 2
    err = capsys.readouterr().err
    assert (
        "ftrun: usage error: --gpus is an option of `ftrun plan` (plan for another box than this machine's "
        "GPUs), not of `ftrun RECIPE`" in err
    ), err
    assert f"Fix: ftrun plan {recipe} lora.r=8 --gpus 8xH100-80GB;" in err and "usage:" not in err
    assert cli.main(["plan", recipe, "--foreground"]) == 2
    assert "--foreground is an option of `ftrun run` (stay attached), not of `ftrun plan`" in capsys.readouterr().err


def test_an_option_no_command_has_gets_argparses_usage(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(tmp_path / "r.yaml"), "--gpu", "8xH100-80GB"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --gpu 8xH100-80GB" in capsys.readouterr().err


def _helps(parser: argparse.ArgumentParser, name: str = "ftrun"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{name} {choice.dest}", choice.help
            for sub, subparser in action.choices.items():
                yield from _helps(subparser, f"{name} {sub}")
        elif action.help and action.help != argparse.SUPPRESS:
            yield f"{name} {'/'.join(action.option_strings) or action.dest}", action.help


def test_every_help_text_ends_as_a_sentence_part():
    helps = dict(_helps(cli._parser()))
    assert "ftrun plan --tokens" in helps and "ftrun plan" in helps
    dangling = {where: text for where, text in helps.items() if text.rstrip().endswith((":", ",", ";", "("))}
    assert dangling == {}


def test_one_epoch_one_word_and_explain_names_each_objectives_trainer_config(capsys, write_recipe, tiny_model):
    """Issue 46: "1 epochs", "1 words" read as typos; `ftrun explain` said SFTConfig for a key DPO checks against
    DPOConfig."""
    recipe = write_recipe(max_steps=None, epochs=1)
    assert cli.main(["plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert " x 1 epoch)" in out and "1 epochs" not in out, out
    assert cli.main(["explain"]) == 0
    explained = capsys.readouterr().out
    assert "SFTConfig (sft), DPOConfig (dpo), ORPOConfig (orpo)" in explained and "Extra TRL SFTConfig" not in explained
    from launcher.data.task_metrics import choose

    assert "(at most 1 word)" in choose(["yes", "no", "yes", "no"])[1]
