"""Launch configs of the norm kernels that work on ``[rows, groups, width]`` views.

``layer_norm`` (per-head weights: a group is a head) and ``gated_rms_norm`` (group-wise
normalisation) tile over rows and groups and keep a group's ``width`` elements in registers, or
loop over them in chunks when a group is wider than :data:`PERSISTENT_LIMIT` (Helion's looped
reduction, ``reduction_loops``). Keys: ``{"dtype", "width", "groups", "tokens"}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .interpret import interpreter_mode
from .runtime import Config, next_power_of_2

PERSISTENT_LIMIT = 16384
_ELEMENTS_PER_PROGRAM = 2048
# The Triton interpreter costs milliseconds per program: few, large programs.
_INTERPRETED_ELEMENTS_PER_PROGRAM = 16384


def _num_warps(elements: int) -> int:
    return min(16, max(1, next_power_of_2(elements) // 512))


def _dims(key: Mapping[str, Any]) -> tuple[int, int, int]:
    return int(key["width"]), max(int(key["groups"]), 1), max(int(key["tokens"]), 1)


def default_config(key: Mapping[str, Any]) -> Config:
    width, groups, tokens = _dims(key)
    chunk = None if width <= PERSISTENT_LIMIT else 4096
    resident = min(next_power_of_2(width), chunk or next_power_of_2(width))
    interpreted = interpreter_mode() == "triton"
    budget = _INTERPRETED_ELEMENTS_PER_PROGRAM if interpreted else _ELEMENTS_PER_PROGRAM
    block_groups = min(next_power_of_2(groups), max(1, budget // resident))
    block_rows = min(next_power_of_2(tokens), max(1, budget // (resident * block_groups)))
    if interpreted:
        block_rows = min(block_rows, 64)
    return {
        "block_sizes": [block_rows, block_groups],
        "reduction_loops": [chunk],
        "num_warps": _num_warps(block_rows * block_groups * resident),
        "num_stages": 1,
    }


def candidate_configs(key: Mapping[str, Any]) -> list[Config]:
    width, groups, tokens = _dims(key)
    candidates = [default_config(key)]
    for rows in (1, 2, 4, 8, 16, 32):
        if rows > next_power_of_2(tokens):
            continue
        for block_groups in (1, 2, 4, 8, 16):
            if block_groups > next_power_of_2(groups):
                continue
            for chunk in (None, 1024, 2048, 4096, 8192):
                if chunk is not None and chunk >= next_power_of_2(width):
                    continue
                if chunk is None and width > 4 * PERSISTENT_LIMIT:
                    continue
                if rows * block_groups * min(next_power_of_2(width), chunk or PERSISTENT_LIMIT) > 65536:
                    continue
                for warps in (1, 2, 4, 8, 16, 32):
                    config = {"block_sizes": [rows, block_groups], "reduction_loops": [chunk], "num_warps": warps,
                              "num_stages": 1}
                    if config not in candidates:
                        candidates.append(config)
    return candidates
