"""LayerNorm: the ``layer_norm`` op as a layer, with the fused residual path."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..ops import fused_add_layer_norm, layer_norm
from ..ops.layer_norm import NUMERICS, fused_add_layer_norm_reference, layer_norm_reference
from .base import CustomOp, EpsAliases
from .module_call import own_attributes

_WEIGHT_AND_BIAS = ("weight", "bias")


def own_parameter(name: str, layer: str, shape: tuple[int, ...], given: Optional[nn.Parameter], wanted: bool,
                  init: object, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> Optional[nn.Parameter]:
    """A shared parameter (checked against ``shape``), a fresh one, or None."""
    if given is not None:
        if tuple(given.shape) != shape:
            raise ValueError(f"{layer}: {name} must have shape {shape}; got {tuple(given.shape)}")
        return given if isinstance(given, nn.Parameter) else nn.Parameter(given, requires_grad=False)
    if wanted:
        return nn.Parameter(init(shape, dtype=dtype, device=device))
    return None


@CustomOp.register("layer_norm")
class LayerNorm(EpsAliases, CustomOp):
    """Layer normalisation over the last dimension, with any of the HF numerics.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` returns
    ``(layer_norm(residual + x), residual + x)`` in one pass over memory (the residual add of a
    pre-norm decoder layer fused with the norm that follows it).

    ``num_heads`` gives per-head parameters ``[num_heads, hidden_size]`` applied to
    ``x = [..., num_heads, hidden_size]`` (Cohere's and Chameleon's q/k norms). ``weight`` and
    ``bias`` may be passed in to share existing parameters (the backend reuses the HF module's,
    so rewiring copies nothing); a ``one_plus`` weight holds ``w`` of ``1 + w``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        numerics: str = "fp32",
        *,
        has_weight: bool = True,
        has_bias: bool = True,
        num_heads: Optional[int] = None,
        weight: Optional[nn.Parameter] = None,
        bias: Optional[nn.Parameter] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"LayerNorm: numerics must be one of {NUMERICS}; got {numerics!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.eps = float(eps)
        self.numerics = numerics
        shape = (hidden_size,) if num_heads is None else (num_heads, hidden_size)
        self.weight = own_parameter("weight", "LayerNorm", shape, weight, has_weight,
                                    torch.zeros if numerics == "one_plus" else torch.ones, dtype, device)
        self.bias = own_parameter("bias", "LayerNorm", shape, bias, has_bias, torch.zeros, dtype, device)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        weight, bias = own_attributes(self, "_parameters", _WEIGHT_AND_BIAS)
        if residual is None:
            return layer_norm(x, weight, bias, self.eps, numerics=self.numerics)
        # the fused kernel takes [hidden] parameters only, and one dtype (under autocast a 16-bit
        # output is added to an fp32 stream: the sum promotes, as in HF)
        if self.num_heads is not None or residual.dtype != x.dtype:
            summed = residual + x
            return layer_norm(summed, weight, bias, self.eps, numerics=self.numerics), summed
        return fused_add_layer_norm(x, residual, weight, bias, self.eps, numerics=self.numerics)

    def forward_native(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return layer_norm_reference(x, self.weight, self.bias, self.eps, self.numerics)
        return fused_add_layer_norm_reference(x, residual, self.weight, self.bias, self.eps, self.numerics)

    def extra_repr(self) -> str:
        shape = (self.hidden_size,) if self.num_heads is None else (self.num_heads, self.hidden_size)
        parts = "weight and bias" if self.weight is not None and self.bias is not None else (
            "weight" if self.weight is not None else "bias" if self.bias is not None else "no weight or bias")
        return f"{shape}, {parts}, eps={self.eps}, numerics={self.numerics}"
