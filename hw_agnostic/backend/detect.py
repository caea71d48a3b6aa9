"""Structure detection: what a module computes, never what its class is called.

* Norms (RMS, layer, gated RMS): see :mod:`.detect_norms`.
* :func:`detect_gated_mlp`: traces the module's own forward (``torch.fx``, children as leaves)
  and matches ``down(act(gate(x)) * up(x))``, or ``gate, up = gate_up(x).chunk(2)``; the
  activation is identified by evaluating it.
* :func:`detect_decoder_layout`: runs a decoder layer's own forward with its parameterised
  children replaced by recording stand-ins, and compares the result with the known residual
  layouts (pre-norm, sandwich-norm, post-norm) run on the same stand-ins.
* :func:`detect_shared_inputs`: one forward of the whole model with hooks on its linears finds
  the groups of linears that read the same tensor (q/k/v).

Every detector returns a spec, or a :class:`NotDetected` saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..ops.fused_experts import gated_reference
from ..tolerances import mismatch
from .detect_norms import NotDetected


# --------------------------------------------------------------------------------------------
# gated MLP


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    gate: str | None  # child names; gate/up are None when gate_up holds both
    up: str | None
    gate_up: str | None
    down: str
    activation: str
    hidden_size: int
    intermediate_size: int
    bias: bool
    down_bias: bool
    # Constant factors on the gate and up projections' outputs and on the down projection's output
    # (Falcon-H1's mlp_multipliers), and the dropout applied to the output (identity in eval).
    gate_multiplier: float | None = None
    up_multiplier: float | None = None
    down_multiplier: float | None = None
    dropout: float = 0.0
    swiglu_alpha: float = 1.702  # activation "swiglu_oai" only
    swiglu_limit: float = 7.0


class _ChildrenAsLeaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


_CANDIDATE_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def identify_activation(fn: Callable[[Tensor], Tensor]) -> str | None:
    """Which supported activation ``fn`` computes (by evaluating it), if any."""
    probe = torch.linspace(-6, 6, 97)
    try:
        with torch.no_grad():
            out = fn(probe)
    except Exception:
        return None
    for name, candidate in _CANDIDATE_ACTIVATIONS.items():
        if isinstance(out, Tensor) and out.shape == probe.shape and torch.allclose(out, candidate(probe), atol=1e-6):
            return name
    return None


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}


def _projection_sizes(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear projection: ``nn.Linear``, or GPT-2's ``Conv1D`` (a transposed linear)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if isinstance(getattr(module, "nf", None), int) and isinstance(weight, Tensor) and weight.dim() == 2:
        return weight.shape[0], weight.shape[1]
    return None


def _one_widening_projection(linears: dict[str, nn.Linear]) -> bool:
    """Exactly one linear widens ``hidden -> inter`` and one narrows ``inter -> hidden`` back."""
    sizes = [(l.in_features, l.out_features) for l in linears.values()]
    narrowing = [s for s in sizes if s[0] > s[1]]
    if len(narrowing) != 1:
        return False
    inter, hidden = narrowing[0]
    widening = [s for s in sizes if s[0] == hidden and s[1] in (inter, 2 * inter)]
    return len(widening) == 1 and widening[0][1] == inter and len(sizes) == 2


def looks_like_mlp(module: nn.Module) -> bool:
    """Worth reporting when not a gated MLP: projections that widen the hidden size and narrow it back."""
    sizes = [s for s in map(_projection_sizes, module.children()) if s is not None]
    if not 2 <= len(sizes) <= 3:
        return False
    return any(a[0] == b[1] and a[1] in (b[0], 2 * b[0]) and b[0] > b[1] for a in sizes for b in sizes if a is not b)


def detect_gated_mlp(module: nn.Module) -> MLPSpec | NotDetected | None:
    linears = _linear_children(module)
    if not (2 <= len(linears) <= 3):
        if looks_like_mlp(module):
            sizes = [s for s in map(_projection_sizes, module.children()) if s is not None]
            if len(sizes) == 2 and sorted(sizes) == sorted([sizes[0], sizes[0][::-1]]):
                return NotDetected("one projection widens, one narrows back: a plain MLP (GPT-2's Conv1D "
                                   "projections), no gate for an op of ours")
            return NotDetected("its projections are not nn.Linear (e.g. GPT-2's Conv1D): not served")
        return None
    others = [name for name, c in module.named_children() if not isinstance(c, nn.Linear) and list(c.parameters())]
    besides = NotDetected(f"children other than linears hold parameters ({', '.join(others)})")
    if others and _one_widening_projection(linears):
        # A gate needs a second widening projection (or one of double width): fc2(act(fc1(x))),
        # here written inline in a larger module (a decoder layer).
        besides = NotDetected(f"one projection widens, none beside it gates: a plain MLP (inline, beside "
                              f"{', '.join(others)})")
    try:
        graph = _ChildrenAsLeaves().trace(module)
    except Exception as err:
        return besides if others else NotDetected(f"forward cannot be traced ({type(err).__name__}: {err})")
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    if len(inputs) != 1 or not isinstance(output.args[0], fx.Node):
        return besides if others else NotDetected("takes or returns more than one tensor")
    x = inputs[0]
    result, dropout = _peel_dropout(module, output.args[0])
    if isinstance(dropout, NotDetected):
        return dropout
    result, down_multiplier = _peel_scale(result)
    down = _module_call(result)
    if down not in linears:
        return NotDetected("its output is not a linear projection")
    product = result.args[0]
    factors = _mul_operands(product)
    if factors is None:
        return NotDetected("the down projection's input is not a product (no gate): a plain MLP")
    if others:
        return NotDetected(f"a gated MLP with parameterised modules beside its projections ({', '.join(others)}): "
                           "not served")
    for act_node, up_node in (factors, factors[::-1]):
        act = _activation_of(module, act_node)
        if act is None:
            continue
        activation, gate_node = act
        gate_node, gate_multiplier = _peel_scale(gate_node)
        up_node, up_multiplier = _peel_scale(up_node)
        spec = _projections(module, linears, x, gate_node, up_node, down, activation)
        if spec is not None:
            if (gate_multiplier or up_multiplier) and spec.gate_up is not None:
                continue  # a factor on one half of a merged projection: not served
            factors = [None if f == 1.0 else f for f in (gate_multiplier, up_multiplier, down_multiplier)]
            return dataclasses.replace(spec, gate_multiplier=factors[0], up_multiplier=factors[1],
                                       down_multiplier=factors[2], dropout=dropout)
    computed = _merged_gated_mlp_by_evaluation(module, linears, down)
    if computed is not None:
        return computed
    return NotDetected("computes a product of projections, but not act(gate(x)) * up(x)")


def _swiglu_parameters(module: nn.Module) -> tuple[float, float]:
    """gpt-oss's clamped SwiGLU constants as the module names them (``alpha``/``swiglu_alpha``, ``limit``)."""
    values = {name: value for name, value in vars(module).items() if isinstance(value, float)}
    alpha = next((v for k, v in values.items() if "alpha" in k), 1.702)
    limit = next((v for k, v in values.items() if "limit" in k), 7.0)
    return alpha, limit


