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


#: The target of each backend that rule and model tests compile for, where the tier has it: the
#: H100/H200's and MI300's.
HEADLINE_TARGETS = {"cuda": "sm_90", "hip": "gfx942"}


@pytest.fixture
def one_target_per_backend(all_targets) -> list[str]:
    """A target of each backend (CUDA, HIP) among the tier's, its headline one where present: for
    tests of a rule's mechanism, the same code for every target of a backend, and of whole models.
    Each target meets every kernel's default configs in the per-op walk (test_default_configs). A
    cold compile of a large kernel takes seconds per target: five for each such test made the tier's
    clean run take twice as long."""
    by_backend: dict[str, list[str]] = {}
    for target in targets.active_mode().targets:
        if target.name in all_targets:
            by_backend.setdefault(target.backend, []).append(target.name)
    return [HEADLINE_TARGETS[backend] if HEADLINE_TARGETS.get(backend) in names else names[0]
            for backend, names in by_backend.items()]
