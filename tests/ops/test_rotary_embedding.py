"""rotary_embedding: DSL vs reference, bit-parity with HF's apply_rotary_pos_emb, layout, bad inputs."""

from __future__ import annotations

import re
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_partial_rotary
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

from hw_agnostic import ops
from hw_agnostic.ops.rotary_embedding import rope_tables, rotary_embedding_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: block sizes: the q loop's [batch, heads, tokens, half, pass-through], then the k loop's
SMALL_CONFIG = {"block_sizes": [1, 2, 2, 4, 2, 1, 1, 2, 4, 2], "num_warps": 2, "num_stages": 1}


def _heads(batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype, layout: str,
           g: torch.Generator) -> torch.Tensor:
    """``[B, H, T, D]`` as attention modules hand it over."""
    if layout == "projection":  # HF: q_proj(x).view(B, T, H, D).transpose(1, 2)
        return torch.randn(batch, tokens, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    if layout == "contiguous":
        return torch.randn(batch, heads, tokens, head_dim, generator=g).to(dtype)
    if layout == "fused_qkv":  # a slice of a wider projection output, e.g. q of a merged qkv
        wide = torch.randn(batch, tokens, heads, head_dim + 7, generator=g).to(dtype)
        return wide[..., 3:3 + head_dim].transpose(1, 2)
    raise ValueError(layout)


def rotary_case(batch, tokens, q_heads, k_heads, head_dim, dtype, *, rotary_dim=None, layout="projection",
                shared_table=True, table_dtype=None, config=None, position_offset=0):
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    table_dtype = dtype if table_dtype is None else table_dtype
    name = (f"b{batch}t{tokens}-h{q_heads}k{k_heads}-d{head_dim}r{rotary_dim}-{str(dtype).removeprefix('torch.')}"
            f"-{layout}" + ("" if shared_table else "-per-row") + (f"-table-{table_dtype}" if table_dtype != dtype else "")
            + ("-small" if config else "") + (f"-at{position_offset}" if position_offset else ""))

    def make():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q = _heads(batch, tokens, q_heads, head_dim, dtype, layout, g)
        k = _heads(batch, tokens, k_heads, head_dim, dtype, layout, g)
        cos, sin = rope_tables(position_offset + tokens, rotary_dim, table_dtype, "cpu",
                               batch=1 if shared_table else batch)
        cos, sin = cos[:, position_offset:], sin[:, position_offset:]
        return q, k, cos, sin

    decline = "cos/sin of another dtype type-promote the result" if table_dtype != dtype else None
    return Case(name, make, config, expected_decline=decline)


CASES = [
    *[rotary_case(1, 1, 32, 8, 128, dtype, position_offset=15) for dtype in DTYPES],  # a Llama-3-8B decode step
    *[rotary_case(2, 7, 4, 2, 64, dtype) for dtype in DTYPES],
    rotary_case(2, 7, 4, 2, 64, torch.bfloat16, config=SMALL_CONFIG),  # many programs: slow in the Triton interpreter
    rotary_case(2, 5, 4, 4, 64, torch.bfloat16, shared_table=False),
    rotary_case(1, 9, 6, 2, 80, torch.float16, rotary_dim=32),  # partial rotary (GPT-NeoX, Phi)
    rotary_case(3, 4, 2, 1, 96, torch.bfloat16, rotary_dim=48, config=SMALL_CONFIG),
    rotary_case(2, 3, 3, 1, 20, torch.float32, rotary_dim=6, layout="fused_qkv"),
    rotary_case(2, 3, 4, 2, 32, torch.bfloat16, layout="contiguous"),
    rotary_case(1, 0, 4, 2, 64, torch.bfloat16),
    rotary_case(1, 3, 1, 1, 2, torch.float32),
    rotary_case(1, 4, 2, 2, 64, torch.bfloat16, table_dtype=torch.float32),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(rotary_embedding_op))
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_rotary_embedding_dsl(case, provider, device):
    check_provider(rotary_embedding_op, provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(6, 40), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.integers(1, 3), tokens=st.integers(1, 6), q_heads=st.integers(1, 5), group=st.integers(1, 3),
    half=st.integers(1, 40), passed=st.sampled_from([0, 0, 3, 16]), dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["projection", "contiguous", "fused_qkv"]), shared_table=st.booleans(),
)
def test_fuzz_shapes_and_layouts(batch, tokens, q_heads, group, half, passed, dtype, layout, shared_table):
    from tests.conftest import kernel_device

    k_heads = max(1, q_heads // group)
    case = rotary_case(batch, tokens, q_heads, k_heads, 2 * half + passed, dtype, rotary_dim=2 * half,
                       layout=layout, shared_table=shared_table)
    for provider in dsl_providers(rotary_embedding_op):
        check_provider(rotary_embedding_op, provider, case, kernel_device())


# --------------------------------------------------------------------------------------------
# parity with Hugging Face's own functions, bit for bit


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(rotary_embedding_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


HF_FUNCTIONS = {"llama": (llama_rotary, None), "gpt_neox_partial": (neox_partial_rotary, 16)}


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", sorted(HF_FUNCTIONS))
def test_matches_hf_bit_for_bit(model, dtype, provider):
    """HF rounds each product and their sum to the dtype; so do the reference and the kernel.

    The GPU compiler may contract a product and the sum into one FMA in fp32 (eager PyTorch does
    not), so on a GPU fp32 is held to one ulp; everything else must be bit-equal.
    """
    from tests.conftest import kernel_device

    function, rotary_dim = HF_FUNCTIONS[model]
    device = "cpu" if provider == "reference" else kernel_device()
    q, k, cos, sin = (t.to(device) for t in rotary_case(2, 6, 8, 2, 64, dtype, rotary_dim=rotary_dim,
                                                          position_offset=1000).make())
    q, k, cos, sin = q * 4, k * 4, cos, sin  # products well away from zero, where roundings show
    want = function(q, k, cos, sin)
    with ops.use_provider(provider), ops.trace_dispatch() as ran:
        got = ops.rotary_embedding(q, k, cos, sin)
    assert [p.provider for p in ran] == [provider]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if device != "cpu" and dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=2e-7, atol=1e-6)
        else:
            assert torch.equal(g, w), f"max difference {(g.double() - w.double()).abs().max().item()}"


def test_results_are_laid_out_like_the_inputs_and_the_inputs_are_kept():
    q, k, cos, sin = rotary_case(2, 5, 4, 2, 32, torch.bfloat16, layout="fused_qkv", rotary_dim=16).make()
    before = [t.clone() for t in (q, k, cos, sin)]
    q_embed, k_embed = ops.rotary_embedding(q, k, cos, sin)
    assert q_embed.stride() == torch.empty_like(q).stride() and k_embed.stride() == torch.empty_like(k).stride()
    assert all(torch.equal(t, b) for t, b in zip((q, k, cos, sin), before))
    fake = torch.library.opcheck  # the fake implementation agrees with the real one on strides too
    fake(torch.ops.hw_agnostic.rotary_embedding.default, (q, k, cos, sin))


def test_type_promotion_follows_hf():
    q, k, cos, sin = rotary_case(1, 4, 2, 2, 64, torch.bfloat16, table_dtype=torch.float32).make()
    got, want = ops.rotary_embedding(q, k, cos, sin), llama_rotary(q, k, cos, sin)
    assert got[0].dtype == want[0].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_nan_and_inf_propagate_as_in_hf():
    q, k, cos, sin = rotary_case(1, 3, 2, 1, 8, torch.float32).make()
    q[0, 0, 0, 0], q[0, 1, 1, 5], k[0, 0, 2, 3] = float("nan"), float("inf"), float("-inf")
    got, want = ops.rotary_embedding(q, k, cos, sin), llama_rotary(q, k, cos, sin)
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w)) and torch.equal(g.nan_to_num(), w.nan_to_num())


