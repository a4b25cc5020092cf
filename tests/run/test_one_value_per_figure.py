"""One figure, one value: every figure a demo run shows in more than one of its outputs has the same value in
each, or a label beside it that says why it differs (issue 34, "a newcomer's second hour").

One run, as scripts/demo.sh makes it (recipes/tiny-cpu.yaml's settings on the tests' tiny model, one epoch instead of
five, the export with the merged model too, so that its dtype is shown): `ftrun plan`, `ftrun data`, the launch
(the plan again, the base model's task scores, the smoke test; detached, as the demo runs), `ftrun status` after
the end (the status block, then the end summary), the worker log (train.log: worker, supervisor and export lines),
metrics.jsonl, smoke.json, final/task_eval.json and final/export.json. The figures, and where each is read:

- examples (in all / train / held out): the data line (`ftrun data`, `ftrun plan`, the launch), the data view's
  statistics, the plan's Tokens: line, the launch's evaluation and smoke-test lines, the worker's "training on"
  and "data as TRL prepared it" lines; the task evaluation's count in its lines, its table (launch, summary) and
  task_eval.json
- tokens per epoch and trained (loss) tokens: the data line, the data view ("what the loss sees", statistics),
  the worker's "loss on N of M tokens"; the run's training tokens: the plan's Tokens: and Why lines (rounded), the
  smoke test's "full run: N tokens", smoke.json, the summary's tokens (labelled "by step N, the last logged one"
  where the last step logged no row) against metrics.jsonl's tokens_seen
- parameters: the plan's weights and Why lines (base, rounded), its adapters line (trainable, rounded), the
  worker's model line (base + adapter = all, trainable), export.json's placement and the export's
  "float32 (N KB)" lines (base x 4 B)
- LoRA rank: the plan, the supervisor's adapter check, the export's adapter line, export.json, the summary's serve
  command
- steps: the plan's Steps: line (and the batch that makes it), the worker's step lines, the status bar, the
  summary's head, metrics.jsonl, the last checkpoint (status, worker log); the batch per step (status, worker)
- checkpoint cadence: the plan's "about every N steps (every M by the clock)" against the recipe and the plan's
  own speed and tokens per step (the worker checkpoints by the clock: its steps are not the plan's N)
- losses: each worker step line and eval line against metrics.jsonl; the summary's first and last loss and eval
  loss (with their steps), the status's loss and eval loss (with its step)
- tokens/s: the plan's Speed: and Why lines (estimated), the smoke test's line against smoke.json (measured), the
  finished run's status (its average) against `ftrun status --json`, the worker's last step line against the last
  metrics row; the task evaluation's generation rates
  (its worker lines, the tables, the export's merged line, task_eval.json)
- time forecasts: the plan's Time: and Why lines against the status's "plan forecast" (rounded), the smoke
  test's "about T" against the status (twice), the summary and smoke.json; the time used: the status's "in all"
  against its phases, the summary's "on the box" against the smoke test and training phases, and the summary's
  percentage against its two durations; the cost and the
  price per hour (plan, status, summary, smoke.json)
- memory: the plan's estimate against the status's "the sizer estimated", the smoke test's peak against
  smoke.json and the status's "measured by the smoke test"
- task scores: the base model's (worker lines, the launch's and the summary's tables, task_eval.json), the
  fine-tuned and merged models' (worker and export lines, the summary's table), the gain line against the table
- the export: each output's size (export lines, the supervisor's "export finished", the status, export.json, the
  files), the dtypes (the worker's training dtype, the export's parity and merge loads, "saved in bfloat16",
  export.json's export_dtype, the merged folder's config.json and tensors)
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from conftest import recipe_file
from helpers import ftrun, metrics, wait_until_ended

pytestmark = pytest.mark.slow  # one full run with its smoke test, task evaluation and merged export: ~2 min

# recipes/tiny-cpu.yaml (the demo's), one epoch; the merged export shows the merged model's dtype
DEMO = dict(
    max_steps=None,
    epochs=1,
    max_length=512,
    micro_batch_size=8,
    gradient_accumulation_steps=1,
    learning_rate=2.0e-2,
    lora={"r": 8, "alpha": 16},
    logging_steps=5,
    checkpoint_every_minutes=0.25,
    keep_checkpoints=2,
    smoke={"fraction": 0.01, "min_steps": 6},
    eval={"fraction": 0.05, "every_minutes": 0.25, "max_new_tokens": 24},
    export=["adapter", "merged"],
)

NUM = r"(\d[\d,]*(?:\.\d+)?)"
SUFFIX = {"": 1, "k": 1e3, "M": 1e6, "B": 1e9}


def num(text: str) -> float:
    return float(text.replace(",", ""))


def grab(pattern: str, text: str, where: str) -> tuple[str, ...]:
    m = re.search(pattern, text, re.M)
    assert m, f"not found in {where}: {pattern!r}"
    return m.groups()


def rounded(text: str, suffix: str = "") -> tuple[float, float]:
    """The interval a figure printed with this many decimals (and k/M/B) stands for."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    scale = SUFFIX[suffix]
    return (num(text) - 0.5 * 10**-decimals) * scale, (num(text) + 0.5 * 10**-decimals) * scale


