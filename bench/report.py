"""Bench results: ratios with their uncertainty, a markdown report and one PNG per op.

A ratio is a baseline's median time over ours (above 1: we are faster). Its interval divides the
baseline's quartiles by ours the other way round (``q25 / q75`` to ``q75 / q25``); when that
interval contains 1.0 the run cannot tell faster from slower, and the report marks the ratio
``~``. A row whose own spread (interquartile range over median) exceeds :data:`NOISY_SPREAD`
is marked ``!``. Both are listed in the summary at the top of ``results.md``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from .timing import MatmulCeiling

BASELINES = ("hf_eager", "hf_compile", "hf_graphs", "hf_grouped_mm", "liger", "torch_sdpa", "flash_attn", "flashinfer",
             "hw_agnostic_apart", "copy")
NOISY_SPREAD = 0.20
GROUP = ["suite", "op", "shape", "dtype"]
#: ops whose 4096-token rows must reach this fraction of a same-size copy (the issue's bar)
COPY_TARGET = 0.5


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series(math.nan, index=frame.index)


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Per row of ours: speed-up over each baseline of its group, with the interval and a noise flag."""
    frame = frame.copy()
    for name in ("gbps", "tflops", "q25_us", "q75_us", "spread", "copy_gbps", "matmul_tflops"):
        frame[name] = pd.to_numeric(_column(frame, name), errors="coerce")
    frame["bw_fraction"] = frame["gbps"] / frame["copy_gbps"]
    frame["matmul_fraction"] = frame["tflops"] / frame["matmul_tflops"]
    index = frame.set_index(GROUP)
    ours = index[index["provider"] == "hw_agnostic"]
    for baseline in BASELINES:
        theirs = index[index["provider"] == baseline]
        if theirs.empty:
            continue
        ratio = pd.DataFrame({
            f"speedup_vs_{baseline}": theirs["time_us"] / ours["time_us"],
            f"speedup_vs_{baseline}_low": theirs["q25_us"] / ours["q75_us"],
            f"speedup_vs_{baseline}_high": theirs["q75_us"] / ours["q25_us"],
        }).dropna(how="all")
        frame = frame.merge(ratio, left_on=GROUP, right_index=True, how="left")
        mine = frame["provider"] == "hw_agnostic"
        for column in ratio.columns:
            frame.loc[~mine, column] = math.nan
    spread = frame.groupby(GROUP)["spread"].transform("max")
    frame["group_spread"] = spread
    frame["noisy"] = spread > NOISY_SPREAD
    return frame


def _baselines(frame: pd.DataFrame) -> list[str]:
    return [b for b in BASELINES if f"speedup_vs_{b}" in frame and frame[f"speedup_vs_{b}"].notna().any()]


def _within_noise(row: pd.Series, baseline: str) -> bool:
    low, high = row.get(f"speedup_vs_{baseline}_low"), row.get(f"speedup_vs_{baseline}_high")
    return bool(pd.notna(low) and pd.notna(high) and low <= 1.0 <= high)


def _ratio_text(row: pd.Series, baseline: str) -> str:
    value = row.get(f"speedup_vs_{baseline}")
    if pd.isna(value):
        return ""
    if baseline == "copy":
        return f"{value * 100:.0f}%"
    return f"{value:.2f}" + (" ~" if _within_noise(row, baseline) else "")


def _label(row: pd.Series) -> str:
    shape = "" if str(row["op"]).endswith(str(row["shape"])) else f" {row['shape']}"  # model rows name it
    return f"{row['op']}{shape} {row['dtype']}"


def _ceiling(meta: dict[str, Any]) -> MatmulCeiling:
    """The run's matmul ceiling; a run from before the fp32 rate was measured has the bf16 one only."""
    return MatmulCeiling(meta.get("matmul_tflops_bf16", meta["matmul_tflops"]), meta.get("matmul_tflops_fp32"))


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB" if value >= 2**20 else f"{value / 2**10:.0f} KiB"


def cache_note(row: pd.Series, cache_bytes: int | None) -> str:
    """Why a row moves more than the DRAM copy figure, where it does."""
    if not (pd.notna(row.get("bw_fraction")) and row["bw_fraction"] > 1.0):
        return ""
    moved = float(row.get("bytes") or 0)
    if cache_bytes and moved <= 2 * cache_bytes:
        return f"above DRAM copy: its {_mib(moved)} fit(s) the {_mib(cache_bytes)} cache"
    return f"above DRAM copy ({_mib(moved)} moved)"


