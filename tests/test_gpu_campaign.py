"""The GPU campaign's dry run: every phase of ``make gpu-campaign`` on the CPU, tiny and interpreted.

So the script is known to work the first time a GPU machine runs it: the same phases, the same
commands (pytest, the tuner, ``python -m bench``), the same packing into at most 8 files of
``$OUT``; only the device, the subsets and the budgets differ. ``make test-gpu-campaign`` runs it
(a minute and a half on 2 cores, five fresh processes importing torch and Helion); ``make test``
leaves it out: run it before a GPU run and when the script or what it calls changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.campaign]


def test_the_dry_run_runs_every_phase_and_packs_the_results(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET",
                                                            "HW_AGNOSTIC_COMPILE_TARGETS")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "bench/gpu_campaign.py", "--dry-run", "--out", str(out), "--budget", "1500"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = (out / "summary.md").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + summary
    for phase in ("install", "doctor", "tests", "compile-check", "autotune", "bench"):
        assert f"| {phase} | ok |" in summary, summary
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.md", "campaign.tar.gz", "bench_results.csv", "tuned_configs.tar.gz"} <= set(
        files), files
    with tarfile.open(out / "tuned_configs.tar.gz") as archive:
        assert "triton_interpreter/rms_norm.json" in archive.getnames()
    with tarfile.open(out / "campaign.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"campaign.log", "tests.log", "tests.xml", "autotune.log", "bench/results.csv", "compile_check.json"} <= names
