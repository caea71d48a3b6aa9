"""Helion kernel for ``grouped_gemm``: one GEMM launch over all experts.

One launch over (row block, column block); a row block reads its expert id, gathers its rows of
``a`` (``a[pair // pairs_per_row]``, so the first GEMM of the experts block reads token rows
straight from the hidden states), multiplies by that expert's weight, and scatters the result
rows to ``out[pair]``: outputs are in pair order, with no padding rows. The epilogue reproduces
the Hugging Face casts: the projection is rounded to the model dtype, the bias added and rounded
again, the router weight multiplied and rounded to the product's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

_constexpr = Constexpr


def _grouped_gemm(
    a: torch.Tensor,
    weight_flat: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    bias_flat: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    num_experts: int,
    pairs_per_row: int,
    stride_e: int,
    stride_k: int,
    stride_n: int,
    bias_stride_e: int,
    block_m: _constexpr,
    has_bias: _constexpr,
    has_scale: _constexpr,
) -> None:
    # The weight is read through a flat view with explicit strides: Helion (1.5) cannot index a
    # tensor with a loaded scalar (the block's expert) next to tiles, but it can load a computed
    # offset tensor. That also serves both layouts, [E, N, K] and [E, K, N], with one kernel.
    num_slots = sorted_pairs.size(0)
    num_pairs, n = out.size()
    k = a.size(1)
    for tile_m, tile_n in hl.tile([num_slots, n], block_size=[block_m, None]):
        expert = block_experts[tile_m.id]
        if expert >= 0:
            routed = expert < num_experts
            slot_pair = sorted_pairs[tile_m]
            valid = (slot_pair >= 0) & (slot_pair < num_pairs)
            pair = torch.where(valid, slot_pair, 0)
            # Bucket num_experts holds the unrouted pairs: zero rows (the scalar condition is
            # broadcast to the rows first; the Triton interpreter rejects a scalar in a mask).
            live = valid & ((slot_pair * 0 + expert) < num_experts)
            weight_base = torch.where(routed, expert, 0) * stride_e
            acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
            for tile_k in hl.tile(k):
                a_block = hl.load(a, [pair // pairs_per_row, tile_k], extra_mask=live[:, None])
                w_block = hl.load(
                    weight_flat,
                    [weight_base + tile_k.index[:, None] * stride_k + tile_n.index[None, :] * stride_n],
                    extra_mask=(tile_k.index < k)[:, None] & (tile_n.index < n)[None, :],
                )
                acc = hl.dot(a_block, w_block, acc=acc)
            y = acc.to(a.dtype).to(torch.float32)  # HF rounds each projection to the model dtype
            if has_bias:
                b = hl.load(bias_flat, [torch.where(routed, expert, 0) * bias_stride_e + tile_n.index],
                            extra_mask=tile_n.index < n)
                y = (y + b.to(torch.float32)[None, :]).to(a.dtype).to(torch.float32)
            if has_scale:
                s = hl.load(scale, [pair], extra_mask=valid)
                y = (y * s.to(torch.float32)[:, None]).to(out.dtype).to(torch.float32)
            y = torch.where(live[:, None], y, 0.0)
            hl.store(out, [pair, tile_n], y.to(out.dtype), extra_mask=valid[:, None])


# fp32 GEMMs in exact fp32, as the HF experts' matmuls are (Triton's fp32 default is TF32).
grouped_gemm_kernel = HelionFunction(_grouped_gemm, dot_precision="ieee")


# --------------------------------------------------------------------------------------------
# configs
#
# Key (see hw_agnostic.autotune.keys):
#   {"dtype", "experts", "n", "k", "pairs_per_row", "block_m", "tokens"} (tokens: pairs)


def gemm_tiles(n: int, k: int, block_m: int) -> Config:
    if interpreter_mode() == "triton":
        return {"block_sizes": [min(next_power_of_2(n), 128), min(next_power_of_2(k), 128)], "num_warps": 4,
                "num_stages": 1}
    block_n = min(next_power_of_2(n), 128 if block_m >= 32 else 64)
    # Two pipelined copies of a 32x128 A and a 128x128 B tile in bf16 need 80 KiB of shared memory,
    # over AMD's 64 KiB LDS: 128-wide N tiles take 64-deep K tiles.
    block_k = min(next_power_of_2(k), 64 if block_m >= 64 or block_n > 64 else 128)
    return {"block_sizes": [block_n, block_k], "num_warps": 8 if block_m * block_n >= 128 * 128 else 4,
            "num_stages": 3}


def default_grouped_gemm_config(key: Mapping[str, Any]) -> Config:
    return gemm_tiles(int(key["n"]), int(key["k"]), int(key["block_m"]))


def gemm_tile_candidates(n: int, k: int) -> list[Config]:
    candidates = []
    for block_n in (32, 64, 128, 256):
        if block_n > 2 * next_power_of_2(n):
            continue
        for block_k in (32, 64, 128):
            if block_k > 2 * next_power_of_2(k):
                continue
            for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4)):
                candidates.append({"block_sizes": [block_n, block_k], "num_warps": warps, "num_stages": stages})
    return candidates


#: Launch orders beside the default (row blocks fastest, so each column block re-gathers every row
#: block's activations): column blocks fastest, and super-groups of 8 row blocks that walk the
#: columns together, so a row block's gathered activations stay in L2 across output columns.
LAUNCH_ORDERS: tuple[dict[str, Any], ...] = ({"loop_orders": [[1, 0]]}, {"l2_groupings": [8]})


def with_launch_orders(config: Config) -> list[Config]:
    """``config`` and its variants in the other launch orders."""
    return [config, *({**config, **order} for order in LAUNCH_ORDERS)]


def grouped_gemm_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = with_launch_orders(default_grouped_gemm_config(key))
    for tiles in gemm_tile_candidates(int(key["n"]), int(key["k"])):
        for config in with_launch_orders(tiles) if tiles["num_stages"] == 3 else [tiles]:
            if config not in candidates:
                candidates.append(config)
    return candidates


GROUPED_GEMM = KernelSpec("grouped_gemm", (_grouped_gemm,), default_grouped_gemm_config, grouped_gemm_candidates)
