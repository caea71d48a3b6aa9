"""grouped_gemm: DSL vs reference, torch's grouped_mm, bad inputs."""

from __future__ import annotations

import re

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.kernels.grouped_gemm import LAUNCH_ORDERS
from hw_agnostic.ops.grouped_gemm import grouped_gemm_op
from hw_agnostic.ops.moe_align import moe_align_reference
from tests.harness import Case, check_provider, dsl_providers, seeded_generator
from tests.ops.moe_cases import DTYPES, GEMM_SMALL, IDS, IGNORE_MASKED_ROW_WARNINGS, W2, W13, X, dtype_name, routing_ids

pytestmark = IGNORE_MASKED_ROW_WARNINGS


def gemm_case(tokens, experts, top_k, k_in, n, dtype, *, stage="gate_up", block_m=16, transposed=False,
              bias=False, pattern="spread", scale_dtype=torch.float32, config=None):
    name = (f"{stage}-T{tokens}-E{experts}-k{top_k}-{k_in}to{n}-{dtype_name(dtype)}-bm{block_m}-{pattern}"
            + ("-transposed" if transposed else "") + ("-bias" if bias else "") + ("-small" if config else ""))

    def make():
        g = seeded_generator(name)
        ids = routing_ids(tokens, experts, top_k, g, pattern)
        sorted_pairs, block_experts, _ = moe_align_reference(ids, experts, block_m)
        rows, pairs_per_row = (tokens, top_k) if stage == "gate_up" else (tokens * top_k, 1)
        a = torch.randn(rows, k_in, generator=g).to(dtype)
        shape = (experts, k_in, n) if transposed else (experts, n, k_in)
        weight = (torch.randn(*shape, generator=g) / k_in**0.5).to(dtype)
        b = (0.5 * torch.randn(experts, n, generator=g)).to(dtype) if bias else None
        scale = torch.rand(rows * pairs_per_row, generator=g).to(scale_dtype) if stage == "down" else None
        return a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, b, scale

    return Case(name, make, config)


GEMM_CASES = [
    *(gemm_case(9, 5, 2, 13, 22, dtype) for dtype in DTYPES),  # odd K and N, a prime E
    *(gemm_case(9, 5, 2, 11, 13, dtype, stage="down", scale_dtype=sd)
      for dtype, sd in ((torch.bfloat16, torch.float32), (torch.float16, torch.float16))),
    gemm_case(7, 5, 2, 13, 22, torch.bfloat16, transposed=True, bias=True),  # gpt-oss layout
    gemm_case(7, 5, 3, 37, 45, torch.float32, block_m=4, config=GEMM_SMALL),  # masks over N and K
    *(gemm_case(37, 5, 3, 37, 45, torch.float32, block_m=4, config={**GEMM_SMALL, **order})
      for order in LAUNCH_ORDERS),  # column blocks fastest; L2 super-groups
    gemm_case(10, 5, 2, 13, 22, torch.float32, pattern="sentinels", bias=True),  # unrouted pairs: zero rows
    gemm_case(1, 3, 1, 13, 22, torch.bfloat16, stage="down"),  # one pair
    gemm_case(0, 3, 2, 13, 22, torch.float32),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(grouped_gemm_op))
@pytest.mark.parametrize("case", GEMM_CASES, ids=repr)
def test_grouped_gemm_dsl(provider, case, device):
    check_provider(grouped_gemm_op, provider, case, device)


def test_grouped_gemm_matches_torch_grouped_mm():
    """``grouped_gemm`` on rows already sorted by expert is ``torch.nn.functional.grouped_mm``."""
    g = seeded_generator("grouped_mm")
    counts = [3, 0, 5, 1]
    a = torch.randn(sum(counts), 24, generator=g)
    weight = torch.randn(4, 24, 12, generator=g)  # grouped_mm wants 16-byte strides
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = ops.grouped_gemm(a, weight, ops.moe_align(ids, 4, 4), transposed=True)


# --------------------------------------------------------------------------------------------
# bad inputs


_alignment = ops.MoEAlignment(*moe_align_reference(IDS, 8, 4))

BAD_INPUTS = [
    ("grouped_gemm: weight must have the dtype of a", lambda: ops.grouped_gemm(X, W13.double(), _alignment)),
    ("grouped_gemm: weight must be [E, N, K] with E, N >= 1 and K = a.shape[1] = 6",
     lambda: ops.grouped_gemm(X, W2, _alignment)),
    ("grouped_gemm: weight must be [E, K, N]", lambda: ops.grouped_gemm(X, W13, _alignment, transposed=True)),
    ("grouped_gemm: sorted_pairs must have dtype int32",
     lambda: ops.grouped_gemm(X, W13, _alignment._replace(sorted_pairs=_alignment.sorted_pairs.long()))),
    ("grouped_gemm: sorted_pairs (32 rows) must hold a power-of-two number of rows",
     lambda: ops.grouped_gemm(X, W13, _alignment._replace(block_experts=_alignment.block_experts[:3]))),
    ("grouped_gemm: bias must have shape (8, 10)",
     lambda: ops.grouped_gemm(X, W13, _alignment, bias=torch.zeros(8, 6))),
    ("grouped_gemm: scale must have shape (8,)",
     lambda: ops.grouped_gemm(X, W13, _alignment, pairs_per_row=2, scale=torch.ones(4))),
    ("grouped_gemm: pairs_per_row must be >= 1", lambda: ops.grouped_gemm(X, W13, _alignment, pairs_per_row=0)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()
