"""Publishing a finished run to the Hugging Face Hub (the recipe's `publish:`): only the outputs the export checked,
with a model card, in one HfApi.create_commit (all or nothing), after the export or by `ftrun publish`. The token is
huggingface_hub's own (HF_TOKEN or `hf auth login`), never the recipe's.

Layout: the merged model at the root, else the adapter; with both, the adapter in adapter/. A GGUF file at the root
(`hf.co/user/repo:Q8_0`). README.md the card, samples.md the before and after answers, ftrun/ the run's records.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from launcher import methods
from launcher.errors import EXIT_RUN_FAILED, FtrunError, UsageError
from launcher.store.rundir import RunDir


class PublishError(FtrunError):
    """Nothing was published: the result is not verified, or the Hub refused."""

    kind = "publish failed"
    exit_code = EXIT_RUN_FAILED


def repo_of(url: str) -> str:
    """hf://user/repo -> user/repo (the recipe checked the form)."""
    parts = url[len("hf://") :].strip("/").split("/") if url.startswith("hf://") else []
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"publish.to={url} does not name a Hugging Face repo", fix="write hf://USER/REPO.")
    return "/".join(parts)


def _load(run: RunDir) -> tuple[Any, dict[str, Any]]:
    from launcher.recipe import Recipe

    recipe = Recipe.model_validate(yaml.safe_load(run.recipe.read_text()))
    report_path = run.final / "export.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return recipe, report


def verified_outputs(run: RunDir, recipe, report: dict[str, Any], what: list[str], state: dict) -> dict[str, Path]:
    """{output: folder or file} of each output to publish, each checked by the export and unchanged since (its size
    in export.json); a PublishError naming what is missing otherwise."""
    from launcher.store.checkpoint import tree_bytes

    if not report.get("ok"):
        why = report.get("error") or ("final/export.json is missing" if not report else "failed")
        raise PublishError(
            f"the export did not pass its checks ({str(why).splitlines()[0]}): nothing was published",
            fix=f"run `ftrun export {run.root}` (it checks again), then `ftrun publish {run.root}`.",
        )
    if not (state.get("final_check") or {}).get("ok"):
        raise PublishError(
            f"{run.root} has no verified final result (state {state.get('state', 'unknown')}): nothing was published",
            fix="publish a run whose training finished and was verified.",
        )
    outputs = report.get("outputs", {})
    found: dict[str, Path] = {}
    for item in what:
        out = outputs.get(item)
        if out is None:
            raise PublishError(
                f"publish.what has {item}, which the export did not make and check: nothing was published",
                fix=f"add {item} to export: and run `ftrun export {run.root}`, or remove it from publish.what.",
            )
        path = Path(out["path"])
        if item == "adapter":
            size = tree_bytes(path / "adapter_model.safetensors")
        else:
            size = path.stat().st_size if path.is_file() else tree_bytes(path) if path.is_dir() else None
        if size is None or (out.get("bytes") is not None and size != out["bytes"]):
            raise PublishError(
                f"{path} changed since the export checked it ({out.get('bytes')} bytes then, "
                f"{size} now): nothing was published",
                fix=f"run `ftrun export {run.root}` to check it again, then `ftrun publish {run.root}`.",
            )
        found[item] = path
    return found


def layout(outputs: dict[str, Path]) -> list[tuple[Path, str]]:
    """(local file, path in the repo) for every file to publish (the module docstring's layout)."""
    files: list[tuple[Path, str]] = []

    def tree(folder: Path, prefix: str) -> None:
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            files.append((f, f"{prefix}{f.relative_to(folder).as_posix()}"))

    if "merged" in outputs:
        tree(outputs["merged"], "")
    if "adapter" in outputs:
        tree(outputs["adapter"], "adapter/" if "merged" in outputs else "")
    if "gguf" in outputs:
        files.append((outputs["gguf"], outputs["gguf"].name))  # the Modelfile names a local path: not published
    return files


