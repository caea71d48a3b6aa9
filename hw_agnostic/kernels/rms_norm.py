"""Helion kernels for ``rms_norm`` and ``fused_add_rms_norm``.

Every kernel works on 2-D row views ``[rows, hidden]`` with arbitrary strides, accumulates in
fp32, and reproduces the casts of the Hugging Face module it replaces (``numerics``):

* ``llama``: normalise in fp32, cast to the input dtype, multiply by the weight in the
  promoted dtype (``weight * normed.to(input_dtype)``).
* ``fp32_scale``: multiply by the weight in fp32, then cast (OLMo-2, gpt-oss).
* ``gemma``: multiply by ``1 + weight`` in fp32, then cast.

``fused_add_rms_norm`` has two kernels. ``row`` keeps a whole row in registers and touches
memory once per tensor; ``chunked`` walks long rows in chunks in two passes and reads the sum
back from ``residual_out`` in the second (Helion's automatic looped reduction would instead
re-read ``x`` and ``residual``, which is one more pass over memory and wrong when the outputs
alias the inputs). Both are safe when ``out is x`` and ``residual_out is residual``: a program
reads each element before it writes it, and programs own disjoint rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Values of the ``numerics`` constexpr. Kernels compare constexprs with literals: Helion folds
#: those at compile time, but passes module-level constants in as runtime arguments.
NUMERICS = ("llama", "fp32_scale", "gemma")

_constexpr = Constexpr


def _apply_weight(normed: torch.Tensor, weight_row: torch.Tensor, input_dtype: torch.dtype, numerics: str) -> torch.Tensor:
    """``normed`` (fp32) scaled as the HF module of ``numerics`` does it; inlined into each kernel."""
    if numerics == "llama":
        return normed.to(input_dtype).to(torch.float32) * weight_row
    if numerics == "fp32_scale":
        return normed * weight_row
    return normed * (1.0 + weight_row)


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
) -> None:
    m, n = x.size(0), hl.specialize(x.size(1))
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        inv_rms = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
        normed = xf * inv_rms
        y = normed
        if has_weight:  # a statement, not an expression: Helion folds constexpr `if`s, not ternaries
            y = _apply_weight(normed, weight[None, :].to(torch.float32), x.dtype, numerics)
        out[tile_m, :] = y.to(out.dtype)


def _fused_add_rms_norm_row(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
) -> None:
    m, n = x.size(0), hl.specialize(x.size(1))
    for tile_m in hl.tile(m):
        s = (x[tile_m, :].to(torch.float32) + residual[tile_m, :].to(torch.float32)).to(residual_out.dtype)
        residual_out[tile_m, :] = s
        sf = s.to(torch.float32)
        inv_rms = torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + eps)
        normed = sf * inv_rms
        y = normed
        if has_weight:  # a statement, not an expression: Helion folds constexpr `if`s, not ternaries
            y = _apply_weight(normed, weight[None, :].to(torch.float32), x.dtype, numerics)
        out[tile_m, :] = y.to(out.dtype)


def _fused_add_rms_norm_chunked(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
) -> None:
    m, n = x.size()
    block_m = hl.register_block_size(m)
    block_n = hl.register_block_size(n)
    for tile_m in hl.tile(m, block_size=block_m):
        sum_sq = hl.zeros([tile_m], dtype=torch.float32)
        for tile_n in hl.tile(n, block_size=block_n):
            s = (x[tile_m, tile_n].to(torch.float32) + residual[tile_m, tile_n].to(torch.float32)).to(
                residual_out.dtype
            )
            residual_out[tile_m, tile_n] = s
            sf = s.to(torch.float32)
            sum_sq = sum_sq + torch.sum(sf * sf, dim=-1)
        inv_rms = torch.rsqrt(sum_sq / n + eps)
        for tile_n in hl.tile(n, block_size=block_n):
            normed = residual_out[tile_m, tile_n].to(torch.float32) * inv_rms[:, None]
            y = normed
            if has_weight:
                y = _apply_weight(normed, weight[None, tile_n].to(torch.float32), x.dtype, numerics)
            out[tile_m, tile_n] = y.to(out.dtype)


rms_norm_kernel = HelionFunction(_rms_norm, memory_bound=True, fp_fusion=False)
fused_add_rms_norm_row_kernel = HelionFunction(_fused_add_rms_norm_row, memory_bound=True, fp_fusion=False)
fused_add_rms_norm_chunked_kernel = HelionFunction(_fused_add_rms_norm_chunked, memory_bound=True, fp_fusion=False)


# --------------------------------------------------------------------------------------------
# configs
#
# Keys (see hw_agnostic.autotune.keys): {"dtype", "hidden", "tokens"}.


def _rows_per_program(key: Mapping[str, Any]) -> int:
    hidden, tokens = int(key["hidden"]), max(int(key["tokens"]), 1)
    if interpreter_mode() == "triton":
        # The interpreter costs milliseconds per program: few, large programs.
        return min(next_power_of_2(tokens), max(1, 16384 // next_power_of_2(hidden)), 64)
    # Small rows (per-head q/k norms) are packed several to a program.
    return min(next_power_of_2(tokens), max(1, 2048 // next_power_of_2(hidden)))


def _num_warps(elements: int) -> int:
    return min(16, max(1, next_power_of_2(elements) // 512))


_PERSISTENT_LIMIT = 16384


def default_rms_norm_config(key: Mapping[str, Any]) -> Config:
    hidden = int(key["hidden"])
    rows = _rows_per_program(key)
    chunk = None if hidden <= _PERSISTENT_LIMIT else 4096
    return {
        "block_sizes": [rows],
        "reduction_loops": [chunk],
        "num_warps": _num_warps(rows * min(next_power_of_2(hidden), chunk or next_power_of_2(hidden))),
        "num_stages": 1,
    }


def rms_norm_candidates(key: Mapping[str, Any]) -> list[Config]:
    hidden, tokens = int(key["hidden"]), max(int(key["tokens"]), 1)
    candidates = [default_rms_norm_config(key)]
    for rows in (1, 2, 4, 8, 16, 32):
        if rows > next_power_of_2(tokens) or rows * min(next_power_of_2(hidden), _PERSISTENT_LIMIT) > 65536:
            continue
        for chunk in (None, 1024, 2048, 4096, 8192):
            if chunk is not None and chunk >= next_power_of_2(hidden):
                continue
            if chunk is None and hidden > 4 * _PERSISTENT_LIMIT:
                continue
            for warps in (1, 2, 4, 8, 16, 32):
                config = {"block_sizes": [rows], "reduction_loops": [chunk], "num_warps": warps, "num_stages": 1}
                if config not in candidates:
                    candidates.append(config)
    return candidates


def default_fused_add_rms_norm_config(key: Mapping[str, Any]) -> Config:
    hidden = int(key["hidden"])
    rows = _rows_per_program(key)
    if hidden <= _PERSISTENT_LIMIT:
        return {"variant": "row", "block_sizes": [rows], "num_warps": _num_warps(rows * next_power_of_2(hidden)), "num_stages": 1}
    return {"variant": "chunked", "block_sizes": [rows, 4096], "num_warps": _num_warps(rows * 4096), "num_stages": 1}


def fused_add_rms_norm_candidates(key: Mapping[str, Any]) -> list[Config]:
    hidden, tokens = int(key["hidden"]), max(int(key["tokens"]), 1)
    candidates = [default_fused_add_rms_norm_config(key)]
    for rows in (1, 2, 4, 8, 16, 32):
        if rows > next_power_of_2(tokens):
            continue
        for warps in (1, 2, 4, 8, 16, 32):
            if hidden <= 4 * _PERSISTENT_LIMIT and rows * next_power_of_2(hidden) <= 65536:
                candidates.append({"variant": "row", "block_sizes": [rows], "num_warps": warps, "num_stages": 1})
            for chunk in (1024, 2048, 4096, 8192):
                if chunk < next_power_of_2(hidden):
                    candidates.append(
                        {"variant": "chunked", "block_sizes": [rows, chunk], "num_warps": warps, "num_stages": 1}
                    )
    unique: list[Config] = []
    for config in candidates:
        if config not in unique:
            unique.append(config)
    return unique


def split_variant(config: Config) -> tuple[str, Config]:
    """The fused kernel's variant name and the Helion config proper."""
    helion_config = dict(config)
    return helion_config.pop("variant", "row"), helion_config


RMS_NORM = KernelSpec("rms_norm", (_apply_weight, _rms_norm), default_rms_norm_config, rms_norm_candidates)
FUSED_ADD_RMS_NORM = KernelSpec(
    "fused_add_rms_norm",
    (_apply_weight, _fused_add_rms_norm_row, _fused_add_rms_norm_chunked),
    default_fused_add_rms_norm_config,
    fused_add_rms_norm_candidates,
)
