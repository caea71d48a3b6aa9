"""MoE routers onto ``moe_route``: which routing a router module computes, and the switch.

A router module (a ``weight [E, H]`` and a ``top_k``) is recognised in one of two ways:

1. **By its code.** Its ``forward`` is, as source text, the ``forward`` of a family's reference
   class (:data:`ROUTER_FORMS`), so the dozens of copies transformers generates for other models
   are recognised too; the family's spec reads the module's attributes.
2. **By what it computes.** Otherwise :func:`infer_router_form` runs the module's own
   ``forward`` on a randomly initialised copy (the module itself is never touched), in float32 and
   bfloat16, and keeps the first routing in ``moe_route``'s terms that reproduces it: scoring
   (softmax / sigmoid / top-k then softmax / top-k then sigmoid), renormalisation, the scaling
   factor (one of the module's float attributes), a correction bias (a length-``E`` tensor the
   module holds, or one the block passes as the second argument), where it casts the logits and
   the weights, and whether it returns ``(logits, weights, ids)`` or ``(dense scores, logits)``
   (Llama-4). Routing it cannot express (PhiMoE's sparsemixer, logit soft-capping, routers that
   also weigh shared experts) matches none and stays the model's own.

Either way the module's class is switched to a subclass whose ``forward`` computes the same
outputs with ``moe_route``: parameters, buffers and hooks stay, ``isinstance`` still holds (so
transformers' router-logit recording sees it). When the weights are real, the switched router is
run against its own original forward first and kept only if the ids are identical and the
weights agree. Under autograd (training) the original forward runs: the op has no backward.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import itertools
import textwrap
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..layers.made_class import made_by
from ..layers.moe import LOGITS, WEIGHTS_DTYPES, RoutingSpec, route
from ..ops.moe_route import SCORINGS
from ..tolerances import mismatch, tolerance
from .changes import Change
from .report import RewireReport

TRIPLE, DENSE = "logits_weights_ids", "dense_scores_logits"


def needs_own_code(*tensors: Optional[Tensor]) -> bool:
    """Whether a call must run transformers' code: autograd records it (the ops have no backward),
    or autocast recasts it (its matmuls in 16 bits, which the fused kernels do not follow)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    first = next((t for t in tensors if t is not None), None)
    return first is not None and torch.is_autocast_enabled(first.device.type)


@dataclasses.dataclass(frozen=True)
class _Fixed:
    """A spec found by :func:`infer_router_form` (hashable, equal by value)."""

    spec: RoutingSpec

    def __call__(self, module: nn.Module) -> RoutingSpec:
        return self.spec


@dataclasses.dataclass(frozen=True)
class _Attribute:
    """A tensor the router holds, by dotted path (``None``: no such tensor)."""

    path: Optional[str]

    def __call__(self, module: nn.Module) -> Optional[Tensor]:
        if self.path is None:
            return None
        value: Any = module
        for part in self.path.split("."):
            value = getattr(value, part, None)
        return value if isinstance(value, Tensor) else None


def _none(module: nn.Module) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class RouterForm:
    """A router ``forward``: how to read its routing, and what it returns."""

    name: str
    spec: Callable[[nn.Module], RoutingSpec]
    anchor: str = ""  # "module:Class" whose forward source defines the form ("" for inferred forms)
    weight: Callable[[nn.Module], Optional[Tensor]] = _Attribute("weight")  # [E, H]
    bias: Callable[[nn.Module], Optional[Tensor]] = _none
    correction_bias: Callable[[nn.Module], Optional[Tensor]] = _none
    keeps_leading_dims: bool = False  # the forward does not flatten its input to [T, H]
    bias_argument: bool = False  # the block passes the correction bias: forward(hidden, bias)
    output: str = TRIPLE

    def __reduce_ex__(self, protocol: int) -> Any:
        """A form of :data:`ROUTER_FORMS` pickles by name (its specs are lambdas); an inferred one by value."""
        if any(form is self for form in ROUTER_FORMS):
            return _known_form, (self.name,)
        return object.__reduce_ex__(self, protocol)

    def describe(self, module: nn.Module) -> str:
        spec = self.spec(module)
        return (f"moe_route {spec.scoring}, top-{spec.top_k}" + (", renormalized" if spec.renormalize else "")
                + (f", groups {spec.topk_group}/{spec.n_group}" if spec.n_group > 1 else "")
                + (f", scaled by {spec.routed_scaling_factor:g}" if spec.routed_scaling_factor != 1.0 else "")
                + ("" if self.anchor else " (inferred from what it computes)"))


