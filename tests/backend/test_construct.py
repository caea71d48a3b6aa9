"""The construction-time path: checkpoints load into merged weights and save to the original keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.monkey_patching import get_patch_mapping

import hw_agnostic
from hw_agnostic.layers import GatedMLP, RMSNorm
from tests.backend.models import EXPECTED, build, config, prompt


def _keys(directory) -> list[str]:
    with safe_open(f"{directory}/model.safetensors", "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "qwen3"])
def test_save_pretrained_round_trips_to_the_original_keys(family, tmp_path):
    original, saved = tmp_path / "hf", tmp_path / "ours"
    hf = build(family)
    hf.save_pretrained(original)
    ids = prompt()
    with torch.no_grad():
        want = hf(ids).logits

    model, report = hw_agnostic.from_pretrained(original)
    model.eval()
    norms, mlps, _, layout = EXPECTED[family]
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == norms
    assert sum(isinstance(m, GatedMLP) for m in model.modules()) == mlps
    assert report.count("GatedMLP") == mlps and report.count(layout) == 2
    with torch.no_grad():
        assert ((model(ids).logits - want).norm() / want.norm()).item() <= 1e-5

    model.save_pretrained(saved)
    assert _keys(saved) == _keys(original)
    assert json.loads((saved / "config.json").read_text())["architectures"] == [type(hf).__name__]
    reloaded = AutoModelForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, want)
    again, _ = hw_agnostic.from_pretrained(saved)
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, model(ids).logits)
    # torch.save / torch.load (a pickle) of the constructed model: its class, its results, its saving
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    loaded.save_pretrained(tmp_path / "loaded")
    assert _keys(tmp_path / "loaded") == _keys(original)
    # a state dict with the original keys (the HF model's, halved) loads into the constructed model
    with torch.no_grad():
        halved = {key: value * 0.5 for key, value in hf.state_dict().items()}
    assert not model.load_state_dict(halved).missing_keys
    hf.load_state_dict(halved)
    with torch.no_grad():
        assert ((model(ids).logits - hf(ids).logits).norm() / hf(ids).logits.norm()).item() <= 1e-5


def test_from_config_builds_our_layers_and_leaves_transformers_unpatched():
    model, report = hw_agnostic.from_config(config("llama"))
    assert any(isinstance(m, GatedMLP) for m in model.modules())
    assert not get_patch_mapping()
    plain = AutoModelForCausalLM.from_config(config("llama"))
    assert not any(isinstance(m, (GatedMLP, RMSNorm)) for m in plain.modules())


def test_loading_merges_each_layer_once(tmp_path):
    """gate and up arrive as one parameter per layer: no second copy is kept."""
    build("llama").save_pretrained(tmp_path)
    model, _ = hw_agnostic.from_pretrained(tmp_path)
    params = dict(model.named_parameters())
    assert "model.layers.0.mlp.gate_up_proj.weight" in params
    assert not any("gate_proj" in name or "up_proj.weight" in name.replace("gate_up_proj", "") for name in params)
