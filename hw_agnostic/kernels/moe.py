"""Helion kernels for the mixture-of-experts path: routing, alignment, grouped GEMM, combine.

Why Helion: every kernel here is tiles, gathers, reductions and one ``dot``, which Helion
expresses directly; a Helion kernel runs in both CPU test tiers (the Triton interpreter runs the
Triton Helion generates, Helion's eager mode runs the body as PyTorch), where a raw
``@triton.jit`` kernel would run in only one.

The data layout, from routing to the combined output (``T`` tokens, ``K`` experts per token,
``P = T * K`` token/expert *pairs*, pair ``p = t * K + k``):

* **routing** (:func:`_route`): one program per block of tokens holds whole rows of router
  logits, scores them (softmax, sigmoid, or raw logits for top-k-then-softmax), optionally
  restricts the choice to the best expert groups (DeepSeek-V3), and picks the top-k by repeated
  arg-max (ties go to the lowest expert index).
* **alignment** (:func:`_count_pairs`, :func:`_segment_offsets`, :func:`_scatter_pairs`): pairs
  are sorted by expert into *segments*, each padded to a multiple of the GEMM's ``block_m``, so
  every GEMM row block belongs to exactly one expert. Pairs whose expert id is outside
  ``[0, E)`` (expert-parallel sentinels) go to one extra segment, bucket ``E``, which the GEMM
  turns into zero rows. The three kernels count pairs per (pair block, bucket), prefix-sum those
  counts (one program), and scatter each pair to ``segment start + pairs of its bucket in
  earlier blocks + its rank in its own block``; the order within a segment is the pair order,
  so the result is deterministic. Everything stays on the device: the buffers are sized by
  upper bounds computed from shapes (see :func:`max_slots`).
* **grouped GEMM** (:func:`_grouped_gemm`): one launch over (row block, column block); a row
  block reads its expert id, gathers its rows of ``a`` (``a[pair // pairs_per_row]``, so the
  first GEMM reads token rows straight from the hidden states), multiplies by that expert's
  weight, and scatters the result rows to ``out[pair]``: outputs are in pair order, with no
  padding rows. The epilogue reproduces the Hugging Face casts: the projection is rounded to the
  model dtype, the bias added and rounded again, the router weight multiplied and rounded to the
  product's dtype.
* **combine** (:func:`_combine_topk`): ``out[t] = sum_k pair_out[t * K + k]`` in fp32, rounded as
  ``weighted.view(T, K, H).sum(1).to(dtype)`` rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, HelionFunction, KernelSpec, next_power_of_2

try:
    import helion.language as hl
except Exception:  # Helion missing or broken: the ops fall back to other providers
    hl = None

#: Values of the ``scoring`` constexpr. Kernels compare constexprs with literals: Helion folds
#: those at compile time, but passes module-level constants in as runtime arguments.
SCORINGS = ("softmax", "sigmoid", "topk_then_softmax")

_constexpr: Any = hl.constexpr if hl is not None else int


# --------------------------------------------------------------------------------------------
# routing


def _route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    routed_scaling_factor: float,
    block_e: _constexpr,
    block_k: _constexpr,
    top_k: _constexpr,
    scoring: _constexpr,
    renormalize: _constexpr,
    has_bias: _constexpr,
    n_group: _constexpr,
    topk_group: _constexpr,
) -> None:
    num_tokens, num_experts = logits.size()
    for tile_t, tile_e in hl.tile([num_tokens, num_experts], block_size=[None, block_e]):
        column = tile_e.index
        in_range = (column < num_experts)[None, :]
        x = torch.where(in_range, logits[tile_t, tile_e].to(torch.float32), float("-inf"))
        if scoring == "softmax":
            exp = torch.exp(x - torch.amax(x, dim=1, keepdim=True))
            scores = exp / torch.sum(exp, dim=1, keepdim=True)
        elif scoring == "sigmoid":
            scores = torch.sigmoid(x)
        else:
            scores = x
        choice = torch.where(in_range, scores, float("-inf"))
        if has_bias:
            choice = choice + hl.load(correction_bias, [tile_e]).to(torch.float32)[None, :]
        if n_group > 1:
            # DeepSeek-V3: a group scores the sum of its two best experts; only the topk_group
            # best groups stay eligible.
            group_of = column // (num_experts // n_group)
            group_score = torch.zeros_like(choice)
            for g in hl.static_range(n_group):
                member = (group_of == g)[None, :] & in_range
                in_group = torch.where(member, choice, float("-inf"))
                first = torch.amax(in_group, dim=1, keepdim=True)
                first_at = torch.amin(torch.where(in_group == first, column[None, :], block_e), dim=1, keepdim=True)
                second = torch.amax(torch.where(column[None, :] == first_at, float("-inf"), in_group), dim=1,
                                    keepdim=True)
                second = torch.where(second == float("-inf"), 0.0, second)  # one-expert groups
                group_score = torch.where(member, first + second, group_score)
            kept = torch.zeros_like(choice)
            for g in hl.static_range(topk_group):
                open_score = torch.where((kept == 0.0) & in_range, group_score, float("-inf"))
                best = torch.amax(open_score, dim=1, keepdim=True)
                best_group = torch.amin(torch.where(open_score == best, group_of[None, :], n_group), dim=1,
                                        keepdim=True)
                kept = torch.where(group_of[None, :] == best_group, 1.0, kept)
            choice = torch.where(kept > 0.0, choice, float("-inf"))
        slot = hl.arange(block_k)
        top_weight = hl.zeros([tile_t, block_k], dtype=torch.float32)
        top_id = hl.zeros([tile_t, block_k], dtype=torch.int32)
        for k in hl.static_range(top_k):
            best = torch.amax(choice, dim=1, keepdim=True)
            best_at = torch.amin(torch.where(choice == best, column[None, :], block_e), dim=1, keepdim=True)
            hit = column[None, :] == best_at
            value = torch.sum(torch.where(hit, scores, 0.0), dim=1, keepdim=True)
            top_weight = torch.where(slot[None, :] == k, value, top_weight)
            top_id = torch.where(slot[None, :] == k, best_at, top_id)
            choice = torch.where(hit, float("-inf"), choice)
        if scoring == "topk_then_softmax":
            top_weight = torch.where(slot[None, :] < top_k, top_weight, float("-inf"))
            exp = torch.exp(top_weight - torch.amax(top_weight, dim=1, keepdim=True))
            top_weight = exp / torch.sum(exp, dim=1, keepdim=True)
        if renormalize:
            total = torch.sum(torch.where(slot[None, :] < top_k, top_weight, 0.0), dim=1, keepdim=True)
            if scoring == "sigmoid":
                total = total + 1e-20  # as DeepSeek-V3's router does
            top_weight = top_weight / total
        top_weight = top_weight * routed_scaling_factor
        chosen = (slot < top_k)[None, :]
        hl.store(weights, [tile_t, slot], top_weight, extra_mask=chosen)
        hl.store(ids, [tile_t, slot], top_id.to(ids.dtype), extra_mask=chosen)


# --------------------------------------------------------------------------------------------
# alignment


def _count_pairs(ids: torch.Tensor, counts: torch.Tensor, block_p: _constexpr) -> None:
    """``counts[b, e]``: pairs of pair block ``b`` in bucket ``e`` (the last bucket: unrouted)."""
    num_pairs = ids.size(0)
    num_buckets = counts.size(1)
    for tile_p in hl.tile(num_pairs, block_size=block_p):
        expert = ids[tile_p].to(torch.int32)
        valid = tile_p.index < num_pairs
        bucket = torch.where((expert >= 0) & (expert < num_buckets - 1), expert, num_buckets - 1)
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
        expert = ids[tile_p].to(torch.int32)
        valid = tile_p.index < num_pairs
        bucket = torch.where((expert >= 0) & (expert < num_buckets - 1), expert, num_buckets - 1)
        earlier = (bucket[None, :] == bucket[:, None]) & (tile_p.index[None, :] < tile_p.index[:, None])
        rank = torch.sum(earlier.to(torch.int32), dim=1).to(torch.int32)
        base = hl.load(block_base, [tile_p.id, bucket], extra_mask=valid)
        start = hl.load(offsets, [bucket], extra_mask=valid)
        hl.store(sorted_pairs, [start + base + rank], tile_p.index, extra_mask=valid)


# --------------------------------------------------------------------------------------------
# grouped GEMM and combine


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


def _combine_topk(pair_out: torch.Tensor, out: torch.Tensor, top_k: _constexpr) -> None:
    """``out[t] = sum_k pair_out[t, k]`` in fp32, rounded to ``pair_out``'s dtype, then ``out``'s."""
    num_tokens, hidden = out.size()
    for tile_t, tile_h in hl.tile([num_tokens, hidden]):
        acc = hl.zeros([tile_t, tile_h], dtype=torch.float32)
        for k in hl.static_range(top_k):
            acc = acc + pair_out[tile_t, k, tile_h].to(torch.float32)
        out[tile_t, tile_h] = acc.to(pair_out.dtype).to(out.dtype)


route_kernel = HelionFunction(_route)
count_pairs_kernel = HelionFunction(_count_pairs)
segment_offsets_kernel = HelionFunction(_segment_offsets)
scatter_pairs_kernel = HelionFunction(_scatter_pairs)
# fp32 GEMMs in exact fp32, as the HF experts' matmuls are (Triton's fp32 default is TF32).
grouped_gemm_kernel = HelionFunction(_grouped_gemm, dot_precision="ieee")
combine_topk_kernel = HelionFunction(_combine_topk)


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
# Keys (see hw_agnostic.autotune.keys):
#   moe_route:     {"dtype", "experts", "top_k", "scoring", "tokens"}
#   moe_align:     {"experts", "top_k", "block_m", "tokens"}
#   grouped_gemm:  {"dtype", "experts", "n", "k", "pairs_per_row", "block_m", "tokens"} (tokens: pairs)
#   fused_experts: {"dtype", "experts", "hidden", "inter", "top_k", "activation", "tokens"}


def _interpreting() -> bool:
    return interpreter_mode() == "triton"


def default_route_config(key: Mapping[str, Any]) -> Config:
    experts, tokens = int(key["experts"]), max(int(key["tokens"]), 1)
    budget = 16384 if _interpreting() else 2048
    rows = max(1, min(next_power_of_2(tokens), budget // next_power_of_2(experts), 64))
    return {"block_sizes": [rows], "num_warps": 4 if next_power_of_2(experts) * rows <= 4096 else 8, "num_stages": 1}


def route_candidates(key: Mapping[str, Any]) -> list[Config]:
    experts, tokens = int(key["experts"]), max(int(key["tokens"]), 1)
    candidates = [default_route_config(key)]
    for rows in (1, 2, 4, 8, 16, 32):
        if rows > next_power_of_2(tokens) or rows * next_power_of_2(experts) > 16384:
            continue
        for warps in (1, 2, 4, 8):
            config = {"block_sizes": [rows], "num_warps": warps, "num_stages": 1}
            if config not in candidates:
                candidates.append(config)
    return candidates


def default_align_config(key: Mapping[str, Any]) -> Config:
    pairs = max(int(key["tokens"]), 1) * int(key["top_k"])
    buckets = int(key["experts"]) + 1
    block_pairs = min(next_power_of_2(pairs), 256 if _interpreting() else 64)
    return {
        "block_pairs": block_pairs,
        "count": {"block_sizes": [min(next_power_of_2(buckets), 256 if _interpreting() else 64)], "num_warps": 4,
                  "num_stages": 1},
        "offsets": {"block_sizes": [16, 64 if _interpreting() else 16], "num_warps": 4, "num_stages": 1},
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


def default_block_m(tokens: int, top_k: int, experts: int) -> int:
    """Rows per GEMM block: about the pairs an expert gets, between 16 and 64 (128 under load)."""
    per_expert = max(tokens, 1) * top_k / max(experts, 1)
    if _interpreting():
        return min(next_power_of_2(max(int(per_expert), 1)), 64)
    for block_m, limit in ((16, 24), (32, 48), (64, 768)):
        if per_expert <= limit:
            return block_m
    return 128


def _gemm_tiles(n: int, k: int, block_m: int) -> Config:
    if _interpreting():
        return {"block_sizes": [min(next_power_of_2(n), 128), min(next_power_of_2(k), 128)], "num_warps": 4,
                "num_stages": 1}
    block_n = min(next_power_of_2(n), 128 if block_m >= 32 else 64)
    block_k = min(next_power_of_2(k), 64 if block_m >= 64 else 128)
    return {"block_sizes": [block_n, block_k], "num_warps": 8 if block_m * block_n >= 128 * 128 else 4,
            "num_stages": 3}


def default_grouped_gemm_config(key: Mapping[str, Any]) -> Config:
    return _gemm_tiles(int(key["n"]), int(key["k"]), int(key["block_m"]))


def _gemm_tile_candidates(n: int, k: int) -> list[Config]:
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


def grouped_gemm_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = [default_grouped_gemm_config(key)]
    for config in _gemm_tile_candidates(int(key["n"]), int(key["k"])):
        if config not in candidates:
            candidates.append(config)
    return candidates


def _combine_config(hidden: int, tokens: int) -> Config:
    block_h = min(next_power_of_2(hidden), 1024)
    budget = 16384 if _interpreting() else 2048
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
        "gate_up": _gemm_tiles(2 * inter, hidden, block_m),
        "down": _gemm_tiles(hidden, inter, block_m),
        "combine": _combine_config(hidden, tokens),
    }


def fused_experts_candidates(key: Mapping[str, Any]) -> list[Config]:
    """Block rows x the GEMM tilings most often best (a product of every knob would never finish)."""
    base = default_fused_experts_config(key)
    hidden, inter = int(key["hidden"]), int(key["inter"])
    candidates = [base]
    tiles = [c for c in _gemm_tile_candidates(max(hidden, 2 * inter), max(hidden, inter))
             if c["num_stages"] in (3, 4) and c["block_sizes"][0] >= 64]
    for block_m in (16, 32, 64, 128):
        for gate_up in tiles:
            for down in (gate_up, base["down"]):
                config = {**base, "block_m": block_m, "gate_up": gate_up, "down": down}
                if config not in candidates:
                    candidates.append(config)
    return candidates


MOE_ROUTE = KernelSpec("moe_route", (_route,), default_route_config, route_candidates)
MOE_ALIGN = KernelSpec("moe_align", (_count_pairs, _segment_offsets, _scatter_pairs), default_align_config,
                       align_candidates)
GROUPED_GEMM = KernelSpec("grouped_gemm", (_grouped_gemm,), default_grouped_gemm_config, grouped_gemm_candidates)
FUSED_EXPERTS = KernelSpec(
    "fused_experts", (_count_pairs, _segment_offsets, _scatter_pairs, _grouped_gemm, _combine_topk),
    default_fused_experts_config, fused_experts_candidates,
)
