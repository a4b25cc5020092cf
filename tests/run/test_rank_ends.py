"""One rank down (issue 25), the fast parts: how a rank's end is classified from torchrun's report and error files,
the watchdog's deadlines and its choice of the silent rank, the words status uses. The real processes are in
tests/run/test_rank_down.py (slow tier)."""

from __future__ import annotations

import json

import pytest

from launcher.plan import deadlines
from launcher.run import rank_ends, views, watchdog
from launcher.store import heartbeat_files
from launcher.store.rundir import RunDir

# torch 2.13's ChildFailedError as torchrun printed it for `kill -9` of rank 1 (rank 0 then raised gloo's error)
REPORT = """
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40173: Connection reset by peer.
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
launcher.worker.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_08:44:17
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 15967) 
  error_file: {file0}
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_08:44:15
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 15968)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 15968
============================================================
"""


def _error_file(path, message: str, frames=("train.py", 10)) -> str:
    """What torch's ErrorHandler.record_exception writes."""
    tb = f'Traceback (most recent call last):\n  File "{frames[0]}", line {frames[1]}, in f\n{message}\n'
    path.write_text(
        json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": tb, "timestamp": "1796201055"}}})
    )
    return str(path)


def test_torchruns_report_gives_each_ranks_end_and_a_kill_is_the_cause_not_the_peers_error(tmp_path):
    f0 = _error_file(tmp_path / "e0.json", "RuntimeError: [pair.cc:537] Read error: Connection reset by peer.")
    ends = rank_ends.parse_report("earlier attempt: ChildFailedError ...\n" + REPORT.format(file0=f0))
    assert [(e.rank, e.exit_code, e.signal, e.root_cause) for e in ends] == [
        (0, 1, None, False),
        (1, -9, "SIGKILL", True),
    ]
    assert ends[0].kind == "exception" and ends[0].peer_gone
    root = rank_ends.cause(ends)
    assert (root.rank, root.kind) == (1, "signal")
    facts = rank_ends.facts(root, ends)
    assert facts["kind"] == "signal" and facts["signal"] == "SIGKILL"
    assert [r["rank"] for r in facts["ranks"]] == [0, 1]


def test_a_peers_error_is_never_the_cause_even_when_torchrun_saw_it_first(tmp_path):
    f0 = _error_file(tmp_path / "e0.json", "RuntimeError: Connection closed by peer [127.0.0.1]:1234")
    text = REPORT.format(file0=f0).replace("Root Cause", "XX").replace("Failures:", "Failures:\nRoot Cause")
    ends = rank_ends.parse_report(text)
    assert ends[0].root_cause  # torchrun's first observed failure: the survivor
    assert rank_ends.cause(ends).rank == 1


@pytest.mark.parametrize(
    "message, kind",
    [
        ("RuntimeError: injected fault in rank 1 at step 4", "exception"),
        ("torch.AcceleratorError: CUDA error: an illegal memory access was encountered", "cuda"),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error",
            "cuda",
        ),
    ],
)
def test_a_ranks_exception_is_an_exception_or_a_cuda_nccl_error(tmp_path, message, kind):
    f1 = _error_file(tmp_path / "e1.json", message)
    text = (
        REPORT.format(file0="<N/A>")
        .replace("exitcode  : -9 (pid: 15968)  (SIGKILL)", "exitcode  : 1 (pid: 15968)")
        .replace("error_file: <N/A>\n  traceback : Signal", f"error_file: {f1}\n  traceback : Signal")
    )
    ends = rank_ends.parse_report(text)
    root = rank_ends.cause(ends)
    assert (root.rank, root.kind, root.message) == (1, kind, message)
    assert ends[0].kind == "crash"  # rank 0 said nothing: exit 1 without an error file


def test_the_same_traceback_has_the_same_signature_and_another_place_not(tmp_path):
    a = rank_ends.single(1, tmp_path / "none.json")[0]
    assert a.kind == "crash" and a.signature() is None
    one = rank_ends.single(1, _error_file(tmp_path / "a.json", "ValueError: bad at 0x7f00aa"))[0]
    two = rank_ends.single(1, _error_file(tmp_path / "b.json", "ValueError: bad at 0x7f11bb"))[0]
    other = rank_ends.single(1, _error_file(tmp_path / "c.json", "ValueError: bad at 0x7f11bb", ("train.py", 11)))[0]
    assert one.signature() == two.signature() != other.signature()


@pytest.mark.parametrize(
    "code, kind",
    [(-9, "signal"), (-15, "signal"), (-1, "signal"), (-11, "crash"), (-6, "crash"), (77, "stopped"), (1, "crash")],
)
def test_a_single_workers_exit_code(code, kind):
    assert rank_ends.single(code, None)[0].kind == kind


