"""A transformers ``StaticCache`` makes a rewired model's decode step graphable.

Its plain K/V layers are served by static paged stores (``PagedKVCache(capacity=...)``): the pages
for the cache's ``max_cache_len`` are allocated once, and the positions seen, lengths and padding
live on the device and are updated in place. So every decode step makes the same calls on the same
addresses: ``torch.compile(fullgraph=True, dynamic=False)`` traces the step once, across block
boundaries, and on a GPU the step is captured as one CUDA graph (``mode="reduce-overhead"``, what
``generate()``'s compile config asks for).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from transformers import CompileConfig, StaticCache

from hw_agnostic import ops, rewire
from hw_agnostic.backend.attention import PagedCacheLayer
from hw_agnostic.layers.attention import PagedKVCache, attend
from hw_agnostic.tolerances import assert_close
from tests.backend.models import build, padded_prompt, prompt
from tests.harness import dsl_providers


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _pair(family: str = "llama", device: str = "cpu"):
    model = build(family).to(device)
    reference = copy.deepcopy(model)
    report = rewire(model)
    assert report.verification is not None and not report.verification.undone, report
    return model, reference


class Counting:
    """A ``torch.compile`` backend (AOT autograd, eager kernels) that counts the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __deepcopy__(self, memo: dict) -> Counting:  # transformers' CompileConfig.to_dict deep-copies its backend
        return self

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs += 1
        return aot_eager(graph, inputs)


def test_generate_on_a_static_cache_runs_static_pages_and_matches_hf():
    model, reference = _pair()
    ids, mask = padded_prompt()
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model.generate(ids, return_dict_in_generate=True, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want)
    layers = got.past_key_values.layers
    assert all(isinstance(layer, PagedCacheLayer) and layer.store.static for layer in layers)
    ran_ops = {plan.op for plan in ran}
    assert "paged_attention" in ran_ops and {"write_kv_cache", "rotary_write_kv_cache"} & ran_ops
    assert got.past_key_values.is_compileable


@pytest.mark.parametrize("extra", [dict(num_beams=3), dict(num_beams=2, num_return_sequences=2)],
                         ids=["beams", "beams-returning-two"])
def test_beam_search_on_a_static_cache_matches_hf(extra):
    """Beams reorder the static pages in place; more sequences than prompts move them once, up front."""
    model, reference = _pair()
    ids, mask = padded_prompt()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  cache_implementation="static", **extra)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.mark.parametrize("family", ["llama", "phi3", "olmo2"])  # the direct path's forms: parts, sliced qkv, whole norms
def test_decode_steps_trace_once_across_blocks_on_fixed_addresses(family):
    model, reference = _pair(family)
    block = model.model.layers[0].self_attn.block_size
    ours, theirs = (StaticCache(config=m.config, max_cache_len=3 * block) for m in (model, reference))
    backend = Counting()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    ids, prompt_mask = padded_prompt(length=block - 2)
    # a padding mask as wide as the cache: every step's mask has the same shape (what generate()
    # does for static caches), the causal part hides the positions not reached yet
    mask = torch.ones(2, 3 * block, dtype=prompt_mask.dtype)
    mask[:, : ids.shape[1]] = prompt_mask
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=ours)
        reference(ids, attention_mask=mask, past_key_values=theirs)
        stores = [layer.store for layer in ours.layers]
        addresses = [(s.k_pages.data_ptr(), s.v_pages.data_ptr(), s.seen.data_ptr(), s.kv_lens.data_ptr())
                     for s in stores]
        for step in range(block + 3):  # past the end of the first and second blocks
            token = prompt(batch=2, length=1, seed=20 + step)
            got = compiled(token, attention_mask=mask, past_key_values=ours).logits
            want = reference(token, attention_mask=mask, past_key_values=theirs).logits
            assert _relative(got, want) <= 1e-5, step
        # an eager step after the graphed ones: what eager code knew of the positions is stale
        token = prompt(batch=2, length=1, seed=99)
        got = model(token, attention_mask=mask, past_key_values=ours).logits
        want = reference(token, attention_mask=mask, past_key_values=theirs).logits
        assert _relative(got, want) <= 1e-5
    for store in stores:  # its bookkeeping went where the device counters say
        assert store.host_seen() == int(store.seen) == 2 * block + 2
        assert torch.equal(store.real.sum(1, dtype=torch.int32), store.kv_lens)
    assert backend.graphs == 1
    assert int(ours.get_seq_length()) == int(theirs.get_seq_length()) == 2 * block + 2
    assert addresses == [(s.k_pages.data_ptr(), s.v_pages.data_ptr(), s.seen.data_ptr(), s.kv_lens.data_ptr())
                         for s in stores]


