"""fused_experts: DSL vs reference, its composition of the other MoE ops, HF parity, bad inputs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops.fused_experts import fused_experts_op
from hw_agnostic.ops.moe_common import example_routing
from hw_agnostic.ops.moe_route import moe_route_op
from hw_agnostic.tolerances import assert_close, assert_within_ulps
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator
from tests.ops.moe_cases import (
    ALIGN_SMALL,
    DTYPES,
    GEMM_SMALL,
    IDS,
    IGNORE_MASKED_ROW_WARNINGS,
    W2,
    W13,
    X,
    dtype_name,
    routing_ids,
)

pytestmark = IGNORE_MASKED_ROW_WARNINGS


def fused_config(block_m: int, *, align=None, tiles=None) -> dict:
    tiles = tiles or {"block_sizes": [32, 32], "num_warps": 4, "num_stages": 1}
    return {
        "block_m": block_m,
        "align": align or {"block_pairs": 64, "count": {"block_sizes": [16], "num_warps": 4, "num_stages": 1},
                           "offsets": {"block_sizes": [2, 16], "num_warps": 4, "num_stages": 1},
                           "scatter": {"num_warps": 4, "num_stages": 1}},
        "gate_up": tiles,
        "down": tiles,
        "combine": {"block_sizes": [4, 16], "num_warps": 4, "num_stages": 1},
    }


def fused_case(tokens, experts, top_k, hidden, inter, dtype, *, weights_dtype=None, activation="silu",
               gpt_oss=False, pattern="spread", layout="contiguous", config=None):
    weights_dtype = weights_dtype or dtype
    name = (f"{'gpt_oss' if gpt_oss else activation}-T{tokens}-E{experts}-k{top_k}-H{hidden}-I{inter}-"
            f"{dtype_name(dtype)}-w{dtype_name(weights_dtype)}-{pattern}-{layout}"
            + (f"-bm{config['block_m']}" if config else ""))

    def make():
        g = seeded_generator(name)
        x = torch.randn(tokens, hidden + (7 if layout == "padded" else 0), generator=g)[:, :hidden].to(dtype)
        ids = routing_ids(tokens, experts, top_k, g, pattern)
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(weights_dtype)
        if gpt_oss:
            w_gate_up = (torch.randn(experts, hidden, 2 * inter, generator=g) / hidden**0.5).to(dtype)
            w_down = (torch.randn(experts, inter, hidden, generator=g) / inter**0.5).to(dtype)
            biases = ((0.3 * torch.randn(experts, 2 * inter, generator=g)).to(dtype),
                      (0.3 * torch.randn(experts, hidden, generator=g)).to(dtype))
            # gate/up pre-activations spread enough for the +-limit clamps to bite
            w_gate_up = w_gate_up * 4
            return (x, w_gate_up, w_down, weights, ids, *biases, "swiglu_oai", True, True, 1.702, 7.0)
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        w_down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
        return x, w_gate_up, w_down, weights, ids, None, None, activation, False, False, 1.702, 7.0

    return Case(name, make, config)


FUSED_SMALL = fused_config(4, align=ALIGN_SMALL, tiles=GEMM_SMALL)
#: Most cases share one config, so the interpreter tier compiles each kernel variant once.
FUSED_SHARED = fused_config(8)

FUSED_CASES = [
    fused_case(9, 5, 2, 13, 11, torch.float32),  # Qwen (weights in the model dtype), the default config
    fused_case(9, 5, 2, 13, 11, torch.bfloat16, config=FUSED_SHARED),
    fused_case(9, 5, 2, 13, 11, torch.bfloat16, weights_dtype=torch.float32, config=FUSED_SHARED),  # Mixtral
    fused_case(7, 5, 3, 37, 19, torch.bfloat16, config=FUSED_SMALL),  # fewer rows than blocks, masks
    fused_case(1, 7, 1, 13, 11, torch.float32, config=FUSED_SHARED),  # one token, top-1
    fused_case(6, 5, 1, 13, 11, torch.float32, pattern="one_expert", config=FUSED_SHARED),
    fused_case(8, 13, 2, 13, 11, torch.float32, pattern="two_experts", config=FUSED_SHARED),  # idle experts
    fused_case(3, 5, 5, 13, 11, torch.float32, config=FUSED_SHARED),  # top-E
    fused_case(9, 5, 2, 13, 11, torch.float32, pattern="sentinels", config=FUSED_SHARED),
    fused_case(9, 5, 2, 13, 11, torch.float16, activation="gelu_tanh", layout="padded", config=FUSED_SHARED),
    fused_case(9, 5, 2, 13, 11, torch.bfloat16, gpt_oss=True, config=FUSED_SHARED),
    fused_case(23, 7, 3, 13, 11, torch.float32, config=fused_config(8, align=ALIGN_SMALL)),  # several pair blocks
    fused_case(0, 5, 2, 13, 11, torch.float32),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(fused_experts_op))
@pytest.mark.parametrize("case", FUSED_CASES, ids=repr)
def test_fused_experts_dsl(provider, case, device):
    check_provider(fused_experts_op, provider, case, device)


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(fused_experts_op))
def test_the_activation_inside_runs_on_the_forced_provider(provider, device):
    """fused_experts runs its gated activation through the activation op: traced, and forced with it."""
    from hw_agnostic.ops.activations import silu_and_mul_op

    case = fused_case(9, 5, 2, 13, 11, torch.float32, config=FUSED_SHARED)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.make())
    want = fused_experts_op.reference(*args)
    with ops.use_config(fused_experts_op, FUSED_SHARED), ops.use_provider(provider, fused_experts_op):
        with ops.trace_dispatch() as ran:
            got = fused_experts_op(*args)
        assert [(p.op, p.provider) for p in ran] == [("fused_experts", provider), ("silu_and_mul", provider)]
        assert_close(got, want.double())
        with ops.use_provider("reference", silu_and_mul_op), ops.trace_dispatch() as ran:
            got = fused_experts_op(*args)  # the inner op's own forcing wins
        assert [(p.op, p.provider) for p in ran] == [("fused_experts", provider), ("silu_and_mul", "reference")]
        assert_close(got, want.double())


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(4, 30), deadline=None, suppress_health_check=list(HealthCheck))
@given(tokens=st.integers(1, 12), experts=st.integers(2, 16), top_k=st.integers(1, 4),
       hidden=st.integers(1, 40), inter=st.integers(1, 24), dtype=st.sampled_from(DTYPES),
       activation=st.sampled_from(["silu", "gelu", "gelu_tanh", "gpt_oss"]),
       weights_dtype=st.sampled_from([None, torch.float32]),
       pattern=st.sampled_from(["spread", "one_expert", "two_experts", "sentinels"]))
def test_fuzz_fused_experts(tokens, experts, top_k, hidden, inter, dtype, activation, weights_dtype, pattern):
    """Expert counts, top-k, sizes, dtypes, router-weight dtypes, every activation and gpt-oss's
    layout with biases, and the routing edge cases."""
    from tests.conftest import kernel_device

    gpt_oss = activation == "gpt_oss"
    case = fused_case(tokens, experts, min(top_k, experts), hidden, inter, dtype, weights_dtype=weights_dtype,
                      activation="silu" if gpt_oss else activation, gpt_oss=gpt_oss, pattern=pattern,
                      config=FUSED_SHARED)
    for provider in dsl_providers(fused_experts_op):
        check_provider(fused_experts_op, provider, case, kernel_device())


@pytest.mark.gpu
def test_the_kernel_path_never_waits_for_the_device():
    """Token counts per expert stay on the device: no host synchronisation once a plan is built."""
    case = fused_case(64, 5, 2, 128, 96, torch.bfloat16)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in case.make())
    logits = torch.randn(64, 5, device="cuda")
    with ops.use_provider("helion", fused_experts_op, moe_route_op):
        fused_experts_op(*args), ops.moe_route(logits, 2)  # builds the plans (compiles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.moe_route(logits, 2)
            fused_experts_op(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_fused_experts_is_route_align_gemm_act_gemm_combine():
    """The fused op equals its pieces composed by hand (pair order, scaling, combine)."""
    case = fused_case(9, 5, 2, 13, 11, torch.float32)
    x, w_gate_up, w_down, weights, ids, *_ = case.make()
    alignment = ops.moe_align(ids, 5, 4)
    projected = ops.grouped_gemm(x, w_gate_up, alignment, pairs_per_row=2)
    down = ops.grouped_gemm(ops.silu_and_mul(projected), w_down, alignment, scale=weights.reshape(-1))
    torch.testing.assert_close(ops.fused_experts(x, w_gate_up, w_down, weights, ids), down.view(9, 2, 13).sum(1))


# --------------------------------------------------------------------------------------------
# parity with the Hugging Face experts


def _hf_experts(family: str, dtype: torch.dtype):
    from transformers import AutoConfig

    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

        config = AutoConfig.for_model("gpt_oss", hidden_size=32, intermediate_size=24, num_local_experts=5)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = AutoConfig.for_model("qwen3_moe", hidden_size=32, moe_intermediate_size=24, num_experts=5)
    config._experts_implementation = "grouped_mm"
    experts = Experts(config)
    g = seeded_generator(family)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=g) / 4)
    return experts.to(dtype)


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(fused_experts_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_matches_hf_grouped_mm_experts(family, dtype, provider):
    """What transformers' grouped_mm experts compute: fp32 within 1e-6, fp16/bf16 within HF_PARITY
    and nearly all bit-equal (every rounding where transformers rounds)."""
    from tests.conftest import kernel_device

    device = "cpu" if provider == "reference" else kernel_device()
    experts = _hf_experts(family, dtype)
    g = seeded_generator(f"{family}{dtype}")
    hidden = torch.randn(11, 32, generator=g).to(dtype)  # grouped_mm wants 16-byte strides
    weights, ids = example_routing(11, 5, 2, "cpu", g)
    weights = weights.to(dtype if family != "gpt_oss" else torch.float32)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
    experts, hidden, weights, ids = experts.to(device), hidden.to(device), weights.to(device), ids.to(device)
    kwargs = dict(activation="swiglu_oai", transposed=True, interleaved=True,
                  gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias) \
        if family == "gpt_oss" else {}
    with torch.no_grad(), ops.use_provider(provider, fused_experts_op), ops.trace_dispatch() as ran:
        got = ops.fused_experts(hidden, experts.gate_up_proj, experts.down_proj, weights, ids, **kwargs).cpu()
    assert ran[0].op == "fused_experts" and {p.provider for p in ran} == {provider}
    assert got.dtype == want.dtype
    if dtype == torch.float32:
        relative = ((got - want).norm() / want.norm()).item()
        assert relative <= 1e-6, relative
    else:
        assert_within_ulps(got, want)


# --------------------------------------------------------------------------------------------
# bad inputs


BAD_INPUTS = [
    ("fused_experts: hidden must be 2-D", lambda: ops.fused_experts(X[None], W13, W2, IDS.float(), IDS)),
    ("fused_experts: w_gate_up must have the dtype of hidden",
     lambda: ops.fused_experts(X, W13.half(), W2, IDS.float(), IDS)),
    ("fused_experts: w_gate_up must be [E, 2I, H]",
     lambda: ops.fused_experts(X, torch.randn(8, 10, 5), W2, IDS.float(), IDS)),
    ("fused_experts: w_gate_up must be [E, H, 2I]",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS, transposed=True)),
    ("fused_experts: w_down must be [E, H, I] = (8, 6, 5)",
     lambda: ops.fused_experts(X, W13, torch.randn(8, 6, 4), IDS.float(), IDS)),
    ("fused_experts: topk_ids must have shape (4, top_k >= 1)",
     lambda: ops.fused_experts(X, W13, W2, IDS.float()[:3], IDS[:3])),
    ("fused_experts: topk_ids must have dtype int32, int64",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS.float())),
    ("fused_experts: topk_weights must have the shape of topk_ids",
     lambda: ops.fused_experts(X, W13, W2, IDS.float()[:, :1], IDS)),
    ("fused_experts: gate_up_bias must have shape (8, 10)",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS, gate_up_bias=torch.zeros(8, 5))),
    ("fused_experts: activation must be one of",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS, activation="relu")),
    ("fused_experts: interleaved gate/up columns are gpt-oss's layout",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS, interleaved=True)),
    ("fused_experts: swiglu_limit must be > 0",
     lambda: ops.fused_experts(X, W13, W2, IDS.float(), IDS, activation="swiglu_oai", swiglu_limit=0.0)),
    ("fused_experts: hidden must have at least one column",
     lambda: ops.fused_experts(X[:, :0], W13[..., :0], W2[:, :0], IDS.float(), IDS)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()


def test_bad_inputs_leave_the_arguments_untouched():
    hidden, ids = X.clone(), IDS.clone()
    with pytest.raises(ValueError):
        ops.fused_experts(hidden, W13, W2, IDS.float(), ids, interleaved=True)
    assert torch.equal(hidden, X) and torch.equal(ids, IDS)


def test_reference_keeps_dtypes_and_shapes():
    weights, ids = ops.moe_route(torch.randn(3, 8).to(torch.bfloat16), 2)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (3, 2)
    out = ops.fused_experts(X.to(torch.bfloat16), W13.to(torch.bfloat16), W2.to(torch.bfloat16), IDS.float(), IDS)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 6)
