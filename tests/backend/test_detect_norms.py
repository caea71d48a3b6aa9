"""Norm detection on every HF norm class the norm ops serve, and on modules that only look like norms.

For each HF layer norm and gated RMS norm (tests/ops/hf_norms.py): the detector finds it, the
replacement ``rewire`` builds from the spec shares the module's parameters, and it computes what
the module computes, rounding for rounding, in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hw_agnostic.backend.detect_norms import (
    Detections,
    GatedNormSpec,
    LayerNormSpec,
    NormSpec,
    NotDetected,
    detect_gated_rms_norm,
    detect_layer_norm,
    detect_rms_norm,
)
from hw_agnostic.backend.rewire import build_gated_norm, build_layer_norm
from tests.harness import seeded_generator
from tests.ops import hf_norms

#: StableLM's per-head norm is a ModuleList of nn.LayerNorms: each of those is detected on its own.
LAYER_NORMS = [e for e in hf_norms.LAYER_NORMS if e.id != "StableLmLayerNormPerHead"]


def _check_replacement(entry: hf_norms.HFNorm, module: nn.Module, new: nn.Module, dtype: torch.dtype) -> None:
    g = seeded_generator(f"detect-{entry.id}-{dtype}")
    module, new = module.to(dtype), new.to(dtype)
    x, gate = hf_norms.inputs(entry, 60, dtype, "cpu", g)
    want = hf_norms.run_module(entry, module, x, gate)
    with torch.no_grad():
        got = new(x, gate) if entry.gated else new(x)
    hf_norms.assert_same_rounding(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", LAYER_NORMS, ids=repr)
def test_every_hf_layer_norm_is_detected_and_replaced_exactly(entry, dtype):
    module = hf_norms.build(entry, 60, seeded_generator(entry.id))
    assert not isinstance(detect_rms_norm(module), NormSpec)  # mean-subtracting: never an RMS norm
    spec = detect_layer_norm(module)
    assert isinstance(spec, LayerNormSpec), spec
    new = build_layer_norm(module, spec)
    for name in ("weight", "bias"):  # shared, not copied
        original = getattr(module, getattr(spec, f"{name}_name") or "", None)
        assert (getattr(new, name) is None) == (original is None)
        if original is not None:
            assert getattr(new, name).data_ptr() == original.data_ptr()
    _check_replacement(entry, module, new, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", hf_norms.GATED_NORMS, ids=repr)
def test_every_hf_gated_rms_norm_is_detected_and_replaced_exactly(entry, dtype):
    module = hf_norms.build(entry, 60, seeded_generator(entry.id))
    spec = detect_gated_rms_norm(module)
    assert isinstance(spec, GatedNormSpec), spec
    assert detect_layer_norm(module) is None
    new = build_gated_norm(module, spec)
    assert new.weight.data_ptr() == module.weight.data_ptr()
    _check_replacement(entry, module, new, dtype)
    x = torch.randn(2, 3, 60, generator=seeded_generator("no-gate"))
    with torch.no_grad():  # where the module takes no gate, both are the (grouped) RMS norm
        try:
            want = module.to(torch.float32)(x)
        except (TypeError, AttributeError):
            return  # it always takes a gate (and is always called with one)
        torch.testing.assert_close(new.to(torch.float32)(x), want)


def test_a_weightless_layer_norm_whose_eps_is_only_in_its_code():
    class Olmoish(nn.Module):  # no parameters, eps only in the code
        def __init__(self):
            super().__init__()
            self.normalized_shape = (24,)

        def forward(self, x):
            return F.layer_norm(x.float(), self.normalized_shape, None, None, eps=3e-5).to(x.dtype)

    assert detect_layer_norm(Olmoish()) == LayerNormSpec((24,), 3e-5, "fp32", None, None, None)


class UnbiasedVarianceNorm(nn.Module):
    """Mean-subtracting, but divides by the unbiased (n - 1) variance: not nn.LayerNorm's."""

    def __init__(self, n):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-5

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return self.weight * centred / torch.sqrt(x.var(-1, keepdim=True, unbiased=True) + self.eps)


class GeluGatedNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-6

    def forward(self, hidden_states, gate=None):
        h = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h * (F.gelu(gate) if gate is not None else 1)


def test_modules_that_only_look_like_norms_are_reported_not_replaced():
    found = detect_layer_norm(UnbiasedVarianceNorm(16))
    assert isinstance(found, NotDetected) and "layer norm" in found.reason
    found = detect_gated_rms_norm(GeluGatedNorm(16))
    assert isinstance(found, NotDetected) and "gated" in found.reason
    # an RMS norm is no layer norm, and projections and embeddings are no candidates at all
    rms = nn.RMSNorm(16, eps=1e-6)
    assert isinstance(detect_layer_norm(rms), NotDetected)
    for module in (nn.Linear(8, 8), nn.Linear(8, 8, bias=False), nn.Embedding(10, 8), nn.Dropout(0.1)):
        assert detect_layer_norm(module) is None and detect_gated_rms_norm(module) is None


class ConfiguredRMSNorm(nn.Module):
    """An RMS norm whose forward also reads a shared config object and an optional tensor attribute."""

    def __init__(self, n, eps=1e-6, config=None, scale=None):
        super().__init__()
        self.weight, self.variance_epsilon, self.config, self.scale = nn.Parameter(torch.ones(n)), eps, config, scale

    def forward(self, x):
        xf = x.float()
        eps = self.config.eps if self.config is not None else self.variance_epsilon
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return y * self.scale if self.scale is not None else y


class Config:
    def __init__(self, eps):
        self.eps = eps


def _counted(detect):
    calls = []

    def counting(module):
        calls.append(module)
        return detect(module)

    return counting, calls


def test_modules_computing_the_same_function_share_one_detection():
    detections, (detect, calls) = Detections(), _counted(detect_rms_norm)
    config = Config(1e-5)
    for modules in ([ConfiguredRMSNorm(32) for _ in range(4)],
                    [ConfiguredRMSNorm(32, config=config) for _ in range(3)]):
        calls.clear()
        specs = [detections(detect, m) for m in modules]
        assert len(calls) == 1 and specs == [detect_rms_norm(modules[-1])] * len(modules), specs
        assert isinstance(specs[0], NormSpec)


def test_modules_that_may_compute_differently_are_detected_each():
    hooked = ConfiguredRMSNorm(32)
    hooked.register_forward_hook(lambda module, args, out: out * 2)
    buffered = ConfiguredRMSNorm(32)
    buffered.register_buffer("offset", torch.zeros(1))
    groups = {
        "eps": [ConfiguredRMSNorm(32, eps=1e-6), ConfiguredRMSNorm(32, eps=1e-5)],
        "width": [ConfiguredRMSNorm(32), ConfiguredRMSNorm(48)],
        "config": [ConfiguredRMSNorm(32, config=Config(1e-6)), ConfiguredRMSNorm(32, config=Config(1e-2))],
        "tensor attribute": [ConfiguredRMSNorm(32, scale=torch.tensor(1.0)),
                             ConfiguredRMSNorm(32, scale=torch.tensor(3.0))],
        "hook": [ConfiguredRMSNorm(32), hooked],
        "buffer": [ConfiguredRMSNorm(32), buffered],
        "training": [ConfiguredRMSNorm(32), ConfiguredRMSNorm(32).eval()],
        "eps type": [ConfiguredRMSNorm(32, eps=1), ConfiguredRMSNorm(32, eps=1.0)],
    }
    for why, modules in groups.items():
        detections, (detect, calls) = Detections(), _counted(detect_rms_norm)
        specs = [detections(detect, m) for m in modules]
        assert len(calls) == len(modules), why
        assert specs == [detect_rms_norm(m) for m in modules], why
    assert isinstance(detect_rms_norm(hooked), NotDetected)  # the hook doubles the output: no RMS norm
    assert isinstance(detect_rms_norm(groups["tensor attribute"][1]), NotDetected)
