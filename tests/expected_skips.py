"""The skips each test tier may have, and why. Any other skip fails its test (see conftest.py).

A tier is where a test process runs kernels: ``reference`` (no GPU, no interpreter), ``triton``
(``TRITON_INTERPRET=1``), ``helion`` (``HELION_INTERPRET=1``), ``compile``
(``HW_AGNOSTIC_COMPILE_TARGETS``: compiled for GPU targets, results from the reference) or ``gpu``. Each entry is a regular
expression matched against the start of the skip reason, and the justification printed with the
tier's skip counts at the end of the run. A harness case a provider declines is allowed only as
an *expected decline*, which the case itself declares, with its reason (``tests/harness.py``).
"""

from __future__ import annotations

from tests.harness import EXPECTED_DECLINE

_DECLARED = (EXPECTED_DECLINE, "declared by the case, with its reason (the reference runs it)")
_NO_KERNELS = (r"no GPU and no CPU interpreter|no device runs kernels here",
               "DSL tests: they run in the TRITON_INTERPRET=1 and HELION_INTERPRET=1 tiers of `make test`, and on GPUs")
_GPU = ("needs a GPU", "GPU-only checks (serving sizes, CUDA graphs, tuning); this machine has none")
_TRITON_ONLY = (r"needs TRITON_INTERPRET=1|configs only matter under the Triton interpreter",
                "fixes and configs specific to the Triton interpreter, tested in its own tier")
_HELION_ONLY = ("needs HELION_INTERPRET=1", "fixes specific to Helion's interpreter, tested in its own tier")
_CPU_ONLY = (r"checks a CPU-only machine|checks the plain CPU path", "checks of the CPU fallback path")
_OLDER_TRANSFORMERS = (r"the installed transformers has no|transformers\.models\.\S+ has no",
                       "HF modules of families newer than the installed transformers (the GPU image has 5.17)")
_ZOO = ("cannot be built offline", "zoo families that do not build or run offline at tiny size, each listed with why "
        "in tests/zoo/families.py (the test fails if one starts working)")

EXPECTED_SKIPS: dict[str, tuple[tuple[str, str], ...]] = {
    "reference": (_NO_KERNELS, _GPU, _TRITON_ONLY, _HELION_ONLY, _ZOO, _OLDER_TRANSFORMERS),
    "triton": (_DECLARED, _GPU, _HELION_ONLY, _CPU_ONLY, _OLDER_TRANSFORMERS),
    "helion": (_DECLARED, _GPU, _TRITON_ONLY, _CPU_ONLY, _OLDER_TRANSFORMERS),
    "compile": (_DECLARED, _GPU, _TRITON_ONLY, _HELION_ONLY, _CPU_ONLY, _OLDER_TRANSFORMERS),
    "gpu": (_DECLARED, _TRITON_ONLY, _HELION_ONLY, _CPU_ONLY, _ZOO, _OLDER_TRANSFORMERS),
}