def within(value: float, interval: tuple[float, float]) -> bool:
    return interval[0] - 1e-9 <= value <= interval[1] + 1e-9


def duration(text: str) -> tuple[float, float]:
    """Seconds a printed duration stands for: '41 s', '1.8 min', '3 min' (the plan's), '2.1 h', '1 h 05 min'."""
    text = text.strip()
    m = re.fullmatch(r"(\d+) h (\d+) min", text)
    if m:
        s = int(m.group(1)) * 3600 + int(m.group(2)) * 60
        return s - 30, s + 30
    value, unit = grab(r"^(\d+(?:\.\d+)?) (s|min|h)$", text, "a duration")
    lo, hi = rounded(value)
    factor = {"s": 1, "min": 60, "h": 3600}[unit]
    return lo * factor, hi * factor


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] + 1e-9 and b[0] <= a[1] + 1e-9


def human_size(n: float) -> str:
    from launcher.deliver.messages import human_size as size

    return size(n)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_model) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("demo")
    run = d / "run"
    recipe = recipe_file(d / "tiny-cpu.yaml", tiny_model, output_dir=run, **DEMO)
    said = {}
    for name, args in (("plan", ("plan", recipe)), ("data", ("data", recipe)), ("launch", (recipe,))):
        res = ftrun(*args, cwd=d, timeout=600)
        assert res.returncode == 0, f"{name}: {res.stdout}\n{res.stderr}"
        said[name] = res.stdout
    wait_until_ended(run, d, timeout=900)
    res = ftrun("status", run, cwd=d)
    assert res.returncode == 0, res.stderr
    said["status"] = res.stdout
    for name, text in said.items():  # kept beside the run, for a failure's reader
        (d / f"{name}.txt").write_text(text)
    status, _, summary = res.stdout.partition("\n== run ")
    assert summary, "a finished run's status ends with its summary"
    rows = metrics(run)
    return SimpleNamespace(
        run=run,
        recipe=DEMO,
        plan=said["plan"],
        data=said["data"],
        launch=said["launch"],
        status=status,
        summary="== run " + summary,
        log=(run / "train.log").read_text(),
        rows=rows,
        train=[r for r in rows if r.get("loss") is not None],
        evals=[r for r in rows if r.get("eval_loss") is not None],
        smoke=json.loads((run / "smoke.json").read_text()),
        plan_json=json.loads((run / "plan.json").read_text()),
        task=json.loads((run / "final" / "task_eval.json").read_text()),
        export=json.loads((run / "final" / "export.json").read_text()),
    )


