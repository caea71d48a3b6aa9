"""``make bench`` / ``python -m bench``: benchmark hw_agnostic against the code it replaces.

Writes into ``--out`` (default ``bench/runs/<platform>-<UTC time>/``, which git ignores; pass
``--out bench/results/<platform>`` to update the committed results):

* ``rows.jsonl`` and ``results.csv``: one row per suite, op, shape, dtype and provider, written
  as each row is measured, so a run that is stopped keeps what it measured;
* ``meta.json``: the command, times, device model, package versions, commit, same-run ceilings;
* ``results.md`` (a summary of rows slower than a baseline and rows too noisy to support their
  ratio, then one table per op) and one PNG per op, written at the end (also after Ctrl-C).

Every time is the median of several runs, with min, max, quartiles and the run count beside it.
``--only REGEX`` measures the grid items whose label (as the progress lines print it) matches;
with ``--merge`` their rows replace the same rows of an existing ``--out``, which is how a noisy
row is re-measured without rerunning everything. ``--report DIR`` rebuilds ``results.md`` and
the plots of DIR from its rows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform as host
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from hw_agnostic.autotune.platform import DeviceMismatch, device_model, largest_cache_bytes, resolve_device
from hw_agnostic.cli import ArgumentParser

from . import report
from .timing import copy_bandwidth, matmul_ceiling

#: name -> module with ``run(device, *, quick, log[, only])`` yielding row dicts (and optionally
#: ``count(device, quick[, only])``, the number of rows, for the progress line's ETA).
SUITES = {"ops": "bench.ops_suite", "model": "bench.model_suite", "moe": "bench.moe_suite",
          "attention": "bench.attention_suite", "vllm": "bench.vllm_suite", "decode_host": "bench.decode_host_suite",
          "decode": "bench.decode_suite"}
HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"
VERSIONED = ("torch", "triton", "helion", "transformers", "numpy", "liger-kernel")
GROUP = ["suite", "op", "shape", "dtype"]


def versions() -> dict[str, str]:
    found = {"python": host.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = ""
    return found


def metadata(device: torch.device, platform: str, argv: list[str]) -> dict[str, Any]:
    from hw_agnostic import __version__
    from hw_agnostic.doctor import source_commit

    cache = largest_cache_bytes(device)
    return {
        "command": "python -m bench " + " ".join(argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform, "device_name": device_model(device),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "largest_cache_bytes": cache, "hw_agnostic": __version__, "commit": source_commit(HERE.parent),
        "versions": versions(),
    }


class Progress:
    """``[elapsed | rows done/total | ETA]`` prefixes for the log lines."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()

    def prefix(self) -> str:
        elapsed = time.monotonic() - self.started
        text = f"{_duration(elapsed):>7}"
        if self.total:
            text += f" | {self.done}/{self.total} rows"
            if self.done:
                left = max(self.total - self.done, 0) * elapsed / self.done
                text += f" | ETA {_duration(left)}"
        return f"[{text}]"

    def log(self, message: str) -> None:
        print(f"{self.prefix()} {message}", flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Results:
    """The rows of one output folder: appended to ``rows.jsonl`` and ``results.csv`` as they come."""

    def __init__(self, out: Path, *, merge: bool) -> None:
        self.out = out
        self.rows_path = out / "rows.jsonl"
        self.rows: list[dict[str, Any]] = []
        self.replaced: set[tuple] = set()
        if merge and self.rows_path.exists():
            self.rows = [json.loads(line) for line in self.rows_path.read_text().splitlines() if line.strip()]
        elif self.rows_path.exists():
            self.rows_path.unlink()

    def add(self, row: dict[str, Any]) -> None:
        group = tuple(row.get(c) for c in GROUP)
        if group not in self.replaced:  # the first row of a re-measured group drops the old ones
            self.replaced.add(group)
            self.rows = [r for r in self.rows if tuple(r.get(c) for c in GROUP) != group]
            self._rewrite_rows()
        self.rows.append(row)
        with self.rows_path.open("a") as handle:
            handle.write(json.dumps(row, default=_jsonable) + "\n")
        self.frame().to_csv(self.out / "results.csv", index=False)

    def _rewrite_rows(self) -> None:
        self.rows_path.write_text("".join(json.dumps(r, default=_jsonable) + "\n" for r in self.rows))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def _suites(names: str) -> list[str]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SUITES]
    if unknown or not chosen:
        raise ValueError(f"unknown suite {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"known: {', '.join(SUITES)}")
    return chosen


def _call(function: Callable[..., Any], *args: Any, only: Callable[[str], bool] | None, out: Path | None = None,
          **kwargs: Any) -> Any:
    """Pass ``only`` (and ``out``, the run's folder) to suites that take them (a suite added later may not)."""
    import inspect

    parameters = inspect.signature(function).parameters
    if only is not None and "only" in parameters:
        kwargs["only"] = only
    if out is not None and "out" in parameters:
        kwargs["out"] = out
    return function(*args, **kwargs)


def _count(modules: Iterable[Any], device: torch.device, quick: bool, only: Callable[[str], bool] | None) -> int | None:
    counts = [_call(m.count, device, quick, only=only) for m in modules if hasattr(m, "count")]
    return sum(counts) if counts else None


def write_reports(out: Path, meta: dict[str, Any], frame: pd.DataFrame) -> list[Path]:
    frame = report.add_ratios(frame)
    (out / "results.md").write_text(report.markdown(frame, meta))
    return report.plot(frame, out, meta)


def main(argv: list[str] | None = None, *, prog: str = "python -m bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog=prog, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, h100, h200, ... or auto (default)")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from {', '.join(SUITES)}")
    parser.add_argument("--quick", action="store_true", help="a smaller grid (see the README for durations)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/runs/<platform>-<time>, ignored by git)")
    parser.add_argument("--only", default=None, metavar="REGEX", help="measure only grid items whose label matches")
    parser.add_argument("--merge", action="store_true", help="replace re-measured rows in --out, keep the others")
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="rebuild DIR's results.md and plots from its rows, measuring nothing")
    args = parser.parse_args(argv)

    if args.report is not None:
        rows = args.report / "rows.jsonl"
        if not rows.is_file():
            parser.error(f"--report {args.report}: no rows.jsonl there")
        meta = json.loads((args.report / "meta.json").read_text()) if (args.report / "meta.json").is_file() else {}
        frame = pd.DataFrame([json.loads(line) for line in rows.read_text().splitlines() if line.strip()])
        write_reports(args.report, meta, frame)
        print(f"rebuilt {args.report}/results.md and plots from {len(frame)} rows")
        return 0
    try:
        suites = _suites(args.suites)
    except ValueError as err:
        parser.error(f"--suites: {err}")
    try:
        device, platform = resolve_device(args.device)
    except DeviceMismatch as err:
        parser.error(f"--device: {err}")
    try:
        pattern = re.compile(args.only) if args.only else None
        only = (lambda label: pattern.search(label) is not None) if pattern else None
    except re.error as err:
        parser.error(f"--only {args.only!r} is not a regular expression ({err})")
    if args.merge and args.out is None:
        parser.error("--merge needs --out (the results folder to merge into)")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or RUNS / f"{platform}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    meta = metadata(device, platform, argv)
    meta_path = out / "meta.json"
    previous = json.loads(meta_path.read_text()) if args.merge and meta_path.is_file() else None
    results = Results(out, merge=args.merge)
    torch.manual_seed(0)
    # Every shape of a baseline module compiles under one code object: with dynamo's default
    # budget of 8 the later shapes would silently run eagerly as "torch.compile" rows.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096

    modules = {name: importlib.import_module(SUITES[name]) for name in suites}
    progress = Progress(_count(modules.values(), device, args.quick, only))
    progress.log(f"writing {out}")
    status = "failed"
    try:
        copy = copy_bandwidth(device)
        ceiling = matmul_ceiling(device)
        matmul = ceiling.tflops
        meta.update(copy_gbps=copy.into_existing_gbps, clone_gbps=copy.clone_gbps, matmul_tflops=matmul,
                    matmul_tflops_bf16=ceiling.bf16, matmul_tflops_fp32=ceiling.fp32)
        if previous is not None:
            meta["merged_into"] = previous
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        progress.log(f"{platform} ({meta['device_name']}): copy {copy.into_existing_gbps:.1f} GB/s into an existing "
                     f"buffer, {copy.clone_gbps:.1f} GB/s as clone(); {ceiling.describe()}")
        context = {"platform": platform, "device_name": meta["device_name"], "copy_gbps": copy.into_existing_gbps,
                   "clone_gbps": copy.clone_gbps, "matmul_tflops": matmul, "measured_at": meta["started"],
                   "commit": meta["commit"] or "", **meta["versions"]}
        for name, module in modules.items():
            started = time.monotonic()
            for row in _call(module.run, device, quick=args.quick, log=progress.log, only=only, out=out):
                # a suite may bring its own ceiling (e.g. the fp32 matmul rate of an fp32 model)
                results.add({**context, **{k: v for k, v in row.items() if v is not None}})
                progress.done += 1
            meta.setdefault("suite_seconds", {})[name] = round(time.monotonic() - started, 1)
        status = "complete"
    except KeyboardInterrupt:
        status = "interrupted"
        progress.log("interrupted: writing the report of what was measured")
    finally:
        meta.update(finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    status=status, seconds=round(time.monotonic() - progress.started, 1))
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        if results.rows:
            write_reports(out, meta, results.frame())
    if results.rows:
        progress.log(f"{status}: wrote {out}/results.csv, results.md, meta.json and plots")
    else:
        progress.log(f"{status}: no rows measured; wrote {out}/meta.json")
    return 0 if status == "complete" else 130


if __name__ == "__main__":
    sys.exit(main())
