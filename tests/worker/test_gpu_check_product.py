"""scripts/gpu_check.sh's product steps (issue 43): the presets, what each step reads from a run directory, the
attention cases and the resume comparison on the CPU; in the slow tier the script's whole dry run, once, shared by
the tests that read its results."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from gpu_check import attention, common, product, resume_check, runner, vs_trl

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
NEW = (
    "attention",
    "product-lora",
    "generation",
    "vs-trl",
    "resume-exact",
    "product-dpo",
    "product-grpo",
    "product-qlora",
    "unsloth",
)


def _ctx(tmp_path: Path, **kw):
    from gpu_check.common import Context

    return Context(
        **{
            "out": tmp_path,
            "work": tmp_path,
            "dry_run": True,
            "device": "cpu",
            "shape": "tiny",
            "progress": lambda **k: None,
            **kw,
        }
    )


def test_the_product_preset_is_one_calls_selection_in_issue_55s_order():
    steps = runner.selected_steps("product")
    # what one call must answer first, then the 8B padding step, then what the loan can spare (issue 55)
    assert steps == [
        "tiny-model",
        "product-lora",
        "product-grpo",
        "attention",
        "generation",
        "bench-padding",
        "bench-lora",
        "resume-exact",
        "product-dpo",
        "product-qlora",
    ]
    assert set(NEW) - {"unsloth", "vs-trl"} <= set(steps)
    # presets and names mix, each step once, always in STEPS's order
    assert runner.selected_steps("device,product,tiny-model").count("tiny-model") == 1
    assert runner.selected_steps("generation,device") == ["device", "generation"]
    with pytest.raises(ValueError, match="'nope' is no step or preset"):
        runner.selected_steps("device,nope")
    assert set(runner.STEP_FUNCS) == set(runner.STEPS) == set(runner.TIMEOUTS)
    # every step that decides one of issue 55's numbers is in the preset
    assert set(runner.DECIDING) <= set(steps)


def test_a_run_directorys_speed_record(tmp_path):
    run = tmp_path / "run"
    (run / "final" / "task_eval").mkdir(parents=True)
    rows = [{"step": 0, "eval_loss": 7.0, "time": 99.0}] + [
        {
            "step": s,
            "loss": 7.0 - s / 10,
            "tokens_seen": 100 * s,
            "time": 100.0 + 0.5 * s,
            "peak_memory_gb": 0.5 + s / 100,
        }
        for s in range(1, 7)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "state.json").write_text(
        json.dumps(
            {
                "state": "succeeded",
                "history": [
                    {"state": "planned", "at": 10.0},
                    {"state": "smoking", "at": 12.0},
                    {"state": "running", "at": 20.0},
                    {"state": "succeeded", "at": 50.0},
                ],
                "export": {"seconds": 7.5},
            }
        )
    )
    (run / "smoke.json").write_text(json.dumps({"tokens_per_second": 612.0, "seconds_per_step": 0.3}))
    plan = {"tokens": {"estimated_tokens_per_second": 67188}, "micro_batch_size": 8}
    (run / "plan.json").write_text(json.dumps(plan))
    attention = {"implementation": "ftrun_varlen", "kernels": {"padding_free": "torch's varlen_attn"}}
    (run / "worker.json").write_text(
        json.dumps({"device": "cuda", "sdpa_backends": {"cudnn": False}, "attention": attention})
    )
    answers = [{"index": i, "new_tokens": 24, "seconds": 0.5} for i in range(4)]
    (run / "final" / "task_eval" / "fine_tuned.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    record = product.run_record(run, started=5.0)
    assert record["phases_seconds"] == {
        "plan and data check": 5.0,
        "base-model task evaluation": 2.0,
        "smoke test": 8.0,
        "training and task evaluation": 30.0,
        "export": 7.5,
    }
    assert record["steps"] == [1, 2, 3, 4, 5, 6] and record["step_seconds"] == [0.5] * 5
    assert record["peak_memory_gb"] == 0.56 and record["sdpa_backends"] == {"cudnn": False}
    assert record["attention"] == attention  # the kernel the run's worker recorded
    assert record["generation"] == {
        "final/fine_tuned": {"answers": 4, "new_tokens": 96, "seconds": 2.0, "tokens_per_second": 48.0}
    }
    assert record["plan"]["tokens"]["estimated_tokens_per_second"] == 67188
    line = product.summary_line({**record, "exit": 0, "wall_seconds": 50.0})
    assert "6 steps, median 0.5 s/step" in line and "smoke 612.0 tok/s (plan 67188)" in line


def test_steps_without_their_packages_or_their_parent_run_say_skipped(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    for step in (product.step_product_lora, resume_check.step_resume_exact, vs_trl.step_vs_trl):
        result = step(_ctx(tmp_path))
        assert result["ok"] is None and "trl not installed" in result["line"] and "device_wheels.sh" in result["line"]
    monkeypatch.setattr(importlib.util, "find_spec", real)
    dpo = product.step_product_dpo(_ctx(tmp_path))
    assert dpo["ok"] is None and "run product-lora first" in dpo["line"]
    from gpu_check import unsloth_check

    if importlib.util.find_spec("unsloth") is None:
        skipped = unsloth_check.step_unsloth(_ctx(tmp_path))
        assert skipped["ok"] is None and "device_wheels.sh --unsloth" in skipped["line"]


def test_the_resume_comparison_says_exact_or_how_far(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    def run(name: str, losses: list[float], weight: float) -> Path:
        d = tmp_path / name
        (d / "final" / "adapter").mkdir(parents=True)
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": x, "grad_norm": 1.0}) + "\n" for i, x in enumerate(losses))
        )
        adapter = d / "final" / "adapter" / "adapter_model.safetensors"
        save_file({"a.lora_A.weight": torch.full((2, 2), weight)}, str(adapter))
        return d

    a = run("a", [3.0, 2.5, 2.0], 1.0)
    same = resume_check.compare(a, run("b", [3.0, 2.5, 2.0], 1.0))
    assert same["exact"] and same["max_loss_difference"] == 0 and same["max_adapter_difference"] == 0
    off = resume_check.compare(a, run("c", [3.0, 2.5, 2.001], 1.0 + 2**-10))
    assert not off["exact"] and off["first_differing_step"] == 3
    assert off["max_loss_difference"] == pytest.approx(0.001) and off["max_adapter_difference"] == pytest.approx(2**-10)


def test_attention_cases_on_the_cpu():
    """Each mask case's layout as transformers hands it to SDPA, timed, with the ops the profiler saw; a backend the
    CPU lacks is "not supported" with torch's own first line, not a crash; decode from a prompt, not from one key."""
    torch = pytest.importorskip("torch")
    s = {**attention.SHAPES["cpu"], "lengths": (9, 13), "new_tokens": 3}
    q, k, v, mask, causal = attention._inputs("padding-free", 9, s, "cpu", torch.float32)
    assert q.shape == (1, s["heads"], 9 * s["batch"], s["head_dim"]) and k.shape[1] == s["heads"] and not causal
    # block-diagonal: no token sees another example's, and each sees its own earlier tokens
    assert mask.shape == (1, 1, 18, 18) and not mask[0, 0, 9, 0] and mask[0, 0, 8, 0] and not mask[0, 0, 0, 1]
    q, k, v, mask, causal = attention._inputs("causal", 9, s, "cpu", torch.float32)
    assert mask is None and causal and k.shape[1] == s["kv_heads"]  # GQA through enable_gqa, as without a mask
    math = attention._train_case("MATH", "padded", [9, 13], s, "cpu", torch.float32)
    assert math["supported"] and [r["length"] for r in math["lengths"]] == [9, 13]
    assert all(r["first_ms"] > 0 and r["repeat_ms"] > 0 for r in math["lengths"])
    assert math["profile"]["backends"] == ["math"]  # the profiler names the op that ran
    default = attention._train_case("default", "padded", [9], s, "cpu", torch.float32)
    assert default["supported"] and default["profile"]["backends"]
    refused = attention._train_case("CUDNN_ATTENTION", "causal", [9], s, "cpu", torch.float32)
    assert refused["supported"] is False and refused["error"].startswith("RuntimeError: ")
    varlen = attention._train_case("varlen", "padding-free", [9], s, "cpu", torch.float32)
    assert varlen["supported"] is False and "CUDA" in varlen["error"] + "varlen"
    decode = attention._decode_case("MATH", 0, s, "cpu", torch.float32)
    assert decode["supported"] and decode["tokens"] == 3 and decode["prompt_lengths"][0] > 1
    assert decode["profile"]["backends"] == ["math"]


