"""Rewiring a bench's model, and saying so when it left anything as it was."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hw_agnostic import rewire
from hw_agnostic.backend.report import RewireReport


def rewired(model: torch.nn.Module, log: Callable[[str], None], suite: str) -> RewireReport:
    """``rewire(model)``, logging the report where a module was left: the suite's rows then measure
    part of the library beside the model's own code (a change undone after it raised, say), which a
    ratio alone would not show."""
    report = rewire(model)
    if report.left:
        log(f"{suite}: WARNING: rewire left {len(report.left)} module(s) as they were; these rows measure "
            f"part of the library:\n{report.table()}")
    return report
