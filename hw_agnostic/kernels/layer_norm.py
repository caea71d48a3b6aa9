"""Helion kernels for ``layer_norm`` and ``fused_add_layer_norm``.

Mean and variance are computed in fp32 from values held in registers (the variance as the mean
of squared deviations, never ``E[x²] - E[x]²``), and the affine part follows the Hugging Face
module being replaced (``numerics``):

* ``fp32``: ``normed * w + b`` in fp32, one rounding to the input dtype (``nn.LayerNorm``,
  ``F.layer_norm``, Cohere, OLMo).
* ``one_plus``: the same with ``w + 1`` rounded to the weight's dtype first (Nemotron's
  ``LayerNorm1P``).
* ``cast_then_affine``: ``normed`` rounded to the input dtype, then multiplied by ``w`` (rounded
  again when the product's dtype is the input's: ``round_product``), then ``+ b`` (Chameleon).

``layer_norm`` works on ``[rows, heads, width]`` views with ``[heads, width]`` parameters (one
head for the usual ``[width]`` ones), so per-head norms (Cohere's q/k norm) run in one launch.
``fused_add_layer_norm`` has the ``row`` / ``chunked`` pair of ``fused_add_rms_norm``; the
chunked one merges per-chunk means and squared deviations (Chan et al.) so it reads ``x`` and
``residual`` once and the sum back once. Both are safe when the outputs are the inputs: a
program reads each element before it writes it, and programs own disjoint rows.
"""

from __future__ import annotations

from typing import Any

import torch

from . import norm_configs
from .rms_norm import default_fused_add_rms_norm_config, fused_add_rms_norm_candidates
from .runtime import Constexpr, HelionFunction, KernelSpec

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Values of the ``numerics`` constexpr (compared with literals inside the kernels, which Helion folds).
NUMERICS = ("fp32", "one_plus", "cast_then_affine")

_constexpr = Constexpr


def _affine(y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, weight_dtype: torch.dtype, input_dtype: torch.dtype,
            numerics: str, has_weight: bool, has_bias: bool, round_product: bool) -> torch.Tensor:
    """The normalised ``y`` (fp32) times ``w`` plus ``b`` (fp32 tiles) with the module's roundings;
    inlined into each kernel. Absent parameters are stand-ins whose loads the compiler drops."""
    if numerics == "cast_then_affine":
        y = y.to(input_dtype).to(torch.float32)
    if has_weight:  # statements, not expressions: Helion folds constexpr `if`s, not ternaries
        if numerics == "one_plus":
            y = y * (w + 1.0).to(weight_dtype).to(torch.float32)
        else:
            y = y * w
            if numerics == "cast_then_affine" and round_product:
                y = y.to(input_dtype).to(torch.float32)
    if has_bias:
        y = y + b
    return y


def _layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
    has_bias: _constexpr,
    round_product: _constexpr,
) -> None:
    m, heads, n = x.size(0), x.size(1), hl.specialize(x.size(2))
    for tile_m, tile_h in hl.tile([m, heads]):
        xf = x[tile_m, tile_h, :].to(torch.float32)
        mean = torch.mean(xf, dim=-1, keepdim=True)
        centred = xf - mean
        variance = torch.mean(centred * centred, dim=-1, keepdim=True)
        y = _affine(centred * torch.rsqrt(variance + eps), weight[tile_h, :].to(torch.float32)[None, :, :],
                    bias[tile_h, :].to(torch.float32)[None, :, :], weight.dtype, x.dtype, numerics, has_weight,
                    has_bias, round_product)
        out[tile_m, tile_h, :] = y.to(out.dtype)


def _fused_add_layer_norm_row(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
    has_bias: _constexpr,
    round_product: _constexpr,
) -> None:
    m, n = x.size(0), hl.specialize(x.size(1))
    for tile_m in hl.tile(m):
        s = (x[tile_m, :].to(torch.float32) + residual[tile_m, :].to(torch.float32)).to(residual_out.dtype)
        residual_out[tile_m, :] = s
        sf = s.to(torch.float32)
        mean = torch.mean(sf, dim=-1, keepdim=True)
        centred = sf - mean
        variance = torch.mean(centred * centred, dim=-1, keepdim=True)
        y = _affine(centred * torch.rsqrt(variance + eps), weight[None, :].to(torch.float32),
                    bias[None, :].to(torch.float32), weight.dtype, x.dtype, numerics, has_weight, has_bias,
                    round_product)
        out[tile_m, :] = y.to(out.dtype)


def _fused_add_layer_norm_chunked(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    numerics: _constexpr,
    has_weight: _constexpr,
    has_bias: _constexpr,
    round_product: _constexpr,
) -> None:
    m, n = x.size()
    block_m = hl.register_block_size(m)
    block_n = hl.register_block_size(n)
    for tile_m in hl.tile(m, block_size=block_m):
        count = hl.zeros([tile_m], dtype=torch.float32)
        mean = hl.zeros([tile_m], dtype=torch.float32)
        squares = hl.zeros([tile_m], dtype=torch.float32)  # sum of squared deviations from the mean
        for tile_n in hl.tile(n, block_size=block_n):
            s = (x[tile_m, tile_n].to(torch.float32) + residual[tile_m, tile_n].to(torch.float32)).to(
                residual_out.dtype
            )
            residual_out[tile_m, tile_n] = s
            sf = s.to(torch.float32)  # masked columns load as 0
            chunk_count = tile_n.end - tile_n.begin
            chunk_mean = torch.sum(sf, dim=-1) / chunk_count
            deviation = torch.where(tile_n.index[None, :] < n, sf - chunk_mean[:, None], 0.0)
            chunk_squares = torch.sum(deviation * deviation, dim=-1)
            total = count + chunk_count
            delta = chunk_mean - mean
            mean = mean + delta * (chunk_count / total)
            squares = squares + chunk_squares + delta * delta * (count * chunk_count / total)
            count = total
        inv_std = torch.rsqrt(squares / n + eps)
        for tile_n in hl.tile(n, block_size=block_n):
            y = _affine((residual_out[tile_m, tile_n].to(torch.float32) - mean[:, None]) * inv_std[:, None],
                        weight[None, tile_n].to(torch.float32), bias[None, tile_n].to(torch.float32), weight.dtype,
                        x.dtype, numerics, has_weight, has_bias, round_product)
            out[tile_m, tile_n] = y.to(out.dtype)


layer_norm_kernel = HelionFunction(_layer_norm, fp_fusion=False)
fused_add_layer_norm_row_kernel = HelionFunction(_fused_add_layer_norm_row, fp_fusion=False)
fused_add_layer_norm_chunked_kernel = HelionFunction(_fused_add_layer_norm_chunked, fp_fusion=False)

LAYER_NORM = KernelSpec(
    "layer_norm", (_affine, _layer_norm), norm_configs.default_config, norm_configs.candidate_configs
)
# The fused kernels have the shape of fused_add_rms_norm's (row / chunked over [rows, hidden]): same configs.
FUSED_ADD_LAYER_NORM = KernelSpec(
    "fused_add_layer_norm",
    (_affine, _fused_add_layer_norm_row, _fused_add_layer_norm_chunked),
    default_fused_add_rms_norm_config,
    fused_add_rms_norm_candidates,
)