def test_attention_order_and_lengths():
    """'default' first, cuDNN last; no two cases share a sequence length (a per-shape cache finds nothing warm)."""
    names = attention.cases()
    assert names[0].startswith("default/") and names[-1].startswith("CUDNN_ATTENTION/")
    assert "varlen/padding-free" in names and "varlen/padded" not in names
    for device in ("cuda", "cpu"):
        s = attention.SHAPES[device]
        seen = [n for i, name in enumerate(names) if not name.endswith("/decode") for n in attention.case_lengths(s, i)]
        assert len(seen) == len(set(seen))
        prompts = [tuple(attention._prompt_lengths(s, i)) for i, n in enumerate(names) if n.endswith("/decode")]
        assert len(prompts) == len(set(prompts)) and min(min(p) for p in prompts) > 1


def test_the_attention_step_times_out_one_case_and_goes_on(tmp_path):
    """A case past its own timeout is recorded as timed out, its child's process group killed, and a new child
    runs the cases after it; a case a child dies in is recorded as crashed; each case's entry is written when it
    ends."""
    import sys

    path = tmp_path / "attention.child.json"
    names = attention.cases()
    fake = tmp_path / "child.py"
    fake.write_text(
        "import json, os, subprocess, sys, time\n"
        f"path, names = {str(path)!r}, {names!r}\n"
        "data = json.load(open(path)) if os.path.exists(path) else {}\n"
        "data.setdefault('device', 'cpu'); data.setdefault('cases', {})\n"
        "def write():\n"
        "    open(path + '.tmp', 'w').write(json.dumps(data)); os.replace(path + '.tmp', path)\n"
        "for name in names:\n"
        "    if name in data['cases']: continue\n"
        "    data['running'] = {'case': name, 'started': time.time()}; write()\n"
        "    if name == names[1]:\n"
        "        grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"        open({str(tmp_path / 'grandchild')!r}, 'w').write(str(grandchild.pid))\n"
        "        time.sleep(60)\n"
        "    if name == names[2]: os._exit(3)\n"
        "    data['cases'][name] = {'supported': True}; data.pop('running'); write()\n"
    )
    attention.run_children(path, budget=60, case_timeout=2, cmd=[sys.executable, str(fake)])
    cases = json.loads(path.read_text())["cases"]
    assert set(cases) == set(names)
    assert cases[names[0]] == {"supported": True}
    assert cases[names[1]]["timed_out"] and cases[names[1]]["seconds"] >= 2
    assert cases[names[2]]["crashed"]
    assert all(cases[n] == {"supported": True} for n in names[3:])
    pid = int((tmp_path / "grandchild").read_text())
    assert not _alive(pid)  # the stuck case's child went with its process group


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_tokens_per_second_over_the_same_steps():
    points = [(1, 0.0, 0), (2, 1.0, 100), (3, 1.5, 300), (4, 2.5, 500)]
    got = vs_trl.rate(points, warmup=2)
    # steps 3 and 4, timed from the end of step 2: 400 tokens in 1.5 s
    assert got["tokens_per_second"] == 266.7 and got["timed_steps"] == 2 and got["step_seconds"] == [0.5, 1.0]
    assert vs_trl.rate(points[:2], warmup=2)["tokens_per_second"] is None