_MODELS = "transformers.models"
ROUTER_FORMS: tuple[RouterForm, ...] = (
    RouterForm(  # Qwen2/3-MoE, OLMoE, FlexOlmo, Qwen3-Next, ...
        "softmax_topk", lambda m: RoutingSpec(m.top_k, "softmax", bool(m.norm_topk_prob), weights_dtype="logits"),
        f"{_MODELS}.qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter",
    ),
    RouterForm(  # Qwen3-VL-MoE, Qwen3.5-MoE: always renormalised
        "softmax_topk_renormalized", lambda m: RoutingSpec(m.top_k, "softmax", True, weights_dtype="logits"),
        f"{_MODELS}.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextTopKRouter",
    ),
    RouterForm(  # Mixtral, MiniMax: renormalised, fp32 weights
        "mixtral", lambda m: RoutingSpec(m.top_k, "softmax", True, weights_dtype="fp32"),
        f"{_MODELS}.mixtral.modeling_mixtral:MixtralTopKRouter",
    ),
    RouterForm(  # DeepSeek-V3, GLM-4-MoE, Dots1, ...: sigmoid, correction bias, groups
        "deepseek_v3",
        lambda m: RoutingSpec(m.top_k, "sigmoid", bool(m.norm_topk_prob), int(m.num_group), int(m.topk_group),
                              float(m.routed_scaling_factor), logits="fp32_inputs", weights_dtype="fp32"),
        f"{_MODELS}.deepseek_v3.modeling_deepseek_v3:DeepseekV3TopkRouter",
        correction_bias=_Attribute("e_score_correction_bias"),
    ),
    RouterForm(  # gpt-oss: biased logits, top-k then softmax
        "gpt_oss", lambda m: RoutingSpec(m.top_k, "topk_then_softmax", weights_dtype="logits"),
        f"{_MODELS}.gpt_oss.modeling_gpt_oss:GptOssTopKRouter", bias=_Attribute("bias"), keeps_leading_dims=True,
    ),
    RouterForm(  # Granite-MoE (all variants): fp32 logits, top-k then softmax, weights in the hidden dtype
        "granite_moe",
        lambda m: RoutingSpec(m.top_k, "topk_then_softmax", logits="fp32_outputs", weights_dtype="hidden"),
        f"{_MODELS}.granitemoe.modeling_granitemoe:GraniteMoeTopKRouter", keeps_leading_dims=True,
    ),
)


def _known_form(name: str) -> RouterForm:
    return next(form for form in ROUTER_FORMS if form.name == name)


