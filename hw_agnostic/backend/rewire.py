"""``rewire(model)``: move an already-built Hugging Face model onto hw_agnostic layers, in place.

Rewiring walks one ordered list of rules (:data:`RULES`). Each finds what modules compute (never
what they are called), builds the replacement from :func:`hw_agnostic.layers.resolve` (so an
out-of-tree plugin's class is what ends up in the model), and returns it as an applied
:class:`~hw_agnostic.backend.changes.Change`; what a rule cannot serve goes to the report with the
reason:

1. ``norms_and_mlps``: RMS norms become :class:`~hw_agnostic.layers.RMSNorm`, layer norms
   :class:`~hw_agnostic.layers.LayerNorm`, gated RMS norms :class:`~hw_agnostic.layers.GatedRMSNorm`
   (each sharing the module's parameters), gated MLPs ``down(act(gate(x)) * up(x))`` a :class:`~hw_agnostic.layers.GatedMLP` with one
   merged gate/up weight.
2. ``qkv``: three sibling linears that read the same tensor get one merged projection.
3. ``attention``: self-attention modules become paged-attention layers (``write_kv_cache`` +
   ``paged_attention``, for ``generate()`` and continuous batching alike); ``rotary``: their
   ``apply_rotary_pos_emb`` call runs ``rotary_embedding`` where a probe shows it computes the same
   (:mod:`hw_agnostic.backend.rotary`).
4. ``fused``: decoder layers with a pre-norm or sandwich-norm residual layout run the residual add
   and the next norm as one ``fused_add_rms_norm`` (``fused_add_layer_norm``).
5. ``experts``: mixture-of-experts layers run ``fused_experts`` and their routers ``moe_route``.
6. ``linear``: every remaining ``nn.Linear`` (the output projections, the LM head, whatever no
   rule merged) becomes the library's :class:`~hw_agnostic.layers.Linear` by its class alone:
   parameters, hooks and ties stay where they are, and it computes ``F.linear``'s values bit for
   bit, faster for fp32 CPU calls of a few rows (:mod:`hw_agnostic.ops.linear`).

Each norm, MLP, q/k/v merge and router is first checked alone against the module it replaces.
Then (``verify=True``, the default) the whole model is checked: :mod:`hw_agnostic.backend.verify`
runs the original and the rewired model on a probe (a padded batch's prefill through the model's
own cache, then cached decode steps) and compares logits with the tolerance table; on
disagreement it finds the changes responsible, undoes them, and reports them as left with the
measured error. Merged weights are the only new tensors, and the originals they replace become
views of them, so the original modules are kept (until verified) at no weight memory.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..layers import CustomOp, LayerNorm, Linear, PagedAttention, PluggableLayer, RMSNorm, resolve
from ..ops import checks
from ..tolerances import mismatch
from . import checkpoint
from .attention import paging_changes, register_attention_function
from .changes import Change, swap
from .decoder import (
    FUSABLE,
    attention_call_refusal,
    install_fused_forward,
    link_next_norm,
    remove_fused_forward,
    unlink_next_norm,
)
from .detect import (
    MLPSpec,
    NotDetected,
    detect_decoder_layout,
    detect_gated_mlp,
    detect_shared_inputs,
    looks_like_decoder_layer,
    looks_like_mlp,
)
from .detect_norms import (
    Detections,
    GatedNormSpec,
    LayerNormSpec,
    NormSpec,
    detect_gated_rms_norm,
    detect_layer_norm,
    detect_rms_norm,
)
from .experts import experts_changes, register_experts_implementation
from .report import RewireReport
from .rotary import rotary_changes, settle_rotary
from .verify import Verification

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
    verify: bool
    probe: Callable[[], Any] | None
    block_size: int = 16


#: on a rewired model: its :class:`Registrations`
REGISTRATIONS = "_hw_agnostic_registrations"


class Registrations:
    """Kept on a rewired model for where it is unpickled (``torch.load``, a spawned process): its
    configs name our attention function and experts implementation, which transformers looks up
    in its registries, and a process that loads the model has imported nothing that registers them.
    Unpickling this registers them (before any forward: it is made while the model loads)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _registered, ()


def _registered() -> Registrations:
    register_attention_function()
    register_experts_implementation()
    return Registrations()


