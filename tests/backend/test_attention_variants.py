"""Attention modules that depart from the Llama pattern: each is served, or declined up front with why.

Gemma-4 (HF's own eager and SDPA attention disagree by more than the one-sided fp32 table),
CTRL (attention called as ``attn(v, k, q)``), Mllama (reads ``cache.layers[i].keys`` itself),
JetMoE (tiles its K/V heads before attending) and DiffLlama (attends twice over value halves it
re-tiles). Each rewired model is compared with the untouched original.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention
from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention
from transformers.models.llama.modeling_llama import LlamaAttention

from hw_agnostic import rewire
from hw_agnostic.backend.attention import PagedCacheLayer
from hw_agnostic.backend.kv_flow import kv_flow
from hw_agnostic.backend.verify import Verification
from hw_agnostic.layers import PagedAttention
from hw_agnostic.tolerances import mismatch, tolerance
from tests.zoo.families import build
from tests.zoo.test_zoo import _inputs, _run

NEW_TOKENS = 8


def _rewired(family: str):
    model = build(family)
    reference = copy.deepcopy(model)
    report = rewire(model)
    return model, reference, report


def _paged(model) -> list[str]:
    return [path for path, m in model.named_modules() if isinstance(m, PagedAttention)]


def _assert_same_results(model, reference, two_sided: bool = False) -> None:
    ids, mask = _inputs()
    (got, got_tokens), (want, want_tokens) = _run(model, ids, mask, NEW_TOKENS), _run(reference, ids, mask, NEW_TOKENS)
    real = mask.bool()
    assert mismatch(got[real], want[real].double(), torch.float32, two_sided=two_sided) is None
    assert torch.equal(got_tokens, want_tokens)


# --------------------------------------------------------------------------------------------
# comparing two computations of one dtype


def test_two_sided_allows_twice_the_table_and_no_more():
    tol = tolerance(torch.float32)
    want = torch.linspace(-1, 1, 101, dtype=torch.float64)
    allowed = tol.rtol * want.abs() + tol.atol * want.abs().max()
    for factor, one_sided, two_sided in ((0.9, True, True), (1.5, False, True), (2.5, False, False)):
        got = (want + factor * allowed).float()
        assert (mismatch(got, want, torch.float32) is None) is one_sided, factor
        assert (mismatch(got, want, torch.float32, two_sided=True) is None) is two_sided, factor
    assert "two-sided" in mismatch((want + 3 * allowed).float(), want, torch.float32, two_sided=True)


def _eager(model):
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = "eager"
    return model


def test_hf_gemma4_attention_implementations_differ_beyond_the_one_sided_table():
    """Why the whole-model check is two-sided: on its probe, Gemma-4's own eager and SDPA logits
    (both fp32) are further apart than one fp32 computation may be from a float64 one."""
    model = build("gemma4_text")
    probe = Verification.__new__(Verification)
    probe.model = model
    inputs = probe._probe_inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad():
        sdpa = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
        eager = _eager(model)(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    assert mismatch(eager, sdpa.double(), torch.float32) is not None
    assert mismatch(eager, sdpa.double(), torch.float32, two_sided=True) is None


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_attention_is_paged_and_computes_what_hf_eager_does(family):
    model, reference, report = _rewired(family)
    attention = [p for p, m in model.named_modules() if type(m).__name__.endswith("TextAttention")]
    assert attention and set(attention) <= set(_paged(model)), report.table()
    assert not any("undone" in e.detail for e in report.left), report.table()
    _assert_same_results(model, reference, two_sided=True)
    ids, mask = _inputs()
    with torch.no_grad():  # against the eager attention the paged one follows: the one-sided table
        got = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        want = _eager(reference)(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert mismatch(got, want.double(), torch.float32) is None


# --------------------------------------------------------------------------------------------
# CTRL: attention called as attn(v, k, q)


def test_a_layer_calling_attention_with_other_inputs_is_not_fused_and_its_attention_is_paged():
    model, reference, report = _rewired("ctrl")
    assert len(_paged(model)) == 2, report.table()
    layers = [e for e in report.left if e.original == "EncoderLayer"]
    assert len(layers) == 2 and all("not fused: its attention is not called as attention(hidden_states=" in e.detail
                                    and "'v'" in e.detail for e in layers), report.table()
    assert not report.fused and not any("undone" in e.detail for e in report.left), report.table()
    _assert_same_results(model, reference)


# --------------------------------------------------------------------------------------------
# Mllama: the model reads the cache layers' keys itself


def test_a_paged_cache_layer_is_initialized_by_its_first_write():
    layer = PagedCacheLayer()
    assert not layer.is_initialized and layer.keys is None
    with pytest.raises(AttributeError, match="first write"):
        layer.is_initialized = True
    k = torch.randn(2, 2, 3, 16)
    layer.update(k, k.clone())
    assert layer.is_initialized and layer.keys.numel() == k.numel()
    layer.reset()
    assert layer.is_initialized and layer.keys.numel() == 0  # what transformers' layers hold after reset


def test_mllama_attention_is_paged():
    model, reference, report = _rewired("mllama")
    assert len(_paged(model)) == 2 and not any("undone" in e.detail for e in report.left), report.table()
    _assert_same_results(model, reference)


# --------------------------------------------------------------------------------------------
# K/V changed between cache.update and the attention call


def test_kv_flow_reads_what_the_attention_call_receives():
    assert kv_flow(LlamaAttention).expansion == "same" and kv_flow(LlamaAttention).refusal is None
    assert kv_flow(JetMoeAttention).expansion == "tile" and kv_flow(JetMoeAttention).refusal is None
    refusal = kv_flow(DiffLlamaAttention).refusal
    assert refusal is not None and "2 times after one cache write" in refusal and "torch.chunk" in refusal


def test_tiled_kv_heads_are_served_by_reordering_the_queries():
    """JetMoE attends over ``k.repeat(1, top_k, 1, 1)``: stored head ``j % Hkv`` at head ``j``."""
    model, reference, report = _rewired("jetmoe")
    assert len(_paged(model)) == 2 and not any("undone" in e.detail for e in report.left), report.table()
    _assert_same_results(model, reference)


def test_attention_over_derived_values_is_declined_up_front():
    model, reference, report = _rewired("diffllama")
    assert not _paged(model)
    left = [e for e in report.left if e.original == "DiffLlamaAttention"]
    assert len(left) == 2 and all("calls its attention 2 times after one cache write" in e.detail
                                  and "undone" not in e.detail for e in left), report.table()
    _assert_same_results(model, reference)
