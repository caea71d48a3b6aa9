"""The reference-vs-DSL harness: every DSL provider of an op, on every case, against float64.

An op's test module lists :class:`Case` objects (shapes, strides, dtypes, argument variants,
optionally an explicit kernel config) and calls :func:`check_provider` for each DSL provider
that can run in this process (:func:`dsl_providers`). For each case the harness

1. builds the inputs, keeping each input's whole underlying buffer (so writes outside a
   strided view are caught),
2. evaluates the op's reference on float64 copies of the inputs: the expected results,
3. runs the op with the provider forced (and the case's config, if any) while PyTorch fills
   every new allocation with NaN, so an output element the kernel never writes fails,
4. checks the results against the expected ones with the tolerance table, the output dtypes
   against the reference's, the in-place contract (declared-mutated arguments hold the
   expected values, all others are bit-for-bit unchanged, and so is every buffer element
   outside the views), and that the forced provider really ran.

Porting a kernel to a new DSL or device = adding a provider to the op and running its tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.ops.registry import Op
from hw_agnostic.tolerances import least_precise, mismatch


@dataclasses.dataclass(frozen=True)
class Case:
    """One input set: ``make()`` returns the op's positional arguments (fresh tensors)."""

    id: str
    make: Callable[[], tuple[Any, ...]]
    config: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return self.id


def dsl_providers(op: Op) -> list[str]:
    return [p.name for p in op.providers if p.name != "reference"]


def seeded_generator(name: str) -> torch.Generator:
    """A generator seeded from a case's name: each case draws the same inputs on every run."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Every ``torch.empty`` inside the block is filled with NaN (or the max integer)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64).clone()
    return value


def _flatten(result: Any) -> list[torch.Tensor]:
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return [r for r in result if isinstance(r, torch.Tensor)]


def check_provider(op: Op, provider: str, case: Case, device: str) -> None:
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device.type != device else a for a in case.make())
    names = list(inspect.signature(op.reference).parameters)
    mutated = {names.index(n) for n in op.mutates_args}

    reason = next(p for p in op.providers if p.name == provider).why_not(op.key(*args))
    if reason is not None:
        pytest.skip(f"{provider} declines this case: {reason}")

    expected_args = tuple(_float64(a) for a in args)
    expected = _flatten(op.reference(*expected_args))
    own_dtype_args = (a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    expected_dtypes = [t.dtype for t in _flatten(op.reference(*own_dtype_args))]
    bases = {i: _base(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    before = {i: b.clone() for i, b in bases.items()}

    with ops.use_provider(provider, op), contextlib.ExitStack() as stack:
        if case.config is not None:
            stack.enter_context(ops.use_config(op, case.config))
        with poisoned_allocations(), ops.trace_dispatch() as ran:
            result = op(*args)
    assert [p.provider for p in ran] == [provider], f"expected {provider} to run, ran {[p.describe() for p in ran]}"

    actual = _flatten(result)
    assert len(actual) == len(expected), f"{len(actual)} outputs, the reference returns {len(expected)}"
    inputs_precision = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for index, (got, want, dtype) in enumerate(zip(actual, expected, expected_dtypes)):
        assert got.dtype == dtype, f"output {index} has dtype {got.dtype}, the reference gives {dtype}"
        if not dtype.is_floating_point:  # ids, offsets, counts: exact
            assert torch.equal(got.cpu(), want.cpu()), f"output {index} differs from the reference:\n{got}\n{want}"
            continue
        problem = mismatch(got, want, least_precise(dtype, *inputs_precision))
        assert problem is None, f"output {index}: {problem}"

    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        if i in mutated:
            problem = mismatch(arg, expected_args[i], arg.dtype)
            assert problem is None, f"in-place argument {names[i]}: {problem}"
            outside = torch.ones_like(bases[i], dtype=torch.bool)
            _view_of(outside, arg).fill_(False)
            assert _same_bits(bases[i][outside], before[i][outside]), f"{names[i]}: elements outside the view changed"
        else:
            assert _same_bits(bases[i], before[i]), f"argument {names[i]} (or its buffer) was modified"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` calls a NaN unequal to itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _view_of(base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The same view of another tensor shaped like ``view``'s base."""
    offset = view.storage_offset() - (view._base.storage_offset() if view._base is not None else 0)
    return base.as_strided(view.shape, view.stride(), base.storage_offset() + offset)
