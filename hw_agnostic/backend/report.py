"""What a rewire did: replaced modules, fused decoder layers, and what was left and why."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # "replaced", "fused" or "left"
    path: str
    original: str  # class of the module found there
    result: str  # class it was replaced by, the fused layout, or "" when left
    detail: str  # what was read from the instance, or why it was left


@dataclasses.dataclass
class RewireReport:
    entries: list[Entry] = dataclasses.field(default_factory=list)
    #: what whole-model verification found (:class:`hw_agnostic.backend.verify.Outcome`), if it ran
    verification: Any = None

    def add(self, kind: str, path: str, original: Any, result: str = "", detail: str = "") -> None:
        """``original``: the module found at ``path``, its class, or its class name."""
        if not isinstance(original, str):
            original = (original if isinstance(original, type) else type(original)).__name__
        self.entries.append(Entry(kind, path, original, result, detail))

    def retract(self, path: str, result: str) -> None:
        """Drop the ``replaced``/``fused`` entry of a change that was undone later (a module may
        hold several: an attention paged and its rotary routed, a layer fused and linked)."""
        self.entries = [e for e in self.entries if e.kind == "left" or (e.path, e.result) != (path, result)]

    @property
    def replaced(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "replaced"]

    @property
    def fused(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "fused"]

    @property
    def left(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "left"]

    def count(self, result: str) -> int:
        """How many modules were replaced by (or fused as) ``result``."""
        return sum(1 for e in self.entries if e.kind != "left" and e.result == result)

    def as_rows(self) -> list[dict[str, str]]:
        return [dataclasses.asdict(e) for e in self.entries]

    def table(self) -> str:
        """The entries as a text table, identical rows of numbered layers folded together."""
        grouped: dict[tuple[str, str, str, str, str], list[str]] = defaultdict(list)
        for e in self.entries:
            pattern = re.sub(r"\.(\d+)\.", ".{i}.", e.path)
            grouped[(e.kind, pattern, e.original, e.result, e.detail)].append(e.path)
        rows = []
        for (kind, pattern, original, result, detail), paths in grouped.items():
            where = paths[0] if len(paths) == 1 else f"{pattern} (x{len(paths)})"
            rows.append((kind, where, original, result or "-", detail))
        headers = ("", "module", "was", "now", "detail")
        widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(5)]
        widths[4] = min(widths[4], 90)

        def line(values: tuple) -> str:
            return "  ".join(str(v)[:widths[i]].ljust(widths[i]) for i, v in enumerate(values)).rstrip()

        summary = (f"{len(self.replaced)} replaced, {len({e.path for e in self.fused})} decoder layers fused, "
                   f"{len(self.left)} left as they were")
        if self.verification is not None:
            summary += f"; {self.verification.describe()}"
        return "\n".join([summary, line(headers), line(tuple("-" * w for w in widths)), *map(line, rows)])

    def __str__(self) -> str:
        return self.table()
