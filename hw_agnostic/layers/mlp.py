"""The gated MLP: one merged gate/up projection, act-and-mul, down projection."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .activation import act_and_mul
from .base import PluggableLayer


@PluggableLayer.register("gated_mlp")
class GatedMLP(PluggableLayer):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` as one ``[2I, H]`` projection.

    ``gate_up_proj.weight`` holds the gate rows first (the layout of Phi-3's checkpoints, and of
    ``torch.cat([gate.weight, up.weight])``); biases are optional on both projections.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        bias: bool = False,
        down_bias: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device)
        self.act_fn = act_and_mul(activation)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias if down_bias is None else down_bias,
                                   dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, activation={self.activation!r}"
