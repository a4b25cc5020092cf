"""Shared fixtures: the tiny model (built once per session, no downloads) and recipe writers."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TINY_DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# idle OpenMP threads sleep rather than spin: several training processes share the cores (scripts/test.sh says why)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The test files that take longest, longest first (their tests' durations summed over the slow tier on 2 cores,
# 2026-12-05: docs/BENCHMARKS.md "CI's tiers"). scripts/test.sh gives each pytest worker whole files in collection
# order (--dist loadfile, --no-loadscope-reorder): started first, a long file runs beside the many short ones instead
# of alone at the end. The other files follow, most tests first (xdist's own order). Only the order changes.
LONGEST_FIRST = (
    "tests/worker/test_gpu_check_product.py",
    "tests/worker/test_engines.py",
    "tests/store/test_sync.py",
    "tests/worker/test_preference.py",
    "tests/run/test_oom.py",
    "tests/run/test_rank_down.py",
    "tests/worker/test_resume_metrics.py",
    "tests/worker/test_grpo.py",
    "tests/test_bench_scripts.py",
    "tests/run/test_pipeline.py",
    "tests/run/test_kill_series.py",
    "tests/run/test_one_value_per_figure.py",
    "tests/worker/test_task_eval.py",
    "tests/worker/test_trackers.py",
)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the counts are of the tests that run
def pytest_collection_modifyitems(config, items):
    files = [item.nodeid.split("::")[0] for item in items]
    count = {f: files.count(f) for f in set(files)}
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    order = {id(item): (rank.get(f, len(rank)), -count[f], f) for item, f in zip(items, files)}
    items.sort(key=lambda item: order[id(item)])  # stable: a file's own tests keep their order


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-shaped model + ChatML tokenizer, built locally (cached across test runs in .cache/)."""
    out = REPO / ".cache" / "tiny-model-tests"
    _load_script("make_tiny_model").build_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def tiny_vlm() -> Path:
    """A tiny Qwen2.5-VL-shaped model + its processor files, built locally (cached across test runs in .cache/)."""
    out = REPO / ".cache" / "tiny-vlm-tests"
    _load_script("make_tiny_vlm").build_tiny_vlm(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_bf16() -> Path:
    """The tiny model saved in bfloat16 (config.json says so), like a published model: what a full fine-tune's
    final/model must come back in."""
    out = REPO / ".cache" / "tiny-model-tests-bf16"
    _load_script("make_tiny_model").build_tiny_model(out, dtype="bfloat16")
    return out


def recipe_file(path: Path, tiny_model: Path, output_dir: Path, **fields) -> Path:
    """A recipe for the tiny model at `path`; keyword arguments override the defaults (None removes a key)."""
    base = {
        "model": str(tiny_model),
        "method": "lora",
        "data": str(TINY_DATA),
        "max_length": 256,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 12,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "checkpoint_every_minutes": 0.02,
        "output_dir": str(output_dir),
        "smoke": {"min_steps": 3},
        "export": [],  # tests that check the export ask for it; the rest should not pay for it
        # the same for the before/after answers (tests/test_eval*.py ask for them) and the scored task evaluation
        # (tests/worker/test_task_eval.py, tests/run/test_task_baseline.py ask for it)
        "eval": {"samples": 0, "task": {"examples": 0}},
        # the whole conversation, as these tests were written for: at max_length 256 the answers of the tiny data's
        # long prompts are cut away, which the answers-only default refuses (tests/data/test_loss_view.py and
        # tests/data/test_layouts*.py test that default)
        "assistant_only_loss": False,
    }
    for key, value in fields.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.fixture
def write_recipe(tmp_path, tiny_model):
    """Write a recipe for the tiny model into tmp_path (output_dir tmp_path/run unless given)."""

    def write(name: str = "r.yaml", **fields) -> Path:
        fields.setdefault("output_dir", str(tmp_path / "run"))
        return recipe_file(tmp_path / name, tiny_model, **fields)

    return write


# One uninterrupted run that every interrupted run (kill -9, crash, preemption, machine loss) is compared with.
RESUME_FIELDS = dict(max_steps=30, checkpoint_every_minutes=0.01, learning_rate=5e-3)


def uninterrupted_run(tmp_path_factory, tiny_model: Path, name: str, fields: dict, *overrides: str) -> Path:
    """One foreground run of the tiny model with `fields` and `overrides`, start to end: what an interrupted run's
    losses and adapter are compared with. Returns its run directory."""
    return _train(tmp_path_factory.mktemp(name), tiny_model, fields, *overrides)


def _train(d: Path, tiny_model: Path, fields: dict, *overrides: str) -> Path:
    from helpers import ftrun

    recipe = recipe_file(d / "ref.yaml", tiny_model, output_dir=d / "run", **fields)
    res = ftrun(recipe, "--foreground", *overrides, cwd=d)
    assert res.returncode == 0, res.stdout + res.stderr
    return d / "run"


def _trained_once(tmp_path_factory, tiny_model: Path, name: str, fields: dict, *overrides: str) -> Path:
    """A run read by test files on every pytest worker: trained once for all of them, by the first that asks, under a
    file lock in the folder the workers' temporary folders share (pytest-xdist's documented way to share a session
    fixture); a session fixture alone is built once per worker. Returns its run directory."""
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    d, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(d, ignore_errors=True)  # a worker's build that failed part way
            d.mkdir()
            _train(d, tiny_model, fields, *overrides)
            done.touch()
    return d / "run"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, tiny_model) -> Path:
    """The uninterrupted run that interrupted runs are compared with, on every worker (_trained_once)."""
    return _trained_once(tmp_path_factory, tiny_model, "reference", RESUME_FIELDS, "smoke.enabled=false")


