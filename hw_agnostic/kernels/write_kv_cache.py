"""Helion kernel for ``write_kv_cache``: keys and values into their slots of the paged cache.

Layouts (the op module builds these views without copying): ``key``, ``value``
``[tokens, num_kv_heads, head_dim]``, any strides; caches ``[num_blocks * block_size,
num_kv_heads, head_dim]``: the paged cache ``[num_blocks, block_size, Hkv, D]`` with its first two
dims merged (slot = block * block_size + offset); any strides otherwise. Slots outside the cache
(negative ones mark padding) are masked, so a bad slot never writes out of bounds; the op's
reference path validates the slots and raises. Why Helion: see :mod:`.paged_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None


def _write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.size()
    num_slots = k_cache.size(0)
    for tile_t, tile_h in hl.tile([num_tokens, num_kv_heads]):
        slot = slot_mapping[tile_t].to(torch.int64)
        keep = (slot >= 0) & (slot < num_slots)
        slot = torch.where(keep, slot, 0)
        heads = tile_h.index.to(torch.int64)
        for tile_d in hl.tile(head_dim):
            dims = tile_d.index.to(torch.int64)
            hl.store(k_cache, [slot, heads, dims], key[tile_t, tile_h, tile_d], extra_mask=keep[:, None, None])
            hl.store(v_cache, [slot, heads, dims], value[tile_t, tile_h, tile_d], extra_mask=keep[:, None, None])


write_kv_cache_kernel = HelionFunction(_write_kv_cache, memory_bound=True)


# --------------------------------------------------------------------------------------------
# configs
#
# Key: {"dtype", "head_dim", "num_kv_heads", "tokens"}.


def default_write_kv_cache_config(key: Mapping[str, Any]) -> Config:
    head_dim, heads, tokens = int(key["head_dim"]), int(key["num_kv_heads"]), max(int(key["tokens"]), 1)
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(heads), max(1, 1024 // block_d))
    budget = 16384 if interpreter_mode() == "triton" else 2048
    block_t = min(next_power_of_2(tokens), max(1, budget // (block_h * block_d)))
    # Up to 4 warps, as many as give every thread a 16-byte vector of the tile (64-wide AMD waves too):
    # one token of 2 heads x 128 over 4 warps got 4-byte loads.
    element_bytes = 4 if key.get("dtype") == "float32" else 2
    warps = min(4, max(1, block_t * block_h * block_d * element_bytes // (16 * 64)))
    return {"block_sizes": [block_t, block_h, block_d], "num_warps": warps, "num_stages": 1}


def write_kv_cache_candidates(key: Mapping[str, Any]) -> list[Config]:
    head_dim, tokens = int(key["head_dim"]), max(int(key["tokens"]), 1)
    candidates = [default_write_kv_cache_config(key)]
    for block_t in (1, 2, 4, 8, 16):
        if block_t > next_power_of_2(tokens):
            continue
        for block_h in (1, 2, 4, 8):
            for warps in (1, 2, 4, 8):
                config = {"block_sizes": [block_t, block_h, next_power_of_2(head_dim)], "num_warps": warps, "num_stages": 1}
                if config not in candidates:
                    candidates.append(config)
    return candidates


WRITE_KV_CACHE = KernelSpec(
    "write_kv_cache", (_write_kv_cache,), default_write_kv_cache_config, write_kv_cache_candidates
)