def test_no_report_leaves_no_rank_ends():
    assert rank_ends.parse_report("Traceback ...\nRuntimeError: boom\n") == []
    assert rank_ends.cause([]) is None


def test_deadline_is_the_larger_of_factor_times_expected_and_the_floor_plus_the_heartbeat_interval(monkeypatch):
    assert deadlines.deadline(0.4, 300) == 300 + deadlines.HEARTBEAT_SECONDS
    assert deadlines.deadline(60, 300) == 600 + deadlines.HEARTBEAT_SECONDS
    assert deadlines.deadline(None, 300) == 300 + deadlines.HEARTBEAT_SECONDS
    monkeypatch.delenv(deadlines.FLOOR_ENV, raising=False)
    assert deadlines.floor_seconds() == deadlines.WATCHDOG_FLOOR_S == 300
    monkeypatch.setenv(deadlines.FLOOR_ENV, "20")
    assert deadlines.floor_seconds() == 20
    for bad in ("0", "-5", "soon"):
        assert deadlines.floor_seconds({deadlines.FLOOR_ENV: bad}) == 300


def test_expected_phase_times_come_from_the_smoke_test_else_the_plan():
    smoke = {
        "seconds_per_step": 0.4,
        "checkpoint_seconds": 12.0,
        "samples_seconds": 3.0,
        "eval_seconds": 30.0,
        "startup_seconds": 40.0,
    }
    e = deadlines.expected_seconds({}, smoke)
    assert e == {"start": 52.0, "step": 0.4, "hash": 12.0, "save": 12.0, "eval": 30.0, "export": 15.0}
    plan = {"estimate": {"hours": 1.0, "setup_hours": 0.1}, "total_steps": 1000}
    e = deadlines.expected_seconds(plan, {})
    assert e["step"] == pytest.approx(3.6) and e["start"] == pytest.approx(360) and e["save"] is None
    # the process group's backstop: twice the longest collective phase's deadline, so the watchdog acts first
    assert deadlines.process_group_timeout({}, smoke, floor=300) == 2 * (300 + 2)
    assert deadlines.process_group_timeout({}, {**smoke, "checkpoint_seconds": 100.0}, floor=300) == 2 * (
        10 * 103 + 2
    )  # the export: a save and the samples
    assert deadlines.process_group_timeout({}, {}, floor=300) < 1800  # not the Trainer's default 30 min


def _beat(rank, step, phase, at, pid=None):
    return {"rank": rank, "step": step, "phase": phase, "time": at, **({"pid": pid} if pid else {})}


def test_watchdog_blames_the_stopped_rank_once_any_rank_is_past_its_deadline():
    expected = {"step": 0.4, "start": None}
    now = 1000.0
    # rank 0 waits in a collective for rank 1, which a SIGSTOP froze; rank 0's file is by chance the older one
    beats = {0: _beat(0, 35, "step", now - 40, pid=10), 1: _beat(1, 35, "step", now - 39, pid=11)}
    states = {10: "sleeping", 11: "stopped"}
    hang = watchdog.silent_rank(beats, [0, 1], now - 100, now, expected, floor=30, process_state=states.get)
    assert hang["rank"] == 1 and hang["process_state"] == "stopped" and hang["silent_ranks"] == [0, 1]
    assert hang["behind"] == [1] and not hang["all_silent"]
    assert hang["step"] == 35 and hang["phase"] == "step" and hang["expected_seconds"] == 0.4
    # within the deadline: nothing
    assert watchdog.silent_rank(beats, [0, 1], now - 100, now - 15, expected, 30, states.get) is None
    # without a process state to go by: the lowest step, then the longest silent
    beats[1]["step"] = 34
    hang = watchdog.silent_rank(beats, [0, 1], now - 100, now, expected, 30)
    assert hang["rank"] == 1 and hang["behind"] == [1] and not hang["all_silent"]
    assert views.rank_end_text({"kind": "hang", "world": 2, **hang}).startswith("rank 1 silent for 39 s at step 34")
    # both blocked at the same step (an NCCL or GPU hang: each waits at the next collective): no rank is named
    beats[1]["step"] = 35
    hang = watchdog.silent_rank(beats, [0, 1], now - 100, now, expected, 30)
    assert hang["rank"] == 0 and hang["behind"] == [0, 1] and hang["all_silent"]
    assert views.rank_end_text({"kind": "hang", "world": 2, **hang}) == (
        "all 2 ranks silent for 40 s since step 35 (in a step; expected 0.4 s)"
    )
    # four ranks, two of them behind the others: both named
    beats = {r: _beat(r, 35 if r % 2 else 34, "step", now - 40) for r in range(4)}
    hang = watchdog.silent_rank(beats, range(4), now - 100, now, expected, 30)
    assert hang["behind"] == [0, 2] and not hang["all_silent"]
    assert views.rank_end_text({"kind": "hang", "world": 4, **hang}).startswith("ranks 0, 2 silent for 40 s at step 34")


