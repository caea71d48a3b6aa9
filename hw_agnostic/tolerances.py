"""The one per-dtype tolerance table: every test, and the tuner's correctness check, use it.

An output in dtype ``d`` is compared with a float64 evaluation of the op's reference (the
reference run on float64 copies of the inputs). Element-wise it passes when

    |out - ref| <= rtol(d) * |ref| + atol(d) * max(|ref|)

The absolute term is scaled by the largest reference magnitude because the rounding error of a
low-precision op is relative to the magnitude of its operands, not of its result: ``(up + 1)``
for ``up`` near -1, or a product of a tiny ``act(gate)`` with a large ``up``, can leave a small
result carrying an error of one ulp of its large operands. ``rtol`` allows about two roundings
to the dtype (the HF modules we follow round intermediates too), plus fp32 reduction-order
noise for fp32.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # relative to max(|ref|)


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-10, atol=1e-12),
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6),
    torch.float16: Tolerance(rtol=2e-3, atol=1e-3),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=8e-3),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype}; the table covers {sorted(map(str, TOLERANCES))}") from None


def least_precise(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype whose rounding bounds an op's error: a bf16 input limits a fp32 result too."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """None when ``actual`` matches the float64 ``expected`` within the table, else a report."""
    dtype = actual.dtype if dtype is None else dtype
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    tol = tolerance(dtype)
    got = actual.detach().to(device="cpu", dtype=torch.float64)
    want = expected.detach().to(device="cpu", dtype=torch.float64)
    nan_mismatch = torch.isnan(got) != torch.isnan(want)
    if nan_mismatch.any():
        index = tuple(nan_mismatch.nonzero()[0].tolist())
        return f"NaN where the reference has none (or vice versa) at {index}: got {got[index].item()}, want {want[index].item()}"
    inf_mismatch = torch.isinf(want) & (got != want)
    if inf_mismatch.any():
        index = tuple(inf_mismatch.nonzero()[0].tolist())
        return f"infinity mismatch at {index}: got {got[index].item()}, want {want[index].item()}"
    finite = torch.isfinite(want)
    got, want = got[finite], want[finite]
    scale = want.abs().max().item() if want.numel() else 0.0
    error = (got - want).abs()
    allowed = tol.rtol * want.abs() + tol.atol * scale
    bad = error > allowed
    if not bad.any():
        return None
    worst = int(torch.argmax(error - allowed))
    return (
        f"{int(bad.sum())} of {want.numel()} elements outside rtol={tol.rtol}, atol={tol.atol}*{scale:.3g} "
        f"for {dtype}; worst: got {got[worst].item():.8g}, want {want[worst].item():.8g}"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    problem = mismatch(actual, expected, dtype)
    if problem is not None:
        raise AssertionError(problem)
