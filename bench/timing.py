"""Timing and ceilings: every measurement keeps its distribution, and the ceilings are measured in the run.

A :class:`Timing` holds the per-call times of one measurement (µs); rows report its median with
min, max, quartiles and the number of runs, so a reader can tell a 5% gain from noise.

* GPUs: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), all samples kept.
* CPU: after warm-up, samples of a batch of calls each (batched so a sample lasts at least
  ``MIN_SAMPLE_S``: single microsecond calls are below the timer's and the scheduler's
  resolution), at least ``MIN_SAMPLES`` of them and ``min_time_s`` in all.

:func:`measure_all` times the candidates of one row (ours and each baseline) in interleaved
rounds on the CPU, so load that comes and goes on a shared machine hits them all alike and
their ratio stays meaningful; each round in a new (seeded) order, so that no candidate always
runs right after the same neighbour and pays for the memory it freed.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

MIN_SAMPLES = 7
SLOW_ROUNDS = 5
MAX_ROUNDS = 200
MIN_SAMPLE_S = 1e-3
COPY_MEGABYTES = 512  # well past any last-level cache: the DRAM figure


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in µs."""

    samples: tuple[float, ...]
    calls_per_sample: int = 1

    @property
    def runs(self) -> int:
        return len(self.samples) * self.calls_per_sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.samples)
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0.05 means the middle half of the runs lie within 5%."""
        return (self.quantile(0.75) - self.quantile(0.25)) / self.median if self.median > 0 else 0.0

    def columns(self) -> dict[str, float]:
        """The row fields of this measurement."""
        return {"time_us": self.median, "min_us": self.min, "q25_us": self.quantile(0.25),
                "q75_us": self.quantile(0.75), "max_us": self.max, "runs": self.runs, "spread": self.spread}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, *, min_time_s: float = 0.4) -> Timing:
    """The distribution of ``fn``'s run time after warm-up."""
    if device.type != "cpu":
        import triton.testing

        times = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
        return Timing(tuple(float(t) * 1e3 for t in times))
    fn()  # warm-up
    return _cpu_rounds({"fn": fn}, min_time_s)["fn"]


def _cpu_rounds(candidates: dict[str, Callable[[], Any]], min_time_s: float) -> dict[str, Timing]:
    """Interleaved rounds of samples, one sample of every candidate per round, in a new order each
    round (warmed up already)."""
    calls: dict[str, int] = {}
    round_s = 0.0
    for name, fn in candidates.items():
        start = time.perf_counter()
        fn()  # also the last warm-up
        once = max(time.perf_counter() - start, 1e-7)
        calls[name] = max(1, int(MIN_SAMPLE_S / once))
        round_s += once * calls[name]
    # Rows of second-long calls (a model's prefill) get a few rounds; the others MIN_SAMPLES
    # rounds and at least min_time_s per candidate.
    minimum_rounds = MIN_SAMPLES if round_s < 1.0 else SLOW_ROUNDS
    budget_s = min_time_s * len(candidates) if round_s < 1.0 else 0.0
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    order = random.Random(0)
    spent, rounds = 0.0, 0
    while (rounds < minimum_rounds or spent < budget_s) and rounds < MAX_ROUNDS:
        # A new order each round: a sample taken right after a large neighbour (the same-size copy
        # freeing 16 MiB) pays for its fresh outputs' page faults, and a fixed order (or a rotated
        # one, which keeps each candidate's neighbours) gave that place to the same candidate every
        # round: a 256 x 4096 fp32 add-and-norm read 0.78x HF's identical two ATen calls.
        order.shuffle(names)
        for name in names:
            fn = candidates[name]
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            elapsed = time.perf_counter() - start
            samples[name].append(elapsed / calls[name] * 1e6)
            spent += elapsed
        rounds += 1
    return {name: Timing(tuple(samples[name]), calls[name]) for name in candidates}


def first_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds the first call takes (for compiled callables: compile time plus one run)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    """Same-run copy figures at a size far past the caches (bytes read + bytes written per second)."""

    into_existing_gbps: float  # dst.copy_(src): the ceiling of in-place ops
    clone_gbps: float  # src.clone(): a fresh output each time (page faults and all), the ceiling of ops returning one


