"""The gated MLP: one merged gate/up projection, act-and-mul, down projection."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .activation import act_and_mul
from .base import PluggableLayer
from .linear import Linear
from .module_call import call_in, own_attributes, plain_calls

_CHILDREN = ("gate_up_proj", "act_fn", "down_proj")


@PluggableLayer.register("gated_mlp")
class GatedMLP(PluggableLayer):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` as one ``[2I, H]`` projection.

    ``gate_up_proj.weight`` holds the gate rows first (the layout of Phi-3's checkpoints, and of
    ``torch.cat([gate.weight, up.weight])``); biases are optional on both projections. Optional
    constant factors multiply the gate and up projections' outputs and the output
    (``down(act(gate(x) * g) * (up(x) * u)) * d``, Falcon-H1's ``mlp_multipliers``), each rounded
    where the model rounds it, and ``dropout`` applies to the output in training (as in SeedOss).
    ``activation="swiglu_oai"`` is gpt-oss's clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        bias: bool = False,
        down_bias: Optional[bool] = None,
        gate_multiplier: Optional[float] = None,
        up_multiplier: Optional[float] = None,
        down_multiplier: Optional[float] = None,
        dropout: float = 0.0,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GatedMLP: dropout must be in [0, 1); got {dropout}")
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        self.gate_multiplier, self.up_multiplier, self.down_multiplier = gate_multiplier, up_multiplier, down_multiplier
        self.dropout = float(dropout)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device)
        self.act_fn = act_and_mul(activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias if down_bias is None else down_bias,
                                   dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        gate_up_proj, act_fn, down_proj = own_attributes(self, "_modules", _CHILDREN)
        plain = plain_calls()
        gate_up = call_in(plain, gate_up_proj, x)
        if self.gate_multiplier is not None or self.up_multiplier is not None:
            gate, up = gate_up.chunk(2, dim=-1)
            gate = gate if self.gate_multiplier is None else gate * self.gate_multiplier
            up = up if self.up_multiplier is None else up * self.up_multiplier
            gate_up = torch.cat([gate, up], dim=-1)
        out = call_in(plain, down_proj, call_in(plain, act_fn, gate_up))
        if self.down_multiplier is not None:
            out = out * self.down_multiplier
        if self.dropout and self.training:
            out = F.dropout(out, self.dropout, training=True)
        return out

    def extra_repr(self) -> str:
        extra = "".join(f", {name}={getattr(self, name)}" for name in ("gate_multiplier", "up_multiplier",
                                                                      "down_multiplier") if getattr(self, name))
        dropout = f", dropout={self.dropout}" if self.dropout else ""
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, activation={self.activation!r}"
                f"{extra}{dropout}")