def router_linear(module: nn.Module) -> Optional[str]:
    """Where a router keeps its ``[E, H]`` projection: ``""`` (its own ``weight``), the name of its one
    ``nn.Linear`` child (Afmoe's ``gate``, HunYuan's ``wg``), or None."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor):
        return "" if weight.dim() == 2 and weight.is_floating_point() else None
    if hasattr(module, "experts"):
        return None  # a whole MoE block, not its router
    linears = [name for name, child in module.named_children() if isinstance(child, nn.Linear)]
    others = [name for name, child in module.named_children() if not isinstance(child, nn.Linear)]
    return linears[0] if len(linears) == 1 and not others else None


def looks_like_router(module: nn.Module) -> bool:
    """A module that picks ``top_k`` experts (an integer ``top_k`` and no experts of its own)."""
    return isinstance(getattr(module, "top_k", None), int) and not hasattr(module, "experts") and not isinstance(
        getattr(module, "top_k"), bool)


def is_router(module: nn.Module) -> bool:
    """A router whose logits are one linear projection: a ``[E, H]`` weight (its own or its one
    linear child's) and an integer ``top_k``."""
    return looks_like_router(module) and router_linear(module) is not None


def _router_weight(module: nn.Module) -> Tensor:
    name = router_linear(module)
    return module.get_submodule(name).weight if name else module.weight


def _weight_form(module: nn.Module) -> tuple[_Attribute, _Attribute]:
    """The weight and linear bias of a router, as form fields."""
    name = router_linear(module)
    prefix = f"{name}." if name else ""
    return _Attribute(prefix + "weight"), _Attribute(prefix + "bias")


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward)).strip()
    except (OSError, TypeError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _anchor_source(anchor: str) -> str | None:
    module_name, _, class_name = anchor.partition(":")
    try:
        return _forward_source(getattr(importlib.import_module(module_name), class_name))
    except Exception:  # a transformers without that model
        return None


#: Inferred forms by router class and configuration (the layers of a model share one inference).
_inferred: dict[tuple, Optional[RouterForm]] = {}


def router_form(module: nn.Module) -> RouterForm | None:
    """The routing ``module`` computes, if ``moe_route`` computes it (inferred forms cached per module)."""
    if not is_router(module):
        return None
    cls = getattr(type(module), "_hw_agnostic_base", type(module))
    source = _forward_source(cls)
    if source is None:
        return None
    known = next((form for form in ROUTER_FORMS if _anchor_source(form.anchor) == source), None)
    if known is not None:
        return known
    return _inferred_form(cls, _configuration(module), module)


def _configuration(module: nn.Module) -> tuple:
    """What an inferred form depends on besides the class: shapes, settings and which tensors it holds."""
    settings = tuple(sorted((k, v) for k, v in vars(module).items()
                            if isinstance(v, (bool, int, float, str, type(None)))
                            and k not in ("training", "layer_idx")))  # one inference for a model's layers
    tensors = tuple((name, tuple(t.shape)) for name, t in itertools.chain(module.named_parameters(),
                                                                            module.named_buffers()))
    return settings + tensors


def _inferred_form(cls: type, configuration: tuple, module: nn.Module) -> RouterForm | None:
    key = (cls, configuration)
    if key not in _inferred:
        _inferred[key] = infer_router_form(module, cls)
    return _inferred[key]


# --------------------------------------------------------------------------------------------
# inference


def _extra_parameters(cls: type) -> int | None:
    """How many required arguments the router's forward takes after the hidden states."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not parameters or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY, parameters[0].POSITIONAL_OR_KEYWORD):
        return None
    required = [p for p in parameters[1:] if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required)


def _probe_copy(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """A CPU copy of the router with random weights that spread the logits (std ~2) and biases
    large enough to change choices."""
    meta = _router_weight(module).is_meta
    probe = copy.deepcopy(module).to_empty(device="cpu") if meta else copy.deepcopy(module).cpu()
    probe.train(False)
    hidden_size = _router_weight(probe).shape[1]
    with torch.no_grad():
        for name, tensor in itertools.chain(probe.named_parameters(), probe.named_buffers()):
            if not tensor.is_floating_point():
                continue
            if name.rsplit(".", 1)[-1] == "weight":
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * (2.0 / hidden_size**0.5))
            elif "bias" in name.rsplit(".", 1)[-1]:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            elif meta:  # an unknown tensor of a meta module: any finite value
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
    return probe


def _correction_candidates(module: nn.Module, experts: int) -> list[Optional[str]]:
    found = [name for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers())
             if name not in ("weight", "bias") and tensor.is_floating_point() and tensor.numel() == experts]
    return [*found, None]


def _factor_candidates(module: nn.Module) -> list[float]:
    factors = [1.0]
    for name, value in vars(module).items():
        if isinstance(value, float) and "scal" in name and value not in factors and value > 0:
            factors.append(value)
    return factors


def _dense(logits: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    return torch.zeros(logits.shape, dtype=weights.dtype, device=weights.device).scatter_(1, ids, weights)


def _close_rows(got: Tensor, want: Tensor) -> Tensor:
    """Per row, whether ``got`` matches ``want`` within the tolerance table (NaN where NaN)."""
    tol = tolerance(want.dtype)
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    close = (got - want).abs() <= tol.rtol * want.abs() + tol.atol * scale
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    return torch.where(finite, close, same).all(-1)


def _agreement(got: tuple[Tensor, Tensor, Tensor], out: Any, form: RouterForm, tokens: int) -> float:
    """The share of rows on which ``got`` reproduces the router's output ``out`` (0.0 on a dtype,
    shape or logits difference)."""
    logits, weights, ids = got
    if not isinstance(out, tuple) or not all(isinstance(t, Tensor) for t in out):
        return 0.0
    if form.output == DENSE:
        if len(out) != 2:
            return 0.0
        want_scores, want_logits = (t.reshape(tokens, -1) for t in out)
        if (want_logits.dtype != logits.dtype or want_logits.shape != logits.shape
                or want_scores.dtype != weights.dtype or not _close_rows(logits, want_logits).all()):
            return 0.0
        return _close_rows(_dense(logits, weights, ids), want_scores).double().mean().item()
    if len(out) != 3:
        return 0.0
    want_logits, want_weights, want_ids = (t.reshape(tokens, -1) for t in out)
    if (want_logits.dtype != logits.dtype or want_logits.shape != logits.shape or want_weights.dtype != weights.dtype
            or want_ids.shape != ids.shape or want_ids.is_floating_point() or not _close_rows(logits, want_logits).all()):
        return 0.0
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)  # a family's top-k may come unsorted
    same_ids = (ids.gather(-1, order) == want_ids.gather(-1, want_order).to(ids.dtype)).all(-1)
    rows = same_ids & _close_rows(weights.gather(-1, order), want_weights.gather(-1, want_order))
    return rows.double().mean().item()


#: Scorings that choose on the logits first: where a softmax underflows or a sigmoid saturates,
#: the scores tie and ``torch.topk`` may pick any of them, and the logits order is one of its picks.
_SCORING_ORDER = ("topk_then_softmax", "topk_then_sigmoid", "softmax", "sigmoid")
assert sorted(_SCORING_ORDER) == sorted(SCORINGS)


def _candidates(module: nn.Module, extra: int) -> list[RouterForm]:
    experts = _router_weight(module).shape[0]
    weight, linear_bias = _weight_form(module)
    groups = int(getattr(module, "num_group", None) or getattr(module, "n_group", None) or 1)
    topk_group = int(getattr(module, "topk_group", None) or 1)
    corrections = [None] if extra else _correction_candidates(module, experts)
    forms = []
    for output, argument, correction, scoring, renormalize, factor in itertools.product(
            (TRIPLE, DENSE), (True, False) if extra else (False,), corrections, _SCORING_ORDER, (False, True),
            _factor_candidates(module)):
        n_group, top_group = (groups, topk_group) if scoring == "sigmoid" else (1, 1)
        if experts % n_group or module.top_k > top_group * (experts // n_group):
            continue
        for logits, weights_dtype in itertools.product(LOGITS, WEIGHTS_DTYPES):
            spec = RoutingSpec(module.top_k, scoring, renormalize, n_group, top_group, factor, logits, weights_dtype)
            forms.append(RouterForm(
                "inferred", _Fixed(spec), weight=weight, bias=linear_bias,
                correction_bias=_Attribute(correction), bias_argument=argument, output=output))
    return forms


#: bfloat16 probes may tie at the top-k boundary, where ``torch.topk``'s order is unspecified.
_BF16_AGREEMENT = 0.9


def infer_router_form(module: nn.Module, cls: Optional[type] = None) -> RouterForm | None:
    """The routing in ``moe_route``'s terms that reproduces ``module``'s forward, or None.

    Run on a random copy (see the module docstring): float32 probes must agree on every row,
    bfloat16 probes (which tell the casts apart) on at least 90% of the rows.
    """
    cls = cls or type(module)
    extra = _extra_parameters(cls)
    if extra is None or extra > 1:
        return None
    experts, hidden_size = _router_weight(module).shape
    generator = torch.Generator().manual_seed(experts * 1000 + hidden_size)
    try:
        probes = {dtype: _probe_copy(module, generator).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    except Exception:
        return None
    tokens = 48
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    bias_argument = 0.3 * torch.randn(experts, generator=generator)
    outputs: dict[torch.dtype, Any] = {}
    with torch.no_grad():
        for dtype, probe in probes.items():
            for shaped in (hidden, hidden[None]):  # [T, H], or [1, T, H] for routers that take only 3-D input
                try:
                    outputs[dtype] = cls.forward(probe, shaped.to(dtype), *([bias_argument] if extra else []))
                    break
                except Exception:
                    continue
            else:
                return None
        for form in _candidates(module, extra):
            if all(_agreement(_route_of(form, probe, hidden.to(dtype), bias_argument), outputs[dtype], form,
                              tokens) >= (1.0 if dtype == torch.float32 else _BF16_AGREEMENT)
                   for dtype, probe in probes.items()):
                return dataclasses.replace(form, keeps_leading_dims=_keeps_leading_dims(cls, probes[torch.float32],
                                                                                         hidden, extra, bias_argument))
    return None


def _route_of(form: RouterForm, module: nn.Module, hidden: Tensor, bias_argument: Tensor,
              native: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    correction = bias_argument if form.bias_argument else form.correction_bias(module)
    return route(form.spec(module), hidden, form.weight(module), form.bias(module),
                 None if correction is None else correction.reshape(-1), native=native)


def _keeps_leading_dims(cls: type, probe: nn.Module, hidden: Tensor, extra: int, bias_argument: Tensor) -> bool:
    try:
        with torch.no_grad():
            out = cls.forward(probe, hidden[:6].reshape(2, 3, -1), *([bias_argument] if extra else []))
    except Exception:  # it takes only [T, H]: we flatten
        return False
    return isinstance(out, tuple) and isinstance(out[0], Tensor) and out[0].dim() == 3


# --------------------------------------------------------------------------------------------
# the switched class


def _routed_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
    cls = type(self)
    form: RouterForm = cls._hw_agnostic_form
    bias = form.bias(self)
    weight = form.weight(self)
    if needs_own_code(hidden_states, weight, bias) or (args or kwargs) and not form.bias_argument:
        return cls._hw_agnostic_base.forward(self, hidden_states, *args, **kwargs)
    correction = (args[0] if args else next(iter(kwargs.values()))) if form.bias_argument else form.correction_bias(self)
    logits, weights, ids = route(form.spec(self), hidden_states, weight, bias,
                                 None if correction is None else correction.reshape(-1))
    if form.output == DENSE:
        return _dense(logits, weights, ids), logits
    if form.keeps_leading_dims:
        lead = hidden_states.shape[:-1]
        logits, weights, ids = logits.view(*lead, -1), weights.view(*lead, -1), ids.view(*lead, -1)
    return logits, weights, ids


@functools.lru_cache(maxsize=None)
def routed_class(cls: type, form: RouterForm) -> type:
    return type(f"HwAgnostic{cls.__name__}", (cls,), {
        "forward": _routed_forward, "_hw_agnostic_form": form, "_hw_agnostic_base": cls, "__module__": __name__,
        **made_by(routed_class, cls, form),
        "__doc__": f"{cls.__name__} computing its routing with hw_agnostic's moe_route ({form.name} form).",
    })


def _router_disagreement(module: nn.Module, routed: type) -> str | None:
    """Run the switched router against the module's own forward on random tokens."""
    weight = _router_weight(module)
    if weight.is_meta:
        return None
    form: RouterForm = routed._hw_agnostic_form
    generator = torch.Generator().manual_seed(weight.shape[-1])
    hidden = torch.randn(13, weight.shape[-1], generator=generator).to(weight.device, weight.dtype)
    args = [0.3 * torch.randn(weight.shape[0], generator=generator).to(weight.device)] if form.bias_argument else []
    base = type(module)
    with torch.no_grad():
        try:
            want = base.forward(module, hidden, *args)
        except Exception:  # a router that takes only [B, T, H]
            hidden = hidden[None]
            try:
                want = base.forward(module, hidden, *args)
            except Exception as err:
                return f"its own forward raised {type(err).__name__}: {err}"
        module.__class__ = routed
        try:
            got = module(hidden, *args)
        finally:
            module.__class__ = base
    if form.output == DENSE:
        pairs = (("scores", got[0], want[0]), ("logits", got[1], want[1]))
    else:
        if not isinstance(want, tuple) or len(want) != 3:
            return "its forward does not return (logits, weights, ids)"
        (want_logits, want_weights, want_ids), (logits, weights, ids) = want, got
        want_ids, ids = want_ids.reshape(13, -1), ids.reshape(13, -1)
        if want_ids.shape != ids.shape or not torch.equal(want_ids.sort(-1).values.to(ids.dtype), ids.sort(-1).values):
            return "chose different experts"
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)  # a family's top-k may come unsorted
        pairs = (("logits", logits.reshape(13, -1), want_logits.reshape(13, -1)),
                 ("weights", weights.reshape(13, -1).gather(-1, order), want_weights.reshape(13, -1).gather(-1, want_order)))
    for name, a, b in pairs:
        if a.dtype != b.dtype:
            return f"{name} in {a.dtype} instead of {b.dtype}"
        problem = mismatch(a, b.double(), b.dtype)
        if problem:
            return f"{name} differ: {problem}"
    return None


