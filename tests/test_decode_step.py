"""A decode step's host work: its paged-cache metadata is computed once for every layer, and its
launches can be counted without compiling or running anything (what ``bench``'s decode-host suite measures)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hw_agnostic import rewire
from hw_agnostic.kernels import targets
from hw_agnostic.layers import attention as paged
from tests.backend.models import build, prompt
from tests.test_attention_integration import padded_prompts

NEW_TOKENS = 4
#: the kernels one rewired Llama decoder layer launches (its norms, MLP, rotary embedding with the KV
#: write, and attention); both residual adds run with the norm after them (the last one with the next
#: layer's input norm)
LAYER_KERNELS = {"fused_add_rms_norm_row": 2, "gated_activation": 1, "rotary_write_kv_cache": 1,
                 "paged_attention": 1}


@pytest.fixture
def metadata_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = paged._step_metadata

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(paged, "_step_metadata", counted)
    return calls


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_steps_metadata_is_computed_once_for_all_layers(metadata_calls, padded):
    model = build("llama", num_hidden_layers=3)
    reference = copy.deepcopy(model)
    rewire(model)
    ids, mask = padded_prompts(length=11) if padded else (prompt(), None)
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = reference.generate(ids, **options)
        metadata_calls.clear()  # rewire's verification ran forwards too
        got = model.generate(ids, **options)
    assert torch.equal(got, want)
    assert len(metadata_calls) == NEW_TOKENS  # one per forward (the prompt, then each new token), not per layer
    lengths = {id(layer.self_attn.kv.kv_lens) for layer in model.model.layers}
    assert len(lengths) == 1  # every layer holds the same lengths tensor


def test_unpadded_steps_share_their_layout_and_slot_base_across_steps():
    """A step without padding lays out as every other (the same offsets and query offsets): the share
    keeps the layout and each token's slot before its row's length, so a decode step computes only
    its slots and lengths; the slots are what the per-step computation gives."""
    store = paged.PagedKVCache(2, 2, 16, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    key = torch.randn(2, 3, 2, 16)
    store.append(key, key)
    computed, growths = store.share.computed, 0
    for step in range(12):  # past the share's capacity: the entries every step reads stay
        growths += store.seen + 1 > store.blocks_per_row * store.block_size
        kv_lens, token = store.kv_lens, torch.randn(2, 1, 2, 16)
        store.append(token, token)  # growing the pages first where the step needs more: new row starts
        want = paged._slots(paged._step_layout(None, 1, 2, token.device), kv_lens, store._row_start).reshape(-1)
        step_entries = [value for _, value in store.share._entries.values() if isinstance(value, paged.StepMetadata)]
        assert torch.equal(step_entries[-1].slots, want), step
        assert torch.equal(store.k_pages.view(-1, 2, 16)[want], token.view(-1, 2, 16))
    # each step computed its metadata; the one-token layout once; the slot base once, and again with
    # the block layout of each growth of the pages (which is computed too)
    assert growths and store.share.computed - computed == 12 + 1 + (1 + growths) + growths


def test_layers_sharing_lengths_crop_and_reorder_alike():
    """Nothing writes the shared lengths in place: cropping or reordering the cache gives every layer
    its own correct view, as transformers' cache would."""
    model = build("llama", num_hidden_layers=2)
    rewire(model)
    ids, mask = padded_prompts(length=9)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    stores = [layer.self_attn.kv for layer in model.model.layers]
    assert [s.kv_lens.tolist() for s in stores] == [[9, 6]] * 2
    cache.crop(-2)
    assert [s.kv_lens.tolist() for s in stores] == [[7, 4]] * 2
    cache.reorder_cache(torch.tensor([1, 0]))
    assert [s.kv_lens.tolist() for s in stores] == [[4, 7]] * 2
    assert stores[0].kv_lens is stores[1].kv_lens


def test_counting_launches_compiles_and_runs_nothing():
    model = build("llama", num_hidden_layers=2)
    rewire(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), targets.compile_for(["sm_90"], run_reference=False, compile=False) as log:
        model(prompt(batch=1), past_key_values=cache, use_cache=True)
        log.launches.clear()
        model(prompt(batch=1, length=1), past_key_values=cache, use_cache=True)
    assert not log.records  # nothing compiled
    layers = model.config.num_hidden_layers
    want = {name: count * layers for name, count in LAYER_KERNELS.items()}
    want["rms_norm"] = 1  # the first layer's input norm (the final norm came with the last layer's add)
    assert dict(log.launches) == want


def test_a_versioned_share_recomputes_after_an_input_is_refilled_in_place():
    """Continuous batching's index buffers belong to transformers, which may refill them between
    forwards: what was computed from a buffer is shared only while the buffer is unchanged."""
    share = paged.StepShare(versioned=True)
    lengths = torch.tensor([0, 3, 5], dtype=torch.int32)

    def differences():
        return lengths[1:] - lengths[:-1]

    first = share.once(("lengths", lengths), differences)
    assert share.once(("lengths", lengths), differences) is first
    lengths.copy_(torch.tensor([0, 4, 9], dtype=torch.int32))
    assert share.once(("lengths", lengths), differences).tolist() == [4, 5]
    with torch.inference_mode():
        frozen = torch.tensor([0, 1])  # an inference tensor: no version counter, so never shared
        computed = share.computed
        share.once(("lengths", frozen), lambda: frozen + 1)
        share.once(("lengths", frozen), lambda: frozen + 1)
        assert share.computed == computed



@pytest.mark.parametrize("real", [True, False], ids=["token", "padding"])
def test_a_one_token_step_lays_out_as_the_general_layout_without_its_sort(real):
    """A batch-1 decode step's layout is computed from its token's flag alone (inside a graph the
    general one's sums, scans and sort are kernels of every layer); the same offsets, counts and
    query offsets, and no order where the general one orders the one row onto itself."""
    flag = torch.tensor([[real]])
    general, one = paged._padded_layout(flag, 1, flag.device), paged._step_layout(flag, 1, 1, flag.device)
    for name in ("offsets", "real", "counts", "cu_seqlens_q"):
        got, want = getattr(one, name), getattr(general, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert general.query_order.tolist() == [0] and one.query_order is None


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_padded_decode_token_at_batch_1_is_not_kept(static):
    """Eager batch-1 steps whose mask marks one new token as padding (the one-token layout with its
    flag off): the token is not stored, and the steps after it compute what HF computes."""
    from transformers import StaticCache

    model = build("llama", num_hidden_layers=2)
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt(batch=1, length=5)
    capacity = 16
    ours, theirs = (StaticCache(config=m.config, max_cache_len=capacity) if static else DynamicCache(config=m.config)
                    for m in (model, reference))
    mask = torch.ones(1, capacity if static else ids.shape[1], dtype=torch.long)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=ours)
        reference(ids, attention_mask=mask, past_key_values=theirs)
        for step in range(4):
            flag = int(step != 1)  # the second new token is padding
            if static:
                mask[:, ids.shape[1] + step] = flag
            else:
                mask = torch.cat([mask, torch.tensor([[flag]])], dim=1)
            token = prompt(batch=1, length=1, seed=60 + step)
            got = model(token, attention_mask=mask, past_key_values=ours).logits
            want = reference(token, attention_mask=mask, past_key_values=theirs).logits
            if flag:  # a padding token's own output is nobody's
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert int(ours.layers[0].store.kv_lens[0]) == ids.shape[1] + 3
