"""Helpers for end-to-end tests: run the real `ftrun` in a subprocess and read what a run leaves behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent


# The article's planning dataset: 10,000 examples of ~500 tokens, three epochs = 15M training tokens.
ARTICLE_DATA = SimpleNamespace(
    examples=10_000,
    total_tokens=5_000_000,
    mean_tokens=500.0,
    max_tokens=2048,
    over_max_length=0,
    tokens_source="tokenizer",
)


def article_recipe(tmp_path, **fields):
    base = {
        "model": "meta-llama/Llama-3.1-8B",
        "method": "qlora",
        "data": "d.jsonl",
        "max_length": 2048,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
    }
    base.update(fields)
    from launcher.recipe_loading import validate_recipe

    return validate_recipe(base, tmp_path, "r")


def article_plan(tmp_path, gpus, unsloth=False, data=ARTICLE_DATA, **fields):
    from launcher.plan.hardware import from_spec
    from launcher.plan.plan import make_plan

    hw = gpus if not isinstance(gpus, str) else from_spec(gpus)
    return make_plan(article_recipe(tmp_path, **fields), hw, data, unsloth_available=unsloth)


def ftrun(*args, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status(run_dir: Path, cwd: Path) -> dict:
    res = ftrun("status", run_dir, "--json", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def polled_status(run_dir: Path) -> dict:
    """What `ftrun status RUN --json` prints (the same function, launcher.run.facts.run_status), read in this
    process: for waiting on a state. A CLI process per poll costs half a second of CPU (its imports), so a test
    polling it twice a second spent half a core waiting, beside the run it waited on (2026-12-05). wait_until_ended
    reads the end it waited for through the CLI once."""
    from launcher.run.facts import run_status
    from launcher.store.rundir import RunDir

    return run_status(RunDir(run_dir))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    """Every logged loss and every tensor of the final adapter identical (exact on CPU)."""
    import torch

    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    differ = [(x["step"], x["loss"], y["loss"]) for x, y in zip(ma, mb) if x["loss"] != y["loss"]]
    if differ:  # what the next reader needs: which steps, and the resumed run's own account of its resume
        log = (b / "train.log").read_text() if (b / "train.log").is_file() else ""
        said = [
            line
            for line in log.splitlines()
            if any(w in line for w in ("resum", "checkpoint", "SIGTERM", "window", "preempt"))
        ]
        first = next(i for i, (x, y) in enumerate(zip(ma, mb)) if x["loss"] != y["loss"])
        raise AssertionError(
            f"losses differ at (step, reference, this run) {differ[:8]}; the first such rows:\n"
            f"  reference {ma[first]}\n  this run  {mb[first]}\n"
            f"the two runs' plans and workers differ in: {_settings_differ(a, b)}; this run's log:\n"
            + "\n".join(said[-30:])
        )
    ta, tb = adapter_tensors(a), adapter_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def _settings_differ(a: Path, b: Path) -> list[str]:
    """The plan.json and worker.json keys whose values differ between two run directories (paths, times and process
    ids aside): a choice one run made and the other did not, where their losses differ."""
    out = []
    for name in ("plan.json", "worker.json"):
        pa, pb = a / name, b / name
        if not (pa.is_file() and pb.is_file()):
            out.append(f"{name} missing in {'the reference' if not pa.is_file() else 'this run'}")
            continue
        ja, jb = json.loads(pa.read_text()), json.loads(pb.read_text())
        for k in sorted(set(ja) | set(jb)):
            if k in ("pid", "started", "launch_argv", "resumed_from", "start_step", "measured", "estimate"):
                continue
            if ja.get(k) != jb.get(k):
                out.append(f"{name} {k}: {str(ja.get(k))[:200]} | {str(jb.get(k))[:200]}")
    return out


def wait_until_ended(run_dir: Path, cwd: Path, timeout: float = 240) -> dict:
    # ended: a final state, and the supervisor gone (it copies the result off the box after training)
    wait_for(
        lambda: (lambda s: s["state"] not in ("running", "recovering", "smoking", "planned") and not s["pid_alive"])(
            polled_status(run_dir)
        ),
        timeout,
        "the run to end",
        0.5,
    )
    s = status(run_dir, cwd)
    log = (run_dir / "train.log").read_text()[-4000:] if (run_dir / "train.log").is_file() else ""
    assert s["state"] == "succeeded", log
    return s


def free_port() -> int:
    """A TCP port free on this box now (the kernel's pick, from its ephemeral range): a test's rendezvous never
    shares a fixed port with another test that runs at the same time (pytest-xdist)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_slices(pids, until, what: str, timeout: float = 180, group: bool = False) -> None:
    """Let the processes (with `group`, the process groups) run 10 ms at a time, frozen ~50 ms between; return with
    them frozen at the first moment `until()` holds.

    A run's checkpoint cadence is wall-clock and the box's speed is not known: on a fast box a short test run
    trains all its steps inside one cadence, its first checkpoint is its final one and nothing is left to
    interrupt (CI, 2026-12-03: the Unsloth kill -9 test found `final` already written). Run this way, the
    processes get about a sixth of the wall clock, so a wall-clock checkpoint comes after a few steps on any box,
    and each check sees them frozen. The trajectory does not depend on the cadence.
    """
    import signal

    send = os.killpg if group else os.kill
    deadline = time.monotonic() + timeout
    while True:
        for p in pids:
            send(p, signal.SIGSTOP)
        if until():
            return
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        for p in pids:
            send(p, signal.SIGCONT)
        time.sleep(0.01)
        for p in pids:
            send(p, signal.SIGSTOP)
        time.sleep(0.05)


def is_training(run_dir: Path) -> bool:
    """Rank 0's heartbeat says it is past its start (imports, model load): in a step, a save, an evaluation."""
    try:
        beat = json.loads((run_dir / "heartbeats" / "rank-0.json").read_text())
    except (OSError, ValueError):
        return False
    return beat.get("phase") not in (None, "", "start")


def freeze_worker(run_dir: Path, until, timeout: float = 180) -> dict:
    """SIGSTOP the worker at the first moment `until(run_dir)` holds, whatever the machine's speed.

    Returns state.json with the frozen worker's pid; the caller kills it or sends SIGCONT. Without this, a fast
    machine finishes a short run before the test can interrupt it. The worker starts (imports, model load) at full
    speed, checked every 50 ms; once it trains it runs in slices (`run_in_slices`), so a wall-clock checkpoint is
    not its final one on a fast box.
    """
    import signal

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = read_state(run_dir) if (run_dir / "state.json").is_file() else {}
        pid = st.get("worker_pid")
        if pid:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                time.sleep(0.05)
                continue
            if until(run_dir):
                return st
            os.kill(pid, signal.SIGCONT)
            if is_training(run_dir):  # a slice, then frozen, as in run_in_slices (the pid is read again each time)
                time.sleep(0.01)
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    st = read_state(run_dir) if (run_dir / "state.json").is_file() else {}
    log = (run_dir / "train.log").read_text(errors="replace")[-2000:] if (run_dir / "train.log").is_file() else ""
    raise AssertionError(
        f"timed out after {timeout}s waiting to freeze the worker at the moment asked for; the run "
        f"is {st.get('state')!r}; the end of its log:\n{log}"
    )


def has_checkpoint(run_dir: Path) -> bool:
    return bool(list((run_dir / "checkpoints").glob("step-*/manifest.json")))


def logged_steps(n: int):
    return lambda run_dir: (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= n


def prepared_run(recipe_path: Path, *overrides: str) -> Path:
    """A run directory with recipe.yaml and plan.json, as `ftrun` writes them, without starting anything."""
    import yaml

    from launcher.data.stats import data_stats
    from launcher.run.prepare import make_plan as pipeline_plan
    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(recipe_path, list(overrides))
    run = Path(recipe.output_dir)
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe.snapshot(), sort_keys=False))
    _, _, stats = data_stats(recipe)
    (run / "plan.json").write_text(json.dumps(pipeline_plan(recipe, stats).to_dict()))
    return run


