"""Every shipped config passes the rules on the target it is for.

Tuned configs (``autotune_cache/<platform>/``, measured on one GPU) are compiled for their
platform's target at the model shape of their key, and must compile without spills or shared
memory overflow; the 128-bit vector rule, a prediction of speed, does not bind them (the tuner
timed them on the device: on an H200, 64-bit loads with 32 warps won a 1-token norm).
Compile-chosen defaults (``autotune_cache/<target>/``) must be fresh (tuned for the kernel's
current source, so each passed the rules when it was chosen), and a sample of those that differ
from the built-in default (the first, middle and last key of each file) is compiled again for its
target, which catches a Triton upgrade that changes what they compile to without recompiling every
entry in every run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import re

import pytest
import torch

from hw_agnostic.autotune import cache
from hw_agnostic.compile_report import compile_entry, shipped_entries
from hw_agnostic.kernels import targets
from hw_agnostic.ops.registry import get_op


SAMPLE_PER_FILE = 3


def _to_compile(entries):
    """Every tuned entry; of the compile-chosen ones that differ from the built-in default (the
    default-config walk compiles those that do not), a sample per file."""
    picked = [e for e in entries if e.folder not in targets.TARGETS]
    chosen = collections.defaultdict(list)
    for entry in entries:
        if entry.folder in targets.TARGETS and not entry.builtin:
            chosen[entry.path].append(entry)
    for group in chosen.values():
        group = sorted(group, key=lambda e: json.dumps(e.key, sort_keys=True))
        picked += group if len(group) <= SAMPLE_PER_FILE else [group[0], group[len(group) // 2], group[-1]]
    return picked


def _check(entries) -> None:
    unmatched = [f"{e.path}: {e.key}" for e in entries if e.shape is None]
    assert not unmatched, "shipped entries no model shape reaches (tune through the model shapes):\n" + "\n".join(
        unmatched)
    log = targets.CompileLog()
    for entry in _to_compile(entries):
        tuned = entry.folder not in targets.TARGETS
        for target in entry.targets:
            for record in compile_entry(entry, target):
                if tuned and record.vector_rule == "required":
                    record = dataclasses.replace(record, vector_rule="exempt: timed on the device")
                log.add(record)
    log.check()


SHIPPED_FILES = sorted(str(path.relative_to(cache.SHIPPED_ROOT)) for path in cache.SHIPPED_ROOT.glob("*/*.json"))


@functools.lru_cache(maxsize=1)
def _shipped_entries() -> tuple:
    return tuple(shipped_entries())


# one test per file, so that the test workers share the compiles (as one test, it was the tier's 25-40 s tail)
@pytest.mark.parametrize("shipped_file", SHIPPED_FILES)
def test_shipped_configs_compile_on_their_targets(shipped_file):
    _check([e for e in _shipped_entries() if e.path == cache.SHIPPED_ROOT / shipped_file])


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
