"""Classes made at run time whose instances pickle and deep-copy.

Rewiring switches modules to classes it makes for them (``type(name, bases, namespace)``: a paged
class per attention class, a routed class per router class). Pickle stores an instance's class by
module and name, which a made class cannot be found under, so ``torch.save(model)`` failed.
:func:`made_by` adds to such a class's namespace a ``__reduce_ex__`` that names the importable
factory and arguments that make it instead; the factory returns the same class for the same
arguments (an ``lru_cache``), so instances pickled together are instances of one class again.
The rest is Python's default reduction (the instance's ``__dict__``, set by ``__setstate__``),
which ``copy.deepcopy`` uses too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def made_by(factory: Callable[..., type], *args: Any) -> dict[str, Any]:
    """Namespace entries for the class ``factory(*args)`` makes (``factory`` and ``args`` importable)."""
    return {"_hw_agnostic_made_by": (factory, args), "__reduce_ex__": _reduce_ex}


def _reduce_ex(self: Any, protocol: int) -> tuple[Any, ...]:
    factory, args = type(self)._hw_agnostic_made_by
    # (copyreg.__newobj__, (cls, *new_args), state, list items, dict items): the class swapped for its recipe
    _, (_, *new_args), *rest = object.__reduce_ex__(self, max(protocol, 2))
    return (_instance, (factory, args, *new_args), *rest)


def _instance(factory: Callable[..., type], args: tuple[Any, ...], *new_args: Any) -> Any:
    cls = factory(*args)
    return cls.__new__(cls, *new_args)