def test_a_compiled_step_after_the_prefill_leaves_the_modules_unread(monkeypatch):
    """What the trace reads becomes a guard the compiled step evaluates on every call: once the prefill
    paged every slot, the pre-forward hook does not walk the modules to page them again (the walk
    made a 6-layer step's guards cost 2.5x HF's a layer)."""
    from hw_agnostic.backend import attention

    model, _ = _pair()
    cache = StaticCache(config=model.config, max_cache_len=24)
    mask = torch.ones(2, 24, dtype=torch.long)
    with torch.no_grad():
        model(prompt(batch=2, length=5), attention_mask=mask, past_key_values=cache)

    def walk(module, cache):
        raise AssertionError("the compiled step walked the modules to page the cache's slots")

    monkeypatch.setattr(attention, "_page_slots", walk)
    torch._dynamo.reset()
    backend = Counting()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    with torch.no_grad():
        for step in range(2):
            compiled(prompt(batch=2, length=1, seed=30 + step), attention_mask=mask, past_key_values=cache)
    assert backend.graphs == 1


def test_generate_compiles_the_decode_step_when_its_compile_config_asks():
    model, reference = _pair()
    ids, mask = padded_prompt()
    backend = Counting()
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    torch._dynamo.reset()
    with torch.no_grad():
        got = model.generate(ids, compile_config=config, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert backend.graphs == 1  # the prefill runs eagerly, every decode step in the one graph


def test_recorded_attention_weights_on_static_pages_match_hf():
    """The fallback path reads static pages back at the cache's whole capacity, as transformers'
    static layer returns its keys, under the capacity-wide mask; the step after it is paged again."""
    from transformers import AutoModelForCausalLM

    from tests.backend.models import config

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config("llama"), attn_implementation="eager").eval()
    model = copy.deepcopy(reference)
    rewire(model)
    ids, prompt_mask = padded_prompt()
    mask = torch.ones(2, 32, dtype=prompt_mask.dtype)
    mask[:, : ids.shape[1]] = prompt_mask
    ours, theirs = (StaticCache(config=m.config, max_cache_len=32) for m in (model, reference))
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=ours)
        reference(ids, attention_mask=mask, past_key_values=theirs)
        for step, record in enumerate((True, False)):
            token = prompt(batch=2, length=1, seed=30 + step)
            got = model(token, attention_mask=mask, past_key_values=ours, output_attentions=record)
            want = reference(token, attention_mask=mask, past_key_values=theirs, output_attentions=record)
            assert _relative(got.logits, want.logits) <= 1e-5
            if record:
                assert len(got.attentions) == len(want.attentions) == 2
                for mine, hf in zip(got.attentions, want.attentions):
                    assert_close(mine, hf.double(), torch.float32)


def _stores(capacity: int) -> tuple[PagedKVCache, PagedKVCache]:
    common = dict(block_size=4, dtype=torch.float32, device="cpu")
    return PagedKVCache(3, 2, 8, **common), PagedKVCache(3, 2, 8, capacity=capacity, **common)


def test_a_static_store_holds_what_a_growing_one_holds_and_never_moves():
    torch.manual_seed(0)
    growing, fixed = _stores(capacity=19)
    addresses = [t.data_ptr() for t in (fixed.k_pages, fixed.v_pages, fixed.seen, fixed.kv_lens, fixed.real)]
    query = torch.randn(3, 4, 1, 8)

    def step(q_len: int, real: torch.Tensor | None = None) -> None:
        key, value = torch.randn(3, q_len, 2, 8), torch.randn(3, q_len, 2, 8)
        grown, kept = growing.append(key, value, real), fixed.append(key, value, real)
        assert kept.max_kv_len == 19
        for name in ("kv_lens", "cu_seqlens_q", "query_order"):
            assert torch.equal(getattr(grown, name), getattr(kept, name)) if getattr(grown, name) is not None \
                else getattr(kept, name) is None, name
        if q_len == 1:
            assert torch.equal(attend(query, grown, scale=0.3), attend(query, kept, scale=0.3))

    def same() -> None:
        seen = growing.seen
        assert int(fixed.seen) == seen
        for grown, kept in zip(growing.read(), fixed.read()):
            assert torch.equal(kept[:, :, :seen], grown) and not kept[:, :, seen:].any()

    real = torch.ones(3, 5, dtype=torch.bool)
    real[1, :2] = False  # left padding
    step(5, real)
    same()
    for _ in range(6):
        step(1)
        same()
    growing.crop(3), fixed.crop(3)
    same()
    index = torch.tensor([2, 0, 0])
    growing.select(index), fixed.select(index)
    same()
    step(2)
    same()
    assert addresses == [t.data_ptr() for t in (fixed.k_pages, fixed.v_pages, fixed.seen, fixed.kv_lens, fixed.real)]
    fixed.reset()
    assert int(fixed.seen) == 0 and not fixed.kv_lens.any() and not fixed.real.any()


