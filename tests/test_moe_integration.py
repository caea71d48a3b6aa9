"""MoE models on hw_agnostic: experts through ExpertsInterface, routers through moe_route, shared experts intact."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hw_agnostic import ops
from hw_agnostic.backend.experts import (
    EXPERTS_IMPLEMENTATION,
    disable_fused_experts,
    enable_fused_experts,
    moe_layer_from_hf,
)
from hw_agnostic.backend.detect import NotDetected
from hw_agnostic.layers.moe import MoE
from hw_agnostic.ops.fused_experts import fused_experts_op
from hw_agnostic.ops.moe_route import moe_route_op
from tests.backend.models import TINY, TOKENS, prompt
from tests.harness import dsl_providers

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

#: Tiny configs: 2 decoder layers, a prime number of experts where the family allows it.
MOE_FAMILIES = {
    "qwen3_moe": dict(head_dim=16, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=40),
    "olmoe": dict(num_experts=5, num_experts_per_tok=2, intermediate_size=24),
    "qwen2_moe": dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=48),
    "deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                        moe_intermediate_size=24, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                    sliding_window=16),
}
#: (experts modules, routers) enable_fused_experts must switch; DeepSeek-V3's first layer is dense.
EXPECTED = {"qwen3_moe": (2, 2), "mixtral": (2, 2), "olmoe": (2, 2), "qwen2_moe": (2, 2), "deepseek_v3": (1, 1),
            "gpt_oss": (2, 2)}


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A tiny model with weights that route decisively (HF's std=0.02 init makes router logits
    nearly equal, so the choice between experts would hang on rounding)."""
    config = AutoConfig.for_model(family, **{**TINY, **TOKENS, **MOE_FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            if tensor.dim() >= 2:
                scale = 3.0 if name.endswith(("gate.weight", "router.weight")) else 1.0
                tensor.copy_(scale * torch.randn(tensor.shape, generator=g) / tensor.shape[-1] ** 0.5)
            elif "norm" in name:
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=g))
            else:  # biases, sinks, DeepSeek-V3's correction bias
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=g))
    return model.to(dtype)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _generate(model, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def _check_family(family: str, provider: str | None, new_tokens: int) -> None:
    model = build(family)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
    expected_tokens = _generate(model, ids[:1], new_tokens)

    report = enable_fused_experts(model)
    experts, routers = EXPECTED[family]
    assert report.count(f"experts_implementation={EXPERTS_IMPLEMENTATION!r}") == experts, report.table()
    assert sum(e.result.startswith("HwAgnostic") for e in report.replaced) == routers, report.table()
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION

    def forced():
        return ops.use_provider(provider, fused_experts_op, moe_route_op) if provider else contextlib.nullcontext()

    with forced(), torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    assert _relative(got, want) <= 1e-5
    # Our experts and our routing ran, once per MoE layer, on the provider asked for.
    for op in ("fused_experts", "moe_route"):
        plans = [p for p in ran if p.op == op]
        assert len(plans) == experts, [p.describe() for p in ran]
        assert provider is None or {p.provider for p in plans} == {provider}
    with forced():
        assert torch.equal(_generate(model, ids[:1], new_tokens), expected_tokens)

    disable_fused_experts(model)
    assert model.config._experts_implementation != EXPERTS_IMPLEMENTATION
    assert not any(type(m).__name__.startswith("HwAgnostic") for m in model.modules())
    with torch.no_grad(), ops.trace_dispatch() as ran:
        assert _relative(model(ids).logits, want) <= 1e-6
    assert not ran


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_fp32_logits_and_greedy_tokens_match_hf(family):
    _check_family(family, None, 32)


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(fused_experts_op))
def test_a_model_through_the_kernels(provider):
    """Qwen3-MoE with routing and experts on the DSL kernels (interpreted on the CPU)."""
    _check_family("qwen3_moe", provider, 4)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_with_rewire_shared_experts_become_gated_mlps(family):
    """The backend's path: rewire() (norms, the shared expert's MLP, fused decoder layers), then the experts."""
    from hw_agnostic import rewire
    from hw_agnostic.layers import GatedMLP

    model = build(family)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
    expected_tokens = _generate(model, ids[:1], 32)
    report = enable_fused_experts(model, report=rewire(model))
    shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
    assert isinstance(getattr(model.model.layers[-1].mlp, shared), GatedMLP), report.table()
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    assert {"fused_experts", "moe_route", "silu_and_mul"} <= {p.op for p in ran}
    assert _relative(got, want) <= 1e-5
    assert torch.equal(_generate(model, ids[:1], 32), expected_tokens)


