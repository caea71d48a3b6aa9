"""Routers recognised by what they compute: every inferred form reproduces the router it replaces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hw_agnostic import ops
from hw_agnostic.backend.experts import moe_layer_from_hf
from hw_agnostic.backend.detect import NotDetected
from hw_agnostic.backend.report import RewireReport
from hw_agnostic.backend.routers import DENSE, infer_router_form, is_router, router_form, switch_router
from tests.zoo.families import build

#: family -> what its router's inferred form must say (families whose router code no anchor matches).
INFERRED = {
    "aria_text": dict(scoring="topk_then_softmax"),  # top-k of the logits, softmax over those k
    "ernie4_5_moe": dict(scoring="softmax", renormalize=True, correction="moe_statics.e_score_correction_bias"),
    "hy_v3": dict(scoring="sigmoid", renormalize=True, argument=True, factor=2.826),  # the block passes the bias
    "kolibri1": dict(scoring="topk_then_sigmoid", correction="e_score_correction_bias"),  # chooses on biased logits
    "llama4_text": dict(scoring="topk_then_sigmoid", output=DENSE),  # returns dense [T, E] scores
    "laguna": dict(scoring="sigmoid", renormalize=True, logits="fp32_outputs", weights_dtype="hidden",
                   correction="e_score_correction_bias"),
    "jamba": dict(scoring="softmax", renormalize=False),
    "minimax_m2": dict(scoring="sigmoid", renormalize=True, argument=True, logits="model_dtype"),
    "afmoe": dict(scoring="sigmoid", renormalize=True, argument=True, weight="gate.weight"),  # takes [B, T, H] only
    "hunyuan_v1_moe": dict(scoring="topk_then_softmax", weight="wg.weight"),  # the logits come from a child linear
}


def _router(family: str) -> nn.Module:
    return next(m for m in build(family).modules() if is_router(m))


def _randomise(router: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in router.named_parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=g) * (0.3 if "bias" in name else 2.0 / tensor.shape[-1] ** 0.5))
        for name, tensor in router.named_buffers():
            if tensor.is_floating_point():
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=g))


def _compare(original, switched, dense: bool) -> None:
    if dense:
        for got, want in zip(switched, original):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
        return
    (logits, weights, ids), (want_logits, want_weights, want_ids) = switched, original
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values.to(ids.dtype))
    assert weights.dtype == want_weights.dtype and logits.dtype == want_logits.dtype
    torch.testing.assert_close(weights.gather(-1, ids.argsort(-1)), want_weights.gather(-1, want_ids.argsort(-1)))
    torch.testing.assert_close(logits, want_logits)


@pytest.mark.parametrize("family", sorted(INFERRED))
def test_inferred_router_forms_reproduce_the_router(family):
    router = _router(family)
    want = INFERRED[family]
    form = router_form(router)
    assert form is not None and not form.anchor
    spec = form.spec(router)
    assert spec.scoring == want["scoring"]
    for field in ("renormalize", "logits", "weights_dtype"):
        if field in want:
            assert getattr(spec, field) == want[field], field
    assert spec.routed_scaling_factor == pytest.approx(want.get("factor", 1.0))
    assert form.bias_argument == want.get("argument", False)
    assert form.correction_bias.path == want.get("correction")
    assert form.output == want.get("output", "logits_weights_ids")
    assert form.weight.path == want.get("weight", "weight")
    experts, hidden_size = form.weight(router).shape
    for dtype in (torch.float32, torch.bfloat16):
        probe = copy.deepcopy(router).to(dtype)
        _randomise(probe, seed=int(dtype == torch.bfloat16))
        hidden = torch.randn(1, 37, hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        hidden = hidden if family == "afmoe" else hidden[0]
        args = [0.3 * torch.randn(experts)] if form.bias_argument else []
        with torch.no_grad():
            original = probe(hidden, *args)
            change = switch_router("router", probe, RewireReport(), verify=True)
            assert change is not None, family
            with ops.trace_dispatch() as ran:
                switched = probe(hidden, *args)
        assert "moe_route" in {p.op for p in ran}
        if dtype == torch.float32:
            _compare(original, switched, form.output == DENSE)


def test_inference_leaves_the_router_untouched_and_works_on_meta():
    router = _router("kolibri1")
    _randomise(router)
    before = {k: v.clone() for k, v in router.state_dict().items()}
    assert infer_router_form(router) is not None
    assert all(torch.equal(before[k], v) for k, v in router.state_dict().items())
    with torch.device("meta"):
        meta = copy.deepcopy(router).to("meta")
    form = infer_router_form(meta)
    assert form is not None and form.spec(meta).scoring == "topk_then_sigmoid"


def test_group_limited_routing_is_inferred():
    """A DeepSeek-V3-style router outside the anchors, with 4 groups of which 2 stay eligible."""
    router = _router("beam")
    router.weight = nn.Parameter(torch.empty(8, router.weight.shape[1]))
    router.e_score_correction_bias = torch.zeros(8)
    router.num_experts, router.num_group, router.topk_group, router.top_k = 8, 4, 2, 3
    _randomise(router)
    form = router_form(router)
    assert form is not None
    spec = form.spec(router)
    assert (spec.scoring, spec.n_group, spec.topk_group, spec.top_k) == ("sigmoid", 4, 2, 3)
    hidden = torch.randn(29, router.weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        original = router(hidden)
        assert switch_router("gate", router, RewireReport(), verify=True) is not None
        _compare(original, router(hidden), dense=False)


def test_routing_moe_route_cannot_express_is_left_with_the_reason():
    router = _router("qwen3_moe")
    base = type(router)

    def by_magnitude(self, hidden):  # chooses the experts with the largest |logit|: no moe_route form
        logits = nn.functional.linear(hidden, self.weight)
        weights, ids = logits.abs().softmax(-1).topk(self.top_k, dim=-1)
        return logits, weights, ids

    router.__class__ = type("MagnitudeRouter", (base,), {"forward": by_magnitude})
    report = RewireReport()
    assert switch_router("gate", router, report, verify=True) is None
    assert "none of moe_route's forms reproduces" in report.left[0].detail
    phimoe = _router("phimoe")  # sparsemixer: a masked top-1, then the best of the rest
    assert router_form(phimoe) is None


def test_experts_and_routers_it_cannot_serve_are_reported():
    """Experts outside @use_experts_implementation and routers that are not one linear are listed as left."""
    from hw_agnostic.backend.experts import enable_fused_experts

    left = {e.path: e.detail for e in enable_fused_experts(build("llama4_text")).left}
    assert "@use_experts_implementation" in left["model.layers.0.feed_forward.experts"]
    left = {e.path: e.detail for e in enable_fused_experts(build("zaya")).left}
    assert "not one linear projection" in left["model.layers.0.mlp.gate"]


def test_blocks_whose_router_takes_the_bias_from_the_block_are_not_built_whole():
    block = next(m for m in build("minimax_m2").modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    result = moe_layer_from_hf(block)
    assert isinstance(result, NotDetected) and "correction bias from the block" in result.reason
