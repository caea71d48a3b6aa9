"""What the four MoE ops share: the pair numbering, the kernels' expert limit, their provider.

``T`` tokens each pick ``K`` of ``E`` experts. A token/expert *pair* is numbered
``p = t * K + k`` (the row-major order of ``topk_ids [T, K]``); ``P = T * K``.

The ops, one module each: :mod:`.moe_route` (router logits -> top-k weights and ids),
:mod:`.moe_align` (ids -> pairs sorted by expert, block-padded), :mod:`.grouped_gemm` (one GEMM
over all experts), :mod:`.fused_experts` (the experts block of a Hugging Face MoE layer).

Their example inputs (tuner, benchmarks, opcheck) take ``width`` as the hidden size. Widths of
the MoE models in :func:`hw_agnostic.autotune.shapes.moe_model` get their experts, top-k, expert
width and routing; any other width gets a small generic layer (8 experts, top-2, I = width).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.runtime import helion_available
from .registry import Provider

#: The most experts the routing and alignment kernels take (the reference runs beyond them).
MAX_KERNEL_EXPERTS = 1024


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def helion_provider(build: object, accepts: object, spec: object, tuning_key: object) -> Provider:
    return Provider("helion", build, interpreters=frozenset({"triton", "helion"}), accepts=accepts, kernel=spec,
                    tuning_key=tuning_key, available=helion_available)


def example_routing(tokens: int, experts: int, top_k: int, device: str | torch.device,
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Distinct experts per token, spread over all experts, and positive weights summing to 1."""
    g = generator or torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return weights.to(device), ids.to(device)
