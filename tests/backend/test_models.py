"""rewire() on tiny Hugging Face models: same logits, same tokens, and the replacements happened."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hw_agnostic import ops, rewire
from hw_agnostic.backend import enable_paged_attention
from hw_agnostic.layers import GatedMLP, GatedRMSNorm, LayerNorm, QKVProjection, RMSNorm
from hw_agnostic.tolerances import assert_close
from tests.backend.models import EXPECTED, FAMILIES, build, prompt
from tests.conftest import kernel_device
from tests.harness import dsl_providers


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _assert_rewired(model, report, family: str) -> None:
    norms, mlps, qkv, layout = EXPECTED[family]
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == norms
    assert sum(isinstance(m, GatedMLP) for m in model.modules()) == mlps
    assert sum(isinstance(m, QKVProjection) for m in model.modules()) == qkv
    assert report.count("RMSNorm") == norms and report.count("GatedMLP") == mlps
    assert report.count("PagedAttention") == 2
    if layout:
        assert report.count(layout) == 2, report.table()
    else:
        assert not report.fused
        assert all("post_norm layout" in e.detail for e in report.left if e.original.endswith("DecoderLayer"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_logits_and_greedy_tokens_match_hf(family):
    model = build(family)
    reference = copy.deepcopy(model)
    ids = prompt()
    report = rewire(model)
    _assert_rewired(model, report, family)
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    want = reference(ids).logits.detach()
    assert _relative(got, want) <= 1e-5
    ran_ops = {p.op for p in ran}
    assert {"rms_norm", "paged_attention"} <= ran_ops and {"silu_and_mul", "gelu_and_mul"} & ran_ops
    assert {"write_kv_cache", "rotary_write_kv_cache"} & ran_ops  # the KV write, alone or with the rotation
    with torch.no_grad():
        tokens = model.generate(ids[:1], max_new_tokens=32, min_new_tokens=32, do_sample=False)
        expected = reference.generate(ids[:1], max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2", "phi3"])
def test_bf16_logits_within_the_tolerance_table(family):
    model = build(family, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # Logits carry the rounding of every layer: compare norm-wise, at the bf16 table's rtol.
    assert _relative(got, want) <= 2e-2


def test_a_scaled_residual_is_not_fused_and_stays_correct():
    """Granite with residual_multiplier != 1 adds ``residual + h * m``: no fusion, same results."""
    model = build("granite", residual_multiplier=0.5)
    reference = copy.deepcopy(model)
    report = rewire(model)
    assert not report.fused
    assert any("combines them differently" in e.detail for e in report.left)
    ids = prompt()
    with torch.no_grad():
        assert _relative(model(ids).logits, reference(ids).logits) <= 1e-5


def test_layernorm_and_plain_mlp_models_are_left_correct():
    """OPT: LayerNorms run on layer_norm; fc1 -> relu -> fc2 MLPs are listed with reasons; same logits."""
    config = AutoConfig.for_model("opt", vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = copy.deepcopy(model)
    report = rewire(model)
    assert sum(isinstance(m, LayerNorm) for m in model.modules()) == 5 and report.count("LayerNorm") == 5
    assert not any(isinstance(m, GatedMLP) for m in model.modules())
    assert any(e.path == "model.decoder.layers.0" for e in report.left)  # its MLP is inline: explained
    ids = prompt()
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    assert "layer_norm" in {p.op for p in ran}
    with torch.no_grad():
        assert _relative(got, reference(ids).logits) <= 1e-5


#: Families whose norms are layer norms or gated RMS norms: (family, layer norms, gated norms, fused op).
NORM_FAMILIES = [
    ("stablelm", 5, 0, "fused_add_layer_norm"),
    ("nemotron", 5, 0, "fused_add_layer_norm"),  # LayerNorm1P: (1 + w)
    ("cohere", 3, 0, None),  # weight-only layer norms; parallel attention and MLP: nothing to fuse
    ("bamba", 0, 7, None),  # Mamba-2 mixers' grouped gated norms (its layers are not fused: see the report)
    ("qwen3_next", 0, 1, None),  # linear attention's gated norm
]


@pytest.mark.parametrize("family, layer_norms, gated_norms, fused", NORM_FAMILIES, ids=[f[0] for f in NORM_FAMILIES])
def test_layer_norm_and_gated_norm_families_run_on_their_ops(family, layer_norms, gated_norms, fused):
    from tests.zoo.families import build as build_zoo

    model = build_zoo(family)
    reference = copy.deepcopy(model)
    report = rewire(model)
    assert sum(isinstance(m, LayerNorm) for m in model.modules()) == layer_norms, report.table()
    assert sum(isinstance(m, GatedRMSNorm) for m in model.modules()) == gated_norms, report.table()
    if fused:
        assert any(fused in e.detail for e in report.fused), report.table()
    else:
        assert not report.fused
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    ran_ops = {p.op for p in ran}
    assert ("layer_norm" in ran_ops) == bool(layer_norms) and ("gated_rms_norm" in ran_ops) == bool(gated_norms)
    assert fused is None or fused in ran_ops
    with torch.no_grad():
        assert _relative(got, reference(ids).logits) <= 1e-5


def test_report_prints_as_a_table(capsys):
    rewire(build("llama"), verbose=True)
    printed = capsys.readouterr().out
    assert "replaced" in printed and "model.layers.{i}.mlp (x2)" in printed and "fused" in printed


def test_rewire_twice_changes_nothing_more():
    model = build("llama")
    rewire(model)
    again = rewire(model)
    assert not again.replaced and not again.fused


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: its attention's own forward runs
def test_torch_compile_fullgraph_of_a_rewired_model(family):
    model = build(family)
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        want = reference(ids, use_cache=False).logits
    assert _relative(got, want) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "olmo2"])  # olmo2: its own forward runs
def test_torch_compile_fullgraph_of_a_rewired_decode_step(family):
    """Decode steps over a paged cache trace as one graph: the cache's host bookkeeping (lengths
    seen, the metadata its layers share) is plain Python state that dynamo follows, also in the
    step whose K/V need a new block (the prompt fills the first block but one slot)."""
    from transformers import DynamicCache

    model = build(family)
    reference = copy.deepcopy(model)
    rewire(model)
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    block = model.model.layers[0].self_attn.block_size
    with torch.no_grad():
        model(prompt(length=block - 1), past_key_values=ours, use_cache=True)
        reference(prompt(length=block - 1), past_key_values=theirs, use_cache=True)
        for step in range(2):
            ids = prompt(length=1, seed=10 + step)
            got = compiled(ids, past_key_values=ours, use_cache=True).logits
            want = reference(ids, past_key_values=theirs, use_cache=True).logits
            assert _relative(got, want) <= 1e-5
    assert ours.get_seq_length() == theirs.get_seq_length() == block + 1


@pytest.mark.dsl
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_through_the_dsl_providers(family):
    """The same model, every op forced onto the DSL kernels (interpreters on the CPU)."""
    device = kernel_device()
    model = build(family).to(device)
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt().to(device)
    (provider,) = dsl_providers(ops.get_op("rms_norm"))
    with torch.no_grad(), ops.use_provider(provider), ops.trace_dispatch() as ran:
        got = model(ids).logits
    assert {p.provider for p in ran} == {provider}
    with torch.no_grad():
        assert _relative(got, reference(ids).logits) <= 1e-5
    assert_close(got[0, -1], reference(ids).logits[0, -1].detach().double(), torch.float32)


def test_an_mlp_with_dropout_is_replaced_in_eval_and_drops_out_in_training():
    """SeedOss's MLP ends in a functional dropout: identity in eval, where the replacement is checked."""
    from hw_agnostic.layers import GatedMLP
    from tests.zoo.families import build as build_zoo

    model = build_zoo("seed_oss")
    reference = copy.deepcopy(model)
    report = rewire(model)
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(m.dropout == model.config.residual_dropout and not m.training for m in mlps), report.table()
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _relative(model(ids).logits, reference(ids).logits) <= 1e-5
    mlps[0].train()
    x = torch.randn(4, 64, model.config.hidden_size)
    with torch.no_grad():
        assert (mlps[0](x) == 0).float().mean() > 0.05  # training drops out as the original does


@pytest.mark.parametrize("call, message", [
    (lambda model: rewire(None), "rewire: model must be a torch.nn.Module, got NoneType"),
    (lambda model: rewire(model, attention="yes"), "rewire: attention must be a bool, got str"),
    (lambda model: rewire(model, verify=1), "rewire: verify must be a bool, got int"),
    (lambda model: rewire(model, probe="forward"), "rewire: probe must be a callable"),
    (lambda model: enable_paged_attention(model, block_size=0), "block_size must be >= 1, got 0"),
    (lambda model: enable_paged_attention(model, block_size=2.5), "block_size must be an int, got float"),
], ids=["model", "switch", "verify", "probe", "block-size", "block-size-type"])
def test_bad_arguments_are_named_and_leave_the_model_as_it_was(call, message):
    model = build("llama")
    classes = [type(m) for m in model.modules()]
    with pytest.raises((TypeError, ValueError), match=message):
        call(model)
    assert [type(m) for m in model.modules()] == classes
