"""GatedRMSNorm: the ``gated_rms_norm`` op as a layer."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..ops import gated_rms_norm
from ..ops.gated_rms_norm import ACTIVATIONS, NUMERICS, ORDERS, gated_rms_norm_reference
from .base import CustomOp, EpsAliases
from .layer_norm import own_parameter


@CustomOp.register("gated_rms_norm")
class GatedRMSNorm(EpsAliases, CustomOp):
    """RMS normalisation combined with an activation gate, as the hybrid / Mamba-2 families write it.

    ``forward(x, gate=None)``: ``gate`` has ``x``'s shape; without one this is a (grouped) RMS
    norm. ``order``, ``group_size``, ``numerics`` and ``activation`` are those of
    :func:`hw_agnostic.ops.gated_rms_norm`. ``weight`` may be passed in to share an existing
    parameter.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        order: str = "norm_then_gate",
        group_size: Optional[int] = None,
        numerics: str = "llama",
        activation: str = "silu",
        has_weight: bool = True,
        weight: Optional[nn.Parameter] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        for name, value, allowed in (("order", order, ORDERS), ("numerics", numerics, NUMERICS),
                                     ("activation", activation, ACTIVATIONS)):
            if value not in allowed:
                raise ValueError(f"GatedRMSNorm: {name} must be one of {allowed}; got {value!r}")
        if group_size is not None and (group_size < 1 or hidden_size % group_size):
            raise ValueError(f"GatedRMSNorm: group_size must divide hidden_size {hidden_size}; got {group_size}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.order, self.numerics, self.activation = order, numerics, activation
        self.group_size = None if group_size == hidden_size else group_size
        self.weight = own_parameter("weight", "GatedRMSNorm", (hidden_size,), weight, has_weight, torch.ones,
                                    dtype, device)

    def forward(self, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, order=self.order, group_size=self.group_size,
                              numerics=self.numerics, activation=self.activation)

    def forward_native(self, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        return gated_rms_norm_reference(x, gate, self.weight, self.eps, self.order, self.group_size, self.numerics,
                                        self.activation)

    def extra_repr(self) -> str:
        groups = "" if self.group_size is None else f", group_size={self.group_size}"
        weight = "" if self.weight is not None else ", no weight"
        return (f"{self.hidden_size}, eps={self.eps}, order={self.order}{groups}, numerics={self.numerics}, "
                f"activation={self.activation}{weight}")