def examples(demo) -> SimpleNamespace:
    """The data line's counts: in all, train, held out, copies of held-out examples that leave training."""
    total, train, held = grab(
        r"([\d,]+) examples; ([\d,]+) train, ([\d,]+) are held out for evaluation", demo.data, "the data view"
    )
    copies = re.search(r", and ([\d,]+) cop(?:y|ies) of (?:a )?held-out example", demo.data)
    return SimpleNamespace(
        total=int(num(total)),
        train=int(num(train)),
        held=int(num(held)),
        copies=int(num(copies.group(1))) if copies else 0,
    )


def data_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("data: "))


def test_examples_in_all_train_and_held_out(demo):
    n = examples(demo)
    assert n.total == n.train + n.held + n.copies, vars(n)  # the line accounts for every example
    # the same data line wherever it is printed
    assert data_line(demo.plan) == data_line(demo.launch) == data_line(demo.data)
    assert int(num(grab(r"^examples ([\d,]+); tokens", demo.data, "the data view's statistics")[0])) == n.train
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        assert int(num(grab(r"^Tokens:.*?\(([\d,]+) examples x", text, where)[0])) == n.train, where
    held, share = grab(
        r"^evaluation: ([\d,]+) held-out examples \((\d+(?:\.\d+)?)% of the data",
        demo.launch,
        "the launch's evaluation line",
    )
    assert int(num(held)) == n.held and within(100 * n.held / n.total, rounded(share))
    smoked, of = grab(r"^smoke test: ([\d,]+) of ([\d,]+) examples", demo.launch, "the smoke test's line")
    assert int(num(of)) == n.train and int(num(smoked)) == demo.smoke["examples"]
    assert demo.smoke["eval_examples"] == n.held
    trains, evals = grab(
        r"training on ([\d,]+) examples, evaluating on ([\d,]+) held-out examples", demo.log, "the worker log"
    )
    assert (int(num(trains)), int(num(evals))) == (n.train, n.held)
    assert int(num(grab(r"data as TRL prepared it: .*?([\d,]+) examples;", demo.log, "the worker log")[0])) == n.train

    # the task evaluation: held-out examples (at most all of them), one count wherever it is printed
    scored = demo.task["examples"]
    assert 0 < scored <= n.held
    for where, text in (("the launch", demo.launch), ("the summary", demo.summary)):
        assert int(grab(r"^  task\s+(\d+) held-out examples, scored by", text, where)[0]) == scored, where
    for line in re.findall(r"\[ftrun task eval\] base_\w+: .*", demo.launch):
        assert f", {scored} examples," in line, line
    counts = re.findall(r"task eval: (?:fine-tuned|merged) [\d.]+% \w+ on (\d+) held-out examples", demo.log)
    assert len(counts) == 2 and set(map(int, counts)) == {scored}


