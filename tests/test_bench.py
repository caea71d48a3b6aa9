"""The bench harness: distributions, ratios with their noise, incremental writes, reports and plots.

The suites themselves measure real ops for minutes; here a fake suite stands in for them.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import types

import pandas as pd
import pytest
import torch

from bench import __main__ as harness
from bench import report
from bench.timing import MIN_SAMPLES, Timing, _cpu_rounds, measure_all


def test_a_timing_keeps_its_distribution():
    timing = Timing((5.0, 1.0, 3.0, 100.0, 2.0), calls_per_sample=10)
    assert (timing.min, timing.median, timing.max, timing.runs) == (1.0, 3.0, 100.0, 50)
    assert timing.quantile(0.25) == 2.0 and timing.quantile(0.75) == 5.0
    assert timing.spread == pytest.approx((5.0 - 2.0) / 3.0)
    columns = timing.columns()
    assert columns["time_us"] == 3.0 and columns["q25_us"] == 2.0 and columns["runs"] == 50


def test_candidates_are_measured_together_and_a_failing_one_gets_an_error():
    calls = {"a": 0, "b": 0}

    def a():
        calls["a"] += 1

    def b():
        calls["b"] += 1
        return torch.ones(16).sum()

    def broken():
        raise RuntimeError("needs 256-token blocks")

    results = measure_all({"a": a, "b": b, "broken": broken}, torch.device("cpu"), min_time_s=0.01)
    assert results["broken"]["error"] == "RuntimeError: needs 256-token blocks" and math.isnan(
        results["broken"]["time_us"])
    for name in ("a", "b"):
        row = results[name]
        assert row["min_us"] <= row["q25_us"] <= row["time_us"] <= row["q75_us"] <= row["max_us"]
        assert row["runs"] >= MIN_SAMPLES and row["first_call_s"] >= 0
    assert calls["a"] >= MIN_SAMPLES and calls["b"] >= MIN_SAMPLES


def test_no_candidate_always_follows_the_same_neighbour():
    """A sample taken right after a large neighbour pays for that neighbour's freed memory (page
    faults on its fresh outputs): each round orders the candidates anew."""
    log: list[str] = []
    candidates = {name: functools.partial(log.append, name) for name in "abcd"}
    _cpu_rounds(candidates, min_time_s=0.01)
    timed = log[len(candidates):]  # after one calibrating call each
    samples = [name for i, name in enumerate(timed) if i == 0 or timed[i - 1] != name]
    followed = {name: {samples[i - 1] for i in range(1, len(samples)) if samples[i] == name} for name in candidates}
    assert all(len(before) >= 2 for before in followed.values()), followed


def _rows(ours: tuple[float, float, float], theirs: tuple[float, float, float], *, op="rms_norm", shape="1x8",
          tokens=1, gbps=1.0) -> list[dict]:
    def row(provider, q25, median, q75):
        return {"suite": "ops", "op": op, "shape": shape, "tokens": tokens, "width": 8, "dtype": "bfloat16",
                "provider": provider, "ran": provider, "time_us": median, "q25_us": q25, "q75_us": q75,
                "min_us": q25, "max_us": q75, "runs": 10, "spread": (q75 - q25) / median, "gbps": gbps,
                "copy_gbps": 10.0, "bytes": 1000, "tflops": math.nan, "matmul_tflops": 1.0}

    return [row("hw_agnostic", *ours), row("hf_eager", *theirs)]


def test_ratios_carry_their_interval_and_noise_flags():
    frame = pd.DataFrame(
        _rows((9, 10, 11), (19, 20, 21))  # clearly 2x
        + _rows((9, 10, 11), (9.5, 10.2, 11), shape="16x8", tokens=16)  # within noise
        + _rows((5, 10, 15), (30, 40, 50), shape="256x8", tokens=256)  # faster, but a noisy row
    )
    ours = report.add_ratios(frame).query("provider == 'hw_agnostic'").set_index("shape")
    assert ours.loc["1x8", "speedup_vs_hf_eager"] == 2.0
    assert ours.loc["1x8", "speedup_vs_hf_eager_low"] == pytest.approx(19 / 11)
    assert ours.loc["1x8", "speedup_vs_hf_eager_high"] == pytest.approx(21 / 9)
    assert not report._within_noise(ours.loc["1x8"], "hf_eager")
    assert report._within_noise(ours.loc["16x8"], "hf_eager")
    assert list(ours["noisy"]) == [False, False, True]


def test_the_report_summarises_slow_noisy_and_cache_resident_rows():
    frame = pd.DataFrame(_rows((9.8, 10, 10.2), (7.8, 8, 8.2))
                         + _rows((9, 10, 11), (9.5, 10.2, 11), shape="16x8", tokens=16)
                         + _rows((5, 10, 15), (30, 40, 50), shape="256x8", tokens=256, gbps=25.0))
    meta = {"platform": "cpu", "device_name": "Test CPU", "command": "python -m bench", "copy_gbps": 10.0,
            "clone_gbps": 2.0, "matmul_tflops": 1.0, "largest_cache_bytes": 32 << 20, "versions": {"torch": "x"}}
    text = report.markdown(report.add_ratios(frame), meta)
    assert "copy into an existing buffer **10.0 GB/s**, `clone()`" in text and "**2.0 GB/s**" in text
    assert "slower in 1:" in text and "rms_norm 1x8 bfloat16: 0.80× (IQR 0.76–0.84)\n" in text
    assert "1.02 ~" in text and "rms_norm 16x8 bfloat16 vs hf_eager" in text
    assert "1 rows are noisy" in text and "! spread" in text
    assert "above DRAM copy: its 1000 KiB" not in text and "fit(s) the 32 MiB cache" in text


def test_plots_have_one_figure_per_op(tmp_path):
    frame = pd.DataFrame(_rows((9, 10, 11), (19, 20, 21)) + _rows((9, 10, 11), (19, 20, 21), shape="16x8", tokens=16)
                         + _rows((9, 10, 11), (12, 13, 14), op="decode b8 ctx128", shape="ctx128", tokens=8))
    frame.loc[frame["op"] == "decode b8 ctx128", "suite"] = "model"
    paths = report.plot(report.add_ratios(frame), tmp_path, {"device_name": "Test CPU", "platform": "cpu"})
    assert sorted(p.name for p in paths) == ["decode_b8_ctx128.png", "rms_norm.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


# --------------------------------------------------------------------------------------------
# the harness, with a fake suite


def _fake_suite(rows_before_stop: int | None = None) -> types.ModuleType:
    suite = types.ModuleType("tests.fake_suite")
    grid = [("rms_norm", 1), ("rms_norm", 16), ("silu_and_mul", 1)]

    def count(device, quick, only=lambda label: True):
        return 2 * sum(only(f"{op} {t}") for op, t in grid)

    def run(device, *, quick, log, only=lambda label: True):
        made = 0
        for op, tokens in grid:
            if not only(f"{op} {tokens}"):
                continue
            log(f"{op} {tokens}")
            for provider, us in (("hw_agnostic", 10.0 + tokens), ("hf_eager", 20.0)):
                if rows_before_stop is not None and made == rows_before_stop:
                    raise KeyboardInterrupt
                made += 1
                yield {"suite": "fake", "op": op, "shape": f"{tokens}x8", "tokens": tokens, "width": 8,
                       "dtype": "bfloat16", "provider": provider, "ran": provider, "time_us": us, "q25_us": us * 0.9,
                       "q75_us": us * 1.1, "min_us": us * 0.8, "max_us": us * 1.2, "runs": 10, "spread": 0.2,
                       "first_call_s": 0.0, "bytes": 100, "gbps": 100 / us / 1e3}

    suite.count, suite.run = count, run
    return suite


@pytest.fixture
def fake_harness(monkeypatch):
    from bench.timing import CopyBandwidth, MatmulCeiling

    def install(suite):
        monkeypatch.setitem(sys.modules, "tests.fake_suite", suite)
        monkeypatch.setattr(harness, "SUITES", {"fake": "tests.fake_suite"})
        monkeypatch.setattr(harness, "copy_bandwidth", lambda device: CopyBandwidth(20.0, 5.0))
        monkeypatch.setattr(harness, "matmul_ceiling", lambda device: MatmulCeiling(0.001, 0.5))

    return install


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_writes_rows_as_they_come_and_reports_at_the_end(fake_harness, tmp_path, capsys):
    fake_harness(_fake_suite())
    assert harness.main(["--device", "cpu", "--suites", "fake", "--out", str(tmp_path)]) == 0
    rows = _lines(tmp_path / "rows.jsonl")
    assert len(rows) == 6 and rows[0]["copy_gbps"] == 20.0 and rows[0]["clone_gbps"] == 5.0
    assert rows[0]["torch"] == torch.__version__ and "helion" in rows[0] and rows[0]["measured_at"]
    assert len(pd.read_csv(tmp_path / "results.csv")) == 6
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["device_name"] and meta["command"].startswith("python -m bench")
    assert "fake" in meta["suite_seconds"] and meta["versions"]["torch"] == torch.__version__
    # the ceiling is the faster of the bf16 and fp32 rates (an AVX2 CPU's bf16 rate is a thousandth of it)
    assert (meta["matmul_tflops"], meta["matmul_tflops_bf16"], meta["matmul_tflops_fp32"]) == (0.5, 0.001, 0.5)
    assert rows[0]["matmul_tflops"] == 0.5
    assert "dense matmul 0.500 TFLOP/s (fp32, the faster here: bf16 0.0010, fp32 0.500)" in (
        tmp_path / "results.md").read_text()
    assert (tmp_path / "results.md").read_text().startswith("# hw_agnostic bench: cpu")
    assert {p.name for p in tmp_path.glob("*.png")} == {"rms_norm.png", "silu_and_mul.png"}
    out = capsys.readouterr().out
    assert "6/6 rows" in out and "ETA" in out


def test_a_stopped_run_keeps_what_it_measured(fake_harness, tmp_path):
    fake_harness(_fake_suite(rows_before_stop=3))
    assert harness.main(["--device", "cpu", "--suites", "fake", "--out", str(tmp_path)]) == 130
    assert len(_lines(tmp_path / "rows.jsonl")) == 3
    assert json.loads((tmp_path / "meta.json").read_text())["status"] == "interrupted"
    assert "interrupted" in (tmp_path / "results.md").read_text()


def test_only_and_merge_remeasure_some_rows(fake_harness, tmp_path):
    fake_harness(_fake_suite())
    assert harness.main(["--device", "cpu", "--suites", "fake", "--out", str(tmp_path)]) == 0
    first = _lines(tmp_path / "rows.jsonl")
    assert harness.main(["--device", "cpu", "--suites", "fake", "--out", str(tmp_path), "--merge",
                         "--only", "^rms_norm 16$"]) == 0
    merged = _lines(tmp_path / "rows.jsonl")
    assert len(merged) == 6
    assert [r for r in merged if r["shape"] != "16x8"] == [r for r in first if r["shape"] != "16x8"]
    assert "merged_into" in json.loads((tmp_path / "meta.json").read_text())
    assert harness.main(["--device", "cpu", "--suites", "fake", "--out", str(tmp_path), "--merge",
                         "--only", "^silu_and_mul"]) == 0
    assert harness.main(["--report", str(tmp_path)]) == 0
    # the report names every run the rows come from, the merge before this one and the full run under it
    (line,) = [line for line in (tmp_path / "results.md").read_text().splitlines() if "merged into" in line]
    assert "--only ^rms_norm 16$" in line and line.count("--suites fake") == 2


def test_default_output_is_outside_the_tracked_tree(fake_harness, tmp_path, monkeypatch):
    fake_harness(_fake_suite())
    monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")
    assert harness.main(["--device", "cpu", "--suites", "fake"]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("cpu-") and (run / "results.md").exists()
    ignored = (harness.HERE.parent / ".gitignore").read_text().splitlines()
    assert "/bench/runs/" in ignored and harness.RUNS != harness.HERE / "results"


def test_decode_host_counts_kernel_launches_not_views_allocations_or_syncs():
    from bench.decode_host_suite import LaunchCount

    x = torch.randn(4, 4)
    with LaunchCount() as counted:
        x.view(16), x.t(), x[1:], torch.empty(3), x.reshape(2, 8)
        x + 1, x.clone(), x.add_(1)
        x.sum().item()
    assert dict(counted.aten) == {"add": 1, "clone": 1, "add_": 1, "sum": 1}
    assert counted.syncs == 1


def test_decode_suite_times_eager_and_compiled_static_steps_of_a_tiny_model():
    """The decode suite's machinery on the CPU (its grid runs on GPUs only): eager steps on dynamic
    caches, compiled steps on static ones (here without CUDA graphs), each cropped back."""
    from transformers import AutoConfig

    from bench import decode_suite

    assert decode_suite.count(torch.device("cpu"), quick=True) == 0
    said = []
    assert list(decode_suite.run(torch.device("cpu"), quick=True, log=said.append)) == [] and "GPU only" in said[0]
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    torch._dynamo.reset()
    rows = list(decode_suite.measure_decode(
        torch.device("cpu"), [(2, 20)], config=config, log=said.append, only=lambda label: True,
        dtype=torch.float32, graphed=dict(fullgraph=True, dynamic=False, backend="eager")))
    assert [(r["op"], r["provider"]) for r in rows] == [
        ("decode b2 ctx20", "hw_agnostic"), ("decode b2 ctx20", "hf_eager"),
        ("decode graphed b2 ctx20", "hw_agnostic"), ("decode graphed b2 ctx20", "hf_graphs"),
        ("decode graphed b2 ctx20", "hf_eager")]
    for row in rows:
        assert "error" not in row, row
        assert row["runs"] >= MIN_SAMPLES and row["tokens"] == 2 and row["width"] == 64
        assert math.isclose(row["tokens_per_s"], 2 / (row["time_us"] * 1e-6))


@pytest.mark.parametrize("batch, context", [(1, 17), (3, 40)])
def test_a_decode_step_row_computes_what_hf_eager_computes(batch, context):
    """The decode-step rows' two sides attend over the same keys: the paged write and attention give
    HF eager's cache concatenation and SDPA (fp32 on the CPU's reference; twice, as the timing repeats it)."""
    from bench import attention_suite

    candidates, work, _ = attention_suite._decode_step(batch, context, torch.float32, torch.device("cpu"))
    assert set(candidates) == {"hw_agnostic", "hf_eager"} and work["bytes"] > 0 and work["flops"] > 0
    want = candidates["hf_eager"]()[:, :, 0]
    for _ in range(2):
        torch.testing.assert_close(candidates["hw_agnostic"](), want)


def test_a_mixed_attention_row_computes_what_its_parts_compute(monkeypatch):
    """The mixed rows' baseline is the same attention: the prompt's and the decode steps' outputs of
    the two separate calls are the mixed call's rows (GPU rows; checked here on the CPU's reference)."""
    from bench import attention_suite

    monkeypatch.setattr(attention_suite, "MIXED_CONTEXT", 40)
    candidates, work, args = attention_suite._mixed(3, 20, torch.float32, torch.device("cpu"))
    assert set(candidates) == {"hw_agnostic", "hw_agnostic_apart"} and work["bytes"] > 0 and work["flops"] > 0
    mixed = candidates["hw_agnostic"]()
    prompt, decodes = candidates["hw_agnostic_apart"]()
    torch.testing.assert_close(torch.cat([prompt, decodes]), mixed)


def test_a_bench_model_rewire_left_partly_says_so():
    """A suite's rows of a partly rewired model measure less of the library: the log says which modules
    were left and why (decode host's rows once measured a model whose attention rewire had undone)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.rewired import rewired

    def tiny(family: str) -> torch.nn.Module:
        config = AutoConfig.for_model(family, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        return AutoModelForCausalLM.from_config(config).eval()

    logged: list[str] = []
    assert not rewired(tiny("llama"), logged.append, "some suite").left and not logged
    report = rewired(tiny("diffllama"), logged.append, "some suite")  # its attention is declined
    assert report.left and len(logged) == 1
    assert logged[0].startswith("some suite: WARNING: rewire left") and "DiffLlamaAttention" in logged[0]


def test_model_suite_small_decode_row_against_hf_eager():
    """The model suite's small-model decode step: two rows (ours, HF eager), counted as it yields them."""
    from bench import model_suite

    cpu = torch.device("cpu")
    small = lambda label: label == model_suite.SMALL_STEP  # noqa: E731
    assert model_suite.count(cpu, quick=True) == 8 and model_suite.count(cpu, quick=True, only=small) == 2
    said = []
    rows = list(model_suite.run(cpu, quick=True, log=said.append, only=small))
    assert [r["provider"] for r in rows] == ["hw_agnostic", "hf_eager"]
    assert all(r["op"] == model_suite.SMALL_STEP and r["tokens"] == 1 and r["time_us"] > 0 for r in rows)