def rewire(
    model: nn.Module,
    *,
    merge_qkv: bool = True,
    attention: bool = True,
    rotary: bool = True,
    fuse: bool = True,
    experts: bool = True,
    linears: bool = True,
    verify: bool = True,
    verbose: bool = False,
    probe: Callable[[], Any] | None = None,
    changes: list[Change] | None = None,
) -> RewireReport:
    """Rewire ``model`` in place and return what was done.

    Args:
        merge_qkv: merge q/k/v projections (needs one probe forward of the model, see ``probe``).
        attention: run self-attention with ``write_kv_cache`` + ``paged_attention`` over a paged
            cache (see :mod:`hw_agnostic.backend.attention`).
        rotary: in those paged modules, run the model's ``apply_rotary_pos_emb`` as ``rotary_embedding``
            where it computes the same (see :mod:`hw_agnostic.backend.rotary`).
        fuse: fuse residual adds into the following norm in recognised decoder layers.
        experts: run mixture-of-experts layers with ``fused_experts`` and their routers with
            ``moe_route`` (see :mod:`hw_agnostic.backend.experts`).
        linears: make the remaining ``nn.Linear`` modules :class:`~hw_agnostic.layers.Linear` (rule 6).
        verify: check each replacement against the module it replaces, then the whole rewired model
            against the original (see :mod:`hw_agnostic.backend.verify`), undoing what disagrees.
            With weights on the meta device this happens on the first forward with real weights.
        verbose: print the report as a table.
        probe: runs one forward of ``model`` for the q/k/v dataflow probe; by default a 4-token
            ``model(input_ids=...)`` call.
        changes: changes already made to ``model`` (the construction-time path), verified with the rest.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"rewire: model must be a torch.nn.Module, got {type(model).__name__}")
    switches = dict(merge_qkv=merge_qkv, attention=attention, rotary=rotary, fuse=fuse, experts=experts,
                    linears=linears, verify=verify, verbose=verbose)
    for name, value in switches.items():
        checks.flag("rewire", name, value)
    if probe is not None and not callable(probe):
        raise TypeError(f"rewire: probe must be a callable running one forward of the model, "
                        f"got {type(probe).__name__}")
    report = RewireReport()
    prior = list(changes or [])
    verification = Verification(model, prior) if verify else None
    options = Options(verify=verify, probe=probe)
    enabled = {"norms_and_mlps": True, "qkv": merge_qkv, "attention": attention, "rotary": attention and rotary,
               "fused": fuse, "experts": experts, "linear": linears}
    made = list(prior)
    for name, rule in RULES:
        if enabled[name]:
            made += rule(model, report, options)
    if verification is not None:
        verification.settle(made, report)
        settle_rotary(made, report)
    finish(model, made, report, verification)
    model.__dict__[REGISTRATIONS] = Registrations()
    if verbose:
        print(report.table())
    return report


def finish(model: nn.Module, made: list[Change], report: RewireReport,
           verification: Verification | None) -> None:
    """Report what stands, make ``save_pretrained`` write the original keys and ``load_state_dict`` take them,
    release the originals."""
    converters: list[Any] = []
    for change in made:
        if change.active:
            report.add("fused" if change.kind == "fused" else "replaced", change.path, change.original,
                       change.result, change.detail)
            converters += change.converters
    checkpoint.install_weight_conversions(model, converters)
    checkpoint.take_original_keys(model, converters)
    if verification is None or verification.done:
        for change in made:
            change.release()


# --------------------------------------------------------------------------------------------
# norms and MLPs


def _norms_and_mlps(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    made: list[Change] = []
    replaced: set[str] = set()
    detections = Detections()
    for path, module in list(model.named_modules()):
        if not path or any(path.startswith(done + ".") for done in replaced):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        change = _replacement(parent, name, path, module, report, options.verify, detections)
        if change is not None:
            made.append(change)
            replaced.add(path)
    return made


def _replacement(parent: nn.Module, name: str, path: str, module: nn.Module, report: RewireReport,
                 verify: bool, detections: Detections) -> Change | None:
    if isinstance(module, (CustomOp, PluggableLayer)):
        return None  # ours already (or a plugin's)
    reasons: list[str] = []
    for detect, build, describe in _NORMS:
        spec = detections(detect, module)
        if isinstance(spec, NotDetected):
            reasons.append(spec.reason)
        elif spec is not None:
            new = build(module, spec).train(module.training)
            problem = _disagreement(module, new, gated=isinstance(spec, GatedNormSpec)) if verify else None
            if problem is not None:
                report.add("left", path, module, detail=f"replacement disagreed: {problem}")
                return None
            return Change("norm", path, type(module).__name__, type(new).__name__, describe(spec),
                          *swap(parent, name, new))
    if reasons:
        report.add("left", path, module, detail="; ".join(dict.fromkeys(reasons)))
        return None
    mlp = detect_gated_mlp(module)
    if isinstance(mlp, MLPSpec):
        new = build_mlp(module, mlp).train(module.training)  # a fresh module is in training mode
        problem = _disagreement(module, new) if verify else None
        if problem is not None:
            report.add("left", path, module, detail=f"replacement disagreed: {problem}")
            return None
        share_merged_mlp_weights(module, mlp, new)
        return Change("mlp", path, type(module).__name__, type(new).__name__, _describe_mlp(mlp),
                      *swap(parent, name, new), converters=tuple(mlp_converters(path, mlp)))
    if looks_like_mlp(module):
        reason = mlp.reason if isinstance(mlp, NotDetected) else "children other than linears hold parameters"
        report.add("left", path, module, detail=reason)
    return None


def _describe_norm(spec: NormSpec) -> str:
    weight = f"weight '{spec.weight_name}'" if spec.weight_name else "no weight"
    return f"eps={spec.eps:g}, numerics={spec.numerics}, {weight}"


def _describe_mlp(spec: MLPSpec) -> str:
    source = f"gate_up={spec.gate_up}" if spec.gate_up else f"gate={spec.gate}, up={spec.up}"
    factors = "".join(f", {name}={value:g}" for name, value in (("gate x", spec.gate_multiplier),
                      ("up x", spec.up_multiplier), ("down x", spec.down_multiplier)) if value is not None)
    act = spec.activation + (f"(alpha={spec.swiglu_alpha:g}, limit={spec.swiglu_limit:g})"
                             if spec.activation == "swiglu_oai" else "")
    return (f"{source}, down={spec.down}, act={act}, {spec.hidden_size}->{spec.intermediate_size}"
            + (", bias" if spec.bias else "") + factors + (f", dropout {spec.dropout:g}" if spec.dropout else ""))


def build_norm(module: nn.Module, spec: NormSpec) -> nn.Module:
    weight = getattr(module, spec.weight_name) if spec.weight_name else None
    return resolve("rms_norm")(spec.hidden_size, spec.eps, spec.numerics, has_weight=weight is not None,
                               weight=weight)


def build_layer_norm(module: nn.Module, spec: LayerNormSpec) -> nn.Module:
    weight = getattr(module, spec.weight_name) if spec.weight_name else None
    bias = getattr(module, spec.bias_name) if spec.bias_name else None
    return resolve("layer_norm")(spec.hidden_size, spec.eps, spec.numerics, has_weight=weight is not None,
                                 has_bias=bias is not None, num_heads=spec.num_heads, weight=weight, bias=bias)


def build_gated_norm(module: nn.Module, spec: GatedNormSpec) -> nn.Module:
    weight = getattr(module, spec.weight_name) if spec.weight_name else None
    return resolve("gated_rms_norm")(spec.hidden_size, spec.eps, order=spec.order, group_size=spec.group_size,
                                     numerics=spec.numerics, activation=spec.activation,
                                     has_weight=weight is not None, weight=weight)


def _describe_layer_norm(spec: LayerNormSpec) -> str:
    parts = [f"weight '{spec.weight_name}'" if spec.weight_name else "no weight",
             f"bias '{spec.bias_name}'" if spec.bias_name else "no bias"]
    heads = f", per head {spec.shape}" if spec.num_heads else ""
    return f"layer norm, eps={spec.eps:g}, numerics={spec.numerics}, {', '.join(parts)}{heads}"


def _describe_gated_norm(spec: GatedNormSpec) -> str:
    groups = f", groups of {spec.group_size}" if spec.group_size else ""
    return (f"gated RMS norm, {spec.order}, act={spec.activation}, eps={spec.eps:g}, "
            f"numerics={spec.numerics}{groups}")


#: The norm detectors, tried in order: (detect, build, describe).
_NORMS: tuple[tuple[Callable[[nn.Module], Any], Callable[[nn.Module, Any], nn.Module], Callable[[Any], str]], ...] = (
    (detect_rms_norm, build_norm, _describe_norm),
    (detect_layer_norm, build_layer_norm, _describe_layer_norm),
    (detect_gated_rms_norm, build_gated_norm, _describe_gated_norm),
)


def build_mlp(module: nn.Module, spec: MLPSpec) -> nn.Module:
    down: nn.Linear = getattr(module, spec.down)
    if spec.gate_up:
        merged: nn.Linear = getattr(module, spec.gate_up)
        weight, bias = merged.weight, merged.bias
    else:
        gate, up = getattr(module, spec.gate), getattr(module, spec.up)
        with torch.no_grad():
            weight = nn.Parameter(torch.cat([gate.weight, up.weight], dim=0), requires_grad=gate.weight.requires_grad)
            bias = nn.Parameter(torch.cat([gate.bias, up.bias]), requires_grad=gate.bias.requires_grad) \
                if spec.bias else None
    layer = resolve("gated_mlp")(
        spec.hidden_size, spec.intermediate_size, spec.activation, bias=spec.bias, down_bias=spec.down_bias,
        gate_multiplier=spec.gate_multiplier, up_multiplier=spec.up_multiplier, down_multiplier=spec.down_multiplier,
        dropout=spec.dropout, swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit, device="meta",
        dtype=down.weight.dtype,
    )
    state = {"gate_up_proj.weight": weight, "down_proj.weight": down.weight}
    if spec.bias:
        state["gate_up_proj.bias"] = bias
    if spec.down_bias:
        state["down_proj.bias"] = down.bias
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def share_merged_mlp_weights(module: nn.Module, spec: MLPSpec, layer: nn.Module) -> None:
    """Make the original gate/up weights views of the merged one: one copy of the weights, two modules."""
    if spec.gate_up:
        return
    inter = spec.intermediate_size
    for suffix in ("weight", "bias") if spec.bias else ("weight",):
        merged = getattr(layer.gate_up_proj, suffix)
        getattr(module, spec.gate)._parameters[suffix].data = merged.data[:inter]
        getattr(module, spec.up)._parameters[suffix].data = merged.data[inter:]


def mlp_converters(path: str, spec: MLPSpec) -> list[Any]:
    converters: list[Any] = []
    suffixes = ("weight", "bias") if spec.bias else ("weight",)
    if spec.gate_up is None:
        inter = spec.intermediate_size
        for suffix in suffixes:
            converters += checkpoint.merged(path, [f"{spec.gate}.{suffix}", f"{spec.up}.{suffix}"],
                                            f"gate_up_proj.{suffix}", (inter, inter))
    else:
        converters += checkpoint.renamed(path, spec.gate_up, "gate_up_proj")
    converters += checkpoint.renamed(path, spec.down, "down_proj")
    return converters


def _disagreement(original: nn.Module, new: nn.Module, *, gated: bool = False) -> str | None:
    weight = next(iter(original.parameters()), None)
    if weight is not None and weight.is_meta:
        return None
    device, dtype = (weight.device, weight.dtype) if weight is not None else ("cpu", torch.float32)
    heads = getattr(new, "num_heads", None)
    shape = (2, 3, new.hidden_size) if heads is None else (2, 3, heads, new.hidden_size)
    g = torch.Generator().manual_seed(new.hidden_size)
    inputs = [torch.randn(*shape, generator=g).to(device, dtype) for _ in range(2 if gated else 1)]
    with torch.no_grad():
        want, got = original(*inputs), new(*inputs)
    if want.dtype != got.dtype:
        return f"dtype {got.dtype} instead of {want.dtype}"
    return mismatch(got, want.double(), want.dtype)


# --------------------------------------------------------------------------------------------
# q/k/v


def _default_probe(model: nn.Module) -> Callable[[], Any]:
    def run() -> Any:
        param = next(model.parameters())
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
        ids = torch.arange(4, device=param.device).remainder(vocab)[None]
        return model(input_ids=ids, use_cache=False)

    return run


_QKV_NAMES = ("q_proj", "k_proj", "v_proj")


def _qkv(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    try:
        groups = detect_shared_inputs(model, options.probe or _default_probe(model))
    except Exception as err:
        report.add("left", "", model, detail=f"q/k/v not merged: the probe forward failed ({type(err).__name__}: {err})")
        return []
    made: list[Change] = []
    for parent_path, names in groups:
        if len(names) > 3 and set(_QKV_NAMES) <= set(names):
            names = list(_QKV_NAMES)  # an attention's q/k/v among more projections of its input (LFM3's head gate)
        parent = model.get_submodule(parent_path)
        linears = [getattr(parent, n) for n in names]
        path = f"{parent_path}.{{{','.join(names)}}}"
        if len(names) != 3 or not all(isinstance(l, nn.Linear) for l in linears):
            continue
        if len({l.in_features for l in linears}) != 1 or len({l.bias is None for l in linears}) != 1:
            report.add("left", path, linears[0], detail="read one input but differ in width or bias")
            continue
        if hasattr(parent, "qkv_proj"):
            report.add("left", path, linears[0], detail="the module already has a 'qkv_proj' attribute")
            continue
        merged = _build_qkv(linears)
        if options.verify and not linears[0].weight.is_meta:
            x = torch.randn(2, linears[0].in_features, generator=torch.Generator().manual_seed(3))
            x = x.to(linears[0].weight.device, linears[0].weight.dtype)
            with torch.no_grad():
                problems = [mismatch(part, l(x).double(), x.dtype) for part, l in zip(merged(x), linears)]
            if any(problems):
                report.add("left", path, linears[0], detail=f"merged projection disagreed: {problems}")
                continue
        made.append(_merge_qkv(parent, parent_path, names, linears, merged))
    return made


def _merge_qkv(parent: nn.Module, parent_path: str, names: list[str], linears: list[nn.Linear],
               merged: nn.Module) -> Change:
    parts = merged.parts()
    start = 0
    for linear, size in zip(linears, merged.sizes):  # the originals become views of the merged weight
        linear._parameters["weight"].data = merged.proj.weight.data[start:start + size]
        if linear.bias is not None:
            linear._parameters["bias"].data = merged.proj.bias.data[start:start + size]
        start += size

    def apply() -> None:
        parent.qkv_proj = merged
        for name, part in zip(names, parts):
            setattr(parent, name, part)

    def undo() -> None:
        for name, linear in zip(names, linears):
            setattr(parent, name, linear)
        del parent.qkv_proj

    apply()
    sizes = tuple(merged.sizes)
    converters = checkpoint.merged(parent_path, [f"{n}.weight" for n in names], "qkv_proj.proj.weight", sizes)
    if linears[0].bias is not None:
        converters += checkpoint.merged(parent_path, [f"{n}.bias" for n in names], "qkv_proj.proj.bias", sizes)
    return Change("qkv", f"{parent_path}.{{{','.join(names)}}}", type(linears[0]).__name__, type(merged).__name__,
                  f"{'+'.join(names)} -> qkv_proj, sizes {merged.sizes}", apply, undo, converters=tuple(converters))


def _build_qkv(linears: list[nn.Linear]) -> nn.Module:
    first = linears[0]
    has_bias = first.bias is not None
    layer = resolve("qkv_projection")(first.in_features, tuple(l.out_features for l in linears), bias=has_bias,
                                      device="meta", dtype=first.weight.dtype)
    with torch.no_grad():
        grad = first.weight.requires_grad
        state = {"proj.weight": nn.Parameter(torch.cat([l.weight for l in linears]), requires_grad=grad)}
        if has_bias:
            state["proj.bias"] = nn.Parameter(torch.cat([l.bias for l in linears]), requires_grad=grad)
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


# --------------------------------------------------------------------------------------------
# attention, decoder layers, experts


def _attention(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    made, left = paging_changes(model, block_size=options.block_size)
    for path, module, reason in left:
        report.add("left", path, module, detail=f"attention runs as the model defines it: {reason}")
    return made


def _rotary(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    made, left = rotary_changes(model)
    for path, module, reason in left:
        report.add("left", path, module, detail=reason)
    return made


def _fused(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    made: list[Change] = []
    input_norms: dict[nn.Module, str] = {}  # fused layer -> the child name of its input norm
    for path, layer in model.named_modules():
        norms = {name for name, child in layer.named_children() if isinstance(child, (RMSNorm, LayerNorm))}
        if not looks_like_decoder_layer(layer, norms) or "forward" in layer.__dict__:
            continue
        hidden = next(getattr(layer, n).hidden_size for n in norms)
        layout = detect_decoder_layout(layer, norms, hidden)
        if isinstance(layout, NotDetected):
            report.add("left", path, layer, detail=f"not fused: {layout.reason}")
            continue
        if layout.name not in FUSABLE:
            report.add("left", path, layer, detail=f"{layout.name} layout: no norm follows a residual add")
            continue
        refusal = attention_call_refusal(getattr(layer, layout.roles["attention"]), layout)
        if refusal is not None:
            report.add("left", path, layer, detail=f"not fused: {refusal}")
            continue
        params = inspect.signature(type(layer).forward).parameters
        defaults = {name: params[name].default for name in layout.attention_params}
        fused_norm = layout.roles["post_attention_norm" if layout.name == "pre_norm" else "pre_mlp_norm"]

        def apply(layer: nn.Module = layer, layout: Any = layout, defaults: dict = defaults) -> None:
            install_fused_forward(layer, layout, defaults)

        def undo(layer: nn.Module = layer) -> None:
            remove_fused_forward(layer)

        apply()
        op = "fused_add_layer_norm" if isinstance(getattr(layer, fused_norm), LayerNorm) else "fused_add_rms_norm"
        made.append(Change("fused", path, type(layer).__name__, layout.name,
                           f"residual add + {fused_norm} -> {op}", apply, undo))
        input_norms[layer] = layout.roles["input_norm"]
    return made + _next_norm_links(model, input_norms)


def _next_norm_links(model: nn.Module, input_norms: dict[nn.Module, str]) -> list[Change]:
    """Each fused layer of a layer list linked to the norm that reads its output next: the next
    layer's input norm, and after the last layer the list's owner's one norm of that width (the
    model's final norm); see :func:`~hw_agnostic.backend.decoder.hand_off` for what makes it safe."""
    made: list[Change] = []
    for owner_path, owner in model.named_modules():
        for list_name, layers in owner.named_children():
            if not isinstance(layers, nn.ModuleList):
                continue
            prefix = f"{owner_path}.{list_name}" if owner_path else list_name
            children = list(layers._modules.items())
            for n, (name, layer) in enumerate(children):
                if layer not in input_norms:
                    continue
                if n + 1 < len(children):
                    parent, norm = children[n + 1][1], input_norms.get(children[n + 1][1])
                    where = f"{prefix}.{children[n + 1][0]}.{norm}"
                else:
                    width = layer._modules[input_norms[layer]].hidden_size
                    finals = [child for child, module in owner.named_children()
                              if isinstance(module, (RMSNorm, LayerNorm)) and module.hidden_size == width]
                    parent, norm = owner, finals[0] if len(finals) == 1 else None
                    where = f"{owner_path}.{norm}" if owner_path else str(norm)
                if norm is None or not isinstance(parent._modules.get(norm), (RMSNorm, LayerNorm)):
                    continue

                def apply(layer: nn.Module = layer, parent: nn.Module = parent, norm: str = norm) -> None:
                    link_next_norm(layer, parent, norm)

                def undo(layer: nn.Module = layer, parent: nn.Module = parent, norm: str = norm) -> None:
                    unlink_next_norm(layer, parent, norm)

                apply()
                made.append(Change("fused", f"{prefix}.{name}", type(layer).__name__, "next norm",
                                   f"last residual add + {where} -> one fused add and norm", apply, undo))
    return made