# ---------------------------------------------------------------------------------------------
# The model card


def _hub_id(model: str) -> Optional[str]:
    """The base model's Hub id, or None for a local folder."""
    return model if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not Path(model).exists() else None


def _eval_losses(run: RunDir) -> tuple[Optional[dict], Optional[dict], Optional[dict]]:
    """(first train row, last train row, last eval row) of metrics.jsonl."""
    from launcher.deliver.plots import read_metrics

    train, evals = read_metrics(run.metrics), read_metrics(run.metrics, "eval_loss")
    return (train[0] if train else None), (train[-1] if train else None), (evals[-1] if evals else None)


def _serve_lines(repo: str, recipe, outputs: dict[str, Path], report: dict[str, Any]) -> list[str]:
    from launcher.deliver.serving import fence, served_name, template_switches, vllm_command

    name = served_name(Path(repo.split("/")[1]))
    base = _hub_id(recipe.model) or "BASE_MODEL"
    switches = template_switches(report)
    lines: list[str] = []
    if switches:
        lines += [
            f"Serve it with the chat-template switch `{json.dumps(switches)}`: the model was trained on the "
            "prompt its template writes with it (the commands below pass it).",
            "",
        ]
    if "merged" in outputs:
        lines += fence(vllm_command(repo, quote=False, switches=switches))
        lines += fence(
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
            lang="python",
        )
    if "adapter" in outputs:
        rank = (report.get("outputs", {}).get("adapter") or {}).get("rank") or recipe.lora.r
        if "merged" in outputs:
            serve = vllm_command(
                base, lora_module=f"{name}=./{name}/adapter", lora_rank=rank, quote=False, switches=switches
            )
            lines += ["The LoRA adapter alone is in `adapter/`:", ""]
            lines += fence(f"hf download {repo} --include 'adapter/*' --local-dir {name}", serve)
        else:
            lines += fence(
                vllm_command(base, lora_module=f"{name}={repo}", lora_rank=rank, quote=False, switches=switches)
            )
            lines += fence(
                "from peft import AutoPeftModelForCausalLM",
                f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")',
                lang="python",
            )
    if "gguf" in outputs:
        quant = str((report.get("outputs", {}).get("gguf") or {}).get("type") or recipe.gguf_type).upper()
        think = " --think=false" if switches.get("enable_thinking") is False else ""
        kwargs = f" --chat-template-kwargs '{json.dumps(switches)}'" if switches else ""
        lines += fence(f"ollama run hf.co/{repo}:{quant}{think}", f"llama-server -hf {repo}:{quant}{kwargs}")
    return lines


