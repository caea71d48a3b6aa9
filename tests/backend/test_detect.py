"""Structure detection on hand-written modules: what counts, what does not, and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hw_agnostic.tolerances import mismatch
from hw_agnostic.backend.detect import (
    DecoderLayout,
    MLPSpec,
    NotDetected,
    detect_decoder_layout,
    detect_gated_mlp,
    identify_activation,
)
from hw_agnostic.backend.detect_norms import NormSpec, detect_rms_norm


class ScaleFirstNorm(nn.Module):
    """An RMS norm with unusual names: parameter ``scale``, eps kept as ``tiny``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.tiny = 3e-5

    def forward(self, x):
        xf = x.float()
        return (self.scale.float() * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + self.tiny))).to(x.dtype)


class NoWeightNorm(nn.Module):
    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class MeanCentered(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_an_rms_norm_is_found_by_what_it_computes():
    spec = detect_rms_norm(ScaleFirstNorm(24))
    assert spec == NormSpec(24, 3e-5, "fp32_scale", "scale", "tiny")
    assert detect_rms_norm(NoWeightNorm()) == NormSpec(16, 1e-6, "llama", None, None)


def test_hf_norms_detected_on_meta():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with torch.device("meta"):
        llama, gemma = LlamaRMSNorm(32, eps=1e-5), GemmaRMSNorm(32, eps=1e-6)
    assert detect_rms_norm(llama) == NormSpec(32, 1e-5, "llama", "weight", "variance_epsilon")
    assert detect_rms_norm(gemma) == NormSpec(32, 1e-6, "gemma", "weight", "eps")


def test_other_norms_are_named_with_a_reason():
    assert "has a bias" in detect_rms_norm(nn.LayerNorm(8)).reason
    assert isinstance(detect_rms_norm(nn.LayerNorm(8, bias=False)), NotDetected)
    assert isinstance(detect_rms_norm(MeanCentered(8)), NotDetected)
    assert detect_rms_norm(nn.Linear(4, 4)) is None and detect_rms_norm(nn.Dropout()) is None


class SplitMLP(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.w_in, self.w_gate, self.w_out = nn.Linear(8, 20), nn.Linear(8, 20), nn.Linear(20, 8)
        self.act = {"silu": nn.SiLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU("tanh")}[act]

    def forward(self, x):
        return self.w_out(self.w_in(x) * self.act(self.w_gate(x)))


class MergedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Linear(8, 40, bias=False)
        self.out = nn.Linear(20, 8, bias=False)

    def forward(self, x):
        gate, up = self.fused(x).chunk(2, dim=-1)
        return self.out(F.silu(gate) * up)


class PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlps_are_found_whatever_their_names(act):
    spec = detect_gated_mlp(SplitMLP(act))
    assert spec == MLPSpec("w_gate", "w_in", None, "w_out", act, 8, 20, True, True)


def test_merged_gate_up_is_found():
    assert detect_gated_mlp(MergedMLP()) == MLPSpec(None, None, "fused", "out", "silu", 8, 20, False, False)


def test_plain_mlp_is_not_gated():
    assert "no gate" in detect_gated_mlp(PlainMLP()).reason


def test_activations_are_identified_by_value():
    assert identify_activation(F.silu) == "silu"
    assert identify_activation(nn.GELU("tanh")) == "gelu_tanh"
    assert identify_activation(torch.relu) is None


class Layer(nn.Module):
    """A decoder layer whose residual arithmetic is chosen per test."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.norm_a, self.norm_b = NoWeightNormWithParam(8), NoWeightNormWithParam(8)
        self.attn, self.ffn = Attention(), SplitMLP("silu")

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        residual = hidden_states
        h, _ = self.attn(hidden_states=self.norm_a(hidden_states), attention_mask=attention_mask, **kwargs)
        h = residual + (h * 0.5 if self.style == "scaled" else h)
        return h + self.ffn(self.norm_b(h))


class NoWeightNormWithParam(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return self.proj(hidden_states), None


def test_decoder_layouts_are_found_by_running_the_layer():
    layout = detect_decoder_layout(Layer("plain"), {"norm_a", "norm_b"}, 8)
    assert isinstance(layout, DecoderLayout) and layout.name == "pre_norm"
    assert layout.roles == {"input_norm": "norm_a", "attention": "attn", "post_attention_norm": "norm_b",
                            "mlp": "ffn"}
    assert layout.attention_params == ("attention_mask",)


def test_a_different_residual_is_not_mistaken_for_pre_norm():
    found = detect_decoder_layout(Layer("scaled"), {"norm_a", "norm_b"}, 8)
    assert isinstance(found, NotDetected) and "combines them differently" in found.reason


# --------------------------------------------------------------------------------------------
# norms and MLPs however they are written


class PowNorm(nn.Module):
    """Gemma 4's spelling: ``x * pow(mean(x²) + eps, -0.5)``, scale multiplied in fp32."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5) * self.weight.float()).to(x.dtype)


class WeightlessWithDummyBuffer(nn.Module):
    """Falcon-Mamba's: a 1-D buffer of ones the forward never reads."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n), persistent=False)
        self.eps = 1e-6

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class GatedNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x, gate=None):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * (y if gate is None else y * F.silu(gate))


def test_norms_spelled_other_ways():
    assert detect_rms_norm(PowNorm(24)) == NormSpec(24, 1e-6, "fp32_scale", "weight", "eps")
    assert detect_rms_norm(WeightlessWithDummyBuffer(24)) == NormSpec(16, 1e-6, "llama", None, "eps")
    assert detect_rms_norm(nn.RMSNorm(24, eps=1e-5)) == NormSpec(24, 1e-5, "fp32_scale", "weight", "eps")
    assert "depends on the input dtype" in detect_rms_norm(nn.RMSNorm(24)).reason
    gated = detect_rms_norm(GatedNorm(24))
    assert isinstance(gated, NotDetected) and "gate" in gated.reason


class TailedMLP(nn.Module):
    """Falcon-H1's multipliers and SeedOss's output dropout around a gated MLP."""

    def __init__(self, dropout: str = "module") -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 40, bias=False), nn.Linear(16, 40, bias=False)
        self.down_proj = nn.Linear(40, 16, bias=False)
        self.act_fn = nn.SiLU()
        self.gate_multiplier, self.down_multiplier = 0.5, 2.0
        self.kind = dropout
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
        y = self.down_proj(y) * self.down_multiplier
        if self.kind == "module":
            return self.dropout(y)
        return F.dropout(y, p=0.1, training=self.training)


@pytest.mark.parametrize("dropout", ["module", "functional"])
def test_gated_mlps_with_multipliers_and_dropout(dropout):
    from hw_agnostic.backend.rewire import build_mlp

    module = TailedMLP(dropout).eval()
    spec = detect_gated_mlp(module)
    assert isinstance(spec, MLPSpec)
    assert (spec.gate_multiplier, spec.up_multiplier, spec.down_multiplier) == (0.5, None, 2.0)
    assert spec.dropout == (0.25 if dropout == "module" else 0.1)
    layer = build_mlp(module, spec).eval()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        m, l = module.to(dtype), layer.to(dtype)
        with torch.no_grad():
            assert mismatch(l(x), m(x).double(), dtype) is None
    layer.float().train()
    x = torch.randn(64, 16)
    assert not torch.equal(layer(x), layer.eval()(x))  # the dropout applies in training


class InlineMLPLayer(nn.Module):
    """A decoder layer with its MLP written inline (OPT's fc1/fc2 beside a norm)."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        if gated:
            self.fc3 = nn.Linear(8, 32)

    def forward(self, x, mask=None):
        h = self.fc1(self.norm(x))
        h = F.silu(h) * self.fc3(x) if hasattr(self, "fc3") else F.relu(h)
        return x + self.fc2(h)


def test_an_inline_plain_mlp_is_called_plain_and_an_inline_gated_one_is_not():
    plain = detect_gated_mlp(InlineMLPLayer(gated=False))
    assert isinstance(plain, NotDetected) and "a plain MLP" in plain.reason
    gated = detect_gated_mlp(InlineMLPLayer(gated=True))
    assert isinstance(gated, NotDetected) and "plain" not in gated.reason


def test_conv1d_projections_are_a_plain_mlp_or_not_served():
    from transformers.pytorch_utils import Conv1D

    class ConvMLP(nn.Module):
        def __init__(self, gated: bool) -> None:
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(32, 8), Conv1D(8, 32)  # Conv1D(out, in)
            self.c_gate = Conv1D(32, 8) if gated else None

        def forward(self, x):
            h = F.gelu(self.c_fc(x))
            return self.c_proj(h * self.c_gate(x) if self.c_gate is not None else h)

    plain = detect_gated_mlp(ConvMLP(gated=False))
    assert isinstance(plain, NotDetected) and "a plain MLP" in plain.reason and "Conv1D" in plain.reason
    gated = detect_gated_mlp(ConvMLP(gated=True))
    assert isinstance(gated, NotDetected) and "not served" in gated.reason and "plain" not in gated.reason


class InlineSwigluMLP(nn.Module):
    """MiniMax-M3's dense MLP: gpt-oss's clamped SwiGLU written inline between two linears."""

    def __init__(self, relu: bool = False) -> None:
        super().__init__()
        self.swiglu_alpha, self.swiglu_limit, self.relu = 1.5, 6.0, relu
        self.gate_up_proj, self.down_proj = nn.Linear(16, 48, bias=False), nn.Linear(24, 16, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.relu:
            return self.down_proj(torch.relu(gate) * up)
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return self.down_proj((up + 1.0) * (gate * torch.sigmoid(gate * self.swiglu_alpha)))


def test_an_inline_clamped_swiglu_is_recognised_by_what_it_computes():
    from hw_agnostic.backend.rewire import build_mlp

    module = InlineSwigluMLP()
    spec = detect_gated_mlp(module)
    assert isinstance(spec, MLPSpec), spec
    assert (spec.activation, spec.gate_up, spec.swiglu_alpha, spec.swiglu_limit) == ("swiglu_oai", "gate_up_proj", 1.5, 6.0)
    x = 4.0 * torch.randn(3, 16, generator=torch.Generator().manual_seed(0))  # past the clamps
    with torch.no_grad():
        assert mismatch(build_mlp(module, spec).train(False)(x), module(x).double()) is None
    relu = detect_gated_mlp(InlineSwigluMLP(relu=True))
    assert isinstance(relu, NotDetected) and "not act(gate(x)) * up(x)" in relu.reason