def stand_in_adapter(run_dir: Path, base_model: str | Path | None = None) -> Path:
    """A finished run's adapter as `init_from` reads it (final/adapter/adapter_config.json, r 8, alpha 16): for the
    recipe checks and the plan, which read the config and never the weights. Returns the run directory."""
    adapter = Path(run_dir) / "final" / "adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    config = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    if base_model is not None:
        config["base_model_name_or_path"] = str(base_model)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return Path(run_dir)


def export_recipe(path: Path, model: Path, out: Path, **fields) -> Path:
    """A short LoRA run of the tiny model without a smoke test, for the export tests (tests/deliver/test_export.py and
    the GGUF tier, tests/deliver/test_gguf.py); `fields` override."""
    import yaml

    base = {
        "model": str(model),
        "method": "lora",
        "data": str(REPO / "recipes" / "data" / "tiny-chat.jsonl"),
        "max_length": 256,
        "assistant_only_loss": False,  # as tests/conftest.py recipe_file: the tests' data at max_length 256
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 8,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "checkpoint_every_minutes": 0.02,
        "output_dir": str(out),
        "smoke": {"enabled": False},
    }
    base.update(fields)
    path.write_text(yaml.safe_dump(base))
    return path


# Ticket sorting, the label task: a short ticket in, one of four labels out (launcher/worker/task_eval.py).
TICKET_LABELS = {
    "account": ["login today", "password not accepted", "can't log in", "close my account", "reset my password"],
    "billing": [
        "charged twice",
        "double charge on my card",
        "invoice shows two payments",
        "refund please",
        "wrong invoice amount",
    ],
    "performance": [
        "server is very slow",
        "dashboard takes ages",
        "everything is slow",
        "instance keeps lagging",
        "pages load slowly",
    ],
    "email": [
        "no confirmation email",
        "verification mail never arrived",
        "no email from you",
        "mail went to spam",
        "resend the email",
    ],
}


