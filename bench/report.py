"""Bench results: a long-format CSV, a markdown summary and one PNG per op."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

BASELINES = ("hf_eager", "hf_compile", "hf_grouped_mm", "liger", "torch_sdpa", "flash_attn", "flashinfer")


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Speed-up of hw_agnostic over each baseline in the same (op, shape, dtype) group."""
    frame = frame.copy()
    frame["bw_fraction"] = frame["gbps"] / frame["copy_gbps"]
    if "tflops" in frame:
        frame["matmul_fraction"] = frame["tflops"] / frame["matmul_tflops"]
    ours = frame[frame["provider"] == "hw_agnostic"].set_index(["suite", "op", "shape", "dtype"])["time_us"]
    for baseline in BASELINES:
        theirs = frame[frame["provider"] == baseline].set_index(["suite", "op", "shape", "dtype"])["time_us"]
        speedup = (theirs / ours).rename(f"speedup_vs_{baseline}")
        frame = frame.merge(speedup, left_on=["suite", "op", "shape", "dtype"], right_index=True, how="left")
    return frame


def markdown(frame: pd.DataFrame, header: str) -> str:
    lines = [header, ""]
    for (suite, op), group in frame.groupby(["suite", "op"], sort=False):
        ours = group[group["provider"] == "hw_agnostic"]
        lines += [f"### {op}", ""]
        wide = group.pivot_table(index=["tokens", "width", "dtype"], columns="provider", values="time_us")
        columns = [c for c in ("hw_agnostic", *BASELINES) if c in wide.columns]
        table = wide[columns].rename(columns=lambda c: f"{c} µs")
        info = ours.set_index(["tokens", "width", "dtype"])
        table["ran"] = info["ran"]
        if info["gbps"].notna().any():
            table["GB/s"] = info["gbps"].round(1)
            table["of copy BW"] = (info["bw_fraction"] * 100).round(1).astype(str) + "%"
        if "tflops" in info and info["tflops"].notna().any():
            table["TFLOP/s"] = info["tflops"].round(3)
            table["of matmul rate"] = (info["matmul_fraction"] * 100).round(1).astype(str) + "%"
        for baseline in BASELINES:
            column = f"speedup_vs_{baseline}"
            if column in info and info[column].notna().any():
                table[f"× vs {baseline}"] = info[column].round(2)
        table = table.reset_index().sort_values(["dtype", "width", "tokens"])
        lines += [table.to_markdown(index=False, floatfmt=".1f"), ""]
    return "\n".join(lines)


def plot(frame: pd.DataFrame, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op, group in frame.groupby("op", sort=False):
        dtypes = sorted(group["dtype"].unique())
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.2), squeeze=False)
        providers = sorted(group["provider"].unique())
        colors = {p: f"C{i}" for i, p in enumerate(providers)}
        markers = dict(zip(sorted(group["width"].unique()), "osD^v<>p*h"))
        for ax, dtype in zip(axes[0], dtypes):
            subset = group[group["dtype"] == dtype]
            for (provider, width), line in subset.groupby(["provider", "width"]):
                line = line.sort_values("tokens")
                style = "-" if provider == "hw_agnostic" else "--"
                ax.plot(line["tokens"], line["gbps"], style, color=colors[provider], marker=markers[width],
                        markersize=4, label=f"{provider} w={width}")
            ax.axhline(subset["copy_gbps"].iloc[0], color="grey", linestyle=":", label="copy bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel("achieved GB/s")
            ax.set_title(f"{op} ({dtype})")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = directory / f"{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
