"""The zoo: every causal-LM family transformers ships, tiny and random, rewired and checked.

For each family that builds offline at tiny size (:mod:`tests.zoo.families`), fp32: ``rewire``
must leave the model computing what it computed (logits of a left-padded batch within the
tolerance table, 12 greedy tokens identical, also on a ``StaticCache``), never raise, and its report must explain every
norm, MLP and attention module it did not replace. Families that cannot be built or run offline
at tiny size even without rewiring are listed in :data:`tests.zoo.families.UNBUILDABLE` with why;
the test fails if one of them starts working (take it off the list) or another one stops.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from hw_agnostic import rewire
from hw_agnostic.layers import CustomOp, PagedAttention, PluggableLayer
from hw_agnostic.tolerances import mismatch
from tests.zoo.families import UNBUILDABLE, build, families

pytestmark = [pytest.mark.zoo]

#: 7 prompt positions + 12 new ones pass the tiny configs' 16-key sliding windows (families.py) and the
#: paged cache's 16-slot blocks; generate() is about half of the zoo's time.
NEW_TOKENS = 12
#: class names of the modules the report must account for (a test heuristic, not a detection rule)
CANDIDATE = re.compile(r"(RMSNorm|LayerNorm|Norm|MLP|Attention)$")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def _greedy(model, ids, mask, new_tokens: int, **extra):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, **extra)


def _run(model, ids, mask, new_tokens: int = NEW_TOKENS):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, _greedy(model, ids, mask, new_tokens)


def _static_tokens(model, ids, mask) -> torch.Tensor | str:
    """Greedy tokens on a ``StaticCache``, or the error transformers raised for one (a family
    without static-cache support)."""
    try:
        return _greedy(model, ids, mask, NEW_TOKENS, cache_implementation="static")
    except Exception as err:
        return type(err).__name__


def _original(family: str):
    """The untouched tiny model and its outputs, or the reason it cannot be had offline."""
    try:
        model = build(family)
        return model, (*_run(model, *_inputs()), _static_tokens(model, *_inputs()))
    except Exception as err:
        return None, f"{type(err).__name__}: {str(err)[:200]}"


def _unexplained(model, report) -> list[str]:
    """Candidate modules neither replaced (nor wrapping a replacement) nor listed as left in the report."""
    explained = {e.path for e in report.left if e.detail}
    explained |= {e.path.split(".{")[0] for e in report.left if ".{" in e.path}
    missing = []
    for path, module in model.named_modules():
        ours = any(isinstance(m, (CustomOp, PluggableLayer, PagedAttention)) for m in module.modules())
        if ours or not CANDIDATE.search(type(module).__name__):
            continue  # replaced, or a wrapper around something replaced
        if not any(path == p or path.startswith(p + ".") for p in explained) and list(module.parameters()):
            missing.append(f"{path} ({type(module).__name__})")
    return missing


@pytest.mark.parametrize("family", families())
def test_rewire_never_makes_a_family_wrong(family):
    original, outcome = _original(family)
    if original is None:
        assert family in UNBUILDABLE, f"{family} does not build or run offline at tiny size: {outcome}"
        pytest.skip(f"cannot be built offline: {UNBUILDABLE[family]}")
    assert family not in UNBUILDABLE, f"{family} builds and runs now: take it off UNBUILDABLE"
    want_logits, want_tokens, want_static = outcome
    model = copy.deepcopy(original)
    report = rewire(model)
    ids, mask = _inputs()
    got_logits, got_tokens = _run(model, ids, mask)
    got_static = _static_tokens(model, ids, mask)
    real = mask.bool()
    # Two-sided, as the rewire's own verification: the original's logits are an fp32 computation
    # too, not a float64 evaluation (Gemma 4's norms take pow(ms, -0.5) where ours take rsqrt; the
    # two round apart by an ulp on vectorised CPUs, scalar ATen is bit-equal).
    problem = mismatch(got_logits[real], want_logits[real].double(), torch.float32, two_sided=True)
    assert problem is None, f"{family} computes something else after rewire: {problem}\n{report.table()}"
    assert torch.equal(got_tokens, want_tokens), f"{family}: greedy tokens differ after rewire\n{report.table()}"
    # on a StaticCache (static pages where the kernel serves a layer): the same tokens, or the same refusal
    if isinstance(want_static, str):
        assert got_static == want_static, (
            f"{family}: transformers raised {want_static} for a static cache, the rewired model {got_static}")
    else:
        assert isinstance(got_static, torch.Tensor) and torch.equal(got_static, want_static), (
            f"{family}: greedy tokens on a static cache differ after rewire ({got_static})\n{report.table()}")
    assert all(e.detail for e in report.left), report.table()
    assert not _unexplained(model, report), f"{family}: the report does not explain {_unexplained(model, report)}"
