"""Norm and gated-activation overrides: vLLM's layer classes with the library's ops inside.

vLLM looks an override up by the name of the class it instantiates, so each one subclasses
that class and registers under its name: the Transformers backend builds ``TPAwareRMSNorm`` and
``TPAwareGemmaRMSNorm`` (their TP all-gather stays vLLM's and wraps ``forward_native``), the
hw-agnostic ``SiluAndMul``, and vLLM's main ``GeluAndMul`` / ``SwigluOAIAndMul``.

Numerics are vLLM's (its ``forward_native``), so that a model gives the same tokens with and
without the plugin:

* ``rms_norm``: normalise in fp32, cast to the weight's dtype, multiply, cast to ``x.dtype``.
  With the weight in ``x``'s dtype that is the library's ``llama`` numerics.
* residual form: vLLM adds the residual **in fp32** and normalises the unrounded sum (the new
  residual is the sum rounded to ``x.dtype``); the library's ``fused_add_rms_norm`` rounds the sum
  first. In fp32 the two agree and the fused op runs; in fp16/bf16 the plugin adds in fp32 and
  runs the library's ``rms_norm`` on the fp32 sum, casting where vLLM casts.
* Gemma: vLLM passes ``weight.float() + 1`` and multiplies in fp32: the library's ``gemma``
  numerics.

A call these do not cover (a ``var_hidden_size`` norm, a weight dtype that differs from the
input's in a Llama norm, a non-float input) runs vLLM's own ``forward_native``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import note_built

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ops() -> Any:
    from hw_agnostic import ops

    return ops


# --------------------------------------------------------------------------------------------
# vLLM's norm numerics on the library's ops


def vllm_rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, gemma: bool) -> Tensor | None:
    """What vLLM's ``rms_norm`` computes (``weight`` is the raw parameter; Gemma adds 1), or
    None when the library cannot compute exactly that."""
    ops = _ops()
    if x.dtype not in FLOAT_DTYPES:
        return None
    if gemma:
        return ops.rms_norm(x, weight, eps, numerics="gemma")
    if weight is not None and weight.dtype != x.dtype:
        return None
    return ops.rms_norm(x, weight, eps, numerics="llama")


def vllm_fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, gemma: bool
) -> tuple[Tensor, Tensor] | None:
    """What vLLM's ``fused_add_rms_norm`` computes: ``(normed, new_residual)``, or None."""
    ops = _ops()
    if x.dtype not in FLOAT_DTYPES or residual.dtype != x.dtype or residual.shape != x.shape:
        return None
    if not gemma and weight is not None and weight.dtype != x.dtype:
        return None
    numerics = "gemma" if gemma else "llama"
    if x.dtype == torch.float32:
        return ops.fused_add_rms_norm(x, residual, weight, eps, numerics=numerics)
    summed = x.float() + residual.float()
    if gemma:
        normed = ops.rms_norm(summed, weight, eps, numerics="gemma")
    else:
        normed = ops.rms_norm(summed, None, eps)
        if weight is not None:
            normed = normed.to(weight.dtype) * weight
    return normed.to(x.dtype), summed.to(x.dtype)


def _norm_forward(
    module: Any, x: Tensor, residual: Tensor | None, weight: Tensor | None, *, gemma: bool,
    fallback: Callable[..., Any],
) -> Any:
    eps = module.variance_epsilon
    if getattr(module, "variance_size_override", None) is None:
        if residual is None:
            result = vllm_rms_norm(x, weight, eps, gemma=gemma)
        else:
            result = vllm_fused_add_rms_norm(x, residual, weight, eps, gemma=gemma)
        if result is not None:
            return result
    return fallback(x, residual)


# --------------------------------------------------------------------------------------------
# the overrides (classes are built at registration: their bases are vLLM's)


def _every_platform(cls: type) -> type:
    """Main-registry CustomOps dispatch per platform: run the override's forward on each."""
    for name in ("forward_cuda", "forward_hip", "forward_xpu", "forward_cpu", "forward_oot", "forward_tpu"):
        setattr(cls, name, cls.forward_native)
    return cls


def register_rms_norm() -> None:
    from vllm.model_executor.models.transformers.fusers.rms_norm import TPAwareRMSNorm

    @TPAwareRMSNorm.register_oot(name="TPAwareRMSNorm")
    class HwAgnosticRMSNorm(TPAwareRMSNorm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _ops()  # import the ops while building the model, never while tracing it
            note_built("rms_norm")

        def forward_native(self, x: Tensor, residual: Tensor | None = None) -> Any:
            weight = self.weight if self.has_weight else None
            return _norm_forward(self, x, residual, weight, gemma=False, fallback=super().forward_native)


def register_gemma_rms_norm() -> None:
    from vllm.model_executor.models.transformers.fusers.rms_norm import TPAwareGemmaRMSNorm

    @TPAwareGemmaRMSNorm.register_oot(name="TPAwareGemmaRMSNorm")
    @_every_platform
    class HwAgnosticGemmaRMSNorm(TPAwareGemmaRMSNorm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _ops()
            note_built("gemma_rms_norm")

        def forward_native(self, x: Tensor, residual: Tensor | None = None) -> Any:
            return _norm_forward(self, x, residual, self.weight, gemma=True, fallback=super().forward_native)


def register_silu_and_mul() -> None:
    from vllm.model_executor.hw_agnostic.layers.activation import SiluAndMul

    @SiluAndMul.register_oot(name="SiluAndMul")
    class HwAgnosticSiluAndMul(SiluAndMul):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _ops()
            note_built("silu_and_mul")

        def forward_native(self, x: Tensor) -> Tensor:
            if x.dtype not in FLOAT_DTYPES:
                return super().forward_native(x)
            return _ops().silu_and_mul(x)


def register_gelu_and_mul() -> None:
    from vllm.model_executor.layers.activation import GeluAndMul

    @GeluAndMul.register_oot(name="GeluAndMul")
    @_every_platform
    class HwAgnosticGeluAndMul(GeluAndMul):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _ops()
            note_built("gelu_and_mul")

        def forward_native(self, x: Tensor) -> Tensor:
            if x.dtype not in FLOAT_DTYPES:
                return super().forward_native(x)
            return _ops().gelu_and_mul(x, self.approximate)


def register_swiglu_oai() -> None:
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    @SwigluOAIAndMul.register_oot(name="SwigluOAIAndMul")
    @_every_platform
    class HwAgnosticSwigluOAIAndMul(SwigluOAIAndMul):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _ops()
            note_built("swiglu_oai")

        def forward_native(self, x: Tensor) -> Tensor:
            if x.dtype not in FLOAT_DTYPES:
                return super().forward_native(x)
            return _ops().swiglu_oai(x, float(self.alpha), float(self.limit), interleaved=True)
