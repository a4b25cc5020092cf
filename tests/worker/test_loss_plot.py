"""loss.png's redrawing during a run: at most one drawing per REDRAW_EVERY_SECONDS, and the finished run's plot
drawn from every row."""

from __future__ import annotations

from pathlib import Path

from launcher.worker import loss_plot


class _Child:
    def __init__(self, argv, **_):
        self.argv, self.done = argv, False

    def poll(self):
        return 0 if self.done else None

    def wait(self, timeout=None):
        self.done = True
        return 0


def test_checkpoints_closer_than_the_interval_draw_once_and_the_end_draws_what_came_since(monkeypatch, tmp_path):
    clock = {"now": 1000.0}
    started: list[_Child] = []

    def popen(argv, **kw):
        started.append(_Child(argv, **kw))
        return started[-1]

    monkeypatch.setattr(loss_plot.subprocess, "Popen", popen)
    monkeypatch.setattr(loss_plot.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(loss_plot, "_PLOT", {"child": None, "pending": False, "started": None})

    def checkpoint_at(t: float) -> None:
        clock["now"] = 1000.0 + t
        loss_plot._redraw_loss_plot(Path(tmp_path))

    checkpoint_at(0)
    assert len(started) == 1 and started[0].argv[-1] == str(tmp_path)
    started[0].done = True  # the drawing ended, but a checkpoint a second later still waits for the interval
    checkpoint_at(1)
    checkpoint_at(loss_plot.REDRAW_EVERY_SECONDS - 1)
    assert len(started) == 1
    checkpoint_at(loss_plot.REDRAW_EVERY_SECONDS + 1)
    assert len(started) == 2
    checkpoint_at(loss_plot.REDRAW_EVERY_SECONDS + 2)  # skipped: the end must draw it
    loss_plot._redraw_loss_plot(Path(tmp_path), final=True)
    assert len(started) == 3 and started[-1].done  # the last drawing is waited for

    # a run whose last checkpoint was drawn ends without drawing it again
    monkeypatch.setattr(loss_plot, "_PLOT", {"child": None, "pending": False, "started": None})
    checkpoint_at(500)
    loss_plot._redraw_loss_plot(Path(tmp_path), final=True)
    assert len(started) == 4
