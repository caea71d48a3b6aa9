"""The tuner: checks candidates before timing them, saves as it goes, and the runtime uses it."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.autotune import cache
from hw_agnostic.autotune.__main__ import main as autotune_main
from hw_agnostic.autotune.platform import DeviceMismatch, resolve_device
from hw_agnostic.autotune.tuner import tune
from hw_agnostic.kernels.interpret import interpreter_mode
from tests.test_registry import SCALE_KERNEL, SCALE_OP


def _fake_timer(fn):
    fn()
    return 1.0


@contextlib.contextmanager
def _replaced(frozen, name, value):
    """Swap a field of a frozen dataclass (the test op's provider or kernel) for one test."""
    original = getattr(frozen, name)
    object.__setattr__(frozen, name, value)
    try:
        yield
    finally:
        object.__setattr__(frozen, name, original)


def test_wrong_candidates_are_rejected_before_timing(tmp_path):
    """A config whose output is wrong never wins, however fast it would be."""
    current: dict = {}
    timed: list[dict] = []

    def configs(key):
        for config in ({"block": 1}, {"block": 2}):
            current.clear()
            current.update(config)
            yield config

    def build(key, config, args):
        return lambda x: x * (3 if config["block"] == 1 else 2)  # block=1 computes garbage

    def timer(fn):
        fn()
        timed.append(dict(current))
        return 0.5 if current["block"] == 1 else 2.0  # the wrong one would be "faster"

    with _replaced(SCALE_OP.providers[0], "build", build), _replaced(SCALE_KERNEL, "candidate_configs", configs):
        results = tune(SCALE_OP, [(4, 8), (300, 8)], dtype=torch.float32, device="cpu", root=tmp_path,
                       timer=timer, progress=False)
    assert [r.status for r in results] == ["tuned", "tuned"]
    assert all(r.config == {"block": 2} for r in results)
    assert all(list(r.rejected) == ['{"block":1}'] for r in results)
    assert timed == [{"block": 2}, {"block": 2}]
    document = json.loads((tmp_path / "cpu" / "test_scale.json").read_text())
    assert [e["key"]["tokens"] for e in document["entries"]] == [4, 512]
    assert document["default"] == {"config": {"block": 2}}


def test_tuning_resumes_and_keeps_existing_keys(tmp_path):
    first = tune(SCALE_OP, [(4, 8)], dtype=torch.float32, device="cpu", root=tmp_path, timer=_fake_timer,
                 progress=False)
    again = tune(SCALE_OP, [(4, 8), (16, 8)], dtype=torch.float32, device="cpu", root=tmp_path,
                 timer=_fake_timer, progress=False)
    assert [r.status for r in first] == ["tuned"]
    assert [r.status for r in again] == ["kept", "tuned"]


@pytest.mark.dsl
@pytest.mark.skipif(interpreter_mode() != "triton", reason="configs only matter under the Triton interpreter")
def test_tuning_a_real_kernel_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.USER_ROOT_ENV, str(tmp_path))
    op = ops.get_op("rms_norm")
    results = tune(op, [(3, 40)], dtype=torch.bfloat16, device="cpu", budget_s=5, timer=_fake_timer,
                   progress=False)
    assert results[0].status == "tuned" and results[0].tried >= 1
    x, weight, eps, numerics = op.example_inputs(3, 40, torch.bfloat16, "cpu")
    choice = op.plan(x, weight, eps, numerics).config
    assert (choice.source, choice.match, choice.config) == ("user", "exact", results[0].config)


def test_device_names_that_contradict_the_machine_are_errors():
    if torch.cuda.is_available():
        pytest.skip("checks a CPU-only machine")
    assert resolve_device("auto")[1] == "cpu"
    assert resolve_device("cpu")[1] == "cpu"
    with pytest.raises(DeviceMismatch, match="DEVICE=h100 means platform 'nvidia_h100', but this machine has 'cpu'"):
        resolve_device("h100")


def test_autotune_cli_refuses_a_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks a CPU-only machine")
    assert autotune_main(["--device", "cpu", "--ops", "rms_norm"]) == 2
    assert "autotuning needs a GPU" in capsys.readouterr().err
    assert autotune_main(["--device", "h200"]) == 2
