"""``hw-agnostic`` (or ``python -m hw_agnostic``): one command line for the library.

Each subcommand is one entry of :data:`COMMANDS`: a name, the ``module:function`` that runs it
(called with the remaining arguments, returning the exit status) and a one-line description.
Modules are imported only when their command runs, so ``--help`` and ``--version`` stay fast.
Adding a subcommand is one :func:`register` call below.

A mistake of the user's (an unknown name, a missing directory, a device this machine lacks) is
reported as one ``error:`` line and exit status 2, never a traceback: commands raise
:class:`UsageError`, and their parsers are :class:`ArgumentParser`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

PROG = "hw-agnostic"


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``prog: error: ...; see --help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    target: str  # "module:function"; the function takes argv and returns an exit status
    help: str

    def load(self) -> Callable[[list[str]], int]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


COMMANDS: dict[str, Command] = {}


def register(name: str, target: str, help: str) -> None:
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = Command(name, target, help)


register("demo", "hw_agnostic.demo:main",
         "rewire a small model, generate with it and with HF eager, check the tokens are identical")
register("bench", "hw_agnostic.cli:bench_main",
         "benchmark the ops and a model against the code they replace (needs the source tree's bench/)")
register("autotune", "hw_agnostic.autotune.__main__:main", "tune kernel launch configs on this GPU")
register("doctor", "hw_agnostic.doctor:main",
         "report versions, devices, which provider runs each op here and why, config caches, environment")
register("compile-report", "hw_agnostic.compile_report:compile_report_main",
         "compile every kernel for GPU targets (no GPU needed) and tabulate registers, spills, shared memory")


def version() -> str:
    from . import __version__

    return __version__


def bench_main(argv: list[str]) -> int:
    """``hw-agnostic bench``: the harness lives in the source tree's ``bench/``, next to the package."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "__main__.py").is_file():
        raise UsageError(
            f"the bench harness is part of the source tree (bench/), not of the installed package; "
            f"run it from a clone: `make bench` or `python -m bench` there (looked in {root})"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench.__main__ import main as run_bench

    return run_bench(argv, prog=f"{PROG} bench")


def _parser() -> ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {c.name:<{width}}  {c.help}" for c in COMMANDS.values())
    parser = ArgumentParser(
        prog=PROG,
        description="Hardware-agnostic LLM layers: ops in Helion/Triton next to PyTorch references.",
        epilog=f"commands:\n{listing}\n\n`{PROG} COMMAND --help` describes a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} [--version] [--help] COMMAND [ARGS...]",
    )
    parser.add_argument("--version", action="version", version=f"hw_agnostic {version()}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    command = COMMANDS.get(argv[0])
    if command is None:
        if argv[0].startswith("-"):
            parser.parse_args(argv)  # --help, --version, or an unknown option (one error line)
        parser.error(f"unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})")
    try:
        return command.load()(argv[1:])
    except UsageError as err:
        print(f"{PROG} {command.name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {command.name}: interrupted", file=sys.stderr)
        return 130
