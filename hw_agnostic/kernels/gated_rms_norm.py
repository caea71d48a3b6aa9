"""Helion kernel for ``gated_rms_norm``: RMS norm and an activation gate in one pass.

One kernel over ``[rows, groups, group_size]`` views (one group for the usual whole-row norm),
tiled over rows and groups, with a group's elements in registers (or looped over in chunks,
Helion's looped reduction, for very wide groups). It reproduces the casts of the Hugging Face
modules (see :mod:`hw_agnostic.ops.gated_rms_norm`):

* the gate ``act(gate)`` is computed in fp32 from the upcast gate;
* ``gate_then_norm`` multiplies the upcast input by it before the statistics (Mamba-2);
  ``norm_then_gate`` multiplies the scaled result by it (Qwen3-Next, Kimi-Linear);
* ``llama`` numerics round the normalised value to the input dtype before the weight, and the
  product to the input dtype when that is its dtype (``round_product``); ``fp32_scale`` keeps
  everything in fp32 and rounds once.
"""

from __future__ import annotations

from typing import Any

import torch

from . import norm_configs
from .runtime import Constexpr, HelionFunction, KernelSpec

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Values of the constexprs (compared with literals inside the kernel, which Helion folds).
ORDERS = ("norm_then_gate", "gate_then_norm")
NUMERICS = ("llama", "fp32_scale")
ACTIVATIONS = ("silu", "sigmoid")

_constexpr = Constexpr


def _activate(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` in fp32; inlined into the kernel."""
    if activation == "sigmoid":
        return torch.sigmoid(g)
    return g * torch.sigmoid(g)


def _gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    order: _constexpr,
    numerics: _constexpr,
    activation: _constexpr,
    has_gate: _constexpr,
    has_weight: _constexpr,
    round_product: _constexpr,
) -> None:
    m, groups, n = x.size(0), x.size(1), hl.specialize(x.size(2))
    for tile_m, tile_g in hl.tile([m, groups]):
        h = x[tile_m, tile_g, :].to(torch.float32)
        a = h
        if has_gate:  # statements, not expressions: Helion folds constexpr `if`s, not ternaries
            a = _activate(gate[tile_m, tile_g, :].to(torch.float32), activation)
            if order == "gate_then_norm":
                h = h * a
        y = h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps)
        if numerics == "llama":
            y = y.to(x.dtype).to(torch.float32)
        if has_weight:
            y = y * weight[tile_g, :].to(torch.float32)[None, :, :]
            if numerics == "llama" and round_product:
                y = y.to(x.dtype).to(torch.float32)
        if has_gate and order == "norm_then_gate":
            y = y * a
        out[tile_m, tile_g, :] = y.to(out.dtype)


gated_rms_norm_kernel = HelionFunction(_gated_rms_norm, fp_fusion=False)

GATED_RMS_NORM = KernelSpec(
    "gated_rms_norm", (_activate, _gated_rms_norm), norm_configs.default_config, norm_configs.candidate_configs
)
