"""``make bench DEVICE=cpu|h100|h200|...``: benchmark hw_agnostic against the code it replaces.

Writes ``bench/results/<platform>/``: ``results.csv`` (long format: one row per suite, op,
shape, dtype and provider, with device, versions and config source), ``results.md`` and one
PNG per op.
"""

from __future__ import annotations

import argparse
import importlib
import platform as host
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from hw_agnostic.autotune.platform import DeviceMismatch, device_name, resolve_device

from . import report
from .timing import copy_bandwidth_gbps, matmul_tflops

SUITES = {"ops": "bench.ops_suite", "model": "bench.model_suite", "moe": "bench.moe_suite", "attention": "bench.attention_suite",
          "vllm": "bench.vllm_suite"}
RESULTS = Path(__file__).resolve().parent / "results"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "python": host.python_version()}
    for name in ("triton", "helion", "transformers", "liger_kernel"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:
            versions[name] = ""
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--device", default="auto", help="cpu, h100, h200, ... or auto (default)")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from {', '.join(SUITES)}")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<platform>)")
    args = parser.parse_args(argv)

    try:
        device, platform = resolve_device(args.device)
    except DeviceMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or RESULTS / platform
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    # Every shape of a baseline module compiles under one code object: with dynamo's default
    # budget of 8 the later shapes would silently run eagerly as "torch.compile" rows.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {message}", flush=True)

    copy_gbps = copy_bandwidth_gbps(device)
    matmul = matmul_tflops(device)
    log(f"{platform} ({device_name(device)}): copy {copy_gbps:.1f} GB/s, bf16 matmul {matmul:.1f} TFLOP/s")
    rows = []
    for suite in args.suites.split(","):
        module = importlib.import_module(SUITES[suite.strip()])
        rows += list(module.run(device, quick=args.quick, log=log))
    context = {"platform": platform, "device_name": device_name(device), "copy_gbps": copy_gbps,
               "matmul_tflops": matmul, **_versions()}
    frame = pd.DataFrame(rows)
    for column, value in context.items():  # a suite may bring its own ceiling (e.g. fp32 matmul rate)
        frame[column] = frame[column].fillna(value) if column in frame else value
    frame = report.add_ratios(frame)
    frame.to_csv(out / "results.csv", index=False)
    command = "make bench DEVICE=" + args.device + (" (--quick)" if args.quick else "")
    header = (f"# hw_agnostic bench: {platform}\n\n`{command}` on {device_name(device)}; "
              f"same-run copy bandwidth {copy_gbps:.1f} GB/s, bf16 matmul {matmul:.2f} TFLOP/s; "
              + ", ".join(f"{k} {v}" for k, v in _versions().items() if v)
              + ". Times are medians after warm-up; `first_call_s` in the CSV holds compile times.")
    (out / "results.md").write_text(report.markdown(frame, header))
    report.plot(frame[frame["suite"] == "ops"], out)
    log(f"wrote {out}/results.csv, results.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
