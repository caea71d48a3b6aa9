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
    assert "default" not in document  # no file-wide config: untuned keys take the key-aware defaults


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
    from hw_agnostic import cli

    assert cli.main(["autotune", "--device", "cpu", "--ops", "rms_norm"]) == 2
    assert "autotuning needs a GPU" in capsys.readouterr().err
    assert cli.main(["autotune", "--device", "h200"]) == 2
    with pytest.raises(SystemExit):
        autotune_main(["--ops", "rms_nrom"])
    assert "--ops: unknown or untunable 'rms_nrom'; tunable: " in capsys.readouterr().err


def test_the_summary_separates_keys_tuned_from_keys_the_budget_left_on_the_default(tmp_path, monkeypatch):
    """Each timed candidate costs one second of a fake clock; the budget covers the first key only."""
    from hw_agnostic.autotune import tuner

    clock = [0.0]
    monkeypatch.setattr(tuner.time, "monotonic", lambda: clock[0])

    def timer(fn):
        fn()
        clock[0] += 1.0
        return 1.0

    results = tune(SCALE_OP, [(4, 8), (16, 8), (64, 8)], dtype=torch.float32, device="cpu", root=tmp_path,
                   timer=timer, budget_s=2.5, progress=False)
    # key 1: both candidates (t = 2); key 2: one candidate, then the deadline (t = 3); key 3: none
    assert [(r.status, r.tried, r.candidates) for r in results] == [("tuned", 2, 2), ("partial", 1, 2),
                                                                      ("out-of-budget", 0, 2)]
    assert results[0].path == tmp_path / "cpu" / "test_scale.json" and results[2].path is None
    keys = sorted(e["key"]["tokens"] for e in json.loads(results[0].path.read_text())["entries"])
    assert keys == [4, 16]  # the key left on the default is not written
    assert tuner.summary(results) == ("3 keys: tuned 1, partially tuned (budget ran out during the key) 1, "
                                      "left on the default (budget spent) 1")


def test_saving_leaves_no_lock_files(tmp_path):
    tune(SCALE_OP, [(4, 8), (16, 8)], dtype=torch.float32, device="cpu", root=tmp_path, timer=_fake_timer,
         progress=False)
    assert sorted(p.name for p in (tmp_path / "cpu").iterdir()) == ["test_scale.json"]


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Writers serialise on the lock file even though each removes it when done."""
    import threading

    def write(tokens):
        cache.save_entry(SCALE_KERNEL, "cpu", {"width": 8, "tokens": tokens}, {"block": 1}, time_us=1.0,
                         root=tmp_path)

    threads = [threading.Thread(target=write, args=(1 << i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    document = json.loads((tmp_path / "cpu" / "test_scale.json").read_text())
    assert sorted(e["key"]["tokens"] for e in document["entries"]) == [1 << i for i in range(8)]
    assert not list((tmp_path / "cpu").glob("*.lock"))


@pytest.mark.dsl
@pytest.mark.skipif(interpreter_mode() != "triton", reason="needs TRITON_INTERPRET=1 (the CPU dry run tunes under the Triton interpreter)")
def test_the_cpu_dry_run_prints_what_it_wrote_and_leaves_global_logging_alone(tmp_path, capsys):
    import logging

    from hw_agnostic import cli

    root_handlers, root_level = list(logging.getLogger().handlers), logging.getLogger().level
    assert cli.main(["autotune", "--device", "interpreter", "--ops", "rms_norm", "--tokens", "3", "--dtypes",
                     "bfloat16", "--budget", "5", "--out", str(tmp_path), "--no-progress", "--log-level",
                     "warning"]) == 0
    assert logging.getLogger().handlers == root_handlers and logging.getLogger().level == root_level
    out = capsys.readouterr().out
    assert "rms_norm bfloat16 on triton_interpreter: " in out
    written = tmp_path / "triton_interpreter" / "rms_norm.json"
    assert f"wrote {written}" in out and " -> {" in out
    assert not list(written.parent.glob("*.lock"))
