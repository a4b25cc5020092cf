"""Every recipe field marked Secret (launcher/recipe_sections.py), given a recognisable value, stays in the run
directory: it never reaches publish's recipe, the trackers' config, the plan's output or the supervisor's log lines."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import yaml

from helpers import ftrun


def _secret_value(annotation, marker: str):
    """A value of the field's type whose every string is `marker`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return [_secret_value(args[0], marker)]
    if typing.get_origin(annotation) is typing.Union:
        return _secret_value(args[0], marker)
    assert annotation is str, f"a Secret field of type {annotation}: teach this test its values"
    return f"json://localhost:9/{marker}"  # a string every Secret field takes: notify: checks it is a URL


def _field(key: str):
    from launcher.recipe import Recipe

    model = Recipe
    *sections, name = key.split(".")
    for part in sections:
        model = model.model_fields[part].annotation
    return model.model_fields[name]


def _secret_recipe(write_recipe, tmp_path):
    from launcher.recipe import Recipe
    from launcher.recipe_loading import load_recipe
    from launcher.recipe_sections import secret_keys

    keys = secret_keys(Recipe)
    assert "on_finish" in keys
    fields: dict = {}
    markers = {}
    for key in keys:
        markers[key] = f"SECRET-{key.replace('.', '-')}-7f3a"
        *sections, name = key.split(".")
        owner = fields
        for part in sections:
            owner = owner.setdefault(part, {})
        owner[name] = _secret_value(_field(key).annotation, markers[key])
    path = write_recipe(**fields)
    return path, load_recipe(path), markers


def test_a_secret_field_reaches_neither_publish_nor_the_trackers_nor_the_logs(
    write_recipe, tmp_path, monkeypatch, capsys
):
    from launcher.deliver import publish
    from launcher.run import ending
    from launcher.run.supervisor_log import _log
    from launcher.worker import trackers

    path, recipe, markers = _secret_recipe(write_recipe, tmp_path)
    assert all(m in yaml.safe_dump(recipe.snapshot()) for m in markers.values())  # the run directory keeps them
    published = yaml.safe_dump(publish._public_recipe(recipe))
    sent = []
    monkeypatch.setattr(trackers, "_describe", lambda tracker, root, snapshot: sent.append(snapshot))
    callback = trackers.recipe_callback(tmp_path / "run", recipe)
    callback.on_train_begin(
        SimpleNamespace(report_to=["tensorboard"]), SimpleNamespace(is_world_process_zero=True), None
    )
    ending._on_finish(recipe, _log)  # a command named by a secret: it fails, and says so
    logged = capsys.readouterr().out
    assert "on_finish" in logged and "<secret>" in logged
    for key, marker in markers.items():
        assert marker not in published, key
        assert sent and marker not in yaml.safe_dump(sent[0]), key
        assert marker not in logged, key
        assert marker not in recipe.redact(f"a line about json://localhost:9/{marker}"), key


def test_a_secret_field_is_not_in_the_plans_output(write_recipe, tmp_path):
    path, _, markers = _secret_recipe(write_recipe, tmp_path)
    for args in (("plan", path), ("plan", path, "--json")):
        res = ftrun(*args, cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        for key, marker in markers.items():
            assert marker not in res.stdout + res.stderr, (args, key)


def test_the_mark_is_one_word_on_a_list_of_strings():
    from pydantic import Field

    from launcher.recipe_sections import Secret, Strict, secret_keys

    class Settings(Strict):
        notify: Secret[list[str]] = Field(default_factory=list)
        on_finish: list[list[str]] = Field(default_factory=list)

    assert secret_keys(Settings) == ["notify"]
    assert Settings(notify=["json://localhost:1/x"]).notify == ["json://localhost:1/x"]
