"""Helion's NaN-propagating max/min for the Triton interpreter (see :mod:`.interpret`, fix 5).

Same results as ``helion.runtime.triton.helpers``: 16-bit inputs reduce in 32 bits, and a NaN
anywhere in the reduced range gives NaN; but through ``tl.max``/``tl.min``, which the
interpreter runs in numpy instead of one Python call per element. Imported only under
``TRITON_INTERPRET=1``.
"""

import triton
import triton.language as tl
from helion.runtime.triton.helpers import _promote_to_32_bits


@triton.jit
def _nan_where_any(result, x, dim: tl.constexpr):
    """``result`` with NaN wherever the reduced range of ``x`` held one."""
    if tl.constexpr(x.dtype.is_floating()):
        nan_in = tl.max((x != x).to(tl.int32), dim) > 0
        result = tl.where(nan_in, tl.full(result.shape, float("nan"), result.dtype), result)
    return result


@triton.jit
def max_propagate_nan(x, dim: tl.constexpr):
    x = _promote_to_32_bits(x)
    return _nan_where_any(tl.max(x, dim), x, dim)


@triton.jit
def min_propagate_nan(x, dim: tl.constexpr):
    x = _promote_to_32_bits(x)
    return _nan_where_any(tl.min(x, dim), x, dim)
