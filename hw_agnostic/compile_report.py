"""``python -m hw_agnostic compile-report``: every kernel of every op, compiled for GPU targets.

Walks each op on the shapes of real models (:mod:`hw_agnostic.autotune.shapes`: the widths an op
sees in them, times the token counts the tuner uses) with meta tensors, in compile-for-target
mode (:mod:`hw_agnostic.kernels.targets`), where each target launches the configs it would get on
such a GPU (tuned for ``--platform``, else the compile-chosen defaults of that target, else the
kernel's built-in default). Writes one CSV row per op x shape x kernel x
target (registers, spills, shared memory, widest loads and stores, matrix instruction, compile
time, the problems the rules find) and a markdown summary.

Meta tensors hold no data, so nothing is computed: the walk needs no memory for the largest
shapes (a DeepSeek-V3 expert layer) and only the compilers' time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .kernels import targets as compile_targets

DEFAULT_OUT = Path("bench/results/compile")
#: Ops whose kernels another op already launches on the same shapes (the in-place form).
SAME_KERNELS_AS = {"fused_add_rms_norm_": "fused_add_rms_norm", "fused_add_layer_norm_": "fused_add_layer_norm"}
#: One model shape per op, for quick walks: Llama-3-8B's widths, head dim 128, Qwen3-30B-A3B's experts.
HEADLINE_WIDTHS = {"rms_norm": 4096, "fused_add_rms_norm": 4096, "silu_and_mul": 14336, "gelu_and_mul": 14336,
                   "swiglu_oai": 2880, "write_kv_cache": 128, "paged_attention": 128, "moe_route": 2048,
                   "moe_align": 2048, "grouped_gemm": 2048, "fused_experts": 2048, "layer_norm": 4096,
                   "fused_add_layer_norm": 4096, "gated_rms_norm": 8192,
                   "rotary_embedding": 128, "rotary_write_kv_cache": 128}


@dataclasses.dataclass(frozen=True)
class Shape:
    op: str
    tokens: int
    width: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.width}"


def tunable_ops(names: str | Sequence[str] = "all") -> list[str]:
    """Ops that launch DSL kernels, by name (``all``: every one but aliases of another's kernels)."""
    from .ops.registry import all_ops

    found = {name: op for name, op in all_ops().items()
             if any(p.kernel is not None for p in op.providers) and op.example_inputs is not None}
    if names == "all":
        return sorted(n for n in found if n not in SAME_KERNELS_AS)
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in wanted if n not in found]
    if unknown:
        raise ValueError(f"unknown or kernel-less ops {unknown}; ops with kernels: {', '.join(sorted(found))}")
    return wanted


def model_shapes(op_names: Iterable[str], dtypes: Iterable[torch.dtype], tokens: Iterable[int], *,
                 headline_only: bool = False) -> list[Shape]:
    """Every width an op sees in the models of :mod:`.autotune.shapes` (or its headline one) x tokens."""
    from .autotune.shapes import widths

    tokens = list(tokens)
    return [Shape(name, t, w, dtype) for name in op_names for dtype in dtypes
            for w in ([HEADLINE_WIDTHS[name]] if headline_only else widths(name)) for t in tokens]


def compile_shape(shape: Shape, target_names: Sequence[str], *,
                  platform: str | None = None) -> list[compile_targets.CompileRecord]:
    """Compile what the op launches on ``shape`` (meta tensors) for each target, with its config."""
    from .ops.registry import get_op

    op = get_op(shape.op)
    args = op.example_inputs(shape.tokens, shape.width, shape.dtype, "meta")
    with compile_targets.compile_for(target_names, run_reference=False, platform=platform) as log:
        op(*args)
    return log.records


@dataclasses.dataclass(frozen=True)
class ShippedEntry:
    """One entry of a shipped config file, with the model shape that reaches its key."""

    path: Path
    folder: str  # a platform (tuned configs) or a compile target (compile-chosen defaults)
    targets: tuple[str, ...]  # what to compile it for
    shape: Shape | None  # None: no model shape gives this key
    key: dict[str, Any]
    config: dict[str, Any]
    builtin: bool  # the config equals the kernel's built-in default for the key


