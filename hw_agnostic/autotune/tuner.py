"""The tuner: for an op and a list of shapes, find each key's fastest correct config.

For every shape it builds the op's example inputs, evaluates the reference in float64, then
walks the kernel's candidate configs (its default first) until the time budget runs out:
each candidate's output is checked against the reference with the tolerance table *before* it
is timed, and rejected if it differs. The winner is saved to the config file right away, so an
interrupted run keeps what it measured and a rerun resumes where it stopped (keys already in
the target file are skipped unless ``retune=True``).

Timing needs a GPU (``triton.testing.do_bench``, median of event-timed runs). On the CPU the
interpreter can drive the whole procedure with a wall-clock timer, which tests the mechanism
but measures nothing worth keeping.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sized
from pathlib import Path
from typing import Any

import torch

from . import cache
from .keys import key_string, make_key
from .platform import device_name, platform_of

log = logging.getLogger(__name__)  # "hw_agnostic.autotune.tuner": the CLI's --log-level sets it

Timer = Callable[[Callable[[], Any]], float]


#: What happened to a key. Only "tuned" and "partial" wrote an entry.
STATUSES = {
    "tuned": "tuned",
    "partial": "partially tuned (budget ran out during the key)",
    "out-of-budget": "left on the default (budget spent)",
    "kept": "kept (already tuned)",
    "no-candidate": "no correct candidate",
    "skipped": "skipped (no tunable provider here)",
}


@dataclasses.dataclass
class KeyResult:
    key: dict[str, Any]
    config: dict[str, Any] | None
    time_us: float | None
    tried: int
    rejected: dict[str, str]
    status: str  # a key of STATUSES
    candidates: int | None = None  # the size of the key's search space
    path: Path | None = None  # the file the entry was written to
    reason: str = ""  # for "skipped"


def gpu_timer(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def wall_clock_timer(fn: Callable[[], Any], repeats: int = 3) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64)
    return value


def _clone(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _outputs(op: Any, args: tuple[Any, ...], result: Any) -> list[torch.Tensor]:
    """What the op produces: its return values, or for an in-place op the arguments it mutates."""
    if op.mutates_args:
        import inspect

        names = list(inspect.signature(op.reference).parameters)
        return [args[names.index(n)] for n in op.mutates_args]
    return [result] if isinstance(result, torch.Tensor) else [r for r in result if isinstance(r, torch.Tensor)]


def tune(
    op: Any,
    shapes: Iterable[tuple[int, int]],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    budget_s: float = 300.0,
    root: Path | None = None,
    timer: Timer | None = None,
    retune: bool = False,
    progress: bool = True,
) -> list[KeyResult]:
    """Tune ``op``'s kernel for each ``(tokens, width)`` shape; save each winner as it is found."""
    from ..tolerances import least_precise, mismatch

    device = torch.device(device)
    platform = platform_of(device)
    timer = timer or (gpu_timer if device.type != "cpu" else wall_clock_timer)
    deadline = time.monotonic() + budget_s
    tuned_with = {"torch": torch.__version__, "device_name": device_name(device)}
    try:
        import triton

        tuned_with["triton"] = triton.__version__
    except ImportError:
        pass
    results: list[KeyResult] = []
    kernel = None
    shapes = list(shapes)
    bar = _progress(len(shapes), f"tune {op.name} {str(dtype).removeprefix('torch.')}", progress)
    for tokens, width in shapes:
        bar.update(1)
        args = op.example_inputs(tokens, width, dtype, device)
        call_key = op.key(*args)
        provider = next((p for p in op.providers if p.kernel is not None and p.why_not(call_key) is None), None)
        if provider is None:
            reasons = "; ".join(f"{p.name}: {p.why_not(call_key)}" for p in op.providers if p.kernel is not None)
            results.append(KeyResult({}, None, None, 0, {}, "skipped", reason=reasons))
            continue
        kernel = provider.kernel
        key = make_key(provider.tuning_key(call_key), call_key.tokens)
        if not retune and _already_tuned(kernel, platform, key, root):
            results.append(KeyResult(key, None, None, 0, {}, "kept"))
            continue
        candidates = kernel.candidate_configs(key)
        total = len(candidates) if isinstance(candidates, Sized) else None
        if time.monotonic() > deadline:
            results.append(KeyResult(key, None, None, 0, {}, "out-of-budget", total))
            continue
        expected_args = tuple(_float64(a) for a in args)
        expected = _outputs(op, expected_args, op.reference(*expected_args))
        precision = least_precise(dtype, *(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()))
        best: tuple[float, dict[str, Any]] | None = None
        rejected: dict[str, str] = {}
        tried = 0
        ran_out = False
        for config in candidates:
            if time.monotonic() > deadline and tried:
                ran_out = True
                break
            tried += 1
            label = key_string(config)
            try:
                run = provider.build(call_key, config, args)
                trial = _clone(args)
                got = _outputs(op, trial, run(*trial))
            except Exception as err:  # a config the compiler rejects is just not a candidate
                rejected[label] = f"{type(err).__name__}: {err}"
                continue
            problems = [mismatch(g, e, precision) for g, e in zip(got, expected)]
            if any(problems):
                rejected[label] = next(p for p in problems if p)
                continue
            timing_args = _clone(args)
            elapsed = timer(lambda: run(*timing_args))
            if best is None or elapsed < best[0]:
                best = (elapsed, config)
        of = f"{tried} of {total if total is not None else '?'} candidates"
        if best is None:
            status = "out-of-budget" if ran_out else "no-candidate"
            results.append(KeyResult(key, None, None, tried, rejected, status, total))
            log.warning("%s %s: %s (%s tried, %d rejected)", op.name, key_string(key), STATUSES[status], of,
                        len(rejected))
            continue
        path = cache.save_entry(kernel, platform, key, best[1], time_us=best[0], root=root, tuned_with=tuned_with)
        status = "partial" if ran_out else "tuned"
        results.append(KeyResult(key, best[1], best[0], tried, rejected, status, total, path))
        log.info("%s %s: %s %.1f µs (%s, %d rejected)", op.name, key_string(key), key_string(best[1]), best[0], of,
                 len(rejected))
        if time.monotonic() > deadline:
            log.warning("%s: time budget spent after %s; the keys left keep their defaults", op.name, key_string(key))
    bar.close()
    return results


def summary(results: list[KeyResult]) -> str:
    """``tuned 4, partially tuned 1, left on the default 7, ...`` (every status that occurred)."""
    counts = Counter(r.status for r in results)
    parts = [f"{label} {counts[status]}" for status, label in STATUSES.items() if counts[status]]
    return f"{len(results)} keys: " + (", ".join(parts) if parts else "none")


def _already_tuned(kernel: Any, platform: str, key: Mapping[str, Any], root: Path | None) -> bool:
    path = cache.config_path(cache.user_root() if root is None else Path(root), platform, kernel.name)
    try:
        parsed = cache.parse_file(path, kernel, platform)
    except cache.CacheFileError:
        return False
    return key_string(key) in parsed.entries


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, description: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="key")
