"""Norm detection: RMS norms, layer norms and gated RMS norms, by what the module computes.

Each detector looks only at leaf modules whose parameters can be a norm's (1-D scales and biases,
or per-head ``[heads, dim]`` ones), reads ``eps`` from a trace of the forward (``make_fx`` on fake
tensors) or from the module's float attributes, then runs the module against the op's reference
for every numerics (and, for gated norms, every gate order, activation and group size) on small
random CPU tensors: fp32 results must agree to rounding, bf16 results pick the numerics (which
casts the module makes). A detector returns a spec, ``None`` for modules that are no candidate at
all, or a :class:`NotDetected` saying why a norm-like module is not one. Works on modules whose
parameters live on meta, CPU or GPU (the probes use fresh CPU parameters).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, fx, nn

from ..ops.gated_rms_norm import ACTIVATIONS as GATE_ACTIVATIONS
from ..ops.gated_rms_norm import NUMERICS as GATED_NUMERICS
from ..ops.gated_rms_norm import ORDERS as GATE_ORDERS
from ..ops.gated_rms_norm import gated_rms_norm_reference
from ..ops.layer_norm import NUMERICS as LAYER_NORM_NUMERICS
from ..ops.layer_norm import layer_norm_reference
from ..ops.rms_norm import NUMERICS, rms_norm_reference
from ..tolerances import mismatch


@dataclasses.dataclass(frozen=True)
class NotDetected:
    reason: str


class Detections:
    """A detector's results shared by the modules that compute the same function of their input and
    parameters: one class, equal state besides the parameters (forward hooks included), parameters
    of the same names, shapes and dtypes, and no buffers. A model's layers repeat their norms:
    tracing and probing each instance again cost a 32-layer Qwen3 2.7 of the 4.6 s its rewire took
    (CPU).

    One object per pass over a model: an attribute that is no plain value (a shared config, a
    function) is told apart by identity, which holds only while the object lives (kept here).
    """

    def __init__(self) -> None:
        self._found: dict[tuple[Any, ...], Any] = {}
        self._alive: list[Any] = []

    def __call__(self, detect: Callable[[nn.Module], Any], module: nn.Module) -> Any:
        key = self._key(module)
        if key is None:
            return detect(module)
        key = (detect, *key)
        if key not in self._found:
            self._found[key] = detect(module)
        return self._found[key]

    def _key(self, module: nn.Module) -> tuple[Any, ...] | None:
        if module._buffers or module._modules:
            return None  # a buffer's values reach the forward; a parent is no norm to any detector
        try:
            state = tuple((name, self._frozen(value)) for name, value in vars(module).items()
                          # the parameters are keyed below; (de)serialisation hooks never run in a forward
                          if name not in ("_parameters", "_buffers", "_modules") and "state_dict" not in name)
        except _Unkeyed:
            return None
        params = ((name, None if p is None else (tuple(p.shape), p.dtype)) for name, p in module._parameters.items())
        return (type(module), state, tuple(params))

    def _frozen(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
            return (type(value), value)  # True, 1 and 1.0 are equal keys, not always the same forward
        if isinstance(value, Tensor):
            raise _Unkeyed  # its values may reach the forward
        if isinstance(value, dict):
            return (type(value), tuple((self._frozen(k), self._frozen(v)) for k, v in value.items()))
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(self._frozen(v) for v in value))
        if isinstance(value, (set, frozenset)):
            return (type(value), frozenset(self._frozen(v) for v in value))
        self._alive.append(value)
        return ("object", id(value))


class _Unkeyed(Exception):
    """A module state the detections cannot key on (a tensor's values)."""


# --------------------------------------------------------------------------------------------
# RMSNorm


@dataclasses.dataclass(frozen=True)
class NormSpec:
    hidden_size: int
    eps: float
    numerics: str
    weight_name: str | None  # None: a norm without a scale
    eps_attribute: str | None  # the instance attribute holding eps, if one does


def looks_like_norm(module: nn.Module) -> bool:
    """Worth reporting when not an RMSNorm: a leaf whose parameters are all 1-D (a norm's scale/bias)."""
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.dim() == 1 for p in params)


