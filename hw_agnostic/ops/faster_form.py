"""Between forms of one call that compute the same bits, the one that is faster on this machine.

Which of two bit-identical forms is faster depends on the CPU, the sizes and the threads: the
activations' fused compiled pass and their eager chain of ATen kernels traded places between an
AVX-512 Xeon and an AVX2 EPYC, and with the width and rows on one machine (SiLU-and-mul on the
EPYC, bf16: 16 x 2048 fused 37 against the chain's 53 us, 256 x 2048 483 against 413). So a call
signature's forms are timed on its first calls themselves: each form runs once untimed (a first
call may compile or allocate), then they take turns for :data:`TIMED_CALLS` calls each, and the
form with the fastest call runs every call after. Every call returns its form's result, and the
forms' results are the same bits, so which form runs is never visible but in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Timed calls per form before the choice (after its untimed first call); the fastest of them counts,
#: since load on the machine only adds to a call.
TIMED_CALLS = 3


class FasterForm:
    """Calls ``forms`` (callables computing the same bits) in turn, then only the fastest (see above)."""

    def __init__(self, *forms: Callable[..., Any]) -> None:
        if len(forms) < 2:
            raise ValueError(f"FasterForm needs at least two forms, got {len(forms)}")
        self.forms = forms
        self.chosen: Callable[..., Any] | None = None
        self._calls = 0
        self._fastest = [float("inf")] * len(forms)

    def __call__(self, *args: Any) -> Any:
        chosen = self.chosen
        if chosen is not None:
            return chosen(*args)
        calls, count = self._calls, len(self.forms)
        self._calls = calls + 1
        index = calls % count
        form = self.forms[index]
        if calls < count:  # each form's first call: untimed
            return form(*args)
        start = time.perf_counter()
        result = form(*args)
        self._fastest[index] = min(self._fastest[index], time.perf_counter() - start)
        if calls + 1 >= count * (TIMED_CALLS + 1):
            self.chosen = self.forms[min(range(count), key=self._fastest.__getitem__)]
        return result
