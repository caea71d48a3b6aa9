"""Attention modules that compute attention in their own code, served on the paged kernels.

Families whose attention writes ``cache.update`` and then computes ``softmax(q k^T + mask) v``
itself (BART-style ``bmm``, BERT-style ``matmul``, GPT-NeoX-style ``baddbmm``) or calls SDPA
itself (Falcon before transformers 5.25, which moved it onto ``ALL_ATTENTION_FUNCTIONS``): rewired, verified, and checked token for token in ``generate`` with left
padding, with ``paged_attention`` running once per layer and step. Modules whose attention the
kernel cannot compute (ALiBi, n-gram attention, a bidirectional image prefix, cross-attention)
stay as they were with the reason; enabled without verification, they fall back to their own
attention and still compute what the original did.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from hw_agnostic import ops, rewire
from hw_agnostic.backend.attention import (
    OWN_CODE, _masks_agree, attention_refusal, disable_paged_attention, enable_paged_attention,
)
from hw_agnostic.layers import PagedAttention
from hw_agnostic.tolerances import assert_close
from tests.zoo.families import tiny_config

NEW_TOKENS = 6
#: family -> attention implementation (Falcon's code differs between the two)
SERVED = {
    "xglm": "eager",
    "trocr": "eager",
    "megatron-bert": "eager",
    "roformer": "eager",
    "gpt_neox_japanese": "eager",
    "falcon": "sdpa",
    "falcon-eager": "eager",
}


def _build(family: str, attn_implementation: str = "eager", **overrides):
    config = tiny_config(family.removesuffix("-eager"), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    return model, copy.deepcopy(model)


def _padded(batch: int = 2, length: int = 7):
    ids = torch.randint(3, 200, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _own_code_modules(model) -> list[str]:
    return [path for path, m in model.named_modules() if isinstance(m, PagedAttention) and "OwnCode" in
            " ".join(c.__name__ for c in type(m).__mro__)]


def _paged_modules(model) -> list[str]:
    return [path for path, m in model.named_modules() if isinstance(m, PagedAttention)]


def _computes_its_own_attention(model) -> bool:
    """Whether the family's attention is its own code in the installed transformers (Falcon's was until 5.25)."""
    return any(attention_refusal(m) == OWN_CODE for m in model.modules())


def _left(report, text: str) -> list:
    return [e for e in report.left if text in e.detail]


@pytest.mark.parametrize("family", sorted(SERVED))
def test_generate_runs_the_kernel_and_matches_greedy(family):
    model, reference = _build(family, SERVED[family])
    report = rewire(model)
    assert report.verification.ran and not report.verification.undone, report.table()
    own_code = _computes_its_own_attention(reference)
    served = _own_code_modules(model) if own_code else _paged_modules(model)
    assert served and not _left(report, "own code"), report.table()
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = model.generate(ids, **kwargs)
    with torch.no_grad():
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert sum(plan.op == "paged_attention" for plan in record) == NEW_TOKENS * len(served)


def test_without_cache_with_attentions_and_in_training_the_module_computes_as_before():
    model, reference = _build("xglm")
    rewire(model)
    ids, mask = _padded()
    real = mask.bool()
    with torch.no_grad():
        got = model(ids, attention_mask=mask, use_cache=False)
        want = reference(ids, attention_mask=mask, use_cache=False)
        assert_close(got.logits[real], want.logits[real].double())
        got = model(ids, attention_mask=mask, output_attentions=True)
        want = reference(ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        assert_close(a.permute(0, 2, 1, 3)[real], b.permute(0, 2, 1, 3)[real].double())
    for m in (model, reference):
        m.train()
        for module in m.modules():  # training mode without randomness: dropout off everywhere
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for name in ("dropout", "attention_dropout", "activation_dropout"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)
    losses = [m(ids, attention_mask=mask, labels=ids).loss for m in (model, reference)]
    assert_close(losses[0], losses[1].double())
    for loss in losses:
        loss.backward()
    grads = dict(reference.named_parameters())
    compared = 0
    for name, param in model.named_parameters():  # merged q/k/v projections have other names
        if name in grads and param.grad is not None:
            assert_close(param.grad, grads[name].grad.double())
            compared += 1
    assert compared


def test_no_attention_weights_escape_as_placeholders():
    model, _ = _build("xglm")
    rewire(model)
    layer = model.model.layers[0].self_attn
    ids, mask = _padded()
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True)
    output, weights = seen[0]
    assert weights is None and torch.isfinite(output).all()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_falcon_with_alibi_is_left(implementation):
    model, _ = _build("falcon", implementation, alibi=True)
    own_code = _computes_its_own_attention(model)
    report = rewire(model)
    # own code: its interpreter sees the ALiBi mask; through the attention interface (transformers
    # >= 5.25) ALiBi is folded into the mask the attention function is given, which it checks
    left = _left(report, "UnrecognisedAttention" if own_code else "UnservableMask")
    assert len(left) == 2 and all("not causal over its cached tokens" in e.detail for e in left), report.table()
    assert not _paged_modules(model) and report.verification.undone == 2


@pytest.mark.parametrize("family, reason", [
    ("bloom", "masks its attention scores other than causally"),  # ALiBi
    ("git", "not causal over its cached tokens"),  # the image prefix attends both ways
    ("prophetnet", "applies einsum"),  # n-gram attention
    ("cpmant", "3-D attention mask"),  # segment masks and a relative-position bias
])
def test_what_the_kernel_cannot_compute_is_left_with_the_reason(family, reason):
    model, reference = _build(family)
    report = rewire(model)
    left = _left(report, "UnrecognisedAttention")
    assert left and all(reason in e.detail for e in left), report.table()
    assert not _own_code_modules(model)


@pytest.mark.parametrize("family", ["trocr", "mvp"])
def test_cross_attention_is_left(family):
    model, _ = _build(family)
    report = rewire(model)
    cross = _left(report, "cross-attention")
    assert cross and all("encoder_attn" in e.path for e in cross)
    assert all(path.endswith("self_attn") for path in _own_code_modules(model))


@pytest.mark.parametrize("family, implementation, overrides", [
    ("bloom", "eager", {}),  # ALiBi added to the scores
    ("cpmant", "eager", {}),  # a 3-D mask: no padding to read on write
    ("falcon", "sdpa", {"alibi": True}),  # ALiBi folded into the mask: padding misread from it is taken back
    ("falcon", "eager", {"alibi": True}),
    ("git", "eager", {}),  # a bidirectional image prefix
])
def test_unverified_modules_it_cannot_compute_fall_back_to_their_own_attention(family, implementation, overrides,
                                                                                caplog):
    model, reference = _build(family, implementation, **overrides)
    assert enable_paged_attention(model)
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        got = model.generate(ids, **kwargs)
        again = model.generate(ids, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got, want) and torch.equal(again, want)
    if family != "cpmant":  # found unrecognised while running (cpmant's mask is refused before)
        assert "runs its own attention over K/V read back from the pages" in caplog.text


def test_save_and_load_keep_the_original_keys(tmp_path):
    model, reference = _build("xglm")
    rewire(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(reference)
    assert list(loaded.state_dict()) == list(reference.state_dict())
    ids, _ = _padded()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def _causal(batch: int, q_len: int, seen: int, window: int | None = None) -> torch.Tensor:
    rows = torch.arange(q_len)[:, None] + seen - q_len
    columns = torch.arange(seen)[None]
    hidden = columns > rows
    if window is not None:
        hidden |= columns <= rows - window
    return torch.zeros(batch, 1, q_len, seen).masked_fill(hidden, torch.finfo(torch.float32).min)


def test_masks_agree_only_with_the_kernels_causal_and_padding_rule():
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, :2] = False
    padded = _causal(2, 6, 6).masked_fill(~real[:, None, None, :], torch.finfo(torch.float32).min)
    assert _masks_agree([(padded, 1.0)], real, 6, 6, 2, torch.device("cpu"))
    assert _masks_agree([(_causal(2, 1, 6), 1.0)], None, 6, 1, 2, torch.device("cpu"))  # a decode step
    assert not _masks_agree([(_causal(2, 6, 6), 1.0)], real, 6, 6, 2, torch.device("cpu"))  # padding visible
    assert not _masks_agree([(_causal(2, 6, 6, window=3), 1.0)], None, 6, 6, 2, torch.device("cpu"))
    # a window agrees only with the window the module passes to its attention
    assert _masks_agree([(_causal(2, 6, 6, window=3), 1.0)], None, 6, 6, 2, torch.device("cpu"), window=3)
    assert not _masks_agree([(_causal(2, 6, 6, window=3), 1.0)], None, 6, 6, 2, torch.device("cpu"), window=4)
    assert not _masks_agree([], None, 6, 6, 2, torch.device("cpu"))  # no mask: not causal
    alibi = torch.arange(6.0).expand(2, 4, 1, 6)
    assert not _masks_agree([(_causal(2, 6, 6), 1.0), (alibi, 1.0)], None, 6, 6, 2, torch.device("cpu"))
    # ALiBi folded into the mask moves its diagonal off zero, so reading padding from it marks real
    # tokens as padding; those queries must not be skipped by the check
    misread = torch.eye(6, dtype=torch.bool)[0].expand(2, 6)
    assert not _masks_agree([(_causal(2, 6, 6) + alibi, 1.0)], misread, 6, 6, 2, torch.device("cpu"))


def test_enabling_can_be_undone():
    model, reference = _build("xglm")
    paths = enable_paged_attention(model)
    assert paths == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert disable_paged_attention(model) == paths
    for path in paths:
        module, original = model.get_submodule(path), reference.get_submodule(path)
        assert type(module) is type(original) and set(vars(module)) == set(vars(original))


@pytest.mark.dsl
@pytest.mark.parametrize("family, implementation", [("xglm", "eager"), ("falcon", "sdpa")])
def test_interpreted_attention_on_the_kernels(family, implementation):
    from hw_agnostic.ops.paged_attention import paged_attention_op
    from hw_agnostic.ops.write_kv_cache import write_kv_cache_op
    from tests.harness import dsl_providers

    model, reference = _build(family, implementation)
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = reference.generate(ids, **kwargs)
    enable_paged_attention(model)
    for provider in dsl_providers(paged_attention_op):
        with torch.no_grad(), ops.use_provider(provider, paged_attention_op, write_kv_cache_op), \
                ops.trace_dispatch() as record:
            got = model.generate(ids, **kwargs)
        assert torch.equal(got, want)
        assert {(plan.op, plan.provider) for plan in record} == {("paged_attention", provider),
                                                                ("write_kv_cache", provider)}


def test_compiled_forward_in_generate():
    """Inside a compiled model the module runs eagerly (a graph break), still on the kernel.

    Dynamo's tracing and AOTAutograd's (our ops' fake implementations) decide that; Inductor's code
    generation, which tests/test_compile.py covers, would add a minute of C++ compiles on a fresh
    machine for the graphs around the break."""
    model, reference = _build("xglm")
    rewire(model)
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.forward = torch.compile(model.forward, backend="aot_eager")
    with torch.no_grad(), ops.trace_dispatch() as record:
        got = model.generate(ids, **kwargs)
    with torch.no_grad():
        assert torch.equal(got, reference.generate(ids, **kwargs))
    assert sum(plan.op == "paged_attention" for plan in record) == 4 * 2


@pytest.mark.parametrize("family", ["xglm", "gpt_neox_japanese"])
def test_a_static_cache_keeps_transformers_layers_under_own_code_attention(family):
    """Own-code attention reads the positions seen as an int, which static pages keep on the device:
    a StaticCache's layers stay transformers' own (graphable as they are) and the module's own
    attention serves them."""
    from transformers.cache_utils import StaticLayer

    model, reference = _build(family, SERVED[family])
    rewire(model)
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad():
        got = model.generate(ids, return_dict_in_generate=True, **kwargs)
        want = reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want)
    assert all(type(layer) is StaticLayer for layer in got.past_key_values.layers)