def test_watchdog_counts_a_rank_without_heartbeat_as_starting_since_the_launch_and_skips_a_raising_one():
    now = 1000.0
    expected = {"start": 20.0}
    beats = {0: _beat(0, 0, "error", now - 500)}
    assert watchdog.silent_rank(beats, [0, 1], now - 150, now, expected, floor=30) is None  # 10 x 20 s not yet
    hang = watchdog.silent_rank(beats, [0, 1], now - 250, now, expected, floor=30)
    assert hang["rank"] == 1 and hang["phase"] == "start" and hang["silent_ranks"] == [1]
    # a start-up nothing measured or planned: three floors
    assert watchdog.silent_rank({}, [0], now - 80, now, {"start": None}, floor=30) is None
    assert watchdog.silent_rank({}, [0], now - 95, now, {"start": None}, floor=30)["rank"] == 0
    assert watchdog.local_ranks({"num_processes": 4, "nodes": {"node_rank": 1}}) == [4, 5, 6, 7]


def test_heartbeat_files_round_trip_and_the_worker_throttles_its_writes(tmp_path, monkeypatch):
    from launcher.worker import heartbeat as beat

    run = RunDir(tmp_path)
    hb = beat.Heartbeat()
    hb.beat("step", 3)  # not started: writes nothing
    assert heartbeat_files.read_all(run) == {}
    clock = [100.0]
    monkeypatch.setattr(beat.time, "time", lambda: clock[0])
    hb.start(tmp_path, 1)
    assert heartbeat_files.read_all(run)[1]["phase"] == "start"
    hb.beat("step", 1)  # a new phase: written at once
    clock[0] += 0.5
    hb.beat("step", 2)  # the same phase within HEARTBEAT_SECONDS: not written
    assert heartbeat_files.read_all(run)[1]["step"] == 1
    clock[0] += beat.HEARTBEAT_SECONDS
    hb.beat("step", 3)
    got = heartbeat_files.read_all(run)[1]
    assert (got["step"], got["phase"], got["time"], got["phase_started"]) == (3, "step", 102.5, 100.0)
    (run.heartbeats / "rank-7.json").write_text("{half")  # a file being replaced is skipped
    assert list(heartbeat_files.read_all(run)) == [1]
    heartbeat_files.clear(run)
    assert heartbeat_files.read_all(run) == {}


def test_status_words_each_end_with_rank_step_and_what_follows():
    hang = {
        "kind": "hang",
        "rank": 1,
        "world": 2,
        "silent_seconds": 240,
        "step": 35,
        "phase": "step",
        "expected_seconds": 0.4,
    }
    assert views.rank_end_text(hang) == "rank 1 silent for 4.0 min at step 35 (in a step; expected 0.4 s)"
    kill = {"kind": "signal", "rank": 1, "world": 2, "signal": "SIGKILL", "step": 12}
    assert views.restarted_reason(kill, 1, 3, 2) == (
        "rank 1 was killed by SIGKILL at step 12 (an interruption from outside, not a crash); restarted from the "
        "newest verified checkpoint in 2s (restart 1 of max_restarts=3 per hour)"
    )
    boom = {"kind": "exception", "rank": 1, "world": 2, "step": 4, "message": "RuntimeError: boom"}
    assert views.repeated_crash_reason(boom).startswith("rank 1 raised at step 4: RuntimeError: boom, the same error")
    cuda = {"kind": "cuda", "rank": 0, "world": 2, "step": 9, "message": "CUDA error: unspecified launch failure"}
    assert views.rank_end_text(cuda) == "CUDA/NCCL error on rank 0 at step 9: CUDA error: unspecified launch failure"
    single = {"kind": "signal", "rank": 0, "world": 1, "signal": "SIGKILL", "step": 3}
    assert views.restart_budget_reason(single, 3, 3).startswith(
        "the worker was killed by SIGKILL at step 3 (an interruption from outside, not a crash); not restarted: 3 "
        "restart(s) in the last hour, the limit (max_restarts=3 per hour)"
    )
    rows = watchdog.heartbeat_rows({1: _beat(1, 35, "save", 990.0)}, 1000.0)
    assert views.heartbeat_lines(rows) == ["  rank 1: step 35, saving a checkpoint, heartbeat 10 s ago"]
