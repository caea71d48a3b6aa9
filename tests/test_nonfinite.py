"""NaN and infinities behave the same on every path, and as the Hugging Face modules do.

* Every op with float inputs: a NaN / +inf / -inf in any input gives the reference's NaN and
  infinity pattern on the DSL paths (the harness compares NaN positions and infinities exactly).
* ``moe_route``: whatever the logits hold, the ids are distinct experts in ``[0, E)``, the same on
  every path; NaN scores rank above every number (as ``torch.topk`` ranks them) and weigh NaN.
* ``moe_align``: int64 ids are range-tested before they are narrowed.
* ``paged_attention``: a NaN query gives NaN (as HF's attention); keys a query cannot see (the
  causal future, outside the window, a block's unwritten tail, spare blocks) never contribute,
  even when they hold NaN or infinities.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops.moe_align import moe_align_op
from hw_agnostic.ops.moe_route import SCORINGS, moe_route_op
from hw_agnostic.ops.paged_attention import example_paged_batch, paged_attention_op
from hw_agnostic.ops.registry import all_ops
from hw_agnostic.tolerances import assert_close
from tests.harness import Case, check_provider, dsl_providers, seeded_generator
from tests.ops.moe_cases import IGNORE_MASKED_ROW_WARNINGS

pytestmark = [IGNORE_MASKED_ROW_WARNINGS,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

NAN, INF = float("nan"), float("inf")
VALUES = (NAN, INF, -INF)
#: Ops whose inputs are special: covered by their own cases below.
SPECIAL = {"paged_attention", "write_kv_cache", "moe_align"}


def _poisoned_cases() -> list[tuple[str, Case]]:
    cases = []
    for name, op in sorted(all_ops().items()):
        if name.startswith("test_") or name in SPECIAL:
            continue
        example = op.example_inputs(5, 24, torch.float32, "cpu")
        floats = [i for i, a in enumerate(example) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        for n, index in enumerate(floats):
            value = VALUES[(n + len(name)) % 3]

            def make(op=op, index=index, value=value):
                args = list(op.example_inputs(5, 24, torch.float32, "cpu"))
                poisoned = args[index]  # any layout (rotary_embedding's q/k are transposed views)
                poisoned[torch.unravel_index(torch.tensor(min(7, poisoned.numel() - 1)), poisoned.shape)] = value
                return tuple(args)

            cases.append((name, Case(f"{name}-arg{index}-{value}", make)))
    return cases


POISONED = _poisoned_cases()


@pytest.mark.dsl
@pytest.mark.parametrize("name, case", POISONED, ids=[c.id for _, c in POISONED])
def test_a_nonfinite_input_gives_the_references_pattern(name, case, device):
    op = all_ops()[name]
    for provider in dsl_providers(op):
        check_provider(op, provider, case, device)


# --------------------------------------------------------------------------------------------
# parity with the HF modules (reference path)


def test_norms_propagate_nonfinite_values_as_the_hf_modules_do():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    g = seeded_generator("nonfinite-hf")
    x = torch.randn(4, 16, generator=g)
    x[0, 3], x[1, 5], x[2, 7] = NAN, INF, -INF
    gate = torch.randn(4, 16, generator=g)
    gate[3, 1] = -INF  # silu(-inf) is NaN in torch
    weight = torch.randn(16, generator=g)
    rms, gated = LlamaRMSNorm(16), Qwen3NextRMSNormGated(16)
    layer = torch.nn.LayerNorm(16)
    with torch.no_grad():
        rms.weight.copy_(weight), gated.weight.copy_(weight), layer.weight.copy_(weight)
        pairs = [
            (ops.rms_norm(x, weight, rms.variance_epsilon), rms(x)),
            (ops.layer_norm(x, layer.weight, layer.bias, layer.eps), layer(x)),
            (ops.gated_rms_norm(x, gate, weight, gated.variance_epsilon), gated(x, gate)),
            (ops.silu_and_mul(torch.cat([x, gate], -1)), F.silu(x) * gate),
        ]
    for ours, theirs in pairs:
        assert_close(ours, theirs.double(), torch.float32)  # NaN where HF has NaN, the same infinities


# --------------------------------------------------------------------------------------------
# moe_route


def _route_logits(g: torch.Generator, experts: int) -> torch.Tensor:
    logits = torch.randn(7, experts, generator=g)
    logits[0, 3] = NAN  # one NaN: softmax makes the row NaN
    logits[1] = NAN
    logits[2, 5] = INF
    logits[3] = -INF
    logits[4, :2] = -INF
    logits[5, 1:3] = INF
    return logits


ROUTINGS = [
    ("softmax", False, 1, 1), ("softmax", True, 1, 1), ("sigmoid", True, 1, 1), ("topk_then_softmax", False, 1, 1),
    ("topk_then_sigmoid", True, 1, 1), ("sigmoid", True, 4, 2), ("sigmoid", True, 8, 3),
]


def route_case(scoring, renormalize, n_group, topk_group):
    name = f"route-{scoring}-{renormalize}-g{n_group}of{topk_group}"

    def make():
        g = seeded_generator(name)
        bias = 0.1 * torch.randn(8, generator=g) if "sigmoid" in scoring else None
        if bias is not None:
            bias[6] = NAN
        return _route_logits(g, 8), bias, 3, scoring, renormalize, n_group, topk_group, 2.5

    return Case(name, make)


ROUTE_CASES = [route_case(*r) for r in ROUTINGS]


def _assert_valid_ids(ids: torch.Tensor, experts: int) -> None:
    assert ids.dtype == torch.int64 and bool(((ids >= 0) & (ids < experts)).all()), ids
    assert all(len(set(row)) == len(row) for row in ids.tolist()), ids


@pytest.mark.parametrize("case", ROUTE_CASES, ids=repr)
def test_route_ids_are_distinct_experts_on_the_reference(case):
    weights, ids = moe_route_op.reference(*case.make())
    _assert_valid_ids(ids, 8)
    assert torch.isnan(weights[1]).all()  # a NaN row weighs NaN


@pytest.mark.dsl
@pytest.mark.parametrize("case", ROUTE_CASES, ids=repr)
def test_route_kernels_pick_the_references_ids(case, device):
    for provider in dsl_providers(moe_route_op):
        check_provider(moe_route_op, provider, case, device)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(st.sampled_from([NAN, INF, -INF, 0.0, 1.0, -1.0, 3.0]), min_size=24, max_size=24),
       scoring=st.sampled_from(list(SCORINGS)), top_k=st.integers(1, 6))
def test_route_ids_stay_in_range_on_any_logits(values, scoring, top_k):
    logits = torch.tensor(values).view(4, 6)
    paths = ["reference"]
    from tests.conftest import kernel_device

    if kernel_device() == "cpu":
        paths += dsl_providers(moe_route_op)
    results = []
    for provider in paths:
        with ops.use_provider(provider, moe_route_op):
            weights, ids = ops.moe_route(logits, top_k, scoring=scoring, renormalize=True)
        _assert_valid_ids(ids, 6)
        results.append(ids)
    for ids in results[1:]:
        assert torch.equal(ids, results[0])


# --------------------------------------------------------------------------------------------
# moe_align


def align_case(block_m):
    def make():
        ids = torch.tensor([[0, 2**32 + 3], [1, -2**32 + 1], [2**31, 3], [-1, 2**63 - 1], [2, 2**40]],
                           dtype=torch.int64)
        return ids, 4, block_m

    return Case(f"align-wide-ids-bm{block_m}", make)


def test_align_puts_wide_ids_with_the_unrouted_pairs():
    sorted_pairs, _, offsets = moe_align_op.reference(*align_case(4).make())
    unrouted = sorted_pairs[offsets[4]:offsets[5]]
    assert sorted(p for p in unrouted.tolist() if p < 10) == [1, 3, 4, 6, 7, 9]


@pytest.mark.dsl
@pytest.mark.parametrize("case", [align_case(4), align_case(16)], ids=repr)
def test_align_kernels_range_test_int64_ids(case, device):
    for provider in dsl_providers(moe_align_op):
        check_provider(moe_align_op, provider, case, device)


# --------------------------------------------------------------------------------------------
# paged attention


def _attention_batch(name: str, window, sinks: bool, dtype=torch.float32, head_dim: int = 16):
    """A prefill, a decode and a chunked-prefill sequence; unwritten slots and spare blocks hold
    NaN, a future key of the prefill's early queries holds NaN / inf, a key leaving the window
    holds inf, one query row is NaN."""
    g = seeded_generator(name)
    q_lens, kv_lens, block_size = [20, 1, 5], [20, 27, 9], 8
    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
        device="cpu", generator=g)
    slots_k, slots_v = k_cache.view(-1, 2, head_dim), v_cache.view(-1, 2, head_dim)
    used = {int(table[s, j // block_size]) * block_size + j % block_size for s, n in enumerate(kv_lens) for j in range(n)}
    for slot in set(range(slots_k.shape[0])) - used:
        slots_k[slot], slots_v[slot] = NAN, NAN

    def slot(j: int) -> int:
        return int(table[0, j // block_size]) * block_size + j % block_size

    slots_v[slot(15), 1, 3] = NAN
    slots_k[slot(17), 0, 2] = INF
    slots_v[slot(2), 0, 5] = INF
    q[3, 1, 0] = NAN
    sink_logits = torch.randn(4, generator=g) if sinks else None
    return (q, k_cache, v_cache, table, cu, lens, head_dim**-0.5, window, None, sink_logits, max(q_lens), max(kv_lens))


def _exact_attention(q, k_cache, v_cache, table, cu, lens, scale, window, softcap, sinks, *hints):
    """Each query over exactly the keys it sees, in float64: what "never contribute" means."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    for s in range(lens.shape[0]):
        start, end, n = int(cu[s]), int(cu[s + 1]), int(lens[s])
        slots = [int(table[s, j // block_size]) * block_size + j % block_size for j in range(n)]
        keys, values = k_cache.flatten(0, 1)[slots].double(), v_cache.flatten(0, 1)[slots].double()
        for i in range(start, end):
            position = n - (end - start) + (i - start)
            seen = [j for j in range(n) if j <= position and (window is None or j > position - window)]
            for h in range(heads):
                kv = h // (heads // kv_heads)
                logits = (keys[seen, kv] @ q[i, h].double()) * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h:h + 1].double()])
                if seen:
                    out[i, h] = (torch.softmax(logits, 0)[:len(seen), None] * values[seen, kv]).sum(0)
    return out


