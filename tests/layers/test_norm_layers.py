"""LayerNorm and GatedRMSNorm layers: forward vs forward_native, the HF modules they replace, plugins."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hw_agnostic.layers import GatedRMSNorm, LayerNorm, RMSNorm, registered_layers, resolve, unregister_oot
from tests.harness import seeded_generator
from tests.ops import hf_norms


def _randomise(layer: nn.Module, g: torch.Generator) -> nn.Module:
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 1.5)
    return layer


@pytest.mark.parametrize("numerics", ["fp32", "one_plus", "cast_then_affine"])
@pytest.mark.parametrize("parameters", ["both", "weight", "none"])
def test_layer_norm_matches_its_native_forward(numerics, parameters):
    g = seeded_generator(f"ln-layer-{numerics}-{parameters}")
    norm = _randomise(LayerNorm(32, 1e-5, numerics, has_weight=parameters != "none", has_bias=parameters == "both"), g)
    x, residual = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    norm = norm.bfloat16()
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    for got, want in zip(norm(x, residual), norm.forward_native(x, residual)):
        torch.testing.assert_close(got, want)


def test_per_head_layer_norm_and_its_residual_path():
    g = seeded_generator("ln-heads")
    norm = _randomise(LayerNorm(8, num_heads=4, has_bias=False), g)
    assert norm.weight.shape == (4, 8) and norm.bias is None
    x, residual = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    normed, summed = norm(x, residual)
    torch.testing.assert_close(summed, residual + x)
    torch.testing.assert_close(normed, norm.forward_native(residual + x))


@pytest.mark.parametrize("layer", ["rms_norm", "layer_norm"])
def test_a_residual_of_another_dtype_is_added_as_hf_adds_it(layer):
    """Under autocast a bf16 output meets the fp32 residual stream: the sum promotes to fp32, as
    ``residual + x`` does in the HF layer, and the norm reads the promoted sum."""
    g = seeded_generator(f"mixed-{layer}")
    norm = RMSNorm(48) if layer == "rms_norm" else LayerNorm(48)
    x, residual = torch.randn(3, 48, generator=g).bfloat16(), torch.randn(3, 48, generator=g)
    with torch.no_grad():
        normed, summed = norm(x, residual)
        assert summed.dtype == torch.float32 and torch.equal(summed, residual + x)
        assert torch.equal(normed, norm(residual + x))


def test_layer_norm_computes_what_nn_layer_norm_computes_sharing_its_parameters():
    g = seeded_generator("ln-share")
    hf = hf_norms.build(hf_norms.LAYER_NORMS[0], 48, g).bfloat16()
    ours = LayerNorm(48, hf.eps, weight=hf.weight, bias=hf.bias)
    assert ours.weight is hf.weight and ours.bias is hf.bias
    x = (torch.randn(4, 48, generator=g) * 3).bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("entry", [e for e in hf_norms.GATED_NORMS if e.id in (
    "MambaRMSNormGated", "Qwen3NextRMSNormGated", "KimiLinearRMSNormGated", "FalconH1RMSNormGated-gate-first")],
    ids=repr)
def test_gated_rms_norm_layer_computes_what_the_hf_module_computes(entry):
    g = seeded_generator(f"gated-layer-{entry.id}")
    hf = hf_norms.build(entry, 60, g).bfloat16()
    order = "gate_then_norm" if entry.id.startswith(("Mamba", "Falcon")) else "norm_then_gate"
    group_size = getattr(hf, "group_size", None) or (60 // hf.n_groups if hasattr(hf, "n_groups") else None)
    ours = GatedRMSNorm(60, hf.variance_epsilon, order=order, group_size=group_size,
                        numerics="llama" if entry.id.startswith(("Mamba", "Qwen")) else "fp32_scale",
                        activation=getattr(hf, "activation", "silu"), weight=hf.weight)
    x, gate = hf_norms.inputs(entry, 60, torch.bfloat16, "cpu", g)
    with torch.no_grad():
        assert torch.equal(ours(x, gate), hf(x, gate))
        assert torch.equal(ours.forward_native(x, gate), hf(x, gate))


def test_gated_rms_norm_without_a_gate_is_a_grouped_rms_norm():
    g = seeded_generator("gated-nogate")
    norm = _randomise(GatedRMSNorm(12, order="gate_then_norm", group_size=4), g)
    x = torch.randn(5, 12, generator=g)
    groups = x.view(5, 3, 4)
    want = norm.weight * (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + norm.eps)).view(5, 12)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), want)


def test_constructors_check_their_arguments():
    with pytest.raises(ValueError, match="numerics must be one of"):
        LayerNorm(8, numerics="llama")
    with pytest.raises(ValueError, match=r"weight must have shape \(4, 8\)"):
        LayerNorm(8, num_heads=4, weight=nn.Parameter(torch.ones(8)))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        LayerNorm(8, bias=nn.Parameter(torch.ones(9)))
    assert torch.equal(LayerNorm(4, numerics="one_plus").weight, torch.zeros(4))
    with pytest.raises(ValueError, match="order must be one of"):
        GatedRMSNorm(8, order="after")
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedRMSNorm(8, activation="gelu")
    with pytest.raises(ValueError, match="group_size must divide hidden_size 8"):
        GatedRMSNorm(8, group_size=3)
    assert GatedRMSNorm(8, group_size=8).group_size is None  # one group: the whole row
    assert GatedRMSNorm(8, has_weight=False).weight is None


def test_the_layers_are_registered():
    layers = registered_layers()
    assert layers["layer_norm"] == (LayerNorm, None) and layers["gated_rms_norm"] == (GatedRMSNorm, None)


class PluginLayerNorm(LayerNorm):
    def forward(self, x, residual=None):
        return self.forward_native(x, residual)


def test_a_plugin_replaces_the_layer_norm():
    LayerNorm.register_oot(PluginLayerNorm)
    try:
        norm = LayerNorm(8, 1e-6, has_bias=False)
        assert type(norm) is PluginLayerNorm and norm.eps == 1e-6 and norm.bias is None
        assert resolve("layer_norm") is PluginLayerNorm
    finally:
        unregister_oot("layer_norm")
    assert type(LayerNorm(8)) is LayerNorm