def copy_bandwidth(device: torch.device, megabytes: int = COPY_MEGABYTES) -> CopyBandwidth:
    elements = megabytes * 2**20 // 2
    # Filled, not drawn: a copy's speed does not depend on the values, and drawing 256M random
    # numbers and casting them took 2.3 s on a CPU (AMD EPYC), a fifth of the ceilings' time.
    src = torch.full((elements,), 1.0, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    into = measure(lambda: dst.copy_(src), device, min_time_s=1.0).median
    del dst
    fresh = measure(lambda: src.clone(), device, min_time_s=1.0).median
    return CopyBandwidth(moved / (into * 1e-6) / 1e9, moved / (fresh * 1e-6) / 1e9)


def matmul_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16,
                  one_call_s: float = 0.25) -> float:
    """Same-run dense matmul rate, the ceiling for compute-bound ops.

    The product is square, ``size`` (2048 on the CPU) or smaller: sizes double from 256 while
    one product would stay under ``one_call_s``, so a device without fast units for ``dtype``
    (an AVX2 CPU multiplies bf16 at about 1 GFLOP/s, where one 2048-cube takes 20 s) reports its
    slow rate in seconds instead of minutes.
    """
    limit = size if device.type != "cpu" else 2048
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm: a GPU's first product carries its library's start-up, which would stop the doubling
        if n * 2 > limit or first_call_s(lambda: a @ b, device) * 8 > one_call_s:
            break
        n *= 2
    us = measure(lambda: a @ b, device, min_time_s=1.0).median
    return 2 * n**3 / (us * 1e-6) / 1e12


class MatmulCeiling(NamedTuple):
    """The compute ceiling of a run: the dense bf16 rate, and on a CPU the fp32 rate beside it."""

    bf16: float
    fp32: float | None  # measured on the CPU only

    @property
    def tflops(self) -> float:
        """The ceiling: the faster rate. A CPU without bf16 units (AVX2) multiplies bf16 at about a
        thousandth of its fp32 rate, and its bf16 ops (SDPA, the experts) compute in fp32: against
        the bf16 rate they read as 40x the ceiling."""
        return max(self.bf16, self.fp32 or 0.0)

    def describe(self) -> str:
        if self.fp32 is None:
            return f"bf16 matmul {self.bf16:.3f} TFLOP/s"
        faster = "bf16" if self.bf16 >= self.fp32 else "fp32"
        return (f"dense matmul {self.tflops:.3f} TFLOP/s ({faster}, the faster here: bf16 {self.bf16:.4f}, "
                f"fp32 {self.fp32:.3f})")


def matmul_ceiling(device: torch.device) -> MatmulCeiling:
    """:func:`matmul_tflops` in bf16, and on the CPU in fp32 too (see :class:`MatmulCeiling`)."""
    fp32 = matmul_tflops(device, dtype=torch.float32) if device.type == "cpu" else None
    return MatmulCeiling(matmul_tflops(device), fp32)


def timed_row(fn: Callable[[], Any], device: torch.device, **measure_options: Any) -> dict[str, float]:
    """``first_call_s`` plus the distribution columns of ``fn``; what every suite's rows carry."""
    first = first_call_s(fn, device)
    return {"first_call_s": first, **measure(fn, device, **measure_options).columns()}


def measure_all(candidates: dict[str, Callable[[], Any]], device: torch.device, *,
                min_time_s: float = 0.4) -> dict[str, dict[str, Any]]:
    """:func:`timed_row` of every candidate; on the CPU in interleaved rounds.

    A candidate that raises gets ``{"error": ...}`` (a baseline that cannot run a shape) and
    the others are still measured.
    """
    results: dict[str, dict[str, Any]] = {}
    alive: dict[str, Callable[[], Any]] = {}
    for name, fn in candidates.items():
        try:
            results[name] = {"first_call_s": first_call_s(fn, device)}
        except Exception as err:
            results[name] = {"time_us": float("nan"), "error": f"{type(err).__name__}: {err}"}
            continue
        alive[name] = fn
    if device.type != "cpu":
        for name, fn in alive.items():
            results[name].update(measure(fn, device, min_time_s=min_time_s).columns())
        return results
    for name, timing in _cpu_rounds(alive, min_time_s).items():
        results[name].update(timing.columns())
    return results
