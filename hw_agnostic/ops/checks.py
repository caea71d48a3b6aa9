"""Argument checks shared by the ops: each error names the op, the argument and what was expected.

They run on every call, so they only read tensor metadata (no synchronisation, no allocation)
and also work on fake tensors while ``torch.compile`` traces.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..kernels.runtime import INT32_MAX

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(op: str, name: str, value: Any, *, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
           min_dim: int = 1) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype {_dtype_names(dtypes)}; got {value.dtype}")
    if value.dim() < min_dim:
        raise ValueError(f"{op}: {name} must have at least {min_dim} dimension(s); got shape {tuple(value.shape)}")
    return value


def same_device(op: str, name: str, value: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if value.device != reference.device:
        raise ValueError(
            f"{op}: {name} is on {value.device} but {reference_name} is on {reference.device}; "
            "all tensors must be on one device"
        )


def same_shape(op: str, name: str, value: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if value.shape != reference.shape:
        raise ValueError(
            f"{op}: {name} must have the shape of {reference_name} {tuple(reference.shape)}; "
            f"got {tuple(value.shape)}"
        )


def same_dtype(op: str, name: str, value: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if value.dtype != reference.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {reference_name} ({reference.dtype}); got {value.dtype}")


def number(op: str, name: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{op}: {name} must be > 0, got {value}")
    return float(value)


def choice(op: str, name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def integer(op: str, name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{op}: {name} must be {bound}, got {value}")
    return value


def flag(op: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def matrix(op: str, name: str, value: Any, *, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> torch.Tensor:
    checked = tensor(op, name, value, dtypes=dtypes)
    if checked.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D; got shape {tuple(checked.shape)}")
    return checked


def vector(op: str, name: str, value: Any, length: int, reference_name: str, reference: torch.Tensor,
           *, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    checked = tensor(op, name, value, dtypes=dtypes)
    same_device(op, name, checked, reference_name, reference)
    if checked.shape != (length,):
        raise ValueError(f"{op}: {name} must have shape ({length},); got {tuple(checked.shape)}")


def kernel_dtype_problem(what: str, *dtypes: torch.dtype | None) -> str | None:
    """Why a kernel provider declines these dtypes (for its ``accepts``), or None."""
    for dtype in dtypes:
        if dtype is not None and dtype not in KERNEL_DTYPES:
            return f"{what} dtype {dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    return None


def rows_collapse(x: torch.Tensor, kept: int = 1) -> bool:
    """Whether ``x`` views as ``[rows, *x.shape[-kept:]]`` with one row stride (``x.view(-1, n)`` for
    ``kept=1``, ``x.view(-1, heads, n)`` for ``kept=2``)."""
    if x.dim() <= kept + 1 or x.is_contiguous():
        return True
    sizes, strides = x.shape, x.stride()
    for i in range(x.dim() - kept - 1):
        if sizes[i] != 1 and sizes[i + 1] != 1 and strides[i] != strides[i + 1] * sizes[i + 1]:
            return False
    # size-1 dims in the middle make the rule above skip a pair; let view decide those.
    if 1 in sizes[:-kept]:
        try:
            x.view(-1, *sizes[-kept:])
        except RuntimeError:
            return False
    return True


def needs_int64(*tensors: torch.Tensor | None) -> bool:
    """Whether an element offset of any tensor can exceed int32 (cheap: sizes and strides)."""
    for t in tensors:
        if t is None:
            continue
        if t.is_contiguous():
            if t.numel() > INT32_MAX:
                return True
            continue
        span = 0
        for size, stride in zip(t.shape, t.stride()):
            if size == 0:
                span = 0
                break
            span += (size - 1) * abs(stride)
        if span > INT32_MAX:
            return True
    return False


# --------------------------------------------------------------------------------------------
# memory overlap of arguments an op writes
#
# These run on every call of an op that writes an argument, so they cost a few dict lookups when
# the tensors are apart (the usual case): layouts are analysed once per (shape, strides).


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int, tuple[tuple[int, int], ...] | None]:
    """Element offsets ``[low, high]`` a layout spans, and its dims ``(stride, size)`` by stride,
    largest first, when no two elements share an offset (None when they may)."""
    low = high = 0
    for size, stride in zip(shape, strides):
        if stride >= 0:
            high += (size - 1) * stride
        else:
            low += (size - 1) * stride
    dims = sorted(((abs(st), sz) for sz, st in zip(shape, strides) if sz > 1), reverse=True)
    reach = 0  # the largest offset the smaller dims reach
    for stride, size in reversed(dims):
        if stride <= reach:
            return low, high, None
        reach += (size - 1) * stride
    return low, high, tuple(dims)


def address_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` that ``t``'s elements span, or None (empty, or no real memory)."""
    if type(t) is not torch.Tensor and isinstance(t, FakeTensor):  # tracing: no memory to compare
        return None
    try:
        start = t.data_ptr()  # functional tensors raise, meta tensors give 0
    except RuntimeError:
        return None
    numel = t.numel()
    if start == 0 or numel == 0:
        return None
    size = t.element_size()
    if t.is_contiguous():
        return start, start + numel * size
    low, high, _ = _layout(tuple(t.shape), t.stride())
    return start + low * size, start + (high + 1) * size


