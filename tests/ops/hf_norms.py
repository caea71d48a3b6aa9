"""The Hugging Face norm modules the new norm ops replace, and the op arguments that reproduce each.

Each entry builds the HF module (from transformers 5.24; an entry whose class the installed
transformers lacks is skipped) with random parameters far from their initial values, and says
how to call our op to compute what the module computes. Tests run both on the same inputs and
require the same dtype and, in fp16/bf16, the same bits for almost every element: a cast in the
wrong place changes the rounding of a large share of the elements, which a tolerance alone
would not see.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hw_agnostic import ops


@dataclasses.dataclass(frozen=True)
class HFNorm:
    """One HF module class: how to build it, and what it is in terms of our op."""

    id: str
    # "module:Class", the module relative to transformers.models ("torch.nn:LayerNorm" for torch's);
    # "module:New|Old" where transformers renamed the class (the first the installed version has)
    path: str
    build: Callable[[type, int], nn.Module]
    ours: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]
    gated: bool = False
    #: The input layout the module expects: "rows" [B, S, H] or "heads" [B, S, heads, head_dim].
    layout: str = "rows"

    def __repr__(self) -> str:
        return self.id

    def module_class(self) -> type:
        module_name, class_name = self.path.split(":")
        if not module_name.startswith("torch."):
            family = module_name
            module_name = f"transformers.models.{family}.modeling_{family}"
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            pytest.skip(f"the installed transformers has no {module_name}")
        found = next((getattr(module, name) for name in class_name.split("|") if hasattr(module, name)), None)
        if found is None:
            pytest.skip(f"{module_name} has no {class_name}")
        return found


def _randomise(module: nn.Module, g: torch.Generator) -> nn.Module:
    """Weights far from 1 (and from 0), biases far from 0."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=g)
            parameter.copy_(noise * 1.5 if name.endswith("weight") else noise)
    return module


HEADS, HEAD_DIM = 3, 20


