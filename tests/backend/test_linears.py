"""Rewire rule 6: the remaining ``nn.Linear`` modules become the library's ``Linear`` by class alone."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hw_agnostic import rewire
from hw_agnostic.layers import Linear, unregister_oot
from hw_agnostic.ops.linear import BLOCK_COLUMNS

from .models import build, prompt

#: A vocabulary wide enough for the LM head to take the blocked schedule at a few rows.
WIDE_VOCAB = 2 * BLOCK_COLUMNS + 5


def _exact_linears(model: nn.Module) -> list[str]:
    return [path for path, module in model.named_modules() if type(module) is nn.Linear]


def test_every_plain_linear_is_swapped_and_the_logits_do_not_move():
    model = build("llama", vocab_size=WIDE_VOCAB)
    without = copy.deepcopy(model)
    report = rewire(model)
    rewire(without, linears=False)
    assert not _exact_linears(model)
    assert {"model.layers.0.self_attn.o_proj", "lm_head"} <= {p for p, m in model.named_modules() if type(m) is Linear}
    assert report.count("hw_agnostic Linear") == 3, report.table()  # two o_proj and the LM head
    assert set(_exact_linears(without)) == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                                            "lm_head"}
    assert model.state_dict().keys() == without.state_dict().keys()
    with torch.no_grad():
        for ids in (prompt(), prompt()[:1, :1]):  # a few rows take the blocked LM head; one row does not
            assert torch.equal(model(ids).logits, without(ids).logits)


def test_ties_and_hooks_stay_on_the_swapped_module():
    model = build("gemma")  # ties its LM head to the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    rewire(model)
    assert type(model.lm_head) is Linear and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model(prompt())
    assert seen and seen[-1][-1] == model.config.vocab_size


def test_subclasses_are_left_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = build("llama")
    model.lm_head.__class__ = Scaled
    reference = copy.deepcopy(model)
    rewire(model)
    assert type(model.lm_head) is Scaled
    with torch.no_grad():
        torch.testing.assert_close(model(prompt()).logits, reference(prompt()).logits, rtol=1e-5, atol=1e-5)


def test_a_plugins_linear_keeps_the_models_modules_as_they_are():
    @Linear.register_oot
    class PluginLinear(Linear):
        pass

    try:
        model = build("llama")
        report = rewire(model)
        assert set(_exact_linears(model)) == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                                              "lm_head"}
        assert report.count("hw_agnostic Linear") == 0
        assert type(model.model.layers[0].mlp.gate_up_proj) is PluginLinear  # the library's own layers build it
    finally:
        unregister_oot("linear")
