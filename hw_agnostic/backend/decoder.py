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

The layer's *last* residual add is fused too, with the norm that reads its output next (the next
layer's input norm, or the model's final norm): :func:`link_next_norm` makes the layer compute
``residual + x`` and that norm's result in one ``fused_add_rms_norm``, and leaves the result with
the norm, which returns it when it is called on exactly that tensor, unchanged (the same object
at the same version counter, its own parameters at theirs); any other call of the norm computes
as before. So the norm's hooks still run, a model that changes its hidden states between layers
(in place or not) gets them normalised as they are, and a norm that is never called on the
output drops the link after one miss. Under ``torch.inference_mode`` (whose tensors keep no
version counter, so an in-place change could not be seen) and while ``torch.compile`` traces
(Inductor fuses the add itself) the add runs alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import LayerNorm, RMSNorm
from ..layers.module_call import call_in, plain_calls
from .detect import DecoderLayout

log = logging.getLogger(__name__)

FUSABLE = ("pre_norm", "sandwich")
#: on a fused layer: ``(parent, name)`` of the norm that reads its output next
NEXT_NORM = "_hw_agnostic_next_norm"
#: on a linked norm: ``(input, result, input version, parameter versions)`` computed by the layer before
HANDED = "_hw_agnostic_handed"


def add_and_norm(norm: nn.Module, x: Tensor, residual: Tensor, plain: bool) -> tuple[Tensor, Tensor]:
    """``(norm(residual + x), residual + x)``, in one pass when ``norm`` is ours (``plain``: as
    :func:`~hw_agnostic.layers.module_call.plain_calls` found for the layer's forward)."""
    if isinstance(norm, (RMSNorm, LayerNorm)):
        return call_in(plain, norm, x, residual)
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


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """What a fused forward needs of its layer's layout (picklable, as the layer's ``forward`` is)."""

    roles: tuple[tuple[str, str], ...]  # (role, child name)
    attention_params: tuple[str, ...]  # the attention keywords, in the order the layer passes them
    hidden_param: str
    defaults: tuple[tuple[str, Any], ...]  # the layer's signature defaults for the attention keywords
    sandwich: bool


def install_fused_forward(layer: nn.Module, layout: DecoderLayout, signature_defaults: dict[str, Any]) -> None:
    if layout.name not in FUSABLE:
        raise ValueError(f"layout {layout.name!r} has no fused forward")
    fused = FusedLayout(tuple(dict(layout.roles).items()), tuple(layout.attention_params), layout.hidden_param,
                        tuple(signature_defaults.items()), layout.name == "sandwich")
    # a partial, not a bound method: it pickles (and deep-copies onto the copy) with the layer
    layer.forward = functools.partial(_fused_forward, fused, layer)


def _fused_forward(fused: FusedLayout, self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    if self.training:  # the class's forward, on ``self``: a deep copy's training must run on the copy
        return type(self).forward(self, *args, **kwargs)
    if fused.hidden_param in kwargs:
        hidden, rest = kwargs.pop(fused.hidden_param), args
    else:
        hidden, rest = args[0], args[1:]
    children = self._modules  # the roles are direct children; read each call (verification may swap them)
    role = {name: children[child] for name, child in fused.roles}
    passed = dict(fused.defaults)
    passed.update(zip(fused.attention_params, rest))
    passed.update(kwargs)
    plain = plain_calls()
    normed = call_in(plain, role["input_norm"], hidden)
    h = call_in(plain, role["attention"], hidden_states=normed, **passed)[0]
    if fused.sandwich:
        h, residual = add_and_norm(role["pre_mlp_norm"], call_in(plain, role["post_attention_norm"], h), hidden,
                                   plain)
        return hand_off(self, call_in(plain, role["post_mlp_norm"], call_in(plain, role["mlp"], h)), residual)
    h, residual = add_and_norm(role["post_attention_norm"], h, hidden, plain)
    return hand_off(self, call_in(plain, role["mlp"], h), residual)


def remove_fused_forward(layer: nn.Module) -> None:
    layer.__dict__.pop("forward", None)


# --------------------------------------------------------------------------------------------
# the last residual add, fused with the next norm


_MISSED = ("missed",)  # left on a norm whose call did not take the result handed to it


def _versions(norm: nn.Module) -> tuple[int, ...] | None:
    """The version counters of ``norm``'s parameters (None: one is an inference tensor, which keeps none)."""
    try:
        return tuple([p._version for p in norm._parameters.values() if p is not None])
    except RuntimeError:
        return None


def _takes_handoff(norm: Any) -> bool:
    return getattr(norm.__dict__.get("forward"), "func", None) is _forward_taking_handoff


def hand_off(layer: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + x``; where ``layer`` is linked to the norm that reads it next, that norm's
    result comes out of the same pass and is left with the norm (see the module docstring)."""
    link = layer.__dict__.get(NEXT_NORM)
    if link is None or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return residual + x
    norm = link[0]._modules.get(link[1])
    if not isinstance(norm, (RMSNorm, LayerNorm)) or not _takes_handoff(norm) or not (
            x.shape == residual.shape and x.dtype == residual.dtype and x.device == residual.device):
        return residual + x
    if HANDED in norm.__dict__:  # a result handed to it was not taken: it does not read this output
        del norm.__dict__[HANDED], layer.__dict__[NEXT_NORM]
        log.debug("%s: the norm after it did not read its output; its last add runs alone", type(layer).__name__)
        return residual + x
    versions = _versions(norm)
    if versions is None:
        return residual + x
    normed, summed = type(norm).forward(norm, x, residual)
    norm.__dict__[HANDED] = (summed, normed, summed._version, versions)
    return summed


def _forward_taking_handoff(self: nn.Module, x: Tensor, residual: Tensor | None = None) -> Any:
    if torch.compiler.is_compiling():
        return type(self).forward(self, x, residual)
    handed = self.__dict__.pop(HANDED, None)
    if handed is not None and handed is not _MISSED:
        if residual is None and handed[0] is x and x._version == handed[2] and _versions(self) == handed[3]:
            return handed[1]
        self.__dict__[HANDED] = _MISSED  # the layer before stops handing results over
    return type(self).forward(self, x, residual)


def link_next_norm(layer: nn.Module, parent: nn.Module, name: str) -> None:
    """Fuse ``layer``'s last residual add with ``parent.<name>``, the norm that reads its output next."""
    norm = parent._modules[name]
    norm.__dict__.pop(HANDED, None)
    norm.__dict__["forward"] = functools.partial(_forward_taking_handoff, norm)
    layer.__dict__[NEXT_NORM] = (parent, name)


def unlink_next_norm(layer: nn.Module, parent: nn.Module, name: str) -> None:
    layer.__dict__.pop(NEXT_NORM, None)
    norm = parent._modules.get(name)
    if norm is not None:
        norm.__dict__.pop(HANDED, None)
        if _takes_handoff(norm):
            del norm.__dict__["forward"]