ATTENTION = [("causal", None, False), ("window", 4, False), ("sinks", None, True), ("window-sinks", 6, True)]


@pytest.mark.parametrize("name, window, sinks", ATTENTION)
def test_attention_reference_sees_only_visible_keys(name, window, sinks):
    args = _attention_batch(name, window, sinks)
    got = paged_attention_op.reference(*args)
    want = _exact_attention(*args)
    assert torch.isnan(got[3, 1]).all() and not torch.isnan(got[:3]).any()
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("nan_query", [True, False], ids=["nan-query", "finite-queries"])
@pytest.mark.parametrize("name, window, sinks", ATTENTION)
def test_attention_cpu_path_sees_only_visible_keys(name, window, sinks, nan_query, monkeypatch):
    """What the reference provider runs by default (SDPA over gathered pages) gives what the exact
    reference gives with NaN / inf among unseen and seen keys and values, a NaN query or not."""
    monkeypatch.setenv("HW_AGNOSTIC_COMPILE_REFERENCE", "1")
    ops.reset(compiled_references=True)
    try:
        args = _attention_batch(name, window, sinks)
        if not nan_query:
            args[0][3, 1, 0] = 1.0
        got = ops.paged_attention(*args[:6], scale=args[6], sliding_window=window, sinks=args[9])
        assert torch.isnan(got[3, 1]).all() == nan_query and not torch.isnan(got[:3]).any()
        assert_close(got, _exact_attention(*args), torch.float32)
    finally:
        ops.reset(compiled_references=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "cpu-path"])