def shipped_entries(root: Path | None = None) -> list[ShippedEntry]:
    """Every entry of every shipped config file, matched to the model shape whose key it is.

    Tuned files (``<platform>/``) are compiled for the platform's target (every target when the
    platform is none of them); compile-chosen defaults (``<target>/``) for their own target.
    """
    from .autotune import cache
    from .autotune.keys import key_string, make_key
    from .autotune.platform import PLATFORM_TARGETS
    from .autotune.shapes import widths
    from .ops.registry import get_op

    root = cache.SHIPPED_ROOT if root is None else root
    kernels_of = {}
    for name in tunable_ops():
        op = get_op(name)
        provider = next(p for p in op.providers if p.kernel is not None)
        kernels_of.setdefault(provider.kernel.name, []).append((name, provider))
    found: list[ShippedEntry] = []
    for path in sorted(root.glob("*/*.json")):
        folder, kernel_name = path.parent.name, path.stem
        if folder in compile_targets.TARGETS:
            target_names: tuple[str, ...] = (folder,)
        elif folder in PLATFORM_TARGETS:
            target_names = (PLATFORM_TARGETS[folder],)
        else:
            target_names = compile_targets.ALL_TARGETS
        users = kernels_of.get(kernel_name, [])
        if not users:
            raise ValueError(f"{path}: no op launches a kernel named {kernel_name!r}")
        spec = users[0][1].kernel
        parsed = cache.parse_file(path, spec, folder)  # raises on stale or corrupt files
        keyed: dict[str, Shape] = {}
        wanted = set(parsed.entries)
        dtypes = {str(key.get("dtype")) for key, _ in parsed.entries.values()}
        with compile_targets.compile_for(target_names[:1], run_reference=False):  # providers take meta calls
            for name, provider in users:
                op = get_op(name)
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    if "None" not in dtypes and str(dtype).removeprefix("torch.") not in dtypes:
                        continue
                    for width in widths(name):
                        for tokens in (1 << i for i in range(15)):
                            if wanted <= set(keyed):
                                break
                            call_key = op.key(*op.example_inputs(tokens, width, dtype, "meta"))
                            if provider.why_not(call_key) is None:
                                tuning_key = make_key(provider.tuning_key(call_key), call_key.tokens)
                                keyed.setdefault(key_string(tuning_key), Shape(name, tokens, width, dtype))
        for text, (key, config) in parsed.entries.items():
            found.append(ShippedEntry(path, folder, target_names, keyed.get(text), key, config,
                                      config == spec.default_config(key)))
    return found


def compile_entry(entry: ShippedEntry, target: str) -> list[compile_targets.CompileRecord]:
    """Compile a shipped entry's config on its model shape for ``target``."""
    from .ops import use_config
    from .ops.registry import get_op

    assert entry.shape is not None
    op = get_op(entry.shape.op)
    args = op.example_inputs(entry.shape.tokens, entry.shape.width, entry.shape.dtype, "meta")
    with compile_targets.compile_for([target], run_reference=False) as log, use_config(op, entry.config):
        op(*args)
    return log.records


