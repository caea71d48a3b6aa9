"""Ops that run other ops inside them: the inner call is traced, and forcing reaches it (``Op.run_inside``).

Two toy ops on the CPU: ``test_outer`` doubles its input through ``test_inner`` on its ``fast``
provider; ``test_inner`` has ``fast`` (which declines negative sums) and ``exotic`` providers
besides the reference, and ``test_outer`` has no ``exotic``.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.ops.registry import PROVIDER_ENV, Op, Provider, ProviderError


class _Key(NamedTuple):
    device: str
    tokens: int
    negative: bool


def _key(x: torch.Tensor) -> _Key:
    return _Key(x.device.type, x.shape[0], bool(x.sum() < 0))


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError("x must be a torch.Tensor")


def _inner_reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _outer_reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


CPU = frozenset({"cpu"})
inner_op = Op("test_inner", _inner_reference, check=_check, key=_key, providers=[
    Provider("fast", lambda key, config, args: _inner_reference, devices=CPU,
             accepts=lambda key: "declines negative sums" if key.negative else None),
    Provider("exotic", lambda key, config, args: _inner_reference, devices=CPU),
])
outer_op = Op("test_outer", _outer_reference, check=_check, key=_key, providers=[
    Provider("fast", lambda key, config, args: lambda x: inner_op.run_inside("test_outer", x) + 1, devices=CPU),
])


def _ran(record) -> list[tuple[str, str]]:
    return [(plan.op, plan.provider) for plan in record]


def test_the_inner_call_is_traced_after_its_caller():
    with ops.trace_dispatch() as ran:
        assert torch.equal(outer_op(torch.ones(3)), torch.full((3,), 3.0))
    assert _ran(ran) == [("test_outer", "fast"), ("test_inner", "fast")]


def test_forcing_the_caller_forces_the_inner_op():
    with ops.use_provider("fast", outer_op), ops.trace_dispatch() as ran:
        outer_op(torch.ones(3))
    assert _ran(ran) == [("test_outer", "fast"), ("test_inner", "fast")]


def test_forcing_the_inner_op_itself_wins():
    with ops.use_provider("fast", outer_op), ops.use_provider("reference", inner_op), ops.trace_dispatch() as ran:
        outer_op(torch.ones(3))
    assert _ran(ran) == [("test_outer", "fast"), ("test_inner", "reference")]


def test_forcing_by_environment_reaches_the_inner_op(monkeypatch):
    monkeypatch.setenv(PROVIDER_ENV, "test_outer=fast")
    ops.reset()
    with ops.trace_dispatch() as ran:
        outer_op(torch.ones(3))
    assert _ran(ran) == [("test_outer", "fast"), ("test_inner", "fast")]


def test_an_inherited_provider_that_cannot_run_the_inner_call_raises():
    with ops.use_provider("fast", outer_op), pytest.raises(ProviderError, match="inside test_outer.*negative sums"):
        outer_op(-torch.ones(3))
    with ops.trace_dispatch() as ran:  # unforced, the inner op falls back to its next provider
        outer_op(-torch.ones(3))
    assert _ran(ran) == [("test_outer", "fast"), ("test_inner", "exotic")]


def test_forcing_a_provider_the_inner_op_lacks_leaves_it_unforced():
    only_outer = Op("test_outer_only", _outer_reference, check=_check, key=_key, providers=[
        Provider("special", lambda key, config, args: lambda x: inner_op.run_inside("test_outer_only", x) + 1,
                 devices=CPU),
    ])
    with ops.use_provider("special", only_outer), ops.trace_dispatch() as ran:
        only_outer(torch.ones(3))
    assert _ran(ran) == [("test_outer_only", "special"), ("test_inner", "fast")]


def test_a_plan_made_under_inherited_forcing_is_not_reused_by_direct_calls():
    """A direct call picks its provider as if nothing were forced, whatever ran inside a forced caller."""
    reordered = Op("test_inner_reordered", _inner_reference, check=_check, key=_key, providers=[
        Provider("exotic", lambda key, config, args: _inner_reference, devices=CPU),
        Provider("fast", lambda key, config, args: _inner_reference, devices=CPU),
    ])
    caller = Op("test_outer_reordered", _outer_reference, check=_check, key=_key, providers=[
        Provider("fast", lambda key, config, args: lambda x: reordered.run_inside("test_outer_reordered", x) + 1,
                 devices=CPU),
    ])
    x = torch.ones(3)
    with ops.use_provider("fast", caller), ops.trace_dispatch() as ran:
        caller(x)
        reordered(x)  # not forced: its first provider
    assert _ran(ran) == [("test_outer_reordered", "fast"), ("test_inner_reordered", "fast"),
                         ("test_inner_reordered", "exotic")]