def test_tokens_per_epoch_trained_tokens_and_the_runs_tokens(demo):
    n = examples(demo)
    per_epoch = int(num(grab(r"; ([\d,]+) tokens per epoch", data_line(demo.data), "the data line")[0]))
    share, seen = grab(r"what the loss sees: (\d+\.\d)% of ([\d,]+) tokens trained", demo.data, "the data view")
    tokens, trained, share2 = grab(
        r"^examples [\d,]+; tokens ([\d,]+) \(after max_length \d+\); trained ([\d,]+) "
        r"\((\d+\.\d)%\)",
        demo.data,
        "the data view's statistics",
    )
    assert int(num(seen)) == int(num(tokens)) == per_epoch
    assert share == share2 and within(100 * num(trained) / per_epoch, rounded(share))
    # the worker counts them again, from the data as TRL tokenized it
    w_trained, w_tokens, w_share = grab(
        r"data as TRL prepared it: .*; loss on ([\d,]+) of ([\d,]+) tokens "
        r"\((\d+\.\d)%\)",
        demo.log,
        "the worker log",
    )
    assert (int(num(w_trained)), int(num(w_tokens)), w_share) == (int(num(trained)), per_epoch, share)

    # the run's training tokens: every epoch of the training examples
    run_tokens = per_epoch * demo.recipe["epochs"]
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        total, suffix, mean = grab(
            r"^Tokens:\s+(\d+(?:\.\d+)?)([kMB]?) training tokens \([\d,]+ examples x "
            r"(\d+(?:\.\d+)?) tokens",
            text,
            where,
        )
        assert within(run_tokens, rounded(total, suffix)), (where, total, suffix, run_tokens)
        assert within(per_epoch / n.train, rounded(mean)), (where, mean)  # the mean length
        why, why_suffix = grab(r"- time: (\d+(?:\.\d+)?)([kMB]?) training tokens /", text, where)
        assert within(run_tokens, rounded(why, why_suffix)), (where, why, why_suffix)
    assert int(num(grab(r"^full run: ([\d,]+) tokens ->", demo.launch, "the smoke test's line")[0])) == run_tokens
    assert demo.smoke["training_tokens"] == run_tokens
    # metrics.jsonl counts what trained; the summary says its last count, and by which step where that is short
    assert demo.train[-1]["tokens_seen"] == max(r.get("tokens_seen") or 0 for r in demo.rows)
    said, label = grab(r"^  tokens\s+([\d,]+)(.*)$", demo.summary, "the summary")
    assert int(num(said)) == demo.train[-1]["tokens_seen"]
    if demo.train[-1]["step"] == demo.rows[-1]["step"]:
        assert int(num(said)) == run_tokens and not label.strip()
    else:  # the last step logged no row: labelled, with the step its count is of
        assert label.strip() == f"(by step {demo.train[-1]['step']}, the last logged one)", label
        assert int(num(said)) < run_tokens


def test_parameters_base_adapter_and_trainable(demo):
    total, base, adapter, trainable = grab(
        r"model: ([\d,]+) parameters \(([\d,]+) of the base model and ([\d,]+) "
        r"of the LoRA adapter\), ([\d,]+) trainable",
        demo.log,
        "the worker log",
    )
    total, base, adapter, trainable = map(lambda s: int(num(s)), (total, base, adapter, trainable))
    assert total == base + adapter and trainable == adapter
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        weights, suffix, width, precision = grab(
            r"^  weights\s+[\d.]+ GB\s+(\d+(?:\.\d+)?)([kMB]?) params x (\d) B "
            r"\((\w+)\)",
            text,
            where,
        )
        assert within(base, rounded(weights, suffix)) and (width, precision) == ("4", "fp32"), (where, weights)
        why, why_suffix = grab(r"- model [^:]+: (\d+(?:\.\d+)?)([kMB]?) params", text, where)
        assert within(base, rounded(why, why_suffix)), (where, why)
        lora, lora_suffix = grab(r"LoRA r=\d+: (\d+(?:\.\d+)?)([kMB]?) trainable params", text, where)
        assert within(trainable, rounded(lora, lora_suffix)), (where, lora)
    # the export counts the base model's parameters for its placement: the same count (tied embeddings once)
    place = demo.export["placement"]
    assert place["parameters"] == base
    for what in ("parity checks", "merge"):
        dtype, size = grab(rf"\[ftrun export\] {what}: (\w+) \(([\d.]+ [KMG]?B)\)", demo.log, "the export's lines")
        assert dtype == "float32" and size == human_size(base * 4), (what, size, base)


def test_lora_rank(demo):
    r = demo.recipe["lora"]["r"]
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        assert int(grab(r"LoRA r=(\d+):", text, where)[0]) == r, where
    assert int(grab(r"final/adapter: \d+ LoRA modules \(r=(\d+)\)", demo.log, "the supervisor's check")[0]) == r
    assert int(grab(r"\[ftrun export\] adapter [\d.]+ [KMG]?B \(rank (\d+)\)", demo.log, "the export")[0]) == r
    assert demo.export["outputs"]["adapter"]["rank"] == r
    assert int(grab(r"--max-lora-rank (\d+)", demo.summary, "the summary's serve command")[0]) == r


