"""``python -m hw_agnostic.autotune --device h100 --ops rms_norm``: tune ops on this device."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from . import cache
from .platform import DeviceMismatch, resolve_device
from .shapes import TOKEN_COUNTS, widths
from .tuner import tune


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hw_agnostic.autotune", description=__doc__)
    parser.add_argument("--device", default="auto", help="h100, h200, mi300x, ... or auto (default)")
    parser.add_argument("--ops", default="all", help="comma-separated op names, or all")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated dtypes")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)), help="comma-separated token counts")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per op and dtype")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"config root to write (default: the user cache, {cache.user_root()})")
    parser.add_argument("--retune", action="store_true", help="tune keys the target file already has")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    from ..ops import all_ops

    try:
        device, platform = resolve_device(args.device)
    except DeviceMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device.type == "cpu" and platform != "triton_interpreter":
        print("error: autotuning needs a GPU; this machine has none (the CPU runs the compiled reference, "
              "which has no configs to tune)", file=sys.stderr)
        return 2
    tunable = {name: op for name, op in all_ops().items()
               if any(p.kernel is not None for p in op.providers) and not name.endswith("_")}
    names = sorted(tunable) if args.ops == "all" else [n.strip() for n in args.ops.split(",")]
    unknown = [n for n in names if n not in tunable]
    if unknown:
        print(f"error: unknown or untunable ops {unknown}; tunable: {', '.join(sorted(tunable))}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    for name in names:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name.strip())
            shapes = [(t, w) for w in widths(name) for t in tokens]
            results = tune(tunable[name], shapes, dtype=dtype, device=device, budget_s=args.budget,
                           root=args.out, retune=args.retune)
            done = sum(r.status == "tuned" for r in results)
            print(f"{name} {dtype_name}: tuned {done}, kept {sum(r.status == 'kept' for r in results)}, "
                  f"left {len(results) - done} of {len(results)} keys on {platform}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