def model_card(run: RunDir, recipe, report: dict[str, Any], repo: str, outputs: dict[str, Path]) -> str:
    """README.md for the repo: the card's metadata (huggingface_hub.ModelCardData) and what the run knows."""
    from huggingface_hub import ModelCard, ModelCardData

    base = _hub_id(recipe.model)
    adapter_at_root = "adapter" in outputs and "merged" not in outputs
    data = ModelCardData(
        base_model=base,
        library_name="peft" if adapter_at_root else "transformers",
        pipeline_tag="text-generation",
        tags=[
            "ftrun",
            recipe.method,
            *(["lora"] if methods.is_adapter(recipe.method) else []),
            *([recipe.objective] if recipe.objective != methods.DEFAULT_OBJECTIVE else []),
            *(["gguf"] if "gguf" in outputs else []),
        ],
    )
    method = methods.METHODS[recipe.method].title
    lora = (
        f" (r={recipe.lora.r}, alpha={recipe.lora.alpha}, targets {recipe.lora.target_modules})"
        if methods.is_adapter(recipe.method) and not recipe.init_from
        else ""
    )
    objective = recipe.objective_row
    if objective.settings:
        settings = ", ".join(f"{k} {getattr(recipe.preference, k)}" for k in objective.settings)
        method += f", objective {objective.name} ({objective.help}; {settings})"
    if recipe.init_from:
        from launcher.recipe import parent_adapter

        parent = parent_adapter(recipe.init_from)
        method += f", continuing the adapter of the earlier run `{Path(recipe.init_from).name}` ({parent})"
    body = [
        f"# {repo.split('/')[1]}",
        "",
        f"A fine-tune of {'[' + base + '](https://huggingface.co/' + base + ')' if base else '`' + recipe.model + '`'} "
        f"with {method}{lora}, trained and checked with ftrun. Published: "
        + ", ".join(f"{k}{' (in adapter/)' if k == 'adapter' and 'merged' in outputs else ''}" for k in outputs)
        + ".",
        "",
    ]

    body += ["## Data", ""]
    data_record = run.root / "data.json"
    if data_record.is_file():
        d = json.loads(data_record.read_text())
        body.append(f"- {d.get('description', '')}".rstrip())
        body.append(
            f"- {d.get('examples', '?')} examples, {d.get('total_tokens', '?')} tokens "
            f"(mean {d.get('mean_tokens', '?')}, longest {d.get('max_tokens', '?')})"
        )
        for s in d.get("sources", []):
            ident = s.get("revision") or (s.get("sha256") or "")[:12]
            body.append(
                f"- source `{Path(str(s.get('source'))).name}`, format {s.get('format')}, "
                f"{s.get('examples')} examples, weight {s.get('weight')}" + (f", {ident}" if ident else "")
            )
    else:
        body.append(f"- `{Path(recipe.data).name}`" if isinstance(recipe.data, str) else "- see ftrun/recipe.yaml")
    body.append("")

    first, last, ev = _eval_losses(run)
    body += ["## Training", ""]
    if first and last:
        body.append(
            f"- training loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
        )
    if ev:
        body.append(f"- eval loss {ev['eval_loss']:.4f} at step {ev['step']} (held-out examples)")
    epochs = f"{recipe.epochs:g} epoch{'' if recipe.epochs == 1 else 's'}"
    length = f"{recipe.max_steps} steps" if recipe.max_steps else epochs
    body += [
        f"- {recipe.micro_batch_size} x {recipe.gradient_accumulation_steps} examples per step per process, "
        f"learning rate {recipe.learning_rate:g}, max length {recipe.max_length}, {length}",
        "",
    ]

    body += _task_eval_lines(run)

    checks = []
    out = report.get("outputs", {})
    if "adapter" in out and out["adapter"].get("changes_base_logits"):
        checks.append(
            f"- adapter: reloaded over the base, top-1 agreement with the base "
            f"{out['adapter']['changes_base_logits']['top1_agreement_with_base']:.3f} (it changes the model)"
        )
    if "merged" in out and out["merged"].get("parity"):
        p = out["merged"]["parity"]
        checks.append(
            f"- merged: top-1 agreement with base + adapter {p.get('top1_agreement')}, "
            f"max relative logit difference {p.get('max_rel')}"
        )
    if "gguf" in out and out["gguf"].get("parity"):
        p = out["gguf"]["parity"]
        checks.append(f"- gguf {out['gguf'].get('type')}: top-1 agreement {p.get('top1_agreement')}")
    if checks:
        body += ["## Checks before publishing", "", *checks, "", "The numbers are in `ftrun/export.json`.", ""]

    samples = run.final / "samples.md"
    if samples.is_file():
        text = samples.read_text()
        text = re.sub(r"^# .*\n", "", text, count=1)  # the card has its own title
        text = re.sub(r"^(#+) ", r"#\1 ", text, flags=re.M)  # its sections under this one
        body += ["## Before and after", "", text.strip(), "", "(also in `samples.md`)", ""]

    body += ["## Use", "", *_serve_lines(repo, recipe, outputs, report)]
    body += ["## Recipe", "", "```yaml", yaml.safe_dump(_public_recipe(recipe), sort_keys=False).strip(), "```", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def _task_eval_file(run: RunDir) -> Optional[Path]:
    """The task evaluation's record: final/task_eval.json, else the base model's alone in the run directory."""
    return next((p for p in (run.final / run.task_eval.name, run.task_eval) if p.is_file()), None)


def _task_eval_lines(run: RunDir) -> list[str]:
    """The card's scores table, from the task evaluation's record; nothing when it has no scores."""
    from launcher.data import task_verdict as tv

    path = _task_eval_file(run)
    record = json.loads(path.read_text()) if path else {}
    scores = {k: v for k, v in (record.get("scores") or {}).items() if v is not None}
    if not scores:
        return []
    shots = record.get("shots")
    start = tv.start_name(record)  # a file written before the parent's rows had their own names: base_ with init_from
    names = {
        tv.BARE_BASE: tv.BARE_BASE_LABEL,
        tv.BASE_ZERO_SHOT: f"{start}, zero-shot",
        tv.PARENT_ZERO_SHOT: "parent adapter, zero-shot",
        tv.FINE_TUNED: "fine-tuned",
        tv.BASE_FEW_SHOT: f"{start}, {shots} examples in the prompt" if shots else f"{start}, few-shot",
        tv.PARENT_FEW_SHOT: f"parent adapter, {shots} examples in the prompt" if shots else "parent adapter, few-shot",
    }
    starts = (tv.BASE_ZERO_SHOT, tv.BASE_FEW_SHOT, tv.PARENT_ZERO_SHOT, tv.PARENT_FEW_SHOT)
    order = [n for n in (tv.BARE_BASE, *starts, tv.FINE_TUNED) if n in scores] + [n for n in scores if n not in names]
    reason = f": {record['metric_reason']}" if record.get("metric_reason") else ""
    lines = [
        "## Task evaluation",
        "",
        f"{record.get('examples', '?')} held-out examples (never trained on), answered greedily; metric "
        f"`{record.get('metric')}`{reason}.",
        "",
        f"| model | {record.get('metric')} |",
        "|---|---:|",
    ]
    lines += [f"| {names.get(n, n)} | {scores[n]:.1%} |" for n in order]
    return lines + ["", "The answers' scores are in `ftrun/task_eval.json`.", ""]


def _public_recipe(recipe) -> dict[str, Any]:
    """The recipe as published: without its secret fields (launcher/recipe_sections.py Secret) and sync:, local paths
    shortened to their last part."""
    snap = recipe.public_snapshot()
    snap.pop("sync", None)
    for key in ("model", "output_dir", "data"):
        if isinstance(snap.get(key), str) and snap[key].startswith("/"):
            snap[key] = Path(snap[key]).name
    return snap


# ---------------------------------------------------------------------------------------------


def publish_run(
    run_root: Path, to: Optional[str] = None, say: Callable[[str], None] = print, state: Optional[dict] = None
) -> dict[str, Any]:
    """Push the run's verified outputs and the card to `to` (default: the recipe's publish.to); the record of it.
    `state`: the run's, as the command read it (else read here)."""
    from huggingface_hub import get_token

    from launcher.store.state import RunSnapshot

    run = RunDir(Path(run_root))
    state = RunSnapshot(run).state if state is None else state
    recipe, report = _load(run)
    url = to or recipe.publish.to
    if not url:
        raise UsageError(
            f"the recipe of {run.root} has no publish.to",
            fix="add publish: {to: hf://USER/REPO} to the "
            "recipe, or give the repo: `ftrun publish RUN --to hf://USER/REPO`.",
        )
    repo = repo_of(url)
    outputs = verified_outputs(run, recipe, report, list(recipe.publish.what), state)
    if not get_token():
        raise PublishError(
            f"publish.to={url} is a Hugging Face repo, but no Hugging Face token is set on this box: "
            "nothing was published",
            fix="run `hf auth login`, or set HF_TOKEN to a token with write access, then "
            f"`ftrun publish {run.root}`; never put it in the recipe.",
        )
    files = layout(outputs)
    card = model_card(run, recipe, report, repo, outputs)
    with tempfile.TemporaryDirectory(prefix="ftrun-publish-") as tmp:  # never a stray file in final/
        return _push(run, recipe, repo, outputs, files, card, Path(tmp), say)


def _push(
    run: RunDir,
    recipe,
    repo: str,
    outputs: dict[str, Path],
    files: list[tuple[Path, str]],
    card: str,
    staging: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd, HfApi

    (staging / "README.md").write_text(card)
    extra = [(staging / "README.md", "README.md")]
    if (run.final / "samples.md").is_file():
        extra.append((run.final / "samples.md", "samples.md"))
    (staging / "recipe.yaml").write_text(yaml.safe_dump(_public_recipe(recipe), sort_keys=False))
    extra.append((staging / "recipe.yaml", "ftrun/recipe.yaml"))
    if (run.root / "data.json").is_file():
        extra.append((run.root / "data.json", "ftrun/data.json"))
    extra.append((run.final / "export.json", "ftrun/export.json"))
    if _task_eval_file(run):
        extra.append((_task_eval_file(run), "ftrun/task_eval.json"))
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(local)) for local, rel in files + extra]
    size = sum(local.stat().st_size for local, _ in files)
    say(f"publishing {', '.join(outputs)} ({size / 1e6:.1f} MB, {len(operations)} files) to {repo}")
    api = HfApi()
    try:
        api.create_repo(repo, private=recipe.publish.private, exist_ok=True)
        info = api.create_commit(repo, operations, commit_message=f"ftrun: {', '.join(outputs)} of {run.root.name}")
    except Exception as exc:  # HfHubHTTPError, a lost connection: the run stays succeeded, the record says why
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise PublishError(
            f"the Hub refused or did not answer ({type(exc).__name__}: {first}); nothing was published "
            "(a commit is all or nothing)",
            fix=f"check the token's write access (`hf auth whoami`) and the network, then `ftrun publish {run.root}`.",
        ) from exc
    commit = getattr(info, "commit_url", None) if info is not None else None
    record = {
        "state": "published",
        "repo": repo,
        "url": f"https://huggingface.co/{repo}",
        "what": list(outputs),
        "files": len(operations),
        "bytes": size,
        "commit": commit,
        "private": recipe.publish.private,
        "at": time.time(),
    }
    say(f"published to https://huggingface.co/{repo}")
    return record