def _weight_bias(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(module, "weight", None), getattr(module, "bias", None)


def _layer_norm(numerics: str = "fp32", eps: str | float = "eps") -> Callable[..., torch.Tensor]:
    def run(module: nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        weight, bias = _weight_bias(module)
        value = eps if isinstance(eps, float) else getattr(module, "variance_epsilon", getattr(module, "eps", 1e-5))
        return ops.layer_norm(x, weight, bias, value, numerics=numerics)

    return run


def _stablelm_per_head(module: nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    # The module takes [B, heads, S, D]; our per-head parameters apply to [..., heads, D].
    weight = torch.stack([norm.weight for norm in module.norms])
    return ops.layer_norm(x.transpose(1, 2), weight, None, module.norms[0].eps).transpose(1, 2)


LAYER_NORMS = [
    HFNorm("nn.LayerNorm", "torch.nn:LayerNorm", lambda cls, h: cls(h, eps=1e-5), _layer_norm()),
    HFNorm("nn.LayerNorm-no-bias", "torch.nn:LayerNorm", lambda cls, h: cls(h, eps=1e-5, bias=False), _layer_norm()),
    HFNorm("nn.LayerNorm-no-affine", "torch.nn:LayerNorm", lambda cls, h: cls(h, eps=1e-5, elementwise_affine=False),
           _layer_norm()),
    HFNorm("CohereLayerNorm", "cohere:CohereLayerNorm", lambda cls, h: cls(h, eps=1e-5), _layer_norm()),
    HFNorm("CohereLayerNorm-qk", "cohere:CohereLayerNorm", lambda cls, h: cls((HEADS, HEAD_DIM), eps=1e-5),
           _layer_norm(), layout="heads"),
    HFNorm("Cohere2LayerNorm", "cohere2:Cohere2LayerNorm", lambda cls, h: cls(h, eps=1e-5), _layer_norm()),
    HFNorm("OlmoLayerNorm", "olmo:OlmoLayerNorm", lambda cls, h: cls(h), _layer_norm(eps=1e-5)),
    HFNorm("NemotronLayerNorm1P", "nemotron:NemotronLayerNorm1P", lambda cls, h: cls(h, eps=1e-5),
           _layer_norm("one_plus")),
    HFNorm("ChameleonLayerNorm-qk", "chameleon:ChameleonLayerNorm", lambda cls, h: cls((HEADS, HEAD_DIM)),
           _layer_norm("cast_then_affine", eps=1e-5), layout="heads"),
    HFNorm("StableLmLayerNormPerHead", "stablelm:StableLmLayerNormPerHead",
           lambda cls, h: cls(HEAD_DIM, HEADS, eps=1e-5), _stablelm_per_head, layout="heads_first"),
]


def _gated(order: str, numerics: str, activation: str = "silu", *, grouped: bool = False,
           falcon: bool = False) -> Callable[..., torch.Tensor]:
    def run(module: nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        group_size = None
        if grouped:
            group_size = module.group_size
        if falcon:
            group_size = x.shape[-1] // module.n_groups
        return ops.gated_rms_norm(
            x, gate, module.weight, module.variance_epsilon,
            order=order if not falcon else ("norm_then_gate" if module.norm_before_gate else "gate_then_norm"),
            group_size=group_size, numerics=numerics,
            activation=getattr(module, "activation", activation),
        )

    return run


_MAMBA = _gated("gate_then_norm", "llama", grouped=True)
_QWEN = _gated("norm_then_gate", "llama")
_KIMI = _gated("norm_then_gate", "fp32_scale")

GATED_NORMS = [
    HFNorm(name, path, lambda cls, h: cls(h, group_size=h // 3, eps=1e-5), _MAMBA, gated=True)
    for name, path in (
        ("MambaRMSNormGated", "mamba2:Mamba2RMSNormGated|MambaRMSNormGated"),  # renamed in 5.25
        ("BambaRMSNormGated", "bamba:BambaRMSNormGated"),
        ("NemotronHRMSNormGated", "nemotron_h:NemotronHRMSNormGated"),
        ("Zamba2RMSNormGated", "zamba2:Zamba2RMSNormGated"),
        ("GraniteMoeHybridRMSNormGated", "granitemoehybrid:GraniteMoeHybridRMSNormGated"),
    )
] + [
    HFNorm("FalconH1RMSNormGated", "falcon_h1:FalconH1RMSNormGated",
           lambda cls, h: cls(h, eps=1e-5, n_groups=3, norm_before_gate=True),
           _gated("", "fp32_scale", falcon=True), gated=True),
    HFNorm("FalconH1RMSNormGated-gate-first", "falcon_h1:FalconH1RMSNormGated",
           lambda cls, h: cls(h, eps=1e-5, n_groups=3, norm_before_gate=False),
           _gated("", "fp32_scale", falcon=True), gated=True),
] + [
    HFNorm(name, path, lambda cls, h: cls(h, eps=1e-5), _QWEN, gated=True)
    for name, path in (
        ("Qwen3NextRMSNormGated", "qwen3_next:Qwen3NextRMSNormGated"),
        ("Qwen3_5RMSNormGated", "qwen3_5:Qwen3_5RMSNormGated"),
        ("Qwen3_5MoeRMSNormGated", "qwen3_5_moe:Qwen3_5MoeRMSNormGated"),
        ("OlmoHybridRMSNormGated", "olmo_hybrid:OlmoHybridRMSNormGated"),
    )
] + [
    HFNorm("Qwen4ExpTextRMSNormGated-sigmoid", "qwen4_exp:Qwen4ExpTextRMSNormGated",
           lambda cls, h: cls(h, eps=1e-5, activation="sigmoid"), _QWEN, gated=True),
] + [
    HFNorm(name, path, lambda cls, h: cls(h, eps=1e-5), _KIMI, gated=True)
    for name, path in (
        ("KimiLinearRMSNormGated", "kimi_linear:KimiLinearRMSNormGated"),
        ("Glm5NextTextRMSNormGated", "glm5_next:Glm5NextTextRMSNormGated"),
        ("BailingHybridRMSNormGated", "bailing_hybrid:BailingHybridRMSNormGated"),
        ("LaraMiniRMSNormGated", "lara_mini:LaraMiniRMSNormGated"),
    )
]


def build(entry: HFNorm, hidden: int, g: torch.Generator) -> nn.Module:
    return _randomise(entry.build(entry.module_class(), hidden), g)


def inputs(entry: HFNorm, hidden: int, dtype: torch.dtype, device: str, g: torch.Generator) -> tuple[Any, ...]:
    if entry.layout in ("heads", "heads_first"):
        shape = (2, 5, HEADS, HEAD_DIM)
    else:
        shape = (2, 5, hidden)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(device=device, dtype=dtype)
    if entry.layout == "heads_first":  # [B, heads, S, D] as attention modules make it: a transposed view
        x = x.transpose(1, 2)
    gate = (torch.randn(shape, generator=g) * 2).to(device=device, dtype=dtype) if entry.gated else None
    return x, gate


def run_module(entry: HFNorm, module: nn.Module, x: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return module(x, gate) if entry.gated else module(x)


def assert_same_rounding(got: torch.Tensor, want: torch.Tensor, *, share: float = 0.01) -> None:
    """Same dtype, and in fp16/bf16 the same bits for all but ``share`` of the elements (each of
    those one rounding step apart at most); in fp32 within 1e-6 relative."""
    from hw_agnostic.tolerances import assert_close

    assert got.dtype == want.dtype, f"dtype {got.dtype}, the HF module returns {want.dtype}"
    assert_close(got, want.double(), want.dtype)
    if want.dtype == torch.float32:
        relative = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert relative <= 1e-6, relative
        return
    differ = (got != want).double().mean().item()
    assert differ <= share, f"{differ:.1%} of the elements round differently from the HF module"


def check_parity(entry: HFNorm, dtype: torch.dtype, provider: str, op: Callable[..., Any]) -> None:
    """Our op (``provider`` forced) against the HF module on one input, at the level of roundings."""
    from tests.conftest import kernel_device
    from tests.harness import seeded_generator

    device = "cpu" if provider == "reference" else kernel_device()
    g = seeded_generator(f"hf-{entry.id}-{dtype}")
    module = build(entry, 60, g).to(device=device, dtype=dtype)
    x, gate = inputs(entry, 60, dtype, device, g)
    want = run_module(entry, module, x, gate)
    with torch.no_grad(), ops.use_provider(provider, op):
        got = entry.ours(module, x, gate)
    assert_same_rounding(got, want)