@pytest.fixture(scope="session")
def sft_parent(tmp_path_factory, tiny_model) -> Path:
    """The parent that DPO and GRPO train from (tests/worker/test_preference.py, tests/worker/test_grpo.py): LoRA SFT
    on the demo's chat data, what recipes/tiny-cpu-dpo.yaml and tiny-cpu-grpo.yaml start from; 60 steps at 2e-2, so
    that GRPO's sampled answers score above nothing. Trained once for both files (_trained_once); each run pins its
    own copy of the parent (launcher/run/parent.py), so neither changes it for the other."""
    return _trained_once(
        tmp_path_factory, tiny_model, "sft-parent", dict(max_steps=60, learning_rate=2e-2), "smoke.enabled=false"
    )


# A local S3 endpoint for the copies off the box (tests/store/test_sync.py, tests/run/test_kill_series.py).


class _RequestLog:
    """WSGI middleware recording each request the S3 server answers: method, path, query, response bytes.

    It can also hold one request (`hold`): a test that must interrupt an upload in its middle stops the upload
    there, rather than hoping to look at the moment it passes (a tiny checkpoint's copy takes milliseconds).
    """

    def __init__(self, app):
        import threading

        self.app, self.entries = app, []
        self._match = None
        self.held, self._released = threading.Event(), threading.Event()

    def hold(self, match) -> None:
        """Hold the first request for which `match(entry)` is true: it waits unanswered, its object not stored,
        and `.held` is set, until `release()`, which answers it 503 without passing it to the store."""
        self.held.clear()
        self._released.clear()
        self._match = match

    def release(self) -> None:
        self._match = None
        self._released.set()

    def __call__(self, environ, start_response):
        entry = {
            "method": environ["REQUEST_METHOD"],
            "path": environ.get("PATH_INFO", ""),
            "query": environ.get("QUERY_STRING", ""),
            "bytes": 0,
        }
        self.entries.append(entry)
        match = self._match
        if match is not None and match(entry):
            self._match = None
            entry["held"] = True
            self.held.set()
            self._released.wait(600)
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return
        result = self.app(environ, start_response)
        try:
            for chunk in result:
                entry["bytes"] += len(chunk)
                yield chunk
        finally:
            if hasattr(result, "close"):
                result.close()

    def object_reads(self) -> list[dict]:
        """GETs of an object (path-style /bucket/key), not listings of the bucket."""
        return [e for e in self.entries if e["method"] == "GET" and e["path"].strip("/").count("/") >= 1]

    def clear(self) -> None:
        self.entries.clear()


@pytest.fixture
def s3_server(monkeypatch):
    """A local S3-compatible server (moto) with one bucket; the ftrun processes reach it via AWS_* variables.
    Yields .env (those variables) and .requests (every request it answered)."""
    from types import SimpleNamespace

    import boto3
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    requests = _RequestLog(server._server.app)
    server._server.app = requests  # werkzeug's handler calls the server's .app for each request
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    boto3.client("s3").create_bucket(Bucket="ftrun-test")
    S3FileSystem.clear_instance_cache()  # fsspec reuses a file system made for an earlier test's endpoint
    yield SimpleNamespace(env=env, requests=requests)
    requests.release()
    server.stop()
    S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_endpoint(s3_server) -> dict:
    return s3_server.env


@pytest.fixture
def procs():
    """Processes a test starts: killed and reaped at the end, whatever happened."""
    import subprocess

    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
