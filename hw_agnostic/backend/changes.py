"""What rewiring does to a model, as changes that can be undone and applied again.

Every rewiring rule returns :class:`Change` objects, already applied. Verification undoes and
reapplies them (in any subset) to find which ones make the model compute something else, and
undoes those for good; the report lists the ones left standing. A change holds the original
module (or forward, or class) until :meth:`Change.release` drops it: originals share their
weights with the replacement (merged projections become views of the merged weight), so holding
them costs no weight memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

#: Change kinds, in the order rewiring applies them (verification bisects in this order too).
KINDS = ("norm", "mlp", "qkv", "attention", "rotary", "fused", "experts", "router", "linear")


@dataclasses.dataclass(eq=False)
class Change:
    kind: str
    path: str
    original: str  # class name of what was there
    result: str  # class name of the replacement, or the fused layout
    detail: str  # what was read from the instance
    _apply: Callable[[], None] | None
    _undo: Callable[[], None] | None
    active: bool = True
    converters: tuple[Any, ...] = ()  # checkpoint converters that save this change under the original keys

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown change kind {self.kind!r} (kinds: {', '.join(KINDS)})")

    def apply(self) -> None:
        if not self.active:
            self._require("apply")
            self._apply()
            self.active = True

    def undo(self) -> None:
        if self.active:
            self._require("undo")
            self._undo()
            self.active = False

    def release(self) -> None:
        """Forget the original (the change can no longer be undone or reapplied)."""
        self._apply = self._undo = None

    def _require(self, what: str) -> None:
        if self._apply is None or self._undo is None:
            raise RuntimeError(f"{self.kind} change at {self.path!r} was released; it cannot {what} any more")


def swap(parent: nn.Module, name: str, new: nn.Module) -> tuple[Callable[[], None], Callable[[], None]]:
    """Put ``new`` at ``parent.name`` now; the (apply, undo) pair that moves between it and the original."""
    old = getattr(parent, name)
    setattr(parent, name, new)
    return (lambda: setattr(parent, name, new)), (lambda: setattr(parent, name, old))


def undo_all(changes: list[Change]) -> None:
    for change in reversed(changes):
        change.undo()


def apply_only(changes: list[Change], keep: set[int]) -> None:
    """Make exactly the changes whose ``id`` is in ``keep`` active (in rewiring order)."""
    for change in reversed(changes):
        if id(change) not in keep:
            change.undo()
    for change in changes:
        if id(change) in keep:
            change.apply()