def test_steps_and_batch(demo):
    n = examples(demo)
    plans = set()
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        plans.add(
            grab(
                r"^Steps:\s+([\d,]+) optimizer steps \(micro-batch (\d+) x accumulation (\d+) x (\d+) process",
                text,
                where,
            )
        )
    assert len(plans) == 1
    steps, micro, accumulation, processes = map(lambda s: int(num(s)), plans.pop())
    batch = micro * accumulation * processes
    assert steps == math.ceil(n.train / batch) * demo.recipe["epochs"]
    totals = {int(t) for t in re.findall(r"\[ftrun worker\] step \d+/(\d+) ", demo.log)}
    assert totals == {steps}
    assert grab(r"^\w+ \[#*\.*\] (\d+)/(\d+)", demo.status, "the status bar") == (str(steps), str(steps))
    assert grab(r"^== run finished at step (\d+)/(\d+):", demo.summary, "the summary") == (str(steps), str(steps))
    assert demo.rows[-1]["step"] == steps and demo.train[-1]["step"] <= steps
    checkpoint = grab(r"last checkpoint (step-\d+)", demo.status, "the status")[0]
    assert checkpoint == f"step-{steps:06d}"
    assert re.findall(r"checkpoint (step-\d+) saved and verified", demo.log)[-1] == checkpoint
    for where, text in (("the status", demo.status), ("the worker log", demo.log)):
        assert {int(b) for b in re.findall(r"batch per step (\d+)", text)} == {batch}, where


def test_checkpoint_cadence_is_the_plans_estimate_of_the_recipes_clock(demo):
    said = set()
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        said.add(grab(r"checkpoint about every (\d+) steps \(every ([^)]+) by the clock\)", text, where))
    assert len(said) == 1
    every, clock = said.pop()
    assert within(demo.recipe["checkpoint_every_minutes"] * 60, duration(clock))
    speed = num(grab(r"^Speed:\s+([\d,]+) tokens/s \(estimated\)", demo.plan, "the plan")[0])
    mean = num(grab(r"^Tokens:.*? examples x (\d+(?:\.\d+)?) tokens", demo.plan, "the plan")[0])
    micro = int(grab(r"micro-batch (\d+) x", demo.plan, "the plan")[0])
    steps = int(num(grab(r"^Steps:\s+([\d,]+) optimizer steps", demo.plan, "the plan")[0]))
    estimate = min(steps, max(1, round(demo.recipe["checkpoint_every_minutes"] * 60 * speed / (micro * mean))))
    assert abs(int(every) - estimate) <= 1, (every, estimate)  # from the printed (rounded) speed and mean


def test_losses_and_eval_losses(demo):
    logged = {int(s): l for s, l in re.findall(r"\[ftrun worker\] step (\d+)/\d+ loss (\d+\.\d+) ", demo.log)}
    assert logged == {r["step"]: f"{r['loss']:.4f}" for r in demo.train}
    evals = {int(s): l for s, l in re.findall(r"\[ftrun worker\] step (\d+)/\d+ eval loss (\d+\.\d+) ", demo.log)}
    assert evals == {r["step"]: f"{r['eval_loss']:.4f}" for r in demo.evals}
    first, last = demo.train[0], demo.train[-1]
    assert grab(r"^  loss\s+(\d+\.\d+) \(step (\d+)\) -> (\d+\.\d+) \(step (\d+)\)", demo.summary, "the summary") == (
        f"{first['loss']:.4f}",
        str(first["step"]),
        f"{last['loss']:.4f}",
        str(last["step"]),
    )
    assert grab(r"^  eval loss (\d+\.\d+) -> (\d+\.\d+)", demo.summary, "the summary") == (
        f"{demo.evals[0]['eval_loss']:.4f}",
        f"{demo.evals[-1]['eval_loss']:.4f}",
    )
    # the status: the same last loss as the summary, with its step where the run is past it; the last eval loss
    # with its step
    loss, at = grab(r"^  loss (\d+\.\d+)(?: \(step (\d+)\))? ", demo.status, "the status")
    assert loss == f"{last['loss']:.4f}"
    at_step = int(grab(r"\] (\d+)/\d+  \(", demo.status, "the status bar")[0])
    assert at == (str(last["step"]) if last["step"] < at_step else None), demo.status
    assert grab(r"^  eval loss (\d+\.\d+) \(step (\d+), held-out examples\)", demo.status, "the status") == (
        f"{demo.evals[-1]['eval_loss']:.4f}",
        str(demo.evals[-1]["step"]),
    )