def _merged_gated_mlp_by_evaluation(module: nn.Module, linears: dict[str, nn.Linear], down: str) -> MLPSpec | None:
    """A merged ``gate_up`` projection and ``down``, with an activation between them written inline
    (MiniMax-M3: clamps, ``gate * sigmoid(alpha * gate) * (up + 1)``): recognised when the module
    computes ``down(act(gate_up(x)))`` for one of the gated activations, on inputs that reach past
    the clamps."""
    if len(linears) != 2 or any(list(c.parameters()) for c in module.children() if not isinstance(c, nn.Linear)):
        return None
    gate_up_name = next(name for name in linears if name != down)
    gate_up, down_proj = linears[gate_up_name], linears[down]
    hidden, inter = down_proj.out_features, down_proj.in_features
    if (gate_up.in_features, gate_up.out_features) != (hidden, 2 * inter) or gate_up.weight.is_meta:
        return None
    alpha, limit = _swiglu_parameters(module)
    g = torch.Generator().manual_seed(hidden)
    weight = gate_up.weight
    x = torch.randn(2, 5, hidden, generator=g).to(weight.device, weight.dtype)
    with torch.no_grad():
        scale = 12.0 / gate_up(x).abs().amax().clamp(min=1e-6)  # projections reaching +-12
        x = x * scale
        try:
            want = module(x)
        except Exception:
            return None
        projected = gate_up(x)
        for activation in ("silu", "gelu", "gelu_tanh", "swiglu_oai"):
            got = down_proj(gated_reference(projected, activation, False, alpha, limit))
            if isinstance(want, Tensor) and got.shape == want.shape and mismatch(got, want.double(), want.dtype) is None:
                return MLPSpec(None, None, gate_up_name, down, activation, hidden, inter, gate_up.bias is not None,
                               down_proj.bias is not None, swiglu_alpha=alpha, swiglu_limit=limit)
    return None


