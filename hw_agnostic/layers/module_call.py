"""Calling a child module from a layer's forward, minus ``nn.Module.__call__`` where it adds nothing;
reading a layer's own parameters and children, minus ``nn.Module.__getattr__``.

A decode step calls about ten child modules a layer; ``module(x)`` goes through two frames of
``nn.Module`` (``_wrapped_call_impl``, ``_call_impl``) before ``forward``, about 1 µs a call. And it
reads about fifteen parameters and children as attributes (``self.weight``, ``self.down_proj``),
each through ``nn.Module.__getattr__``: 0.6 µs a read (torch 2.13), where the dict it looks in
answers in 0.05.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.modules import module as _nn_module


def no_global_hooks() -> bool:
    """Whether no forward or backward hook is registered for every module (``register_module_*_hook``)."""
    return not (_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_backward_pre_hooks or _nn_module._global_backward_hooks)


def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``, without ``nn.Module.__call__``'s two frames where they would only
    call ``forward``: no hook of the module's or global ones, no ``module.compile()``, no ``__call__``
    of its class's own, no ``torch.jit`` tracing (what ``_call_impl`` checks before calling forward
    directly), no ``torch.fx`` symbolic tracing (which records a child's call as a node). The
    library's layers call their children through it: about 1 µs a call, 8-10 of a decode layer's
    222-225 µs (2 and 6 layers, interleaved in one process). Traced by Dynamo it is the plain call:
    each check here would be a guard the compiled graph evaluates on every call (Dynamo leaves a
    module call's hooks unguarded), and inside a graph the call costs nothing. A forward that calls
    several children checks the conditions outside the modules once (:func:`plain_calls`) and
    calls each through :func:`call_in`."""
    return call_in(plain_calls(), module, *args, **kwargs)


def plain_calls() -> bool:
    """Whether nothing outside the modules stands between a forward and its children's forwards:
    not compiling, no global module hooks, no ``torch.jit`` or ``torch.fx`` tracing. Checked once
    per forward for all its children (about 0.2 µs a check alone, 5-10 µs of a decode layer's host
    time in place when each of its nine child calls made it)."""
    return not (torch.compiler.is_compiling() or not no_global_hooks() or torch._C._get_tracing_state()
                or is_fx_symbolic_tracing())


def call_in(plain: bool, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """:func:`call` inside a forward that found ``plain = plain_calls()``: the module's own
    conditions (its hooks, a compiled call, its class's ``__call__``) are checked here."""
    if (not plain or module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
            or module._backward_hooks or module._compiled_call_impl is not None
            or type(module).__call__ is not nn.Module.__call__):
        return module(*args, **kwargs)
    return module.forward(*args, **kwargs)


def own_attributes(module: nn.Module, store: str, names: tuple[str, ...]) -> tuple[Any, ...]:
    """``tuple(getattr(module, name) for name in names)`` for parameters (``store="_parameters"``) or
    children (``"_modules"``), read from that dict of the module (see the module docstring) where that
    gives the same: where the module's class defines none of the names itself (a parametrization's
    generated class, or a plugin's, may define one as a property, which the attribute read would
    reach first), every name is in the dict (a deleted one raises the attribute's error), and
    outside a Dynamo trace (which reads attributes its own way, at no cost inside the graph)."""
    getter = None if torch.compiler.is_compiling() else _dict_getter(type(module), names)
    if getter is not None:
        try:
            return getter(module.__dict__[store])
        except KeyError:
            pass
    return tuple([getattr(module, name) for name in names])


@functools.lru_cache(maxsize=256)  # bounded: a parametrization makes a class per module
def _dict_getter(cls: type, names: tuple[str, ...]) -> Optional[Callable[[dict[str, Any]], tuple[Any, ...]]]:
    """What reads ``names`` out of a dict as a tuple (one C call for several names), or None where
    ``cls`` defines one of them itself."""
    if any(hasattr(cls, name) for name in names):
        return None
    if len(names) > 1:
        return operator.itemgetter(*names)
    name = names[0]
    return lambda values: (values[name],)
