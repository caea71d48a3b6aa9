"""A fused layer's last residual add runs with the norm that reads its output next (the next layer's
input norm, the final norm): one ``fused_add_rms_norm`` per layer boundary, never a stale result."""

from __future__ import annotations

import copy

import pytest
import torch

from hw_agnostic import ops, rewire
from hw_agnostic.backend.decoder import NEXT_NORM
from hw_agnostic.backend.report import RewireReport
from tests.backend.models import build, prompt

FUSED_FAMILIES = ["llama", "qwen3", "gemma", "gemma2", "gemma3_text"]


def _ops_of(model, ids, mode=torch.no_grad):
    with mode(), ops.trace_dispatch() as ran:
        logits = model(ids).logits
    return logits, [plan.op for plan in ran]


def _links_removed(model):
    return [layer.__dict__.pop(NEXT_NORM) for layer in model.model.layers]


def _links_restored(model, links):
    for layer, link in zip(model.model.layers, links):
        layer.__dict__[NEXT_NORM] = link


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_each_layer_boundary_is_one_fused_add_and_norm(family):
    model = build(family)
    reference = copy.deepcopy(model)
    report = rewire(model)
    links = [e for e in report.fused if e.result == "next norm"]
    assert [e.path for e in links] == ["model.layers.0", "model.layers.1"], report.table()
    assert "model.norm" in links[-1].detail
    logits, ran = _ops_of(model, prompt())
    links = _links_removed(model)
    _, alone = _ops_of(model, prompt())
    _links_restored(model, links)
    # the second layer's input norm and the final norm came with the adds before them
    assert ran.count("rms_norm") == alone.count("rms_norm") - 2, ran
    assert ran.count("fused_add_rms_norm") == alone.count("fused_add_rms_norm") + 2, ran
    assert ran[-1] == "fused_add_rms_norm" and alone[-1] == "rms_norm"
    with torch.no_grad():
        want = reference(prompt()).logits
    assert (logits - want).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_handoff_changes_no_bit(family):
    """bf16: linked and unlinked rewired models give identical logits (the add rounds where HF's does)."""
    model = build(family, dtype=torch.bfloat16)
    rewire(model)
    linked, ran = _ops_of(model, prompt())
    assert ran[-1] == "fused_add_rms_norm"
    links = _links_removed(model)
    unlinked, alone = _ops_of(model, prompt())
    _links_restored(model, links)
    assert alone[-1] == "rms_norm"
    assert torch.equal(linked, unlinked)


def _with_hook(model, register):
    handle = register(model)
    try:
        with torch.no_grad():
            return model(prompt()).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("how", ["in_place_output", "new_output", "in_place_pre_hook", "norm_hook"])
def test_what_runs_between_layers_is_seen(how):
    """A hook that steers a layer's output in place, replaces it, edits the next layer's input in
    place, or watches the norm itself: the rewired model computes what HF computes with it."""
    steer = torch.linspace(-1, 1, 64)
    seen: list[torch.Tensor] = []
    registers = {
        "in_place_output": lambda m: m.model.layers[0].register_forward_hook(lambda mod, args, out: out.add_(steer)),
        "new_output": lambda m: m.model.layers[1].register_forward_hook(lambda mod, args, out: out * 0.5),
        "in_place_pre_hook": lambda m: m.model.layers[1].register_forward_pre_hook(
            lambda mod, args: (args[0].mul_(2.0), None)[1]),
        "norm_hook": lambda m: m.model.norm.register_forward_hook(lambda mod, args, out: seen.append(out.clone())),
    }
    model = build("llama")
    reference = copy.deepcopy(model)
    rewire(model)
    got = _with_hook(model, registers[how])
    got_norm = seen[:]
    seen.clear()
    want = _with_hook(reference, registers[how])
    assert (got - want).abs().max() <= 1e-5
    if how == "norm_hook":
        assert len(got_norm) == 1 and (got_norm[0] - seen[0]).abs().max() <= 1e-5


def test_a_norm_that_does_not_read_the_output_drops_the_link():
    model = build("llama")
    reference = copy.deepcopy(model)
    rewire(model)
    last = model.model.layers[-1]
    handle = last.register_forward_hook(lambda mod, args, out: out + 0.0)  # the final norm gets another tensor
    for _ in range(2):
        with torch.no_grad():
            got = model(prompt()).logits
    handle.remove()
    assert NEXT_NORM not in last.__dict__  # dropped after the miss
    assert NEXT_NORM in model.model.layers[0].__dict__  # the link that is read stays
    with torch.no_grad():
        assert (got - reference(prompt()).logits).abs().max() <= 1e-5
        assert (model(prompt()).logits - reference(prompt()).logits).abs().max() <= 1e-5


def test_inference_mode_runs_the_add_alone():
    """Inference tensors keep no version counter, so an in-place change could not be seen: no handoff."""
    model = build("llama")
    reference = copy.deepcopy(model)
    rewire(model)
    logits, ran = _ops_of(model, prompt(), mode=torch.inference_mode)
    assert ran.count("rms_norm") == 3, ran  # each layer's input norm and the final norm
    with torch.no_grad():
        assert (logits - reference(prompt()).logits).abs().max() <= 1e-5


def test_generate_with_the_handoff_matches_hf():
    model = build("llama", num_hidden_layers=3)
    reference = copy.deepcopy(model)
    rewire(model)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt(), **options), reference.generate(prompt(), **options))


def test_undoing_one_change_of_a_module_keeps_the_others_in_the_report():
    report = RewireReport()
    report.add("fused", "model.layers.0", "LlamaDecoderLayer", "pre_norm", "residual add")
    report.add("fused", "model.layers.0", "LlamaDecoderLayer", "next norm", "last residual add")
    report.retract("model.layers.0", "next norm")
    assert [e.result for e in report.fused] == ["pre_norm"]
    assert "1 decoder layers fused" in report.table()