def summary(frame: pd.DataFrame, meta: dict[str, Any]) -> list[str]:
    ours = frame[frame["provider"] == "hw_agnostic"]
    lines = ["## Summary", ""]
    lines.append(f"{len(ours)} rows of hw_agnostic in {ours['op'].nunique()} ops.")
    for baseline in (b for b in _baselines(frame) if b != "copy"):
        column = f"speedup_vs_{baseline}"
        compared = ours[ours[column].notna()]
        slower = compared[compared[column] < 1.0]
        lines.append(f"- vs **{baseline}**: at least as fast in {len(compared) - len(slower)} of {len(compared)} rows"
                     + (f"; slower in {len(slower)}:" if len(slower) else "."))
        for _, row in slower.sort_values(column).iterrows():
            noise = " (within noise)" if _within_noise(row, baseline) else ""
            lines.append(f"  - {_label(row)}: {row[column]:.2f}× (IQR {row[column + '_low']:.2f}–"
                         f"{row[column + '_high']:.2f}){noise}")
    if "speedup_vs_copy" in ours:
        big = ours[ours["speedup_vs_copy"].notna() & (ours["tokens"] >= 4096)]
        if len(big):
            short = big[big["speedup_vs_copy"] < COPY_TARGET]
            lines.append(f"- 4096-token rows reach {big['speedup_vs_copy'].min() * 100:.0f}–"
                         f"{big['speedup_vs_copy'].max() * 100:.0f}% of a same-size copy "
                         f"({len(short)} below {COPY_TARGET * 100:.0f}%"
                         + (": " + ", ".join(_label(r) for _, r in short.iterrows()) if len(short) else "") + ").")
    noise = [(row, b) for _, row in ours.iterrows() for b in _baselines(frame) if b != "copy" and _within_noise(row, b)]
    lines.append(f"- {len(noise)} ratios are within noise (`~`: their interquartile interval contains 1.0)"
                 + ("." if not noise else ": " + ", ".join(f"{_label(r)} vs {b}" for r, b in noise[:40])
                    + (", ..." if len(noise) > 40 else "") + "."))
    noisy = ours[ours["noisy"]]
    lines.append(f"- {len(noisy)} rows are noisy (`!`: a provider's IQR above {NOISY_SPREAD * 100:.0f}% of its "
                 "median)" + ("." if noisy.empty else ": " + ", ".join(
                     f"{_label(r)} ({r['group_spread'] * 100:.0f}%)" for _, r in noisy.iterrows()) + "."))
    above = ours[ours["bw_fraction"] > 1.0]
    if len(above):
        cache = meta.get("largest_cache_bytes")
        lines.append(f"- {len(above)} rows move more than the DRAM copy figure: their data stays in the "
                     f"{_mib(cache) if cache else 'device'} cache between runs (the copy figure is measured at "
                     "512 MiB); `of same-size copy` compares them with a copy of their own size instead.")
    errors = frame[_column(frame, "error").map(lambda value: isinstance(value, str) and value != "")]
    if len(errors):
        lines.append(f"- {len(errors)} baseline rows could not run: "
                     + "; ".join(f"{_label(r)} {r['provider']}: {str(r['error'])[:120]}" for _, r in errors.iterrows()))
    return lines + [""]


def header(meta: dict[str, Any]) -> list[str]:
    if not meta:
        return ["# hw_agnostic bench", ""]
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
    cache = meta.get("largest_cache_bytes")
    lines = [f"# hw_agnostic bench: {meta.get('platform')}", "",
             f"`{meta.get('command')}` on {meta.get('device_name')} ({meta.get('cores')} cores, "
             f"{meta.get('torch_threads')} torch threads{', largest cache ' + _mib(cache) if cache else ''}); "
             f"{meta.get('started')} to {meta.get('finished')} ({meta.get('status')}, {meta.get('seconds')} s); "
             f"hw_agnostic {meta.get('hw_agnostic')} at {meta.get('commit') or 'an unknown commit'}; {versions}.", ""]
    if "copy_gbps" in meta:
        lines += [f"Same-run ceilings (512 MiB, far past the caches): copy into an existing buffer "
                  f"**{meta['copy_gbps']:.1f} GB/s**, `clone()` (a fresh output, page faults included) "
                  f"**{meta['clone_gbps']:.1f} GB/s**; {_ceiling(meta).describe()}.", ""]
    earlier, run = [], meta.get("merged_into")
    while run:  # each merge keeps the meta of the run it merged into, which may be a merge itself
        earlier.append(f"`{run.get('command')}`, {run.get('started')}")
        run = run.get("merged_into")
    if earlier:
        lines += ["Some rows were re-measured by this command and merged into earlier runs (newest first: "
                  f"{'; '.join(earlier)}); each row's `measured_at` in the CSV says which run it comes from.", ""]
    lines += ["Times are medians of `runs` calls (timed in batches, the candidates of a row interleaved), with "
              "min–max beside them; `first_call_s` in the CSV holds compile times. `× vs X` is X's median over "
              "ours (above 1: hw_agnostic is faster); `~` marks a ratio whose interquartile interval contains "
              "1.0, `!` a row with a provider whose IQR exceeds "
              f"{NOISY_SPREAD * 100:.0f}% of its median. `of same-size copy` is a copy moving the same bytes "
              "(a `clone()`, or for in-place ops a copy into an existing buffer) over ours; `of copy BW` divides "
              "GB/s by the DRAM copy figure.", ""]
    return lines


