"""``rewire(model)``: move an already-built Hugging Face model onto hw_agnostic layers, in place.

1. Every module that computes an RMS norm becomes :class:`~hw_agnostic.layers.RMSNorm` (sharing
   the module's weight: nothing is copied), with the eps and numerics read from that instance.
2. Every module that computes ``down(act(gate(x)) * up(x))`` becomes a
   :class:`~hw_agnostic.layers.GatedMLP` with one merged gate/up weight (built one layer at a time,
   so only one layer's gate and up weights exist twice, briefly); the down projection is reused.
3. Three sibling linears that read the same tensor (q, k, v) get one merged projection.
   Self-attention modules become paged-attention layers: K/V go to a paged cache through
   ``write_kv_cache`` and attention runs in ``paged_attention``, for ``generate()`` and
   continuous batching alike.
4. Decoder layers with a pre-norm or sandwich-norm residual layout get a forward that runs the
   residual add and the next norm as one ``fused_add_rms_norm``.
5. Mixture-of-experts layers run their experts with ``fused_experts`` (through transformers'
   ``ExpertsInterface``) and their routers with ``moe_route``.

The classes built are the ones :func:`hw_agnostic.layers.resolve` returns, so an out-of-tree
plugin's replacements are what ends up in the model. Anything not understood is left as it was
and listed in the report with the reason; when the weights are real (not on meta), each
replacement is run against the module it replaces on a small input first and kept only if they
agree within the tolerance table.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..layers import CustomOp, PagedAttention, PluggableLayer, RMSNorm, resolve
from ..tolerances import mismatch
from .attention import enable_paged_attention
from .decoder import FUSABLE, install_fused_forward
from .experts import enable_fused_experts
from .detect import (
    MLPSpec,
    NormSpec,
    NotDetected,
    detect_decoder_layout,
    detect_gated_mlp,
    detect_rms_norm,
    detect_shared_inputs,
    looks_like_decoder_layer,
    looks_like_mlp,
)
from .report import RewireReport

log = logging.getLogger(__name__)


def rewire(
    model: nn.Module,
    *,
    merge_qkv: bool = True,
    attention: bool = True,
    fuse: bool = True,
    experts: bool = True,
    verify: bool = True,
    verbose: bool = False,
    probe: Callable[[], Any] | None = None,
) -> RewireReport:
    """Rewire ``model`` in place and return what was done.

    Args:
        merge_qkv: merge q/k/v projections (needs one probe forward of the model, see ``probe``).
        attention: run self-attention with ``write_kv_cache`` + ``paged_attention`` over a paged
            cache (see :mod:`hw_agnostic.backend.attention`).
        fuse: fuse residual adds into the following norm in recognised decoder layers.
        experts: run mixture-of-experts layers with ``fused_experts`` and their routers with
            ``moe_route`` (see :mod:`hw_agnostic.backend.experts`).
        verify: run each replacement against the module it replaces first (skipped on meta).
        verbose: print the report as a table.
        probe: runs one forward of ``model`` for the q/k/v dataflow probe; by default a 4-token
            ``model(input_ids=...)`` call.
    """
    report = RewireReport()
    replaced: set[str] = set()
    for path, module in list(model.named_modules()):
        if not path or any(path.startswith(done + ".") for done in replaced):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        new = _replacement(path, module, report, verify)
        if new is not None:
            setattr(parent, name, new)
            replaced.add(path)
    if merge_qkv:
        _merge_qkv(model, report, probe or _default_probe(model), verify)
    if attention:
        _page_attention(model, report)
    if fuse:
        _fuse_decoder_layers(model, report)
    if experts:
        enable_fused_experts(model, verify=verify, report=report)
    if verbose:
        print(report.table())
    return report


# --------------------------------------------------------------------------------------------
# norms and MLPs


def _replacement(path: str, module: nn.Module, report: RewireReport, verify: bool) -> nn.Module | None:
    if isinstance(module, (CustomOp, PluggableLayer)):
        return None  # ours already (or a plugin's)
    norm = detect_rms_norm(module)
    if isinstance(norm, NormSpec):
        return _checked(path, module, build_norm(module, norm), report, verify, _describe_norm(norm))
    if isinstance(norm, NotDetected):
        report.add("left", path, module, detail=norm.reason)
        return None
    mlp = detect_gated_mlp(module)
    if isinstance(mlp, MLPSpec):
        return _checked(path, module, build_mlp(module, mlp), report, verify, _describe_mlp(mlp))
    if isinstance(mlp, NotDetected) and looks_like_mlp(module):
        report.add("left", path, module, detail=mlp.reason)
    return None


def _describe_norm(spec: NormSpec) -> str:
    weight = f"weight '{spec.weight_name}'" if spec.weight_name else "no weight"
    return f"eps={spec.eps:g}, numerics={spec.numerics}, {weight}"


def _describe_mlp(spec: MLPSpec) -> str:
    source = f"gate_up={spec.gate_up}" if spec.gate_up else f"gate={spec.gate}, up={spec.up}"
    return (f"{source}, down={spec.down}, act={spec.activation}, "
            f"{spec.hidden_size}->{spec.intermediate_size}" + (", bias" if spec.bias else ""))


def build_norm(module: nn.Module, spec: NormSpec) -> nn.Module:
    weight = getattr(module, spec.weight_name) if spec.weight_name else None
    return resolve("rms_norm")(spec.hidden_size, spec.eps, spec.numerics, has_weight=weight is not None,
                               weight=weight)


def build_mlp(module: nn.Module, spec: MLPSpec) -> nn.Module:
    down: nn.Linear = getattr(module, spec.down)
    if spec.gate_up:
        merged: nn.Linear = getattr(module, spec.gate_up)
        weight, bias = merged.weight, merged.bias
    else:
        gate, up = getattr(module, spec.gate), getattr(module, spec.up)
        with torch.no_grad():
            weight = torch.cat([gate.weight, up.weight], dim=0)
            bias = torch.cat([gate.bias, up.bias]) if spec.bias else None
    layer = resolve("gated_mlp")(
        spec.hidden_size, spec.intermediate_size, spec.activation, bias=spec.bias, down_bias=spec.down_bias,
        device="meta", dtype=down.weight.dtype,
    )
    state = {"gate_up_proj.weight": weight, "down_proj.weight": down.weight}
    if spec.bias:
        state["gate_up_proj.bias"] = bias
    if spec.down_bias:
        state["down_proj.bias"] = down.bias
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def _checked(
    path: str, original: nn.Module, new: nn.Module, report: RewireReport, verify: bool, detail: str
) -> nn.Module | None:
    if verify:
        problem = _disagreement(original, new)
        if problem is not None:
            report.add("left", path, original, detail=f"replacement disagreed: {problem}")
            return None
    report.add("replaced", path, original, type(new).__name__, detail)
    return new


def _disagreement(original: nn.Module, new: nn.Module) -> str | None:
    weight = next(iter(original.parameters()), None)
    if weight is None or weight.is_meta:
        return None
    hidden = new.hidden_size
    x = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(hidden)).to(weight.device, weight.dtype)
    with torch.no_grad():
        want, got = original(x), new(x)
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


def _merge_qkv(model: nn.Module, report: RewireReport, probe: Callable[[], Any], verify: bool) -> None:
    try:
        groups = detect_shared_inputs(model, probe)
    except Exception as err:
        report.add("left", "", model, detail=f"q/k/v not merged: the probe forward failed ({type(err).__name__}: {err})")
        return
    for parent_path, names in groups:
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
        if verify and not linears[0].weight.is_meta:
            x = torch.randn(2, linears[0].in_features, generator=torch.Generator().manual_seed(3))
            x = x.to(linears[0].weight.device, linears[0].weight.dtype)
            with torch.no_grad():
                problems = [mismatch(part, l(x).double(), x.dtype) for part, l in zip(merged(x), linears)]
            if any(problems):
                report.add("left", path, linears[0], detail=f"merged projection disagreed: {problems}")
                continue
        parent.qkv_proj = merged
        for name, part in zip(names, merged.parts()):
            setattr(parent, name, part)
        report.add("replaced", path, linears[0], type(merged).__name__,
                   f"{'+'.join(names)} -> qkv_proj, sizes {merged.sizes}")


def _build_qkv(linears: list[nn.Linear]) -> nn.Module:
    first = linears[0]
    has_bias = first.bias is not None
    layer = resolve("qkv_projection")(first.in_features, tuple(l.out_features for l in linears), bias=has_bias,
                                      device="meta", dtype=first.weight.dtype)
    with torch.no_grad():
        state = {"proj.weight": torch.cat([l.weight for l in linears]).detach()}
        if has_bias:
            state["proj.bias"] = torch.cat([l.bias for l in linears]).detach()
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


# --------------------------------------------------------------------------------------------
# decoder layers


def _fuse_decoder_layers(model: nn.Module, report: RewireReport) -> None:
    for path, layer in model.named_modules():
        norms = {name for name, child in layer.named_children() if isinstance(child, RMSNorm)}
        if not looks_like_decoder_layer(layer, norms) or hasattr(layer, "_hw_agnostic_original_forward"):
            continue
        hidden = next(getattr(layer, n).hidden_size for n in norms)
        layout = detect_decoder_layout(layer, norms, hidden)
        if isinstance(layout, NotDetected):
            report.add("left", path, layer, detail=f"not fused: {layout.reason}")
            continue
        attention = layout.roles["attention"]
        if not isinstance(getattr(layer, attention), PagedAttention):
            report.add("left", f"{path}.{attention}", getattr(layer, attention),
                       detail="attention runs as the model defines it")
        if layout.name not in FUSABLE:
            report.add("left", path, layer, detail=f"{layout.name} layout: no norm follows a residual add")
            continue
        params = inspect.signature(type(layer).forward).parameters
        defaults = {name: params[name].default for name in layout.attention_params}
        install_fused_forward(layer, layout, defaults)
        fused_norm = layout.roles["post_attention_norm" if layout.name == "pre_norm" else "pre_mlp_norm"]
        report.add("fused", path, layer, layout.name, f"residual add + {fused_norm} -> fused_add_rms_norm")


def _page_attention(model: nn.Module, report: RewireReport) -> None:
    originals = {path: type(module) for path, module in model.named_modules()}
    for path in enable_paged_attention(model):
        report.add("replaced", path, originals[path], type(model.get_submodule(path)).__name__,
                   "K/V in a paged cache: write_kv_cache + paged_attention")