def _difference_reachable(difference: int, dims: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``difference = sum(t_k * stride_k)`` with ``|t_k| < size_k``: two tensors of this
    layout ``difference`` elements apart share an element. Strides are nested (each larger than
    what the smaller dims reach), so each dim leaves at most two candidates."""
    if not dims:
        return difference == 0
    (stride, size), rest = dims[0], dims[1:]
    reach = sum((n - 1) * st for st, n in rest)
    lowest = max(-(size - 1), -((reach - difference) // stride))  # ceil((difference - reach) / stride)
    highest = min(size - 1, (difference + reach) // stride)
    return any(_difference_reachable(difference - t * stride, rest) for t in range(lowest, highest + 1))


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory.

    Compares addresses, not storages, so two storages over one buffer (``torch.frombuffer``
    twice, an untyped-storage view, ``as_strided`` over another tensor's memory) are caught too.
    Where the address ranges meet, two tensors of one dtype and layout (``buf[..., ::2]`` and
    ``buf[..., 1::2]``; the K and V halves of one ``[blocks, 2, ...]`` cache) are compared
    element by element, exactly; other layouts whose ranges meet count as overlapping.
    """
    return _ranges_overlap(a, address_range(a), b, address_range(b))


def _ranges_overlap(a: torch.Tensor, span_a: tuple[int, int] | None, b: torch.Tensor,
                    span_b: tuple[int, int] | None) -> bool:
    if span_a is None or span_b is None or not (span_a[0] < span_b[1] and span_b[0] < span_a[1]):
        return False
    if a.device != b.device:
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return True
    dims = _layout(tuple(a.shape), a.stride())[2]
    gap, size = b.data_ptr() - a.data_ptr(), a.element_size()
    if dims is None or gap % size:
        return True
    return _difference_reachable(gap // size, dims)


def no_aliasing(op: str, written: tuple[tuple[str, torch.Tensor], ...],
                read: tuple[tuple[str, torch.Tensor | None], ...] = (), *, among_written: bool = True) -> None:
    """Raise ``ValueError`` naming the arguments if a tensor ``op`` writes has elements that share
    memory, or shares memory with another argument it writes (unless ``among_written=False``: the
    op writes them at data-dependent places) or reads (None: absent)."""
    for name, value in written:
        writable(op, name, value)
    spans = [(name, value, address_range(value)) for name, value in (*written, *read) if value is not None]
    for i, (name, value, span) in enumerate(spans[: len(written)]):
        for other_name, other, other_span in spans[(i + 1 if among_written else len(written)):]:
            if _ranges_overlap(value, span, other, other_span):
                raise ValueError(
                    f"{op}: {name} and {other_name} share memory; {name} is written while {other_name} is in "
                    "use, so each needs its own memory"
                )


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share an address (a stride 0, or strides that interleave).

    Conservative: a layout it cannot prove free of collisions counts as overlapping.
    """
    if t.is_contiguous():
        return False
    return _layout(tuple(t.shape), t.stride())[2] is None


def writable(op: str, name: str, value: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``value``, which ``op`` writes, has elements that alias each other."""
    if self_overlapping(value):
        raise ValueError(
            f"{op}: {name} has elements that share memory (shape {tuple(value.shape)}, strides "
            f"{tuple(value.stride())}: a stride of 0 or interleaving strides), so results written to it would "
            f"collide; pass a tensor whose elements each have their own memory (e.g. {name}.contiguous())"
        )
