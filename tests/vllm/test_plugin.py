"""The vLLM plugin in-process: registration rules, version checks, numerics, counts.

Runs in the ``.venv-vllm`` tier (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

import pytest
import torch

pytest.importorskip("vllm")
# vLLM's Transformers backend picks its layer classes when first imported.
os.environ.setdefault("VLLM_USE_HW_AGNOSTIC", "1")

import hw_agnostic.integrations.vllm as plugin  # noqa: E402
from hw_agnostic.integrations.vllm import _compat, counts  # noqa: E402
from hw_agnostic.integrations.vllm.layers import vllm_fused_add_rms_norm, vllm_rms_norm  # noqa: E402
from hw_agnostic.ops.registry import COMPILE_ENV  # noqa: E402


@pytest.fixture
def fresh_registries(monkeypatch: pytest.MonkeyPatch):
    """Run register() as a new process would, and undo what it registered afterwards."""
    from vllm.model_executor import custom_op as main_ops
    from vllm.model_executor.hw_agnostic import custom_op as hw_ops
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    saved = dict(main_ops.op_registry_oot), dict(hw_ops.op_registry_oot)
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.delenv(plugin.OVERRIDES_ENV, raising=False)
    monkeypatch.delenv(counts.COUNTS_ENV, raising=False)
    monkeypatch.setenv(COMPILE_ENV, "0")  # the plain reference: the numerics tests compare it bit for bit
    yield main_ops.op_registry_oot, hw_ops.op_registry_oot
    for registry, before in zip((main_ops.op_registry_oot, hw_ops.op_registry_oot), saved):
        registry.clear()
        registry.update(before)
    AttentionBackendEnum.CPU_ATTN.clear_override()


def test_entry_point_is_declared():
    points = {p.name: p.value for p in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("hw_agnostic") == "hw_agnostic.integrations.vllm:register"


def test_does_nothing_without_vllm_use_hw_agnostic(fresh_registries, monkeypatch):
    main, hw = fresh_registries
    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    before = (dict(main), dict(hw))
    plugin.register()
    assert (dict(main), dict(hw)) == before
    assert plugin.registered() == {}


def test_registers_every_override_once(fresh_registries, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    main, hw = fresh_registries
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setenv(plugin.OVERRIDES_ENV, "+attention,+moe")
    plugin.register()
    plugin.register()  # a second load of the plugin in the same process changes nothing
    assert set(plugin.registered().values()) == {"registered"}
    assert set(plugin.registered()) == set(plugin.OVERRIDES)
    assert {"TPAwareRMSNorm", "SiluAndMul"} <= set(hw)
    assert {"TPAwareGemmaRMSNorm", "GeluAndMul", "SwigluOAIAndMul", "UnquantizedFusedMoEMethod"} <= set(main)
    assert hw["TPAwareRMSNorm"].__module__ == "hw_agnostic.integrations.vllm.layers"
    from hw_agnostic.integrations.vllm.attention import BACKEND_PATH

    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
    assert BACKEND_PATH == "hw_agnostic.integrations.vllm.attention.HwAgnosticCPUAttentionBackend"
    from vllm.model_executor.models.transformers.fusers.rms_norm import TPAwareRMSNorm

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        norm = TPAwareRMSNorm(hidden_size=64, eps=1e-6)  # vLLM's own construction builds the override
    assert type(norm) is hw["TPAwareRMSNorm"]


def test_attention_and_moe_are_off_by_default_on_the_cpu(fresh_registries, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    main, hw = fresh_registries
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    plugin.register()
    state = plugin.registered()
    for name in ("attention", "moe"):
        assert "off by default on the CPU" in state[name] and f"+{name}" in state[name]
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden() and "UnquantizedFusedMoEMethod" not in main
    assert {name for name, s in state.items() if s == "registered"} == set(plugin.OVERRIDES) - {"attention", "moe"}


def test_overrides_can_be_turned_off(fresh_registries, monkeypatch):
    main, hw = fresh_registries
    monkeypatch.setenv(plugin.ENABLE_ENV, "true")
    monkeypatch.setenv(plugin.OVERRIDES_ENV, "+attention, -attention,+moe,-moe")  # the last word wins
    plugin.register()
    state = plugin.registered()
    assert state["attention"].startswith("turned off") and state["moe"].startswith("turned off")
    assert state["rms_norm"] == "registered"
    assert "UnquantizedFusedMoEMethod" not in main


@pytest.mark.parametrize("spec", ["-rmsnorm", "moe", "+"])
def test_a_bad_override_spec_is_an_error(fresh_registries, monkeypatch, spec):
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setenv(plugin.OVERRIDES_ENV, spec)
    with pytest.raises(ValueError, match="HW_AGNOSTIC_VLLM_OVERRIDES.*is not \\+name or -name.*they are: rms_norm"):
        plugin.register()


def test_missing_vllm_names_skip_the_override_with_one_warning(fresh_registries, monkeypatch, caplog):
    main, hw = fresh_registries
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setenv(plugin.OVERRIDES_ENV, "+moe")
    monkeypatch.setitem(_compat.REQUIRED, "moe", (("vllm.model_executor.layers.fused_moe", "NoSuchMethod"),))
    monkeypatch.setitem(_compat.REQUIRED, "gelu_and_mul", (("vllm.no_such_module", "GeluAndMul"),))
    with caplog.at_level(logging.WARNING, logger="vllm.hw_agnostic"):
        plugin.register()
    warnings = [r for r in caplog.records if r.name == "vllm.hw_agnostic" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert _compat.SUPPORTED_VERSIONS in message and "NoSuchMethod" in message and "vllm.no_such_module" in message
    assert "UnquantizedFusedMoEMethod" not in main and "GeluAndMul" not in main
    assert plugin.registered()["rms_norm"] == "registered"


def test_the_installed_vllm_has_every_name():
    assert {name: _compat.missing_names(name) for name in plugin.OVERRIDES} == {n: [] for n in plugin.OVERRIDES}


# --------------------------------------------------------------------------------------------
# numerics: vLLM's forward_native, bit for bit


def _vllm_norm(x, residual, weight, eps, gemma):
    from vllm.model_executor.hw_agnostic.layers.layernorm import RMSNorm

    # vLLM's Gemma norm is its rms_norm with weight.float() + 1 (vllm.ir native implementation)
    w = None if weight is None else (weight.float() + 1.0 if gemma else weight)
    if residual is None:
        return RMSNorm._rms_norm(None, x, w, eps)
    return RMSNorm._fused_add_rms_norm(None, x, residual, w, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gemma,has_weight", [(False, True), (False, False), (True, True)],
                         ids=["llama", "no_weight", "gemma"])
def test_norms_compute_what_vllm_computes(dtype, gemma, residual, has_weight):
    torch.manual_seed(0)
    x = (torch.randn(37, 96) * 3).to(dtype)
    res = (torch.randn(37, 96) * 3).to(dtype) if residual else None
    weight = (torch.randn(96) * (0.1 if gemma else 1.0) + (0.0 if gemma else 1.0)).to(dtype) if has_weight else None
    expected = _vllm_norm(x, res, weight, 1e-6, gemma)
    got = vllm_rms_norm(x, weight, 1e-6, gemma=gemma) if res is None else \
        vllm_fused_add_rms_norm(x, res, weight, 1e-6, gemma=gemma)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == e.dtype
        assert torch.equal(g, e), (g - e).abs().max()


def test_a_norm_the_ops_cannot_match_falls_back():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert vllm_rms_norm(x, torch.ones(8), 1e-6, gemma=False) is None  # fp32 weight on bf16 input
    assert vllm_rms_norm(x.to(torch.int32), None, 1e-6, gemma=False) is None


def test_counts_are_written_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv(counts.COUNTS_ENV, str(tmp_path))
    monkeypatch.setattr(counts, "_started", False)
    from hw_agnostic import ops

    ops.reset()
    ops.silu_and_mul(torch.randn(3, 8))
    path = counts.start_if_requested()
    assert path is not None and path.exists()
    records = counts.read_counts(tmp_path)
    assert len(records) == 1 and counts.total_calls(records, "silu_and_mul") >= 1


# --------------------------------------------------------------------------------------------
# MoE: which layers the library serves, which stay vLLM's


def _moe_layer(activation="SILU", *, use_ep=False, dp_size=1, lora=False, act_and_mul=True, dtype=torch.float32,
               expert_map=None, **attrs):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    parallel = SimpleNamespace(use_ep=use_ep, dp_size=dp_size, pcp_size=1, enable_eplb=False)
    moe = SimpleNamespace(moe_parallel_config=parallel, is_act_and_mul=act_and_mul, is_lora_enabled=lora,
                          is_sequence_parallel=False)
    layer = SimpleNamespace(activation=getattr(MoEActivation, activation), expert_map=expert_map,
                            w13_weight=torch.empty(0, dtype=dtype), **attrs)
    return SimpleNamespace(moe=moe), layer


@pytest.mark.parametrize("activation,expected", [("SILU", ("silu", False)), ("GELU_TANH", ("gelu_tanh", False)),
                                                 ("SWIGLUOAI", ("swiglu_oai", True)),
                                                 ("SWIGLUOAI_UNINTERLEAVE", ("swiglu_oai", False))])
def test_moe_layers_the_library_serves(activation, expected):
    from hw_agnostic.integrations.vllm.moe import _activation, why_not_served

    method, layer = _moe_layer(activation)
    assert why_not_served(method, layer) is None
    assert _activation(layer) == expected


@pytest.mark.parametrize("kwargs,reason", [
    (dict(activation="RELU2"), "relu2"), (dict(use_ep=True), "expert/data"), (dict(dp_size=2), "expert/data"),
    (dict(lora=True), "LoRA"), (dict(act_and_mul=False), "act-and-mul"),
    (dict(dtype=torch.float8_e4m3fn), "weight dtype"), (dict(expert_map=torch.arange(4)), "expert map"),
    (dict(activation="SWIGLUOAI", swiglu_limit=10.0), "non-default"),
])
def test_moe_layers_that_stay_vllms(kwargs, reason):
    from hw_agnostic.integrations.vllm.moe import why_not_served

    method, layer = _moe_layer(**kwargs)
    assert reason in why_not_served(method, layer)
