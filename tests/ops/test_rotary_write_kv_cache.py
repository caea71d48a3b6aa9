"""rotary_write_kv_cache: DSL vs reference, the same bits as rotary_embedding then write_kv_cache, bad inputs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops.rotary_embedding import rope_tables
from hw_agnostic.ops.rotary_write_kv_cache import rotary_write_kv_cache_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator
from tests.ops.test_rotary_embedding import _heads  # q, k and v as attention modules hand them over

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: block sizes: the q loop's [tokens, heads, half, pass-through], the k loop's, then the values' dim
SMALL_CONFIG = {"block_sizes": [2, 2, 4, 2, 2, 1, 4, 2, 16], "num_warps": 2, "num_stages": 1}


def fused_case(batch, tokens, q_heads, k_heads, head_dim, dtype, *, rotary_dim=None, layout="projection",
               shared_table=True, block_size=16, padding=0, slot_dtype=torch.int64, cache_layout="contiguous",
               config=None, position_offset=0):
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    name = (f"b{batch}t{tokens}-h{q_heads}k{k_heads}-d{head_dim}r{rotary_dim}-{str(dtype).removeprefix('torch.')}"
            f"-{layout}" + ("" if shared_table else "-per-row") + f"-bs{block_size}" + (f"-pad{padding}" if padding else "")
            + ("-int32" if slot_dtype == torch.int32 else "") + (f"-{cache_layout}" if cache_layout != "contiguous" else "")
            + ("-small" if config else "") + (f"-at{position_offset}" if position_offset else ""))

    def make():
        g = seeded_generator(name)
        q = _heads(batch, tokens, q_heads, head_dim, dtype, layout, g)
        k = _heads(batch, tokens, k_heads, head_dim, dtype, layout, g)
        v = _heads(batch, tokens, k_heads, head_dim, dtype, layout, g)
        cos, sin = rope_tables(position_offset + tokens, rotary_dim, dtype, "cpu", batch=1 if shared_table else batch)
        cos, sin = cos[:, position_offset:], sin[:, position_offset:]
        num_blocks = -(-batch * tokens // block_size) + 2
        shape = (num_blocks, block_size, k_heads, head_dim)
        if cache_layout == "view":  # blocks of a wider buffer: block and slot dims do not merge
            k_cache = torch.randn(num_blocks, block_size + 1, k_heads, head_dim, generator=g).to(dtype)[:, 1:]
            v_cache = torch.randn(num_blocks, block_size + 1, k_heads, head_dim, generator=g).to(dtype)[:, 1:]
        else:
            k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:batch * tokens]
        slots[torch.randperm(batch * tokens, generator=g)[:padding]] = -1
        return q, k, v, cos, sin, k_cache, v_cache, slots.to(slot_dtype)

    decline = None
    if layout == "contiguous" and batch > 1 and tokens > 1:
        decline = "row-major [B, H, T, D] heads do not merge batch and tokens into one row per token"
    elif cache_layout == "view":
        decline = "the caches' block and slot dims do not merge into one slot stride"
    return Case(name, make, config, expected_decline=decline)


CASES = [
    *[fused_case(1, 1, 32, 8, 128, dtype, position_offset=15) for dtype in DTYPES],  # a Llama-3-8B decode step
    *[fused_case(2, 7, 4, 2, 64, dtype, padding=2) for dtype in DTYPES],
    fused_case(2, 7, 4, 2, 64, torch.bfloat16, config=SMALL_CONFIG),  # many programs: slow in the Triton interpreter
    fused_case(2, 5, 4, 4, 64, torch.bfloat16, shared_table=False, slot_dtype=torch.int32),
    fused_case(1, 9, 6, 2, 80, torch.float16, rotary_dim=32, block_size=4),  # partial rotary (GPT-NeoX, Phi)
    fused_case(3, 4, 2, 1, 96, torch.bfloat16, rotary_dim=48, config=SMALL_CONFIG),
    fused_case(2, 3, 3, 1, 20, torch.float32, rotary_dim=6, layout="fused_qkv", block_size=1),
    fused_case(3, 1, 4, 2, 32, torch.bfloat16, layout="contiguous"),  # one token a row: rows merge
    fused_case(2, 3, 4, 2, 32, torch.bfloat16, layout="contiguous"),
    fused_case(2, 3, 4, 2, 32, torch.float16, cache_layout="view"),
    fused_case(1, 0, 4, 2, 64, torch.bfloat16),
    fused_case(1, 3, 1, 1, 2, torch.float32, padding=3),
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(rotary_write_kv_cache_op))
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_rotary_write_kv_cache_dsl(case, provider, device):
    check_provider(rotary_write_kv_cache_op, provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(4, 30), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.integers(1, 3), tokens=st.integers(1, 5), q_heads=st.integers(1, 4), group=st.integers(1, 2),
    half=st.integers(1, 24), passed=st.sampled_from([0, 0, 3, 16]), dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["projection", "fused_qkv"]), shared_table=st.booleans(),
    block_size=st.sampled_from([1, 4, 16]), padding=st.integers(0, 2),
)
def test_fuzz_shapes_and_layouts(batch, tokens, q_heads, group, half, passed, dtype, layout, shared_table, block_size,
                                 padding):
    from tests.conftest import kernel_device

    case = fused_case(batch, tokens, q_heads, max(1, q_heads // group), 2 * half + passed, dtype, rotary_dim=2 * half,
                      layout=layout, shared_table=shared_table, block_size=block_size,
                      padding=min(padding, batch * tokens))
    for provider in dsl_providers(rotary_write_kv_cache_op):
        check_provider(rotary_write_kv_cache_op, provider, case, kernel_device())


# --------------------------------------------------------------------------------------------
# the same bits as the two ops it fuses


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(rotary_write_kv_cache_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[8]], ids=repr)
def test_the_same_bits_as_rotary_embedding_then_write_kv_cache(case, provider):
    """What the direct attention path relies on to call it in place of the two ops."""
    from tests.conftest import kernel_device

    device = kernel_device() if provider != "reference" else "cpu"
    q, k, v, cos, sin, k_cache, v_cache, slots = (t.to(device) for t in case.make())
    want_q, want_k = ops.rotary_embedding(q, k, cos, sin)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    batch, heads, tokens, dim = k.shape
    ops.write_kv_cache(want_k.transpose(1, 2).reshape(-1, heads, dim), v.transpose(1, 2).reshape(-1, heads, dim),
                       want_k_cache, want_v_cache, slots)
    with ops.use_provider(provider, rotary_write_kv_cache_op):
        got_q, got_k = ops.rotary_write_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    for got, want in ((got_q, want_q), (got_k, want_k), (k_cache, want_k_cache), (v_cache, want_v_cache)):
        assert torch.equal(got, want)
    assert got_q.transpose(1, 2).is_contiguous() and got_k.transpose(1, 2).is_contiguous()  # tokens-major


def test_results_are_new_and_the_caches_bump_their_versions():
    q, k, v, cos, sin, k_cache, v_cache, slots = CASES[3].make()
    versions = k_cache._version, v_cache._version
    q_embed, k_embed = ops.rotary_write_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    assert q_embed.data_ptr() != q.data_ptr() and k_embed.data_ptr() != k.data_ptr()


def test_fake_opcheck_and_compile():
    args = CASES[3].make()
    torch.library.opcheck(torch.ops.hw_agnostic.rotary_write_kv_cache.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    fresh = CASES[3].make()
    compiled = torch.compile(lambda *a: [t + 1 for t in ops.rotary_write_kv_cache(*a)], fullgraph=True, backend="eager")
    got = compiled(*fresh)
    want = ops.rotary_write_kv_cache(*args)
    assert all(torch.equal(g, w + 1) for g, w in zip(got, want))
    assert torch.equal(fresh[5], args[5]) and torch.equal(fresh[6], args[6])


# --------------------------------------------------------------------------------------------
# bad inputs


def _call(**overrides):
    g = torch.Generator().manual_seed(0)
    args = {"q": torch.randn(1, 3, 4, 16, generator=g).transpose(1, 2), "k": torch.randn(1, 3, 2, 16, generator=g).transpose(1, 2),
            "v": torch.randn(1, 3, 2, 16, generator=g).transpose(1, 2), "cos": torch.ones(1, 3, 16),
            "sin": torch.zeros(1, 3, 16), "k_cache": torch.zeros(2, 4, 2, 16), "v_cache": torch.zeros(2, 4, 2, 16),
            "slot_mapping": torch.tensor([0, 5, -1])}
    args.update(overrides)
    return args, lambda: ops.rotary_write_kv_cache(*args.values())


BAD_INPUTS = [
    ("rotary_write_kv_cache: q must be a torch.Tensor", {"q": None}),
    ("rotary_write_kv_cache: k must have the dtype of q", {"k": torch.ones(1, 2, 3, 16, dtype=torch.float16)}),
    ("rotary_write_kv_cache: cos must be [batch or 1, tokens, rotary_dim] (3-D)", {"cos": torch.ones(3, 16)}),
    ("v must have the shape of k", {"v": torch.ones(1, 2, 2, 16)}),
    ("v must have dtype", {"v": torch.ones(1, 2, 3, 16, dtype=torch.int32)}),
    ("k has 2 heads of dim 16 but the cache holds 2 heads of dim 8", {"k_cache": torch.zeros(2, 4, 2, 8),
                                                                       "v_cache": torch.zeros(2, 4, 2, 8)}),
    ("v_cache must have the shape of k_cache", {"v_cache": torch.zeros(3, 4, 2, 16)}),
    ("the rotated keys (torch.float32: k's and cos's dtypes promoted) must have the cache's dtype (torch.bfloat16)",
     {"k_cache": torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16), "v_cache": torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)}),
    ("slot_mapping must have dtype int32 or int64", {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}),
    ("slot_mapping must have one slot per token (batch * tokens = 3); got 2", {"slot_mapping": torch.tensor([0, 1])}),
    ("slot_mapping holds slot 8, past the cache's 8 slots", {"slot_mapping": torch.tensor([0, 8, -1])}),
    ("slot_mapping writes one slot twice", {"slot_mapping": torch.tensor([2, 2, -1])}),
]


@pytest.mark.parametrize("message, overrides", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, overrides):
    args, call = _call(**overrides)
    caches = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1])


def test_caches_that_share_memory_with_an_input_are_refused():
    args, _ = _call()
    buffer = torch.zeros(2, 4, 2, 16)
    args["k_cache"], args["k"] = buffer, buffer[0, :3].unsqueeze(0).transpose(1, 2)
    with pytest.raises(ValueError, match="k_cache and k share memory"):
        ops.rotary_write_kv_cache(*args.values())
