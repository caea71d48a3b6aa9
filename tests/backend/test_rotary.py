"""The rotary rule: paged attention modules' apply_rotary_pos_emb on rotary_embedding, where it computes the same."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hw_agnostic import ops, rewire
from hw_agnostic.backend import rotary
from hw_agnostic.layers import PagedAttention
from tests.backend.models import build, prompt
from tests.zoo.families import build as build_zoo


def _paged(model: torch.nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def _rotary_calls(run) -> int:
    """The rotations the rule ran: ``rotary_embedding`` alone, or fused with the step's cache write by the
    direct attention path (whose reference form, outside the tests' plain mode, calls the op inside)."""
    with torch.no_grad(), ops.trace_dispatch() as ran:
        run()
    names = [p.op for p in ran]
    return sum(name == "rotary_write_kv_cache" or name == "rotary_embedding" and (
        index == 0 or names[index - 1] != "rotary_write_kv_cache") for index, name in enumerate(names))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_runs_the_op_and_generates_what_hf_generates(dtype):
    model = build("llama", dtype=dtype)
    reference = copy.deepcopy(model)
    report = rewire(model)
    routed = [e for e in report.replaced if e.result == "rotary_embedding"]
    assert [e.path for e in routed] == [f"model.layers.{i}.self_attn" for i in range(2)], report.table()
    ids = prompt()
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=8, do_sample=False)
    calls = _rotary_calls(lambda: model.generate(ids, max_new_tokens=8, do_sample=False))
    assert calls == 2 * 8  # every layer, the prefill and each decode step
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    # bit for bit: the op computes what HF's function computes, so the logits equal those of the
    # same rewire without the rule
    plain = copy.deepcopy(reference)
    rewire(plain, rotary=False)
    assert _rotary_calls(lambda: plain(ids)) == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    verdicts = rotary.verdicts(_paged(model)[0])
    assert verdicts and all(v.same for v in verdicts.values())


@pytest.mark.parametrize("family", ["gpt_neox", "phi"])
def test_partial_rotary_is_routed(family):
    """GPT-NeoX rotates the first quarter of each head inside its function, Phi splits the heads
    itself and passes the rotary part."""
    model = build_zoo(family)
    reference = copy.deepcopy(model)
    report = rewire(model)
    assert any(e.result == "rotary_embedding" for e in report.replaced), report.table()
    ids = prompt(length=6)
    assert _rotary_calls(lambda: model(ids)) == len(_paged(model))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["glm", "cohere"])
def test_another_rotary_layout_keeps_the_models_function_and_says_why(family):
    """GLM and Cohere rotate interleaved pairs: the probe disagrees, the routing is undone and reported."""
    model = build_zoo(family)
    report = rewire(model)
    left = [e for e in report.left if e.detail.startswith("rotary embedding runs as the model defines it")]
    assert len(left) == len(_paged(model)) and "differs from rotary_embedding's" in left[0].detail, report.table()
    assert not any(e.result == "rotary_embedding" for e in report.replaced)
    assert _rotary_calls(lambda: model(prompt(length=6))) == 0


def _router(module: PagedAttention):
    forward = PagedAttention.forward_of(module)
    while forward is not None:
        found = [v for v in getattr(forward, "__globals__", {}).values() if callable(getattr(v, "routes", None))]
        if found:
            return found[0]
        forward = getattr(forward, "__wrapped__", None)
    raise AssertionError("no rotary router")


