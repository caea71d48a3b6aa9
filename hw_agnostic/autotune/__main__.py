"""``hw-agnostic autotune --device h100 --ops rms_norm``: tune kernel launch configs on this device.

Each key's candidates are checked against the reference, then timed, within ``--budget``
seconds per op and dtype; each winner is saved as soon as it is found (a rerun resumes). The
summary separates keys tuned from keys left on the default because the budget ran out, and
names the file written and the config chosen for each key.

Needs a GPU. Without one, ``TRITON_INTERPRET=1 hw-agnostic autotune --device interpreter
--ops rms_norm --tokens 1,16 --budget 30`` drives the whole procedure through the Triton
interpreter (timings worthless, the mechanism real), writing the ``triton_interpreter`` platform.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ..cli import ArgumentParser, UsageError
from ..kernels.interpret import interpreter_mode
from . import cache
from .keys import key_string
from .platform import DeviceMismatch, resolve_device
from .shapes import TOKEN_COUNTS, widths
from .tuner import KeyResult, summary, tune

LOGGER = "hw_agnostic"
DTYPES = ("bfloat16", "float16", "float32")


@contextlib.contextmanager
def _logging(level: str) -> Iterator[None]:
    """Log this library's messages at ``level`` to stderr; every other logger is left as it is."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(LOGGER)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def _report(name: str, dtype: str, platform: str, results: list[KeyResult]) -> list[str]:
    lines = [f"{name} {dtype} on {platform}: {summary(results)}"]
    for path in dict.fromkeys(r.path for r in results if r.path is not None):
        lines.append(f"  wrote {path}")
    for result in results:
        if result.config is not None:
            lines.append(f"  {key_string(result.key)} -> {key_string(result.config)} ({result.time_us:.1f} µs"
                         + (", partial search" if result.status == "partial" else "") + ")")
    skipped = {r.reason for r in results if r.status == "skipped"}
    lines += [f"  skipped: {reason}" for reason in skipped]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="hw-agnostic autotune", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="h100, h200, mi300x, interpreter, ... or auto (default)")
    parser.add_argument("--ops", default="all", help="comma-separated op names, or all")
    parser.add_argument("--dtypes", default="bfloat16,float16", help=f"comma-separated, from {', '.join(DTYPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)), help="comma-separated token counts")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per op and dtype")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"config root to write (default: the user cache, {cache.user_root()})")
    parser.add_argument("--retune", action="store_true", help="tune keys the target file already has")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="of hw_agnostic's own messages")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from ..ops import all_ops

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes {args.dtypes!r}: choose from {', '.join(DTYPES)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: expected comma-separated integers")
    if any(t < 1 for t in tokens):
        parser.error("--tokens: token counts must be >= 1")
    if args.budget <= 0:
        parser.error("--budget must be > 0 seconds")
    tunable = {name: op for name, op in all_ops().items()
               if any(p.kernel is not None for p in op.providers) and not name.endswith("_")
               and not name.startswith("test_")}
    names = sorted(tunable) if args.ops == "all" else [n.strip() for n in args.ops.split(",")]
    unknown = [n for n in names if n not in tunable]
    if unknown:
        parser.error(f"--ops: unknown or untunable {', '.join(map(repr, unknown))}; tunable: {', '.join(sorted(tunable))}")
    try:
        device, platform = resolve_device(args.device)
    except DeviceMismatch as err:
        raise UsageError(str(err)) from None
    if device.type == "cpu" and platform != "triton_interpreter":
        raise UsageError("autotuning needs a GPU; this machine has none (the CPU runs the reference, which has no "
                         "configs to tune; TRITON_INTERPRET=1 ... --device interpreter exercises the tuner)")
    if platform == "triton_interpreter" and interpreter_mode() != "triton":
        raise UsageError("--device interpreter needs TRITON_INTERPRET=1 in the environment")

    lines: list[str] = []
    try:
        redirect = contextlib.nullcontext()
        if not args.no_progress:
            from tqdm.contrib.logging import logging_redirect_tqdm

            redirect = logging_redirect_tqdm([logging.getLogger(LOGGER)])
        with _logging(args.log_level), redirect:
            for name in names:
                for dtype_name in dtypes:
                    shapes = [(t, w) for w in widths(name) for t in tokens]
                    results = tune(tunable[name], shapes, dtype=getattr(torch, dtype_name), device=device,
                                   budget_s=args.budget, root=args.out, retune=args.retune,
                                   progress=not args.no_progress)
                    lines += _report(name, dtype_name, platform, results)
    finally:
        if lines:
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    from ..cli import main as cli_main

    sys.exit(cli_main(["autotune", *sys.argv[1:]]))
