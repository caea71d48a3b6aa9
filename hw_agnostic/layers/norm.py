"""RMSNorm: the ``rms_norm`` op as a layer, with the fused residual path."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..ops import fused_add_rms_norm, rms_norm
from ..ops.rms_norm import NUMERICS, fused_add_rms_norm_reference, rms_norm_reference
from .base import CustomOp, EpsAliases
from .module_call import own_attributes

_WEIGHT = ("weight",)


@CustomOp.register("rms_norm")
class RMSNorm(EpsAliases, CustomOp):
    """RMS normalisation over the last dimension, with any of the HF numerics.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` returns
    ``(rms_norm(residual + x), residual + x)`` in one pass over memory (the residual add of a
    decoder layer fused with the norm that follows it).

    ``weight`` may be passed in to share an existing parameter (the backend reuses the HF
    module's, so rewiring copies nothing); a Gemma weight holds ``w`` of ``1 + w``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        numerics: str = "llama",
        *,
        has_weight: bool = True,
        weight: Optional[nn.Parameter] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"RMSNorm: numerics must be one of {NUMERICS}; got {numerics!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.numerics = numerics
        if weight is not None:
            if tuple(weight.shape) != (hidden_size,):
                raise ValueError(f"RMSNorm: weight must have shape ({hidden_size},); got {tuple(weight.shape)}")
            self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        elif has_weight:
            init = torch.zeros if numerics == "gemma" else torch.ones
            self.weight = nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        (weight,) = own_attributes(self, "_parameters", _WEIGHT)
        if residual is None:
            return rms_norm(x, weight, self.eps, numerics=self.numerics)
        if residual.dtype != x.dtype:  # autocast: a 16-bit output added to an fp32 stream promotes, as in HF
            summed = residual + x
            return rms_norm(summed, weight, self.eps, numerics=self.numerics), summed
        return fused_add_rms_norm(x, residual, weight, self.eps, numerics=self.numerics)

    def forward_native(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps, self.numerics)
        return fused_add_rms_norm_reference(x, residual, self.weight, self.eps, self.numerics)

    def extra_repr(self) -> str:
        shape = tuple(self.weight.shape) if self.weight is not None else "no weight"
        return f"{shape}, eps={self.eps}, numerics={self.numerics}"
