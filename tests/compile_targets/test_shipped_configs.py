"""Every shipped config passes the rules on the target it is for.

Tuned configs (``autotune_cache/<platform>/``, measured on one GPU) are compiled for their
platform's target at the model shape of their key; compile-chosen defaults
(``autotune_cache/<target>/``) must be fresh (tuned for the kernel's current source), and those
that differ from the built-in default are compiled again for their target.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from hw_agnostic.autotune import cache
from hw_agnostic.compile_report import compile_entry, shipped_entries
from hw_agnostic.kernels import targets
from hw_agnostic.ops.registry import get_op


def _check(entries) -> None:
    unmatched = [f"{e.path}: {e.key}" for e in entries if e.shape is None]
    assert not unmatched, "shipped entries no model shape reaches (tune through the model shapes):\n" + "\n".join(
        unmatched)
    log = targets.CompileLog()
    for entry in entries:
        if entry.folder in targets.TARGETS and entry.builtin:
            continue  # the built-in default at this key: the default-config walk compiles it
        for target in entry.targets:
            for record in compile_entry(entry, target):
                log.add(record)
    log.check()


def test_every_shipped_config_compiles_on_its_target():
    _check(shipped_entries())


def test_a_shipped_config_overflowing_shared_memory_fails(tmp_path):
    op = get_op("grouped_gemm")
    provider = next(p for p in op.providers if p.kernel is not None)
    args = op.example_inputs(512, 4096, torch.bfloat16, "meta")
    with targets.compile_for(["sm_90"], run_reference=False):
        key = op.plan(*args).config.key
    huge = {"block_sizes": [256, 128], "num_warps": 8, "num_stages": 5}  # 256x128 bf16 B tiles, 5 stages: 272 KiB
    cache.save_entry(provider.kernel, "nvidia_h100", key, huge, time_us=1.0, root=tmp_path)
    (entry,) = shipped_entries(tmp_path)
    assert entry.targets == ("sm_90",) and entry.shape.tokens == 512 and entry.shape.width == 4096
    with pytest.raises(targets.TargetCompileError,
                       match=re.escape(f"kernel grouped_gemm, config {json.dumps(huge, sort_keys=True)}, target sm_90")):
        _check([entry])