def test_results_are_packed_into_one_tarball_beside_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(
        OUT=str(tmp_path / "out"),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        GPU_CHECK_BUDGET_S="5",
        GPU_CHECK_STEPS="device,attention",  # steps that import nothing beyond torch: a short preflight
    )
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # out of time: not run is not passed
    out = tmp_path / "out"
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"device.json", "attention.json", "preflight.json"} <= names and "summary.json" not in names
    summary = json.loads((out / "summary.json").read_text())
    assert {s["step"]: s["status"] for s in summary["steps"]}["attention"] == "not run"
    assert (out / "attention.json").is_file()  # kept on the CPU; a GPU run leaves the two files alone
    # the preflight printed each step's estimate first, and the report what the call decides
    assert "gpu_check preflight: CPU" in proc.stderr and "  attention  " in proc.stderr
    assert "gpu_check decides:" in proc.stdout


# ---------------------------------------------------------------------------------------------
# The dry run of every new step through the script, once (minutes on 2 cores: the slow tier)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    """The whole `scripts/gpu_check.sh --dry-run`, every step, as CI ran it on its own before (.ci/run): once here,
    where the tests below read what each new step recorded."""
    tmp = tmp_path_factory.mktemp("gpu-check-product")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(OUT=str(tmp / "out"), GPU_CHECK_WORK=str(tmp / "work"), GPU_CHECK_BUDGET_S="1800")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=2000)
    (tmp / "out" / "stdout.txt").write_text(proc.stdout + proc.stderr)
    (tmp / "out" / "rc.txt").write_text(str(proc.returncode))
    return tmp / "out"


@pytest.mark.slow
def test_the_whole_dry_run_passes(dry_run):
    """Every step passed or was skipped for a missing package (the script's own exit status says so)."""
    summary = json.loads((dry_run / "summary.json").read_text())
    assert (dry_run / "rc.txt").read_text() == "0" and summary["all_passed"], (dry_run / "stdout.txt").read_text()
    assert {s["step"] for s in summary["steps"]} >= set(NEW)


def _result(out: Path, name: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert data["status"] in ("passed", "skipped"), (out / "stdout.txt").read_text()
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", ["product-lora", "product-qlora", "product-dpo", "product-grpo", "product-vision"])
def test_the_demo_recipe_through_the_cli_records_its_phases_and_speeds(dry_run, name):
    data = _result(dry_run, name)
    if data["status"] == "skipped":
        pytest.skip(data["line"])
    assert data["state"] == "succeeded" and data["steps"] == list(range(1, product.STEPS["cpu"] + 1))
    assert len(data["step_seconds"]) == len(data["steps"]) - 1 and data["smoke"]["tokens_per_second"] > 0
    assert data["plan"]["tokens"]["estimated_tokens_per_second"] > 0 and data["peak_memory_gb"] > 0
    assert "smoke test" in data["phases_seconds"] and data["worker"]["device"] == "cpu"
    if "export=[]" in product.overrides("cpu", name):  # product.CPU_TRIMS: made by the loan or another test
        assert "export" not in data["phases_seconds"] and not (data["export"] or {}).get("state"), data["export"]
    else:  # QLoRA's adapter export, timed as on the GPU
        assert data["export"]["state"] == "succeeded" and "export" in data["phases_seconds"]
    if name == "product-vision":  # the tiny VLM's run, scored with the images in the prompt
        assert "tiny-vlm" in data["command"] and data["task_eval"]["scores"] and "task score (exact)" in data["line"]


@pytest.mark.slow
def test_the_killed_run_resumes_exactly_on_the_cpu(dry_run):
    data = _result(dry_run, "resume-exact")
    assert data["ok"] and data["resume"]["exact"], data["line"]
    killed = data["runs"]["killed"]
    assert killed["relaunch_said_continuing"] and killed["ended"] == "succeeded"
    assert 1 <= killed["killed_after_checkpoint"] < resume_check.STEPS["cpu"]


@pytest.mark.slow
def test_ftrun_and_plain_trl_side_by_side_and_the_other_cpu_steps(dry_run):
    versus = _result(dry_run, "vs-trl")
    assert versus["shape"] == "tiny" and versus["sides"]["ftrun"]["tokens_per_second"] > 0
    assert versus["sides"]["trl"]["tokens_per_second"] > 0
    assert versus["sides"]["ftrun"]["timed_steps"] == versus["sides"]["trl"]["timed_steps"]
    assert versus["settings"]["padding_free"] is True
    gen = _result(dry_run, "generation")
    assert gen["variants"]["default"]["passes"][-1]["tokens_per_second"] > 0
    att = _result(dry_run, "attention")
    cases = att["cases"]
    assert set(cases) == set(attention.cases()) and att["policy"]["cudnn"] is False  # ftrun's policy, in the child
    assert cases["MATH/causal"]["supported"] and not cases["CUDNN_ATTENTION/causal"]["supported"]
    assert cases["default/padded"]["profile"]["backends"] and cases["default/decode"]["supported"]
    assert _result(dry_run, "unsloth")["status"] == "skipped"


@pytest.mark.slow
def test_the_grpo_step_records_its_sampling_share_and_rewards(dry_run):
    data = _result(dry_run, "product-grpo")
    if data["status"] == "skipped":
        pytest.skip(data["line"])
    assert data["rewards"] and all(len(r) == 3 for r in data["rewards"])
    assert 0 < data["sampling_share"] <= 1 and "sampling" in data["line"]


def test_resume_exact_ends_the_detached_runs_processes_when_it_is_stopped(tmp_path):
    """The step's timeout(1) sends SIGTERM to the step's process group; the detached supervisor leads a session of
    its own, out of that reach: the step ends the supervisor's and the worker's process groups itself."""
    import signal
    import sys
    import time

    run = tmp_path / "run"
    run.mkdir()
    step = tmp_path / "step.py"
    # the step: a 'supervisor' in a new session (as `ftrun RECIPE` detaches it) with a 'worker' child, recorded in
    # state.json as the run records them; then it waits inside resume_check's guard until it is sent SIGTERM
    worker = f"import time; time.sleep(120)  # launcher.worker.train --run-dir {run}"
    supervisor = (
        f"import subprocess, sys, time  # launcher.run.supervisor --run-dir {run}\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    step.write_text(
        "import json, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from gpu_check import resume_check\n"
        f"run = Path({str(run)!r})\n"
        f"sup = subprocess.Popen([sys.executable, '-c', {supervisor!r}], start_new_session=True,\n"
        "                       stdout=subprocess.PIPE, text=True)\n"
        "worker = int(sup.stdout.readline())\n"
        "state = {'state': 'running', 'supervisor_pid': sup.pid, 'worker_pid': worker}\n"
        "(run / 'state.json').write_text(json.dumps(state))\n"
        "with resume_check.detached_guard([run]):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(step)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.stdout.readline().strip() == "ready"
    state = json.loads((run / "state.json").read_text())
    assert _alive(state["supervisor_pid"]) and _alive(state["worker_pid"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 124
    deadline = time.monotonic() + 10
    while (_alive(state["supervisor_pid"]) or _alive(state["worker_pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(state["supervisor_pid"]) and not _alive(state["worker_pid"])
    # a pid that is not this run's (recycled: another program's, or another run's ftrun process) is left alone
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)  # launcher.worker.train --run-dir /elsewhere"],
        start_new_session=True,
    )
    (run / "state.json").write_text(json.dumps({"supervisor_pid": os.getpid(), "worker_pid": other.pid}))
    assert resume_check.end_detached([run]) == [] and _alive(other.pid)
    other.kill()
    other.wait()


def _bench_ctx(tmp_path, monkeypatch, card: str):
    from launcher.plan.hardware import catalog_box
    from gpu_check import bench

    monkeypatch.setattr(bench, "_plan_hardware", lambda ctx: (catalog_box(card, 1), f"catalog {card}"))
    monkeypatch.setattr(bench, "_fused_head_importable", lambda: True)
    return _ctx(tmp_path, device="cuda", shape="qwen3-8b", dry_run=False)


def test_the_preflight_skips_what_an_80_gb_card_cannot_hold(tmp_path, monkeypatch):
    """bench-full (~131 GB) does not fit an H100's 79.6 GB; bench-lora-fast is held to speed.py's own headroom;
    bench-lora fits. The reasons give the sizer's figure and the card's; an H200 holds bench-lora-fast."""
    from launcher.plan import speed
    from gpu_check import preflight

    ctx = _bench_ctx(tmp_path, monkeypatch, "H100-80GB")
    box = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_total_gb": 79.65, "process_seconds": 10.0}
    full = preflight.estimate(ctx, "bench-full", box)
    assert full.memory_gb > 100
    assert "needs" in preflight.memory_verdict(full, box) and "79.7 GB" in preflight.memory_verdict(full, box)
    fast = preflight.estimate(ctx, "bench-lora-fast", box)
    assert fast.memory_rule == "speed" and fast.memory_gb < 79.65 * 0.97 < fast.memory_gb * speed.HEADROOM
    assert "headroom" in preflight.memory_verdict(fast, box)
    lora = preflight.estimate(ctx, "bench-lora", box)
    assert preflight.memory_verdict(lora, box) is None
    # the time: a process start and the bench's tokens at the plan's tokens/s, each part saying where it comes from
    assert lora.seconds > 10 and any("plan's" in p and "tokens/s" in p for p in lora.parts)
    h200 = {**box, "gpu": "NVIDIA H200", "gpu_total_gb": 140.4}
    assert (
        preflight.memory_verdict(
            preflight.estimate(_bench_ctx(tmp_path, monkeypatch, "H200"), "bench-lora-fast", h200), h200
        )
        is None
    )


def test_each_preset_steps_estimate_comes_from_its_own_sizing(tmp_path):
    from gpu_check import preflight

    box = {"process_seconds": 10.0}
    for device in ("cuda", "cpu"):
        ctx = _ctx(tmp_path, device=device)
        for name in runner.selected_steps("product"):
            if name.startswith("bench-"):
                continue  # sized at the 8B shape: the test above
            est = preflight.estimate(ctx, name, box)
            assert est.parts and est.seconds >= 10 or name == "bench-padding", (name, est)
            assert all(" s " in p for p in est.parts)
    # GRPO samples: a prefill and a call per completion token each step, beside the task evaluation's calls (a
    # prefill and one call per new token for each batch of 32 held-out prompts; on a GPU no base-model evaluation),
    # counted here from the demo GRPO recipe itself
    import math

    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu-grpo.yaml").read_text())
    rows = (REPO / "recipes" / recipe["data"]).read_text().split("\n")
    held_out = round(sum(1 for r in rows if r.strip()) * recipe["eval"]["fraction"])
    per_step = 1 + recipe["grpo"]["max_completion_length"]
    per_eval = math.ceil(held_out / 32) * (1 + recipe["eval"]["max_new_tokens"])
    steps, calls, why = product.planned_calls("cuda", "product-grpo")
    smoke = product.smoke_steps("cuda", "product-grpo")  # the demo GRPO recipe's smoke.min_steps
    assert smoke >= 1 and steps == smoke + product.STEPS["cuda"] and "sampling" in why
    assert calls == steps * per_step + per_eval, (calls, steps, per_step, per_eval)
    # product-lora on a GPU: the pipeline's five processes, the step's own, and the CPU comparison's two
    assert product.processes("cuda", "product-lora") == 8 and product.processes("cuda", "product-dpo") == 4
    # the dry run leaves out what the loan leaves out of DPO and GRPO (their export), and keeps what it keeps
    for name in ("product-dpo", "product-grpo"):
        assert "export=[]" in product.overrides("cpu", name) and "export=[]" in product.overrides("cuda", name)
        assert product.processes("cpu", name) == 4  # the step's, the CLI's, the smoke test's and the run's
    # LoRA's export on the CPU is tests/run/test_one_value_per_figure.py's; on the loan product-lora times it
    assert "export=[]" in product.overrides("cpu", "product-lora") and product.processes("cpu", "product-lora") == 4
    assert not any(x.startswith("export") for x in product.overrides("cuda", "product-lora"))
    assert product.processes("cpu", "product-qlora") == 5  # the one export of the dry run
    cuda = preflight.estimate(_ctx(tmp_path, device="cuda"), "attention", box)
    assert any("cuDNN" in p for p in cuda.parts)


def test_the_report_says_what_the_call_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_CHECK_STEPS", "product")
    monkeypatch.setenv("GPU_CHECK_MODE", "gpu")
    out = tmp_path
    runner.write_summary(out)
    verdict = {"value": 900.0, "target": ">= 740 tokens/s", "met": True, "says": "generation 900 tokens/s"}
    (out / "generation.json").write_text(
        json.dumps(
            {"step": "generation", "status": "passed", "ok": True, "line": "x", "decides": {"generation": verdict}}
        )
    )
    no = {"value": {"exact": False}, "target": "bitwise", "met": False, "says": "resume on cuda: not exact"}
    (out / "resume-exact.json").write_text(
        json.dumps({"step": "resume-exact", "status": "passed", "ok": True, "line": "y", "decides": {"resume": no}})
    )
    (out / "bench-padding.json").write_text(
        json.dumps({"step": "bench-padding", "status": "timed out", "ok": False, "line": "timed out after 150 s"})
    )
    common.record_skip(out, "bench-lora", "needs 200 GB")
    text = runner.report(out)
    assert "    MET generation (generation): generation 900 tokens/s; target >= 740 tokens/s" in text
    assert "NOT MET resume (resume-exact)" in text
    assert "MISSING padding-free (bench-padding, timed out): timed out after 150 s" in text
    assert "MISSING plan-tokens-per-second (bench-lora, skipped): skipped: needs 200 GB" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decides"]["generation"]["step"] == "generation"


def _wheel(folder: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel (METADATA, WHEEL, RECORD and one module)."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for k, v in files.items():
            z.writestr(k, v)


def test_the_calls_wheels_are_tried_as_the_box_installs_them(tmp_path):
    """`device_wheels.sh --check DIR` (which the dry run runs where the call's wheel folder exists) installs them with
    pip install --target for the box's Python 3.12 on manylinux: one version of each passes, two of one fail."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "ftrun_probe", "1.0")
    script = REPO / "scripts" / "device_wheels.sh"
    ok = subprocess.run(["bash", str(script), "--check", str(wheels)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "install with pip install --target" in ok.stdout, ok.stdout + ok.stderr
    _wheel(wheels, "ftrun_probe", "2.0")
    two = subprocess.run(["bash", str(script), "--check", str(wheels)], capture_output=True, text=True, timeout=120)
    assert two.returncode == 1 and "do not install together" in two.stderr, two.stdout + two.stderr


def test_a_product_run_ends_with_its_step(tmp_path, monkeypatch):
    """The CLI runs in a session of its own (out of reach of the step's timeout(1)); when the step is ended (runner
    turns timeout's SIGTERM into SystemExit), the CLI's process group, a foreground run's worker with it, is
    killed, so nothing holds the GPU for the next step."""
    import signal

    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\nsleep 60 &\necho $! > {tmp_path / 'worker.pid'}\nsleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(product.sys, "executable", str(fake))

    def stop(signum, frame):
        raise SystemExit(124)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(2)
    try:
        with pytest.raises(SystemExit):
            product.cli(["recipe.yaml"], tmp_path, timeout=30, log=tmp_path / "cli.log")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    worker = int((tmp_path / "worker.pid").read_text())
    import time

    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_a_steps_seconds_keep_the_later_steps_estimates_but_never_starve_it():
    # room for everything: its timeout
    assert runner.step_limit(120, 40, 500, 200) == (120, "")
    # the later steps' estimates are kept out of what is left ...
    limit, why = runner.step_limit(120, 40, 300, 220)
    assert limit == 80 and "220 s kept for the later steps' estimates" in why
    # ... but never below its own estimate and a half: the earlier step matters more
    assert runner.step_limit(120, 40, 300, 290)[0] == 70
    # nor above what is left, or its timeout
    assert runner.step_limit(120, 200, 50, 0) == (50, "")
    assert runner.step_limit(1, 29, 500, 400)[0] == 1  # GPU_CHECK_TIMEOUTS=NAME=1 holds
    assert runner.step_limit(60, 60, 64, 71) == (60, "")  # its estimate and a half is all of it: nothing cut


def test_a_preflight_that_cannot_measure_the_box_still_lists_every_step(tmp_path, monkeypatch):
    from gpu_check import preflight

    def broken(device, names, timeout=120):
        raise RuntimeError("the box's import check failed: Segmentation fault")

    monkeypatch.setattr(preflight, "measure_box", broken)
    rows = preflight.run(_ctx(tmp_path), ["tiny-model", "device"], {"tiny-model": 90, "device": 60}, 100)
    assert [r[0] for r in rows] == ["tiny-model", "device"]
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert "Segmentation fault" in report["box"]["error"]


@pytest.mark.slow
def test_the_vision_step_trains_the_tiny_vlm_and_runs_the_7b_code_on_the_tiny_config(dry_run):
    data = _result(dry_run, "vision")
    if data["status"] == "skipped":
        pytest.skip(data["line"])
    tiny = data["tiny"]
    assert tiny["device"] == "cpu" and tiny["loss_falls"] and tiny["images"] > 0
    assert data["shape"]["name"] == "tiny VLM (dry run)" and data["shape"]["peak_memory_gb"] > 0
    assert data["plan"]["memory_gb"] > 0 and "decides" not in data  # the verdicts are a GPU's
    assert "needs a GPU" in data["line"]
