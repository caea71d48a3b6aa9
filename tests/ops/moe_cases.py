"""What the MoE op tests share: routing patterns, small kernel configs, bad-input arguments."""

from __future__ import annotations

import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The Triton interpreter evaluates masked-out rows too; Helion fills them with -inf before a row
# max, so softmax on those rows computes -inf - -inf. Those rows are never stored.
IGNORE_MASKED_ROW_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def routing_ids(tokens: int, experts: int, top_k: int, g: torch.Generator, pattern: str = "spread") -> torch.Tensor:
    """``[tokens, top_k]`` expert ids: distinct per token (``spread``), or a routing edge case."""
    if pattern == "spread":
        return torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    if pattern == "one_expert":  # every pair goes to one expert
        return torch.full((tokens, top_k), experts // 2, dtype=torch.int64)
    if pattern == "two_experts":  # most experts get no tokens
        return torch.tensor([0, experts - 1])[torch.randint(0, 2, (tokens, top_k), generator=g)]
    if pattern == "sentinels":  # expert-parallel sentinels (HF uses num_experts) and a stray -1
        ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
        ids[::3, 0] = experts
        ids[1::4, -1] = -1
        return ids
    raise ValueError(pattern)


ALIGN_SMALL = {
    "block_pairs": 8,
    "count": {"block_sizes": [4], "num_warps": 4, "num_stages": 1},
    "offsets": {"block_sizes": [2, 4], "num_warps": 4, "num_stages": 1},
    "scatter": {"num_warps": 4, "num_stages": 1},
}


GEMM_SMALL = {"block_sizes": [16, 16], "num_warps": 4, "num_stages": 1}


# Well-formed arguments that the bad-input tests spoil one at a time.
IDS = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
X, W13, W2 = torch.randn(4, 6), torch.randn(8, 10, 6), torch.randn(8, 6, 5)
