"""Mixture-of-experts layers: router, routed experts, and the sparse MoE block composed of them.

* :class:`MoERouter` (``moe_router``): router logits and the top-k experts of each token, with
  the routing of a model family described by a :class:`RoutingSpec` (which scoring, whether the
  weights are renormalised, how the logits and the weights are cast).
* :class:`MoEExperts` (``moe_experts``): the routed experts as one ``fused_experts`` call over
  stacked ``[E, ...]`` weights, in the Hugging Face layout (``gate_up_proj [E, 2I, H]``,
  ``down_proj [E, H, I]``) or gpt-oss's transposed one with biases.
* :class:`MoE` (``moe``): router, experts and an optional shared expert (Qwen2-MoE gates it with
  ``sigmoid(shared_expert_gate(x))``, DeepSeek-V3 adds it as is).

:func:`route` is what the router layer runs; the backend reuses it inside Hugging Face router
modules, so a router's numerics are written once.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused_experts import ACTIVATIONS, fused_experts, fused_experts_reference
from ..ops.moe_route import moe_route, moe_route_reference
from .base import CustomOp, PluggableLayer
from .mlp import GatedMLP
from .module_call import call_in, plain_calls

#: How router logits are computed: ``F.linear`` in the model dtype, on fp32 copies of the inputs
#: (DeepSeek-V3), or in the model dtype and then cast to fp32 (Granite-MoE).
LOGITS = ("model_dtype", "fp32_inputs", "fp32_outputs")
#: The dtype of the routing weights handed to the experts: fp32 as computed (Mixtral,
#: DeepSeek-V3), the logits' dtype (Qwen, OLMoE, gpt-oss) or the hidden states' (Granite-MoE).
WEIGHTS_DTYPES = ("fp32", "logits", "hidden")


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """A family's routing, in :func:`~hw_agnostic.ops.moe_route`'s terms plus its casts."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    logits: str = "model_dtype"
    weights_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.logits not in LOGITS:
            raise ValueError(f"RoutingSpec: logits must be one of {LOGITS}; got {self.logits!r}")
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"RoutingSpec: weights_dtype must be one of {WEIGHTS_DTYPES}; got {self.weights_dtype!r}")