def after_export(recipe, run: RunDir, log: Callable[[str], None]) -> None:
    """The supervisor's step after the export: publish when the recipe asks, the outcome in state.json's `publish`;
    a failure never changes the run's own state."""
    from launcher.store.state import RunSnapshot, move

    if not recipe.publish.to:
        return
    state = RunSnapshot(run).state  # the supervisor's, after the export: nothing else writes it while this publishes
    if (state.get("final_check") or {}).get("ok") is None:
        return  # a node other than the first of a multi-node run: node 0 writes, exports and publishes the result
    try:
        record = publish_run(run.root, say=log, state=state)
    except FtrunError as exc:
        record = {"state": "failed", "reason": exc.message, "retry": f"ftrun publish {run.root}"}
        log(f"publish: {exc.message}")
    move(run, "note", publish=record)


def publish_command(run: RunDir, to: Optional[str] = None) -> int:
    """`ftrun publish [RUN]`: the same step by hand; the command line resolves the run (launcher/cli.py)."""
    from launcher.store.state import RunLock, RunSnapshot, move

    lock = RunLock(run).acquire()  # not while the supervisor trains, exports or publishes
    try:
        state = RunSnapshot(run).state  # read under the lock: no other writer until it is released
        try:
            record = publish_run(run.root, to=to, say=print, state=state)
        except FtrunError as exc:
            if state.get("state"):
                move(
                    run,
                    "note",
                    publish={"state": "failed", "reason": exc.message, "retry": f"ftrun publish {run.root}"},
                )
            raise
        move(run, "note", publish=record)
    finally:
        lock.release()
    return 0
