"""``python -m hw_agnostic demo`` runs offline and checks itself."""

from __future__ import annotations

import subprocess
import sys

from hw_agnostic.demo import main


def test_demo_generates_the_same_tokens_as_hf(capsys):
    assert main(["--family", "qwen3", "--new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical: yes" in out and "replaced" in out


def test_demo_loads_a_local_checkpoint(tmp_path, capsys):
    from tests.backend.models import build

    build("gemma2").save_pretrained(tmp_path)
    assert main(["--checkpoint", str(tmp_path), "--new-tokens", "8"]) == 0
    assert "built at construction" in capsys.readouterr().out


def test_module_entry_point_lists_commands():
    result = subprocess.run([sys.executable, "-m", "hw_agnostic"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "demo" in result.stderr
