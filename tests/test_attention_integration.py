"""Paged attention inside transformers models: generate() and continuous batching, token for token.

Tiny random-weight models (2 layers, fp32) of five families, each with what makes it different:
Llama (plain GQA), Mistral (sliding window on every layer), Qwen3 (q/k norms), Gemma-2 (logit
softcap, alternating sliding layers) and gpt-oss (attention sinks, alternating sliding layers).
The reference is the same model, unswapped, with transformers' eager attention; the sliding
windows (16) are shorter than the sequences, so they matter.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hw_agnostic import ops
from hw_agnostic.backend.attention import PagedCacheLayer, disable_paged_attention, enable_paged_attention
from hw_agnostic.layers.attention import PagedAttention
from hw_agnostic.layers.base import unregister_oot

FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 16},
    "gpt_oss": {"head_dim": 16, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
}
NEW_TOKENS = 20


def tiny_model(family: str, *, layers: int = 2, attn_implementation: str = "eager"):
    config = AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **FAMILIES[family],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    return model, copy.deepcopy(model)


def padded_prompts(batch: int = 2, length: int = 21, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (what generate wants for decoder-only models): row ``i`` has ``3 * i`` pads."""
    ids = torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : 3 * row] = 0
        ids[row, : 3 * row] = 0
    return ids, mask


@pytest.fixture
def forbid_hf_attention(monkeypatch):
    """Make transformers' own attention functions raise, so a test fails if they run."""

    def forbidden(*args, **kwargs):
        raise AssertionError("transformers' attention ran instead of hw_agnostic's paged attention")

    def install(family: str):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        monkeypatch.setattr(module, "eager_attention_forward", forbidden)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for name in ("sdpa", "paged|eager"):
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, forbidden)

    return install


def _ran(record, op: str) -> list:
    return [plan for plan in record if plan.op == op]


def _layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


# --------------------------------------------------------------------------------------------
# generate()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_hf_eager(family, forbid_hf_attention):
    model, reference = tiny_model(family)
    ids, mask = padded_prompts()
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    replaced = enable_paged_attention(model)
    assert replaced == [f"model.layers.{i}.self_attn" for i in range(_layers(model))]
    forbid_hf_attention(family)
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), f"{family}: generated tokens differ from HF eager"
    forwards = NEW_TOKENS * _layers(model)  # one prefill and 19 decode steps, per layer
    assert len(_ran(record, "paged_attention")) == forwards
    assert len(_ran(record, "write_kv_cache")) == forwards
    cache_layer = model.model.layers[0].self_attn.kv
    assert cache_layer is not None and cache_layer.seen == ids.shape[1] + NEW_TOKENS - 1


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_generate_reads_padding_from_either_mask(attn_implementation):
    """SDPA's boolean and eager's additive masks both carry the padding the cache must skip."""
    model, reference = tiny_model("llama", attn_implementation=attn_implementation)
    ids, mask = padded_prompts(batch=3, length=12, seed=1)
    enable_paged_attention(model)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    kv_lens = model.model.layers[0].self_attn.kv.kv_lens.tolist()
    assert kv_lens == [12 + 7 - 3 * row for row in range(3)]  # padding was never written


def test_beam_search_reorders_the_paged_cache():
    model, reference = tiny_model("llama")
    ids, mask = padded_prompts()
    enable_paged_attention(model)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_forward_without_cache_and_in_training_mode():
    model, reference = tiny_model("gemma2")
    ids, mask = padded_prompts()
    enable_paged_attention(model)
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = model(ids, attention_mask=mask, use_cache=False).logits
    want = reference(ids, attention_mask=mask, use_cache=False).logits.detach()
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert _ran(record, "paged_attention")
    model.train()
    reference.train()
    with ops.trace_dispatch() as record:  # training runs the model's own attention
        got = model(ids, attention_mask=mask, use_cache=False).logits
    assert not _ran(record, "paged_attention")
    torch.testing.assert_close(got[real], reference(ids, attention_mask=mask, use_cache=False).logits[real],
                               rtol=1e-5, atol=1e-5)


def test_enabling_keeps_names_and_can_be_undone():
    model, _ = tiny_model("qwen3")
    keys = list(model.state_dict())
    first = enable_paged_attention(model)
    assert enable_paged_attention(model) == []  # already swapped
    assert list(model.state_dict()) == keys  # the layer shares the module's parameters and names
    assert all(isinstance(model.get_submodule(p), PagedAttention) for p in first)
    assert model.config._attn_implementation == "eager"  # the model's own setting is untouched
    assert disable_paged_attention(model) == first
    assert type(model.model.layers[0].self_attn).__name__ == "Qwen3Attention"
    assert model.model.layers[0].self_attn.config is model.config


def test_an_out_of_tree_replacement_is_what_gets_built():
    calls = []

    @PagedAttention.register_oot
    class CountingAttention(PagedAttention):
        def forward(self, *args, **kwargs):
            calls.append(self.layer_idx)
            return super().forward(*args, **kwargs)

    try:
        model, _ = tiny_model("llama")
        enable_paged_attention(model)
        assert isinstance(model.model.layers[0].self_attn, CountingAttention)
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
        assert calls == [0, 1]
    finally:
        unregister_oot("paged_attention")