def test_routes_says_what_the_router_would_run_and_keeps_the_last_verdict_per_tables():
    """The direct attention path asks ``routes`` before running the rotation inside the KV write."""
    model = build("llama")
    rewire(model, verify=False)
    router = _router(_paged(model)[0])
    router.verdicts.clear()  # (routers live with their modeling module: other tests' probes are in it)
    routes = router.routes
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, config.num_attention_heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(2, 3, config.num_key_value_heads, head_dim, generator=g).transpose(1, 2)
    cos, sin = torch.rand(1, 3, head_dim, generator=g), torch.rand(1, 3, head_dim, generator=g)  # as HF passes them
    assert not routes(q, k, cos, sin)  # nothing probed yet: the router would probe first
    with torch.no_grad():
        model(prompt())  # probes the call signatures
    assert routes(q, k, cos, sin) and routes(q, k, cos, sin)  # the second from the kept verdict
    # the same tables with q / k of another signature: not the kept verdict's
    assert not routes(q.double(), k.double(), cos, sin)
    assert not routes(q[:, :2], k[:, :1], cos, sin)  # other head counts: a signature never probed
    assert not routes(q[:, :, :, :4], k[:, :, :, :4], cos[..., :4], sin[..., :4])
    assert routes(q, k, cos, sin)
    q.requires_grad_(True)
    assert not routes(q, k, cos, sin)  # autograd records: the model's function runs


def test_the_probe_uses_random_tables_not_the_call_s():
    """At position 0 (cos 1, sin 0) every layout agrees; the probe must not be fooled by such a call."""
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_rotary

    q, k = torch.randn(1, 1, 4, 16).transpose(1, 2), torch.randn(1, 1, 2, 16).transpose(1, 2)
    cos, sin = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
    assert torch.equal(glm_rotary(q, k, cos, sin)[0], ops.rotary_embedding(q, k, cos, sin)[0])
    assert not rotary._probe(glm_rotary, q, k, cos, sin).same


def test_training_and_gradients_run_the_models_code():
    model = build("llama")
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt()
    model.train(), reference.train()
    with ops.trace_dispatch() as ran:
        loss = model(ids, labels=ids).loss
    assert not any(p.op == "rotary_embedding" for p in ran)
    want = reference(ids, labels=ids).loss
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    theirs = dict(reference.named_parameters())
    shared = [(name, p) for name, p in model.named_parameters() if name in theirs and p.shape == theirs[name].shape]
    assert any("o_proj" in name for name, _ in shared) and any("embed" in name for name, _ in shared)
    for name, got in shared:
        torch.testing.assert_close(got.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_function_patched_after_the_rewire_is_the_one_called(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = build("llama")
    rewire(model)
    original = modeling_llama.apply_rotary_pos_emb
    calls = []

    def patched(q, k, cos, sin, *rest, **options):
        calls.append(q.shape)
        return original(q, k, cos, sin, *rest, **options)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", patched)
    assert _rotary_calls(lambda: model(prompt())) == 0
    assert len(calls) == 2


def test_undo_restores_the_class_forward():
    model = build("llama")
    changes, left = rotary.rotary_changes(model)  # nothing paged yet: nothing to route
    assert not changes and not left
    rewire(model, rotary=False, verify=False)
    module = _paged(model)[0]
    own = type(module)._hw_agnostic_base.forward
    assert PagedAttention.forward_of(module) is own
    changes, _ = rotary.rotary_changes(model)
    assert len(changes) == 2 and PagedAttention.forward_of(module) is not own
    assert rotary.rotary_changes(model) == ([], [])  # routed already: nothing more
    for change in changes:
        change.undo()
    assert PagedAttention.forward_of(module) is own
    assert _rotary_calls(lambda: model(prompt())) == 0
    changes[0].apply()
    assert _rotary_calls(lambda: model(prompt())) == 1


def test_a_compiled_decode_step_traces_the_op_in_one_graph():
    model = build("llama")
    reference = copy.deepcopy(model)
    rewire(model)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        model(prompt(), past_key_values=ours, use_cache=True)  # eager: probes the call signatures
        reference(prompt(), past_key_values=theirs, use_cache=True)
        ids = prompt(length=1, seed=10)
        got = compiled(ids, past_key_values=ours, use_cache=True).logits
        want = reference(ids, past_key_values=theirs, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each layer's rotation: the op, or the op fused with the step's cache write (the direct attention path)
    assert graphs and all(str(g.code).count("rotary_embedding") + str(g.code).count("rotary_write_kv_cache") >= 2
                          for g in graphs)