def switch_router(path: str, module: nn.Module, report: RewireReport, verify: bool) -> Change | None:
    """Switch ``module`` to compute its routing with ``moe_route`` (returned applied), or list it as left."""
    if hasattr(type(module), "_hw_agnostic_form"):
        return None  # switched already
    form = router_form(module)
    if form is None:
        report.add("left", path, module, detail="routing none of moe_route's forms reproduces (scoring, "
                                                "renormalisation, scaling, correction bias, casts)")
        return None
    base = type(module)
    routed = routed_class(base, form)
    problem = _router_disagreement(module, routed) if verify else None
    if problem is not None:
        report.add("left", path, module, detail=f"moe_route disagreed with this router: {problem}")
        return None
    module.__class__ = routed

    def apply() -> None:
        module.__class__ = routed

    def undo() -> None:
        module.__class__ = base

    return Change("router", path, base.__name__, routed.__name__, form.describe(module), apply, undo)


def restore_routers(model: nn.Module) -> None:
    """Every switched router of ``model`` back to its own class."""
    for module in model.modules():
        base = getattr(type(module), "_hw_agnostic_base", None)
        if base is not None and hasattr(type(module), "_hw_agnostic_form"):
            module.__class__ = base


__all__ = ["ROUTER_FORMS", "RouterForm", "infer_router_form", "is_router", "restore_routers", "router_form",
           "routed_class", "switch_router"]
