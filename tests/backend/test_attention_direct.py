"""The direct path of paged attention modules whose forward is the common Hugging Face one."""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.llama import modeling_llama
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
from transformers.models.phi3.modeling_phi3 import Phi3Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from hw_agnostic import ops, rewire
from hw_agnostic.backend.attention_direct import _head_counts, _head_views, _sliced_heads
from hw_agnostic.backend.attention_forms import _TEMPLATE, recognise
from hw_agnostic.layers.attention import _STATE, PagedAttention
from hw_agnostic.layers.qkv import QKVProjection

from .models import TINY, TOKENS, build, prompt

RECOGNISED = ["llama", "mistral", "qwen2", "gemma", "gemma2", "granite", "qwen3", "gemma3_text", "phi3", "olmo2"]


def _paged(model):
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def _count_direct(model) -> dict[str, int]:
    """Counts, over every paged module of ``model``, the calls its direct path took and declined."""
    counts = {"taken": 0, "declined": 0}
    for module in _paged(model):
        state = module.__dict__[_STATE]
        direct = state.direct

        def counting(mod, arguments, direct=direct):
            result = direct(mod, arguments)
            counts["declined" if result is NotImplemented else "taken"] += 1
            return result

        state.direct = counting
    return counts


def _rewired(family):
    model = build(family)
    rewire(model)
    return model


def _without_direct(model):
    for module in _paged(model):
        module.__dict__[_STATE].direct = None
    return model


def _generate(model, ids, steps=6):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def _both_paths_agree(rewired):
    """A prompt and five decode steps of the models ``rewired()`` builds, one through the direct path
    and one through the general path: every call of the first takes the direct path (each paged
    layer, prompt and five steps), and tokens and logits agree bit for bit. Returns the direct model,
    its counts, tokens and logits."""
    direct, general = rewired(), _without_direct(rewired())
    counts = _count_direct(direct)
    ids = prompt(batch=1, length=14)
    (got_tokens, got_logits), (want_tokens, want_logits) = _generate(direct, ids), _generate(general, ids)
    assert counts == {"taken": len(_paged(direct)) * 6, "declined": 0} and _paged(direct)
    assert torch.equal(got_tokens, want_tokens) and torch.equal(got_logits, want_logits)
    return direct, counts, got_tokens, got_logits


