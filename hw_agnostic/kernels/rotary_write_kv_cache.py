"""Helion kernel for ``rotary_write_kv_cache``: queries and keys rotated, the rotated keys and the
values written into their slots of the paged cache, in one launch.

Layouts (the op module builds these views without copying): ``q`` ``[tokens, Hq, D]``, ``k`` /
``v`` ``[tokens, Hkv, D]``, any strides (Hugging Face's heads transposed back to the projections'
tokens-major layout, batch and tokens merged); ``cos`` / ``sin`` ``[tokens, R]``, one row per
token; results ``q_out`` / ``k_out`` as ``q`` / ``k``; caches ``[num_blocks * block_size, Hkv, D]``
(see :mod:`.write_kv_cache`). Two top-level loops, one grid: the queries' programs, then the keys'
and values'.

The rotation is :mod:`.rotary_embedding`'s (its ``_rotate``, so the roundings are Hugging Face's,
bit for bit); each rotated key goes to ``k_out`` and to its slot, each value to its slot. Slots
outside the cache (negative ones mark padding) are masked, as in ``write_kv_cache``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .rotary_embedding import _rotate
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

_constexpr = Constexpr  # half the rotary dim: see :mod:`.rotary_embedding`


def _rotary_write_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    half: _constexpr,
) -> None:
    tokens, q_heads, head_dim = q.size()
    k_heads = k.size(1)
    num_slots = k_cache.size(0)
    rotary = 2 * half
    for tile_n, tile_h in hl.tile([tokens, q_heads]):
        for tile_d in hl.tile(half):
            second = tile_d.index + half
            c1 = cos[tile_n, tile_d].to(torch.float32)[:, None, :]
            c2 = cos[tile_n, second].to(torch.float32)[:, None, :]
            s1 = sin[tile_n, tile_d].to(torch.float32)[:, None, :]
            s2 = sin[tile_n, second].to(torch.float32)[:, None, :]
            first_half, second_half = _rotate(q[tile_n, tile_h, tile_d], q[tile_n, tile_h, second],
                                              c1, c2, s1, s2, q_out.dtype)
            q_out[tile_n, tile_h, tile_d] = first_half
            q_out[tile_n, tile_h, second] = second_half
        for tile_p in hl.tile(rotary, head_dim):
            q_out[tile_n, tile_h, tile_p] = q[tile_n, tile_h, tile_p]
    for tile_n, tile_h in hl.tile([tokens, k_heads]):
        slot = slot_mapping[tile_n].to(torch.int64)
        keep = (slot >= 0) & (slot < num_slots)
        slot = torch.where(keep, slot, 0)
        heads = tile_h.index.to(torch.int64)
        for tile_d in hl.tile(half):
            second = tile_d.index + half
            c1 = cos[tile_n, tile_d].to(torch.float32)[:, None, :]
            c2 = cos[tile_n, second].to(torch.float32)[:, None, :]
            s1 = sin[tile_n, tile_d].to(torch.float32)[:, None, :]
            s2 = sin[tile_n, second].to(torch.float32)[:, None, :]
            first_half, second_half = _rotate(k[tile_n, tile_h, tile_d], k[tile_n, tile_h, second],
                                              c1, c2, s1, s2, k_out.dtype)
            k_out[tile_n, tile_h, tile_d] = first_half
            k_out[tile_n, tile_h, second] = second_half
            hl.store(k_cache, [slot, heads, tile_d.index.to(torch.int64)], first_half, extra_mask=keep[:, None, None])
            hl.store(k_cache, [slot, heads, second.to(torch.int64)], second_half, extra_mask=keep[:, None, None])
        for tile_p in hl.tile(rotary, head_dim):
            passed = k[tile_n, tile_h, tile_p]
            k_out[tile_n, tile_h, tile_p] = passed
            hl.store(k_cache, [slot, heads, tile_p.index.to(torch.int64)], passed, extra_mask=keep[:, None, None])
        for tile_e in hl.tile(head_dim):
            hl.store(v_cache, [slot, heads, tile_e.index.to(torch.int64)], v[tile_n, tile_h, tile_e],
                     extra_mask=keep[:, None, None])


rotary_write_kv_cache_kernel = HelionFunction(_rotary_write_kv_cache, memory_bound=True, fp_fusion=False)


# --------------------------------------------------------------------------------------------
# configs. Keys: {"dtype", "head_dim", "rotary_dim", "q_heads", "k_heads", "tokens"}. Block sizes:
# the q loop's [tokens, heads], its half-rotary and pass-through dims, then the k loop's [tokens,
# heads], half-rotary, pass-through and whole-head (the values) dims.


def _blocks(key: Mapping[str, Any], heads: int, budget: int) -> list[int]:
    half = max(int(key["rotary_dim"]) // 2, 1)
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, budget // block_d))
    block_n = min(next_power_of_2(max(int(key["tokens"]), 1)), max(1, budget // (block_h * block_d)))
    passed = int(key["head_dim"]) - int(key["rotary_dim"])
    return [block_n, block_h, block_d, min(next_power_of_2(max(passed, 1)), 1024)]


def _config(key: Mapping[str, Any], budget: int, warps: int) -> Config:
    k_blocks = _blocks(key, int(key["k_heads"]), budget)
    return {"block_sizes": _blocks(key, int(key["q_heads"]), budget) + k_blocks
            + [min(next_power_of_2(int(key["head_dim"])), 1024)], "num_warps": warps, "num_stages": 1}


def default_rotary_write_kv_cache_config(key: Mapping[str, Any]) -> Config:
    budget = 16384 if interpreter_mode() == "triton" else 1024
    q_blocks = _blocks(key, int(key["q_heads"]), budget)
    # Up to 4 warps, as many as give every thread a 16-byte vector of a half-rotary tile (as rotary_embedding's).
    element_bytes = 4 if key.get("dtype") == "float32" else 2
    warps = min(4, max(1, q_blocks[0] * q_blocks[1] * q_blocks[2] * element_bytes // (16 * 64)))
    return _config(key, budget, warps)


def rotary_write_kv_cache_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = [default_rotary_write_kv_cache_config(key)]
    tokens = next_power_of_2(max(int(key["tokens"]), 1))
    for budget in (256, 512, 1024, 2048, 4096):
        if _blocks(key, int(key["q_heads"]), budget)[0] > tokens:
            continue
        for warps in (1, 2, 4, 8):
            config = _config(key, budget, warps)
            if config not in candidates:
                candidates.append(config)
    return candidates


ROTARY_WRITE_KV_CACHE = KernelSpec(
    "rotary_write_kv_cache", (_rotate, _rotary_write_kv_cache), default_rotary_write_kv_cache_config,
    rotary_write_kv_cache_candidates,
)