def test_a_step_past_a_static_capacity_raises_and_writes_nothing():
    _, fixed = _stores(capacity=6)
    fixed.append(torch.randn(3, 5, 2, 8), torch.randn(3, 5, 2, 8))
    pages = fixed.k_pages.clone()
    with pytest.raises(ValueError, match="static capacity of 6 .*: 5 positions seen, a step of 2"):
        fixed.append(torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8))
    # bit for bit: pages nothing wrote hold whatever the allocator left, NaN patterns included
    assert torch.equal(fixed.k_pages.view(torch.uint8), pages.view(torch.uint8))
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        PagedKVCache(1, 1, 8, dtype=torch.float32, device="cpu", capacity=0)


@pytest.mark.dsl
def test_the_kernel_reads_a_static_batch_as_a_growing_one():
    """On a static store the kernel's length hint is the capacity, far past the rows' lengths."""
    from tests.conftest import kernel_device

    device = kernel_device()
    torch.manual_seed(0)
    common = dict(block_size=4, dtype=torch.float32, device=device)
    growing, fixed = PagedKVCache(2, 2, 16, **common), PagedKVCache(2, 2, 16, capacity=64, **common)
    real = torch.ones(2, 7, dtype=torch.bool, device=device)
    real[0, :3] = False
    for q_len, step_real in ((7, real), (1, None)):
        key, value = (torch.randn(2, q_len, 2, 16, device=device) for _ in range(2))
        grown, kept = growing.append(key, value, step_real), fixed.append(key, value, step_real)
    query = torch.randn(2, 4, 1, 16, device=device)
    (provider,) = dsl_providers(ops.get_op("paged_attention"))
    with ops.use_provider(provider):
        got = attend(query, kept, scale=0.25)
    assert_close(got, attend(query, grown, scale=0.25).double(), torch.float32)


@pytest.mark.gpu
def test_the_decode_step_replays_as_a_cuda_graph():
    """Run by the GPU campaign's test phase (``-m "gpu or dsl"``)."""
    model, reference = _pair(device="cuda")
    ours, theirs = (StaticCache(config=m.config, max_cache_len=64) for m in (model, reference))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, mode="reduce-overhead")
    ids = prompt(batch=2, length=9).cuda()
    from torch._dynamo.utils import counters

    counters.clear()
    with torch.no_grad():
        model(ids, past_key_values=ours)
        reference(ids, past_key_values=theirs)
        for step in range(20):
            token = prompt(batch=2, length=1, seed=40 + step).cuda()
            got = compiled(token, past_key_values=ours).logits.clone()
            want = reference(token, past_key_values=theirs).logits
            assert _relative(got, want) <= 1e-4, step
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_a_batch_1_decode_step_traces_no_sort_or_scan_and_skips_a_padded_token():
    """At batch 1 a traced step's layout is its one token's flag (no argsort or cumsum per layer, each
    a kernel inside a CUDA graph); a decode token the mask marks as padding is not kept, so the steps
    after it compute what HF computes."""
    model, reference = _pair()
    block = model.model.layers[0].self_attn.block_size
    ours, theirs = (StaticCache(config=m.config, max_cache_len=2 * block) for m in (model, reference))
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return aot_eager(graph, inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    ids = prompt(batch=1, length=5)
    mask = torch.ones(1, 2 * block, dtype=torch.long)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=ours)
        reference(ids, attention_mask=mask, past_key_values=theirs)
        for step in range(5):
            position = ids.shape[1] + step
            mask[:, position] = int(step != 1)  # the second new token is padding
            token = prompt(batch=1, length=1, seed=50 + step)
            got = compiled(token, attention_mask=mask, past_key_values=ours).logits
            want = reference(token, attention_mask=mask, past_key_values=theirs).logits
            if step != 1:  # a padding token's own output is nobody's
                assert _relative(got, want) <= 1e-5, step
    assert len(graphs) == 1
    called = {str(node.target) for node in graphs[0].graph.nodes if node.op in ("call_function", "call_method")}
    assert not {name for name in called if "argsort" in name or "cumsum" in name or "sort" in name}, called
    store = ours.layers[0].store
    assert int(store.kv_lens[0]) == ids.shape[1] + 4  # the padding token was not kept
