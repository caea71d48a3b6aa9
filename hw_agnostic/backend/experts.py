"""Mixture-of-experts models onto hw_agnostic: experts through ``ExpertsInterface``, routers through ``moe_route``.

:func:`enable_fused_experts` works on an already-built Hugging Face model, in place:

1. **Experts.** Every experts module transformers builds with ``@use_experts_implementation``
   (stacked ``gate_up_proj`` / ``down_proj`` weights) dispatches its forward through
   ``ExpertsInterface`` by ``config._experts_implementation``. We register
   :data:`EXPERTS_IMPLEMENTATION` there and select it, so those modules run ``fused_experts``;
   nothing is copied and the model's structure is unchanged (shared experts, router-logit
   capture for the auxiliary loss and checkpoints keep working). Which gated activation a module
   applies is found by evaluating its ``_apply_gate`` against the activation references (so
   gpt-oss's clamped SwiGLU is recognised as what it computes, not by its class name). A module
   we cannot run (no gate, a post-expert norm, a gate we do not know, quantised weights) keeps
   transformers' ``grouped_mm`` path and is listed as left, with the reason.
2. **Routers.** A router module whose routing ``moe_route`` computes (recognised by its code or
   by what it computes, see :mod:`.routers`) has its class switched to a subclass whose
   ``forward`` computes the same outputs with ``moe_route``.

Both paths fall back to transformers' own code while autograd needs gradients (training): the
ops have no backward. :func:`disable_fused_experts` undoes both.

:func:`moe_layer_from_hf` builds a :class:`~hw_agnostic.layers.moe.MoE` layer from an HF sparse
MoE block (sharing its parameters), for a backend or plugin that replaces whole blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..layers.base import resolve
from ..layers.moe import MoE
from ..ops import checks
from ..ops.fused_experts import fused_experts, gated_reference
from ..tolerances import mismatch
from .changes import Change
from .detect import NotDetected
from .report import RewireReport
from .routers import DENSE, is_router, looks_like_router, needs_own_code, restore_routers, router_form, switch_router

log = logging.getLogger(__name__)

EXPERTS_IMPLEMENTATION = "hw_agnostic"


# --------------------------------------------------------------------------------------------
# experts


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    activation: str
    interleaved: bool
    transposed: bool
    has_bias: bool
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def describe(self) -> str:
        layout = "[E, H, 2I] (transposed)" if self.transposed else "[E, 2I, H]"
        gate = "interleaved" if self.interleaved else "gate-first"
        return f"fused_experts: {self.activation}, {layout}, {gate}" + (", biases" if self.has_bias else "")


def is_hf_experts(module: nn.Module) -> bool:
    """A module transformers' ``@use_experts_implementation`` decorated (it sets these attributes)."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "has_bias", "down_proj"))


def looks_like_experts(module: nn.Module) -> bool:
    """Experts we do not serve: an ``*Expert*`` module holding stacked ``[E, ., .]`` weights."""
    stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]
    return bool(stacked) and "expert" in type(module).__name__.lower() and not is_hf_experts(module)


def _gate_candidates(module: nn.Module) -> list[tuple[str, bool, float, float]]:
    alpha, limit = float(getattr(module, "alpha", 1.702)), float(getattr(module, "limit", 7.0))
    return [("silu", False, alpha, limit), ("gelu", False, alpha, limit), ("gelu_tanh", False, alpha, limit),
            ("swiglu_oai", True, alpha, limit), ("swiglu_oai", False, alpha, limit)]


def _identify_gate(module: nn.Module) -> tuple[str, bool, float, float] | None:
    """Which gated activation ``module._apply_gate`` computes, by evaluating it on a probe that
    reaches past gpt-oss's clamps."""
    shuffle = torch.randperm(16, generator=torch.Generator().manual_seed(0))  # tells interleaved from gate-first
    probe = torch.linspace(-9.0, 9.0, 6 * 16).reshape(6, 16)[:, shuffle]
    try:
        with torch.no_grad():
            out = module._apply_gate(probe)
    except Exception:
        return None
    for candidate in _gate_candidates(module):
        want = gated_reference(probe, *candidate)
        if isinstance(out, Tensor) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-5, atol=1e-6):
            return candidate
    return None


_experts_specs: weakref.WeakKeyDictionary[nn.Module, ExpertsSpec | NotDetected] = weakref.WeakKeyDictionary()


def detect_experts(module: nn.Module) -> ExpertsSpec | NotDetected:
    """How ``fused_experts`` runs this experts module, or why it cannot (cached per module)."""
    spec = _experts_specs.get(module)
    if spec is None:
        spec = _detect_experts(module)
        _experts_specs[module] = spec
    return spec


