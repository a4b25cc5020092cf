"""loss.png: training loss, eval loss and learning rate over steps (and below them, for a preference objective, the
reward margin and the preference accuracy; for GRPO, the sampled answers' reward with its spread), drawn from a run's
metrics.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional


def read_metrics(path: Path, key: str = "loss") -> list[dict[str, Any]]:
    """The rows that carry `key` (training rows: loss; eval passes: eval_loss)."""
    rows: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash mid-write
        if isinstance(row, dict) and row.get(key) is not None and row.get("step") is not None:
            rows.append(row)
    return rows


def plot_loss(metrics: Path, out: Path, title: Optional[str] = None) -> Optional[Path]:
    """Write out (PNG) from metrics; None when there is nothing to plot yet. Written to a temp file, then renamed."""
    rows = read_metrics(metrics)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU box; must precede pyplot
    import matplotlib.pyplot as plt

    margins = [r for r in rows if r.get("rewards/margins") is not None]
    held = read_metrics(metrics, "eval_rewards/margins")
    sampled = [r for r in rows if r.get("reward") is not None]
    if margins or held:  # DPO/ORPO: a second panel, the margin chosen - rejected and the share of pairs ranked right
        fig, (ax, rax) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True, height_ratios=(3, 2))
        _rewards(rax, margins, held)
    elif sampled:  # GRPO: a second panel, the sampled answers' reward, mean +- spread
        fig, (ax, rax) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True, height_ratios=(3, 2))
        _sampled_rewards(rax, sampled)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    _plot(ax, rows, "loss", color="tab:blue", label="training loss")
    evals = read_metrics(metrics, "eval_loss")
    if evals:
        _plot(ax, evals, "eval_loss", color="tab:green", marker="o", label="eval loss (held out)")
        ax.legend(loc="upper right")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lr = [(r["step"], r["learning_rate"]) for r in rows if r.get("learning_rate") is not None]
    if lr:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in lr], [v for _, v in lr], color="tab:orange", alpha=0.8, label="learning rate")
        ax2.set_ylabel("learning rate", color="tab:orange")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    last = rows[-1]
    ax.set_title(
        title
        or f"{metrics.parent.name}: step {last['step']}, loss {last['loss']:.4f}"
        + (f", eval loss {evals[-1]['eval_loss']:.4f}" if evals else "")
    )
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.png")  # two drawers never share a temporary
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _plot(ax, rows: list[dict[str, Any]], key: str, **style: Any) -> None:
    """`key` of each row over its step."""
    ax.plot([r["step"] for r in rows], [r[key] for r in rows], **style)


def _rewards(ax, margins: list[dict[str, Any]], held: list[dict[str, Any]]) -> None:
    """The reward margin (training pairs, held-out pairs) and the held-out preference accuracy over steps."""
    if margins:
        _plot(ax, margins, "rewards/margins", color="tab:purple", label="reward margin (training pairs)")
    if held:
        _plot(ax, held, "eval_rewards/margins", color="tab:red", marker="o", label="reward margin (held out)")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_ylabel("chosen - rejected")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    accuracy = [r for r in held if r.get("eval_rewards/accuracies") is not None]
    if accuracy:
        ax2 = ax.twinx()
        style = {"color": "tab:olive", "linestyle": "--", "label": "preference accuracy (held out)"}
        _plot(ax2, accuracy, "eval_rewards/accuracies", **style)
        ax2.set_ylim(0.0, 1.05)
        ax2.set_ylabel("preference accuracy", color="tab:olive")


def _sampled_rewards(ax, rows: list[dict[str, Any]]) -> None:
    """GRPO: the sampled answers' mean reward with its standard deviation as a band; with several rewards, each one's
    too (TRL's rewards/<name>/mean, /std)."""
    from launcher.methods import reward_parts

    names = list(reward_parts(rows[-1]))
    several = len(names) > 1
    got = [(r["step"], r["reward"], r.get("reward_std") or 0.0) for r in rows]
    line = {"label": "reward of the sampled answers (mean" + (", weighted sum)" if several else ")")}
    _band(ax, got, "tab:purple", 0.2, line, {"label": "+- their standard deviation"})
    if several:
        colours = ("tab:blue", "tab:green", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
        for k, name in enumerate(names):
            got = [(r["step"], reward_parts(r).get(name) or {}) for r in rows]
            got = [(step, p["mean"], p.get("std") or 0.0) for step, p in got if p.get("mean") is not None]
            if not got:
                continue
            flat = all(abs(d) < 1e-9 for _, _, d in got)
            line = {"linestyle": "--", "label": f"{name}" + (" (never varied)" if flat else "")}
            _band(ax, got, colours[k % len(colours)], 0.1, line)
    ax.set_ylabel("reward")
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")


def _band(ax, got: list[tuple], colour: str, alpha: float, line: dict, band: Optional[dict] = None) -> None:
    """(step, mean, spread) points as a line with a band of +- the spread around it."""
    steps = [g[0] for g in got]
    ax.plot(steps, [g[1] for g in got], color=colour, **line)
    ax.fill_between(
        steps, [g[1] - g[2] for g in got], [g[1] + g[2] for g in got], color=colour, alpha=alpha, **(band or {})
    )


def refresh(run_root: Path) -> Optional[Path]:
    """Redraw run_root/loss.png; never raises (a plot is not worth a training run), returns None on failure."""
    try:
        return plot_loss(Path(run_root) / "metrics.jsonl", Path(run_root) / "loss.png")
    except Exception as exc:  # matplotlib missing or broken: say so once per call, keep training
        print(f"[ftrun] loss.png not updated: {type(exc).__name__}: {exc}", flush=True)
        return None


if __name__ == "__main__":  # the worker draws in a child process: python -m launcher.deliver.plots RUN_DIR
    import sys

    # the lowest CPU priority: on 2 cores the drawing halved two logged intervals' tokens/s after each checkpoint
    try:
        os.nice(19)
    except (AttributeError, OSError):  # not on this platform: draw at normal priority
        pass
    refresh(Path(sys.argv[1]))
