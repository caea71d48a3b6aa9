"""Gated activations as layers: ``act(gate) * up`` on a merged ``[..., 2I]`` input."""

from __future__ import annotations

from torch import Tensor

from ..ops import gelu_and_mul, silu_and_mul, swiglu_oai
from ..ops.activations import gelu_and_mul_reference, silu_and_mul_reference, swiglu_oai_reference
from .base import CustomOp


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[..., :I]) * x[..., I:]``."""

    def forward(self, x: Tensor) -> Tensor:
        return silu_and_mul(x)

    def forward_native(self, x: Tensor) -> Tensor:
        return silu_and_mul_reference(x)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """``gelu(x[..., :I], approximate) * x[..., I:]`` (``"tanh"``: Gemma's GELU)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeluAndMul: approximate must be 'none' or 'tanh'; got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return gelu_and_mul(x, self.approximate)

    def forward_native(self, x: Tensor) -> Tensor:
        return gelu_and_mul_reference(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


@CustomOp.register("swiglu_oai")
class SwigluOai(CustomOp):
    """gpt-oss's clamped SwiGLU on an interleaved (or gate-first) ``[..., 2I]`` input."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0, *, interleaved: bool = True) -> None:
        super().__init__()
        self.alpha, self.limit, self.interleaved = float(alpha), float(limit), interleaved

    def forward(self, x: Tensor) -> Tensor:
        return swiglu_oai(x, self.alpha, self.limit, interleaved=self.interleaved)

    def forward_native(self, x: Tensor) -> Tensor:
        return swiglu_oai_reference(x, self.alpha, self.limit, self.interleaved)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}, interleaved={self.interleaved}"


#: The activation names the gated MLP accepts, and the layer computing each.
ACTIVATIONS = {
    "silu": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_tanh": lambda: GeluAndMul("tanh"),
}


def act_and_mul(activation: str, *, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> CustomOp:
    """The ``act(gate) * up`` layer for an activation name (``silu``, ``gelu``, ``gelu_tanh``), or
    ``swiglu_oai``: gpt-oss's clamped SwiGLU on a gate-first input (MiniMax-M3's dense MLPs)."""
    if activation == "swiglu_oai":
        return SwigluOai(swiglu_alpha, swiglu_limit, interleaved=False)
    try:
        return ACTIVATIONS[activation]()
    except KeyError:
        raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(ACTIVATIONS)}, "
                         f"swiglu_oai") from None
