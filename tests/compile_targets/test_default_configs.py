"""Every op on a headline model shape, with the configs each target would launch, passes the rules.

Each target compiles what a GPU of it gets where nothing is tuned (its compile-chosen defaults,
else the built-in default). Meta tensors: no memory, no compute. One width per op (Llama-3-8B's,
head dim 128, Qwen3-30B-A3B's experts), a decode-sized and a prefill-sized token count;
``make compile-report`` walks every model shape (bench/results/compile/).
"""

from __future__ import annotations

import pytest
import torch

from hw_agnostic.compile_report import compile_shape, model_shapes, tunable_ops
from hw_agnostic.kernels import targets

TOKENS = (1, 4096)
#: Problems known and reported (bench/results/compile/report.md), each with why it stays for now.
#: A known problem that no longer occurs fails the test too, so the entry goes once it is fixed.
KNOWN: dict[tuple[str, str, str], str] = {}


@pytest.mark.parametrize("op_name", tunable_ops())
def test_model_shapes_compile_on_every_target(op_name, all_targets):
    log = targets.CompileLog()
    for shape in model_shapes([op_name], [torch.bfloat16], TOKENS, headline_only=True):
        for record in compile_shape(shape, all_targets):
            log.add(record)
    assert {r.target for r in log.records} == set(all_targets)
    known_here = {k for k in KNOWN if k[1] in all_targets}
    seen, unknown = set(), []
    for record in log.records:
        for problem in record.problems():
            matches = [k for k in known_here if k[0] == record.kernel and k[1] == record.target and k[2] in problem]
            seen.update(matches)
            if not matches:
                unknown.append(problem)
    assert not unknown, "\n".join(unknown)
    expected = {k for k in known_here if k[0] in {r.kernel for r in log.records}}
    assert seen == expected, f"known problems that no longer occur (drop them from KNOWN): {expected - seen}"