def test_tokens_per_second(demo):
    # the plan's estimate, labelled so, one value in each of its lines and in plan.json
    rates = set()
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        rates.add(grab(r"^Speed:\s+([\d,]+) tokens/s \(estimated\)", text, where)[0])
        rates.add(grab(r"- time: [\d.]+[kMB]? training tokens / ([\d,]+) tokens/s \(estimated\)", text, where)[0])
    assert len(rates) == 1
    assert f"{demo.plan_json['tokens']['estimated_tokens_per_second']:,.0f}" == rates.pop()
    # the smoke test's measurement
    assert grab(r"^smoke test: \d+ measured steps, ([\d,]+) tokens/s", demo.launch, "the smoke test's line")[0] == (
        f"{demo.smoke['tokens_per_second']:,.0f}"
    )
    # the status of a finished run: its average (issue 46), the tokens trained over the training's time, as
    # `ftrun status --json` says it; the worker's last step line says the last window's
    last = demo.train[-1]
    avg = json.loads(ftrun("status", demo.run, "--json", cwd=demo.run.parent).stdout)["average_tokens_per_second"]
    assert (
        grab(r"^  loss \d+\.\d+(?: \(step \d+\))?\s+([\d,]+) tokens/s on average", demo.status, "the status")[0]
        == f"{avg:,.0f}"
    )
    assert re.findall(r"\[ftrun worker\] step \d+/\d+ loss .* (\d+) tok/s", demo.log)[-1] == (
        f"{last['tokens_per_second']:.0f}"
    )


def test_time_and_cost_forecasts(demo):
    # the plan's forecast: its Time: and Why lines, then the status's "plan forecast"
    planned = set()
    for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch)):
        planned.add(grab(r"^Time:\s+(.+?) training; cost ([\d.]+) EUR at ([\d.]+) EUR/h", text, where))
        why = grab(r"- time: .*\(estimated\) = (.+?); cost at ([\d.]+) EUR/h.* = ([\d.]+) EUR", text, where)
        planned.add((why[0], why[2], why[1]))
    assert len(planned) == 1, planned
    plan_time, plan_cost, price = planned.pop()
    status_plan, status_plan_cost = grab(r"plan forecast (.+?) / ([\d.]+) EUR", demo.status, "the status")
    assert overlap(duration(plan_time), duration(status_plan)), (plan_time, status_plan)
    assert status_plan_cost == plan_cost
    # the smoke test's forecast, everywhere it is repeated
    smoke_said = grab(r"^full run: [\d,]+ tokens -> about (.+?)(?: \(|,|$)", demo.launch, "the smoke test's line")[0]
    from launcher.run.views import format_duration

    assert smoke_said == format_duration(demo.smoke["estimated_seconds"])
    assert grab(r"\(smoke test forecast for the whole run: (.+?)\)", demo.status, "the status")[0] == smoke_said
    smoke_status, smoke_cost = grab(r"\(smoke test forecast (.+?) / ([\d.]+) EUR", demo.status, "the status")
    assert smoke_status == smoke_said and smoke_cost == f"{demo.smoke['estimated_cost']:.2f}"
    running, export, source, forecast, pct, box = grab(
        r"^  time\s+(.+?) running(?: \+ (.+?) export)? \(the (smoke test|plan) forecast (.+?), ([+-]\d+)%\)"
        r"(?:; (.+?) on the box)?",
        demo.summary,
        "the summary",
    )
    assert source == "smoke test" and forecast == smoke_said
    # the percentage is the two durations' (each printed rounded): the time running and the export's, which the smoke
    # test's forecast counts too
    (rlo, rhi), (flo, fhi) = duration(running), duration(forecast)
    if export:
        rlo, rhi = rlo + duration(export)[0], rhi + duration(export)[1]
    assert (rlo - fhi) / fhi * 100 - 0.5 <= int(pct) <= (rhi - flo) / flo * 100 + 0.5, (running, forecast, pct)
    # the status's "in all" says each phase it covers (issue 46); the summary's box time is its smoke test and
    # training (each printed rounded)
    in_all, phases = grab(r"^  time (.+?) in all: (.+?)(?:   \(|$)", demo.status, "the status")
    said = dict(
        re.findall(r"(plan and baseline|smoke test|training and evaluation|export) ([\d.]+ (?:s|min|h))", phases)
    )
    assert set(said) == {"plan and baseline", "smoke test", "training and evaluation", "export"}, phases
    parts = [duration(v) for v in said.values()]
    assert overlap(duration(in_all), (sum(p[0] for p in parts), sum(p[1] for p in parts))), (in_all, phases)
    box_parts = [duration(said["smoke test"]), duration(said["training and evaluation"])]
    assert overlap(duration(box or running), (sum(p[0] for p in box_parts), sum(p[1] for p in box_parts)))
    assert grab(r"^  cost\s+([\d.]+) EUR at ([\d.]+) EUR/h", demo.summary, "the summary")[1] == price
    assert f"{demo.smoke['price_per_hour_eur']:.2f}" == price


