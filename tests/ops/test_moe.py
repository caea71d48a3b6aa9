"""moe_route, moe_align, grouped_gemm, fused_experts: DSL vs reference, invariants, HF parity, bad inputs."""

from __future__ import annotations

import re
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.kernels.moe import max_slots
from hw_agnostic.ops import moe
from hw_agnostic.ops.moe import (
    fused_experts_op,
    grouped_gemm_op,
    moe_align_op,
    moe_align_reference,
    moe_route_op,
)
from hw_agnostic.tolerances import assert_close
from tests.harness import Case, check_provider, dsl_providers

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The Triton interpreter evaluates masked-out rows too; Helion fills them with -inf before a row
# max, so softmax on those rows computes -inf - -inf. Those rows are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def distinct_logits(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router logits with no near-ties (a tie makes the chosen expert implementation-defined):
    a random permutation of well-separated levels plus a little noise."""
    levels = torch.rand(tokens, experts, generator=g).argsort(dim=1).to(torch.float32)
    return (levels - experts / 2) * 0.25 + 0.01 * torch.rand(tokens, experts, generator=g)


def routing_ids(tokens: int, experts: int, top_k: int, g: torch.Generator, pattern: str = "spread") -> torch.Tensor:
    """``[tokens, top_k]`` expert ids: distinct per token (``spread``), or a routing edge case."""
    if pattern == "spread":
        return torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    if pattern == "one_expert":  # every pair goes to one expert
        return torch.full((tokens, top_k), experts // 2, dtype=torch.int64)
    if pattern == "two_experts":  # most experts get no tokens
        return torch.tensor([0, experts - 1])[torch.randint(0, 2, (tokens, top_k), generator=g)]
    if pattern == "sentinels":  # expert-parallel sentinels (HF uses num_experts) and a stray -1
        ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
        ids[::3, 0] = experts
        ids[1::4, -1] = -1
        return ids
    raise ValueError(pattern)


# --------------------------------------------------------------------------------------------
# ops with integer outputs: the harness's checks, with integers compared exactly
#
# tests/harness.py compares floating outputs with the tolerance table; expert ids, sorted
# pairs and offsets must match exactly.


ROUTE_SMALL = {"block_sizes": [2], "num_warps": 4, "num_stages": 1}


def route_case(tokens, experts, top_k, dtype=torch.float32, *, scoring="softmax", renormalize=False, bias=False,
               n_group=1, topk_group=1, factor=1.0, config=None):
    name = (f"{scoring}-T{tokens}-E{experts}-k{top_k}-{_dtype(dtype)}" + ("-renorm" if renormalize else "")
            + ("-bias" if bias else "") + (f"-g{n_group}of{topk_group}" if n_group > 1 else "")
            + ("-small" if config else ""))

    def make():
        g = _generator(name)
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
    route_case(0, 7, 2, torch.float32, renormalize=True),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(moe_route_op))
@pytest.mark.parametrize("case", ROUTE_CASES, ids=repr)
def test_moe_route_dsl(provider, case, device):
    check_provider(moe_route_op, provider, case, device)


def test_route_matches_the_hf_routers():
    """moe_route reproduces the routers it replaces (cast as the model casts)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = _generator("hf-routers")
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
            "qwen": (qwen, moe.moe_route(hidden @ qwen.weight.T, 3, renormalize=True)),
            "mixtral": (mixtral, moe.moe_route(hidden @ mixtral.weight.T, 2, renormalize=True)),
            "gpt_oss": (gpt_oss, moe.moe_route(hidden @ gpt_oss.weight.T + gpt_oss.bias, 4,
                                               scoring="topk_then_softmax")),
            "deepseek": (deepseek, moe.moe_route(
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
# moe_align

ALIGN_SMALL = {
    "block_pairs": 8,
    "count": {"block_sizes": [4], "num_warps": 4, "num_stages": 1},
    "offsets": {"block_sizes": [2, 4], "num_warps": 4, "num_stages": 1},
    "scatter": {"num_warps": 4, "num_stages": 1},
}


def align_case(tokens, experts, top_k, block_m, *, pattern="spread", ids_dtype=torch.int64, config=None):
    name = (f"T{tokens}-E{experts}-k{top_k}-bm{block_m}-{pattern}-{_dtype(ids_dtype)}"
            + ("-small" if config else ""))

    def make():
        return routing_ids(tokens, experts, top_k, _generator(name), pattern).to(ids_dtype), experts, block_m

    return Case(name, make, config)


ALIGN_CASES = [
    align_case(9, 5, 2, 4),
    align_case(1, 3, 1, 16),  # one token, fewer pairs than a block
    align_case(2, 7, 7, 4, ids_dtype=torch.int32),  # top-E
    align_case(6, 13, 1, 4, pattern="one_expert"),
    align_case(11, 13, 2, 8, pattern="two_experts"),  # experts without tokens
    align_case(10, 5, 2, 4, pattern="sentinels"),
    align_case(23, 7, 3, 4, config=ALIGN_SMALL),  # several pair blocks: the prefix over blocks
    align_case(0, 5, 2, 16),
]


def assert_alignment_invariants(topk_ids: torch.Tensor, num_experts: int, block_m: int, alignment) -> None:
    """What the GEMM relies on, checked from first principles (not against the reference)."""
    sorted_pairs, block_experts, offsets = (t.cpu().to(torch.int64) for t in alignment)
    flat = topk_ids.reshape(-1).cpu().to(torch.int64)
    pairs = flat.numel()
    assert sorted_pairs.shape == (max_slots(pairs, num_experts, block_m),)
    assert block_experts.shape == (sorted_pairs.numel() // block_m,)
    assert offsets.shape == (num_experts + 2,) and offsets[0] == 0
    assert bool((offsets[1:] >= offsets[:-1]).all()), f"offsets not monotone: {offsets}"
    assert bool((offsets % block_m == 0).all()), f"segments not padded to {block_m}: {offsets}"
    listed = sorted_pairs[sorted_pairs < pairs]
    # every pair appears exactly once, so every token appears top_k times
    assert torch.equal(listed.sort().values, torch.arange(pairs)), "pairs missing or repeated"
    assert bool((sorted_pairs[sorted_pairs >= pairs] == pairs).all()), "padding must hold the pair count"
    assert bool((sorted_pairs[offsets[-1]:] == pairs).all()), "rows past the last segment must be padding"
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    for expert in range(num_experts + 1):
        segment = sorted_pairs[offsets[expert]:offsets[expert + 1]]
        members = segment[segment < pairs]
        assert torch.equal(members, (bucket == expert).nonzero().squeeze(1)), f"segment {expert}: {segment}"
        assert segment.numel() - members.numel() < block_m, f"segment {expert} over-padded"
        blocks = block_experts[offsets[expert] // block_m:offsets[expert + 1] // block_m]
        assert bool((blocks == expert).all()), f"blocks of segment {expert}: {blocks}"
    assert bool((block_experts[offsets[-1] // block_m:] == -1).all())


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(moe_align_op))
@pytest.mark.parametrize("case", ALIGN_CASES, ids=repr)
def test_moe_align_dsl(provider, case, device):
    check_provider(moe_align_op, provider, case, device)
    topk_ids, experts, block_m = case.make()
    with ops.use_provider(provider, moe_align_op):
        assert_alignment_invariants(topk_ids, experts, block_m, moe.moe_align(topk_ids.to(device), experts, block_m))


@pytest.mark.parametrize("case", ALIGN_CASES, ids=repr)
def test_alignment_invariants_of_the_reference(case):
    topk_ids, experts, block_m = case.make()
    assert_alignment_invariants(topk_ids, experts, block_m, moe.moe_align(topk_ids, experts, block_m))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(tokens=st.integers(0, 40), experts=st.integers(1, 17), top_k=st.integers(1, 4),
       block_m=st.sampled_from([1, 2, 4, 16, 64]), seed=st.integers(0, 2**16), pattern=st.sampled_from(
           ["spread", "one_expert", "two_experts", "sentinels"]))
def test_fuzz_alignment_invariants(tokens, experts, top_k, block_m, seed, pattern):
    top_k = min(top_k, experts)
    ids = routing_ids(tokens, experts, top_k, torch.Generator().manual_seed(seed), pattern)
    assert_alignment_invariants(ids, experts, block_m, moe.moe_align(ids, experts, block_m))


# --------------------------------------------------------------------------------------------
# grouped_gemm

GEMM_SMALL = {"block_sizes": [16, 16], "num_warps": 4, "num_stages": 1}


def gemm_case(tokens, experts, top_k, k_in, n, dtype, *, stage="gate_up", block_m=16, transposed=False,
              bias=False, pattern="spread", scale_dtype=torch.float32, config=None):
    name = (f"{stage}-T{tokens}-E{experts}-k{top_k}-{k_in}to{n}-{_dtype(dtype)}-bm{block_m}-{pattern}"
            + ("-transposed" if transposed else "") + ("-bias" if bias else "") + ("-small" if config else ""))

    def make():
        g = _generator(name)
        ids = routing_ids(tokens, experts, top_k, g, pattern)
        sorted_pairs, block_experts, _ = moe_align_reference(ids, experts, block_m)
        rows, pairs_per_row = (tokens, top_k) if stage == "gate_up" else (tokens * top_k, 1)
        a = torch.randn(rows, k_in, generator=g).to(dtype)
        shape = (experts, k_in, n) if transposed else (experts, n, k_in)
        weight = (torch.randn(*shape, generator=g) / k_in**0.5).to(dtype)
        b = (0.5 * torch.randn(experts, n, generator=g)).to(dtype) if bias else None
        scale = torch.rand(rows * pairs_per_row, generator=g).to(scale_dtype) if stage == "down" else None
        return a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, b, scale

    return Case(name, make, config)


GEMM_CASES = [
    *(gemm_case(9, 5, 2, 13, 22, dtype) for dtype in DTYPES),  # odd K and N, a prime E
    *(gemm_case(9, 5, 2, 11, 13, dtype, stage="down", scale_dtype=sd)
      for dtype, sd in ((torch.bfloat16, torch.float32), (torch.float16, torch.float16))),
    gemm_case(7, 5, 2, 13, 22, torch.bfloat16, transposed=True, bias=True),  # gpt-oss layout
    gemm_case(7, 5, 3, 37, 45, torch.float32, block_m=4, config=GEMM_SMALL),  # masks over N and K
    gemm_case(10, 5, 2, 13, 22, torch.float32, pattern="sentinels", bias=True),  # unrouted pairs: zero rows
    gemm_case(1, 3, 1, 13, 22, torch.bfloat16, stage="down"),  # one pair
    gemm_case(0, 3, 2, 13, 22, torch.float32),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(grouped_gemm_op))
@pytest.mark.parametrize("case", GEMM_CASES, ids=repr)
def test_grouped_gemm_dsl(provider, case, device):
    check_provider(grouped_gemm_op, provider, case, device)


def test_grouped_gemm_matches_torch_grouped_mm():
    """``grouped_gemm`` on rows already sorted by expert is ``torch.nn.functional.grouped_mm``."""
    g = _generator("grouped_mm")
    counts = [3, 0, 5, 1]
    a = torch.randn(sum(counts), 24, generator=g)
    weight = torch.randn(4, 24, 12, generator=g)  # grouped_mm wants 16-byte strides
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = moe.grouped_gemm(a, weight, moe.moe_align(ids, 4, 4), transposed=True)
    torch.testing.assert_close(got, torch.nn.functional.grouped_mm(a, weight, offs=offs), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# fused_experts


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
            f"{_dtype(dtype)}-w{_dtype(weights_dtype)}-{pattern}-{layout}"
            + (f"-bm{config['block_m']}" if config else ""))

    def make():
        g = _generator(name)
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
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(tokens=st.integers(1, 12), experts=st.integers(2, 9), top_k=st.integers(1, 2),
       hidden=st.integers(1, 40), inter=st.integers(1, 24), dtype=st.sampled_from(DTYPES),
       pattern=st.sampled_from(["spread", "two_experts", "sentinels"]))
def test_fuzz_fused_experts(tokens, experts, top_k, hidden, inter, dtype, pattern):
    from tests.conftest import kernel_device

    case = fused_case(tokens, experts, min(top_k, experts), hidden, inter, dtype, pattern=pattern, config=FUSED_SHARED)
    for provider in dsl_providers(fused_experts_op):
        check_provider(fused_experts_op, provider, case, kernel_device())


@pytest.mark.gpu
def test_the_kernel_path_never_waits_for_the_device():
    """Token counts per expert stay on the device: no host synchronisation once a plan is built."""
    case = fused_case(64, 5, 2, 128, 96, torch.bfloat16)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in case.make())
    logits = torch.randn(64, 5, device="cuda")
    with ops.use_provider("helion", fused_experts_op, moe_route_op):
        fused_experts_op(*args), moe.moe_route(logits, 2)  # builds the plans (compiles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe.moe_route(logits, 2)
            fused_experts_op(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_fused_experts_is_route_align_gemm_act_gemm_combine():
    """The fused op equals its pieces composed by hand (pair order, scaling, combine)."""
    case = fused_case(9, 5, 2, 13, 11, torch.float32)
    x, w_gate_up, w_down, weights, ids, *_ = case.make()
    alignment = moe.moe_align(ids, 5, 4)
    projected = moe.grouped_gemm(x, w_gate_up, alignment, pairs_per_row=2)
    down = moe.grouped_gemm(ops.silu_and_mul(projected), w_down, alignment, scale=weights.reshape(-1))
    torch.testing.assert_close(moe.fused_experts(x, w_gate_up, w_down, weights, ids), down.view(9, 2, 13).sum(1))


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
    g = _generator(family)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=g) / 4)
    return experts.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_matches_hf_grouped_mm_experts(family, dtype):
    """The spec follows what transformers computes (the kernels follow the spec: the harness)."""
    experts = _hf_experts(family, dtype)
    g = _generator(f"{family}{dtype}")
    hidden = torch.randn(11, 32, generator=g).to(dtype)  # grouped_mm wants 16-byte strides
    weights, ids = moe.example_routing(11, 5, 2, "cpu", g)
    weights = weights.to(dtype if family != "gpt_oss" else torch.float32)
    with torch.no_grad():
        want = experts(hidden, ids, weights)
        kwargs = dict(activation="swiglu_oai", transposed=True, interleaved=True,
                      gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias) \
            if family == "gpt_oss" else {}
        got = moe.fused_experts(hidden, experts.gate_up_proj, experts.down_proj, weights, ids, **kwargs)
    assert got.dtype == want.dtype
    if dtype == torch.float32:
        relative = ((got - want).norm() / want.norm()).item()
        assert relative <= 1e-6, relative
    else:
        assert_close(got, want.double(), dtype)


# --------------------------------------------------------------------------------------------
# bad inputs

_logits = torch.randn(4, 8)
_ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
_x, _w13, _w2 = torch.randn(4, 6), torch.randn(8, 10, 6), torch.randn(8, 6, 5)
_alignment = moe.MoEAlignment(*moe_align_reference(_ids, 8, 4))

BAD_INPUTS = [
    ("moe_route: router_logits must be a torch.Tensor", lambda: moe.moe_route([[1.0]], 1)),
    ("moe_route: router_logits must be 2-D", lambda: moe.moe_route(torch.randn(2, 3, 4), 1)),
    ("moe_route: router_logits must have dtype", lambda: moe.moe_route(torch.ones(2, 3, dtype=torch.int32), 1)),
    ("moe_route: top_k must be in [1, 8]", lambda: moe.moe_route(_logits, 9)),
    ("moe_route: top_k must be an int", lambda: moe.moe_route(_logits, 2.0)),
    ("moe_route: scoring must be one of", lambda: moe.moe_route(_logits, 2, scoring="softplus")),
    ("moe_route: renormalize must be a bool", lambda: moe.moe_route(_logits, 2, renormalize=1)),
    ("moe_route: correction_bias must have shape (8,)",
     lambda: moe.moe_route(_logits, 2, scoring="sigmoid", correction_bias=torch.zeros(7))),
    ("moe_route: n_group (3) must divide", lambda: moe.moe_route(_logits, 2, scoring="sigmoid", n_group=3)),
    ("moe_route: topk_group must be in [1, 4]",
     lambda: moe.moe_route(_logits, 2, scoring="sigmoid", n_group=4, topk_group=5)),
    ("needs scoring='sigmoid'", lambda: moe.moe_route(_logits, 2, n_group=2)),
    ("moe_route: top_k (5) exceeds the 4 experts",
     lambda: moe.moe_route(_logits, 5, scoring="sigmoid", n_group=4, topk_group=2)),
    ("moe_route: routed_scaling_factor must be finite",
     lambda: moe.moe_route(_logits, 2, routed_scaling_factor=float("nan"))),
    ("moe_align: topk_ids must have dtype int32, int64", lambda: moe.moe_align(_ids.float(), 8, 4)),
    ("moe_align: topk_ids must be 2-D", lambda: moe.moe_align(_ids.reshape(-1), 8, 4)),
    ("moe_align: num_experts must be >= 1", lambda: moe.moe_align(_ids, 0, 4)),
    ("moe_align: block_m must be a power of two", lambda: moe.moe_align(_ids, 8, 6)),
    ("moe_align: block_m must be in [1, 256]", lambda: moe.moe_align(_ids, 8, 512)),
    ("grouped_gemm: weight must have the dtype of a", lambda: moe.grouped_gemm(_x, _w13.double(), _alignment)),
    ("grouped_gemm: weight must be [E, N, K] with E, N >= 1 and K = a.shape[1] = 6",
     lambda: moe.grouped_gemm(_x, _w2, _alignment)),
    ("grouped_gemm: weight must be [E, K, N]", lambda: moe.grouped_gemm(_x, _w13, _alignment, transposed=True)),
    ("grouped_gemm: sorted_pairs must have dtype int32",
     lambda: moe.grouped_gemm(_x, _w13, _alignment._replace(sorted_pairs=_alignment.sorted_pairs.long()))),
    ("grouped_gemm: sorted_pairs (32 rows) must hold a power-of-two number of rows",
     lambda: moe.grouped_gemm(_x, _w13, _alignment._replace(block_experts=_alignment.block_experts[:3]))),
    ("grouped_gemm: bias must have shape (8, 10)",
     lambda: moe.grouped_gemm(_x, _w13, _alignment, bias=torch.zeros(8, 6))),
    ("grouped_gemm: scale must have shape (8,)",
     lambda: moe.grouped_gemm(_x, _w13, _alignment, pairs_per_row=2, scale=torch.ones(4))),
    ("grouped_gemm: pairs_per_row must be >= 1", lambda: moe.grouped_gemm(_x, _w13, _alignment, pairs_per_row=0)),
    ("fused_experts: hidden must be 2-D", lambda: moe.fused_experts(_x[None], _w13, _w2, _ids.float(), _ids)),
    ("fused_experts: w_gate_up must have the dtype of hidden",
     lambda: moe.fused_experts(_x, _w13.half(), _w2, _ids.float(), _ids)),
    ("fused_experts: w_gate_up must be [E, 2I, H]",
     lambda: moe.fused_experts(_x, torch.randn(8, 10, 5), _w2, _ids.float(), _ids)),
    ("fused_experts: w_gate_up must be [E, H, 2I]",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids, transposed=True)),
    ("fused_experts: w_down must be [E, H, I] = (8, 6, 5)",
     lambda: moe.fused_experts(_x, _w13, torch.randn(8, 6, 4), _ids.float(), _ids)),
    ("fused_experts: topk_ids must have shape (4, top_k >= 1)",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float()[:3], _ids[:3])),
    ("fused_experts: topk_ids must have dtype int32, int64",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids.float())),
    ("fused_experts: topk_weights must have the shape of topk_ids",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float()[:, :1], _ids)),
    ("fused_experts: gate_up_bias must have shape (8, 10)",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids, gate_up_bias=torch.zeros(8, 5))),
    ("fused_experts: activation must be one of",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids, activation="relu")),
    ("fused_experts: interleaved gate/up columns are gpt-oss's layout",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids, interleaved=True)),
    ("fused_experts: swiglu_limit must be > 0",
     lambda: moe.fused_experts(_x, _w13, _w2, _ids.float(), _ids, activation="swiglu_oai", swiglu_limit=0.0)),
    ("fused_experts: hidden must have at least one column",
     lambda: moe.fused_experts(_x[:, :0], _w13[..., :0], _w2[:, :0], _ids.float(), _ids)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()


def test_bad_inputs_leave_the_arguments_untouched():
    hidden, ids = _x.clone(), _ids.clone()
    with pytest.raises(ValueError):
        moe.fused_experts(hidden, _w13, _w2, _ids.float(), ids, interleaved=True)
    assert torch.equal(hidden, _x) and torch.equal(ids, _ids)


def test_reference_keeps_dtypes_and_shapes():
    weights, ids = moe.moe_route(torch.randn(3, 8).to(torch.bfloat16), 2)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (3, 2)
    out = moe.fused_experts(_x.to(torch.bfloat16), _w13.to(torch.bfloat16), _w2.to(torch.bfloat16), _ids.float(), _ids)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 6)