def _detect_experts(module: nn.Module) -> ExpertsSpec | NotDetected:
    if not module.has_gate or not hasattr(module, "gate_up_proj"):
        return NotDetected("experts without a gate (up_proj only): not a gated MLP")
    if getattr(module, "has_post_expert_norm", False):
        return NotDetected("a norm after each expert")
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name)
        if not isinstance(weight, Tensor) or weight.dim() != 3 or weight.dtype not in checks.FLOAT_DTYPES:
            return NotDetected(f"{name} is not a stacked float [E, ., .] tensor ({getattr(weight, 'dtype', None)})")
    gate = _identify_gate(module)
    if gate is None:
        return NotDetected("its _apply_gate is none of silu/gelu/gelu_tanh(gate) * up or gpt-oss's clamped SwiGLU")
    activation, interleaved, alpha, limit = gate
    return ExpertsSpec(activation, interleaved, bool(module.is_transposed), bool(module.has_bias), alpha, limit)


#: Experts modules switched back to the implementation the model had (undone by verification).
_declined: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_PREVIOUS_ATTRIBUTE = "_hw_agnostic_previous_experts"


def _model_implementation(module: nn.Module) -> Callable[..., Any]:
    """The experts implementation ``module``'s model had before ours was selected."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = getattr(module.config, _PREVIOUS_ATTRIBUTE, "grouped_mm")
    own = getattr(type(module).forward, "__wrapped__", None)  # the class's own per-expert loop ("eager")
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, own)


def hw_agnostic_experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                                top_k_weights: Tensor) -> Tensor:
    """The ``ExpertsInterface`` implementation: ``fused_experts`` on the module's own weights."""
    spec = detect_experts(module)
    if (module in _declined or isinstance(spec, NotDetected)
            or needs_own_code(hidden_states, top_k_weights, module.gate_up_proj)):
        return _model_implementation(module)(module, hidden_states, top_k_index, top_k_weights)
    dtype = module.gate_up_proj.dtype  # transformers casts the input to the weights' dtype too
    out = fused_experts(
        hidden_states.to(dtype), module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
        activation=spec.activation, transposed=spec.transposed, interleaved=spec.interleaved,
        gate_up_bias=module.gate_up_proj_bias if spec.has_bias else None,
        down_bias=module.down_proj_bias if spec.has_bias else None,
        swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit,
    )
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Make ``experts_implementation="hw_agnostic"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, hw_agnostic_experts_forward)


# --------------------------------------------------------------------------------------------
# the entry points


_previous_implementation: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _select_implementation(model: nn.Module, experts: list[nn.Module]) -> None:
    for module in experts:
        config = getattr(module, "config", None)
        if config is not None and not hasattr(config, _PREVIOUS_ATTRIBUTE):
            setattr(config, _PREVIOUS_ATTRIBUTE, config._experts_implementation)
    if hasattr(model, "set_experts_implementation") and hasattr(model, "get_experts_implementation"):
        _previous_implementation.setdefault(model, model.get_experts_implementation())
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    for module in experts:  # configs transformers' setter does not reach (modules outside a PreTrainedModel)
        config = getattr(module, "config", None)
        if config is not None and config._experts_implementation != EXPERTS_IMPLEMENTATION:
            config._experts_implementation_internal = EXPERTS_IMPLEMENTATION


def experts_changes(model: nn.Module, *, routing: bool = True, verify: bool = True,
                    report: RewireReport | None = None) -> list[Change]:
    """Run ``model``'s MoE experts with ``fused_experts`` and its routers with ``moe_route``, in place.

    Returns the changes (applied); modules that keep transformers' code are listed in ``report``
    as left, with the reason.
    """
    report = report if report is not None else RewireReport()
    register_experts_implementation()
    changes: list[Change] = []
    selected = []
    for path, module in model.named_modules():
        if is_hf_experts(module):
            spec = detect_experts(module)
            if isinstance(spec, NotDetected):
                report.add("left", path, module, detail=f"experts keep transformers' grouped_mm: {spec.reason}")
                continue
            selected.append(module)
            _declined.discard(module)
            experts = module.gate_up_proj.shape[0]
            changes.append(Change(
                "experts", path, type(module).__name__, f"experts_implementation={EXPERTS_IMPLEMENTATION!r}",
                f"{spec.describe()}, {experts} experts",
                (lambda m=module: _declined.discard(m)), (lambda m=module: _declined.add(m)),
            ))
        elif routing and is_router(module):
            change = switch_router(path, module, report, verify)
            if change is not None:
                changes.append(change)
        elif routing and looks_like_router(module):
            report.add("left", path, module, detail="a router whose logits are not one linear projection of the "
                                                    "hidden states: not served")
        elif looks_like_experts(module):
            report.add("left", path, module, detail="experts outside transformers' @use_experts_implementation "
                                                    "(no stacked gate_up_proj / down_proj it dispatches): not served")
    if selected:
        _select_implementation(model, selected)
    return changes