def _peel_dropout(module: nn.Module, node: fx.Node) -> tuple[fx.Node, float | NotDetected]:
    """``dropout(t)`` -> ``(t, p)``; anything else -> ``(node, 0.0)``. Dropout is the identity in eval."""
    if node.op == "call_module" and isinstance(module.get_submodule(node.target), nn.Dropout):
        return node.args[0], float(module.get_submodule(node.target).p)
    if node.op == "call_function" and node.target is F.dropout:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        if not isinstance(p, (int, float)) or any(isinstance(a, fx.Node) for a in node.args[1:]):
            return node, NotDetected("a dropout whose rate is computed at run time")
        return node.args[0], float(p)
    return node, 0.0


def _peel_scale(node: Any) -> tuple[Any, float | None]:
    """``t * c`` or ``c * t`` with a constant ``c`` -> ``(t, c)``; anything else -> ``(node, None)``."""
    if not isinstance(node, fx.Node):
        return node, None
    is_mul = (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or (
        node.op == "call_method" and node.target == "mul")
    if is_mul and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
            return a, float(b)
        if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
            return b, float(a)
    return node, None


def _module_call(node: Any) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "call_module" else None


def _mul_operands(node: Any) -> tuple[fx.Node, fx.Node] | None:
    if not isinstance(node, fx.Node):
        return None
    is_mul = (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or (
        node.op == "call_method" and node.target == "mul"
    )
    if is_mul and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return node.args[0], node.args[1]
    return None


def _activation_of(module: nn.Module, node: fx.Node) -> tuple[str, fx.Node] | None:
    if node.op == "call_module":
        fn = module.get_submodule(node.target)
    elif node.op == "call_function":
        fn = node.target
    else:
        return None
    if len(node.args) != 1 or not isinstance(node.args[0], fx.Node):
        return None
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    name = identify_activation(functools.partial(fn, **node.kwargs) if node.kwargs else fn)
    return (name, node.args[0]) if name else None


def _projections(
    module: nn.Module, linears: dict[str, nn.Linear], x: fx.Node, gate: fx.Node, up: fx.Node, down: str,
    activation: str,
) -> MLPSpec | None:
    down_linear = linears[down]
    gate_name, up_name = _module_call(gate), _module_call(up)
    if gate_name in linears and up_name in linears and gate.args == (x,) and up.args == (x,) and gate_name != up_name:
        g, u = linears[gate_name], linears[up_name]
        if g.weight.shape != u.weight.shape or (g.bias is None) != (u.bias is None):
            return None
        if down_linear.in_features != g.out_features or down_linear.out_features != g.in_features:
            return None
        return MLPSpec(gate_name, up_name, None, down, activation, g.in_features, g.out_features,
                       g.bias is not None, down_linear.bias is not None)
    merged = _chunk_source(gate, up)
    if merged is not None and merged.args == (x,):
        name = _module_call(merged)
        m = linears.get(name)
        if m is None or m.out_features % 2 or down_linear.in_features != m.out_features // 2:
            return None
        return MLPSpec(None, None, name, down, activation, m.in_features, m.out_features // 2,
                       m.bias is not None, down_linear.bias is not None)
    return None


def _chunk_source(gate: fx.Node, up: fx.Node) -> fx.Node | None:
    """The node both are halves of (``gate, up = t.chunk(2, dim=-1)``, gate first), if any."""
    if not all(n.op == "call_function" and n.target is operator.getitem for n in (gate, up)):
        return None
    (gate_src, gate_index), (up_src, up_index) = gate.args, up.args
    if gate_src is not up_src or (gate_index, up_index) != (0, 1) or not isinstance(gate_src, fx.Node):
        return None
    chunk = gate_src
    is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or (
        chunk.op == "call_function" and chunk.target is torch.chunk
    )
    if not is_chunk:
        return None
    chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    return chunk.args[0] if chunks == 2 and dim == -1 else None


# --------------------------------------------------------------------------------------------
# decoder layouts


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
    """How a decoder layer wires norms, attention and MLP around its residual stream."""

    name: str  # "pre_norm", "sandwich" or "post_norm"
    roles: dict[str, str]  # role -> child name
    hidden_param: str  # the forward's hidden-states parameter
    attention_params: tuple[str, ...]  # forward parameters passed on to attention as keywords
    var_keyword: str | None


LAYOUTS: dict[str, tuple[str, ...]] = {
    "pre_norm": ("input_norm", "attention", "post_attention_norm", "mlp"),
    "sandwich": ("input_norm", "attention", "post_attention_norm", "pre_mlp_norm", "mlp", "post_mlp_norm"),
    "post_norm": ("attention", "post_attention_norm", "mlp", "post_mlp_norm"),
}


def run_layout(name: str, modules: dict[str, Callable[..., Any]], hidden: Tensor, attention_kwargs: dict) -> Tensor:
    """The residual computation of a layout (``modules`` by role): the spec fused forwards match."""
    def attend(h: Tensor) -> Tensor:
        return modules["attention"](hidden_states=h, **attention_kwargs)[0]

    if name == "pre_norm":
        hidden = hidden + attend(modules["input_norm"](hidden))
        return hidden + modules["mlp"](modules["post_attention_norm"](hidden))
    if name == "sandwich":
        hidden = hidden + modules["post_attention_norm"](attend(modules["input_norm"](hidden)))
        return hidden + modules["post_mlp_norm"](modules["mlp"](modules["pre_mlp_norm"](hidden)))
    hidden = hidden + modules["post_attention_norm"](attend(hidden))
    return hidden + modules["post_mlp_norm"](modules["mlp"](hidden))


class _StandIn(nn.Module):
    """Replaces one child during a probe: a fixed nonlinear map, recording how it was called."""

    def __init__(self, name: str, hidden: int, is_norm: bool, calls: list, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.name, self.is_norm, self.calls = name, is_norm, calls
        self.scale = torch.randn(hidden, generator=g, dtype=torch.float64)
        self.mix = torch.randn(hidden, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs.get("hidden_states")
        self.calls.append((self.name, len(args), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        if self.is_norm:
            return torch.tanh(x * self.scale + 0.1)
        out = torch.sin(x @ self.mix)
        attention_like = "hidden_states" in kwargs or len(kwargs) > 0
        return (out, None) if attention_like else out


def looks_like_decoder_layer(layer: nn.Module, norms: set[str]) -> bool:
    """Norms beside at least two composite modules (attention, MLP): not a whole model, not an attention."""
    composite = [
        child for name, child in layer.named_children()
        if name not in norms and not isinstance(child, (nn.Linear, nn.Embedding, nn.ModuleList, nn.ModuleDict))
        and any(True for _ in child.parameters())
    ]
    return bool(norms) and len(composite) >= 2


def detect_decoder_layout(layer: nn.Module, norms: set[str], hidden_size: int) -> DecoderLayout | NotDetected:
    """Which residual layout ``layer``'s forward implements, by running it on stand-ins."""
    parameterised = [name for name, child in layer.named_children() if any(True for _ in child.parameters())]
    if not norms or not parameterised:
        return NotDetected("no norms among its children")
    signature = inspect.signature(type(layer).forward)
    params = list(signature.parameters.values())[1:]
    if not params:
        return NotDetected("its forward takes no arguments")
    hidden_param = params[0].name
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    named = tuple(p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    calls: list = []
    stand_ins = {
        name: _StandIn(name, hidden_size, name in norms, calls, seed=i)
        for i, name in enumerate(parameterised)
    }
    originals = {name: getattr(layer, name) for name in parameterised}
    hidden = torch.randn(3, 5, hidden_size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    try:
        for name, stand_in in stand_ins.items():
            setattr(layer, name, stand_in)
        with torch.no_grad():
            try:
                expected = layer(hidden)
            except Exception as err:
                return NotDetected(f"its forward fails on stand-ins ({type(err).__name__}: {err})")
        order = [name for name, _, _ in calls]
        kinds = ["norm" if name in norms else "module" for name in order]
        layout = _match_layout(kinds)
        if layout is None:
            return NotDetected(f"calls its children in an unrecognised order: {order}")
        roles = dict(zip(LAYOUTS[layout], order))
        attention_call = calls[order.index(roles["attention"])]
        mlp_call = calls[order.index(roles["mlp"])]
        if mlp_call[1] != 1 or mlp_call[2]:
            return NotDetected("its MLP is called with more than the hidden states")
        defaults = {p.name: p.default for p in params[1:] if p.name in named}
        if attention_call[2] != {k: v for k, v in defaults.items()}:
            return NotDetected("passes attention arguments other than its own (see the layer's forward)")
        calls.clear()
        with torch.no_grad():
            got = run_layout(layout, {role: stand_ins[name] for role, name in roles.items()}, hidden, defaults)
        if not (isinstance(expected, Tensor) and expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-12, atol=1e-12)):
            return NotDetected(f"calls its children like a {layout} layer but combines them differently "
                               "(e.g. a scaled residual)")
        return DecoderLayout(layout, roles, hidden_param, named, var_keyword)
    finally:
        for name, original in originals.items():
            setattr(layer, name, original)


def _match_layout(kinds: list[str]) -> str | None:
    for name, roles in LAYOUTS.items():
        expected = ["norm" if role.endswith("norm") else "module" for role in roles]
        if kinds == expected:
            return name
    return None


# --------------------------------------------------------------------------------------------
# linears reading one input


def detect_shared_inputs(model: nn.Module, run: Callable[[], Any]) -> list[tuple[str, list[str]]]:
    """Groups of sibling linears that read the same tensor during ``run()``: ``[(parent, [names])]``.

    Groups are listed in the order their members are called in.
    """
    seen: dict[tuple[str, int], list[str]] = defaultdict(list)
    keep_alive: list[Tensor] = []  # ids stay unique only while the tensors live
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parent, _, name = path.rpartition(".")

            def record(mod: nn.Module, args: tuple, parent: str = parent, name: str = name) -> None:
                if args and isinstance(args[0], Tensor):
                    keep_alive.append(args[0])
                    if name not in seen[(parent, id(args[0]))]:
                        seen[(parent, id(args[0]))].append(name)

            handles.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    groups, reported = [], set()
    for (parent, _), names in seen.items():
        if len(names) > 1 and (parent, tuple(names)) not in reported:
            reported.add((parent, tuple(names)))
            groups.append((parent, names))
    return groups
