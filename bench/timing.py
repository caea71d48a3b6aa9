"""Timing and ceilings: medians after warm-up, device events on GPUs, same-run copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def median_time_us(fn: Callable[[], Any], device: torch.device, *, min_time_s: float = 0.4,
                   max_runs: int = 200) -> float:
    """Median wall time of ``fn`` in microseconds, after warm-up.

    GPUs: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, median). CPU: at
    least 5 runs and ``min_time_s`` of them, after two warm-up runs (one warm-up and 3 runs when
    a call takes over a second).
    """
    if device.type != "cpu":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    start = time.perf_counter()
    fn()
    slow = time.perf_counter() - start > 1.0  # seconds per call: fewer runs tell as much
    if not slow:
        fn()
    samples: list[float] = []
    spent = 0.0
    min_runs = 3 if slow else 5
    while (len(samples) < min_runs or spent < min_time_s) and len(samples) < max_runs:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        spent += elapsed
    return statistics.median(samples) * 1e6


def first_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds the first call takes (for compiled callables: compile time plus one run)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth_gbps(device: torch.device, megabytes: int = 512) -> float:
    """Same-run device copy bandwidth (bytes read + bytes written), the ceiling for memory-bound ops."""
    elements = megabytes * 2**20 // 2
    src = torch.randn(elements, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    us = median_time_us(lambda: dst.copy_(src), device, min_time_s=1.0)
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def matmul_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Same-run dense matmul rate, the ceiling for compute-bound ops."""
    size = size if device.type != "cpu" else 2048
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    us = median_time_us(lambda: a @ b, device, min_time_s=1.0)
    return 2 * size**3 / (us * 1e-6) / 1e12