def enable_fused_experts(
    model: nn.Module, *, routing: bool = True, verify: bool = True, report: RewireReport | None = None
) -> RewireReport:
    """Run ``model``'s MoE experts with ``fused_experts`` and its routers with ``moe_route``, in place.

    Returns the report (``report`` if given): one ``replaced`` entry per experts module and router
    switched, one ``left`` entry with the reason for each one that keeps transformers' code.
    ``rewire`` does this and verifies the whole model; called alone, only each router is checked.
    """
    report = report if report is not None else RewireReport()
    for change in experts_changes(model, routing=routing, verify=verify, report=report):
        report.add("replaced", change.path, change.original, change.result, change.detail)
        change.release()
    return report


def disable_fused_experts(model: nn.Module) -> None:
    """Undo :func:`enable_fused_experts`: transformers' routers and experts implementation again."""
    restore_routers(model)
    previous = _previous_implementation.pop(model, None)
    if previous is not None:
        model.set_experts_implementation(previous)


# --------------------------------------------------------------------------------------------
# whole blocks


def moe_layer_from_hf(block: nn.Module) -> MoE | NotDetected:
    """A :class:`~hw_agnostic.layers.moe.MoE` computing what the HF sparse MoE ``block`` computes.

    The layer shares the block's parameters (nothing is copied). Recognised: a router child
    (``gate`` or ``router``) of a family :func:`router_form` knows, an experts child ``experts``,
    and optionally ``shared_expert`` (+ ``shared_expert_gate``, Qwen2-MoE) or ``shared_experts``
    (DeepSeek-V3). When the weights are real the layer is run against the block first.
    """
    router = next((getattr(block, n) for n in ("gate", "router") if hasattr(block, n)), None)
    experts = getattr(block, "experts", None)
    if router is None or experts is None or not is_hf_experts(experts):
        return NotDetected("not a sparse MoE block (no gate/router and HF experts children)")
    form = router_form(router)
    if form is None:
        return NotDetected("routing none of moe_route's forms reproduces")
    if form.bias_argument or form.output == DENSE:
        return NotDetected("the router takes its correction bias from the block or returns dense scores: "
                           "the MoE layer's router has neither")
    spec = detect_experts(experts)
    if isinstance(spec, NotDetected):
        return spec
    routing = form.spec(router)
    weight, bias, correction = form.weight(router), form.bias(router), form.correction_bias(router)
    correction = None if correction is None else correction.reshape(-1)  # ERNIE keeps it as [1, E]
    num_experts, hidden = weight.shape
    inter = experts.down_proj.shape[1] if spec.transposed else experts.down_proj.shape[2]
    new_router = resolve("moe_router")(hidden, num_experts, routing, bias=bias is not None,
                                       correction_bias=correction is not None, device="meta", dtype=weight.dtype)
    state = {"weight": weight, **({"bias": bias} if bias is not None else {}),
             **({"e_score_correction_bias": correction} if correction is not None else {})}
    new_router.load_state_dict(state, strict=True, assign=True)
    new_experts = resolve("moe_experts")(
        num_experts, hidden, inter, spec.activation, transposed=spec.transposed, interleaved=spec.interleaved,
        bias=spec.has_bias, swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit, device="meta",
        dtype=experts.gate_up_proj.dtype)
    expert_state = {"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}
    if spec.has_bias:
        expert_state.update(gate_up_proj_bias=experts.gate_up_proj_bias, down_proj_bias=experts.down_proj_bias)
    new_experts.load_state_dict(expert_state, strict=True, assign=True)
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    layer = resolve("moe")(new_router, new_experts, shared, getattr(block, "shared_expert_gate", None))
    problem = _block_disagreement(block, layer)
    return NotDetected(f"the MoE layer disagreed with the block: {problem}") if problem else layer


def _block_disagreement(block: nn.Module, layer: nn.Module) -> str | None:
    weight = layer.experts.gate_up_proj
    if weight.is_meta:
        return None
    hidden = torch.randn(2, 5, layer.hidden_size, generator=torch.Generator().manual_seed(7))
    hidden = hidden.to(weight.device, weight.dtype)
    with torch.no_grad():
        want, got = block(hidden), layer(hidden)
    if not isinstance(want, Tensor):
        return f"the block returns {type(want).__name__}, not a tensor"
    return mismatch(got, want.double(), want.dtype)


__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "ROUTER_FORMS",
    "ExpertsSpec",
    "RouterForm",
    "detect_experts",
    "disable_fused_experts",
    "enable_fused_experts",
    "experts_changes",
    "hw_agnostic_experts_forward",
    "is_hf_experts",
    "moe_layer_from_hf",
    "register_experts_implementation",
]