def _experts(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    return experts_changes(model, verify=options.verify, report=report)


def _linears(model: nn.Module, report: RewireReport, options: Options) -> list[Change]:
    """Each module whose class is exactly ``nn.Linear`` gets :class:`~hw_agnostic.layers.Linear` as
    its class. Nothing else about the module changes (its ``__dict__``, so its parameters, ties,
    hooks and an accelerate-wrapped forward), and ``Linear`` adds no state, so the swap is exact and
    undone by swapping back. Subclasses (quantised linears, LoRA layers) are left alone. With a
    plugin's replacement registered for ``"linear"`` nothing is swapped: a class whose ``__init__``
    was never run cannot be put in place."""
    if resolve("linear") is not Linear:
        log.debug("rewire: a plugin replaces 'linear'; the model's nn.Linear modules stay as they are")
        return []
    made: list[Change] = []
    for path, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue

        def apply(module: nn.Module = module) -> None:
            module.__class__ = Linear

        def undo(module: nn.Module = module) -> None:
            module.__class__ = nn.Linear

        apply()
        bias = ", bias" if module.bias is not None else ""
        made.append(Change("linear", path, "Linear", "hw_agnostic Linear",
                           f"{module.in_features}->{module.out_features}{bias}", apply, undo))
    return made


#: The rules, in the order they run (later rules see what earlier ones built).
RULES: tuple[tuple[str, Callable[[nn.Module, RewireReport, Options], list[Change]]], ...] = (
    ("norms_and_mlps", _norms_and_mlps),
    ("qkv", _qkv),
    ("attention", _attention),
    ("rotary", _rotary),
    ("fused", _fused),
    ("experts", _experts),
    ("linear", _linears),
)

__all__ = ["RULES", "build_mlp", "build_norm", "finish", "rewire"]