def test_gradients_are_the_references():
    q, k, cos, sin = (t.double().requires_grad_() for t in rotary_case(1, 3, 2, 1, 16, torch.float32, rotary_dim=8).make())
    assert torch.autograd.gradcheck(lambda *a: ops.rotary_embedding(*a), (q, k, cos, sin))


def test_traces_into_a_full_graph():
    q, k, cos, sin = rotary_case(1, 4, 4, 2, 32, torch.float32).make()
    compiled = torch.compile(lambda *a: [t + 1 for t in ops.rotary_embedding(*a)], fullgraph=True, backend="eager")
    got = compiled(q, k, cos, sin)
    want = ops.rotary_embedding(q, k, cos, sin)
    assert torch.equal(got[0], want[0] + 1) and torch.equal(got[1], want[1] + 1)


BAD_INPUTS = [
    ("q must be a torch.Tensor", lambda q, k, c, s: ops.rotary_embedding(None, k, c, s)),
    ("q must have dtype", lambda q, k, c, s: ops.rotary_embedding(q.int(), k, c, s)),
    ("q must be [batch, heads, tokens, head_dim] (4-D)", lambda q, k, c, s: ops.rotary_embedding(q[0], k, c, s)),
    ("k must have the dtype of q", lambda q, k, c, s: ops.rotary_embedding(q, k.half(), c, s)),
    ("k is on meta but q is on cpu", lambda q, k, c, s: ops.rotary_embedding(q, k.to("meta"), c, s)),
    ("k must match q's batch, tokens and head_dim", lambda q, k, c, s: ops.rotary_embedding(q, k[..., :8], c, s)),
    ("cos must be [batch or 1, tokens, rotary_dim] (3-D)", lambda q, k, c, s: ops.rotary_embedding(q, k, c[0], s[0])),
    ("sin must have the shape of cos", lambda q, k, c, s: ops.rotary_embedding(q, k, c, s[..., :4])),
    ("sin must have the dtype of cos", lambda q, k, c, s: ops.rotary_embedding(q, k, c, s.double())),
    ("cos and sin must be [2 or 1, 3, rotary_dim]", lambda q, k, c, s: ops.rotary_embedding(q, k, c[:, :2], s[:, :2])),
    ("cos and sin must be [2 or 1, 3, rotary_dim]",
     lambda q, k, c, s: ops.rotary_embedding(q, k, c.expand(3, -1, -1), s.expand(3, -1, -1))),
    ("rotary dim (cos.shape[-1]) must be even and within 2..head_dim (16); got 5",
     lambda q, k, c, s: ops.rotary_embedding(q, k, c[..., :5], s[..., :5])),
    ("got 32", lambda q, k, c, s: ops.rotary_embedding(q, k, torch.cat([c, c], -1), torch.cat([s, s], -1))),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    q, k, cos, sin = rotary_case(2, 3, 4, 2, 16, torch.float32).make()
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call(q, k, cos, sin)