def walk(shapes: Sequence[Shape], target_names: Sequence[str], *, platform: str | None = None,
         progress: bool = True) -> Any:
    """Every shape compiled for every target: a long-format frame, one row per record."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    bar = _progress(len(shapes), progress)
    for shape in shapes:
        bar.set_postfix_str(f"{shape.op} {shape.label}", refresh=False)
        base = {"op": shape.op, "tokens": shape.tokens, "width": shape.width,
                "dtype": str(shape.dtype).removeprefix("torch.")}
        try:
            records = compile_shape(shape, target_names, platform=platform)
        except Exception as err:  # the op itself failed before any kernel compiled
            rows.append({**base, "target": ",".join(target_names), "ok": False,
                         "error": f"{type(err).__name__}: {err}",
                         "problems": f"op {shape.op} on {shape.label}: {type(err).__name__}: {err}"})
            bar.update(1)
            continue
        for record in records:
            row = {**base, **record.row(), "op": shape.op}
            row["launched_by"] = record.op
            row["problems"] = " | ".join(record.problems())
            rows.append(row)
        bar.update(1)
    bar.close()
    columns = ["op", "tokens", "width", "dtype", "kernel", "target", "ok", "registers", "spill_bytes",
               "loop_spill_bytes", "shared", "shared_limit", "load_bits", "store_bits", "matrix", "vector_rule",
               "num_warps", "num_stages", "grid", "seconds", "config", "signature", "source", "launched_by",
               "memory_bound", "error", "problems"]
    frame = pd.DataFrame(rows)
    return frame.reindex(columns=[c for c in columns if c in frame.columns] +
                         [c for c in frame.columns if c not in columns])


def summary_markdown(frame: Any, *, command: str, seconds: float) -> str:
    """The report: per target, per kernel, and the problems found."""
    import triton

    frame = frame.copy()
    frame["has_problem"] = frame["problems"].fillna("").astype(bool)
    lines = [
        "# Compile report: every kernel for every target",
        "",
        f"`{command}` on a machine without a GPU ({datetime.date.today().isoformat()}, triton {triton.__version__}, "
        f"helion {_version('helion')}, torch {torch.__version__}; {seconds:.0f} s). Every op on the shapes of real "
        "models, launched with the configs a GPU of that target would get, compiled by Triton's own backends from "
        "the JIT-specialised launch arguments. Rules (`hw_agnostic/kernels/targets.py`): compiles, no register "
        "spills (on NVIDIA targets a few bytes are allowed when the SASS shows every spill access outside the "
        "loops: `loop_spill_bytes` 0), shared memory within the target's limit, 128-bit loads in memory-bound "
        "kernels on aligned contiguous rows. `report.csv` has every row.",
        "",
        "## Per target",
        "",
    ]
    per_target = []
    for target, group in frame.groupby("target", sort=False):
        gemm = group[group["matrix"].notna() & (group["matrix"] != "none")]
        per_target.append({
            "target": target,
            "compiles": len(group),
            "failed": int((~group["ok"].astype(bool)).sum()),
            "spilling": int(group["problems"].fillna("").str.contains("spills").sum()),
            "spilling outside loops": int(((group["spill_bytes"].fillna(0) > 0)
                                           & ~group["problems"].fillna("").str.contains("spills")).sum()),
            "over shared limit": int((group["shared"].fillna(0) > group["shared_limit"].fillna(float("inf"))).sum()),
            "without 128-bit loads": int(group["problems"].fillna("").str.contains("128-bit").sum()),
            "max registers": int(group["registers"].max()) if group["registers"].notna().any() else None,
            "matrix instructions": ", ".join(f"{k} {v}" for k, v in gemm["matrix"].value_counts().items()) or "none",
        })
    lines += [_table(per_target), ""]
    lines += ["## Per kernel", "",
              "Over all shapes: registers and shared memory are the largest seen (limit in brackets); load bits the "
              "narrowest widest load among launches whose rows the JIT can prove 16-byte aligned (memory-bound "
              "kernels), store bits the narrowest widest store; matrix the instruction classes seen.", ""]
    kernels = []
    for (kernel, target), group in frame[frame["kernel"].notna()].groupby(["kernel", "target"], sort=False):
        required = group[group["vector_rule"] == "required"]
        kernels.append({
            "kernel": kernel,
            "target": target,
            "ops": ", ".join(sorted(group["op"].unique())),
            "shapes": len(group),
            "ok": f"{int(group['ok'].astype(bool).sum())}/{len(group)}",
            "registers": _max(group["registers"]),
            "spills (B)": _max(group["spill_bytes"]),
            "shared (B)": f"{_max(group['shared'])} [{int(group['shared_limit'].iloc[0])}]",
            "load bits (aligned rows)": _min(required["load_bits"]) if len(required) else "-",
            "store bits": _min(group["store_bits"]),
            "matrix": ", ".join(sorted(group["matrix"].dropna().unique())),
            "problems": int(group["has_problem"].sum()),
        })
    lines += [_table(sorted(kernels, key=lambda r: (r["kernel"], _target_order(r["target"])))), ""]
    problems = frame[frame["has_problem"]]
    lines += ["## Problems", ""]
    if problems.empty:
        lines += ["None: every launch compiled for every target and passed every rule.", ""]
    else:
        distinct = problems.assign(problem=problems["problems"].str.split(" \\| ")).explode("problem")
        grouped = distinct.groupby("problem", sort=False)["tokens"].count().sort_values(ascending=False)
        lines += [f"{len(problems)} of {len(frame)} compiles break a rule; each distinct message once "
                  "(with how many shapes hit it):", ""]
        for message, count in list(grouped.items())[:80]:
            lines.append(f"- ({count}) {message}")
        if len(grouped) > 80:
            lines.append(f"- ... {len(grouped) - 80} more in report.csv")
        lines.append("")
    return "\n".join(lines)


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "?"


def _target_order(name: str) -> int:
    return list(compile_targets.ALL_TARGETS).index(name) if name in compile_targets.ALL_TARGETS else 99


def _max(column: Any) -> Any:
    return int(column.max()) if column.notna().any() else "-"


def _min(column: Any) -> Any:
    return int(column.min()) if column.notna().any() else "-"


def _table(rows: list[dict[str, Any]]) -> str:
    import pandas as pd

    return pd.DataFrame(rows).to_markdown(index=False)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="compile", unit="shape")


def compile_report_main(argv: list[str] | None = None) -> int:
    from .autotune.shapes import TOKEN_COUNTS

    parser = argparse.ArgumentParser(prog="python -m hw_agnostic compile-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(compile_targets.ALL_TARGETS),
                        help="comma-separated targets, or all (default: %(default)s)")
    parser.add_argument("--ops", default="all", help="comma-separated op names, or all")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated dtypes (default: %(default)s)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)), help="comma-separated token counts")
    parser.add_argument("--platform", default=None,
                        help="launch with this platform's tuned configs (e.g. nvidia_h100) instead of the defaults")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for report.csv and report.md")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any launch breaks a rule")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    try:
        target_names = [t.name for t in compile_targets.parse_targets(args.targets)]
        op_names = tunable_ops(args.ops)
        dtypes = [_dtype(name) for name in args.dtypes.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from .kernels.interpret import interpreter_mode

    if interpreter_mode() is not None:
        print(f"error: {compile_targets.INTERPRETER_CONFLICT}", file=sys.stderr)
        return 2
    os.environ.setdefault("HW_AGNOSTIC_COMPILE_REFERENCE", "0")
    import pandas as pd

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    frames = []
    for name in op_names:  # the CSV grows op by op, so a long walk keeps what it did
        frames.append(walk(model_shapes([name], dtypes, tokens), target_names, platform=args.platform))
        frame = pd.concat(frames, ignore_index=True)
        frame.to_csv(args.out / "report.csv", index=False)
    seconds = time.perf_counter() - start
    command = "python -m hw_agnostic compile-report " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "report.md").write_text(summary_markdown(frame, command=command.strip(), seconds=seconds))
    broken = int(frame["problems"].fillna("").astype(bool).sum())
    print(f"{len(frame)} compiles for {', '.join(target_names)} in {seconds:.0f} s; {broken} break a rule; "
          f"wrote {args.out / 'report.csv'} and {args.out / 'report.md'}")
    return 1 if args.strict and broken else 0


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.strip(), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"--dtypes: {name!r} is not a torch dtype")
    return value


if __name__ == "__main__":
    sys.exit(compile_report_main())
