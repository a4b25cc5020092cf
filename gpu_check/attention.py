"""The attention step: torch's attention kernels forward and backward at 8 sequence lengths for three mask cases,
torch's varlen kernel for padding-free rows, and generation's attention (a real prompt's prefill, then a decode
step per new token), each under ftrun's SDPA policy (launcher/plan/attention.py, applied by
launcher/worker/loading.py apply_sdpa_backends, as every ftrun process that runs attention does) and each backend
forced alone; the first call's cost against a repeat's, and the kernels torch.profiler saw run.

Every case is its own entry of the child's JSON, written when the case ends, and has its own timeout: a case that
hangs or builds for too long (cuDNN builds an execution graph per new shape) is recorded as timed out and the child
is started again for the cases after it. "default" (what a run gets) goes first, and no case sees a sequence length
another case has seen: a backend that builds per shape finds nothing of another case's in its caches."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

from gpu_check.common import Context, child_env, first_line, module_cmd, read_json, write_json

# Qwen3-8B's attention (launcher/plan/models.py): 32 query heads, 8 key/value heads, head_dim 128; the dry run a
# tiny GQA shape. `lengths`: the base lengths, each case adds its own offset (case_lengths), none a multiple of
# another, as a padding-free step's totals are. Decode: the task evaluation's batch of 32 prompts
# (launcher/worker/task_eval.py BATCH), left-padded as generate pads them, their lengths those of chat prompts.
SHAPES = {
    "cuda": dict(
        heads=32,
        kv_heads=8,
        head_dim=128,
        batch=4,
        lengths=(517, 803, 1029, 1301, 1610, 1877, 2113, 2390),
        decode_batch=32,
        prompt_lengths=(40, 420),  # shortest and longest prompt of the batch; the rows spread between them
        new_tokens=24,  # the demo recipe's eval.max_new_tokens
        repeats=3,
    ),
    "cpu": dict(
        heads=4,
        kv_heads=2,
        head_dim=32,
        batch=2,
        lengths=(16, 40, 64, 88),
        decode_batch=4,
        prompt_lengths=(6, 20),
        new_tokens=4,
        repeats=2,
    ),
}
# "default" is SDPA as a run calls it: torch's dispatch over the backends ftrun's policy leaves on. "varlen" is
# torch's FlashAttention-2 varlen kernel (torch.nn.attention.varlen, torch 2.10+): padding-free rows without a mask.
BACKENDS = ("default", "varlen", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")
MASKS = ("causal", "padded", "padding-free")
KINDS = (*MASKS, "decode")
# cuDNN's cost of a new shape: up to about a second per step with a new token count on the first H200 loan
# (docs/engines.md). A case's own limit: cuDNN's decode case (a prefill and 24 new key lengths) at that cost, and
# some; the dry run's CPU is slower per call.
CUDNN_BUILD_S = 1.0
CASE_TIMEOUT_S = {"cuda": 40.0, "cpu": 60.0}


def cases() -> list[str]:
    """Every case in the order run: the default dispatch first, cuDNN (the slow builder) last."""
    out = []
    for backend in BACKENDS:
        for kind in KINDS:
            if backend == "varlen" and kind != "padding-free":
                continue  # varlen is the padding-free layout's kernel; a padded batch goes through SDPA
            out.append(f"{backend}/{kind}")
    return out


def cudnn_shapes(s: dict[str, Any]) -> int:
    """New shapes the cuDNN cases bring (a training length's forward and backward counted as one, each decode
    step's key length one): what it builds."""
    kinds = [c.split("/")[1] for c in cases() if c.startswith("CUDNN")]
    return sum(1 + s["new_tokens"] if k == "decode" else len(s["lengths"]) for k in kinds)


def case_lengths(s: dict[str, Any], index: int) -> list[int]:
    """Case `index`'s lengths: the base lengths shifted by its own offset, so that no two cases share one."""
    base = s["lengths"]
    gap = min(b - a for a, b in zip(base, base[1:]))
    step = max(1, gap // (len(cases()) + 1))
    return [n + index * step for n in base]


def _segments(length: int, count: int) -> list[int]:
    """A micro-batch's example lengths, the longest `length`, each shorter one an even step down."""
    return [length - (length * i) // (2 * count) for i in range(count)]


def _inputs(case: str, length: int, s: dict[str, Any], device: str, dtype):
    """(q, k, v, mask, is_causal) as transformers 5.x hands them to SDPA: GQA through enable_gqa only without a mask
    on CUDA, else the key/value heads repeated (transformers/integrations/sdpa_attention.py, use_gqa_in_sdpa and
    repeat_kv); a bool mask where True attends (transformers/masking_utils.py, sdpa_mask)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(length)
    batch = 1 if case == "padding-free" else s["batch"]
    total = length * s["batch"] if case == "padding-free" else length  # padding-free: the batch's examples in a row

    def rand(heads: int):
        return torch.randn(batch, heads, total, s["head_dim"], generator=g).to(device, dtype).requires_grad_()

    q, k, v = rand(s["heads"]), rand(s["kv_heads"]), rand(s["kv_heads"])
    if case == "causal":
        return q, k, v, None, True
    pos = torch.arange(total)
    causal = pos[:, None] >= pos[None, :]
    if case == "padded":  # each row's own length, right-padded to the longest
        lens = _segments(length, batch)
        keep = torch.stack([pos < n for n in lens])  # (batch, keys)
        mask = causal[None, None] & keep[:, None, None, :]
    else:  # block-diagonal: each example sees itself only (position ids restart per example)
        parts = _segments(length, s["batch"])
        parts[-1] += total - sum(parts)
        doc = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(parts))
        mask = (causal & (doc[:, None] == doc[None, :]))[None, None]
    rep = s["heads"] // s["kv_heads"]
    k = k.detach().repeat_interleave(rep, dim=1).requires_grad_()
    v = v.detach().repeat_interleave(rep, dim=1).requires_grad_()
    return q, k, v, mask.to(device), False


def _context(backend: str):
    """sdpa_kernel sets the enable flags of the backends it names and clears the others for the block
    (torch/nn/attention/__init__.py, _sdpa_kernel), so a forced backend runs even where the policy turned it off."""
    import contextlib

    if backend in ("default", "varlen"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def _timer(device: str) -> Callable[[Callable[[], None]], float]:
    import torch

    def timed(fn: Callable[[], None]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return round((time.perf_counter() - t0) * 1000, 3)

    return timed


# What names an attention op or kernel in a profile: aten's SDPA ops say the backend the dispatch chose
# (_scaled_dot_product_{flash,efficient,cudnn}_attention, _scaled_dot_product_attention_math, ..._for_cpu), the
# varlen op is torch_attn::_varlen_attn; kernels: fmha/flash/cudnn/xformers-style names.
_ATTENTION_WORDS = ("attention", "attn", "fmha", "flash", "cudnn", "mha", "sdpa", "softmax", "varlen")
_BACKEND_OF_OP = (
    ("varlen", "varlen"),
    ("cudnn_attention", "cudnn"),
    ("flash_attention_for_cpu", "cpu-flash"),
    ("flash_attention", "flash"),
    ("efficient_attention", "efficient"),
    ("attention_math", "math"),
)


def profile_kernels(fn: Callable[[], None], device: str) -> dict[str, Any]:
    """Run `fn` once under torch.profiler: the attention ops torch dispatched to, the backend their names say, and
    the device kernels that ran (the attention ones first, each with its total microseconds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    ops: list[str] = []
    kernels: dict[str, float] = {}
    for e in prof.events():
        name = e.name
        if e.device_type == DeviceType.CPU:
            low = name.lower()
            if any(w in low for w in _ATTENTION_WORDS) and name not in ops:
                ops.append(name)
        else:
            kernels[name] = kernels.get(name, 0.0) + e.time_range.elapsed_us()
    attention_kernels = {k: v for k, v in kernels.items() if any(w in k.lower() for w in _ATTENTION_WORDS)}
    others = sorted((k for k in kernels if k not in attention_kernels), key=kernels.get, reverse=True)[:4]
    backends = []
    for op in ops:
        for word, backend in _BACKEND_OF_OP:
            if word in op.lower():
                if backend not in backends:
                    backends.append(backend)
                break
    return {
        "ops": ops,
        "backends": backends,
        "attention_kernels": {k[:200]: round(v, 1) for k, v in sorted(attention_kernels.items(), key=lambda x: -x[1])},
        "other_kernels": [k[:200] for k in others],
    }


def _varlen_fn():
    """torch's varlen attention (torch.nn.attention.varlen.varlen_attn, torch 2.10+), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_call(fn, q, k, v, cu, longest: int):
    """Causal GQA varlen attention with the signature this torch has: torch 2.13 takes window_size=(-1, 0) for
    causal and enable_gqa (torch/nn/attention/varlen.py varlen_attn); an earlier one's is_causal is used where it
    is a parameter, and key/value heads are repeated where enable_gqa is not."""
    params = inspect.signature(fn).parameters
    kw: dict[str, Any] = {}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kw["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu, cu, longest, longest, **kw)


def _forward_alone(fn, q, k, v, cu, longest: int) -> str:
    """Where forward and backward failed: whether the forward alone runs (then the backward pass is what fails)."""
    import torch

    try:
        with torch.no_grad():
            _varlen_call(fn, q, k, v, cu, longest)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        return f"fails too: {first_line(exc)}"
    return "runs: the backward pass is what fails"


def _train_case(backend: str, kind: str, lengths: list[int], s: dict[str, Any], device: str, dtype) -> dict[str, Any]:
    """Forward and backward at each length: the first call's milliseconds and the best repeat's; the profile of a
    repeat at the longest length."""
    import torch
    import torch.nn.functional as F

    timed = _timer(device)
    rows = []
    once: Optional[Callable[[], None]] = None
    for length in lengths:
        if backend == "varlen":
            fn = _varlen_fn()
            if fn is None:
                return {"supported": False, "error": "torch.nn.attention.varlen is not in this torch"}
            if device != "cuda":
                return {"supported": False, "error": "torch's varlen kernel is FlashAttention-2's: CUDA only"}
            parts = _segments(length, s["batch"])
            cu = torch.tensor([0, *torch.tensor(parts).cumsum(0).tolist()], dtype=torch.int32, device=device)
            total = int(cu[-1])
            g = torch.Generator(device="cpu").manual_seed(length)

            def rand(h: int, total: int = total, g=g):
                return torch.randn(total, h, s["head_dim"], generator=g).to(device, dtype).requires_grad_()

            q, k, v = rand(s["heads"]), rand(s["kv_heads"]), rand(s["kv_heads"])

            def once(q=q, k=k, v=v, cu=cu, longest=max(parts)) -> None:  # type: ignore[misc]
                out = _varlen_call(fn, q, k, v, cu, longest)
                out = out[0] if isinstance(out, tuple) else out
                out.float().sum().backward()

            tokens = total
        else:
            q, k, v, mask, causal = _inputs(kind, length, s, device, dtype)
            gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}

            def once(q=q, k=k, v=v, mask=mask, causal=causal, gqa=gqa) -> None:  # type: ignore[misc]
                with _context(backend):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
                out.float().sum().backward()

            tokens = q.shape[0] * q.shape[2]
        try:
            first = timed(once)
            repeat = min(timed(once) for _ in range(s["repeats"]))
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            refused = {"supported": False, "error": first_line(exc), "at_length": length}
            if backend == "varlen":  # issue 55: does this torch's varlen kernel have its backward pass?
                refused["forward_alone"] = _forward_alone(fn, q, k, v, cu, max(parts))
            return refused
        rows.append({"length": length, "tokens": tokens, "first_ms": first, "repeat_ms": repeat})
    ratio = sum(r["first_ms"] for r in rows) / max(1e-9, sum(r["repeat_ms"] for r in rows))
    assert once is not None
    return {
        "supported": True,
        "lengths": rows,
        "first_over_repeat": round(ratio, 2),
        "first_ms_total": round(sum(r["first_ms"] for r in rows), 2),
        "repeat_ms_total": round(sum(r["repeat_ms"] for r in rows), 2),
        "profile": profile_kernels(once, device),
    }


def _prompt_lengths(s: dict[str, Any], index: int) -> list[int]:
    """The decode batch's prompt lengths, spread between the shortest and longest, shifted by the case's index."""
    lo, hi = s["prompt_lengths"]
    n = s["decode_batch"]
    return [lo + index + (hi - lo) * i // max(1, n - 1) for i in range(n)]


def _decode_case(backend: str, index: int, s: dict[str, Any], device: str, dtype) -> dict[str, Any]:
    """Generation's attention as transformers' generate runs it on a left-padded batch of prompts: the prompt's
    prefill (causal, padding masked), then one query per new token against the keys so far, a padding mask each
    step (the key/value heads repeated, as with any mask). Milliseconds of the prefill and of each decode step."""
    import torch
    import torch.nn.functional as F

    timed = _timer(device)
    rep = s["heads"] // s["kv_heads"]
    lens = _prompt_lengths(s, index)
    longest, b, new = max(lens), s["decode_batch"], s["new_tokens"]
    g = torch.Generator(device="cpu").manual_seed(index)
    keys = longest + new
    cache_k = torch.randn(b, s["kv_heads"], keys, s["head_dim"], generator=g).to(device, dtype)
    cache_k = cache_k.repeat_interleave(rep, dim=1)
    cache_v = torch.randn_like(cache_k)
    pad = torch.tensor([longest - n for n in lens], device=device)  # left padding per row
    pos = torch.arange(keys, device=device)
    real = pos[None, :] >= pad[:, None]  # (batch, keys): False on each row's padding

    def attend(q, n_keys: int, mask) -> None:
        with _context(backend):
            F.scaled_dot_product_attention(q, cache_k[:, :, :n_keys], cache_v[:, :, :n_keys], attn_mask=mask)

    ms = []
    with torch.no_grad():
        qp = torch.randn(b, s["heads"], longest, s["head_dim"], generator=g).to(device, dtype)
        causal = pos[:longest, None] >= pos[None, :longest]
        # a padding query attends to itself only (a fully masked row would be NaN); real ones causally to real keys
        prefill_mask = (causal[None] & real[:, None, :longest]) | torch.eye(longest, dtype=torch.bool, device=device)
        prefill_mask = prefill_mask[:, None]
        try:
            prefill = timed(lambda: attend(qp, longest, prefill_mask))
            last = None
            for t in range(new):
                n_keys = longest + t + 1
                q = torch.randn(b, s["heads"], 1, s["head_dim"], generator=g).to(device, dtype)
                mask = real[:, None, None, :n_keys]
                ms.append(timed(lambda q=q, n_keys=n_keys, mask=mask: attend(q, n_keys, mask)))
                last = (q, n_keys, mask)
        except (RuntimeError, NotImplementedError) as exc:
            return {"supported": False, "error": first_line(exc), "at_new_token": len(ms)}
        q, n_keys, mask = last
        profile = profile_kernels(lambda: attend(q, n_keys, mask), device)
    return {
        "supported": True,
        "prompt_lengths": [min(lens), max(lens)],
        "prefill_ms": prefill,
        "tokens": len(ms),
        "total_ms": round(sum(ms), 2),
        "first_ms": ms[0],
        "median_ms": sorted(ms)[len(ms) // 2],
        "max_ms": max(ms),
        "profile": profile,
    }


def run_case(name: str, s: dict[str, Any], device: str, dtype) -> dict[str, Any]:
    backend, kind = name.split("/")
    index = cases().index(name)
    if kind == "decode":
        return _decode_case(backend, index, s, device, dtype)
    return _train_case(backend, kind, case_lengths(s, index), s, device, dtype)


def attention_child(out: str) -> int:
    """The cases not yet in `out` (a JSON the parent reads), in order, each written there as it ends; `running`
    names the case under way and when it started, for the parent's per-case timeout."""
    import torch

    from launcher.worker import loading

    policy = loading.apply_sdpa_backends()  # ftrun's policy, as the worker and the task evaluation set it
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = SHAPES[device]
    path = Path(out)
    result = read_json(path) or {}
    result.update(
        device=device,
        dtype=str(dtype).replace("torch.", ""),
        shape=s,
        torch=torch.__version__,
        cudnn=torch.backends.cudnn.version(),
        policy=policy,
        gpu=torch.cuda.get_device_name(0) if device == "cuda" else None,
    )
    result.setdefault("cases", {})
    if device == "cuda":  # the context, cuBLAS and the allocator: not a first call's cost of the first case
        a = torch.randn(256, 256, device=device, dtype=dtype)
        (a @ a).sum().item()
    only = os.environ.get("GPU_CHECK_ATTENTION_ONLY")  # one backend, to look at it alone
    for name in cases():
        if name in result["cases"] or (only and not name.startswith(only + "/")):
            continue
        result["running"] = {"case": name, "started": time.time(), "pid": os.getpid()}
        write_json(path, result)
        t0 = time.perf_counter()
        r = run_case(name, s, device, dtype)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        result["cases"][name] = r
        result.pop("running", None)
        write_json(path, result)
    return 0


def _said(r: dict[str, Any]) -> str:
    if r.get("timed_out"):
        return "timed out"
    if r.get("not_run"):
        return "not run"
    if not r.get("supported"):
        return "n/a"
    backends = "+".join((r.get("profile") or {}).get("backends") or []) or "?"
    if "total_ms" in r:
        return f"{r['total_ms']:.0f} ms/{r['tokens']} tok [{backends}]"
    return f"x{r['first_over_repeat']} [{backends}]"


def _line(result: dict[str, Any]) -> str:
    by_backend: dict[str, list[str]] = {}
    for name, r in result.get("cases", {}).items():
        backend, kind = name.split("/")
        by_backend.setdefault(backend, []).append(f"{kind} {_said(r)}")
    parts = [f"{b.split('_')[0].lower()}: {', '.join(x)}" for b, x in by_backend.items()]
    return "first/repeat [backend that ran] " + "; ".join(parts)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_children(path: Path, budget: float, case_timeout: float, cmd: Optional[list[str]] = None) -> list[str]:
    """Run attention children (`cmd`, by default `attention-child --out PATH`) until every case is in `path` or
    the budget is spent: a case past `case_timeout` is recorded as timed out, its child (and anything it started)
    killed, and a new child goes on with the next case; a child that dies in a case records that case as crashed.
    Returns the child's last output lines."""
    deadline = time.monotonic() + budget
    tail: list[str] = []
    log = path.with_suffix(".log")
    while time.monotonic() < deadline:
        data = read_json(path) or {}
        done = len(data.get("cases", {}))
        if done == len(cases()):
            break
        with log.open("a") as fh:
            proc = subprocess.Popen(
                cmd or module_cmd("attention-child", "--out", str(path)),
                env=child_env(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        stuck: Optional[tuple[str, float]] = None
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                data = read_json(path) or {}
                running = data.get("running") or {}
                now = time.time()
                if running.get("case") and now - running.get("started", now) > case_timeout:
                    stuck = (running["case"], now - running["started"])
                if stuck or time.monotonic() > deadline:
                    _kill_group(proc)
                    break
        except BaseException:  # the step is ended (its timeout's SIGTERM): the child, in a session of its own, too
            _kill_group(proc)
            raise
        data = read_json(path) or {}
        running = (data.get("running") or {}).get("case")
        data.pop("running", None)
        data.setdefault("cases", {})
        if stuck:
            data["cases"][stuck[0]] = {"supported": None, "timed_out": True, "seconds": round(stuck[1], 1)}
        elif running and time.monotonic() <= deadline:
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.is_file() else []
            data["cases"][running] = {"supported": None, "crashed": True, "error": lines[-1][:300] if lines else ""}
        write_json(path, data)
        if log.is_file():
            tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-5:]
        if len(data["cases"]) == done:  # the child got no case done (an import failed, say): another would not
            break
    data = read_json(path) or {}
    data.pop("running", None)
    cases_done = data.setdefault("cases", {})
    for name in cases():
        cases_done.setdefault(name, {"supported": None, "not_run": "the step's time ran out before it"})
    write_json(path, data)
    return tail


def step_attention(ctx: Context) -> dict[str, Any]:
    budget = float(os.environ.get("GPU_CHECK_STEP_BUDGET", "120"))
    path = ctx.out / "attention.child.json"
    path.unlink(missing_ok=True)
    tail = run_children(path, budget - 5, CASE_TIMEOUT_S[ctx.device])
    result = read_json(path) or {}
    if "device" not in result:
        why = tail[-1][:200] if tail else "no output"
        return {"ok": False, "error": why, "line": f"attention child failed: {why}"}
    path.unlink()
    path.with_suffix(".log").unlink(missing_ok=True)
    result["hub_kernel"] = _hub_kernel()
    default = [r for n, r in result["cases"].items() if n.startswith("default/")]
    ok = all(r.get("supported") for r in default)  # what a run calls must run; a forced backend may refuse
    return {"ok": ok, **result, "line": _line(result)}


def _hub_kernel() -> dict[str, Any]:
    """transformers' Hub kernels (attn_implementation="kernels-community/...") need the `kernels` package and the
    kernel's download: a lent box has no network, so only a kernel already in its Hub cache could run."""
    import importlib.util

    if importlib.util.find_spec("kernels") is None:
        return {"skipped": "the kernels package is not installed"}
    return {"skipped": "no network on the box to fetch a Hub kernel, and none is carried"}
