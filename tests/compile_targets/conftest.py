"""The compile tier: these tests run only with ``HW_AGNOSTIC_COMPILE_TARGETS`` set (``make test-compile``).

They compile kernels for GPU targets with Triton's backends, which takes seconds per kernel, so
the other tiers skip them; the interpreter tiers could not run them anyway (kernels generated
under an interpreter do not compile).
"""

from __future__ import annotations

import pytest

from hw_agnostic.kernels import targets


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if targets.active_mode() is not None:
        return
    skip = pytest.mark.skip(reason=f"the compile tier: set {targets.TARGETS_ENV} (make test-compile)")
    for item in items:
        if item.path.is_relative_to(config.rootpath / "tests" / "compile_targets"):
            item.add_marker(skip)


@pytest.fixture
def all_targets() -> list[str]:
    """The targets the tier compiles for (all of them, unless the variable names fewer)."""
    mode = targets.active_mode()
    assert mode is not None
    return [t.name for t in mode.targets]
