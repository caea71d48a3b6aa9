"""Helion kernels for ``fused_experts``: the top-k combine, after the alignment and grouped-GEMM kernels.

Why Helion: every MoE kernel (here, :mod:`.moe_route`, :mod:`.moe_align`, :mod:`.grouped_gemm`)
is tiles, gathers, reductions and one ``dot``, which Helion expresses directly; a Helion kernel
runs in both CPU test tiers (the Triton interpreter runs the Triton Helion generates, Helion's
eager mode runs the body as PyTorch), where a raw ``@triton.jit`` kernel would run in only one.

The chain, from the router's ids to the combined output: the alignment kernels
(:mod:`.moe_align`), the grouped GEMM twice (:mod:`.grouped_gemm`: gate/up, then down scaled by
the router weights), and :func:`_combine_topk`: ``out[t] = sum_k pair_out[t * K + k]`` in fp32,
rounded as ``weighted.view(T, K, H).sum(1).to(dtype)`` rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .grouped_gemm import GROUPED_GEMM, gemm_tile_candidates, gemm_tiles, with_launch_orders
from .interpret import interpreter_mode
from .moe_align import MOE_ALIGN, default_align_config
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

_constexpr = Constexpr


def _combine_topk(pair_out: torch.Tensor, out: torch.Tensor, top_k: _constexpr) -> None:
    """``out[t] = sum_k pair_out[t, k]`` in fp32, rounded to ``pair_out``'s dtype, then ``out``'s."""
    num_tokens, hidden = out.size()
    for tile_t, tile_h in hl.tile([num_tokens, hidden]):
        acc = hl.zeros([tile_t, tile_h], dtype=torch.float32)
        for k in hl.static_range(top_k):
            acc = acc + pair_out[tile_t, k, tile_h].to(torch.float32)
        out[tile_t, tile_h] = acc.to(pair_out.dtype).to(out.dtype)


combine_topk_kernel = HelionFunction(_combine_topk)


# --------------------------------------------------------------------------------------------
# configs
#
# Key (see hw_agnostic.autotune.keys):
#   {"dtype", "experts", "hidden", "inter", "top_k", "activation", "tokens"}


def default_block_m(tokens: int, top_k: int, experts: int) -> int:
    """Rows per GEMM block: about the pairs an expert gets, between 16 and 64 (128 under load)."""
    per_expert = max(tokens, 1) * top_k / max(experts, 1)
    if interpreter_mode() == "triton":
        return min(next_power_of_2(max(int(per_expert), 1)), 64)
    for block_m, limit in ((16, 24), (32, 48), (64, 768)):
        if per_expert <= limit:
            return block_m
    return 128


def _combine_config(hidden: int, tokens: int) -> Config:
    block_h = min(next_power_of_2(hidden), 1024)
    budget = 16384 if interpreter_mode() == "triton" else 2048
    rows = max(1, min(next_power_of_2(tokens), budget // block_h))
    return {"block_sizes": [rows, block_h], "num_warps": 4, "num_stages": 1}


def default_fused_experts_config(key: Mapping[str, Any]) -> Config:
    """One config for the whole chain; the two GEMMs share ``block_m`` (one alignment)."""
    tokens, top_k, experts = max(int(key["tokens"]), 1), int(key["top_k"]), int(key["experts"])
    hidden, inter = int(key["hidden"]), int(key["inter"])
    block_m = default_block_m(tokens, top_k, experts)
    align_key = {"experts": experts, "top_k": top_k, "tokens": tokens}
    return {
        "block_m": block_m,
        "align": default_align_config(align_key),
        "gate_up": gemm_tiles(2 * inter, hidden, block_m),
        "down": gemm_tiles(hidden, inter, block_m),
        "combine": _combine_config(hidden, tokens),
    }


def fused_experts_candidates(key: Mapping[str, Any]) -> list[Config]:
    """Block rows x the GEMM tilings most often best (a product of every knob would never finish)."""
    base = default_fused_experts_config(key)
    hidden, inter = int(key["hidden"]), int(key["inter"])
    candidates = [base]
    tiles = [c for c in gemm_tile_candidates(max(hidden, 2 * inter), max(hidden, inter))
             if c["num_stages"] in (3, 4) and c["block_sizes"][0] >= 64]
    for block_m in (16, 32, 64, 128):
        for gate_up in tiles:
            for down in (gate_up, base["down"]):
                config = {**base, "block_m": block_m, "gate_up": gate_up, "down": down}
                if config not in candidates:
                    candidates.append(config)
    for gate_up in with_launch_orders(base["gate_up"])[1:]:  # the default tiles in the other launch orders
        for down in with_launch_orders(base["down"])[1:]:
            candidates.append({**base, "gate_up": gate_up, "down": down})
    return candidates


FUSED_EXPERTS = KernelSpec(
    "fused_experts", (*MOE_ALIGN.functions, *GROUPED_GEMM.functions, _combine_topk),
    default_fused_experts_config, fused_experts_candidates,
)
