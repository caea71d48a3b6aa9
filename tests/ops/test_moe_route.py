"""moe_route: DSL vs reference, HF parity, bad inputs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops.moe_route import SCORINGS, moe_route_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator
from tests.ops.moe_cases import IGNORE_MASKED_ROW_WARNINGS, dtype_name

pytestmark = IGNORE_MASKED_ROW_WARNINGS


def distinct_logits(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router logits with no near-ties (a tie makes the chosen expert implementation-defined):
    a random permutation of well-separated levels plus a little noise."""
    levels = torch.rand(tokens, experts, generator=g).argsort(dim=1).to(torch.float32)
    return (levels - experts / 2) * 0.25 + 0.01 * torch.rand(tokens, experts, generator=g)


# --------------------------------------------------------------------------------------------
# an op with integer outputs: the harness's checks, with integers compared exactly
#
# tests/harness.py compares floating outputs with the tolerance table; expert ids, sorted
# pairs and offsets must match exactly.


ROUTE_SMALL = {"block_sizes": [2], "num_warps": 4, "num_stages": 1}


def route_case(tokens, experts, top_k, dtype=torch.float32, *, scoring="softmax", renormalize=False, bias=False,
               n_group=1, topk_group=1, factor=1.0, config=None):
    name = (f"{scoring}-T{tokens}-E{experts}-k{top_k}-{dtype_name(dtype)}" + ("-renorm" if renormalize else "")
            + ("-bias" if bias else "") + (f"-g{n_group}of{topk_group}" if n_group > 1 else "")
            + ("-small" if config else ""))

    def make():
        g = seeded_generator(name)
        logits = distinct_logits(tokens, experts, g).to(dtype)
        correction = (0.05 * torch.randn(experts, generator=g)) if bias else None
        return logits, correction, top_k, scoring, renormalize, n_group, topk_group, factor

    return Case(name, make, config)


ROUTE_CASES = [
    route_case(9, 7, 2, torch.float32, renormalize=True),  # Qwen/OLMoE, a prime E
    route_case(7, 7, 2, torch.bfloat16, renormalize=True, config=ROUTE_SMALL),
    route_case(1, 5, 1, torch.float32),  # one token, top-1
    route_case(4, 5, 5, torch.float32),  # top-E
    route_case(9, 12, 3, torch.float32, scoring="sigmoid", renormalize=True, bias=True, n_group=4, topk_group=2,
               factor=2.5),  # DeepSeek-V3 (three experts per group)
    route_case(5, 8, 3, torch.bfloat16, scoring="sigmoid", renormalize=True, bias=True, n_group=4, topk_group=2,
               factor=2.5, config=ROUTE_SMALL),  # two experts per group
    route_case(8, 11, 4, torch.bfloat16, scoring="topk_then_softmax"),  # gpt-oss
    route_case(6, 9, 2, torch.float32, scoring="topk_then_sigmoid", renormalize=True, bias=True),  # Kolibri
    route_case(5, 16, 1, torch.bfloat16, scoring="topk_then_sigmoid"),  # Llama-4
    route_case(7, 6, 2, torch.float32, renormalize=True, bias=True),  # ERNIE-4.5: softmax, biased choice
    route_case(0, 7, 2, torch.float32, renormalize=True),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(moe_route_op))
@pytest.mark.parametrize("case", ROUTE_CASES, ids=repr)
def test_moe_route_dsl(provider, case, device):
    check_provider(moe_route_op, provider, case, device)


@st.composite
def routings(draw) -> dict:
    """A valid moe_route call of any routing family: scoring, groups, top-k within what they allow."""
    scoring = draw(st.sampled_from(list(SCORINGS)))
    experts = draw(st.integers(1, 24))
    n_group = topk_group = 1
    divisors = [d for d in (2, 4, 8) if experts % d == 0 and experts > d]
    if scoring == "sigmoid" and divisors and draw(st.booleans()):
        n_group = draw(st.sampled_from(divisors))
        topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(8, topk_group * experts // n_group)))
    return dict(tokens=draw(st.integers(0, 20)), experts=experts, top_k=top_k,
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])), scoring=scoring,
                renormalize=draw(st.booleans()), bias=scoring != "topk_then_softmax" and draw(st.booleans()), n_group=n_group,
                topk_group=topk_group, factor=draw(st.sampled_from([1.0, 2.5])),
                config=draw(st.sampled_from([None, ROUTE_SMALL])))


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(6, 40), deadline=None, suppress_health_check=list(HealthCheck))
@given(routing=routings())
def test_fuzz_routing(routing):
    from tests.conftest import kernel_device

    tokens, experts, top_k = routing.pop("tokens"), routing.pop("experts"), routing.pop("top_k")
    case = route_case(tokens, experts, top_k, **routing)
    for provider in dsl_providers(moe_route_op):
        check_provider(moe_route_op, provider, case, kernel_device())


