"""paged_attention: DSL vs reference, the spec vs Hugging Face attention, bad inputs."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.autotune.keys import token_bucket
from hw_agnostic.kernels import paged_attention as kernels
from hw_agnostic.ops.paged_attention import (
    example_paged_batch, paged_attention, paged_attention_op, widest_alike_kv_len,
)
from hw_agnostic.ops.write_kv_cache import write_kv_cache, write_kv_cache_op
from hw_agnostic.tolerances import assert_close
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator

SMALL_BLOCKS = {"block_sizes": [16, 16], "num_warps": 4, "num_stages": 1, "num_splits": 1}


def attention_case(
    name: str,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    heads: tuple[int, int] = (8, 2),
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    config: dict | None = None,
    unowned_rows: int = 0,
    leading_rows: int = 0,
    q_layout: str = "contiguous",
    cache_layout: str = "contiguous",
    table_layout: str = "contiguous",
    hints: bool = True,
) -> Case:
    """A varlen batch: sequence ``s`` has ``q_lens[s]`` new queries and ``kv_lens[s]`` keys in the cache.

    ``unowned_rows`` appends query rows no sequence owns (padding of a captured batch) and
    ``leading_rows`` puts such rows before the first sequence (``cu_seqlens_q[0] > 0``);
    ``q_layout="fused"`` makes ``q`` a strided view of a fused QKV projection; ``cache_layout="view"``
    makes the caches views into a larger buffer (as Hugging Face's paged cache hands them over), so
    the harness also checks nothing outside them is touched. ``table_layout="wide"`` makes the block
    table the first columns of a wider one whose other columns name no block (a persistent table
    sliced to the batch), ``"column_major"`` one whose columns are contiguous.
    """
    num_q_heads, num_kv_heads = heads

    def make():
        g = seeded_generator(name)
        q, k_cache, v_cache, table, cu, lens = example_paged_batch(
            q_lens, kv_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, dtype=dtype, device="cpu", generator=g,
        )
        if unowned_rows:
            q = torch.cat([q, torch.randn(unowned_rows, num_q_heads, head_dim, generator=g).to(dtype)])
        if leading_rows:
            q = torch.cat([torch.randn(leading_rows, num_q_heads, head_dim, generator=g).to(dtype), q])
            cu = cu + leading_rows
        if q_layout == "fused":
            width = (num_q_heads + 2 * num_kv_heads) * head_dim
            fused = torch.randn(q.shape[0], width, generator=g).to(dtype)
            fused[:, : num_q_heads * head_dim] = q.reshape(q.shape[0], -1)
            q = fused[:, : num_q_heads * head_dim].view(q.shape[0], num_q_heads, head_dim)
        if cache_layout == "view":
            def embed(cache):
                buffer = torch.randn(cache.shape[0] + 3, *cache.shape[1:], generator=g).to(dtype)
                buffer[2:-1] = cache
                return buffer[2:-1]
            k_cache, v_cache = embed(k_cache), embed(v_cache)
        if table_layout == "wide":
            wide = torch.full((table.shape[0], table.shape[1] + 5), 1 << 20, dtype=table.dtype)
            wide[:, : table.shape[1]] = table
            table = wide[:, : table.shape[1]]
        elif table_layout == "column_major":
            table = table.t().contiguous().t()
        sink_logits = torch.randn(num_q_heads, generator=g) if sinks else None
        max_q, max_kv = (max(q_lens, default=0), max(kv_lens, default=0)) if hints else (None, None)
        return (q, k_cache, v_cache, table, cu, lens, head_dim**-0.5, window, softcap, sink_logits, max_q, max_kv)

    return Case(name, make, config)


def split_config(num_splits: int) -> dict:
    return {"block_sizes": [16, 16], "num_warps": 4, "num_stages": 1, "num_splits": num_splits}


ATTENTION_CASES = [
    # mixed prefill + decode: a chunk with cached context, a decode step, a fresh prompt; lengths
    # across block boundaries and not multiples of the block size
    attention_case("mixed-gqa4-fp32", [5, 1, 12], [37, 16, 12]),
    attention_case("mixed-gqa4-bf16", [5, 1, 12], [37, 16, 12], dtype=torch.bfloat16),
    attention_case("mixed-gqa4-fp16-small-blocks", [3, 1, 9], [33, 50, 9], dtype=torch.float16, config=SMALL_BLOCKS),
    # a long prompt beside decode steps: the packed grid (no sequence padded to the longest, even
    # with the eager interpreter's 256-row blocks)
    attention_case("prompt-beside-decodes", [100, 1, 1, 1], [130, 20, 7, 64]),
    attention_case("prompt-beside-decodes-split2", [100, 1, 1, 1], [130, 20, 7, 64],
                   config={**split_config(2), "block_sizes": [64, 16]}),  # 64-row blocks: 4x fewer interpreted programs
    # block tables that are not one contiguous [seqs, blocks] array
    attention_case("wide-block-table", [3, 1, 2], [40, 20, 17], table_layout="wide"),
    attention_case("column-major-block-table", [3, 1, 2], [40, 20, 17], table_layout="column_major"),
    # one-token sequences: a one-token prompt and a decode step at length 1
    attention_case("one-token-sequences", [1, 1, 1], [1, 2, 17]),
    # GQA ratios 8:1 (MQA-like), 4:1, 1:1
    attention_case("gqa8-decode-bf16", [1, 1, 1, 1], [9, 30, 64, 65], heads=(8, 1), dtype=torch.bfloat16),
    attention_case("mha-prefill", [7, 12], [7, 40], heads=(2, 2)),
    attention_case("gqa8-prefill-small-blocks", [9, 1], [40, 23], heads=(8, 1), config=SMALL_BLOCKS),
    # head dims 64 (above), 80, 128, 256; block sizes 16 (above) and 64
    attention_case("hd80-bf16", [4, 1], [21, 35], heads=(4, 2), head_dim=80, dtype=torch.bfloat16),
    attention_case("hd128-block64", [6, 1], [70, 129], heads=(4, 1), head_dim=128, block_size=64),
    attention_case("hd256-block64-fp16", [3, 1], [66, 20], heads=(2, 1), head_dim=256, block_size=64,
                   dtype=torch.float16),
    # sliding window, softcap, sinks, and all three together
    attention_case("window", [12, 1], [40, 33], window=8),
    attention_case("window-longer-than-context", [5, 1], [9, 4], window=64),
    attention_case("softcap-bf16", [6, 1], [25, 18], softcap=5.0, dtype=torch.bfloat16),
    attention_case("sinks", [4, 1, 9], [30, 17, 9], sinks=True),
    attention_case("window-softcap-sinks-small-blocks", [10, 1], [37, 29], window=6, softcap=3.0, sinks=True,
                   config=SMALL_BLOCKS),
    # split-KV (flash-decoding) forced on short contexts: empty splits, sinks and windows in the merge
    # (one kernel specialisation for all four: the split count, sinks and window are runtime values)
    attention_case("split3-decode", [1, 1, 1], [37, 100, 5], heads=(4, 2), config=split_config(3)),
    attention_case("split2-decode-sinks", [1, 1], [150, 70], heads=(4, 2), sinks=True, config=split_config(2)),
    attention_case("split4-decode-window", [1, 1], [200, 90], heads=(4, 2), window=40, config=split_config(4)),
    attention_case("split2-mixed-sinks", [4, 1], [40, 60], heads=(4, 2), sinks=True, config=split_config(2)),
    # layouts and edge cases of the batch
    attention_case("more-queries-than-keys", [6, 1], [4, 3]),
    attention_case("fused-q-view-cache-views", [5, 1], [21, 40], q_layout="fused", cache_layout="view"),
    attention_case("no-hints", [5, 1], [37, 16], hints=False),
]


# --------------------------------------------------------------------------------------------
# DSL providers vs the reference


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(paged_attention_op))
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=repr)
def test_paged_attention_dsl(provider, case, device):
    check_provider(paged_attention_op, provider, case, device)


# Rows no sequence owns, before the first sequence and after the last: the op allocates its
# output without filling it, so the kernels must write them (zeros). Decode and prefill, one pass
# and split-KV (where the merge writes the output), tiny shapes for the interpreters.
_UNOWNED_BATCHES = {"decode": ([1, 1, 1], [20, 9, 33]), "prefill": ([5, 3], [5, 19])}
UNOWNED_ROWS_CASES = [
    attention_case(f"unowned-{leading}-{trailing}-{batch}-splits{splits}", *_UNOWNED_BATCHES[batch], heads=(4, 2),
                   head_dim=16, leading_rows=leading, unowned_rows=trailing, config=split_config(splits))
    for batch in _UNOWNED_BATCHES for splits in (1, 2) for leading, trailing in ((0, 0), (0, 3), (2, 0), (2, 3))
] + [
    attention_case("unowned-rows-and-empty-sequence", [3, 0, 1], [20, 12, 5], unowned_rows=2),
    attention_case("unowned-both-fused-q", [4, 1], [9, 30], heads=(4, 2), head_dim=16, leading_rows=3,
                   unowned_rows=2, q_layout="fused"),
    # sequences that own no row, no hints: the grid is sized by q's rows, every one unowned (and
    # more of them than the programs' shares would cover if a share were rounded down)
    *[attention_case(f"every-row-unowned-no-hints-splits{splits}", [0, 0, 0], [4, 7, 2], heads=(4, 2), head_dim=16,
                     leading_rows=1, unowned_rows=4, hints=False, config=split_config(splits)) for splits in (1, 2)],
]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(paged_attention_op))
@pytest.mark.parametrize("case", UNOWNED_ROWS_CASES, ids=repr)
def test_rows_no_sequence_owns_are_zeros_dsl(provider, case, device):
    """The harness checks the owned rows against the reference in NaN-filled allocations; the rows
    before ``cu_seqlens_q[0]`` and from ``cu_seqlens_q[-1]`` on must be exact zeros."""
    got = check_provider(paged_attention_op, provider, case, device).cpu()
    cu = case.make()[4]
    owned = torch.zeros(got.shape[0], dtype=torch.bool)
    owned[int(cu[0]):int(cu[-1])] = True
    assert torch.equal(got[~owned], torch.zeros_like(got[~owned])), "rows no sequence owns are not zeros"


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(paged_attention_op))
def test_the_output_is_allocated_without_a_fill(provider, device, monkeypatch):
    """What makes the test above able to fail: with its kernels' launches skipped, the op returns
    the harness's NaN poison in every row (no zero-fill hides a row the kernel does not write)."""
    from hw_agnostic.ops.paged_attention import _AttentionLaunch
    from tests.harness import poisoned_allocations

    def skip_launch(*args):
        return None

    monkeypatch.setattr(_AttentionLaunch, "_launches", lambda self, *launch: (skip_launch, None))
    args = attention_case("unfilled", [2, 1], [5, 9], heads=(4, 2), head_dim=16, leading_rows=1,
                          unowned_rows=1).make()
    with ops.use_provider(provider, paged_attention_op), poisoned_allocations(), ops.trace_dispatch() as ran:
        got = paged_attention_op(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
    assert [p.provider for p in ran] == [provider]
    assert bool(torch.isnan(got).all())


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(paged_attention_op))
def test_a_wrong_block_table_entry_fails_the_check(provider, device, monkeypatch):
    """The harness catches one misplaced block: the spec sees a table with one entry changed."""
    case = attention_case("wrong-block", [3, 1], [40, 20], heads=(4, 2))
    reference = paged_attention_op.reference

    def reference_with_a_wrong_block(q, k_cache, v_cache, table, *rest):
        wrong = table.clone()
        wrong[0, 1] = table[1, 0]  # a valid block of the other sequence
        return reference(q, k_cache, v_cache, wrong, *rest)

    monkeypatch.setattr(paged_attention_op, "reference", reference_with_a_wrong_block)
    with pytest.raises(AssertionError, match="output 0"):
        check_provider(paged_attention_op, provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(6, 20), deadline=None, suppress_health_check=list(HealthCheck))
# Found by fuzzing: no query rows at all (an empty grid; Helion's eager mode mishandled it).
@example(batch=[(0, 0)], window=None, sinks=False, num_splits=1, unowned_rows=1, leading_rows=0)
@given(
    batch=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30)), min_size=1, max_size=3),
    window=st.sampled_from([None, 1, 5]),
    sinks=st.booleans(),
    num_splits=st.sampled_from([1, 2, 3]),
    unowned_rows=st.integers(0, 2),
    leading_rows=st.integers(0, 2),
)
def test_fuzz_batches(batch, window, sinks, num_splits, unowned_rows, leading_rows):
    """Random batch shapes and runtime options on one kernel specialisation per split mode (the
    specialisations themselves are covered case by case above; each costs a compile)."""
    from tests.conftest import kernel_device

    q_lens = [q for q, _ in batch]
    kv_lens = [max(q, kv) for q, kv in batch]
    case = attention_case(
        f"fuzz-{batch}-{window}-{sinks}-{num_splits}-{unowned_rows}-{leading_rows}", q_lens, kv_lens, heads=(4, 2),
        window=window, sinks=sinks, config=split_config(num_splits), unowned_rows=unowned_rows,
        leading_rows=leading_rows,
    )
    for provider in dsl_providers(paged_attention_op):
        check_provider(paged_attention_op, provider, case, kernel_device())


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(5, 40), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batch=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=3),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 1), (4, 2), (6, 2), (8, 1)]),
    head_dim=st.sampled_from([16, 32, 64]),
    block_size=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    window=st.sampled_from([None, 1, 7, 24]),
    softcap=st.sampled_from([None, 2.0, 30.0]),
    sinks=st.booleans(),
    num_splits=st.sampled_from([1, 3]),
    unowned=st.tuples(st.integers(0, 2), st.integers(0, 2)),
)
def test_fuzz_heads_dtypes_and_features(batch, heads, head_dim, block_size, dtype, window, softcap, sinks,
                                        num_splits, unowned):
    """Head counts and GQA ratios, head dims, cache block sizes, dtypes, window / softcap / sinks
    together, split-KV on and off, rows no sequence owns before and after: the kernel
    specialisations, drawn at random."""
    from tests.conftest import kernel_device

    q_lens = [q for q, _ in batch]
    kv_lens = [max(q, kv) for q, kv in batch]
    case = attention_case(
        f"fuzz-{batch}-{heads}-{head_dim}-{block_size}-{dtype}-{window}-{softcap}-{sinks}-{num_splits}-{unowned}",
        q_lens, kv_lens, heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype, window=window,
        softcap=softcap, sinks=sinks, config=split_config(num_splits), leading_rows=unowned[0], unowned_rows=unowned[1],
    )
    for provider in dsl_providers(paged_attention_op):
        check_provider(paged_attention_op, provider, case, kernel_device())


