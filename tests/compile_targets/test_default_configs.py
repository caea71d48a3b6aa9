"""Every op on a headline model shape, with the configs each target would launch, passes the rules.

Each target compiles what a GPU of it gets where nothing is tuned (its compile-chosen
defaults, else the built-in default). Meta tensors: no memory, no compute.
One width per op (Llama-3-8B's, head dim 128, Qwen3-30B-A3B's experts), a decode-sized and a
prefill-sized token count; ``make compile-report`` walks every model shape (bench/results/compile/).
"""

from __future__ import annotations

import pytest
import torch

from hw_agnostic.compile_report import compile_shape, model_shapes, tunable_ops
from hw_agnostic.kernels import targets

TOKENS = (1, 4096)


@pytest.mark.parametrize("op_name", tunable_ops())
def test_model_shapes_compile_on_every_target(op_name, all_targets):
    shapes = model_shapes([op_name], [torch.bfloat16], TOKENS, headline_only=True)
    log = targets.CompileLog()
    for shape in shapes:
        for record in compile_shape(shape, all_targets):
            log.add(record)
    assert {r.target for r in log.records} == set(all_targets)
    log.check()