def test_attention_reference_propagates_a_nan_query_as_hf_attention_does(compiled, monkeypatch):
    """HF's eager attention and SDPA with a mask give NaN (CPU SDPA's flash path with
    ``is_causal=True`` gives 0, an artefact of that path), also on the CPU path users get by default."""
    monkeypatch.setenv("HW_AGNOSTIC_COMPILE_REFERENCE", "1" if compiled else "0")
    ops.reset(compiled_references=True)
    try:
        _check_nan_query_attention()
    finally:
        ops.reset(compiled_references=True)


def _check_nan_query_attention() -> None:
    g = seeded_generator("nan-query-sdpa")
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    q[0, 1, 2, 4] = NAN
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)  # [1, H, S, D]
    assert torch.isnan(want[0, 1, 2]).all()
    k_cache, v_cache = (t[0].transpose(0, 1).reshape(1, 6, 2, 16) for t in (k, v))
    got = ops.paged_attention(q[0].transpose(0, 1).contiguous(), k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                              torch.tensor([0, 6], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    assert_close(got, want[0].transpose(0, 1).double(), torch.float32)


def attention_case(name, window, sinks, splits, head_dim=16):
    config = {"block_sizes": [16, 8], "num_warps": 4, "num_stages": 1, "num_splits": splits}
    wide = f"-hd{head_dim}" if head_dim != 16 else ""
    return Case(f"attention-{name}-splits{splits}{wide}",
                lambda: _attention_batch(name, window, sinks, head_dim=head_dim), config)


# Head dim 256 takes the kernel's key-by-key pass over non-finite values (above KEY_BY_KEY_HEAD_DIM).
ATTENTION_CASES = [attention_case(n, w, s, 1) for n, w, s in ATTENTION] + [
    attention_case("window-sinks", 6, True, 3), attention_case("causal", None, False, 2),
    attention_case("window-sinks", 6, True, 1, head_dim=256), attention_case("causal", None, False, 2, head_dim=256)]


@pytest.mark.dsl
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=repr)
def test_attention_kernels_see_only_visible_keys(case, device):
    for provider in dsl_providers(paged_attention_op):
        check_provider(paged_attention_op, provider, case, device)
