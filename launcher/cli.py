"""The `ftrun` command: parse, call one stage, print. No logic lives here.

    ftrun RECIPE [key=value ...] [--foreground] [--fresh] [--memory-limit GB] [--allow-changes]
          [--nnodes N --node-rank I --master-addr HOST --master-port PORT]
                                                           plan, smoke test, run detached (or resume)
    ftrun plan RECIPE [key=value ...] [--gpus SPEC] [--tokens N] [--price EUR/h] [--json]
    ftrun smoke RECIPE [key=value ...] [--memory-limit GB]  the smoke test alone, and its forecast
    ftrun baseline RECIPE [key=value ...] [--json]         the base model scored on the task: does fine-tuning pay?
    ftrun data RECIPE [key=value ...]                      one example per source as the loss sees it, statistics
    ftrun status [RECIPE|RUN_DIR] [--json] [--watch]       every run under ./runs, or one run
    ftrun logs [RECIPE|RUN_DIR] [-f]                       the run's train.log (-f: follow it)
    ftrun stop [RECIPE|RUN_DIR]                            checkpoint, then stop
    ftrun pull RECIPE [key=value ...]                      fetch a run from sync.to (no resume)
    ftrun push [RECIPE|RUN_DIR]                            copy checkpoint + result to sync.to now
    ftrun export [RECIPE|RUN_DIR] [--merged] [--gguf TYPE]  adapter, merged model, GGUF, serving commands; checked
    ftrun publish [RECIPE|RUN_DIR] [--to hf://USER/REPO]   push the checked export + model card to the Hub
    ftrun explain                                          every recipe key, its default and meaning
    ftrun llamacpp install | check MODEL [--type T] | architectures   llama.cpp for the GGUF export
    --debug (anywhere on the line): tracebacks instead of one-paragraph errors
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from launcher import gguf_types
from launcher.errors import EXIT_INTERNAL, FtrunError, UsageError

COMMANDS = ("plan", "smoke", "baseline", "data", "status", "logs", "stop", "pull", "push", "export", "publish", "explain",
            "llamacpp", "run")


RECIPE_HELP = "the recipe file (YAML; `ftrun explain` lists its keys)"
OVERRIDES_HELP = "recipe keys changed for this command, e.g. lora.r=8 max_length=2048"
TARGET_HELP = "the run's recipe file or its run directory (default: the only run under ./runs)"


def _tokens_meaning() -> str:
    from launcher.recipe import TOKENS_MEANING  # the one wording of what a token count means

    return TOKENS_MEANING


def _gpu_names() -> str:
    from launcher.plan.hardware import catalog  # the catalog is the one list of names (gpus.yaml)

    return ", ".join(catalog())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftrun", description="From a fine-tuning recipe to a trained, exported model.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--debug", action="store_true", help="show tracebacks (accepted anywhere on the line)")
    sub = p.add_subparsers(dest="command")

    r = sub.add_parser("run", help="plan, smoke-test and start (or resume) the run; the default command")
    r.add_argument("recipe", help=RECIPE_HELP)
    r.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    r.add_argument("--foreground", action="store_true", help="stay attached (debugging, tests)")
    r.add_argument("--fresh", action="store_true", help="start over; the old run directory is kept, renamed")
    r.add_argument("--memory-limit", help="cap each worker's memory, e.g. 20GB (plan for a smaller card)")
    r.add_argument("--nnodes", type=int, default=1, help="boxes in the job (run the same command on each)")
    r.add_argument("--node-rank", type=int, default=0, help="this box's number, 0 .. nnodes-1 (0 holds the rendezvous)")
    r.add_argument("--master-addr", help="address of node 0, reachable from every node")
    r.add_argument("--master-port", type=int, default=29500, help="a free TCP port on node 0")
    r.add_argument("--allow-changes", action="store_true",
                   help="resume from the run's checkpoints even though the recipe's training settings changed")

    pl = sub.add_parser("plan", help="size the job: memory, engine, GPUs, time, cost")
    pl.add_argument("recipe", help=RECIPE_HELP)
    pl.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    pl.add_argument("--gpus", metavar="SPEC", help="plan for another box than this machine's GPUs (or, without a GPU "
                    "here, the recipe's box:): COUNTxNAME such as 4xH100-80GB, or NAME for one card; names: "
                    f"{_gpu_names()}")
    pl.add_argument("--tokens", metavar="N", help=f"{_tokens_meaning()}; e.g. 15M, used instead of counting the data "
                    "or the recipe's tokens:")
    pl.add_argument("--price", type=float, metavar="EUR/h", help="the whole box's price per hour (overrides the "
                    "catalog and the recipe's price_per_hour_eur)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON, also when it does not fit")

    sm = sub.add_parser("smoke", help="run only the smoke test (1%% of the data) and print the forecast")
    sm.add_argument("recipe", help=RECIPE_HELP)
    sm.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    sm.add_argument("--memory-limit", help="cap the worker's memory, e.g. 20GB")

    bl = sub.add_parser("baseline", help="score the base model on held-out examples, zero-shot and with examples in "
                        "its prompt, and say whether fine-tuning pays (the launch does it too, before its smoke test)")
    bl.add_argument("recipe", help=RECIPE_HELP)
    bl.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    bl.add_argument("--json", action="store_true", help="print only the scores and the verdict as JSON on stdout")

    da = sub.add_parser("data", help="the data as the loss sees it: one example per source with its trained tokens "
                        "marked, and the dataset's statistics (the launch's data check)")
    da.add_argument("recipe", help=RECIPE_HELP)
    da.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)

    for name, helptext in (("status", "state, step, loss, ETA of a run"), ("logs", "the run's train.log"),
                           ("stop", "checkpoint and stop a run")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("target", nargs="?", help=TARGET_HELP)
        if name == "status":
            s.add_argument("--json", action="store_true", help="print the status (or the list of runs) as JSON")
            s.add_argument("--watch", action="store_true", help="refresh every 2 s until the run ends")
        if name == "logs":
            s.add_argument("-f", "--follow", action="store_true",
                           help="keep printing new lines while the run's launcher or supervisor lives")
    pu = sub.add_parser("pull", help="fetch a run from the recipe's sync.to without resuming it")
    pu.add_argument("recipe", help=RECIPE_HELP)
    pu.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
    ps = sub.add_parser("push", help="copy the newest checkpoint and the result to sync.to now")
    ps.add_argument("target", nargs="?", help=TARGET_HELP)
    ex = sub.add_parser("export", help="adapter, merged 16-bit model, GGUF and serving commands, each checked")
    ex.add_argument("target", nargs="?", help=TARGET_HELP)
    ex.add_argument("--merged", action="store_true", help="also merge the adapter into the 16-bit base")
    ex.add_argument("--gguf", metavar="TYPE", help=f"also write a GGUF: {gguf_types.listed()} (the recipe's gguf "
                    f"export defaults to {gguf_types.DEFAULT_TYPE}; implies --merged)")
    pb = sub.add_parser("publish", help="push the checked export and a model card to the recipe's publish.to")
    pb.add_argument("target", nargs="?", help=TARGET_HELP)
    pb.add_argument("--to", metavar="hf://USER/REPO", help="another repo than the recipe's publish.to")
    sub.add_parser("explain", help="every recipe key with its default and meaning")
    ll = sub.add_parser("llamacpp", help="llama.cpp for the GGUF export: install its converter (install), check a model "
                        "(check MODEL), write the shipped architecture table (architectures)", add_help=False)
    ll.add_argument("args", nargs=argparse.REMAINDER, help="install: copy llama.cpp's converter from the installed "
                    "llama-cpp-python's source; check MODEL [--type T]: can this model become a GGUF; architectures: "
                    "write the shipped architecture table (`ftrun llamacpp --help` for more)")
    return p


def _parse_gb(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    t = text.strip().lower().replace(" ", "")
    # ftrun's one unit, GB = 2**30 bytes (sizing.GB), as nvidia-smi counts: 20GB and 20GiB are the same, 800MB is 800 MiB
    for unit, factor in (("gib", 1.0), ("gb", 1.0), ("g", 1.0), ("mib", 1 / 1024), ("mb", 1 / 1024), ("m", 1 / 1024)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], factor
            break
    else:
        scale = 1.0
    try:
        value = float(t) * scale
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UsageError(f"--memory-limit {text!r} is not a memory size", fix="write it like 20GB, 1.5GB or 800MB.")
    return value


def _nodes(a) -> Optional[dict]:
    if a.nnodes == 1:
        return None
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        raise UsageError(f"--nnodes {a.nnodes} --node-rank {a.node_rank}: the rank must be 0 .. nnodes-1",
                         fix="number the boxes 0, 1, ...; node 0 is the one whose address is --master-addr.")
    if not a.master_addr:
        raise UsageError(f"--nnodes {a.nnodes} needs --master-addr (the address of node 0)",
                         fix="add --master-addr HOST --master-port PORT, the same on every node.")
    return {"nnodes": a.nnodes, "node_rank": a.node_rank, "master_addr": a.master_addr, "master_port": a.master_port}


def cmd_run(a) -> int:
    from launcher.run.pipeline import launch

    return launch(a.recipe, a.overrides, foreground=a.foreground, fresh=a.fresh, memory_limit=_parse_gb(a.memory_limit),
                  allow_changes=a.allow_changes, nodes=_nodes(a))


def cmd_plan(a) -> int:
    from launcher.run.plan_command import plan_command

    return plan_command(a.recipe, a.overrides, a.gpus, a.tokens, a.json, a.price)


def cmd_smoke(a) -> int:
    from launcher.run.pipeline import smoke_only

    return smoke_only(a.recipe, a.overrides, memory_limit=_parse_gb(a.memory_limit))


def cmd_baseline(a) -> int:
    from launcher.run.baseline_command import baseline_command

    return baseline_command(a.recipe, a.overrides, json_out=a.json)


def cmd_data(a) -> int:
    from launcher.run.data_command import data_command

    return data_command(a.recipe, a.overrides)


def cmd_status(a) -> int:
    from launcher.run.status_command import status_command

    return status_command(a.target, as_json=a.json, watching=a.watch)


def cmd_logs(a) -> int:
    from launcher.run.logs_command import logs_command
    from launcher.run.pipeline import resolve_run

    return logs_command(resolve_run(a.target, command="logs"), follow=a.follow)


def cmd_stop(a) -> int:
    from launcher.run.control import stop_command
    from launcher.run.pipeline import resolve_run

    return stop_command(resolve_run(a.target, command="stop"))


def cmd_pull(a) -> int:
    from launcher.run.pipeline import pull_command

    return pull_command(a.recipe, a.overrides)


def cmd_push(a) -> int:
    from launcher.run.pipeline import push_command

    return push_command(a.target)


def cmd_export(a) -> int:
    from launcher.deliver.export import export_command
    from launcher.run.pipeline import resolve_run

    return export_command(resolve_run(a.target, command="export"), merged=a.merged, gguf=a.gguf)


def cmd_publish(a) -> int:
    from launcher.run.pipeline import resolve_run
    from launcher.deliver.publish import publish_command

    return publish_command(resolve_run(a.target, command="publish"), to=a.to)


def cmd_llamacpp(a) -> int:
    from launcher.deliver import llamacpp

    return llamacpp.main(a.args, prog="ftrun llamacpp")


def cmd_explain(a) -> int:
    from launcher.recipe import explain

    print(explain())
    return 0


WITH_OVERRIDES = ("run", "plan", "smoke", "baseline", "data", "pull")


def split_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """(arguments for argparse, key=value overrides): `ftrun RECIPE ...` is `ftrun run RECIPE ...`, and options
    and overrides may stand before or after the recipe (`ftrun plan --gpus 4xH100-80GB r.yaml lora.r=8`,
    `ftrun --memory-limit 20GB r.yaml`). argparse cannot interleave a list of positionals with options, so the
    overrides (words with '=' that are not options) are taken out first and handed over after parsing."""
    argv = list(argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    if not argv or argv[0] not in WITH_OVERRIDES:
        return argv, []
    overrides = [x for x in argv[1:] if "=" in x and not x.startswith("-")]
    return [x for x in argv if x not in overrides], overrides


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [x for x in argv if x != "--debug"]
    if argv[:1] == ["llamacpp"]:  # its own parser (launcher/deliver/llamacpp.py) reads the rest, --help included
        args = argparse.Namespace(command="llamacpp", args=argv[1:])
    else:
        argv, overrides = split_command_line(argv)
        args = _parser().parse_args(argv)
        if hasattr(args, "overrides"):
            args.overrides = overrides
    if args.command is None:
        _parser().print_help()
        return 2
    handler = globals()[f"cmd_{args.command}"]
    try:
        return handler(args)
    except FtrunError as exc:
        if debug:
            raise
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ftrun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ftrun status | head`: the reader has gone, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 0
    except Exception as exc:  # an ftrun bug: one line, and how to see more
        if debug or os.environ.get("FTRUN_DEBUG"):
            raise
        print(f"ftrun: internal error: {type(exc).__name__}: {exc}\n  Run again with --debug for the traceback, "
              "and please report it.", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
