"""Helion kernel for ``rotary_embedding``: queries and keys rotated in one launch.

Layouts: the op's own, no views in between (each costs the host a microsecond): ``q``
``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]``, any strides (Hugging Face's queries are transposed
views of the projection's ``[B, T, H, D]`` output); ``cos`` / ``sin`` ``[B, T, R]``, broadcast over
the heads (the op expands a table shared by several rows, batch stride 0); outputs laid out like
``q`` / ``k``.
The first ``R`` dims are rotated in the neox layout (halves ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``),
the others (partial rotary) are copied.

The math is Hugging Face's ``x * cos + rotate_half(x) * sin`` with its roundings: each product is
rounded to the dtype, then their sum (``rotate_half`` negates, which is exact). Rounding the
products first also keeps the GPU compiler from contracting them into an FMA in fp16/bf16; in
fp32 an FMA may differ from eager PyTorch in the last bit.

One launch for both tensors: two top-level loops, which Helion runs as one grid (the programs
of the second loop follow those of the first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Half the rotary dim is a constexpr: the second half's loads are at a constant offset from the
#: first's, so the compiler can prove them aligned and use 16-byte vectors (fixed per model).
_constexpr = Constexpr


def _rotate(x1: torch.Tensor, x2: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, s1: torch.Tensor,
            s2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` on the two halves, each product rounded to ``dtype`` and
    then the sum, as HF's eager code rounds; inlined into the kernel."""
    x1, x2 = x1.to(torch.float32), x2.to(torch.float32)
    first = (x1 * c1).to(dtype).to(torch.float32) - (x2 * s1).to(dtype).to(torch.float32)
    second = (x2 * c2).to(dtype).to(torch.float32) + (x1 * s2).to(dtype).to(torch.float32)
    return first.to(dtype), second.to(dtype)


def _rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    half: _constexpr,
) -> None:
    batch, q_heads, tokens, head_dim = q.size()
    k_heads = k.size(1)
    rotary = 2 * half
    for tile_b, tile_h, tile_t in hl.tile([batch, q_heads, tokens]):
        for tile_d in hl.tile(half):
            second = tile_d.index + half
            c1 = cos[tile_b, tile_t, tile_d].to(torch.float32)[:, None, :, :]
            c2 = cos[tile_b, tile_t, second].to(torch.float32)[:, None, :, :]
            s1 = sin[tile_b, tile_t, tile_d].to(torch.float32)[:, None, :, :]
            s2 = sin[tile_b, tile_t, second].to(torch.float32)[:, None, :, :]
            first_half, second_half = _rotate(q[tile_b, tile_h, tile_t, tile_d], q[tile_b, tile_h, tile_t, second],
                                              c1, c2, s1, s2, q_out.dtype)
            q_out[tile_b, tile_h, tile_t, tile_d] = first_half
            q_out[tile_b, tile_h, tile_t, second] = second_half
        for tile_p in hl.tile(rotary, head_dim):
            q_out[tile_b, tile_h, tile_t, tile_p] = q[tile_b, tile_h, tile_t, tile_p]
    for tile_b, tile_h, tile_t in hl.tile([batch, k_heads, tokens]):
        for tile_d in hl.tile(half):
            second = tile_d.index + half
            c1 = cos[tile_b, tile_t, tile_d].to(torch.float32)[:, None, :, :]
            c2 = cos[tile_b, tile_t, second].to(torch.float32)[:, None, :, :]
            s1 = sin[tile_b, tile_t, tile_d].to(torch.float32)[:, None, :, :]
            s2 = sin[tile_b, tile_t, second].to(torch.float32)[:, None, :, :]
            first_half, second_half = _rotate(k[tile_b, tile_h, tile_t, tile_d], k[tile_b, tile_h, tile_t, second],
                                              c1, c2, s1, s2, k_out.dtype)
            k_out[tile_b, tile_h, tile_t, tile_d] = first_half
            k_out[tile_b, tile_h, tile_t, second] = second_half
        for tile_p in hl.tile(rotary, head_dim):
            k_out[tile_b, tile_h, tile_t, tile_p] = k[tile_b, tile_h, tile_t, tile_p]


rotary_embedding_kernel = HelionFunction(_rotary_embedding, memory_bound=True, fp_fusion=False)


# --------------------------------------------------------------------------------------------
# configs. Keys: {"dtype", "head_dim", "rotary_dim", "q_heads", "k_heads", "tokens"}. Block sizes:
# the q loop's [batch, heads, tokens], its half-rotary and pass-through dims, then the k loop's.


def _blocks(key: Mapping[str, Any], heads: int, budget: int) -> list[int]:
    half = max(int(key["rotary_dim"]) // 2, 1)
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(heads), max(1, budget // block_d))
    block_t = min(next_power_of_2(max(int(key["tokens"]), 1)), max(1, budget // (block_h * block_d)))
    passed = int(key["head_dim"]) - int(key["rotary_dim"])
    block_p = min(next_power_of_2(max(passed, 1)), 1024)
    return [1, block_h, block_t, block_d, block_p]


def default_rotary_embedding_config(key: Mapping[str, Any]) -> Config:
    budget = 16384 if interpreter_mode() == "triton" else 1024
    q_blocks = _blocks(key, int(key["q_heads"]), budget)
    k_blocks = _blocks(key, int(key["k_heads"]), budget)
    # Up to 4 warps, as many as give every thread a 16-byte vector of a half-rotary tile (64-wide AMD waves too).
    element_bytes = 4 if key.get("dtype") == "float32" else 2
    elements = q_blocks[1] * q_blocks[2] * q_blocks[3]
    warps = min(4, max(1, elements * element_bytes // (16 * 64)))
    return {"block_sizes": q_blocks + k_blocks, "num_warps": warps, "num_stages": 1}


def rotary_embedding_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = [default_rotary_embedding_config(key)]
    tokens = next_power_of_2(max(int(key["tokens"]), 1))
    for budget in (256, 512, 1024, 2048, 4096):
        q_blocks = _blocks(key, int(key["q_heads"]), budget)
        k_blocks = _blocks(key, int(key["k_heads"]), budget)
        if q_blocks[2] > tokens:
            continue
        for warps in (1, 2, 4, 8):
            config = {"block_sizes": q_blocks + k_blocks, "num_warps": warps, "num_stages": 1}
            if config not in candidates:
                candidates.append(config)
    return candidates


ROTARY_EMBEDDING = KernelSpec(
    "rotary_embedding", (_rotate, _rotary_embedding), default_rotary_embedding_config, rotary_embedding_candidates
)
