"""Fused forwards for decoder layers whose residual layout was detected.

Pre-norm (Llama, Mistral, Qwen, Phi-3, Gemma):  ``h + mlp(post_norm(h + attn(input_norm(h))))``
runs the residual add and ``post_norm`` as one ``fused_add_rms_norm`` (``fused_add_layer_norm``
for layer norms). Sandwich-norm (Gemma 2/3)
fuses the add after ``post_attention_norm`` with ``pre_mlp_norm``. Post-norm (OLMo-2) has no
norm after its residual adds, so there is nothing to fuse. Attention is called with exactly the
keywords the layer's own forward passes it (checked when the layout was detected), and the
original forward still runs in training mode, where the layer's dropouts matter. A norm that is
not (or no longer) the library's ``RMSNorm`` or ``LayerNorm`` is called unfused, so verification may undo norms and
fused layers independently.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch import Tensor, nn

from ..layers import LayerNorm, RMSNorm
from .detect import DecoderLayout

FUSABLE = ("pre_norm", "sandwich")


def add_and_norm(norm: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """``(norm(residual + x), residual + x)``, in one pass when ``norm`` is ours."""
    if isinstance(norm, (RMSNorm, LayerNorm)):
        return norm(x, residual)
    summed = residual + x
    return norm(summed), summed


def attention_call_refusal(attention: nn.Module, layout: DecoderLayout) -> str | None:
    """Why the fused forward cannot call ``attention`` as ``attention(hidden_states=h, <the layer's
    attention keywords>)`` (None: it can). A module that takes its input under other names (CTRL's
    ``forward(v, k, q, ...)``, called with the normed hidden states three times) is called by its
    layer in a way the layout does not record, so its layer is not fused."""
    own_class = getattr(type(attention), "_hw_agnostic_base", type(attention))  # a paged module: its own forward
    try:
        signature = inspect.signature(own_class.forward)
    except (TypeError, ValueError):
        return "its attention's forward has no signature to check the fused call against"
    try:
        signature.bind(attention, hidden_states=None, **dict.fromkeys(layout.attention_params))
    except TypeError as err:
        return f"its attention is not called as attention(hidden_states=..., ...): {err}"
    return None


def install_fused_forward(layer: nn.Module, layout: DecoderLayout, signature_defaults: dict[str, Any]) -> None:
    if layout.name not in FUSABLE:
        raise ValueError(f"layout {layout.name!r} has no fused forward")
    original = type(layer).forward.__get__(layer)
    roles = dict(layout.roles)
    named = layout.attention_params
    hidden_param = layout.hidden_param
    defaults = dict(signature_defaults)
    sandwich = layout.name == "sandwich"

    def attention_kwargs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        passed = dict(defaults)
        passed.update(zip(named, args))
        passed.update(kwargs)
        return passed

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        if self.training:
            return original(*args, **kwargs)
        if hidden_param in kwargs:
            hidden, rest = kwargs.pop(hidden_param), args
        else:
            hidden, rest = args[0], args[1:]
        children = self._modules  # the roles are direct children; read each call (verification may swap them)
        role = {name: children[child] for name, child in roles.items()}
        h = role["attention"](hidden_states=role["input_norm"](hidden), **attention_kwargs(rest, kwargs))[0]
        if sandwich:
            h, residual = add_and_norm(role["pre_mlp_norm"], role["post_attention_norm"](h), hidden)
            return residual + role["post_mlp_norm"](role["mlp"](h))
        h, residual = add_and_norm(role["post_attention_norm"], h, hidden)
        return residual + role["mlp"](h)

    layer.forward = types.MethodType(forward, layer)


def remove_fused_forward(layer: nn.Module) -> None:
    layer.__dict__.pop("forward", None)