def test_memory(demo):
    estimates = {
        grab(r"^Memory [^:]*: ([\d.]+) GB of", text, where)[0]
        for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch))
    }
    estimates |= {
        grab(r"- memory: needs ([\d.]+) GB", text, where)[0]
        for where, text in (("ftrun plan", demo.plan), ("the launch", demo.launch))
    }
    assert len(estimates) == 1
    measured, sizer = grab(
        r"^  memory ([\d.]+) GB per process, measured by the smoke test \(the sizer estimated "
        r"([\d.]+) GB\)",
        demo.status,
        "the status",
    )
    assert num(sizer) == num(estimates.pop())
    peak = grab(r"^smoke test: .*peak memory ([\d.]+) GB", demo.launch, "the smoke test's line")[0]
    assert peak == f"{demo.smoke['peak_memory_gb']:.2f}"
    assert abs(num(measured) - demo.smoke["peak_memory_gb"]) <= 0.05 + 1e-9, (measured, peak)


def test_task_scores(demo):
    from launcher.data.task_verdict import pct

    scores, speed = demo.task["scores"], demo.task["generation"]
    labels = {
        "base_zero_shot": "base model, zero-shot",
        "base_few_shot": f"base model, {demo.task['shots']} examples",
        "fine_tuned": "fine-tuned",
        "merged": "merged",
    }
    tables = {"the launch": demo.launch, "the summary": demo.summary}
    for name, label in labels.items():
        for where, text in tables.items():
            if name in ("fine_tuned", "merged") and where == "the launch":
                continue  # the launch scores the base model only
            shown, rate = grab(rf"^\s+{re.escape(label)}\s+(\d+%)\s+\(([\d,]+) tokens/s generated\)", text, where)
            assert shown == pct(scores[name]) and rate == f"{speed[name]['tokens_per_s']:,.0f}", (where, name)
    for name in ("base_zero_shot", "base_few_shot"):
        score, rate = grab(rf"\[ftrun task eval\] {name}: (\d+\.\d)% .*, (\d+) tokens/s\)", demo.launch, "the launch")
        assert within(100 * scores[name], rounded(score)) and rate == f"{speed[name]['tokens_per_s']:.0f}", name
    tuned, who, base = grab(
        r"task eval: fine-tuned (\d+\.\d)% \w+ on \d+ held-out examples \((base model [^)]*?) "
        r"(\d+\.\d)%\)",
        demo.log,
        "the worker log",
    )
    base_name = "base_zero_shot" if who == "base model zero-shot" else "base_few_shot"
    assert within(100 * scores["fine_tuned"], rounded(tuned)) and within(100 * scores[base_name], rounded(base))
    merged, tuned2, rate = grab(
        r"task eval: merged (\d+\.\d)% \w+ on \d+ held-out examples \(fine-tuned (\d+\.\d)%\), "
        r"(\d+) tokens/s generated",
        demo.log,
        "the export's lines",
    )
    assert within(100 * scores["merged"], rounded(merged)) and tuned2 == tuned
    assert rate == f"{speed['merged']['tokens_per_s']:.0f}"
    # the gain: the difference of the two percents it names, each as the table shows it
    a, b, gain = grab(
        r"^  gain\s+fine-tuned (\d+)% against (\d+)% for the [^(]+\(([+-]\d+) points?, (?:within|beyond) "
        r"the ±\d+-point noise of \d+ examples\)",
        demo.summary,
        "the summary",
    )
    assert f"{a}%" == pct(scores["fine_tuned"]) and int(gain) == int(a) - int(b)
    before, after = (grab(r"^  verdict\s+(.*)$", text, where)[0] for where, text in tables.items())
    assert after == demo.task["verdict"]
    # the launch judges the base alone, before training; the summary the same base and what the run did against it
    # (issue 46): the same verdict, or the launch's with the run's outcome where the run did not beat the base
    assert after == before or after.startswith(
        before.removesuffix(": fine-tuning pays") + ", so fine-tuning should pay; this run did not: "
    ), (before, after)