def detect_rms_norm(module: nn.Module) -> NormSpec | NotDetected | None:
    """``None`` for modules that are no candidates at all (children, matrices, buffers beside weights)."""
    params = dict(module.named_parameters(recurse=False))
    buffers = list(module.buffers(recurse=False))
    if list(module.children()) or (buffers and (params or any(b.dim() != 1 for b in buffers))):
        return None  # a weightless norm may keep a dummy 1-D buffer (Falcon-Mamba's); it is checked by value
    if len(params) > 1 or any(p.dim() != 1 for p in params.values()):
        if looks_like_norm(module):
            return NotDetected(f"has parameters {sorted(params)}: not an RMS norm (a LayerNorm has a bias)")
        return None
    weight_name = next(iter(params), None)
    extra = _extra_inputs(module)
    if extra:
        reason = f"its forward takes more than the input ({', '.join(extra)}): not a plain RMS norm"
        return NotDetected(reason) if weight_name else None
    if "eps" in vars(module) and module.eps is None:  # torch's nn.RMSNorm(eps=None): finfo(x.dtype).eps
        return NotDetected("its eps is None: it depends on the input dtype")
    hidden = params[weight_name].shape[0] if weight_name else 16
    eps = _traced_eps(module, weight_name, hidden)
    if isinstance(eps, NotDetected):
        return eps if weight_name else None
    numerics = _matching_numerics(module, weight_name, hidden, eps)
    if isinstance(numerics, NotDetected):
        return numerics
    eps, eps_attribute = _eps_attribute(module, eps)
    return NormSpec(hidden, eps, numerics, weight_name, eps_attribute)


