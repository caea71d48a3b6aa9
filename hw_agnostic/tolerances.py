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


def mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
             two_sided: bool = False, conditioning: float = 1.0) -> str | None:
    """None when ``actual`` matches the float64 ``expected`` within the table, else a report.

    ``two_sided``: ``expected`` is itself a ``dtype`` computation (another implementation's
    result held in float64), not a float64 evaluation; each of the two may lie the table's width
    from the exact result, on opposite sides, so twice the table is allowed.
    ``conditioning``: how much the inputs amplify a correct computation's rounding beyond what
    the table assumes (the caller says why, e.g. rows whose mean lies far outside their spread);
    it multiplies the absolute term.
    """
    dtype = actual.dtype if dtype is None else dtype
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    tol = tolerance(dtype)
    if two_sided:
        tol = Tolerance(rtol=2 * tol.rtol, atol=2 * tol.atol)
    if conditioning != 1.0:
        tol = Tolerance(rtol=tol.rtol, atol=conditioning * tol.atol)
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
        f"{int(bad.sum())} of {want.numel()} elements outside rtol={tol.rtol:g}, atol={tol.atol:g}*{scale:.3g} "
        f"for {dtype}{' (two-sided)' if two_sided else ''}; worst: got {got[worst].item():.8g}, want {want[worst].item():.8g}"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    problem = mismatch(actual, expected, dtype)
    if problem is not None:
        raise AssertionError(problem)


# --------------------------------------------------------------------------------------------
# units in the last place: where a kernel rounds, not only how far it lands
#
# The table above bounds the error against float64; it cannot see *where* a kernel rounds. A
# kernel that skips one of the roundings the Hugging Face module does (``act(gate)`` rounded to
# bf16 before the multiply, ``normed`` cast before the llama weight multiply) lands within one
# rounding of the right answer, inside the table, yet differs from the module it replaces by one
# ulp in a quarter of its elements. Compared with the module itself, in the output dtype, it fails.


@dataclasses.dataclass(frozen=True)
class UlpTolerance:
    max_ulps: int  # no element further than this many ulps
    max_inexact: float  # at most this share of the elements not bit-equal


#: A kernel against the Hugging Face module it replaces, in the module's fp16/bf16 output dtype:
#: no element more than two ulps off, and at most 1% of them not bit-equal. A last-bit difference
#: of a transcendental or of a reduction order, in fp32, flips the rounding of an element now and
#: then, and where the module rounds twice (``act(gate)``, then the product with ``up``) the second
#: rounding can carry that one ulp to two (on an H200: 1 of 1920 fp16 silu-and-mul elements, the
#: GPU's exp and division differing from the CPU's); a rounding in the wrong place moves about a
#: quarter of the elements.
HF_PARITY = UlpTolerance(max_ulps=2, max_inexact=0.01)
BIT_EXACT = UlpTolerance(max_ulps=0, max_inexact=0.0)

_ORDERED_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
                torch.float64: torch.int64}


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per element, how many steps of their (common) dtype separate the two values.

    0 is bit-equal (``+0`` and ``-0`` count as equal), 1 is adjacent. NaNs and infinities are
    left to :func:`ulp_mismatch`, which checks them first.
    """
    if actual.dtype != expected.dtype or actual.dtype not in _ORDERED_INT:
        raise TypeError(f"ulp_distance needs two tensors of one float dtype ({sorted(map(str, _ORDERED_INT))}); "
                        f"got {actual.dtype} and {expected.dtype}")
    int_dtype = _ORDERED_INT[actual.dtype]
    magnitude_bits = torch.iinfo(int_dtype).max

    def ordered(t: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits onto a monotonic integer line
        bits = t.detach().cpu().contiguous().view(int_dtype).to(torch.int64)
        magnitude = bits & magnitude_bits
        return torch.where(bits < 0, -magnitude, magnitude)

    return (ordered(actual) - ordered(expected)).abs()


def ulp_mismatch(actual: torch.Tensor, expected: torch.Tensor, tol: UlpTolerance = HF_PARITY, *,
                 ignore_below: float = 0.0) -> str | None:
    """None when ``actual`` is within ``tol`` of ``expected`` (both in the output dtype), else a report.

    NaNs must sit where ``expected`` has them and infinities must be equal. Elements where both
    magnitudes are below ``ignore_below`` are not compared (the far tail of a function that
    underflows, where a kernel may be more accurate than the module it replaces).
    """
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    got, want = actual.detach().cpu(), expected.detach().cpu()
    nan_mismatch = torch.isnan(got) != torch.isnan(want)
    if nan_mismatch.any():
        index = tuple(nan_mismatch.nonzero()[0].tolist())
        return f"NaN where the expected has none (or vice versa) at {index}: got {got[index].item()}, want {want[index].item()}"
    inf_mismatch = (torch.isinf(got) | torch.isinf(want)) & (got != want)
    if inf_mismatch.any():
        index = tuple(inf_mismatch.nonzero()[0].tolist())
        return f"infinity mismatch at {index}: got {got[index].item()}, want {want[index].item()}"
    compared = torch.isfinite(want) & ((got.abs() >= ignore_below) | (want.abs() >= ignore_below))
    got, want = got[compared], want[compared]
    if want.numel() == 0:
        return None
    distance = ulp_distance(got, want)
    inexact = int((distance > 0).sum())
    share = inexact / distance.numel()
    worst = int(distance.max())
    if worst <= tol.max_ulps and share <= tol.max_inexact:
        return None
    counts = ", ".join(f"{d} ulp: {int((distance == d).sum())}" for d in distance.unique()[:4].tolist())
    at = int(distance.argmax())
    return (f"{inexact} of {distance.numel()} elements ({share:.2%}) differ in {actual.dtype} (allowed: "
            f"{tol.max_inexact:.2%}, each by <= {tol.max_ulps} ulp); worst {worst} ulp: got {got[at].item():.8g}, "
            f"want {want[at].item():.8g} ({counts})")


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, tol: UlpTolerance = HF_PARITY, *,
                       ignore_below: float = 0.0) -> None:
    problem = ulp_mismatch(actual, expected, tol, ignore_below=ignore_below)
    if problem is not None:
        raise AssertionError(problem)
