"""The compile tier: these tests run only with ``HW_AGNOSTIC_COMPILE_TARGETS`` set (``make test-compile``).

They compile kernels for GPU targets with Triton's backends, which takes seconds per kernel, so
the other tiers do not collect them (tests/conftest.py); the interpreter tiers could not run them
anyway (kernels generated under an interpreter do not compile).
"""

from __future__ import annotations

import pytest

from hw_agnostic.kernels import targets


@pytest.fixture
def all_targets() -> list[str]:
    """The targets the tier compiles for (all of them, unless the variable names fewer)."""
    mode = targets.active_mode()
    assert mode is not None
    return [t.name for t in mode.targets]