@pytest.mark.parametrize("family", RECOGNISED)
def test_the_direct_path_computes_what_the_forward_computes_bit_for_bit(family):
    """Prompt and decode steps through both paths: the same tokens and logits, bit for bit, also past
    a sliding window (Mistral, Gemma-2: the window and softcap the forward passes are evaluated)."""
    _, _, got_tokens, got_logits = _both_paths_agree(lambda: _rewired(family))
    with torch.no_grad():
        reference = build(family)(got_tokens[:, :-1]).logits[:, 13:]
    torch.testing.assert_close(got_logits[:, 0], reference[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_cache_holds_the_same_pages_after_either_path(family):
    direct, general = _rewired(family), _without_direct(_rewired(family))
    caches = [DynamicCache(config=direct.config), DynamicCache(config=general.config)]
    with torch.no_grad():
        for model, cache in zip((direct, general), caches):
            model(prompt(batch=1, length=5), cache=cache, use_cache=True)
            model(prompt(batch=1, length=1, seed=3), cache=cache, use_cache=True)
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        for got, want in zip(mine.read(), theirs.read()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "olmo2"])
def test_the_query_and_key_norms_are_called_as_modules_hooks_included(family):
    """``q_norm`` / ``k_norm`` of the heads, called as the forward calls them: on each part's
    ``[B, T, H, D]`` heads (Qwen3), on the transposed ``[B, H, T, D]`` ones (Gemma-3), on the whole
    projections ``[B, T, H * D]`` (OLMo-2)."""
    model = _rewired(family)
    counts = _count_direct(model)
    seen = []
    module = _paged(model)[0]
    module.q_norm.register_forward_hook(lambda norm, args, out: seen.append(("q", tuple(out.shape))))
    module.k_norm.register_forward_hook(lambda norm, args, out: seen.append(("k", tuple(out.shape))))
    with torch.no_grad():
        model(prompt(batch=1, length=5))
    heads, kv_heads, head_dim = (model.config.num_attention_heads, model.config.num_key_value_heads,
                                 module.head_dim)
    assert counts["taken"] == len(_paged(model)) and counts["declined"] == 0
    if family == "qwen3":
        assert seen == [("q", (1, 5, heads, head_dim)), ("k", (1, 5, kv_heads, head_dim))]
    elif family == "olmo2":
        assert seen == [("q", (1, 5, heads * head_dim)), ("k", (1, 5, kv_heads * head_dim))]
    else:
        assert seen == [("q", (1, heads, 5, head_dim)), ("k", (1, kv_heads, 5, head_dim))]


@pytest.mark.parametrize("family", ["llama", "phi3", "olmo2"])
def test_left_padded_generation_takes_it_and_matches_the_general_path(family):
    direct, general = _rewired(family), _without_direct(_rewired(family))
    counts = _count_direct(direct)
    ids = prompt(batch=2, length=6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    outputs = []
    for model in (direct, general):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outputs.append((out.sequences, torch.stack(out.logits)))
    assert counts["taken"] == 2 * 3 and counts["declined"] == 0
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_calls_it_cannot_take_run_the_forward():
    """Recorded attention weights, a hook on a projection part, training: the module's forward runs
    (and the hook fires)."""
    model = _rewired("llama")
    counts = _count_direct(model)
    ids = prompt(batch=2, length=6)
    with torch.no_grad():
        model(ids[:1], output_attentions=True)
    assert counts["taken"] == 0 and counts["declined"] == 2

    fired = []
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: fired.append(1))
    with torch.no_grad():
        model(ids[:1])
    handle.remove()
    assert fired == [1] and counts["taken"] == 1  # the other layer took it

    attention = model.model.layers[0].self_attn
    attention.config._attn_implementation = "sdpa"  # its config no longer names the paged function
    with torch.no_grad():
        model(ids[:1])
    attention.config._attn_implementation = "hw_agnostic_paged"
    assert counts["taken"] == 2 and counts["declined"] == 4

    model.train()
    model(ids[:1]).logits.sum().backward()
    assert counts["taken"] == 2
    model.eval()
    with torch.no_grad():
        model(ids[:1])
    assert counts["taken"] == 4


def test_a_merge_undone_by_verification_leaves_the_forward_to_run():
    model = _rewired("llama")
    counts = _count_direct(model)
    attention = model.model.layers[0].self_attn
    attention.q_proj = torch.nn.Linear(64, 64, bias=False)  # no longer a part of qkv_proj
    with torch.no_grad():
        model(prompt(batch=1, length=3))
    assert counts["declined"] == 1 and counts["taken"] == 1


def test_only_the_template_forward_is_recognised(tmp_path):
    assert recognise(modeling_llama.LlamaAttention).qk_norms is None
    assert recognise(Qwen3Attention).qk_norms == "heads"  # q_norm / k_norm of each part's heads
    assert recognise(Gemma3Attention).qk_norms == "transposed"  # ... of the transposed heads
    assert recognise(Olmo2Attention).qk_norms == "whole"  # ... of the whole q / k projections
    assert recognise(Phi3Attention).fused and not recognise(modeling_llama.LlamaAttention).fused  # one qkv_proj

    namespace = dict(vars(modeling_llama))
    template = textwrap.dedent(_TEMPLATE)
    assert "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n" in template
    extra_statement = template.replace("value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
                                       "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2) * 2")
    sinks = template.replace("scaling=self.scaling,", "scaling=self.scaling, s_aux=self.sinks,")
    other_keyword = template.replace("scaling=self.scaling,", "scaling=self.scaling, value_scale=self.value_scale,")
    signature = "def forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):"
    assert signature in template
    reordered = template.replace(signature, "def forward(self, hidden_states, attention_mask, cache=None, "
                                            "position_embeddings=None, **kwargs):")
    other_default = template.replace(signature, signature.replace("cache,", "cache=0,"))
    with_positions = signature.replace("cache,", "cache, position_ids=None,")
    positions_passed_on = template.replace(signature, with_positions).replace(
        "scaling=self.scaling,", "scaling=self.scaling, position_ids=position_ids,")
    positions_kept = template.replace(signature, with_positions)  # not passed on: **kwargs would have
    q_norm_only = template.replace("query_states = self.q_proj(hidden_states).view(hidden_shape)",
                                   "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))")
    window = template.replace("scaling=self.scaling,", "scaling=self.scaling, sliding_window=self.window,")
    merged = "attn_output = attn_output.reshape(*input_shape, -1).contiguous()\n"
    dropout = template.replace(merged, merged + "    attn_output = nn.functional.dropout(attn_output, p=self.p, "
                                               "training=self.training)\n")
    dropout_in_training = dropout.replace("training=self.training", "training=True")
    assert len({template, extra_statement, sinks, other_keyword, window, q_norm_only, dropout,
                dropout_in_training, reordered, other_default, positions_passed_on, positions_kept}) == 12
    found = {}
    for name, source in (("template", template), ("scaled values", extra_statement), ("sinks", sinks),
                         ("other keyword", other_keyword), ("window", window), ("reordered", reordered),
                         ("other default", other_default), ("positions passed on", positions_passed_on),
                         ("positions kept", positions_kept), ("q norm only", q_norm_only), ("dropout", dropout),
                         ("dropout in training", dropout_in_training)):
        path = tmp_path / f"{name.replace(' ', '_')}.py"  # inspect.getsource reads the forward's file
        path.write_text(textwrap.dedent(source))
        code = compile(textwrap.dedent(source), str(path), "exec")
        exec(code, namespace)  # noqa: S102 - test source
        found[name] = recognise(type(name.title().replace(" ", ""), (modeling_llama.LlamaAttention,),
                                     {"forward": namespace["forward"]}))
    assert found["template"] is not None and not found["template"].forwarded
    assert found["scaled values"] is None and found["other keyword"] is None and found["q norm only"] is None
    assert found["window"] is not None and [name for name, _ in found["window"].forwarded] == ["sliding_window"]
    assert found["sinks"] is not None and [name for name, _ in found["sinks"].forwarded] == ["s_aux"]
    # parameters in another order, defaults None: read by name; any other default: not the template's call
    assert found["reordered"] is not None and found["other default"] is None
    assert found["positions passed on"] is not None and found["positions kept"] is None
    assert found["dropout"] is not None and found["dropout in training"] is None


def test_the_heads_are_the_views_the_forward_makes_of_each_part():
    """The direct path splits the merged projection's output into heads at once: each of q, k and v
    is the view the forward's ``part.view(...).transpose(1, 2)`` makes (offset, sizes, strides)."""
    attention = _rewired("llama").model.layers[0].self_attn
    qkv, head_dim = attention.qkv_proj, attention.head_dim
    heads = _head_counts(type(qkv), qkv.sizes, head_dim)
    assert heads == tuple(size // head_dim for size in qkv.sizes)
    hidden = torch.randn(2, 5, qkv.proj.in_features)
    with torch.no_grad():
        merged = qkv.proj(hidden)
        width = merged.shape[-1]
        # the projection's output, one at an offset into a larger buffer, one not contiguous
        for output in (merged, torch.randn(3, 2, 5, width)[1], torch.randn(5, 2, width).transpose(0, 1)):
            want = [part.view(2, 5, -1, head_dim).transpose(1, 2) for part in output.split_with_sizes(qkv.sizes, -1)]
            for plain in (True, False):  # as_strided outside a trace, the forward's ops inside one
                got = _head_views(output, (2, 5, -1, head_dim), heads, plain)
                for g, w in zip(got, want, strict=True):
                    assert (g.data_ptr(), g.shape, g.stride()) == (w.data_ptr(), w.shape, w.stride())
                    assert g._base is (output if output._base is None else output._base)
    assert _head_counts(type(qkv), (64, 48, 48), 32) is None  # a part of no whole number of heads


def test_a_plugins_merged_projection_forward_is_still_called():
    """A QKVProjection whose forward a subclass overrides (an out-of-tree plugin) is called for its
    parts, not bypassed by the one-view split."""
    model = _rewired("llama")
    counts = _count_direct(model)
    calls = []

    class Logged(QKVProjection):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    for layer in model.model.layers:
        layer.self_attn.qkv_proj.__class__ = Logged
    with torch.no_grad():
        model(prompt(batch=1, length=3))
    assert counts["taken"] == 2 and len(calls) == 2


def test_a_fused_projection_is_called_as_a_module_and_sliced_as_the_forward_slices():
    """Phi-3's ``qkv_proj``: its hooks fire on the direct path, and the heads are the views the
    forward's slices make (offset, sizes, strides), also where a slice is no whole number of heads."""
    model = _rewired("phi3")
    counts = _count_direct(model)
    attention = model.model.layers[0].self_attn
    fired = []
    attention.qkv_proj.register_forward_hook(lambda module, args, out: fired.append(tuple(out.shape)))
    with torch.no_grad():
        model(prompt(batch=1, length=4))
    assert counts == {"taken": 2, "declined": 0} and len(fired) == 1

    head_dim, heads, kv_heads = attention.head_dim, model.config.num_attention_heads, attention.num_key_value_heads
    width = (heads + 2 * kv_heads) * head_dim

    def forwards(qkv, shape):
        query_pos = heads * head_dim
        parts = (qkv[..., :query_pos], qkv[..., query_pos: query_pos + kv_heads * head_dim],
                 qkv[..., query_pos + kv_heads * head_dim:])
        return [part.view(shape).transpose(1, 2) for part in parts]

    for qkv in (torch.randn(2, 5, width), torch.randn(5, 2, width).transpose(0, 1),  # contiguous, or not
                torch.randn(2, 5, width + head_dim // 2)):  # a value slice of no whole number of heads
        shape = (2, 5, -1, head_dim)
        for plain in (True, False):
            try:
                want = forwards(qkv, shape)
            except RuntimeError as error:  # the forward's own view fails: so does the direct path's
                with pytest.raises(RuntimeError, match=re.escape(str(error))):
                    _sliced_heads(attention, qkv, shape, plain)
                continue
            got = _sliced_heads(attention, qkv, shape, plain)
            for g, w in zip(got, want, strict=True):
                assert (g.data_ptr(), g.shape, g.stride()) == (w.data_ptr(), w.shape, w.stride())


def _rewired_from_config(family, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **TINY, **TOKENS, **config)).eval()
    rewire(model)
    return model


@pytest.mark.parametrize("use_qk_norm", [False, True])
def test_a_forward_whose_head_norms_a_flag_switches_takes_it_bit_for_bit(use_qk_norm):
    """Cohere's forward norms each part's heads where ``self.use_qk_norm`` says so: read on every call."""
    direct, counts, _, _ = _both_paths_agree(lambda: _rewired_from_config("cohere", use_qk_norm=use_qk_norm))
    attention = _paged(direct)[0]
    assert recognise(type(attention)._hw_agnostic_base).qk_norms == "optional heads"
    if use_qk_norm:
        _norm_called_only_while_flagged(direct, counts, "q_norm", "use_qk_norm")


def _norm_called_only_while_flagged(direct, counts, norm, flag):
    """A call with ``flag`` off does not call the q norm ``norm``, one with it on does: the flag is
    read on every call, which takes the direct path either way."""
    attention = _paged(direct)[0]
    seen = []
    getattr(attention, norm).register_forward_hook(lambda *_: seen.append(1))
    for on in (False, True):
        setattr(attention, flag, on)
        with torch.no_grad():
            direct(prompt(batch=1, length=3))
    assert seen == [1] and counts["declined"] == 0


def _rotates_in_the_write(direct):
    """Whether a call of ``direct`` rotates its queries and keys in the step's write (every layer) and
    nowhere else."""
    with torch.no_grad(), ops.trace_dispatch() as ran:
        direct(prompt(batch=1, length=3))
    names = [plan.op for plan in ran]
    return names.count("rotary_write_kv_cache") == len(_paged(direct)) and "rotary_embedding" not in names


def test_a_forward_dropping_out_its_merged_heads_takes_it_bit_for_bit():
    """Starcoder2's forward drops out the merged heads (``training=self.training``), which outside
    training leaves them as they are: recognised, and both paths give the same tokens and logits."""
    _both_paths_agree(lambda: _rewired_from_config("starcoder2", sliding_window=16, residual_dropout=0.5))


@pytest.mark.parametrize("family, clip_qkv", [("olmo", None), ("olmo", 0.05), ("olmoe", 0.05)])
def test_projections_clamped_in_place_take_it_bit_for_bit(family, clip_qkv):
    """OLMo's and OLMoE's forwards clamp the q/k/v projections in place where ``config.clip_qkv`` says
    so (OLMoE after its whole-projection norms): the direct path clamps the same tensors."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, clip_qkv=clip_qkv))
    assert recognise(type(_paged(direct)[0])._hw_agnostic_base).clipped


@pytest.mark.parametrize("family, config", [
    ("exaone4", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2)),
    ("cohere2", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("smollm3", dict(no_rope_layers=[1, 0])),
], ids=["exaone4-hybrid", "exaone4-no-window", "cohere2-hybrid", "smollm3-nope-layer"])
def test_a_rotary_embedding_applied_under_a_test_takes_it_bit_for_bit(family, config):
    """Forwards that rotate q / k only where a test of the module says so, read per call: Exaone-4
    not on the global layers of a model with sliding ones, Cohere-2 on the sliding layers alone,
    SmolLM3 on the layers that ``use_rope``; a prompt past the window and decode steps."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, **config))
    assert recognise(type(_paged(direct)[0])._hw_agnostic_base).rotary_condition is not None


def test_the_rotary_test_is_read_on_every_call():
    """SmolLM3's ``use_rope`` switched off on a module after rewiring: the direct path follows the flag
    as the forward does (both paths agree), and the switch changes what the model computes."""
    def switched():
        model = _rewired_from_config("smollm3", no_rope_layers=[1, 1])
        _paged(model)[1].use_rope = False
        return model

    direct, _, _, logits = _both_paths_agree(switched)
    unswitched = _without_direct(_rewired_from_config("smollm3", no_rope_layers=[1, 1]))
    assert not torch.equal(_generate(unswitched, prompt(batch=1, length=14))[1], logits)

def test_attention_sinks_passed_as_a_keyword_take_it_bit_for_bit():
    """GPT-OSS passes its attention sinks (``s_aux=self.sinks``) with its window: evaluated per call
    and read by the kernel, on a hybrid of sliding and full layers; a prompt past the window."""
    def gpt_oss():
        model = _rewired_from_config("gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        for attention in _paged(model):  # sinks that matter (they start at zero)
            attention.sinks.data.normal_()
        return model

    direct, *_ = _both_paths_agree(gpt_oss)
    assert [name for name, _ in recognise(type(_paged(direct)[0])._hw_agnostic_base).forwarded] == [
        "sliding_window", "s_aux"]


@pytest.mark.parametrize("family, config", [("nanochat", {}), ("hunyuan_v1_dense", dict(head_dim=16))],
                         ids=["nanochat", "hunyuan_v1_dense"])
def test_query_and_key_norms_after_the_rotary_embedding_take_it_bit_for_bit(family, config):
    """NanoChat and HunYuan norm the rotated heads (HunYuan's norms are ``query_layernorm`` /
    ``key_layernorm``): the direct path rotates, calls those modules on the rotated heads (their
    hooks too) and writes what they return."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, **config))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.qk_norms == "after rotary"
    q_norm = getattr(attention, recognised.norm_names[0])
    seen = []
    q_norm.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        direct(prompt(batch=1, length=3))
    assert seen == [(1, direct.config.num_attention_heads, 3, attention.head_dim)]


@pytest.mark.parametrize("family, config", [
    ("granitemoehybrid", dict(layer_types=["full_attention"] * 2, position_embedding_type="rope",
                              num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)),
    ("granitemoehybrid", dict(layer_types=["full_attention"] * 2, position_embedding_type=None,
                              num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64)),
    ("granite_swa", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
], ids=["granite-4-rope", "granite-4-nope", "granite-swa"])
def test_a_forward_rotating_only_where_given_tables_takes_it_bit_for_bit(family, config):
    """Granite-4.0's attention takes its parameters in another order and rotates only ``if
    position_embeddings is not None``: with the model's rotary tables, and without them (NoPE, where
    the direct path writes the heads unrotated); Granite-SWA's the same with a window."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, **config))
    recognised = recognise(type(_paged(direct)[0])._hw_agnostic_base)
    assert recognised.rotary_optional and recognised.rotary_condition is None


def _rewired_qwen2_vl():
    """A tiny Qwen2-VL (a vision tower the text prompts never reach), rewired."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(TINY, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, spatial_merge_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                           vision_start_token_id=252, **TOKENS)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    rewire(model)
    return model


def test_the_form_spelt_with_batch_and_query_sizes_takes_it_bit_for_bit():
    """Qwen2-VL's text attention unpacks ``bsz, q_len, _ = hidden_states.size()``, splits the whole
    projections with those sizes and passes ``position_ids`` on by name (its multimodal rotary
    tables come from the model): both paths give the same tokens and logits; a two-dimensional
    input, which the forward's unpacking refuses, is left to the forward."""
    direct, counts, _, _ = _both_paths_agree(_rewired_qwen2_vl)
    attention = _paged(direct)[0]
    assert recognise(type(attention)._hw_agnostic_base).sized
    cos = sin = torch.ones(5, attention.head_dim)
    with pytest.raises(ValueError, match="not enough values to unpack"), torch.no_grad():
        attention(torch.randn(5, direct.config.text_config.hidden_size), attention_mask=None,
                  position_embeddings=(cos, sin), past_key_values=DynamicCache(config=direct.config))
    assert counts["declined"] == 1


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_gated_attention_takes_it_bit_for_bit(family):
    """Qwen3-Next's and Qwen3.5's attention chunk an output gate out of the q projection and multiply
    the merged heads by its sigmoid: both paths give the same tokens and logits."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, head_dim=16,
                                                                 layer_types=["full_attention"] * 2))
    assert recognise(type(_paged(direct)[0])._hw_agnostic_base).gated


def test_queries_scaled_by_their_positions_take_it_bit_for_bit():
    """Ministral-3 scales the rotated queries by a factor of ``position_ids`` (Llama-4's attention
    scaling, here past 4 positions) and passes ``position_ids`` on: both paths agree; a call without
    ``position_ids``, a parameter without a default, is left to the forward (which refuses it)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
            "original_max_position_embeddings": 4}
    direct, counts, _, logits = _both_paths_agree(lambda: _rewired_from_config("ministral3", rope_parameters=rope))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.query_scale is not None and "position_ids" in recognised.required
    unscaled = _rewired_from_config("ministral3", rope_parameters={**rope, "original_max_position_embeddings": 64})
    assert not torch.equal(_generate(unscaled, prompt(batch=1, length=14))[1], logits)  # the scale matters
    cos = sin = torch.ones(1, 3, attention.head_dim)
    with pytest.raises(TypeError, match="position_ids"), torch.no_grad():
        attention(torch.randn(1, 3, direct.config.hidden_size), attention_mask=None, position_embeddings=(cos, sin),
                  past_key_values=DynamicCache(config=direct.config))
    assert counts["declined"] == 1


@pytest.mark.parametrize("family", ["lfm2", "lfm2_moe"])
def test_children_and_output_named_otherwise_take_it_bit_for_bit(family):
    """LFM2 names its head norms ``q_layernorm`` / ``k_layernorm`` and its output projection
    ``out_proj``, spells the views ``view(*hidden_shape)`` and returns the projection as ``output``:
    the same calls, made on those children; both paths agree, and ``out_proj``'s hook fires."""
    extra = dict(num_experts=4, num_experts_per_tok=2, num_dense_layers=0) if family == "lfm2_moe" else {}
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config(family, layer_types=["full_attention"] * 2, **extra))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.norm_names == ("q_layernorm", "k_layernorm") and recognised.out_names == ("out_proj",)
    fired = []
    attention.out_proj.register_forward_hook(lambda *_: fired.append(1))
    with torch.no_grad():
        direct(prompt(batch=1, length=3))
    assert fired == [1]


def test_merged_heads_normed_before_the_output_projection_take_it_bit_for_bit():
    """BitNet norms the merged heads with ``self.attn_sub_norm`` before ``o_proj``: the direct path
    calls that module (its hooks too) on the same tensor."""
    direct, *_ = _both_paths_agree(lambda: _rewired_from_config("bitnet"))
    attention = _paged(direct)[0]
    assert recognise(type(attention)._hw_agnostic_base).sub_norm
    seen = []
    attention.attn_sub_norm.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        direct(prompt(batch=1, length=3))
    assert seen == [(1, 3, direct.config.num_attention_heads * attention.head_dim)]


@pytest.mark.parametrize("qk_layernorm", [False, True])
@pytest.mark.parametrize("partial_rotary_factor", [0.5, 1.0])
def test_a_partial_rotary_embedding_takes_it_bit_for_bit(qk_layernorm, partial_rotary_factor):
    """Phi rotates the first ``rotary_ndims`` dims of each head (slices, rotates, concatenates), norms
    the transposed heads where ``self.qk_layernorm`` says, and projects with ``dense``: both paths
    agree, the step's write rotates the queries and keys after the first call, and the flag is read
    on every call."""
    direct, counts, _, _ = _both_paths_agree(lambda: _rewired_from_config(
        "phi", qk_layernorm=qk_layernorm, partial_rotary_factor=partial_rotary_factor))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.partial_rotary and recognised.qk_norms == "optional transposed"
    assert recognised.out_names == ("dense",)
    assert _rotates_in_the_write(direct) and counts["declined"] == 0
    if qk_layernorm:
        _norm_called_only_while_flagged(direct, counts, "q_layernorm", "qk_layernorm")


def _llama_spelt(tmp_path, source):
    """A tiny Llama whose attention forward is ``source`` (run in Llama's modeling namespace), rewired."""
    path = tmp_path / "spelt.py"  # inspect.getsource reads the forward's file
    path.write_text(source)
    namespace = dict(vars(modeling_llama))
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - test source
    spelt = type("SpeltAttention", (modeling_llama.LlamaAttention,), {"forward": namespace["forward"]})
    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = spelt
    rewire(model)
    return model


def test_heads_transposed_in_statements_of_their_own_take_it_bit_for_bit(tmp_path):
    """GLM-4V-MoE's and GLM-Image's text attention view each part's heads, then transpose them in
    statements of their own: the same views as the template's, so the same direct path (here
    Llama's forward so spelt)."""
    parts = "".join(f"        {name}_states = self.{name[0]}_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
                    for name in ("query", "key", "value"))
    apart = "".join(f"        {name}_states = self.{name[0]}_proj(hidden_states).view(hidden_shape)\n"
                    for name in ("query", "key", "value")) + "".join(
        f"        {name}_states = {name}_states.transpose(1, 2)\n" for name in ("query", "key", "value"))
    llama = inspect.getsource(modeling_llama.LlamaAttention.forward)
    assert parts in llama
    direct, *_ = _both_paths_agree(lambda: _llama_spelt(tmp_path, textwrap.dedent(llama.replace(parts, apart))))
    assert recognise(type(_paged(direct)[0])._hw_agnostic_base) is not None


@pytest.mark.parametrize("config", [{}, dict(rotary_pct=1.0), dict(use_parallel_residual=False)])
def test_one_projection_holding_each_heads_q_k_and_v_takes_it_bit_for_bit(config):
    """GPT-NeoX projects each head's queries, keys and values side by side with ``query_key_value``,
    chunks them apart, rotates a part of each head (its own ``apply_rotary_pos_emb`` slices by the
    tables' width), takes its cache as ``layer_past`` and projects with ``dense``: both paths agree,
    the step's write rotates after the first call, and ``query_key_value``'s hook fires."""
    direct, counts, _, _ = _both_paths_agree(lambda: _rewired_from_config("gpt_neox", **config))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.interleaved and recognised.out_names == ("dense",)
    fired = []
    attention.query_key_value.register_forward_hook(lambda *_: fired.append(1))
    assert _rotates_in_the_write(direct) and fired == [1] and counts["declined"] == 0


@pytest.mark.parametrize("config", [{}, dict(qk_layernorm=True), dict(use_parallel_residual=True)])
def test_heads_split_by_the_modules_head_counts_take_it_bit_for_bit(config):
    """StableLM splits the whole projections into ``self.num_heads`` / ``self.num_key_value_heads`` heads,
    norms the transposed heads where ``self.qk_layernorm`` says so, rotates the first ``rotary_ndims``
    dims, passes ``position_ids`` on, and takes ``output_attentions`` / ``use_cache`` it never reads (not
    passed on): both paths agree; head counts that are not the merged projection's parts leave the call to
    the forward."""
    direct, counts, _, _ = _both_paths_agree(lambda: _rewired_from_config("stablelm", **config))
    attention = _paged(direct)[0]
    recognised = recognise(type(attention)._hw_agnostic_base)
    assert recognised.counted_heads and recognised.ignored == {"output_attentions", "use_cache"}
    assert _rotates_in_the_write(direct) and counts["declined"] == 0
    attention.num_heads = attention.num_heads // 2  # the forward's own view raises
    with pytest.raises(RuntimeError, match="invalid for input of size"), torch.no_grad():
        direct(prompt(batch=1, length=3))
    assert counts["declined"] == 1


def test_the_sized_form_split_by_head_counts_takes_it_bit_for_bit():
    """Mllama's text self-attention splits the whole projections into ``self.num_heads`` /
    ``self.num_key_value_heads`` heads of the unpacked batch and query sizes: both paths agree."""
    from tests.zoo.families import build as build_family

    def rewired():
        model = build_family("mllama")
        rewire(model)
        return model

    direct, *_ = _both_paths_agree(rewired)
    recognised = recognise(type(_paged(direct)[0])._hw_agnostic_base)
    assert recognised.counted_heads and recognised.sized and not recognised.partial_rotary


@pytest.mark.parametrize("position_embeddings", [True, False])
def test_tables_set_to_none_before_the_rotary_test_take_it_bit_for_bit(position_embeddings):
    """OLMo-Hybrid sets ``cos, sin = None, None`` and rotates only where the call brings tables (its NoPE
    layers bring none): both paths agree, with and without tables."""
    from tests.zoo.families import build as build_family

    def rewired():
        model = build_family("olmo_hybrid")
        rewire(model)
        if not position_embeddings:  # a NoPE model: its layers get no tables
            for attention in _paged(model):
                attention.register_forward_pre_hook(
                    lambda module, args, kwargs: (args, {**kwargs, "position_embeddings": None}), with_kwargs=True)
        return model

    direct, *_ = _both_paths_agree(rewired)
    recognised = recognise(type(_paged(direct)[0])._hw_agnostic_base)
    assert recognised.rotary_optional and recognised.qk_norms == "whole"


@pytest.mark.parametrize("use_attention_gate", [False, True])
def test_each_heads_output_gated_where_the_gate_is_set_takes_it_bit_for_bit(use_attention_gate):
    """LFM3 norms each part's heads, passes its sliding window, and where ``self.g_proj`` is set scales
    each head's output by ``sigmoid(g_proj(hidden_states))`` before the merge: both paths agree, with and
    without the gate, and the gate's hook fires. q/k/v are merged although the gate reads their input too
    (the gate stays a projection of its own)."""
    from tests.zoo.families import build as build_family

    def rewired():
        model = build_family("lfm3", use_attention_gate=use_attention_gate)
        rewire(model)
        return model

    direct, counts, _, _ = _both_paths_agree(rewired)
    attention = _paged(direct)[0]
    assert recognise(type(attention)._hw_agnostic_base).head_gate
    assert (attention.g_proj is not None) == use_attention_gate and isinstance(attention.qkv_proj, QKVProjection)
    assert not use_attention_gate or isinstance(attention.g_proj, torch.nn.Linear)
    if use_attention_gate:
        fired = []
        attention.g_proj.register_forward_hook(lambda *_: fired.append(1))
        with torch.no_grad():
            direct(prompt(batch=1, length=3))
        assert fired == [1] and counts["declined"] == 0