def test_a_cache_filled_without_paged_attention_keeps_transformers_code():
    """A cache slot filled by an unpaged model cannot be paged mid-sequence: that layer keeps
    transformers' cache and the module's own attention for the cache's whole life."""
    model, reference = tiny_model("llama")
    cache, own = DynamicCache(config=reference.config), DynamicCache(config=reference.config)
    with torch.no_grad():
        reference(torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
        reference(torch.tensor([[5, 6, 7]]), cache=own, use_cache=True)
    enable_paged_attention(model)
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = model(torch.tensor([[8]]), cache=cache, use_cache=True).logits
    want = reference(torch.tensor([[8]]), cache=own, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not _ran(record, "paged_attention") and cache.get_seq_length() == 4
    assert not any(isinstance(layer, PagedCacheLayer) for layer in cache.layers)


def test_the_cache_layers_are_paged_views():
    model, _ = tiny_model("gpt_oss")
    enable_paged_attention(model, block_size=4)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache, use_cache=True)
    assert all(isinstance(layer, PagedCacheLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 6 and cache.is_sliding == [True, False]  # gpt-oss alternates
    store = cache.layers[1].store
    assert store.block_size == 4 and store.block_table.shape == (1, 2) and store.kv_lens.tolist() == [6]


# --------------------------------------------------------------------------------------------
# continuous batching


def _generate_batch(model, prompts, new_tokens: int, max_batch_tokens: int = 24):
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=max_batch_tokens)
    outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                                   progress_bar=False)
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in outputs.values()}
    return [by_prompt[tuple(p)] for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_batch_matches_hf_eager(family, forbid_hf_attention):
    """Prompts of 21, 5, 33 and 1 tokens with at most 24 tokens a batch: prompts are prefilled in
    chunks next to other requests' decode steps, over transformers' paged cache."""
    model, reference = tiny_model(family)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (21, 5, 33, 1)]
    new_tokens = 16
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=0, eos_token_id=-1)
            want.append(out[0, len(prompt):].tolist())
    enable_paged_attention(model)
    forbid_hf_attention(family)
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = _generate_batch(model, prompts, new_tokens)
    assert got == want, f"{family}: continuous batching differs from HF eager"
    assert _ran(record, "paged_attention")
    # Full-attention layers write into transformers' pages themselves, sliding layers into their
    # ring buffers in decode-only steps (see hw_agnostic.backend.attention).
    assert _ran(record, "write_kv_cache")


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_decode_steps_read_sliding_windows_in_place(family, monkeypatch):
    """A step whose queries are all single tokens reads each sliding layer's window from its ring
    buffer: transformers' gather (``SlidingAttentionCacheAllocator.update``: ``index_select`` of every
    window) runs only in steps with longer queries, and the tokens stay HF's."""
    from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
        SlidingAttentionCacheAllocator,
    )

    from hw_agnostic.backend import attention as backend_attention

    model, reference = tiny_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (21, 5, 9)]
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                   eos_token_id=-1)[0, len(p):].tolist() for p in prompts]
    enable_paged_attention(model)
    steps = []  # (longest query of the step, whether it gathered the window)
    binding_update = backend_attention._ContinuousBatchingBinding.update
    gather = SlidingAttentionCacheAllocator.update

    def update(self, *args, kwargs=None, **extra):
        steps.append([None if kwargs is None else int(kwargs["max_length_q"]), False])
        return binding_update(self, *args, kwargs=kwargs, **extra)

    def gathering(self, *args, **kwargs):
        steps[-1][1] = True
        return gather(self, *args, **kwargs)

    monkeypatch.setattr(backend_attention._ContinuousBatchingBinding, "update", update)
    monkeypatch.setattr(SlidingAttentionCacheAllocator, "update", gathering)
    with torch.no_grad():
        got = _generate_batch(model, prompts, 24, max_batch_tokens=8)  # 24 tokens: past the window of 16
    assert got == want, f"{family}: continuous batching differs from HF eager"
    assert any(longest == 1 for longest, _ in steps) and any(gathered for _, gathered in steps)
    assert not [step for step in steps if step == [1, True]], "a decode-only step gathered a sliding window"


# --------------------------------------------------------------------------------------------
# the kernels themselves (interpreter tiers, GPUs)


@pytest.mark.dsl
def test_generate_and_generate_batch_on_the_kernels():
    from hw_agnostic.ops.paged_attention import paged_attention_op
    from hw_agnostic.ops.write_kv_cache import write_kv_cache_op
    from tests.harness import dsl_providers

    model, reference = tiny_model("llama", layers=1)
    ids, mask = padded_prompts(batch=2, length=9)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [21, 22]]
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        want_batch = [reference.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, pad_token_id=0,
                                         eos_token_id=-1)[0, len(p):].tolist() for p in prompts]
    enable_paged_attention(model)
    for provider in dsl_providers(paged_attention_op):
        with torch.no_grad(), ops.use_provider(provider, paged_attention_op, write_kv_cache_op), \
                ops.trace_dispatch() as record:
            got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
            got_batch = _generate_batch(model, prompts, 3, max_batch_tokens=8)
        assert torch.equal(got, want)
        assert got_batch == want_batch
        ran = {(plan.op, plan.provider) for plan in record}
        assert ran == {("paged_attention", provider), ("write_kv_cache", provider)}