def write_ticket_labels(path: Path, n: int = 200, seed: int = 0) -> Path:
    """n chat examples "Ticket 7468: login today" -> "account" (four labels, drawn evenly), one JSON line each."""
    import random

    rng = random.Random(f"tickets-{seed}")
    labels = sorted(TICKET_LABELS)
    with Path(path).open("w") as fh:
        for k in range(n):
            label = labels[k % len(labels)]
            ticket = f"Ticket {rng.randint(1000, 9999)}: {rng.choice(TICKET_LABELS[label])}"
            fh.write(
                json.dumps({"messages": [{"role": "user", "content": ticket}, {"role": "assistant", "content": label}]})
                + "\n"
            )
    return Path(path)


# A Hub dataset in the HF datasets cache, as `datasets` leaves a download there (tests/data,
# tests/worker/test_preference.py).
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(root, repo_id: str, rows: list[dict]) -> str:
    """A stand-in HF datasets cache holding `repo_id` as `datasets` leaves a Hub download there (the folder named
    by the commit), built by datasets itself from a parquet file: what load_dataset reads offline."""
    import datasets

    src = root / "src.parquet"
    root.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    datasets.load_dataset("parquet", data_files={"train": str(src)}, cache_dir=str(root / "build"))
    built = next(p for p in (root / "build" / "parquet").glob("*/*/*") if p.is_dir())
    org, name = repo_id.split("/")
    dest = root / "datasets" / f"{org}___{name}" / "default" / "0.0.0" / HUB_REVISION
    shutil.copytree(built, dest)
    for f in dest.glob("parquet-*.arrow"):
        f.rename(dest / f.name.replace("parquet-", f"{name}-"))
    info = json.loads((dest / "dataset_info.json").read_text())
    (dest / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default"}))
    return str(root / "datasets")
