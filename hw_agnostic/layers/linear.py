"""``Linear``: ``nn.Linear`` whose forward is :func:`hw_agnostic.ops.linear` (same values, bit for bit)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import linear
from .base import CustomOp
from .module_call import own_attributes

_WEIGHT_AND_BIAS = ("weight", "bias")


@CustomOp.register("linear")
class Linear(CustomOp, nn.Linear):
    """The projections of the library's own layers (the merged q/k/v, gate/up and down projections).

    An ``nn.Linear`` in every other respect (parameters, state-dict keys, ``isinstance`` checks);
    its forward runs fp32 CPU calls of a few rows in column blocks (see :mod:`hw_agnostic.ops.linear`).
    """

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = own_attributes(self, "_parameters", _WEIGHT_AND_BIAS)
        return linear(x, weight, bias)

    def forward_native(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)
