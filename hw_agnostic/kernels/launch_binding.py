"""Launches bound to an op's call signature: Helion's host code runs once per signature, not per call.

Helion's generated host function reads the sizes and strides of its tensor arguments, computes
the grid and calls a launcher with the kernel, the grid, the tensors, those integers and the
scalars: 2-7 µs of Python per launch at decode sizes. For one call signature of an op (the shapes,
strides, dtypes, devices and scalar values its dispatch keys each call on) all of that is the same
on every call but the tensors. So an op's run can hand out, per signature (``run.bind(args)``,
which dispatch calls once per signature; :func:`bindable` makes it), a copy of itself whose kernels
are :class:`BoundLaunch` es: the first call runs the host code and records the launch; later calls give the launcher the
recorded kernel, grid, integers and scalars with the call's own tensors, through a function
generated for that launch.

That holds only where everything the run hands to a kernel's host code follows from the call's
signature: tensors made from the call's (views, fresh outputs) or kept by the plan, integers from
sizes and scalar arguments; nothing read from a tensor's values. A run that binds must also call
each bound kernel once per call. A launch is replayed only where each tensor the launcher got is
one of the host function's arguments (not made inside it) and the host function returned nothing;
arguments the recording call passed twice (an in-place op's input and output) must be one tensor
again, or the host code runs (and keeps running) for that binding. :data:`CHECK_REPLAYS` (the
tests set it) runs the host code beside every replay and compares the launches. A run whose host
code takes views of its tensors (rows flattened from ``x``, a cache's slots) may offer the replay
the tensors themselves first (:func:`replayed`), and make the views only where it declines.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

#: Tests set it: every replay is compared with what the host code would launch (see module docstring).
CHECK_REPLAYS = False

_Launch = tuple[Any, tuple[Any, ...], tuple[Any, ...], dict[str, Any]]  # kernel, grid, arguments, options
_Replay = Callable[[tuple[Any, ...], Callable[..., Any]], bool]


def bindable(running: Callable[..., Callable[..., Any]], *launches: Any) -> Callable[..., Any]:
    """``running(*launches)``, an op's run over its kernels (each a :class:`HostLaunch`, or an object
    holding some with a ``bound()`` copy, see :func:`bound_copy`), with ``bind(args)``: the same run
    over copies bound to that call signature. Not under the Helion interpreter, which has no host code."""
    run = running(*launches)
    if all(callable(getattr(launch, "bound", None)) for launch in launches):
        run.bind = lambda args: running(*(launch.bound() for launch in launches))  # type: ignore[attr-defined]
    return run


def replayed(launch: Any, *args: Any) -> bool:
    """``launch.replays(*args)`` for a :class:`BoundLaunch`; False for any other kernel (a
    :class:`HostLaunch` records nothing, the Helion interpreter's kernels have no host code)."""
    replays = getattr(launch, "replays", None)
    return replays is not None and replays(*args)


def bound_copy(holder: Any, *names: str) -> Any:
    """A shallow copy of ``holder`` whose kernels (the attributes ``names``) are bound copies, where
    they can bind: the ``bound()`` of an object that runs several kernels, once each per call."""
    copied = copy.copy(holder)
    for name in names:
        launch = getattr(holder, name)
        if isinstance(launch, HostLaunch):
            setattr(copied, name, launch.bound())
    return copied


class HostLaunch:
    """A compiled kernel's host function with the launcher it launches through."""

    def __init__(self, host: Callable[..., Any], launcher: Callable[..., Any]) -> None:
        self.host, self.launcher = host, launcher

    def __call__(self, *args: Any) -> Any:
        return self.host(*args, _launcher=self.launcher)

    def bound(self) -> BoundLaunch:
        """A copy for the calls of one signature (see the module docstring)."""
        return BoundLaunch(self)


class BoundLaunch:
    """A :class:`HostLaunch` for the calls of one signature: recorded on the first, replayed after."""

    def __init__(self, source: HostLaunch) -> None:
        self.source = source
        self.replay: _Replay | None = None
        self.recorded = False  # once recorded, ``replay`` None means the host code runs every call

    def __call__(self, *args: Any) -> Any:
        replay = self.replay
        if replay is not None:
            if CHECK_REPLAYS:
                _check(self.source, replay, args)
            if replay(args, self.source.launcher):
                return None
            self.replay = None  # the arguments alias otherwise than when recorded
        if self.recorded:
            return self.source(*args)
        launches: list[_Launch] = []
        launcher = self.source.launcher

        def record(kernel: Any, grid: Any, *launch_args: Any, **options: Any) -> Any:
            launches.append((kernel, tuple(grid), launch_args, options))
            return launcher(kernel, grid, *launch_args, **options)

        result = self.source.host(*args, _launcher=record)
        self.replay = None if result is not None or not launches else _replay_function(launches, args)
        self.recorded = True
        return result

    def replays(self, *args: Any) -> bool:
        """Replay the recorded launches with ``args`` standing for the recording call's arguments,
        position for position, and say whether it did.

        A tensor of ``args`` may be another view of the memory the recorded one viewed: the one the
        run flattened into the rows its host code takes (``x`` for ``x.view(-1, hidden)``), with the
        same data pointer, dtype and device. Launchers read a tensor argument for those alone (its
        sizes and strides were read by the host code into the recorded integers), so a run skips
        making its views on every call but the recording one: about 1.3 us a view under ``no_grad``,
        two to four a call. False, launching nothing, before the first call has recorded, where
        the host code runs every call, where tensors passed twice are not one tensor, and while
        :data:`CHECK_REPLAYS` compares replays with the host code (which takes the views): the
        caller then makes its views and calls the launch."""
        replay = self.replay
        return replay is not None and not CHECK_REPLAYS and replay(args, self.source.launcher)


def _check(source: HostLaunch, replay: _Replay, args: tuple[Any, ...]) -> None:
    """Raise if replaying ``args`` launches other than the host code launches."""
    want: list[_Launch] = []
    got: list[_Launch] = []
    source.host(*args, _launcher=lambda k, grid, *a, **o: want.append((k, tuple(grid), a, o)))
    if replay(args, lambda k, grid, *a, **o: got.append((k, tuple(grid), a, o))) and (
            len(want) != len(got) or not all(_same_launch(w, g) for w, g in zip(want, got))):
        raise AssertionError(f"a bound launch replayed {got} where the host code launches {want}")


def _same_launch(want: _Launch, got: _Launch) -> bool:
    (kernel, grid, args, options), (kernel_got, grid_got, args_got, options_got) = want, got
    return (kernel is kernel_got and grid == grid_got and options == options_got and len(args) == len(args_got)
            and all(a is b if isinstance(a, torch.Tensor) else type(a) is type(b) and a == b
                    for a, b in zip(args, args_got)))


def _replay_function(launches: list[_Launch], args: tuple[Any, ...]) -> _Replay | None:
    """``replay(args, launcher)`` making ``launches`` with the tensors of ``args`` in the places the
    recording call's took (True), or False, launching nothing, where tensors the recording call
    passed more than once (an in-place op's input and output) are not the same tensor in ``args``;
    None where a launched tensor is not one of ``args``."""
    positions: dict[int, list[int]] = {}
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            positions.setdefault(id(arg), []).append(index)
    namespace: dict[str, Any] = {}
    lines, aliased = [], set()
    for n, (kernel, grid, launch_args, options) in enumerate(launches):
        if any(isinstance(value, torch.Tensor) for value in options.values()):
            return None
        namespace[f"kernel{n}"], namespace[f"grid{n}"], namespace[f"options{n}"] = kernel, grid, options
        parts = []
        for m, arg in enumerate(launch_args):
            if isinstance(arg, torch.Tensor):
                found = positions.get(id(arg))
                if found is None:  # made inside the host code
                    return None
                if len(found) > 1:
                    aliased.add(tuple(found))
                parts.append(f"a[{found[0]}]")
            else:
                namespace[f"c{n}_{m}"] = arg
                parts.append(f"c{n}_{m}")
        lines.append(f"    launch(kernel{n}, grid{n}, {', '.join(parts)}, **options{n})")
    same = [f"a[{group[0]}] is a[{other}]" for group in sorted(aliased) for other in group[1:]]
    check = [f"    if not ({' and '.join(same)}):", "        return False"] if same else []
    source = "\n".join(["def replay(a, launch):", *check, *lines, "    return True"]) + "\n"
    exec(_compiled(source), namespace)  # noqa: S102 - source built from positions only
    return namespace["replay"]


@functools.lru_cache(maxsize=256)
def _compiled(source: str) -> types.CodeType:
    """The code of a replay's source. Sources repeat: a decode step's paged attention gets a new call
    signature at every context length (its ``max_kv_len``) and rebinds to the same launches; compiling
    took about 150 µs of each step's host time, running the compiled code a few."""
    return compile(source, "<bound launch>", "exec")