def test_route_matches_the_hf_routers():
    """moe_route reproduces the routers it replaces (cast as the model casts)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = seeded_generator("hf-routers")
    hidden = torch.randn(10, 16, generator=g)

    def config(**kw):
        return type("Config", (), kw)()

    qwen = Qwen3MoeTopKRouter(config(num_experts_per_tok=3, num_experts=8, norm_topk_prob=True, hidden_size=16))
    mixtral = MixtralTopKRouter(config(num_experts_per_tok=2, num_local_experts=8, hidden_size=16))
    gpt_oss = GptOssTopKRouter(config(num_experts_per_tok=4, num_local_experts=8, hidden_size=16))
    deepseek = DeepseekV3TopkRouter(config(num_experts_per_tok=3, num_local_experts=8, hidden_size=16,
                                           routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=True))
    with torch.no_grad():
        for router in (qwen, mixtral, gpt_oss, deepseek):
            router.weight.normal_(generator=g)
        gpt_oss.bias.normal_(generator=g)
        deepseek.e_score_correction_bias.normal_(std=0.1, generator=g)
        routes = {
            "qwen": (qwen, ops.moe_route(hidden @ qwen.weight.T, 3, renormalize=True)),
            "mixtral": (mixtral, ops.moe_route(hidden @ mixtral.weight.T, 2, renormalize=True)),
            "gpt_oss": (gpt_oss, ops.moe_route(hidden @ gpt_oss.weight.T + gpt_oss.bias, 4,
                                               scoring="topk_then_softmax")),
            "deepseek": (deepseek, ops.moe_route(
                hidden @ deepseek.weight.T, 3, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2,
                correction_bias=deepseek.e_score_correction_bias, routed_scaling_factor=2.5)),
        }
        for name, (router, (weights, ids)) in routes.items():
            _, hf_weights, hf_ids = router(hidden)
            order = hf_ids.argsort(dim=1)  # DeepSeek-V3's top-k is unsorted
            assert torch.equal(ids.sort(dim=1).values, hf_ids.gather(1, order)), name
            torch.testing.assert_close(weights.gather(1, ids.argsort(dim=1)), hf_weights.gather(1, order),
                                       rtol=1e-6, atol=1e-7, msg=name)


# --------------------------------------------------------------------------------------------
# bad inputs


_logits = torch.randn(4, 8)

BAD_INPUTS = [
    ("moe_route: router_logits must be a torch.Tensor", lambda: ops.moe_route([[1.0]], 1)),
    ("moe_route: router_logits must be 2-D", lambda: ops.moe_route(torch.randn(2, 3, 4), 1)),
    ("moe_route: router_logits must have dtype", lambda: ops.moe_route(torch.ones(2, 3, dtype=torch.int32), 1)),
    ("moe_route: top_k must be in [1, 8]", lambda: ops.moe_route(_logits, 9)),
    ("moe_route: top_k must be an int", lambda: ops.moe_route(_logits, 2.0)),
    ("moe_route: scoring must be one of", lambda: ops.moe_route(_logits, 2, scoring="softplus")),
    ("moe_route: renormalize must be a bool", lambda: ops.moe_route(_logits, 2, renormalize=1)),
    ("moe_route: correction_bias must have shape (8,)",
     lambda: ops.moe_route(_logits, 2, scoring="sigmoid", correction_bias=torch.zeros(7))),
    ("moe_route: n_group (3) must divide", lambda: ops.moe_route(_logits, 2, scoring="sigmoid", n_group=3)),
    ("moe_route: topk_group must be in [1, 4]",
     lambda: ops.moe_route(_logits, 2, scoring="sigmoid", n_group=4, topk_group=5)),
    ("needs scoring='sigmoid'", lambda: ops.moe_route(_logits, 2, n_group=2)),
    ("moe_route: top_k (5) exceeds the 4 experts",
     lambda: ops.moe_route(_logits, 5, scoring="sigmoid", n_group=4, topk_group=2)),
    ("moe_route: routed_scaling_factor must be finite",
     lambda: ops.moe_route(_logits, 2, routed_scaling_factor=float("nan"))),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()
