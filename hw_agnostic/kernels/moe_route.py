"""Helion kernel for ``moe_route``: router logits -> top-k expert weights and ids.

One program per block of tokens holds whole rows of router logits, scores them (softmax,
sigmoid, or raw logits for top-k-then-softmax), optionally restricts the choice to the best
expert groups (DeepSeek-V3), and picks the top-k by repeated arg-max over the experts not yet
taken (ties go to the lowest expert index; a NaN score ranks with +inf, above every number, as
``torch.topk`` ranks it), so every id is a distinct expert in ``[0, E)`` whatever the logits
hold. Why Helion for the MoE kernels: see :mod:`.fused_experts`.

Row reductions are taken without ``keepdim`` and widened with ``[:, None]``: Helion writes
``keepdim=True`` as ``tl.reshape(tl.max(...), [rows, 1])``, which Triton 3.6 (the GPU image's)
lays out apart from the tile and converts back through shared memory at every one of the
top-k steps (on sm_90, 16 rows x 128 experts: 32 registers and 56 KB of spills; DeepSeek-V3's
grouped router was still compiling after 12 minutes). ``[:, None]`` (``tt.expand_dims``) keeps
the tile's layout on every Triton; Triton 3.9 compiles both forms alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Values of the ``scoring`` constexpr. Kernels compare constexprs with literals: Helion folds
#: those at compile time, but passes module-level constants in as runtime arguments.
SCORINGS = ("softmax", "sigmoid", "topk_then_softmax", "topk_then_sigmoid")

_constexpr = Constexpr


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
            exp = torch.exp(x - torch.amax(x, dim=1)[:, None])
            scores = exp / torch.sum(exp, dim=1)[:, None]
        elif scoring == "sigmoid":
            scores = torch.sigmoid(x)
        else:
            scores = x
        choice = torch.where(in_range, scores, float("-inf"))
        if has_bias:
            choice = choice + hl.load(correction_bias, [tile_e]).to(torch.float32)[None, :]
        choice = torch.where(choice != choice, float("inf"), choice)  # NaN ranks with +inf
        if n_group > 1:
            # DeepSeek-V3: a group scores the sum of its two best experts; only the topk_group
            # best groups stay eligible.
            group_of = column // (num_experts // n_group)
            group_score = torch.zeros_like(choice)
            for g in hl.static_range(n_group):
                member = (group_of == g)[None, :] & in_range
                in_group = torch.where(member, choice, float("-inf"))
                first = torch.amax(in_group, dim=1)[:, None]
                first_at = torch.amin(torch.where(in_group == first, column[None, :], block_e), dim=1)[:, None]
                second = torch.amax(torch.where(column[None, :] == first_at, float("-inf"), in_group), dim=1)[:, None]
                members = torch.sum(member.to(torch.float32), dim=1)[:, None]
                second = torch.where(members > 1.0, second, 0.0)  # one-expert groups score their one
                group_score = torch.where(member, first + second, group_score)
            group_score = torch.where(group_score != group_score, float("inf"), group_score)
            kept = torch.zeros_like(choice)
            for g in hl.static_range(topk_group):
                open_group = (kept == 0.0) & in_range
                open_score = torch.where(open_group, group_score, float("-inf"))
                best = torch.amax(open_score, dim=1)[:, None]
                best_group = torch.amin(torch.where(open_group & (open_score == best), group_of[None, :], n_group),
                                        dim=1)[:, None]
                kept = torch.where(group_of[None, :] == best_group, 1.0, kept)
            choice = torch.where(kept > 0.0, choice, float("-inf"))
        slot = hl.arange(block_k)
        top_weight = hl.zeros([tile_t, block_k], dtype=torch.float32)
        top_id = hl.zeros([tile_t, block_k], dtype=torch.int32)
        # Taken (and padding) columns leave the choice: with -inf scores a pick must not repeat.
        taken = torch.zeros_like(choice) + torch.where(in_range, 0.0, 1.0)
        for k in hl.static_range(top_k):
            open_choice = torch.where(taken == 0.0, choice, float("-inf"))
            best = torch.amax(open_choice, dim=1)[:, None]
            best_at = torch.amin(torch.where((taken == 0.0) & (open_choice == best), column[None, :], block_e),
                                 dim=1)[:, None]
            hit = column[None, :] == best_at
            value = torch.sum(torch.where(hit, scores, 0.0), dim=1)[:, None]
            top_weight = torch.where(slot[None, :] == k, value, top_weight)
            top_id = torch.where(slot[None, :] == k, best_at, top_id)
            taken = torch.where(hit, 1.0, taken)
        if scoring == "topk_then_softmax":
            top_weight = torch.where(slot[None, :] < top_k, top_weight, float("-inf"))
            exp = torch.exp(top_weight - torch.amax(top_weight, dim=1)[:, None])
            top_weight = exp / torch.sum(exp, dim=1)[:, None]
        if scoring == "topk_then_sigmoid":
            top_weight = torch.sigmoid(top_weight)
        if renormalize:
            total = torch.sum(torch.where(slot[None, :] < top_k, top_weight, 0.0), dim=1)[:, None]
            if scoring == "sigmoid":
                total = total + 1e-20  # as DeepSeek-V3's router does
            top_weight = top_weight / total
        top_weight = top_weight * routed_scaling_factor
        chosen = (slot < top_k)[None, :]
        hl.store(weights, [tile_t, slot], top_weight, extra_mask=chosen)
        hl.store(ids, [tile_t, slot], top_id.to(ids.dtype), extra_mask=chosen)


route_kernel = HelionFunction(_route)


# --------------------------------------------------------------------------------------------
# configs
#
# Key (see hw_agnostic.autotune.keys): {"dtype", "experts", "top_k", "scoring", "tokens"}


def default_route_config(key: Mapping[str, Any]) -> Config:
    experts, tokens = int(key["experts"]), max(int(key["tokens"]), 1)
    budget = 16384 if interpreter_mode() == "triton" else 2048
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


MOE_ROUTE = KernelSpec("moe_route", (_route,), default_route_config, route_candidates)
