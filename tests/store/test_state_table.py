"""The run-state table (launcher/store/state.py STATES): the only writer refuses what it does not hold, every
transition the product makes is in it, and docs/architecture.md shows it as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.store.rundir import RunDir
from launcher.store.state import STATES, TransitionError, read_state, set_state

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# Every path a run takes in the product, as the launch, the supervisor, `ftrun stop` and `ftrun export` write it;
# a stop or kill -9 in each phase included (a killed run's state stays active and its resume writes planned).
PATHS = [
    ("planned", "smoking", "running", "running", "succeeded"),  # launch, supervisor's first attempt, training done
    ("planned", "smoking", "failed-smoke", "planned"),  # smoke test failed or Ctrl-C, then the same command
    ("planned", "smoking", "planned"),  # `ftrun smoke` passed; or killed during the smoke test, then resumed
    ("planned", "running", "recovering", "running", "failed"),  # a crash restarted, then a crash limit
    ("planned", "running", "recovering", "stopped", "planned"),  # `ftrun stop` while recovering, then a resume
    ("planned", "running", "recovering", "failed"),  # a rank left behind after a crash
    ("planned", "running", "recovering", "planned"),  # supervisor killed while recovering, then a resume
    ("planned", "running", "stopped", "planned", "running"),  # `ftrun stop` while training, then a resume
    ("planned", "running", "preempted", "planned"),  # the provider's SIGTERM
    ("planned", "running", "planned"),  # kill -9 of the supervisor while training, then the same command
    ("planned", "running", "succeeded", "trained-not-exported", "succeeded"),  # export failed, `ftrun export`
    ("planned", "running", "succeeded", "planned", "running", "succeeded"),  # killed while exporting, resumed
    ("planned", "planned", "smoking", "running"),  # `ftrun baseline` first
]


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_every_transition_the_product_makes_is_in_the_table(tmp_path, path):
    run = RunDir(tmp_path)
    for state in path:
        set_state(run, state, reason=f"to {state}")
    assert [h["state"] for h in read_state(run)["history"]] == [
        s for i, s in enumerate(path) if s != path[i - 1] or i == 0
    ]


@pytest.mark.parametrize("was,to", [("failed", "running"), ("succeeded", "failed"), ("planned", "stopped")])
def test_a_transition_the_table_does_not_hold_is_refused_and_nothing_written(tmp_path, was, to):
    run = RunDir(tmp_path)
    set_state(run, was, reason="before")
    with pytest.raises(TransitionError) as err:
        set_state(run, to, reason="after")
    assert f"from {was} to {to}" in err.value.message
    assert read_state(run)["state"] == was and read_state(run)["reason"] == "before"


def test_every_state_allows_only_states_of_the_table():
    for name, row in STATES.items():
        assert set(row.next) <= set(STATES) and name not in row.next and row.entered, name


def test_the_architecture_doc_shows_the_table_as_it_is():
    rows = ["| state | entered by | allows next |", "|---|---|---|"]
    rows += [f"| `{n}` | {r.entered} | {', '.join(f'`{x}`' for x in r.next)} |" for n, r in STATES.items()]
    assert "\n".join(rows) in DOC.read_text(), (
        "docs/architecture.md's run-state table differs from STATES:\n" + "\n".join(rows)
    )