def router_logits(spec: RoutingSpec, hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The router's linear layer, cast as the family casts it."""
    if spec.logits == "fp32_inputs":
        return F.linear(hidden.float(), _as_fp32(weight), None if bias is None else _as_fp32(bias))
    logits = F.linear(hidden, weight, bias)
    return logits.float() if spec.logits == "fp32_outputs" else logits


#: fp32 copies of 16-bit router parameters, by ``id``: ``(parameter ref, data_ptr, version, copy)``;
#: an entry leaves with its parameter (a tensor cannot key a weak dictionary: ``==`` is element-wise).
_fp32_copies: dict[int, tuple[weakref.ref, int, int, Tensor]] = {}


def _as_fp32(parameter: Tensor) -> Tensor:
    """``parameter.float()``, kept between calls while the parameter holds the same values.

    DeepSeek-V3's router multiplies fp32 copies of its inputs, and casting its ``[E, H]`` weight
    on every call was most of a decode-size routing (32 x 7168 bf16: 0.9 MB written per call). The
    copy is kept (memory: twice the weight's bytes, not saved with the model) and made again when
    the parameter's memory or version counter changes (an in-place update, ``.data =``); not while
    autograd records through it, while tracing, or for a tensor without a version counter (an
    inference tensor).
    """
    if parameter.dtype == torch.float32 or torch.compiler.is_compiling() or (
            parameter.requires_grad and torch.is_grad_enabled()) or parameter.is_inference():
        return parameter.float()
    key, place, version = id(parameter), parameter.data_ptr(), parameter._version
    kept = _fp32_copies.get(key)
    if kept is not None and kept[0]() is parameter and kept[1] == place and kept[2] == version:
        return kept[3]
    with torch.inference_mode(False):  # kept: a normal tensor, which autograd may save, even if made in that mode
        copy = parameter.detach().float()
    if kept is None or kept[0]() is not parameter:
        weakref.finalize(parameter, _fp32_copies.pop, key, None)
    _fp32_copies[key] = (weakref.ref(parameter), place, version, copy)
    return copy


def route(
    spec: RoutingSpec,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    correction_bias: Optional[Tensor] = None,
    *,
    native: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits [T, E], weights [T, k], ids [T, k])`` for ``hidden [..., H]`` (``T`` rows)."""
    logits = router_logits(spec, hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    args = (spec.top_k, spec.scoring, spec.renormalize, spec.n_group, spec.topk_group, spec.routed_scaling_factor)
    if native:
        weights, ids = moe_route_reference(logits, correction_bias, *args)
    else:
        top_k, scoring, renormalize, n_group, topk_group, factor = args
        weights, ids = moe_route(logits, top_k, scoring=scoring, renormalize=renormalize,
                                 correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                                 routed_scaling_factor=factor)
    if spec.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    elif spec.weights_dtype == "hidden":
        weights = weights.to(hidden.dtype)
    return logits, weights, ids


@CustomOp.register("moe_router")
class MoERouter(CustomOp):
    """Router logits ``x @ weight.T (+ bias)`` and the top-k experts per token.

    ``forward(x [..., H])`` returns ``(logits [T, E], weights [T, k], ids [T, k])`` with ``T`` the
    number of rows of ``x``, as the Hugging Face routers do.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        spec: RoutingSpec,
        *,
        bias: bool = False,
        correction_bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.num_experts, self.spec = hidden_size, num_experts, spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device)) if bias else None
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32,
                                                                        device=device))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return route(self.spec, x, self.weight, self.bias, self.e_score_correction_bias)

    def forward_native(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return route(self.spec, x, self.weight, self.bias, self.e_score_correction_bias, native=True)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, experts={self.num_experts}, {self.spec}"


@CustomOp.register("moe_experts")
class MoEExperts(CustomOp):
    """The routed experts: ``sum_k w[t, k] * down_e(act(gate_up_e(x[t])))`` in one fused call.

    Weights are stacked per expert: ``gate_up_proj [E, 2I, H]`` (gate rows first, or gate/up
    interleaved with ``interleaved=True``) and ``down_proj [E, H, I]``; with ``transposed=True``
    ``[E, H, 2I]`` and ``[E, I, H]`` (gpt-oss). ``forward(x [T, H], ids [T, k], weights [T, k])``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        transposed: bool = False,
        interleaved: bool = False,
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoEExperts: activation must be one of {ACTIVATIONS}; got {activation!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.transposed, self.interleaved = activation, transposed, interleaved
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        gate_up = (num_experts, hidden_size, 2 * intermediate_size) if transposed else \
            (num_experts, 2 * intermediate_size, hidden_size)
        down = (num_experts, intermediate_size, hidden_size) if transposed else \
            (num_experts, hidden_size, intermediate_size)
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(down, dtype=dtype, device=device))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, dtype=dtype,
                                                              device=device))
            self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype, device=device))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, activation=self.activation,
                             transposed=self.transposed, interleaved=self.interleaved,
                             gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                             swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)

    def forward_native(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return fused_experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids, self.gate_up_proj_bias,
                                       self.down_proj_bias, self.activation, self.transposed, self.interleaved,
                                       self.swiglu_alpha, self.swiglu_limit)

    def extra_repr(self) -> str:
        layout = "transposed" if self.transposed else "hf"
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"activation={self.activation!r}, layout={layout}, interleaved={self.interleaved}, "
                f"bias={self.gate_up_proj_bias is not None}")


@PluggableLayer.register("moe")
class MoE(PluggableLayer):
    """A sparse MoE block: routed experts plus an optional shared expert.

    ``forward(x [..., H])`` returns ``[..., H]``: ``experts(x, *router(x)) + shared(x)``, with
    ``shared(x) = sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when a shared gate exists
    (Qwen2-MoE) and ``shared_expert(x)`` otherwise (DeepSeek-V3's shared experts). A plugin can
    replace the whole block (``MoE.register_oot``), e.g. with an expert-parallel implementation.
    """

    def __init__(
        self,
        router: MoERouter,
        experts: MoEExperts,
        shared_expert: Optional[GatedMLP | nn.Module] = None,
        shared_expert_gate: Optional[nn.Linear] = None,
    ) -> None:
        super().__init__()
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("MoE: a shared_expert_gate needs a shared_expert")
        self.router, self.experts = router, experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.hidden_size = experts.hidden_size

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        plain = plain_calls()
        _, weights, ids = call_in(plain, self.router, rows)
        out = call_in(plain, self.experts, rows, ids, weights)
        if self.shared_expert is not None:
            shared = call_in(plain, self.shared_expert, rows)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(call_in(plain, self.shared_expert_gate, rows)) * shared
            out = out + shared
        return out.view(x.shape)