def _as_fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _extra_inputs(module: nn.Module) -> list[str]:
    """The forward's parameters after the input (a gated norm's ``gate``): a one-input probe would miss them."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind is not p.VAR_KEYWORD]


def _call_with(module: nn.Module, weight_name: str | None, x: Tensor, weight: Tensor | None) -> Any:
    values = {weight_name: weight} if weight_name else {}
    return torch.func.functional_call(module, values, (x,))


def _traced_eps(module: nn.Module, weight_name: str | None, hidden: int) -> float | NotDetected:
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(x: Tensor, weight: Tensor) -> Any:
        return _call_with(module, weight_name, x, weight if weight_name else None)

    try:
        graph = make_fx(run, tracing_mode="fake")(torch.empty(2, 3, hidden), torch.empty(hidden)).graph
    except Exception as err:
        return NotDetected(f"forward cannot be traced on fake tensors ({type(err).__name__}: {err})")
    aten = torch.ops.aten
    fused = {getattr(aten, name).default for name in ("rms_norm", "_fused_rms_norm") if hasattr(aten, name)}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in fused:  # torch's own F.rms_norm: (input, shape, weight, eps)
            eps = node.args[3] if len(node.args) > 3 else node.kwargs.get("eps")
            if not isinstance(eps, (int, float)):
                return NotDetected("torch's rms_norm with eps=None: its eps depends on the input dtype")
            return float(eps)
        added = _added_eps(node)
        if added is not None and added[1].target is aten.mean.dim and list(added[1].args[1]) in ([-1], [2]):
            return added[0]
    return NotDetected("computes no rsqrt(mean(x**2, -1) + eps)")


def _added_eps(node: fx.Node) -> tuple[float, fx.Node] | None:
    """For an inverse square root of ``t + eps`` (one tensor, one number): ``(eps, t's node)``."""
    aten = torch.ops.aten
    if not _is_inverse_sqrt(node):
        return None
    added = node.args[0]
    if not (isinstance(added, fx.Node) and added.target in (aten.add.Tensor, aten.add.Scalar, aten.add_.Scalar)):
        return None
    scalars = [a for a in added.args if isinstance(a, (int, float))]
    tensors = [a for a in added.args if isinstance(a, fx.Node)]
    if len(scalars) != 1 or len(tensors) != 1:
        return None
    return float(scalars[0]), tensors[0]


def _is_inverse_sqrt(node: fx.Node) -> bool:
    """``rsqrt(t)``, ``pow(t, -0.5)`` or ``sqrt(t)`` (divided by later, ``x / sqrt(...)``)."""
    aten = torch.ops.aten
    if node.target in (aten.rsqrt.default, aten.sqrt.default):
        return True
    return node.target is aten.pow.Tensor_Scalar and len(node.args) == 2 and node.args[1] == -0.5


def _matching_numerics(module: nn.Module, weight_name: str | None, hidden: int, eps: float) -> str | NotDetected:
    g = torch.Generator().manual_seed(hidden)
    weight32 = torch.randn(hidden, generator=g) if weight_name else None
    probes = [torch.randn(3, hidden, generator=g) * 3, torch.randn(3, hidden, generator=g) * math.sqrt(eps) * 0.5]
    low = (torch.randn(3, hidden, generator=g) * 2).to(torch.bfloat16)
    weight_low = weight32.to(torch.bfloat16) if weight32 is not None else None
    errors: dict[str, float] = {}
    with torch.no_grad():
        try:
            theirs = [_call_with(module, weight_name, x, weight32) for x in probes]
            theirs_low = _call_with(module, weight_name, low, weight_low)
        except Exception as err:
            return NotDetected(f"forward failed on a probe ({type(err).__name__}: {err})")
        for numerics in NUMERICS if weight_name else ("llama",):
            ours = [rms_norm_reference(x, weight32, eps, numerics) for x in probes]
            if any(not isinstance(t, Tensor) or t.shape != o.shape or t.dtype != o.dtype for t, o in zip(theirs, ours)):
                continue
            if not all(torch.allclose(t, o, rtol=1e-6, atol=0) for t, o in zip(theirs, ours)):
                continue
            ours_low = rms_norm_reference(low, weight_low, eps, numerics)
            if theirs_low.dtype != ours_low.dtype:
                continue
            errors[numerics] = (theirs_low.double() - ours_low.double()).abs().max().item()
    if not errors:
        return NotDetected("computes something other than an RMS norm with llama, fp32_scale or gemma numerics")
    best = min(errors, key=errors.get)
    if errors[best] != 0.0:
        return NotDetected(f"closest to {best!r} numerics but bf16 results differ by up to {errors[best]:.3g}")
    return best


# --------------------------------------------------------------------------------------------
# shared by the layer-norm and gated-norm detectors


def _float_attributes(module: nn.Module) -> list[float]:
    return [float(v) for v in vars(module).values() if isinstance(v, float) and 0.0 < v < 1.0]


def _eps_candidates(run: Any, examples: tuple[Tensor, ...], module: nn.Module) -> list[float]:
    """The eps values the forward may add: what a fake trace shows before an inverse square root
    (or hands to torch's fused layer/RMS norm), then the module's small float attributes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    found: list[float] = []
    aten = torch.ops.aten
    fused = {getattr(aten, name).default: index for name, index in
             (("native_layer_norm", 4), ("layer_norm", 4), ("rms_norm", 3), ("_fused_rms_norm", 3))
             if hasattr(aten, name)}
    statistics = {aten.mean.dim, aten.var.correction, aten.var.dim, aten.var_mean.correction}
    try:
        graph = make_fx(run, tracing_mode="fake")(*examples).graph
    except Exception:
        graph = None
    for node in graph.nodes if graph is not None else ():
        if node.op != "call_function":
            continue
        if node.target in fused:
            index = fused[node.target]
            eps = node.args[index] if len(node.args) > index else node.kwargs.get("eps")
            if isinstance(eps, (int, float)):
                found.append(float(eps))
        elif (added := _added_eps(node)) is not None:
            eps, source = added
            if source.target is aten.select.int or str(source.target).startswith("<built-in function getitem"):
                source = source.args[0]  # var_mean's variance
            if getattr(source, "target", None) in statistics:
                found.append(eps)
    for value in _float_attributes(module):
        found += [value, _as_fp32(value)]
    return list(dict.fromkeys(found))


def _eps_attribute(module: nn.Module, eps: float) -> tuple[float, str | None]:
    """The attribute holding eps, if one does (a trace may show it rounded to fp32), and its value."""
    for name, value in vars(module).items():
        if isinstance(value, float) and (value == eps or _as_fp32(value) == eps):
            return float(value), name
    return eps, None


def _probes(shape: tuple[int, ...], eps: float, g: torch.Generator) -> list[Tensor]:
    """fp32 inputs: ordinary ones, and ones so small that eps dominates the statistics."""
    return [torch.randn(*shape, generator=g) * 3 + 0.5, torch.randn(*shape, generator=g) * math.sqrt(eps) * 0.5]


def _agrees(theirs: Any, ours: Tensor) -> bool:
    return (isinstance(theirs, Tensor) and theirs.shape == ours.shape and theirs.dtype == ours.dtype
            and torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6))


def _bf16_error(theirs: Any, ours: Tensor) -> float | None:
    """None where the module's bf16 result is not within the tolerance table of ours, else the max error."""
    if not isinstance(theirs, Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
        return None
    if mismatch(theirs, ours.double(), ours.dtype) is not None:
        return None
    return (theirs.double() - ours.double()).abs().max().item()


# --------------------------------------------------------------------------------------------
# LayerNorm


@dataclasses.dataclass(frozen=True)
class LayerNormSpec:
    shape: tuple[int, ...]  # (hidden,), or (heads, hidden) for per-head parameters
    eps: float
    numerics: str
    weight_name: str | None
    bias_name: str | None
    eps_attribute: str | None

    @property
    def hidden_size(self) -> int:
        return self.shape[-1]

    @property
    def num_heads(self) -> int | None:
        return self.shape[0] if len(self.shape) == 2 else None


def _normalised_shape(module: nn.Module, params: dict[str, nn.Parameter]) -> tuple[int, ...] | None:
    if params:
        shapes = {tuple(p.shape) for p in params.values()}
        return next(iter(shapes)) if len(shapes) == 1 else None
    declared = getattr(module, "normalized_shape", None)
    if isinstance(declared, int):
        return (declared,)
    if isinstance(declared, (tuple, list, torch.Size)) and len(declared) == 1 and isinstance(declared[0], int):
        return (int(declared[0]),)
    return None


def _roles(params: dict[str, nn.Parameter]) -> list[tuple[str | None, str | None]]:
    """Which parameter may be the weight and which the bias: by name where the names say, else both ways."""
    names = list(params)
    if not names:
        return [(None, None)]
    if len(names) == 1:
        return [(names[0], None), (None, names[0])]
    first, second = names
    if "bias" in second or "beta" in second:
        return [(first, second)]
    if "bias" in first or "beta" in first:
        return [(second, first)]
    return [(first, second), (second, first)]


def detect_layer_norm(module: nn.Module) -> LayerNormSpec | NotDetected | None:
    """A mean-subtracting norm over the last dimension (``nn.LayerNorm``, OLMo's weightless one,
    Cohere's bias-free one, Nemotron's ``1 + w``, Chameleon's per-head one), or None/NotDetected."""
    params = dict(module.named_parameters(recurse=False))
    if list(module.children()) or list(module.buffers(recurse=False)) or len(params) > 2:
        return None
    if any(p.dim() not in (1, 2) for p in params.values()) or _extra_inputs(module):
        return None
    if isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
        return None
    shape = _normalised_shape(module, params)
    if shape is None:
        return None
    spec = _layer_norm_spec(module, params, shape)
    if isinstance(spec, NotDetected) and (len(shape) > 1 or not params):
        return None  # per-head or weightless: a norm only if it computes one, no report otherwise
    return spec


def _layer_norm_spec(module: nn.Module, params: dict[str, nn.Parameter],
                     shape: tuple[int, ...]) -> LayerNormSpec | NotDetected:
    probe_shape = (2, 3, *shape)
    g = torch.Generator().manual_seed(sum(shape))
    weight32, bias32 = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)

    def values(weight_name: str | None, bias_name: str | None, weight: Tensor, bias: Tensor) -> dict[str, Tensor]:
        chosen = {weight_name: weight, bias_name: bias}
        return {name: chosen[name] for name in params}

    def call(weight_name: str | None, bias_name: str | None, x: Tensor, weight: Tensor, bias: Tensor) -> Any:
        return torch.func.functional_call(module, values(weight_name, bias_name, weight, bias), (x,))

    roles = _roles(params)
    candidates = _eps_candidates(lambda x, w, b: call(*roles[0], x, w, b),
                                 (torch.empty(probe_shape), weight32, bias32), module)
    if not candidates:
        return NotDetected("no eps found in its forward or attributes: not a layer norm")
    low = (torch.randn(*probe_shape, generator=g) * 2).to(torch.bfloat16)
    found: dict[tuple[Any, ...], float] = {}
    with torch.no_grad():
        for (weight_name, bias_name), eps in itertools.product(roles, candidates):
            probes = _probes(probe_shape, eps, g)
            try:
                theirs = [call(weight_name, bias_name, x, weight32, bias32) for x in probes]
            except Exception as err:
                return NotDetected(f"forward failed on a probe ({type(err).__name__}: {err})")
            w = weight32 if weight_name else None
            b = bias32 if bias_name else None
            for numerics in LAYER_NORM_NUMERICS if (w is not None or b is not None) else ("fp32",):
                if numerics == "one_plus" and w is None:
                    continue
                if not all(_agrees(t, layer_norm_reference(x, w, b, eps, numerics)) for t, x in zip(theirs, probes)):
                    continue
                w_low = None if w is None else w.to(torch.bfloat16)
                b_low = None if b is None else b.to(torch.bfloat16)
                try:
                    theirs_low = call(weight_name, bias_name, low, weight32.to(torch.bfloat16), bias32.to(torch.bfloat16))
                except Exception as err:
                    return NotDetected(f"forward failed on a bf16 probe ({type(err).__name__}: {err})")
                error = _bf16_error(theirs_low, layer_norm_reference(low, w_low, b_low, eps, numerics))
                if error is not None:
                    found[(weight_name, bias_name, eps, numerics)] = error
    if not found:
        return NotDetected("computes something other than a layer norm over its last dimension "
                           f"with {', '.join(LAYER_NORM_NUMERICS)} numerics")
    weight_name, bias_name, eps, numerics = min(found, key=found.get)
    eps, eps_attribute = _eps_attribute(module, eps)
    return LayerNormSpec(shape, eps, numerics, weight_name, bias_name, eps_attribute)


# --------------------------------------------------------------------------------------------
# gated RMSNorm


@dataclasses.dataclass(frozen=True)
class GatedNormSpec:
    hidden_size: int
    eps: float
    order: str
    group_size: int | None  # None: the whole row
    numerics: str
    activation: str
    weight_name: str | None
    eps_attribute: str | None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def detect_gated_rms_norm(module: nn.Module) -> GatedNormSpec | NotDetected | None:
    """``norm(x) * act(gate)`` or ``norm(x * act(gate))``, per group or over the row (the Mamba-2
    and hybrid linear-attention families' gated norms), called as ``module(x, gate)``."""
    params = dict(module.named_parameters(recurse=False))
    if list(module.children()) or list(module.buffers(recurse=False)) or len(params) != 1:
        return None
    (weight_name, weight), = params.items()
    if weight.dim() != 1 or _extra_inputs(module) != ["gate"]:
        return None
    hidden = weight.shape[0]
    g = torch.Generator().manual_seed(hidden)
    weight32 = torch.randn(hidden, generator=g)

    def call(x: Tensor, gate: Tensor | None, w: Tensor) -> Any:
        return torch.func.functional_call(module, {weight_name: w}, (x, gate))

    candidates = _eps_candidates(call, (torch.empty(2, 3, hidden), torch.empty(2, 3, hidden), weight32), module)
    if not candidates:
        return NotDetected("no eps found in its forward or attributes: not a gated RMS norm")
    gate = torch.randn(2, 3, hidden, generator=g) * 2
    low, low_gate = ((torch.randn(2, 3, hidden, generator=g) * 2).to(torch.bfloat16) for _ in range(2))
    found: dict[tuple[Any, ...], float] = {}
    with torch.no_grad():
        for eps in candidates:
            probes = _probes((2, 3, hidden), eps, g)
            try:
                theirs = [call(x, gate, weight32) for x in probes]
                theirs_low = call(low, low_gate, weight32.to(torch.bfloat16))
            except Exception as err:
                return NotDetected(f"forward failed on a probe ({type(err).__name__}: {err})")
            try:
                plain = call(probes[0], None, weight32)
            except Exception:  # a module that always takes a gate is always called with one
                plain = None
            for group, order, numerics, activation in itertools.product(
                    _divisors(hidden), GATE_ORDERS, GATED_NUMERICS, GATE_ACTIVATIONS):
                size = None if group == hidden else group

                def ours(x: Tensor, gate: Tensor | None, w: Tensor) -> Tensor:
                    return gated_rms_norm_reference(x, gate, w, eps, order, size, numerics, activation)

                if not all(_agrees(t, ours(x, gate, weight32)) for t, x in zip(theirs, probes)):
                    continue
                if plain is not None and not _agrees(plain, ours(probes[0], None, weight32)):
                    continue
                error = _bf16_error(theirs_low, ours(low, low_gate, weight32.to(torch.bfloat16)))
                if error is not None:
                    found[(eps, order, size, numerics, activation)] = error
    if not found:
        return NotDetected("computes something other than an RMS norm gated by silu or sigmoid, "
                           "in either order, per group or over the row")
    eps, order, size, numerics, activation = min(found, key=found.get)
    eps, eps_attribute = _eps_attribute(module, eps)
    return GatedNormSpec(hidden, eps, order, size, numerics, activation, weight_name, eps_attribute)