def test_the_exports_sizes_and_dtypes(demo):
    final = demo.run / "final"
    outputs = demo.export["outputs"]
    from launcher.store.checkpoint import tree_bytes

    # the sizes: export.json's against the files (the adapter's weights file; the merged model's folder)
    assert outputs["adapter"]["bytes"] == (final / "adapter" / "adapter_model.safetensors").stat().st_size
    assert outputs["merged"]["bytes"] == tree_bytes(final / "merged")
    sizes = {k: outputs[k]["size"] for k in ("adapter", "merged")}
    assert sizes == {k: human_size(outputs[k]["bytes"]) for k in sizes}
    # each size says what it counts (issue 46): the adapter's weights file, the merged model's folder
    listed = f"adapter {sizes['adapter']} weights file, merged {sizes['merged']} folder"
    assert grab(r"export finished: (.*?); serving commands", demo.log, "the supervisor")[0] == listed
    assert (
        grab(r"^  export \(adapter, merged\): succeeded - (.*?); serving commands", demo.status, "the status")[0]
        == listed
    )
    assert grab(r"\[ftrun export\] adapter ([\d.]+ [KMG]?B) \(rank", demo.log, "the export")[0] == sizes["adapter"]
    assert grab(r"\[ftrun export\] merged model ([\d.]+ [KMG]?B) in ", demo.log, "the export")[0] == sizes["merged"]

    # the dtypes: the training's, the export's loads, and what the merged folder is saved in
    trained = grab(r"\[ftrun worker\] model: .* on \w+ in (\w+)", demo.log, "the worker log")[0]
    device_dtype = grab(r"\[ftrun worker\] device \w+ \((\w+)\)", demo.log, "the worker log")[0]
    assert trained == device_dtype == "float32"
    merge_dtype, saved = grab(
        r"merging the adapter into the (\w+) base; the merged model is saved in (\w+)", demo.log, "the export"
    )
    place = demo.export["placement"]
    assert merge_dtype == place["merge"]["dtype"] and place["parity"]["dtype"] == trained
    assert {e["dtype"] for e in place["loads"]} == {trained}  # base + adapter and the merged model reloaded alike
    assert grab(r"loading the base .* in (\w+) and the adapter", demo.log, "the export")[0] == trained
    assert saved == demo.export["export_dtype"]
    assert json.loads((final / "merged" / "config.json").read_text())["dtype"] == saved
    assert outputs["merged"]["tensor_dtypes"] == [{"bfloat16": "BF16", "float16": "F16"}[saved]]
