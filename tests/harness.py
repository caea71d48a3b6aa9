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
   outside the views), and that the forced provider really ran, with every op it runs inside
   (``Op.run_inside``) on that provider too.

A provider that declines a case fails it, unless the case declares the decline and why
(``Case(expected_decline=...)``): then the case is skipped with that reason, and a declared
decline that does not happen fails too. A DSL that silently stops accepting its cases cannot
turn a tier green.

Porting a kernel to a new DSL or device = adding a provider to the op and running its tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.ops.registry import Op
from hw_agnostic.tolerances import least_precise, mismatch, ulp_distance


@dataclasses.dataclass(frozen=True)
class Case:
    """One input set: ``make()`` returns the op's positional arguments (fresh tensors).

    ``expected_decline``: why the op's DSL providers are expected to decline this case (the
    reference runs it), as one reason for all of them or ``{provider: reason}``.
    ``conditioning``: how much the inputs amplify a correct kernel's rounding (see
    :func:`hw_agnostic.tolerances.mismatch`); the case says why where it sets it.
    """

    id: str
    make: Callable[[], tuple[Any, ...]]
    config: dict[str, Any] | None = None
    expected_decline: str | Mapping[str, str] | None = None
    conditioning: float = 1.0

    def __repr__(self) -> str:
        return self.id

    def decline_expected_from(self, provider: str) -> str | None:
        if isinstance(self.expected_decline, Mapping):
            return self.expected_decline.get(provider)
        return self.expected_decline


#: Prefix of the skip reason of a declared decline (tests/expected_skips.py allows it).
EXPECTED_DECLINE = "expected decline"


def dsl_providers(op: Op) -> list[str]:
    """The op's DSL providers that target where kernels run in this process.

    A provider built for other devices or another CPU interpreter is not listed (it is not
    meant to run here); one that should run here but is unavailable (Helion missing) is, so its
    tests fail instead of vanishing. In compile-for-target mode the providers generating Triton
    are listed (their launches compile for the targets).
    """
    from hw_agnostic.kernels import targets
    from hw_agnostic.kernels.interpret import interpreter_mode

    from tests.conftest import kernel_device

    device, mode = kernel_device(), interpreter_mode()
    if mode is None and targets.active_mode() is not None:
        # Compile-for-target mode: every provider that generates Triton compiles its launches.
        mode = "triton"
    return [p.name for p in op.providers if p.name != "reference" and (
        device is None or device in p.devices or (device == "cpu" and mode in p.interpreters))]


def fuzz_examples(triton: int, elsewhere: int) -> int:
    """How many examples a DSL fuzz test draws in this process: the Triton interpreter costs
    milliseconds per program instance and a code generation per new specialisation; Helion's
    eager mode and GPUs cost far less, so they draw more. Compile-for-target mode compiles each
    new specialisation for every target: as few as the Triton interpreter."""
    from hw_agnostic.kernels import targets
    from hw_agnostic.kernels.interpret import interpreter_mode

    return triton if interpreter_mode() == "triton" or targets.active_mode() is not None else elsewhere


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


def check_provider(op: Op, provider: str, case: Case, device: str) -> Any:
    """The checks of the module docstring on one case; returns the op's result for further checks."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device.type != device else a for a in case.make())
    names = list(inspect.signature(op.reference).parameters)
    mutated = {names.index(n) for n in op.mutates_args}

    reason = next(p for p in op.providers if p.name == provider).why_not(op.key(*args))
    declared = case.decline_expected_from(provider)
    if reason is not None:
        if declared is None:
            pytest.fail(f"{provider} declines case {case.id}: {reason}. A decline is a failure unless the case "
                        "declares it: Case(expected_decline=...)", pytrace=False)
        pytest.skip(f"{EXPECTED_DECLINE}: {op.name} on {provider}: {declared} ({reason})")
    if declared is not None:
        pytest.fail(f"case {case.id} declares that {provider} declines it ({declared}), but {provider} runs it: "
                    "drop the declaration", pytrace=False)

    expected_args = tuple(_float64(a) for a in args)
    expected = _flatten(op.reference(*expected_args))
    own_dtype_args = (a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    own_dtype = _flatten(op.reference(*own_dtype_args))  # the spec with its own roundings
    expected_dtypes = [t.dtype for t in own_dtype]
    bases = {i: _base(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    before = {i: b.clone() for i, b in bases.items()}

    with ops.use_provider(provider, op), contextlib.ExitStack() as stack:
        if case.config is not None:
            stack.enter_context(ops.use_config(op, case.config))
        with poisoned_allocations(), ops.trace_dispatch() as ran:
            result = op(*args)
    assert ran and ran[0].op == op.name and all(p.provider == provider for p in ran), (
        f"expected {op.name} (and every op it runs inside) on {provider}, ran {[p.describe() for p in ran]}")

    actual = _flatten(result)
    assert len(actual) == len(expected), f"{len(actual)} outputs, the reference returns {len(expected)}"
    inputs_precision = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for index, (got, want, spec, dtype) in enumerate(zip(actual, expected, own_dtype, expected_dtypes)):
        assert got.dtype == dtype, f"output {index} has dtype {got.dtype}, the reference gives {dtype}"
        if not dtype.is_floating_point:  # ids, offsets, counts: exact
            assert torch.equal(got.cpu(), want.cpu()), f"output {index} differs from the reference:\n{got}\n{want}"
            continue
        problem = mismatch(_spec_roundings_as_exact(got, spec, want), want, least_precise(dtype, *inputs_precision),
                           conditioning=case.conditioning)
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
    return result


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` calls a NaN unequal to itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh dense copy: ``contiguous()`` keeps a one-element view's stride, which ``view`` refuses.
    return torch.empty(t.numel(), dtype=t.dtype, device=t.device).copy_(t.reshape(-1)).view(torch.uint8)


def _spec_roundings_as_exact(got: torch.Tensor, spec: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``got`` in float64, with the elements within one ulp of the spec run in its own dtype
    replaced by the float64 values: the table bounds the distance to float64, but where the
    spec's own roundings cancel (two experts' outputs of opposite sign summed in fp16) the spec
    itself lands further away, and a kernel that reproduces the spec is right."""
    got64 = got.detach().cpu().to(torch.float64)
    if got.dtype == torch.float64 or spec.dtype != got.dtype or spec.shape != got.shape:
        return got64
    same_as_spec = ulp_distance(got.detach().cpu(), spec.detach().cpu()) <= 1
    return torch.where(same_as_spec, exact.detach().cpu().to(torch.float64), got64)


def _view_of(base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """The same view of another tensor shaped like ``view``'s base."""
    offset = view.storage_offset() - (view._base.storage_offset() if view._base is not None else 0)
    return base.as_strided(view.shape, view.stride(), base.storage_offset() + offset)
