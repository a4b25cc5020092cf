"""The `ftrun` command line: parse, call one stage, print. No logic lives here.

`COMMANDS` is the one list of subcommands; the usage text, the parser and the dispatch are built from it. `--debug`,
anywhere on the line, shows tracebacks instead of one-paragraph errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from launcher import gguf_types
from launcher.errors import EXIT_INTERNAL, FtrunError, UsageError
from launcher.store.rundir import RUNS

RECIPE_HELP = "the recipe file (YAML; `ftrun explain` lists its keys)"
OVERRIDES_HELP = "recipe keys changed for this command, e.g. lora.r=8 max_length=2048"
TARGET_HELP = f"the run's recipe file or its run directory (default: the only run under ./{RUNS})"
MASTER_PORT = 29500  # --master-port's default: torchrun's own


def _tokens_meaning() -> str:
    from launcher.recipe import TOKENS_MEANING  # the one wording of what a token count means

    return TOKENS_MEANING


def _gpu_names() -> str:
    from launcher.plan.hardware import catalog  # the catalog is the one list of names (gpus.yaml)

    return ", ".join(catalog())


def _smoke_share() -> str:
    from launcher.recipe_sections import SmokeSettings  # the smoke test's default sample, as its field says it

    return f"{SmokeSettings.model_fields['fraction'].default:.0%}"


# --- each command's options and call ------------------------------------------------------------------------------


def _run_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--foreground", action="store_true", help="stay attached (debugging, tests)")
    r.add_argument("--fresh", action="store_true", help="start over; the old run directory is kept, renamed")
    r.add_argument("--memory-limit", metavar="GB", help="cap each worker's memory, e.g. 20GB (plan for a smaller card)")
    r.add_argument("--nnodes", type=int, default=1, metavar="N", help="boxes in the job (run the same command on each)")
    r.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="I",
        help="this box's number, 0 .. nnodes-1 (0 holds the rendezvous)",
    )
    r.add_argument("--master-addr", metavar="HOST", help="address of node 0, reachable from every node")
    r.add_argument("--master-port", type=int, default=MASTER_PORT, metavar="PORT", help="a free TCP port on node 0")
    r.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume from the run's checkpoints even though the recipe's training settings changed",
    )


def _run(a) -> int:
    from launcher.run.pipeline import launch

    return launch(
        a.recipe,
        a.overrides,
        foreground=a.foreground,
        fresh=a.fresh,
        memory_limit=_parse_gb(a.memory_limit),
        allow_changes=a.allow_changes,
        nodes=_nodes(a),
    )


def _plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus",
        metavar="SPEC",
        help="plan for another box than this machine's GPUs (or, without a GPU "
        "here, the recipe's box:): COUNTxNAME such as 4xH100-80GB, or NAME for one card; names: "
        f"{_gpu_names()}",
    )
    p.add_argument(
        "--tokens",
        metavar="N",
        help=f"{_tokens_meaning()}; e.g. 15M, used instead of counting the data "
        "and instead of the recipe's `tokens` key",
    )
    p.add_argument(
        "--price",
        type=float,
        metavar="EUR/h",
        help="the whole box's price per hour (overrides the catalog and the recipe's price_per_hour_eur)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON, also when it does not fit")


def _plan(a) -> int:
    from launcher.run.plan_command import plan_command

    return plan_command(a.recipe, a.overrides, a.gpus, a.tokens, a.json, a.price)


def _smoke(a) -> int:
    from launcher.run.pipeline import smoke_only

    return smoke_only(a.recipe, a.overrides, memory_limit=_parse_gb(a.memory_limit))


def _baseline(a) -> int:
    from launcher.run.baseline_command import baseline_command

    return baseline_command(a.recipe, a.overrides, json_out=a.json)


def _data(a) -> int:
    from launcher.run.data_command import data_command

    return data_command(a.recipe, a.overrides)


def _status_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--json", action="store_true", help="print the status (or the list of runs) as JSON")
    s.add_argument("--watch", action="store_true", help="refresh every 2 s until the run ends")


def _status(a) -> int:
    from launcher.run.status_command import status_command

    return status_command(a.target, as_json=a.json, watching=a.watch)


def _logs(a) -> int:
    from launcher.run.logs_command import logs_command
    from launcher.run.run_dirs import resolve_run

    return logs_command(resolve_run(a.target, command="logs"), follow=a.follow)


def _stop(a) -> int:
    from launcher.run.control import stop_command
    from launcher.run.run_dirs import resolve_run

    return stop_command(resolve_run(a.target, command="stop"))


def _pull(a) -> int:
    from launcher.run.sync_commands import pull_command

    return pull_command(a.recipe, a.overrides)


def _push(a) -> int:
    from launcher.run.sync_commands import push_command

    return push_command(a.target)


def _export_options(e: argparse.ArgumentParser) -> None:
    e.add_argument("--merged", action="store_true", help="also merge the adapter into the 16-bit base")
    e.add_argument(
        "--gguf",
        metavar="TYPE",
        help=f"also write a GGUF: {gguf_types.listed()} (the recipe's gguf "
        f"export defaults to {gguf_types.DEFAULT_TYPE}; implies --merged)",
    )


def _export(a) -> int:
    from launcher.run.after_training import export_command
    from launcher.run.run_dirs import resolve_run
    from launcher.store.modes import share_results

    run = resolve_run(a.target, command="export")
    try:
        return export_command(run, merged=a.merged, gguf=a.gguf)
    finally:  # what the export wrote, as readable as the rest of the run (as the supervisor's export does)
        share_results(run.final, lambda line: print(line, file=sys.stderr))


def _publish(a) -> int:
    from launcher.deliver.publish import publish_command
    from launcher.run.run_dirs import resolve_run

    return publish_command(resolve_run(a.target, command="publish"), to=a.to)


def _explain(a) -> int:
    from launcher.recipe import explain

    print(explain())
    return 0


def _llamacpp(a) -> int:
    from launcher.deliver import llamacpp

    return llamacpp.main(a.args, prog="ftrun llamacpp")


def _llamacpp_options(ll: argparse.ArgumentParser) -> None:
    ll.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="install: copy llama.cpp's converter from the installed "
        "llama-cpp-python's source; check MODEL [--type T]: can this model become a GGUF; architectures: "
        "write the shipped architecture table (`ftrun llamacpp --help` for more)",
    )


def _none(_: argparse.ArgumentParser) -> None:
    pass


@dataclass(frozen=True)
class Command:
    name: str
    takes: str  # "recipe": RECIPE [key=value ...]; "target": [RECIPE|RUN_DIR]; else its own words, as typed
    help: str
    options: Callable[[argparse.ArgumentParser], None]
    call: Callable[[argparse.Namespace], int]

    def text(self) -> str:
        """What it does, with the defaults it names read from where they are set."""
        return self.help.replace("{smoke_share}", _smoke_share())

    def synopsis(self, parser: argparse.ArgumentParser) -> str:
        """`ftrun NAME`, what it takes and its options, read from its parser."""
        words = {"recipe": ["RECIPE [key=value ...]"], "target": ["[RECIPE|RUN_DIR]"]}.get(self.takes, [self.takes])
        for action in parser._actions:  # argparse has no public list of a parser's options
            if action.option_strings and action.help != argparse.SUPPRESS and "-h" not in action.option_strings:
                flag = action.option_strings[-1]
                words.append(f"[{flag}]" if action.nargs == 0 else f"[{flag} {action.metavar or action.dest.upper()}]")
        return " ".join(["ftrun", self.name, *filter(None, words)])


# `ftrun RECIPE ...` is `ftrun run RECIPE ...`: run is the default command
COMMANDS = {
    c.name: c
    for c in (
        Command(
            "run",
            "recipe",
            "plan, smoke-test and start (or resume) the run, detached; the default command (`ftrun RECIPE`)",
            _run_options,
            _run,
        ),
        Command("plan", "recipe", "size the job: memory, engine, GPUs, time, cost", _plan_options, _plan),
        Command(
            "smoke",
            "recipe",
            "run only the smoke test ({smoke_share} of the data unless the recipe's smoke.fraction says otherwise) "
            "and print the forecast",
            lambda s: s.add_argument("--memory-limit", metavar="GB", help="cap the worker's memory, e.g. 20GB"),
            _smoke,
        ),
        Command(
            "baseline",
            "recipe",
            "score the base model on held-out examples, zero-shot and with examples in its prompt, and say whether "
            "fine-tuning pays (the launch does it too, before its smoke test)",
            lambda b: b.add_argument(
                "--json", action="store_true", help="print only the scores and the verdict as JSON on stdout"
            ),
            _baseline,
        ),
        Command(
            "data",
            "recipe",
            "the data as the loss sees it: one example per source with its trained tokens "
            "marked, and the dataset's statistics (the launch's data check)",
            _none,
            _data,
        ),
        Command(
            "status",
            "target",
            f"state, step, loss and ETA of a run; without a target, every run under ./{RUNS}",
            _status_options,
            _status,
        ),
        Command(
            "logs",
            "target",
            "the run's train.log",
            lambda g: g.add_argument(
                "-f",
                "--follow",
                action="store_true",
                help="keep printing new lines while the run's launcher or supervisor lives",
            ),
            _logs,
        ),
        Command("stop", "target", "checkpoint and stop a run", _none, _stop),
        Command("pull", "recipe", "fetch a run from the recipe's sync.to without resuming it", _none, _pull),
        Command("push", "target", "copy the newest checkpoint and the result to sync.to now", _none, _push),
        Command(
            "export",
            "target",
            "adapter, merged 16-bit model, GGUF and serving commands, each checked",
            _export_options,
            _export,
        ),
        Command(
            "publish",
            "target",
            "push the checked export and a model card to the recipe's publish.to",
            lambda p: p.add_argument(
                "--to", metavar="hf://USER/REPO", help="another repo than the recipe's publish.to"
            ),
            _publish,
        ),
        Command("explain", "", "every recipe key with its default and meaning", _none, _explain),
        Command(
            "llamacpp",
            "install | check MODEL [--type T] | architectures",
            "llama.cpp for the GGUF export: install its converter (install), check a model (check MODEL), write the "
            "shipped architecture table (architectures)",
            _llamacpp_options,
            _llamacpp,
        ),
    )
}
WITH_OVERRIDES = tuple(name for name, c in COMMANDS.items() if c.takes == "recipe")


def usage_text(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """Each command's synopsis (what it does is in the list above it): the epilog of `ftrun --help`."""
    import textwrap

    lines = ["synopses:"]
    for c in COMMANDS.values():
        lines += textwrap.wrap(c.synopsis(parsers[c.name]), 100, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines + ["  --debug (anywhere on the line): tracebacks instead of one-paragraph errors"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftrun",
        description="From a fine-tuning recipe to a trained, exported model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks (accepted anywhere on the line)")
    sub = p.add_subparsers(dest="command")
    for c in COMMANDS.values():
        # argparse formats help with %: a literal percent sign is doubled
        sp = sub.add_parser(c.name, help=c.text().replace("%", "%%"), add_help=c.name != "llamacpp")
        if c.takes == "recipe":
            sp.add_argument("recipe", help=RECIPE_HELP)
            sp.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)
        elif c.takes == "target":
            sp.add_argument("target", nargs="?", help=TARGET_HELP)
        c.options(sp)
    p.epilog = usage_text(sub.choices)
    p.set_defaults(_commands=sub.choices)  # each command's parser, for an option given to the wrong one
    return p


