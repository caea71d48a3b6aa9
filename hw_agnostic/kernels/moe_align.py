"""Helion kernels for ``moe_align``: the token/expert pairs sorted by expert, block-padded.

``T`` tokens, ``K`` experts per token, ``P = T * K`` token/expert *pairs*, pair ``p = t * K + k``.
Pairs are sorted by expert into *segments*, each padded to a multiple of the GEMM's ``block_m``,
so every GEMM row block belongs to exactly one expert. Pairs whose expert id is outside
``[0, E)`` (expert-parallel sentinels) go to one extra segment, bucket ``E``, which the GEMM
turns into zero rows. The three kernels (:func:`_count_pairs`, :func:`_segment_offsets`,
:func:`_scatter_pairs`) count pairs per (pair block, bucket), prefix-sum those counts (one
program), and scatter each pair to ``segment start + pairs of its bucket in earlier blocks + its
rank in its own block``; the order within a segment is the pair order, so the result is
deterministic. Everything stays on the device: the buffers are sized by upper bounds computed
from shapes (see :func:`max_slots`).
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


def _bucket(expert: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """A pair's bucket (int32): its expert, or the last bucket for ids outside ``[0, E)``.

    The range test runs on the ids as loaded: narrowing an int64 id first would turn
    ``2**32 + 3`` into expert 3.
    """
    return torch.where((expert >= 0) & (expert < num_buckets - 1), expert, num_buckets - 1).to(torch.int32)


def _count_pairs(ids: torch.Tensor, counts: torch.Tensor, block_p: _constexpr) -> None:
    """``counts[b, e]``: pairs of pair block ``b`` in bucket ``e`` (the last bucket: unrouted)."""
    num_pairs = ids.size(0)
    num_buckets = counts.size(1)
    for tile_p in hl.tile(num_pairs, block_size=block_p):
        valid = tile_p.index < num_pairs
        bucket = _bucket(ids[tile_p], num_buckets)
        for tile_e in hl.tile(num_buckets):
            match = (bucket[None, :] == tile_e.index[:, None]) & valid[None, :]
            counts[tile_p.id, tile_e] = torch.sum(match.to(torch.int32), dim=1).to(torch.int32)


def _segment_offsets(
    counts: torch.Tensor,
    block_base: torch.Tensor,
    offsets: torch.Tensor,
    block_experts: torch.Tensor,
    block_m: _constexpr,
    block_e: _constexpr,
) -> None:
    """One program: per-bucket prefix over pair blocks, padded segment offsets, block owners."""
    num_pair_blocks, num_buckets = counts.size()
    num_blocks = block_experts.size(0)
    for tile_e in hl.tile(num_buckets, block_size=block_e):
        running = hl.zeros([tile_e], dtype=torch.int32)
        for tile_b in hl.tile(num_pair_blocks):
            count = counts[tile_b, tile_e]
            block_base[tile_b, tile_e] = torch.cumsum(count, dim=0).to(torch.int32) - count + running[None, :]
            running = running + torch.sum(count, dim=0).to(torch.int32)
        padded = (running + (block_m - 1)) // block_m * block_m
        ends = torch.cumsum(padded, dim=0).to(torch.int32)
        offsets[tile_e.index + 1] = ends
        real = (tile_e.index < num_buckets)[None, :]
        for tile_j in hl.tile(num_blocks):
            start = tile_j.index * block_m
            owner = torch.sum(((ends[None, :] <= start[:, None]) & real).to(torch.int32), dim=1).to(torch.int32)
            block_experts[tile_j] = torch.where(owner < num_buckets, owner, -1)


def _scatter_pairs(
    ids: torch.Tensor, block_base: torch.Tensor, offsets: torch.Tensor, sorted_pairs: torch.Tensor,
    block_p: _constexpr,
) -> None:
    num_pairs = ids.size(0)
    num_buckets = block_base.size(1)
    for tile_p in hl.tile(num_pairs, block_size=block_p):
        valid = tile_p.index < num_pairs
        bucket = _bucket(ids[tile_p], num_buckets)
        earlier = (bucket[None, :] == bucket[:, None]) & (tile_p.index[None, :] < tile_p.index[:, None])
        rank = torch.sum(earlier.to(torch.int32), dim=1).to(torch.int32)
        base = hl.load(block_base, [tile_p.id, bucket], extra_mask=valid)
        start = hl.load(offsets, [bucket], extra_mask=valid)
        hl.store(sorted_pairs, [start + base + rank], tile_p.index, extra_mask=valid)


count_pairs_kernel = HelionFunction(_count_pairs)
segment_offsets_kernel = HelionFunction(_segment_offsets)
scatter_pairs_kernel = HelionFunction(_scatter_pairs)


# --------------------------------------------------------------------------------------------
# shapes the host code needs


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the expert-sorted, block-padded pair list: an upper bound computable from shapes.

    Each non-empty segment (at most ``min(E + 1, P)`` of them: one per expert, plus the
    unrouted bucket) adds at most ``block_m - 1`` padding rows.
    """
    if num_pairs == 0:
        return 0
    padded = num_pairs + min(num_experts + 1, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


# --------------------------------------------------------------------------------------------
# configs
#
# Key (see hw_agnostic.autotune.keys): {"experts", "top_k", "block_m", "tokens"}


def default_align_config(key: Mapping[str, Any]) -> Config:
    pairs = max(int(key["tokens"]), 1) * int(key["top_k"])
    buckets = int(key["experts"]) + 1
    block_pairs = min(next_power_of_2(pairs), 256 if interpreter_mode() == "triton" else 64)
    return {
        "block_pairs": block_pairs,
        "count": {"block_sizes": [min(next_power_of_2(buckets), 256 if interpreter_mode() == "triton" else 64)], "num_warps": 4,
                  "num_stages": 1},
        # One program holds a [rows, buckets] tile: past 128 buckets (DeepSeek-V3's 257) more
        # warps share it, or its registers spill.
        "offsets": {"block_sizes": [16, 64 if interpreter_mode() == "triton" else 16],
                    "num_warps": 8 if buckets > 128 else 4, "num_stages": 1},
        "scatter": {"num_warps": 4, "num_stages": 1},
    }


def align_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = [default_align_config(key)]
    pairs = max(int(key["tokens"]), 1) * int(key["top_k"])
    for block_pairs in (32, 64, 128):
        if block_pairs > next_power_of_2(pairs):
            continue
        for warps in (2, 4, 8):
            config = {
                "block_pairs": block_pairs,
                "count": {"block_sizes": [64], "num_warps": warps, "num_stages": 1},
                "offsets": {"block_sizes": [16, 16], "num_warps": warps, "num_stages": 1},
                "scatter": {"num_warps": warps, "num_stages": 1},
            }
            if config not in candidates:
                candidates.append(config)
    return candidates


MOE_ALIGN = KernelSpec("moe_align", (_bucket, _count_pairs, _segment_offsets, _scatter_pairs), default_align_config,
                       align_candidates)
