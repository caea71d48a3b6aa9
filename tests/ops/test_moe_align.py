"""moe_align: DSL vs reference (integers compared exactly), invariants, bad inputs."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.kernels.moe_align import max_slots
from hw_agnostic.ops.moe_align import moe_align_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator
from tests.ops.moe_cases import ALIGN_SMALL, IDS, IGNORE_MASKED_ROW_WARNINGS, dtype_name, routing_ids

pytestmark = IGNORE_MASKED_ROW_WARNINGS


def align_case(tokens, experts, top_k, block_m, *, pattern="spread", ids_dtype=torch.int64, config=None):
    name = (f"T{tokens}-E{experts}-k{top_k}-bm{block_m}-{pattern}-{dtype_name(ids_dtype)}"
            + ("-small" if config else ""))

    def make():
        return routing_ids(tokens, experts, top_k, seeded_generator(name), pattern).to(ids_dtype), experts, block_m

    return Case(name, make, config)


ALIGN_CASES = [
    align_case(9, 5, 2, 4),
    align_case(1, 3, 1, 16),  # one token, fewer pairs than a block
    align_case(2, 7, 7, 4, ids_dtype=torch.int32),  # top-E
    align_case(6, 13, 1, 4, pattern="one_expert"),
    align_case(11, 13, 2, 8, pattern="two_experts"),  # experts without tokens
    align_case(10, 5, 2, 4, pattern="sentinels"),
    align_case(23, 7, 3, 4, config=ALIGN_SMALL),  # several pair blocks: the prefix over blocks
    align_case(0, 5, 2, 16),
]


def assert_alignment_invariants(topk_ids: torch.Tensor, num_experts: int, block_m: int, alignment) -> None:
    """What the GEMM relies on, checked from first principles (not against the reference)."""
    sorted_pairs, block_experts, offsets = (t.cpu().to(torch.int64) for t in alignment)
    flat = topk_ids.reshape(-1).cpu().to(torch.int64)
    pairs = flat.numel()
    assert sorted_pairs.shape == (max_slots(pairs, num_experts, block_m),)
    assert block_experts.shape == (sorted_pairs.numel() // block_m,)
    assert offsets.shape == (num_experts + 2,) and offsets[0] == 0
    assert bool((offsets[1:] >= offsets[:-1]).all()), f"offsets not monotone: {offsets}"
    assert bool((offsets % block_m == 0).all()), f"segments not padded to {block_m}: {offsets}"
    listed = sorted_pairs[sorted_pairs < pairs]
    # every pair appears exactly once, so every token appears top_k times
    assert torch.equal(listed.sort().values, torch.arange(pairs)), "pairs missing or repeated"
    assert bool((sorted_pairs[sorted_pairs >= pairs] == pairs).all()), "padding must hold the pair count"
    assert bool((sorted_pairs[offsets[-1]:] == pairs).all()), "rows past the last segment must be padding"
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    for expert in range(num_experts + 1):
        segment = sorted_pairs[offsets[expert]:offsets[expert + 1]]
        members = segment[segment < pairs]
        assert torch.equal(members, (bucket == expert).nonzero().squeeze(1)), f"segment {expert}: {segment}"
        assert segment.numel() - members.numel() < block_m, f"segment {expert} over-padded"
        blocks = block_experts[offsets[expert] // block_m:offsets[expert + 1] // block_m]
        assert bool((blocks == expert).all()), f"blocks of segment {expert}: {blocks}"
    assert bool((block_experts[offsets[-1] // block_m:] == -1).all())


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(moe_align_op))
@pytest.mark.parametrize("case", ALIGN_CASES, ids=repr)
def test_moe_align_dsl(provider, case, device):
    check_provider(moe_align_op, provider, case, device)
    topk_ids, experts, block_m = case.make()
    with ops.use_provider(provider, moe_align_op):
        assert_alignment_invariants(topk_ids, experts, block_m, ops.moe_align(topk_ids.to(device), experts, block_m))


@pytest.mark.parametrize("case", ALIGN_CASES, ids=repr)
def test_alignment_invariants_of_the_reference(case):
    topk_ids, experts, block_m = case.make()
    assert_alignment_invariants(topk_ids, experts, block_m, ops.moe_align(topk_ids, experts, block_m))


ALIGN_FUZZ = dict(tokens=st.integers(0, 40), experts=st.integers(1, 17), top_k=st.integers(1, 4),
                  block_m=st.sampled_from([1, 2, 4, 16, 64]), ids_dtype=st.sampled_from([torch.int32, torch.int64]),
                  pattern=st.sampled_from(["spread", "one_expert", "two_experts", "sentinels"]))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(**ALIGN_FUZZ)
def test_fuzz_alignment_invariants(tokens, experts, top_k, block_m, ids_dtype, pattern):
    case = align_case(tokens, experts, min(top_k, experts), block_m, pattern=pattern, ids_dtype=ids_dtype)
    ids, experts, block_m = case.make()
    assert_alignment_invariants(ids, experts, block_m, ops.moe_align(ids, experts, block_m))


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(6, 40), deadline=None, suppress_health_check=list(HealthCheck))
@given(**ALIGN_FUZZ, small=st.booleans())
def test_fuzz_alignment_dsl(tokens, experts, top_k, block_m, ids_dtype, pattern, small):
    """The kernels against the reference (exactly) and the invariants, on random routings."""
    from tests.conftest import kernel_device

    case = align_case(tokens, experts, min(top_k, experts), block_m, pattern=pattern, ids_dtype=ids_dtype,
                      config=ALIGN_SMALL if small else None)
    ids, experts, block_m = case.make()
    for provider in dsl_providers(moe_align_op):
        check_provider(moe_align_op, provider, case, kernel_device())
        with contextlib.ExitStack() as stack:
            stack.enter_context(ops.use_provider(provider, moe_align_op))
            if case.config is not None:
                stack.enter_context(ops.use_config(moe_align_op, case.config))
            alignment = ops.moe_align(ids.to(kernel_device()), experts, block_m)
        assert_alignment_invariants(ids, experts, block_m, alignment)


# --------------------------------------------------------------------------------------------
# bad inputs


BAD_INPUTS = [
    ("moe_align: topk_ids must have dtype int32, int64", lambda: ops.moe_align(IDS.float(), 8, 4)),
    ("moe_align: topk_ids must be 2-D", lambda: ops.moe_align(IDS.reshape(-1), 8, 4)),
    ("moe_align: num_experts must be >= 1", lambda: ops.moe_align(IDS, 0, 4)),
    ("moe_align: block_m must be a power of two", lambda: ops.moe_align(IDS, 8, 6)),
    ("moe_align: block_m must be in [1, 256]", lambda: ops.moe_align(IDS, 8, 512)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()