@pytest.mark.dsl
def test_int64_addressing(device):
    """Caches past 2**31 elements: the last block starts past 2**31 (untouched pages cost nothing)."""
    block_size, heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * heads * head_dim) + 2
    k_cache = torch.empty(num_blocks, block_size, heads, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.empty_like(k_cache)
    last = num_blocks - 1
    g = seeded_generator("int64")
    key = torch.randn(10, heads, head_dim, generator=g).to(torch.bfloat16).to(device)
    value = torch.randn(10, heads, head_dim, generator=g).to(torch.bfloat16).to(device)
    slots = torch.arange(last * block_size, last * block_size + 10, device=device)
    q = torch.randn(1, 4, head_dim, generator=g).to(torch.bfloat16).to(device)
    table = torch.tensor([[last]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([10], dtype=torch.int32, device=device)
    assert write_kv_cache_op.key(key, value, k_cache, v_cache, slots).int64
    dense_k = key.double().repeat_interleave(4, 1)
    dense_v = value.double().repeat_interleave(4, 1)
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q.double(), dense_k) * head_dim**-0.5, -1)
    want = torch.einsum("hqk,khd->qhd", probs, dense_v)
    for provider in dsl_providers(paged_attention_op):
        with ops.use_provider(provider), ops.trace_dispatch() as ran:
            write_kv_cache(key, value, k_cache, v_cache, slots)
            got = paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=1, max_kv_len=10)
        assert [p.provider for p in ran] == [provider, provider]
        assert torch.equal(k_cache[last, :10], key) and torch.equal(v_cache[last, :10], value)
        assert_close(got, want, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# the spec vs Hugging Face's eager attention (reference here; the kernels in the interpreter tiers)


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(paged_attention_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


class _Module(torch.nn.Module):
    """The attributes HF's eager attention functions read from the attention module."""

    def __init__(self, group: int, sinks: torch.Tensor | None) -> None:
        super().__init__()
        self.num_key_value_groups = group
        self.head_dim = 32
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_matches_hf_eager_attention(family, provider):
    """One sequence with cached context: the paged op equals the HF eager function on dense K/V."""
    from importlib import import_module

    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    from tests.conftest import kernel_device

    device = "cpu" if provider == "reference" else kernel_device()
    eager = import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward
    g = seeded_generator(f"hf-{family}")
    q_len, kv_len, heads, kv_heads, head_dim = 5, 29, 4, 2, 32
    window = 8 if family in ("mistral", "gemma2", "gpt_oss") else None
    softcap = 4.0 if family == "gemma2" else None
    sinks = torch.randn(heads, generator=g) if family == "gpt_oss" else None
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        [q_len], [kv_len], num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
        dtype=torch.float32, device="cpu", generator=g,
    )
    keys = k_cache[table[0, :2].long()].flatten(0, 1)[:kv_len]
    values = v_cache[table[0, :2].long()].flatten(0, 1)[:kv_len]
    mask_function = sliding_window_causal_mask_function(window) if window else causal_mask_function
    mask = sdpa_mask(batch_size=1, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len,
                     mask_function=mask_function, allow_is_causal_skip=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    kwargs = {"softcap": softcap} if softcap else {}
    want, _ = eager(_Module(heads // kv_heads, sinks), q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                    values.transpose(0, 1)[None], additive, scaling=head_dim**-0.5, **kwargs)
    args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (q, k_cache, v_cache, table, cu, lens)]
    with ops.use_provider(provider, paged_attention_op), ops.trace_dispatch() as ran:
        got = paged_attention(*args, sliding_window=window, softcap=softcap,
                              sinks=None if sinks is None else sinks.to(device), max_q_len=q_len, max_kv_len=kv_len)
    assert [p.provider for p in ran] == [provider]
    torch.testing.assert_close(got.cpu(), want[0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the reference's own semantics (runs everywhere)


def test_reference_equals_dense_causal_attention_per_sequence():
    """Each sequence of a mixed batch equals causal attention over its own dense K/V."""
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        [4, 1, 6], [10, 7, 6], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=torch.float64, device="cpu", generator=seeded_generator("dense"),
    )
    out = paged_attention(q, k_cache, v_cache, table, cu, lens)
    for seq, (start, end, kv_len) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), lens.tolist())):
        blocks = table[seq, : -(-kv_len // 4)].long()
        keys = k_cache[blocks].flatten(0, 1)[:kv_len].repeat_interleave(2, 1).transpose(0, 1)
        values = v_cache[blocks].flatten(0, 1)[:kv_len].repeat_interleave(2, 1).transpose(0, 1)
        queries = q[start:end].transpose(0, 1)
        mask = torch.ones(end - start, kv_len, dtype=torch.bool).tril(kv_len - (end - start))
        want = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        torch.testing.assert_close(out[start:end], want.transpose(0, 1))


def test_rows_without_keys_and_unowned_rows_are_zero():
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        [5], [2], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32, device="cpu")
    q = torch.cat([q, torch.randn(3, 2, 16)])
    out = paged_attention(q, k_cache, v_cache, table, cu, lens)
    assert torch.equal(out[:3], torch.zeros(3, 2, 16))  # positions -3..-1 see no key
    assert out[3:5].abs().sum() > 0
    assert torch.equal(out[5:], torch.zeros(3, 2, 16))  # rows no sequence owns


def test_custom_ops_are_registered_with_their_schemas():
    assert "Tensor(a2!) k_cache" in str(torch.ops.hw_agnostic.write_kv_cache.default._schema)
    out = torch.ops.hw_agnostic.paged_attention(
        *example_paged_batch([2], [5], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu"), 0.25, None, None, None, None, None)
    assert out.shape == (2, 2, 16)


# --------------------------------------------------------------------------------------------
# bad inputs


def _batch(**overrides):
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        [3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
        device="cpu")
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table, "cu_seqlens_q": cu,
            "kv_lens": lens}
    kwargs = {}
    for name, value in overrides.items():
        (args if name in args else kwargs)[name] = value
    return lambda: paged_attention(*args.values(), **kwargs)


def _poke(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


_table = example_paged_batch([3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu")[3]

BAD_INPUTS = [
    ("q has head_dim 32 but k_cache has head_dim 16", _batch(q=torch.ones(4, 4, 32))),
    ("q's 3 heads must be a positive multiple of k_cache's 2 KV heads", _batch(q=torch.ones(4, 3, 16))),
    ("q must be [tokens, num_q_heads, head_dim]", _batch(q=torch.ones(4, 64))),
    ("q must have dtype", _batch(q=torch.ones(4, 4, 16, dtype=torch.int32))),
    ("k_cache and v_cache must have q's dtype", _batch(q=torch.ones(4, 4, 16, dtype=torch.bfloat16))),
    ("v_cache must have the dtype of k_cache", _batch(v_cache=torch.ones(6, 4, 2, 16, dtype=torch.float16))),
    ("v_cache must have the shape of k_cache", _batch(v_cache=torch.ones(6, 4, 2, 8))),
    ("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]", _batch(k_cache=torch.ones(24, 2, 16))),
    ("block_table must have dtype int32", _batch(block_table=_table.long())),
    ("block_table must have one row per sequence (2)", _batch(block_table=_table[:1])),
    ("kv_lens must have dtype int32", _batch(kv_lens=torch.tensor([10, 6]))),
    ("cu_seqlens_q must have num_seqs + 1 = 3 entries", _batch(cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32))),
    ("cu_seqlens_q must be a torch.Tensor", _batch(cu_seqlens_q=[0, 3, 4])),
    ("block_table is on meta but k_cache is on cpu", _batch(block_table=_table.to("meta"))),
    ("scale must be > 0", _batch(scale=0.0)),
    ("scale must be finite", _batch(scale=float("inf"))),
    ("sliding_window must be >= 1", _batch(sliding_window=0)),
    ("sliding_window must be an int", _batch(sliding_window=4.0)),
    ("softcap must be > 0", _batch(softcap=-1.0)),
    ("sinks must have one logit per query head", _batch(sinks=torch.zeros(2))),
    ("max_kv_len = 64 but block_table's 3 columns of 4-token blocks hold at most 12 keys",
     _batch(max_kv_len=64)),
    ("max_q_len must be >= 0", _batch(max_q_len=-1)),
    # data checks of the reference path
    ("block_table[0, 1] = 99 is not a block of the cache", _batch(block_table=_poke(_table, (0, 1), 99))),
    ("block_table[1, 0] = -1 is not a block of the cache", _batch(block_table=_poke(_table, (1, 0), -1))),
    # every sequence reads as many blocks (checked as one): still the first bad entry, row by row
    ("block_table[1, 1] = 99 is not a block of the cache",
     _batch(block_table=_poke(_poke(_table, (1, 1), 99), (1, 0), 0), kv_lens=torch.tensor([6, 6], dtype=torch.int32))),
    ("kv_lens[0] = 13 needs 4 blocks of 4 but block_table has 3 columns",
     _batch(kv_lens=torch.tensor([13, 6], dtype=torch.int32))),
    ("kv_lens[1] is -1", _batch(kv_lens=torch.tensor([10, -1], dtype=torch.int32))),
    ("cu_seqlens_q must be non-decreasing offsets into q's 4 rows",
     _batch(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32))),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "tensor-ops"])
@pytest.mark.parametrize("message, call", [case for case in BAD_INPUTS if "is not a block of the cache" in case[0]],
                         ids=lambda value: value if isinstance(value, str) else "")
def test_block_table_checks_name_the_bad_entry_either_way(message, call, listed, monkeypatch):
    """A small block table is checked as one list read to the host, a larger one by tensor ops:
    both name the first bad entry."""
    if not listed:
        monkeypatch.setattr(importlib.import_module("hw_agnostic.ops.paged_attention"), "LISTED_BLOCKS", 0)
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("lengths", [[10, 6], [6, 6]], ids=["uneven", "even"])
def test_block_table_columns_no_sequence_reads_may_hold_anything(lengths):
    """The reference's data check reads only the blocks each sequence's keys lie in."""
    stale = _poke(_poke(_table, (0, 2) if lengths == [6, 6] else (1, 2), -7), (1, 2), 1 << 20)
    _batch(block_table=stale, kv_lens=torch.tensor(lengths, dtype=torch.int32))()


# --------------------------------------------------------------------------------------------
# GPU only: serving sizes, and a decode step captured in a CUDA graph


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1] * 16, [4096 + 37 * i for i in range(16)]),  # decode: one pass over the keys
    ([1, 1], [8192, 5000]),  # few long sequences: the split-KV path
    ([1024, 1, 300], [1024, 2048, 900]),  # mixed prefill and decode
])
def test_serving_sizes_on_the_gpu(q_lens, kv_lens):
    batch = example_paged_batch(q_lens, kv_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                                dtype=torch.bfloat16, device="cuda", generator=seeded_generator(str(kv_lens)))
    hints = (max(q_lens), max(kv_lens))
    with ops.trace_dispatch() as ran:
        got = paged_attention(*batch, max_q_len=hints[0], max_kv_len=hints[1])
    assert [p.provider for p in ran] == ["helion"]
    doubled = [t.double() if t.is_floating_point() else t for t in batch]
    want = paged_attention_op.reference(*doubled, 128**-0.5, None, None, None, *hints)
    assert_close(got, want, torch.bfloat16)


