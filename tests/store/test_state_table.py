"""The run-state tables (launcher/store/state.py STATES and MOVES): every path the product takes is made of their rows,
a transition or a move they do not hold is refused with nothing written, and docs/architecture.md shows them as they
are."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.store.rundir import RunDir
from launcher.store.state import MOVES, STATES, TransitionError, move, read_state, set_state

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# Every path a run takes in the product, as the launch, the supervisor, `ftrun stop` and `ftrun export` write it, one
# move each (`end:STATE`: the move and the state it writes); a stop or kill -9 in each phase included (a killed run's
# state stays active and its resume writes planned).
PATHS = [
    ("plan", "smoke", "run", "run", "trained", "export:succeeded", "note", "end:succeeded"),  # launch to export
    ("plan", "smoke", "end:failed-smoke", "plan"),  # smoke test failed or Ctrl-C, then the same command
    ("plan", "smoke", "plan"),  # `ftrun smoke` passed; or killed during the smoke test, then resumed
    ("plan", "run", "recover", "run", "end:failed"),  # a crash restarted, then a crash limit
    ("plan", "run", "note", "recover", "end:stopped", "plan"),  # `ftrun stop` while recovering, then a resume
    ("plan", "run", "recover", "end:failed"),  # a rank left behind after a crash
    ("plan", "run", "recover", "plan"),  # supervisor killed while recovering, then a resume
    ("plan", "run", "note", "end:stopped", "plan", "run"),  # `ftrun stop` while training, then a resume
    ("plan", "run", "end:preempted", "plan"),  # the provider's SIGTERM
    ("plan", "run", "plan"),  # kill -9 of the supervisor while training, then the same command
    ("plan", "run", "end:failed", "plan", "run"),  # out of memory with the recipe's own settings, then a resume
    # the export failed its check, `ftrun export` retried it and it failed again, then passed; then `ftrun publish`
    (
        "plan",
        "run",
        "trained",
        "export:trained-not-exported",
        "export:trained-not-exported",
        "export:succeeded",
        "note",
    ),
    ("plan", "run", "trained", "export:succeeded", "plan", "run", "trained"),  # killed while exporting, resumed
    ("plan", "run", "end:stopped", "note"),  # stopped after the final result was saved; a fetched run's pids cleared
    ("plan", "plan", "smoke", "run"),  # `ftrun baseline` first
]


def entered_by(state: str) -> list[str]:
    """The moves that write `state` (the doc's table shows them beside each state)."""
    return [name for name, m in MOVES.items() if state in m.to]


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_every_path_the_product_takes_is_made_of_the_tables_rows(tmp_path, path):
    run = RunDir(tmp_path)
    states = []
    for step in path:
        name, _, to = step.partition(":")
        states.append(move(run, name, to or None, reason=step)["state"])
    assert [h["state"] for h in read_state(run)["history"]] == [
        s for i, s in enumerate(states) if i == 0 or s != states[i - 1]
    ]


@pytest.mark.parametrize("was,to", [("failed", "running"), ("succeeded", "failed"), ("planned", "stopped")])
def test_a_transition_the_table_does_not_hold_is_refused_and_nothing_written(tmp_path, was, to):
    run = RunDir(tmp_path)
    set_state(run, was, reason="before")
    with pytest.raises(TransitionError) as err:
        set_state(run, to, reason="after")
    assert f"from {was} to {to}" in err.value.message
    assert read_state(run)["state"] == was and read_state(run)["reason"] == "before"


@pytest.mark.parametrize(
    "was,name,to", [("running", "end", "running"), ("running", "export", None), ("smoking", "smoke", "planned")]
)
def test_a_move_that_does_not_write_that_state_is_refused_and_nothing_written(tmp_path, was, name, to):
    run = RunDir(tmp_path)
    set_state(run, was, reason="before")
    with pytest.raises(TransitionError) as err:
        move(run, name, to, reason="after")
    assert f"the run-state move {name} cannot write {to}" in err.value.message
    assert read_state(run)["state"] == was and read_state(run)["reason"] == "before"


def test_every_state_is_entered_by_a_move_and_allows_only_states_of_the_table():
    for name, row in STATES.items():
        assert set(row.next) <= set(STATES) and name not in row.next and entered_by(name), name
    for name, row in MOVES.items():
        assert set(row.to) <= set(STATES) and row.by, name


def test_the_architecture_doc_shows_the_tables_as_they_are():
    text = DOC.read_text()
    states = ["| state | entered by (move) | allows next |", "|---|---|---|"]
    states += [
        f"| `{n}` | {', '.join(f'`{m}`' for m in entered_by(n))} | {', '.join(f'`{x}`' for x in r.next)} |"
        for n, r in STATES.items()
    ]
    moves = ["| move | writes | made by |", "|---|---|---|"]
    moves += [
        f"| `{n}` | {', '.join(f'`{x}`' for x in m.to) or 'the state it finds'} | {m.by} |" for n, m in MOVES.items()
    ]
    for rows in (states, moves):
        assert "\n".join(rows) in text, "docs/architecture.md's run-state tables differ from state.py:\n" + "\n".join(
            rows
        )