def test_training_keeps_transformers_experts():
    """With gradients on, the HF code runs (the ops have no backward), and gradients flow."""
    model = build("qwen3_moe")
    enable_fused_experts(model)
    with ops.trace_dispatch() as ran:
        loss = model(prompt(), labels=prompt()).loss
    loss.backward()
    assert not [p for p in ran if p.op in ("fused_experts", "moe_route")]
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_router_logits_are_still_recorded():
    """transformers records router logits (for the auxiliary loss) from the router class: still there."""
    model = build("mixtral")
    ids = prompt()
    with torch.no_grad():
        want = model(ids, output_router_logits=True).router_logits
        enable_fused_experts(model)
        got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_bf16_model_stays_close():
    model = build("qwen2_moe", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    enable_fused_experts(model)
    ids = prompt()
    with torch.no_grad():
        assert _relative(model(ids).logits, reference(ids).logits) <= 2e-2


def test_unknown_routers_and_experts_are_left_with_a_reason():
    model = build("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts._apply_gate = lambda x: torch.relu(x.chunk(2, dim=-1)[0]) * x.chunk(2, dim=-1)[1]  # a ReLU-gated MoE
    router = model.model.layers[1].mlp.gate
    hf_router = type(router)

    def squared_logits(self, hidden):  # ranks experts by logit squared: no moe_route form computes it
        logits = torch.nn.functional.linear(hidden, self.weight)
        weights, ids = (logits * logits).softmax(-1).topk(self.top_k, dim=-1)
        return logits, weights, ids

    router.__class__ = type("CustomRouter", (hf_router,), {"forward": squared_logits})
    report = enable_fused_experts(model)
    left = {e.path: e.detail for e in report.left}
    assert "_apply_gate is none of" in left["model.layers.0.mlp.experts"]
    assert "none of moe_route's forms reproduces" in left["model.layers.1.mlp.gate"]
    assert report.count(f"experts_implementation={EXPERTS_IMPLEMENTATION!r}") == 1
    ids = prompt()
    with torch.no_grad(), ops.trace_dispatch() as ran:
        model(ids)  # the left experts run transformers' grouped_mm, the others ours
    assert [p.op for p in ran if p.op == "fused_experts"] == ["fused_experts"]


# --------------------------------------------------------------------------------------------
# the MoE layer built from HF blocks (shared experts)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "olmoe"])
def test_moe_layer_from_hf_block(family):
    model = build(family)
    block = model.model.layers[-1].mlp
    layer = moe_layer_from_hf(block)
    assert isinstance(layer, MoE), layer
    assert layer.experts.gate_up_proj is block.experts.gate_up_proj  # shared, not copied
    x = torch.randn(2, 5, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = layer(x)
    assert _relative(got, block(x)) <= 1e-6
    assert {"fused_experts", "moe_route"} <= {p.op for p in ran}
    if family != "olmoe":
        assert (layer.shared_expert_gate is not None) == (family == "qwen2_moe")


def test_gpt_oss_block_is_not_replaced_whole():
    """gpt-oss's MLP returns (hidden, router_scores): a block the MoE layer cannot stand in for."""
    block = build("gpt_oss").model.layers[0].mlp
    result = moe_layer_from_hf(block)
    assert isinstance(result, NotDetected) and "returns tuple" in result.reason


def test_moe_layers_match_their_native_forward():
    layer = moe_layer_from_hf(build("deepseek_v3").model.layers[-1].mlp)
    x = torch.randn(7, TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, weights, ids = layer.router(x)
        native_logits, native_weights, native_ids = layer.router.forward_native(x)
        assert torch.equal(ids, native_ids)
        torch.testing.assert_close(weights, native_weights)
        torch.testing.assert_close(logits, native_logits)
        torch.testing.assert_close(layer.experts(x, ids, weights), layer.experts.forward_native(x, ids, weights))


def test_a_plugin_replacing_the_moe_layer_is_what_gets_built():
    from hw_agnostic.layers.base import unregister_oot

    class ExpertParallelMoE(MoE):
        pass

    MoE.register_oot(ExpertParallelMoE)
    try:
        layer = moe_layer_from_hf(build("qwen2_moe").model.layers[0].mlp)
    finally:
        unregister_oot("moe")
    assert type(layer) is ExpertParallelMoE