def _misplaced_option(parser: argparse.ArgumentParser, args, extra: list[str], typed: str) -> Optional[UsageError]:
    """An option that another command has (`ftrun RECIPE --gpus 8xH100-80GB`): which command it belongs to, what it
    does there, and the command line that uses it. None when no command has it (argparse's own error then)."""
    commands = getattr(args, "_commands", None) or {}
    for word in extra:
        flag = word.split("=", 1)[0]
        if not flag.startswith("-"):
            continue
        # argparse keeps each parser's options in _option_string_actions; it offers no public lookup
        owners = [
            (name, sp._option_string_actions[flag])
            for name, sp in commands.items()
            if name != args.command and flag in sp._option_string_actions
        ]
        if not owners:
            continue
        name, action = owners[0]
        does = (action.help or "").split(" (")[0].split(":")[0].rstrip(".; ")
        line = (
            " ".join(["ftrun", name, args.recipe, *getattr(args, "overrides", []), *extra])
            if getattr(args, "recipe", None)
            else None
        )
        return UsageError(
            f"{flag} is an option of `ftrun {name}`" + (f" ({does})" if does else "") + f", not of `{typed}`",
            fix=(f"{line}; " if line else "") + f"`ftrun {name} --help` lists its options",
        )
    return None


def _parse_gb(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    t = text.strip().lower().replace(" ", "")
    # ftrun's one unit, GB = 2**30 bytes (sizing_constants.GB), as nvidia-smi counts: 20GB and 20GiB are the same,
    # 800MB is 800 MiB
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
        # a rank, an address or a port only mean something in a job of several boxes: without --nnodes the run would
        # train alone on this box, and the other nodes would wait for it in vain
        given = [
            f"--node-rank {a.node_rank}" if a.node_rank != 0 else "",
            f"--master-addr {a.master_addr}" if a.master_addr else "",
            f"--master-port {a.master_port}" if a.master_port != MASTER_PORT else "",
        ]
        given = [g for g in given if g]
        if given:
            raise UsageError(
                f"{' '.join(given)} {'is a flag' if len(given) == 1 else 'are flags'} of a job across several boxes, "
                f"but --nnodes (the number of boxes) is missing or 1, so this box would train alone",
                fix="give the number of boxes on every node, e.g. `--nnodes 2 --node-rank 1 --master-addr HOST` "
                "(node 0 has --node-rank 0 and HOST is its address); to train on this box alone, leave out "
                + " and ".join(g.split()[0] for g in given)
                + ".",
            )
        return None
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        raise UsageError(
            f"--nnodes {a.nnodes} --node-rank {a.node_rank}: the rank must be 0 .. nnodes-1",
            fix="number the boxes 0, 1, ...; node 0 is the one whose address is --master-addr.",
        )
    if not a.master_addr:
        raise UsageError(
            f"--nnodes {a.nnodes} needs --master-addr (the address of node 0)",
            fix="add --master-addr HOST --master-port PORT, the same on every node.",
        )
    if not 0 < a.master_port < 65536:
        raise UsageError(
            f"--master-port {a.master_port} is not a TCP port",
            fix=f"give a free port from 1024 to 65535 on node 0, the same on every node (default {MASTER_PORT}).",
        )
    return {"nnodes": a.nnodes, "node_rank": a.node_rank, "master_addr": a.master_addr, "master_port": a.master_port}


def split_command_line(argv: list[str]) -> tuple[list[str], list[str]]:
    """(arguments for argparse, key=value overrides): `ftrun RECIPE ...` is `ftrun run RECIPE ...`; the overrides are
    taken out first, as argparse cannot interleave a list of positionals with options."""
    argv = list(argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    if not argv or argv[0] not in WITH_OVERRIDES:
        return argv, []
    overrides = [x for x in argv[1:] if "=" in x and not x.startswith("-")]
    return [x for x in argv if x not in overrides], overrides


def _recipe_and_overrides(argv: list[str], recipe: str, words: list[str]) -> tuple[str, list[str]]:
    """The recipe, and every other word that is not an option in the order typed (for parse_overrides to refuse by
    name); when argparse's recipe is no file but a later word is (`ftrun plan max_steps 20 r.yaml`), that is it."""
    left, ordered = [recipe, *words], []
    for word in argv[1:]:  # argv[0] is the command
        if word in left:
            left.remove(word)
            ordered.append(word)
    ordered += left
    if not os.path.isfile(recipe):
        recipe = next((w for w in ordered if "=" not in w and os.path.isfile(w)), recipe)
    ordered.remove(recipe)
    return recipe, ordered


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [x for x in argv if x != "--debug"]
    parser, extra = None, []
    if argv[:1] == ["llamacpp"]:  # its own parser (launcher/deliver/llamacpp.py) reads the rest, --help included
        args = argparse.Namespace(command="llamacpp", args=argv[1:])
    else:
        typed = argv[0] if argv[:1] and argv[0] in COMMANDS else "RECIPE"  # `ftrun RECIPE` is `ftrun run RECIPE`
        typed_argv = argv if typed != "RECIPE" else ["run", *argv]
        argv, overrides = split_command_line(argv)
        parser = _parser()
        args, extra = parser.parse_known_args(argv)
        if hasattr(args, "overrides"):
            # words that are neither options nor key=value (`max_steps 20`, `lr:1e-4`) go to the overrides too, in
            # the order typed, so that they are refused by name (recipe_loading.parse_overrides) instead of dropped
            strays = list(args.overrides) + ([] if any(x.startswith("-") for x in extra) else extra)
            extra = [x for x in extra if x not in strays]
            args.recipe, args.overrides = _recipe_and_overrides(typed_argv, args.recipe, overrides + strays)
    try:
        if extra:
            misplaced = _misplaced_option(parser, args, extra, f"ftrun {typed}")
            if misplaced is None:
                parser.error("unrecognized arguments: " + " ".join(extra))  # argparse's usage and exit 2
            raise misplaced
        if args.command is None:
            _parser().print_help()
            return 2
        return COMMANDS[args.command].call(args)
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
        print(
            f"ftrun: internal error: {type(exc).__name__}: {exc}\n  Run again with --debug for the traceback, "
            "and please report it.",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
