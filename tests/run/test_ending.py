"""Every ending through one door (launcher/run/ending.py), told to the recipe's notify: URLs through Apprise's json://
form, against a local HTTP server; the URLs refused at plan time when Apprise cannot parse them, and never published."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from launcher.errors import RecipeError, SmokeError
from launcher.recipe_loading import load_recipe
from launcher import notify
from launcher.run import ending, smoke_replan, supervisor
from launcher.run.ending import Ending
from launcher.store.rundir import RunDir
from launcher.store.state import move, read_state, set_state


@pytest.fixture
def inbox():
    """A local HTTP server keeping each JSON body posted to it; yields (url, messages)."""
    messages: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            messages.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"json://127.0.0.1:{server.server_port}/hook", messages
    server.shutdown()


def _run(write_recipe, url, state="running"):
    recipe_path = write_recipe(notify=[url, "json://127.0.0.1:9/nobody-listens"])
    run = RunDir(recipe_path.parent / "run")
    run.root.mkdir()
    run.recipe.write_text(recipe_path.read_text())
    run.plan.write_text(json.dumps({"total_steps": 12}))
    set_state(run, "planned")
    if state != "planned":
        set_state(run, state)
    return run, load_recipe(run.recipe)


ENDINGS = [
    ("failed", "the worker crashed 3 times at step 4", 5),
    ("failed", "out of memory at step 7 with the recipe's own settings", 5),
    ("stopped", "stopped by `ftrun stop` at step 5 after a checkpoint (step-000005)", 77),
    ("preempted", "preempted (SIGTERM) at step 5 after a checkpoint (step-000005)", 77),
    ("stopped", "stopped by SIGTERM while recovering", 77),
]


@pytest.mark.parametrize("state,reason,code", ENDINGS)
def test_every_ending_of_the_supervisor_leaves_through_the_door_and_is_told(
    write_recipe, inbox, monkeypatch, capsys, state, reason, code
):
    url, messages = inbox
    run, _recipe = _run(write_recipe, url)
    monkeypatch.setattr(supervisor, "_attempts", lambda *a: Ending(state, reason, code))
    assert supervisor.supervise(run.root) == code
    assert read_state(run)["state"] == state and read_state(run)["reason"] == reason
    assert len(messages) == 1 and reason in messages[0]["message"], messages
    assert run.root.name in messages[0]["title"]
    said = capsys.readouterr().out.splitlines()  # the supervisor's log (train.log)
    # the unreachable URL is logged by its place, never by its text, and changes nothing
    assert any(line.endswith("notify[0]: sent") for line in said), said
    assert any("notify[1]: not sent" in line for line in said), said
    assert not any("127.0.0.1" in line for line in said), said


def test_a_trained_run_is_told_with_its_summary_and_an_export_that_failed(write_recipe, inbox, monkeypatch):
    url, messages = inbox
    run, recipe = _run(write_recipe, url)
    with run.metrics.open("w") as fh:
        for step, loss in ((1, 2.5), (12, 1.25)):
            fh.write(json.dumps({"step": step, "loss": loss}) + "\n")
    set_state(run, "succeeded", reason="training finished")
    assert ending.leave(run, recipe, Ending("succeeded", None, 0), log=lambda _: None) == 0
    set_state(run, "trained-not-exported", reason="trained, not exported: the GGUF failed its check")
    assert ending.leave(run, recipe, Ending("trained-not-exported", None, 5), log=lambda _: None) == 5
    assert [m["title"].split(":")[1].strip() for m in messages] == ["run finished", "run finished (its export failed)"]
    assert "loss      2.5000 (step 1) -> 1.2500 (step 12)" in messages[0]["message"]
    assert "the GGUF failed its check" in messages[1]["message"]


def test_the_final_copy_off_the_box_keeps_the_exports_reason(write_recipe, inbox, tmp_path):
    """With sync.to, the door adds the copy's progress to the state's reason; a run trained, not exported, still
    says why its export failed (the reason the supervisor's export, or `ftrun export`, wrote)."""
    from launcher.store.sync import Syncer

    url, messages = inbox
    offbox = tmp_path / "offbox"
    recipe_path = write_recipe(notify=[url], sync={"to": str(offbox)})
    run = RunDir(recipe_path.parent / "run")
    run.root.mkdir()
    run.recipe.write_text(recipe_path.read_text())
    run.plan.write_text(json.dumps({"total_steps": 12}))
    recipe = load_recipe(run.recipe)
    set_state(run, "planned")
    set_state(run, "running")
    move(run, "trained", reason="training finished")
    why = "trained, not exported: the GGUF failed its check"
    move(run, "export", "trained-not-exported", reason=why)
    syncer = Syncer(run, str(offbox), keep=2, log=lambda _: None)
    assert ending.leave(run, recipe, Ending("trained-not-exported", None, 5), syncer, log=lambda _: None) == 5
    state = read_state(run)
    assert state["state"] == "trained-not-exported"
    assert state["reason"] == f"{why}; result verified at {offbox}", state
    assert json.loads((offbox / "state.json").read_text())["reason"] == state["reason"]  # the copy says so too
    assert "the GGUF failed its check" in messages[0]["message"]


def test_a_trained_run_that_the_supervisor_ends_leaves_through_the_door(write_recipe, inbox, monkeypatch):
    """The supervisor's trained endings: its export wrote the state (the move `export`), the door tells it."""
    url, messages = inbox
    run, _recipe = _run(write_recipe, url)
    move(run, "trained", reason="training finished")

    def exported(*args):
        move(run, "export", "trained-not-exported", reason="trained, not exported: the merge ran out of memory")
        return Ending("trained-not-exported", None, 5)

    monkeypatch.setattr(supervisor, "_attempts", exported)
    assert supervisor.supervise(run.root) == 5
    assert read_state(run)["state"] == "trained-not-exported"
    assert messages[0]["title"].endswith("run finished (its export failed): run"), messages
    assert "the merge ran out of memory" in messages[0]["message"]


def test_ftrun_export_by_hand_leaves_through_the_door_failed_or_passed(write_recipe, inbox, monkeypatch, tmp_path):
    """`ftrun export` on a trained run: a failure is told, recorded, and raised as before; a pass afterwards is told
    too; on_finish, which ran as the supervisor ended, is not run again (it may stop the box the user works on)."""
    import launcher.deliver.export  # noqa: F401  imported before the patch below: it binds check_inputs by name
    from launcher.deliver import export_inputs
    from launcher.deliver.messages import ExportError
    from launcher.run.after_training import export_command

    url, messages = inbox
    touched = tmp_path / "on_finish-ran"
    recipe_path = write_recipe(notify=[url], on_finish=[["touch", str(touched)]])
    run = RunDir(recipe_path.parent / "run")
    run.root.mkdir()
    run.recipe.write_text(recipe_path.read_text())
    for name, to in (("plan", None), ("run", None), ("trained", None), ("export", "trained-not-exported")):
        move(run, name, to, reason=name)
    monkeypatch.setattr(export_inputs, "check_inputs", lambda *a: None)

    def fails(*args):
        raise ExportError("the GGUF does not match its reference: top-1 agreement 0.41", fix="see export.json")

    monkeypatch.setattr("launcher.deliver.export.export_run", fails)
    with pytest.raises(ExportError):
        export_command(run, gguf="q8_0")
    state = read_state(run)
    assert state["state"] == "trained-not-exported" and state["export"]["state"] == "failed", state
    assert len(messages) == 1 and messages[0]["title"].endswith("run finished (its export failed): run"), messages
    assert "top-1 agreement 0.41" in messages[0]["message"]

    monkeypatch.setattr("launcher.deliver.export.export_run", lambda *a: {"outputs": {}, "serving": "SERVING.md"})
    assert export_command(run) == 0
    assert read_state(run)["state"] == "succeeded" and read_state(run)["export"]["state"] == "succeeded"
    assert len(messages) == 2 and messages[1]["title"].endswith("run finished: run"), messages
    assert not touched.exists()


def test_a_smoke_test_that_fails_before_the_supervisor_leaves_through_the_door(write_recipe, inbox, monkeypatch):
    url, messages = inbox
    run, recipe = _run(write_recipe, url, state="planned")

    def fails(*args, **kw):
        raise SmokeError("the smoke test's loss was NaN at step 2", fix="lower the learning rate")

    monkeypatch.setattr("launcher.run.smoke.run_smoke", fails)
    with pytest.raises(SmokeError):
        smoke_replan._smoke(run, recipe, {}, [], [], None)
    assert read_state(run)["state"] == "failed-smoke"
    assert len(messages) == 1 and "smoke test FAILED" in messages[0]["message"], messages
    assert "loss was NaN" in messages[0]["message"]


def test_a_url_apprise_cannot_parse_is_refused_by_its_place(tmp_path):
    notify.check([])  # nothing to check: apprise not even imported
    with pytest.raises(RecipeError) as err:
        notify.check(["json://127.0.0.1/ok", "nosuchservice://token"])
    assert "notify[1] (nosuchservice://...)" in err.value.message and "notify[1]" in err.value.fix
    assert "//token" not in err.value.message  # the rest of a URL may be a secret: the error names the scheme


@pytest.mark.parametrize("notify_value", [["json://127.0.0.1/ok", "nosuchservice://s3cr3t"], "ntfy://s3cr3t"])
def test_a_recipe_with_a_bad_notify_is_refused_as_it_loads_with_its_other_errors_and_no_url(write_recipe, notify_value):
    """Every command loads the recipe first: `ftrun plan` and the launch refuse it before any GPU time, all its
    problems at once, and neither Apprise's refusal nor a wrong type shows the value (a Secret field)."""
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(notify=notify_value, learning_rate="fast"))
    text = err.value.message + err.value.fix
    assert "'notify' = <secret>" in text and "learning_rate" in text and "s3cr3t" not in text, text


def test_the_published_recipe_and_the_tracker_config_leave_notify_out(write_recipe):
    from launcher.deliver.publish import _public_recipe

    recipe = load_recipe(write_recipe(notify=["json://127.0.0.1/secret-token"]))
    assert recipe.notify and "notify" not in _public_recipe(recipe)


@pytest.mark.slow
def test_a_real_run_tells_its_passed_smoke_test_and_its_end(write_recipe, inbox, capsys):
    """The whole foreground path (the CLI, the smoke test, the supervisor in this process, a real worker): one
    message when the smoke test passed, with the forecast, and one at the end, with the loss; no log names the URL."""
    from launcher.cli import main

    url, messages = inbox
    recipe = write_recipe(max_steps=4, notify=[url])
    assert main([str(recipe), "--foreground"]) == 0
    assert [m["title"].split(":")[1].strip() for m in messages] == ["smoke test passed", "run finished"], messages
    assert "full run:" in messages[0]["message"] and "loss" in messages[1]["message"]
    assert "127.0.0.1" not in capsys.readouterr().out + (recipe.parent / "run" / "train.log").read_text()
