"""write_kv_cache: DSL vs reference, the spec's own semantics, bad inputs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hw_agnostic.ops.write_kv_cache import write_kv_cache, write_kv_cache_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator


def write_case(name: str, tokens: int, *, heads: int = 2, head_dim: int = 64, block_size: int = 16,
               num_blocks: int = 5, dtype: torch.dtype = torch.float32, slot_dtype: torch.dtype = torch.int64,
               padding: int = 1, key_layout: str = "contiguous", cache_layout: str = "contiguous",
               config: dict | None = None) -> Case:
    def make():
        g = seeded_generator(name)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
        slots[torch.randperm(tokens, generator=g)[:padding]] = -1
        if key_layout == "fused":  # key and value are views of a fused QKV projection
            fused = torch.randn(tokens, 3 * heads * head_dim, generator=g).to(dtype)
            key = fused[:, heads * head_dim: 2 * heads * head_dim].view(tokens, heads, head_dim)
            value = fused[:, 2 * heads * head_dim:].view(tokens, heads, head_dim)
        else:
            key = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
            value = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
        shape = (num_blocks, block_size, heads, head_dim)
        if cache_layout == "view":
            k_cache = torch.randn(num_blocks + 2, *shape[1:], generator=g).to(dtype)[1:-1]
            v_cache = torch.randn(num_blocks + 2, *shape[1:], generator=g).to(dtype)[1:-1]
        else:
            k_cache = torch.randn(shape, generator=g).to(dtype)
            v_cache = torch.randn(shape, generator=g).to(dtype)
        return key, value, k_cache, v_cache, slots.to(slot_dtype)

    return Case(name, make, config)


WRITE_CASES = [
    write_case("write-fp32", 13),
    write_case("write-bf16-int32-slots", 9, dtype=torch.bfloat16, slot_dtype=torch.int32),
    write_case("write-fp16-hd80-small-blocks", 7, heads=3, head_dim=80, dtype=torch.float16,
               config={"block_sizes": [2, 2, 32], "num_warps": 4, "num_stages": 1}),
    write_case("write-fused-key-cache-views", 11, key_layout="fused", cache_layout="view", block_size=64, num_blocks=2),
    write_case("write-all-padding", 3, padding=3),
    write_case("write-one-token", 1, padding=0),
    write_case("write-no-tokens", 0, padding=0),
]


# --------------------------------------------------------------------------------------------
# DSL providers vs the reference


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(write_kv_cache_op))
@pytest.mark.parametrize("case", WRITE_CASES, ids=repr)
def test_write_kv_cache_dsl(provider, case, device):
    check_provider(write_kv_cache_op, provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(6, 40), deadline=None, suppress_health_check=list(HealthCheck))
@given(tokens=st.integers(0, 24), heads=st.integers(1, 4), head_dim=st.sampled_from([16, 32, 80]),
       block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 8), padding=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]), key_layout=st.sampled_from(["contiguous", "fused"]),
       cache_layout=st.sampled_from(["contiguous", "view"]))
def test_fuzz_writes(tokens, heads, head_dim, block_size, num_blocks, padding, dtype, slot_dtype, key_layout,
                     cache_layout):
    from tests.conftest import kernel_device

    assume(tokens <= num_blocks * block_size)
    case = write_case(f"fuzz-{tokens}-{heads}-{head_dim}-{block_size}-{num_blocks}-{padding}", tokens, heads=heads,
                      head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, dtype=dtype,
                      slot_dtype=slot_dtype, padding=min(padding, tokens), key_layout=key_layout,
                      cache_layout=cache_layout)
    for provider in dsl_providers(write_kv_cache_op):
        check_provider(write_kv_cache_op, provider, case, kernel_device())


# --------------------------------------------------------------------------------------------
# the reference's own semantics (runs everywhere)


def test_write_kv_cache_skips_padding_and_leaves_other_slots():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key, value = torch.ones(3, 1, 8), 2 * torch.ones(3, 1, 8)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache[1, 1].eq(1).all() and k_cache[0, 0].eq(1).all() and v_cache[1, 1].eq(2).all()
    assert k_cache.sum() == 2 * 8 and v_cache.sum() == 2 * 2 * 8


# --------------------------------------------------------------------------------------------
# bad inputs


def _write(**overrides):
    args = {"key": torch.ones(3, 2, 16), "value": torch.ones(3, 2, 16), "k_cache": torch.zeros(2, 4, 2, 16),
            "v_cache": torch.zeros(2, 4, 2, 16), "slot_mapping": torch.tensor([0, 5, -1])}
    args.update(overrides)
    return lambda: write_kv_cache(*args.values())


BAD_INPUTS = [
    ("key has 2 heads of dim 8 but the cache holds 2 heads of dim 16", _write(key=torch.ones(3, 2, 8))),
    ("value must have the shape of key", _write(value=torch.ones(2, 2, 16))),
    ("key must have the cache's dtype", _write(key=torch.ones(3, 2, 16, dtype=torch.bfloat16))),
    ("slot_mapping must have dtype int32 or int64", _write(slot_mapping=torch.tensor([0.0, 1.0, 2.0]))),
    ("slot_mapping must have one slot per token (3)", _write(slot_mapping=torch.tensor([0, 1]))),
    ("slot_mapping holds slot 8, past the cache's 8 slots", _write(slot_mapping=torch.tensor([0, 8, -1]))),
    ("slot_mapping writes one slot twice", _write(slot_mapping=torch.tensor([2, 2, -1]))),
    ("v_cache must have the shape of k_cache", _write(v_cache=torch.zeros(3, 4, 2, 16))),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()


def test_a_bad_slot_leaves_the_caches_alone():
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError):
        write_kv_cache(torch.ones(2, 2, 16), torch.ones(2, 2, 16), k_cache, v_cache, torch.tensor([1, 99]))
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0
