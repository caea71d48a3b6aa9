"""The command line: one entry point, subcommands, one-line user errors, and the doctor's report."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from hw_agnostic import __version__, cli

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hw_agnostic", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_help_lists_every_command_and_exits_0():
    result = _run("--help")
    assert result.returncode == 0
    for name in ("demo", "bench", "autotune", "doctor", "compile-report"):
        assert f"\n  {name} " in result.stdout


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"hw_agnostic {__version__}"


def test_no_command_prints_usage_and_exits_2():
    result = _run()
    assert result.returncode == 2 and "COMMAND" in result.stderr


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_unknown_command_is_one_line_naming_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["benchmark"])
    assert exit_.value.code == 2
    assert "unknown command 'benchmark' (commands: demo, bench, autotune, doctor, compile-report)" in _one_error_line(capsys)


def test_unknown_family_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--family", "gpt5"])
    assert exit_.value.code == 2
    assert "invalid choice: 'gpt5'" in (err := _one_error_line(capsys)) and "'llama'" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_line(capsys):
    assert cli.main(["demo", "--device", "cuda"]) == 2
    assert "this machine has no CUDA device" in _one_error_line(capsys)


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert cli.main(["demo", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "no such directory" in _one_error_line(capsys)
    assert cli.main(["demo", "--checkpoint", str(tmp_path)]) == 2
    assert "it has no config.json" in _one_error_line(capsys)


def test_bench_rejects_unknown_suites_and_devices_with_the_known_names(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--suites", "ops,kernels"])
    assert exit_.value.code == 2
    assert "unknown suite 'kernels'; known: ops, model, moe, attention" in _one_error_line(capsys)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--device", "tpu9"])
    err = _one_error_line(capsys)
    assert "unknown device 'tpu9'; known: auto, cpu, interpreter" in err and "h100" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_autotune_without_a_gpu_is_one_line(capsys):
    assert cli.main(["autotune", "--device", "cpu"]) == 2
    assert "autotuning needs a GPU" in _one_error_line(capsys)
    assert cli.main(["autotune", "--device", "h100"]) == 2
    assert "means platform 'nvidia_h100'" in _one_error_line(capsys)


def test_a_command_is_one_registration(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    cli.register("echo-args", "tests.test_cli:_echo", "print the arguments")
    assert cli.main(["echo-args", "a", "--b"]) == 7
    assert capsys.readouterr().out == "['a', '--b']\n"
    with pytest.raises(ValueError, match="already registered"):
        cli.register("echo-args", "tests.test_cli:_echo", "again")


def _echo(argv: list[str]) -> int:
    print(argv)
    return 7


def test_the_installed_command_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hw-agnostic": "hw_agnostic.cli:main"}
    executable = Path(sys.executable).parent / "hw-agnostic"
    installed_from_here = (ROOT / "hw_agnostic").samefile(Path(cli.__file__).parent) and executable.exists()
    if installed_from_here:  # make test installs this checkout, and with it the command
        result = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == f"hw_agnostic {__version__}"


# --------------------------------------------------------------------------------------------
# doctor


def test_doctor_reports_what_a_bug_report_needs(capsys, monkeypatch):
    monkeypatch.setenv("HW_AGNOSTIC_PROVIDER", "rms_norm=reference")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for section in ("== package", "== devices", "== ops", "== tuned configs", "== environment"):
        assert section in out
    assert f"torch            {torch.__version__}" in out and "helion " in out and "transformers " in out
    assert "platform         " in out and "interpreter      " in out
    for op in ("rms_norm", "silu_and_mul", "paged_attention", "fused_experts"):
        assert f"\n{op}" in out
    assert "  cpu: runs " in out and "<lambda>" not in out  # each CPU path says what it runs
    assert "[forced: reference (HW_AGNOSTIC_PROVIDER for rms_norm)]" in out
    assert "HW_AGNOSTIC_PROVIDER           rms_norm=reference" in out and "HW_AGNOSTIC_CACHE_DIR" in out
    assert "hf_secret" not in out  # never print credentials
    if not torch.cuda.is_available():
        from hw_agnostic.kernels.interpret import interpreter_mode

        if interpreter_mode() is None:
            assert "helion: device 'cpu' is not supported" in out


def test_doctor_json_lists_providers_and_config_files(tmp_path, monkeypatch, capsys):
    from hw_agnostic.autotune import cache
    from hw_agnostic.kernels import rms_norm as kernels

    monkeypatch.setenv(cache.USER_ROOT_ENV, str(tmp_path))
    cache.save_entry(kernels.RMS_NORM, "nvidia_h100", {"dtype": "bfloat16", "hidden": 64, "tokens": 1},
                     {"block_sizes": [1]}, time_us=1.0)
    (tmp_path / "nvidia_h100" / "silu_and_mul.json").write_text("{not json")
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    providers = report["ops"]["rms_norm"]["cpu"]["providers"]
    assert set(providers) == {"helion", "reference"} and providers["reference"] == "can run"
    files = report["tuned_configs"]["user"]["files"]
    assert files["nvidia_h100/rms_norm.json"] == "1 tuned keys"
    assert files["nvidia_h100/silu_and_mul.json"] == "not a kernel this version has"
    assert report["devices"]["cpu"]["cores"] >= 1
