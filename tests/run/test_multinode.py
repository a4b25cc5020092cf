"""Two "nodes" on 127.0.0.1: the same ftrun command on each box, torchrun's static rendezvous, DDP over both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, recipe_file
from helpers import free_port, ftrun, metrics


@pytest.mark.slow
def test_two_nodes_on_loopback_train_like_one_process_with_double_accumulation(tmp_path, tiny_model):
    fields = dict(max_steps=6, micro_batch_size=4, gradient_accumulation_steps=1, smoke={"enabled": False})
    recipe = recipe_file(
        tmp_path / "r.yaml", tiny_model, output_dir=tmp_path / "node0", engine="ddp", num_processes=1, **fields
    )
    port = free_port()
    # one process per node: without OMP_NUM_THREADS=1 two processes on 2 cores crawl (STACK-FACTS)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher.cli",
                str(recipe),
                "--foreground",
                f"output_dir={tmp_path / f'node{rank}'}",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    plan = json.loads((node0 / "plan.json").read_text())
    assert plan["nodes"] == {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port}
    assert "--nnodes=2" in plan["launch_argv"] and "--node-rank=0" in plan["launch_argv"]
    state = json.loads((node0 / "state.json").read_text())
    assert state["verification"]["ok"] and state["verification"]["world_size"] == 2
    assert [r["step"] for r in metrics(node0)] == list(range(1, 7))
    assert (node0 / "final" / "adapter" / "adapter_model.safetensors").is_file()
    # every box keeps its own verified checkpoints, so either can resume
    assert list((node1 / "checkpoints").glob("step-*/manifest.json"))

    ref = recipe_file(
        tmp_path / "ref.yaml", tiny_model, output_dir=tmp_path / "ref", **{**fields, "gradient_accumulation_steps": 2}
    )
    res = ftrun(ref, "--foreground", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for a, b in zip(metrics(node0), metrics(tmp_path / "ref")):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