def markdown(frame: pd.DataFrame, meta: dict[str, Any]) -> str:
    lines = header(meta) + summary(frame, meta)
    cache = meta.get("largest_cache_bytes")
    for (suite, op), group in frame.groupby(["suite", "op"], sort=False):
        lines += [f"### {op}", ""]
        ours = group[group["provider"] == "hw_agnostic"]
        wide = group.pivot_table(index=["tokens", "width", "dtype"], columns="provider", values="time_us")
        columns = [c for c in ("hw_agnostic", *BASELINES) if c in wide.columns]
        table = wide[columns].rename(columns=lambda c: f"{c} µs")
        info = ours.set_index(["tokens", "width", "dtype"]).reindex(table.index)
        if "min_us" in info:
            table.insert(1, "min–max µs", [f"{a:.1f}–{b:.1f}" for a, b in zip(info["min_us"], info["max_us"])])
            table.insert(2, "runs", info["runs"])
        for baseline in _baselines(group):
            name = "of same-size copy" if baseline == "copy" else f"× vs {baseline}"
            table[name] = [_ratio_text(row, baseline) for _, row in info.iterrows()]
        if info["gbps"].notna().any():
            table["GB/s"] = info["gbps"].round(1)
            table["of copy BW"] = (info["bw_fraction"] * 100).round(1).astype(str) + "%"
        if info["tflops"].notna().any():
            table["TFLOP/s"] = info["tflops"].round(3)
            table["of matmul rate"] = (info["matmul_fraction"] * 100).round(1).astype(str) + "%"
        table["ran"] = info["ran"]
        notes = []
        for _, row in info.iterrows():
            parts = [f"! spread {row['group_spread'] * 100:.0f}%" if row.get("noisy") is True else "",
                     cache_note(row, cache)]
            notes.append("; ".join(p for p in parts if p))
        table["notes"] = notes
        table = table.reset_index().sort_values(["dtype", "width", "tokens"])
        lines += [table.to_markdown(index=False, floatfmt=".1f"), ""]
    return "\n".join(lines)


def _slug(op: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", op)


def plot(frame: pd.DataFrame, directory: Path, meta: dict[str, Any]) -> list[Path]:
    """One figure per op: a panel of ours' speed-up over each baseline, interquartile bars, legend outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    times = FuncFormatter(lambda value, _: f"{value:g}×")

    device = f"{meta.get('device_name', '')} ({meta.get('platform', '')})" if meta else ""
    paths = []
    for (suite, op), group in frame.groupby(["suite", "op"], sort=False):
        ours = group[group["provider"] == "hw_agnostic"]
        baselines = _baselines(group)
        if ours.empty or not baselines:
            continue
        by_tokens = ours["tokens"].nunique() > 1
        fig, axes = plt.subplots(1, len(baselines), figsize=(4.6 * len(baselines) + 1.8, 3.8), squeeze=False)
        series = list(ours.groupby(["width", "dtype"], sort=True))
        handles = {}
        for ax, baseline in zip(axes[0], baselines):
            column = f"speedup_vs_{baseline}"
            for i, ((width, dtype), line) in enumerate(series):
                line = line.sort_values("tokens")
                x = line["tokens"] if by_tokens else [i]
                y = line[column]
                errors = [(y - line[f"{column}_low"]).clip(lower=0), (line[f"{column}_high"] - y).clip(lower=0)]
                handle = ax.errorbar(x, y, yerr=errors, marker="os^Dv<>p*h"[i % 10], markersize=4, capsize=2,
                                     linestyle="-" if by_tokens else "none", color=f"C{i % 10}")
                handles[f"width {width}, {dtype}"] = handle
            ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
            if baseline == "copy":
                ax.axhline(COPY_TARGET, color="red", linestyle=":", linewidth=1)
                ax.set_ylabel("fraction of a same-size copy")
                ax.set_title("vs a same-size copy", fontsize=9)
            else:
                ax.set_ylabel(f"speed-up over {baseline}")
                ax.set_title(f"vs {baseline}", fontsize=9)
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(times)
                ax.yaxis.set_minor_formatter(times)
                ax.tick_params(axis="y", which="minor", labelsize=7)
            if by_tokens:
                ax.set_xscale("log", base=2)
                ax.set_xlabel("tokens")
            else:
                ax.set_xticks(range(len(series)), [f"{w}" for (w, _), _ in series])
                ax.set_xlabel("width")
            ax.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"{op}: hw_agnostic vs baselines on {device}", fontsize=10)
        fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                   title="bars: interquartile", title_fontsize=7)
        fig.tight_layout()
        path = directory / f"{_slug(op)}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
