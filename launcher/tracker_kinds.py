"""The experiment trackers as a table: one row a tracker (tensorboard, wandb, mlflow, trackio), with what is imported
and what pip installs: the recipe's `report_to`, launcher/worker/trackers.py and pyproject.toml's `trackers` extra
derive from it. A root leaf.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tracker:
    name: str  # the recipe's report_to value, and transformers' report_to name
    module: str  # what is imported
    package: str  # what pip installs (the `trackers` extra of pyproject.toml lists it, tests/test_tables.py checks)
    what: str  # for the recipe's help ("" where the name says it)


TRACKERS: dict[str, Tracker] = {
    t.name: t
    for t in (
        Tracker("tensorboard", "tensorboard", "tensorboard", "event files in the run"),  # installed with ftrun[train]
        Tracker("wandb", "wandb", "wandb", ""),
        # mlflow-skinny: the client and its local file store, without the server and UI
        Tracker("mlflow", "mlflow", "mlflow-skinny", ""),
        Tracker("trackio", "trackio", "trackio", ""),
    )
}


def described() -> str:
    return ", ".join(f"{t.name} ({t.what})" if t.what else t.name for t in TRACKERS.values())