@pytest.mark.gpu
def test_a_decode_step_captures_in_a_cuda_graph():
    """No host synchronisation: write + attention record into a graph and replay right as lengths grow."""
    q_lens, kv_lens = [1, 1, 1], [700, 31, 2000]
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        q_lens, [n + 8 for n in kv_lens], num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    key, value = torch.randn_like(q[:, :8]), torch.randn_like(q[:, :8])
    capacity = table.shape[1] * 16

    def slots():  # each sequence's next free slot
        return (table.long().gather(1, (lens.long() // 16)[:, None])[:, 0] * 16 + lens.long() % 16)

    slot_mapping = slots()

    def step():
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return paged_attention(q, k_cache, v_cache, table, cu, lens + 1, max_q_len=1, max_kv_len=capacity)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        lens += 1
        slot_mapping.copy_(slots())
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


@pytest.mark.dsl
def test_auto_splits_are_chosen_per_call_from_the_context(device):
    """One plan (one kv-length bucket), two contexts: each call gets the splits its length needs."""
    op = paged_attention_op
    launches = []
    with ops.use_provider(dsl_providers(op)[0], op):
        for kv_len, want_splits in ((1100, 3), (2000, 4)):  # both in the 2048 bucket; ceil(kv_len / 512) splits
            q, k_cache, v_cache, table, cu, lens = example_paged_batch(
                [1], [kv_len], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
                device=device, spare_blocks=0)
            args = (q, k_cache, v_cache, table, cu, lens, 0.25, None, None, None, 1, kv_len)
            got = op(*args)
            (plan,) = op.plans()
            launches.append(plan.run)
            assert plan.run.num_splits == want_splits
            assert_close(got, op.reference(*args).double(), torch.float32)
    assert launches[0] is launches[1]  # one plan served both calls



@pytest.mark.dsl
def test_the_widest_alike_hint_launches_what_the_exact_hint_does_dsl(device):
    """The public function's raised hint (here to the block table's capacity): the same splits, the same bits."""
    op = paged_attention_op
    with ops.use_provider(dsl_providers(op)[0], op):
        for kv_len, want_splits in ((1100, 3), (700, 1)):
            batch = example_paged_batch([1], [kv_len], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                                        dtype=torch.float32, device=device)
            assert widest_alike_kv_len(kv_len, batch[1], batch[3]) > kv_len
            exact = op(*batch, 0.25, None, None, None, 1, kv_len)
            (plan,) = [p for p in op.plans() if p.calls]
            assert plan.run.num_splits == want_splits
            widest = paged_attention(*batch, scale=0.25, max_q_len=1, max_kv_len=kv_len)
            assert plan.run.num_splits == want_splits
            assert torch.equal(widest, exact)
            op.reset()

@settings(max_examples=300, deadline=None)
@given(max_kv_len=st.integers(1, 1 << 17), columns=st.integers(1, 1 << 13), block_size=st.sampled_from([1, 16, 64]),
       num_seqs=st.integers(1, 64), num_kv_heads=st.sampled_from([1, 2, 8]), programs=st.sampled_from([16, 132, 264]))
@example(max_kv_len=1000, columns=64, block_size=16, num_seqs=1, num_kv_heads=8, programs=264)  # below two splits
@example(max_kv_len=5000, columns=313, block_size=16, num_seqs=1, num_kv_heads=8, programs=264)  # past the capacity
def test_a_valid_hint_is_raised_to_the_widest_that_launches_alike(max_kv_len, columns, block_size, num_seqs,
                                                                  num_kv_heads, programs):
    """The wider hint keeps the key's bucket, the split count on any device and the check's verdict."""
    k_cache, table = torch.empty(0, block_size, 1, 1), torch.empty(1, columns)
    widest = widest_alike_kv_len(max_kv_len, k_cache, table)
    capacity = columns * block_size
    if max_kv_len > capacity:
        assert widest == max_kv_len  # left for the check to refuse
        return
    assert max_kv_len <= widest <= capacity
    assert token_bucket(widest) == token_bucket(max_kv_len)
    splits = [kernels.choose_num_splits(decode=True, num_seqs=num_seqs, num_kv_heads=num_kv_heads, max_kv_len=n,
                                        programs=programs) for n in (max_kv_len, widest)]
    assert splits[0] == splits[1]
    if widest < capacity:  # the widest: one more is another launch, or past the block table
        one_more = widest + 1
        assert (token_bucket(one_more) != token_bucket(widest)
                or -(-one_more // kernels.MIN_TOKENS_PER_SPLIT) != -(-widest // kernels.MIN_TOKENS_PER_SPLIT)
                or (one_more < 2 * kernels.MIN_TOKENS_PER_SPLIT) != (widest < 2 * kernels.MIN_TOKENS_PER_SPLIT))


@pytest.mark.parametrize("hint, error", [(0, None), (-1, "max_kv_len must be >= 0"), (10**6, "hold at most"),
                                         (True, "max_kv_len must be an int"), (1.5, "max_kv_len must be an int")])
def test_hints_that_are_not_valid_reach_the_check_as_given(hint, error):
    q, k_cache, v_cache, table, cu, lens = example_paged_batch([1], [10], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                               block_size=4, dtype=torch.float32, device="cpu")
    if type(hint) is int:
        assert widest_alike_kv_len(hint, k_cache, table) == hint
    assert widest_alike_kv_len(7, "not a cache", table) == 7
    call = lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=1, max_kv_len=hint)
    if error is None:
        call()
    else:
        with pytest.raises((TypeError, ValueError), match=error):
            call()


def test_a_growing_decode_keeps_its_call_signature_for_many_steps():
    """A decode whose hint grows by one a step gets a new call signature only where a launch would change."""
    op = paged_attention_op
    q, k_cache, v_cache, table, cu, lens = example_paged_batch([1], [700], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                               block_size=16, dtype=torch.float32, device="cpu")
    op.reset()
    for kv_len in range(1, 701):
        lens.fill_(kv_len)
        got = paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=1, max_kv_len=kv_len)
        if kv_len in (1, 300, 700):
            want = op.reference(q, k_cache, v_cache, table, cu, lens, 0.25, None, None, None, 1, kv_len)
            assert_close(got, want.double(), torch.float32)
    # 1, 2, 4, ..., 512 (ten buckets) and 513..700 (below two splits): eleven, not 700
    assert len(op._checked) == 11


@pytest.mark.parametrize("block_rows", [16, 64, 256])
@given(q_lens=st.lists(st.integers(0, 300), min_size=1, max_size=40), group=st.sampled_from([1, 4, 8]))
@settings(max_examples=60, deadline=None)
def test_the_query_grid_gives_every_packed_row_one_block(q_lens, group, block_rows):
    """The grid layouts as the kernel reads them: block ``b`` belongs to the sequence the device map
    (packed) or ``b // blocks_per_seq`` (uniform) names, and owns that sequence's packed rows
    ``[b - first, b - first + 1) * block_rows``; every packed row of every sequence falls in exactly one
    block, and the grid has no more blocks than its layout's bound."""
    from hw_agnostic.kernels.paged_attention import block_sequences, query_grid

    tokens, num_seqs = sum(q_lens), len(q_lens)
    grid = query_grid(num_seqs=num_seqs, tokens=tokens, max_q_len=max(q_lens), group=group, block_rows=block_rows)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if grid.packed:
        owners = block_sequences(cu, group, block_rows, grid.blocks).tolist()
        firsts = [(int(cu[s]) * group + s * (block_rows - 1)) // block_rows for s in range(num_seqs)]
    else:
        owners = [b // grid.blocks_per_seq for b in range(grid.blocks)]
        firsts = [s * grid.blocks_per_seq for s in range(num_seqs)]
    covered = [[0] * (n * group) for n in q_lens]
    for block, seq in enumerate(owners):
        if seq >= num_seqs:
            continue
        begin = (block - firsts[seq]) * block_rows
        for row in range(max(begin, 0), min(begin + block_rows, q_lens[seq] * group)):
            covered[seq][row] += 1
    assert all(count == 1 for rows in covered for count in rows)
    uniform = num_seqs * -(-max(max(q_lens), 1) * group // block_rows)
    assert grid.blocks <= max(uniform, 1)
    if grid.packed:
        assert grid.blocks <= (tokens * group + num_seqs * (block_rows - 1)) // block_rows


def test_a_mixed_batch_launches_work_per_sequence_not_per_longest_query():
    """One 512-token prompt beside 63 decode steps (GQA 4, 64-row blocks): the uniform layout would
    give every sequence the prompt's 32 blocks (2048, ~95% idle); the packed grid has 98."""
    from hw_agnostic.kernels.paged_attention import query_grid

    mixed = query_grid(num_seqs=64, tokens=512 + 63, max_q_len=512, group=4, block_rows=64)
    assert mixed.packed and mixed.blocks == 98
    decode = query_grid(num_seqs=64, tokens=64, max_q_len=1, group=4, block_rows=16)
    assert not decode.packed and decode.blocks == 64  # one block per sequence: exact already
    prompt = query_grid(num_seqs=1, tokens=512, max_q_len=512, group=4, block_rows=64)
    assert not prompt.packed and prompt.blocks == 32


def test_the_block_map_is_built_on_the_device_in_a_few_launches():
    """A mixed batch's block map reads nothing on the host (a captured step stays valid) and costs a
    handful of small launches, once per call."""
    from bench.decode_host_suite import LaunchCount
    from hw_agnostic.kernels.paged_attention import block_sequences

    cu = torch.tensor([0, 512, *range(513, 576)], dtype=torch.int32)
    with LaunchCount() as count:
        owners = block_sequences(cu, 4, 64, 98)
    assert count.syncs == 0 and sum(count.aten.values()) <= 6
    owners = owners.tolist()
    assert owners[:32] == [0] * 32 and owners[32] == 1 and sorted(owners) == owners and set(owners) == set(range(64))
