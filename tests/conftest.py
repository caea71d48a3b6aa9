"""Test-suite settings.

* The reference runs eagerly unless a test opts in (compiling costs tens of seconds per graph
  on the CPU); ``tests/test_compile.py`` covers the compiled path.
* Tuned configs are read from and written to a per-session temporary directory, never the
  developer's own cache.
* ``dsl`` tests need something that runs kernels: a GPU, or one of the CPU interpreters.
  With ``HW_AGNOSTIC_COMPILE_TARGETS`` set (the compile tier) they run on the CPU in
  compile-for-target mode, and each test fails if a launch it made broke a compile rule.
* Hypothesis fuzzing is deterministic by default (see the profiles below).
* No silent skips: a skip whose reason ``tests/expected_skips.py`` does not allow for this tier
  fails its test, and the end of the run lists the tier's skips by reason.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import os
import re
import shutil
import tempfile

# The vLLM plugin's tests run in their own tier and venv (make test-vllm), where vLLM is installed;
# the compile tier's only with HW_AGNOSTIC_COMPILE_TARGETS set (make test-compile).
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
if not os.environ.get("HW_AGNOSTIC_COMPILE_TARGETS"):
    collect_ignore.append("compile_targets")

os.environ.setdefault("HW_AGNOSTIC_COMPILE_REFERENCE", "0")
# Each test process (xdist's controller and workers alike) tunes into a cache of its own, removed as it exits.
os.environ["HW_AGNOSTIC_CACHE_DIR"] = tempfile.mkdtemp(prefix="hw_agnostic_test_cache_")
atexit.register(shutil.rmtree, os.environ["HW_AGNOSTIC_CACHE_DIR"], ignore_errors=True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Inductor compiles in this process, without a pool of compile subprocesses: with as many workers
    # as cores the pools only compete with the other workers (with Inductor's cache cold, as on a
    # clean machine, tests/test_cpu_path.py took 246 s on 2 cores with them and 205 s without).
    # Read when Inductor's config is first imported, so before torch.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per worker: tiny tensors gain nothing from more, and with as many workers
    # as cores, more threads only oversubscribe the cores (each op then waits on spinning peers).
    torch.set_num_threads(1)
from hypothesis import settings  # noqa: E402

# Fuzz tests draw the same examples on every run unless asked to explore
# (HYPOTHESIS_PROFILE=explore): CI must not pass or fail by chance. Failures found while
# exploring are kept as @example regressions in the test.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from hw_agnostic.kernels import targets  # noqa: E402
from hw_agnostic.kernels.interpret import interpreter_mode  # noqa: E402


def kernel_device() -> str | None:
    """Where DSL kernels run in this process: ``"cuda"``, ``"cpu"`` (an interpreter, or
    compile-for-target mode, where launches compile and the reference computes) or None."""
    if interpreter_mode() is not None or targets.active_mode() is not None:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-dtype", action="append", default=[], metavar="DTYPE",
        help="deselect the parametrized tests of inputs of this dtype (a torch dtype name, e.g. float16): a "
             "torch.dtype parameter, or a token of the test's id (float16 also as fp16, bfloat16 as bf16)")


#: the short names test ids also give a dtype (not fp32: it names a numerics mode too)
DTYPE_ALIASES = {"float16": {"fp16"}, "bfloat16": {"bf16"}}


def _deselect_dtypes(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = set(config.getoption("without_dtype"))
    unknown = {n for n in names if not isinstance(getattr(torch, n, None), torch.dtype)}
    if unknown:
        raise pytest.UsageError(f"--without-dtype: {sorted(unknown)} name no torch dtype")
    dtypes = {getattr(torch, n) for n in names}
    tokens = names.union(*(DTYPE_ALIASES.get(n, set()) for n in names))
    kept, dropped = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        drop = spec is not None and (any(v in dtypes for v in spec.params.values() if isinstance(v, torch.dtype))
                                     or not tokens.isdisjoint(spec.id.split("-")))
        (dropped if drop else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("without_dtype"):
        _deselect_dtypes(config, items)
    no_kernels = pytest.mark.skip(reason="no GPU and no CPU interpreter (TRITON_INTERPRET=1 / HELION_INTERPRET=1)")
    no_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "dsl" in item.keywords and kernel_device() is None:
            item.add_marker(no_kernels)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


def tier() -> str:
    """This process's test tier (see tests/expected_skips.py)."""
    mode = interpreter_mode()
    if mode is not None:
        return mode
    if targets.active_mode() is not None:
        return "compile"
    return "gpu" if torch.cuda.is_available() else "reference"


def _skip_reason(report: pytest.TestReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def _allowed(reason: str) -> tuple[str, str] | None:
    from tests.expected_skips import EXPECTED_SKIPS

    return next(((pattern, why) for pattern, why in EXPECTED_SKIPS[tier()] if re.match(pattern, reason)), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if _allowed(reason) is None:
            report.outcome = "failed"
            report.longrepr = (f"unexpected skip in the {tier()} tier: {reason}\n"
                               "(a skip must be allowed, with its reason, in tests/expected_skips.py)")


_skips: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counts the allowed skips (on the xdist controller too: it sees every worker's reports)."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        allowed = _allowed(reason)
        if allowed is not None:
            _skips[allowed[1]][reason] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    total = sum(sum(reasons.values()) for reasons in _skips.values())
    terminalreporter.write_sep("-", f"{total} skips in the {tier()} tier, each allowed by tests/expected_skips.py")
    for why, reasons in sorted(_skips.items(), key=lambda item: -sum(item[1].values())):
        terminalreporter.write_line(f"{sum(reasons.values()):5d}  {why}")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"       {count:5d}  {reason}")


@pytest.fixture
def device() -> str:
    """The device kernels run on in this process (tests marked ``dsl`` only)."""
    found = kernel_device()
    if found is None:
        pytest.skip("no device runs kernels here")
    return found


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test starts without cached dispatch plans."""
    from hw_agnostic import ops

    ops.reset()
    yield
    ops.reset()


@pytest.fixture(autouse=True)
def _one_layer_norm_table(monkeypatch):
    """Layer norms choose between ATen's kernel and the compiled reference by the CPU's vector unit
    (``ops.layer_norm.NATIVE_ROWS``); tests see the AVX-512 table on every machine, so each runs the
    same path everywhere and both paths are covered (``test_cpu_path`` checks the other table)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("hw_agnostic.ops.layer_norm"), "_avx512", lambda: True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """In compile-for-target mode (the compile tier), a ``dsl`` test fails if a launch it made does
    not compile, spills, overflows shared memory or misses 128-bit loads (hw_agnostic.kernels.targets)."""
    mode = targets.active_mode()
    if mode is None or "dsl" not in item.keywords:
        return (yield)
    with targets.compile_for([t.name for t in mode.targets]) as compile_log:
        result = yield
    compile_log.check()
    return result
