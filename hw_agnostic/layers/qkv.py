"""A merged q/k/v projection behind the three projections an attention module calls.

HF attention modules call ``self.q_proj(x)``, ``self.k_proj(x)`` and ``self.v_proj(x)`` on the
same ``x``. :class:`QKVProjection` holds one ``[q + k + v, H]`` weight; the backend puts it on
the attention module as ``qkv_proj`` and replaces the three projections by :class:`QKVPart`
views. The first part asked for an input runs the one merged matmul and keeps the other two
results until they are asked for (or another input arrives), so the attention code, unchanged,
runs one GEMM instead of three.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .base import PluggableLayer
from .linear import Linear
from .module_call import call


@PluggableLayer.register("qkv_projection")
class QKVProjection(PluggableLayer):
    """One projection computing ``len(sizes)`` outputs (q, k, v) of an input."""

    def __init__(
        self,
        hidden_size: int,
        sizes: tuple[int, ...],
        *,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self.sizes = tuple(int(s) for s in sizes)
        self.proj = Linear(hidden_size, sum(self.sizes), bias=bias, dtype=dtype, device=device)
        self._pending: Optional[tuple[Tensor, tuple[Tensor, ...], int]] = None

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return call(self.proj, x).split_with_sizes(self.sizes, dim=-1)  # Tensor.split: a Python wrapper over it

    def part(self, x: Tensor, index: int) -> Tensor:
        """Output ``index`` for ``x``, from the merged matmul (run once per input)."""
        pending = self._pending
        if pending is not None and pending[0] is x:
            outputs, left = pending[1], pending[2] - 1
            # past nn.Module.__setattr__, which checks every assignment for parameters, buffers
            # and modules: 2.5 us of each of the three calls a decode step's layer makes
            self.__dict__["_pending"] = (x, outputs, left) if left else None
            return outputs[index]
        outputs = self.forward(x)
        self.__dict__["_pending"] = (x, outputs, len(self.sizes) - 1)
        return outputs[index]

    def parts(self) -> list["QKVPart"]:
        return [QKVPart(self, i) for i in range(len(self.sizes))]

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class QKVPart(nn.Module):
    """Stands where ``q_proj``/``k_proj``/``v_proj`` stood; owns no parameters."""

    def __init__(self, projection: QKVProjection, index: int) -> None:
        super().__init__()
        # Not a submodule: the projection's parameters belong to the attention module once.
        object.__setattr__(self, "_projection", projection)
        self.index = index
        self.in_features = projection.proj.in_features
        self.out_features = projection.sizes[index]

    def forward(self, x: Tensor) -> Tensor:
        return self._projection.part(x, self.index)

    @property
    def _rows(self) -> slice:
        start = sum(self._projection.sizes[: self.index])
        return slice(start, start + self.out_features)

    @property
    def weight(self) -> Tensor:
        return self._projection.proj.weight[self._rows]

    @property
    def bias(self) -> Optional[Tensor]:
        bias = self._projection.proj.bias
        return None if bias is None else bias[self._rows]

    def extra_repr(self) -> str:
        return f"part {self.index} of qkv_proj, out_features={self.out_features}"
