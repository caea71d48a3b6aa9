"""The forms of the common Hugging Face attention forward the direct path recognises (see
:mod:`.attention_direct`), by their syntax tree, statement by statement.

About forty families (Llama, Gemma, Granite, GLM-4, Helium, Ernie-4.5, Qwen2-MoE, ...,
and with the sliding window, softcap or attention sinks they pass their attention function,
Mistral, Mixtral, Qwen2, Gemma-2, GPT-OSS) share one attention forward, statement for statement:

    split q / k / v into heads; apply_rotary_pos_emb(q, k, cos, sin);
    cache.update(k, v, self.layer_idx, ...); attention_interface(self, q, k, v, attention_mask,
    scaling=self.scaling, [dropout=..., sliding_window=..., softcap=..., s_aux=...], **kwargs);
    merge the heads; o_proj.

Qwen3 and its kin (Qwen3-MoE, Qwen3-VL, dots1, Mellum: 9 more classes) run the same forward with
per-head norms of the queries and keys before the rotary embedding, ``self.q_norm(...)`` /
``self.k_norm(...)`` of each part's ``[B, T, H, D]`` heads; Gemma-3, Apertus, HY-V3 and T5Gemma-2's
self-attention (5 more) norm the transposed heads in statements of their own; Cohere and GLM-4-MoE
(2 more) each part's heads where ``self.use_qk_norm`` says so, read on every call; OLMo-2, OLMo-3,
FlexOlmo and MiniMax-M2 (4 more) the whole q and k projections before splitting them into heads;
NanoChat and HunYuan (4 more, HunYuan's norms named ``query_layernorm`` / ``key_layernorm``) the
heads after the rotary embedding, which the step's write then stores as they are
(:data:`_QK_NORM_TEMPLATES`). The q / k norms and the output projection may go by other names
(:data:`_CHILD_NAMES`; LFM2's ``q_layernorm`` / ``k_layernorm`` / ``out_proj``), the views be spelt
``view(*hidden_shape)`` and the projected output be returned under another name used nowhere else.
BitNet norms the merged heads with ``self.attn_sub_norm`` before ``o_proj`` (:data:`_SUB_NORMED_TEMPLATE`). The direct path calls those two modules (their hooks too) on the
same tensors. Phi-3 and Phi-4-multimodal project q, k and v in one ``qkv_proj`` and slice it by
the config's head counts (:data:`_FUSED_TEMPLATE`); the direct path calls that module as a module
(its hooks run) and takes the same views of its output. Starcoder2 and Seed-OSS run the template
with one more statement, ``attn_output = nn.functional.dropout(attn_output, p=..., training=self.training)``
after the heads are merged, which leaves them as they are outside training, where the direct path
never runs; it is left out of the comparison (:func:`_is_output_dropout`) where ``nn`` is torch's.
OLMo and OLMoE (after its whole-projection norms) clamp the projections in place where
``config.clip_qkv`` says so, before splitting them into heads (:data:`_CLIPPED_TEMPLATES`); the direct
path clamps the same tensors. Exaone-4, Cohere-2 and SmolLM3 apply the rotary embedding under a test
of the module's own attributes (Exaone-4, which also norms the transposed heads: not on the global
layers of a model with sliding ones; Cohere-2: on the sliding layers alone; SmolLM3: the layers that
``use_rope``); any form above is recognised so (:data:`_CONDITIONAL_ROTARY`), and the direct path
evaluates the forward's own test on every call, where the forward does. Granite-4.0's hybrid and
Granite-SWA rotate ``if position_embeddings is not None`` (NoPE models pass none): the direct path
rotates where the call brings tables and writes the heads as they are where it brings None. The
parameters may come in any order (Granite-4.0, Mimi), with no default but None: the direct path
reads its arguments by name; a sixth, ``position_ids``, is allowed where the attention call passes it
on by name (as ``**kwargs`` would). Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni and GLM-4V's text towers spell
the template with the input's batch and query sizes (:data:`_SIZED_TEMPLATE`): the same views of a
three-dimensional input; any other input is left to the forward, whose unpacking refuses it.
Qwen3-Next and Qwen3.5 gate the merged heads by ``torch.sigmoid`` of a gate chunked out of each
head's q projection (:data:`_GATED_TEMPLATE`); the direct path makes the same chunk, norms and product.
Ministral-3 scales the rotated queries by a factor of the positions (:data:`_SCALED_QUERY_TEMPLATE`),
evaluated as the forward's own expression, before the write (which then cannot rotate them). A call
that leaves out a parameter without a default is the forward's, which refuses it.

:func:`recognise` compares a class forward with every form, once the cache parameter's name is
unified, annotations dropped, the attention call's ``dropout``, ``sliding_window``, ``softcap``
and ``s_aux`` keywords set aside and the expressions a form leaves open (a rotary test, a query
factor) set aside as placeholders; what it sets aside is evaluated apart, as functions of
``self`` (and the few locals a form names) in the forward's own globals.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from ..layers.attention import _CACHE_NAMES

#: the names a recognised forward takes its cache by (GPT-NeoX's ``layer_past`` too)
_FORWARD_CACHE_NAMES = (*_CACHE_NAMES, "layer_past")
#: a call's arguments every recognised forward takes by name (the rest reach the attention function as ``**kwargs``)
_TAKEN_BY_NAME = frozenset({"hidden_states", "position_embeddings", "attention_mask", *_CACHE_NAMES})

#: the attention call's keywords the direct path evaluates; ``dropout`` is set aside (no call in
#: training takes the direct path), any other keyword leaves the forward unrecognised
_FORWARDED = ("sliding_window", "softcap", "s_aux")

_TEMPLATE = '''
def forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask,
                                                    scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
'''


_PARTS = """\
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
"""
#: the three part projections whole, before their heads are split off (:data:`_VIEWS`) ...
_WHOLE = """\
    query_states = self.q_proj(hidden_states)
    key_states = self.k_proj(hidden_states)
    value_states = self.v_proj(hidden_states)
"""
#: ... or with the whole q / k projections normed
_WHOLE_NORMED = """\
    query_states = self.q_norm(self.q_proj(hidden_states))
    key_states = self.k_norm(self.k_proj(hidden_states))
    value_states = self.v_proj(hidden_states)
"""
#: each part's heads, transposed in statements of their own: the same views as :data:`_PARTS` (GLM-4V-MoE's
#: and GLM-Image's text towers)
_TRANSPOSED_APART = """\
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)
"""
#: the heads split off the whole projections, as statements of their own
_VIEWS = """\
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
"""

#: the transposed heads normed where ``self.qk_layernorm`` says so (Phi, StableLM)
_FLAGGED_NORMS = """\
    if self.qk_layernorm:
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
"""

#: The template with per-head norms of the queries and keys before the rotary embedding, by where
#: they are applied: ``"heads"``, to each part's ``[B, T, H, D]`` heads before the transpose (Qwen3 and
#: its derivatives, dots1, Mellum); ``"transposed"``, to the transposed ``[B, H, T, D]`` heads, as
#: statements of their own (Gemma-3, Apertus, HY-V3); ``"optional heads"``, as ``"heads"`` where
#: ``self.use_qk_norm`` is true, in statements of their own (Cohere, GLM-4-MoE); ``"optional
#: transposed"``, as ``"transposed"`` where ``self.qk_layernorm`` is true (Phi); ``"whole"``, to the
#: whole q and k projections before their heads are split off (OLMo-2); and after the rotary
#: embedding, ``"after rotary"``, to the rotated heads (NanoChat; HunYuan, whose norms are
#: ``query_layernorm`` / ``key_layernorm``: :data:`_CHILD_NAMES`).
_QK_NORM_TEMPLATES = {
    "heads": _TEMPLATE.replace(
        "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)").replace(
        "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"),
    "transposed": _TEMPLATE.replace(
        "    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n",
        "    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)\n"
        "    query_states = self.q_norm(query_states)\n"
        "    key_states = self.k_norm(key_states)\n"),
    "optional heads": _TEMPLATE.replace(_PARTS, """\
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape)
    if self.use_qk_norm:
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)
"""),
    "optional transposed": _TEMPLATE.replace(_PARTS, _PARTS + _FLAGGED_NORMS),
    "whole": _TEMPLATE.replace(_PARTS, _WHOLE_NORMED + _VIEWS),
    "after rotary": _TEMPLATE.replace(
        "    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n",
        "    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
        "    query_states = self.q_norm(query_states)\n"
        "    key_states = self.k_norm(key_states)\n"),
}
#: the names a forward may call its q / k norms and output projection by, as the templates call them
_CHILD_NAMES = {"query_layernorm": "q_norm", "key_layernorm": "k_norm", "q_layernorm": "q_norm",
                "k_layernorm": "k_norm", "out_proj": "o_proj", "dense": "o_proj"}
_RENAMED_CHILDREN = frozenset({*_CHILD_NAMES, *_CHILD_NAMES.values()})

#: the in-place clamps of OLMo's and OLMoE's projections, where the config says so
_CLIP = """\
    if self.config.clip_qkv is not None:
        query_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        key_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        value_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
"""

#: The template, and its form with norms of the whole q / k projections, with the projections clamped
#: in place (``config.clip_qkv``) before their heads are split off: OLMo, OLMoE (which spells the views
#: ``view(*hidden_shape)``), by their q/k norm form.
_CLIPPED_TEMPLATES = {
    None: _TEMPLATE.replace(_PARTS, _WHOLE + _CLIP + _VIEWS),
    "whole": _TEMPLATE.replace(_PARTS, _WHOLE_NORMED + _CLIP + _VIEWS),
}

_ROTARY = "    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
_UNPACK = "    cos, sin = position_embeddings\n"
#: The rotary embedding of the first ``self.rotary_ndims`` dims of each head, the rest passed on (Phi):
#: each head sliced in two, the first parts rotated, the two concatenated again.
_PARTIAL_ROTARY = """\
    query_rot, query_pass = (query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :])
    key_rot, key_pass = (key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :])
    query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
    query_states = torch.cat((query_rot, query_pass), dim=-1)
    key_states = torch.cat((key_rot, key_pass), dim=-1)
"""
#: what stands for the test of an ``if`` around the rotary embedding (see :class:`_Unify`)
_CONDITION = "__rotary_condition__"
#: A form's rotary embedding applied only where a test of the module's own attributes holds, read on
#: every call, with the rotary tables unpacked before the test (Exaone-4: not on the global layers of a
#: model with sliding ones; Cohere-2: on the sliding layers alone) or inside it (SmolLM3: the layers
#: that ``use_rope``; OLMo-Hybrid, with the tables set to None before). Each form of :data:`_FORMS` is
#: recognised with any of these.
_CONDITIONAL_ROTARY = (
    (_UNPACK + _ROTARY, _UNPACK + f"    if {_CONDITION}:\n    " + _ROTARY),
    (_UNPACK + _ROTARY, f"    if {_CONDITION}:\n    " + _UNPACK + "    " + _ROTARY),
    # the tables first set to None, read by nothing after the test (OLMo-Hybrid's NoPE layers)
    (_UNPACK + _ROTARY, "    cos, sin = None, None\n" + f"    if {_CONDITION}:\n    " + _UNPACK + "    " + _ROTARY),
)

#: The template spelt with the batch and query sizes (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni, GLM-4V's text
#: towers): ``bsz, q_len, _ = hidden_states.size()``, the whole projections, then their heads split off
#: as ``view(bsz, q_len, -1, self.head_dim)``, merged back as ``reshape(bsz, q_len, -1)``: the same views
#: of a three-dimensional input, which the unpacking requires.
_SIZED_TEMPLATE = _TEMPLATE.replace(
    "    input_shape = hidden_states.shape[:-1]\n    hidden_shape = (*input_shape, -1, self.head_dim)\n",
    "    bsz, q_len, _ = hidden_states.size()\n").replace(
    _PARTS, _WHOLE + _VIEWS.replace("view(hidden_shape)", "view(bsz, q_len, -1, self.head_dim)")).replace(
    "attn_output.reshape(*input_shape, -1)", "attn_output.reshape(bsz, q_len, -1)")

#: Qwen3-Next's and Qwen3.5's gated attention: the q projection holds each head's queries and output
#: gate side by side (``head_dim * 2``), chunked apart; the queries and keys per-head normed, as in the
#: ``"heads"`` form; the merged heads multiplied by ``torch.sigmoid(gate)`` before ``o_proj``.
_GATED_TEMPLATE = _TEMPLATE.replace(_PARTS, """\
    query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
""").replace(
    "    attn_output = attn_output.reshape(*input_shape, -1).contiguous()\n",
    "    attn_output = attn_output.reshape(*input_shape, -1).contiguous()\n"
    "    attn_output = attn_output * torch.sigmoid(gate)\n")

#: what stands for the factor of a statement scaling the rotated queries (see :class:`_Unify`)
_QUERY_SCALE = "__query_scale__"
#: Ministral-3's form: the rotated queries scaled by a factor of the positions (Llama-4's attention
#: scaling), ``query_states = query_states * <factor>``, the factor an expression of ``self``,
#: ``position_ids``, ``query_states`` and the module's globals.
_SCALED_QUERY_TEMPLATE = _TEMPLATE.replace(_ROTARY, _ROTARY + f"    query_states = query_states * {_QUERY_SCALE}\n")

_MERGED = "    attn_output = attn_output.reshape(*input_shape, -1).contiguous()\n"
#: LFM3's form: Qwen3's per-head q/k norms, and where ``self.g_proj`` is set, each head's output scaled by
#: a gate of the input, ``torch.sigmoid(self.g_proj(hidden_states))`` (one value a head), before the merge.
_HEAD_GATED_TEMPLATE = _QK_NORM_TEMPLATES["heads"].replace(_MERGED, """\
    if self.g_proj is not None:
        attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states)).unsqueeze(-1)
""" + _MERGED)
#: BitNet's form: the merged heads normed by ``self.attn_sub_norm`` before ``o_proj``.
_SUB_NORMED_TEMPLATE = _TEMPLATE.replace(_MERGED, _MERGED + "    attn_output = self.attn_sub_norm(attn_output)\n")


def _counted_heads(source: str) -> str:
    """``source`` (:data:`_SIZED_TEMPLATE`'s views) with each projection split into the module's own head
    counts (``self.num_heads``, ``self.num_key_value_heads``) instead of ``-1`` heads."""
    for name, count in (("query", "num_heads"), ("key", "num_key_value_heads"), ("value", "num_key_value_heads")):
        source = source.replace(f"{name}_states.view(bsz, q_len, -1, self.head_dim)",
                                f"{name}_states.view(bsz, q_len, self.{count}, self.head_dim)")
    return source


#: The sized template splitting the projections by the module's head counts: Mllama's text self-attention.
_COUNTED_HEADS_TEMPLATE = _counted_heads(_SIZED_TEMPLATE)

#: StableLM's form: the counted heads, the transposed heads normed where ``self.qk_layernorm`` says so,
#: the first ``rotary_ndims`` dims rotated (:data:`_PARTIAL_ROTARY`), ``position_ids`` passed on by name,
#: the merged heads reshaped without a copy.
_STABLELM_TEMPLATE = _COUNTED_HEADS_TEMPLATE.replace(
    "def forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):",
    "def forward(self, hidden_states, position_embeddings, attention_mask, cache, position_ids, **kwargs):").replace(
    _UNPACK, _FLAGGED_NORMS + _UNPACK).replace(_ROTARY, _PARTIAL_ROTARY).replace(
    "scaling=self.scaling, **kwargs)", "scaling=self.scaling, position_ids=position_ids, **kwargs)").replace(
    "attn_output.reshape(bsz, q_len, -1).contiguous()", "attn_output.reshape(bsz, q_len, -1)")

#: GPT-NeoX's form: one projection, ``query_key_value``, holding each head's queries, keys and values
#: side by side (``3 * self.head_size`` a head), chunked apart; the cache parameter ``layer_past``,
#: updated without the call's keywords; the output projection ``dense`` (:data:`_CHILD_NAMES`).
_INTERLEAVED_TEMPLATE = _TEMPLATE.replace(
    "    hidden_shape = (*input_shape, -1, self.head_dim)\n" + _PARTS, """\
    hidden_shape = (*input_shape, -1, 3 * self.head_size)
    qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
    query_states, key_states, value_states = qkv.chunk(3, dim=-1)
""").replace("cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)",
             "cache.update(key_states, value_states, self.layer_idx)")

#: The template with one projection of q, k and v together, ``qkv_proj``, sliced by the config's head
#: counts (Phi-3, Phi-4-multimodal).
_FUSED_TEMPLATE = _TEMPLATE.replace(_PARTS, """\
    qkv = self.qkv_proj(hidden_states)
    query_pos = self.config.num_attention_heads * self.head_dim
    query_states = qkv[..., :query_pos]
    key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
    value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]
""" + _VIEWS)


@dataclasses.dataclass(frozen=True)
class Recognised:
    """A class forward recognised as the template: its code, and its forwarded keywords as functions of ``self``."""

    code: types.CodeType
    forwarded: tuple[tuple[str, Callable[[nn.Module], Any]], ...]
    owner: type  # the class whose forward it is
    qk_norms: Optional[str] = None  # the form of :data:`_QK_NORM_TEMPLATES` the forward has (None: the template)
    fused: bool = False  # the forward is :data:`_FUSED_TEMPLATE`'s: one ``qkv_proj``, sliced
    clipped: bool = False  # the forward is one of :data:`_CLIPPED_TEMPLATES`: projections clamped in place
    # the test of ``self`` the forward applies its rotary embedding under (:data:`_CONDITIONAL_ROTARY`; None: always)
    rotary_condition: Optional[Callable[[nn.Module], Any]] = None
    norm_names: tuple[str, str] = ("q_norm", "k_norm")  # the children the forward calls its q / k norms
    # the forward rotates only where it is given ``position_embeddings`` (``if position_embeddings is not None:``)
    rotary_optional: bool = False
    sized: bool = False  # the forward is :data:`_SIZED_TEMPLATE`'s: it unpacks a three-dimensional input's sizes
    gated: bool = False  # the forward is :data:`_GATED_TEMPLATE`'s: an output gate from the q projection
    # the factor of the rotated queries, of ``(self, position_ids, query_states)`` (:data:`_SCALED_QUERY_TEMPLATE`)
    query_scale: Optional[Callable[[nn.Module, Any, Tensor], Any]] = None
    required: frozenset[str] = frozenset()  # the parameters without a default: a call without one is the forward's
    out_names: tuple[str] = ("o_proj",)  # the child the forward calls its output projection (as one name)
    sub_norm: bool = False  # the forward is :data:`_SUB_NORMED_TEMPLATE`'s: ``attn_sub_norm`` of the merged heads
    partial_rotary: bool = False  # the forward rotates the first ``self.rotary_ndims`` dims (:data:`_PARTIAL_ROTARY`)
    interleaved: bool = False  # the forward is :data:`_INTERLEAVED_TEMPLATE`'s: each head's q, k, v side by side
    # the forward splits heads by the module's head counts (:func:`_counted_heads`), not by ``-1``
    counted_heads: bool = False
    ignored: frozenset[str] = frozenset()  # parameters the forward's body never reads (not passed on either)
    head_gate: bool = False  # the forward is :data:`_HEAD_GATED_TEMPLATE`'s: each head's output gated where g_proj is set
    # a call's arguments the forward takes by name (its cache's too, and the ignored ones): not passed on
    not_passed_on: frozenset[str] = _TAKEN_BY_NAME

    def __reduce__(self) -> tuple[Any, ...]:
        """Recognised again where it is unpickled (code and the forwarded functions do not pickle)."""
        return recognise, (self.owner,)


class _Unify(ast.NodeTransformer):
    """The cache parameter named ``cache``, annotated assignments plain, the attention call's
    optional keywords taken out (into :attr:`forwarded`)."""

    def __init__(self, cache_name: str) -> None:
        self.cache_name = cache_name
        self.forwarded: dict[str, ast.expr] = {}
        self.rotary_condition: Optional[ast.expr] = None
        self.child_names: dict[str, set[str]] = {}  # each template child name: the names the forward calls it by
        self.passes_position_ids = False
        self.query_scale: Optional[ast.expr] = None
        self.ignored: frozenset[str] = frozenset()  # the forward's parameters its body never reads

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        """``self.<child>`` for the q / k norms and the output projection, by the templates' names
        (:data:`_CHILD_NAMES`), the forward's own names kept in :attr:`child_names`."""
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in _RENAMED_CHILDREN:
            unified = _CHILD_NAMES.get(node.attr, node.attr)
            self.child_names.setdefault(unified, set()).add(node.attr)
            return ast.Attribute(value=node.value, attr=unified, ctx=node.ctx)
        return node

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="cache", ctx=node.ctx) if node.id == self.cache_name else node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is None or not node.simple:
            return node
        return self.visit_Assign(ast.Assign(targets=[node.target], value=node.value))

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        """``query_states = query_states * <factor>``: the factor set aside as :data:`_QUERY_SCALE`."""
        self.generic_visit(node)
        value = node.value
        if (len(node.targets) == 1 and ast.dump(node.targets[0]) == ast.dump(ast.Name(id="query_states", ctx=ast.Store()))
                and isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)
                and ast.dump(value.left) == _expression("query_states")):
            self.query_scale = value.right
            node.value = ast.BinOp(left=value.left, op=value.op, right=ast.Name(id=_QUERY_SCALE, ctx=ast.Load()))
        return node

    def visit_If(self, node: ast.If) -> ast.AST:
        """An ``if`` whose body applies the rotary embedding (and maybe unpacks its tables first), with
        no ``else``: its test set aside as :data:`_CONDITION` (:func:`recognise` evaluates it apart)."""
        self.generic_visit(node)
        body = [ast.dump(statement) for statement in node.body]
        if not node.orelse and body and body[-1] == _statement(_ROTARY) and body[:-1] in ([], [_statement(_UNPACK)]):
            self.rotary_condition = node.test
            node.test = ast.Name(id=_CONDITION, ctx=ast.Load())
        return node

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if (isinstance(node.func, ast.Attribute) and node.func.attr == "view" and len(node.args) == 1
                and isinstance(node.args[0], ast.Starred) and ast.dump(node.args[0].value) == _expression("hidden_shape")):
            node.args = [node.args[0].value]  # ``view(*hidden_shape)``: the same view as ``view(hidden_shape)``
        if isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
            kept = []
            for keyword in node.keywords:
                if keyword.arg == "dropout":
                    continue
                if keyword.arg in _FORWARDED:
                    self.forwarded[keyword.arg] = keyword.value
                    continue
                if keyword.arg == "position_ids" and ast.dump(keyword.value) == _expression("position_ids"):
                    self.passes_position_ids = True  # its parameter, passed on as **kwargs would pass it
                    continue
                kept.append(keyword)
            node.keywords = kept
        return node


def _expression(source: str) -> str:
    return ast.dump(ast.parse(source, mode="eval").body)


@functools.lru_cache(maxsize=None)
def _statement(source: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(source)).body[0])


def _is_output_dropout(statement: ast.stmt) -> bool:
    """Whether ``statement`` is ``attn_output = nn.functional.dropout(attn_output, p=..., training=self.training)``
    (Starcoder2, Seed-OSS): the merged heads as they are outside training, where the direct path never runs."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id == "attn_output"):
        return False
    call = statement.value
    keywords = {keyword.arg: keyword.value for keyword in getattr(call, "keywords", ())}
    return (isinstance(call, ast.Call) and ast.dump(call.func) == _expression("nn.functional.dropout")
            and len(call.args) == 1 and ast.dump(call.args[0]) == _expression("attn_output")
            and set(keywords) == {"p", "training"} and ast.dump(keywords["training"]) == _expression("self.training"))


def _output_named_as_template(function: ast.FunctionDef, statements: list[ast.stmt]) -> list[ast.stmt]:
    """``statements`` with a last ``output = self.<proj>(attn_output)`` / ``return output, attn_weights``
    (LFM2) named as the template's ``attn_output``, where ``output`` is that name's only use."""
    if len(statements) < 2:
        return statements
    project, returned = statements[-2], statements[-1]
    if not (isinstance(project, (ast.Assign, ast.AnnAssign)) and isinstance(returned, ast.Return)):
        return statements
    target = project.targets[0] if isinstance(project, ast.Assign) and len(project.targets) == 1 else getattr(
        project, "target", None)
    value = returned.value
    if not (isinstance(target, ast.Name) and target.id != "attn_output" and isinstance(value, ast.Tuple)
            and len(value.elts) == 2 and ast.dump(value.elts[0]) == ast.dump(ast.Name(id=target.id, ctx=ast.Load()))):
        return statements
    if sum(isinstance(n, ast.Name) and n.id == target.id for n in ast.walk(function)) != 2:
        return statements
    renamed = ast.Assign(targets=[ast.Name(id="attn_output", ctx=ast.Store())], value=project.value)
    back = ast.Return(value=ast.Tuple(elts=[ast.Name(id="attn_output", ctx=ast.Load()), value.elts[1]], ctx=ast.Load()))
    return [*statements[:-2], renamed, back]


def _body(function: ast.FunctionDef) -> Optional[tuple[list[str], "_Unify", bool]]:
    """The unified statements of ``function``, what unifying them set aside (:class:`_Unify`: the
    forwarded keywords, the rotary test, the q / k norms' names, the queries' scale) and whether it
    drops out its merged heads (:func:`_is_output_dropout`, a statement left out of the others);
    None when its parameters are not the template's."""
    args = function.args
    names = [a.arg for a in args.args]
    cache = [name for name in names if name in _FORWARD_CACHE_NAMES]
    # The template's parameters in any order (the direct path reads its arguments by name), a default
    # only None; and maybe ``position_ids``, which the attention call must then pass on by name (as it
    # would reach the attention function in ``**kwargs`` without the parameter).
    # Other parameters the body never reads (StableLM's ``output_attentions`` and ``use_cache``) are
    # ignored, whatever their defaults: named, they do not reach the attention function either.
    template = {"hidden_states", "position_embeddings", "attention_mask", *cache}
    read = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    ignored = set(names[1:]) - template - {"position_ids"}
    defaulted = names[len(names) - len(args.defaults):]
    if (args.vararg or args.kwonlyargs or args.posonlyargs or args.kwarg is None or names[:1] != ["self"]
            or len(cache) != 1 or not template <= set(names) or ignored & read or len(names) != len(set(names))
            or not all(name in ignored or isinstance(default, ast.Constant) and default.value is None
                       for name, default in zip(defaulted, args.defaults))):
        return None
    statements = function.body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]  # the docstring
    kept = [statement for statement in statements if not _is_output_dropout(statement)]
    kept = _output_named_as_template(function, kept)
    unify = _Unify(cache[0])
    unify.ignored = frozenset(ignored)
    dumps = [ast.dump(unify.visit(statement)) for statement in kept]
    if unify.passes_position_ids != ("position_ids" in names):
        return None
    return dumps, unify, len(kept) < len(statements)


class _Form(NamedTuple):
    """What a recognised form's source differs from the template in (see :class:`Recognised`)."""

    qk_norms: Optional[str] = None
    fused: bool = False
    clipped: bool = False
    sized: bool = False
    gated: bool = False
    scaled_query: bool = False
    sub_norm: bool = False
    partial_rotary: bool = False
    interleaved: bool = False
    counted_heads: bool = False
    head_gate: bool = False


#: every recognised form but a conditional rotary embedding's, with its source
_BASE_FORMS = (
    *((source.replace(_ROTARY, _PARTIAL_ROTARY), _Form(qk_norms=form, partial_rotary=True))
      for source, form in ((_TEMPLATE, None), (_QK_NORM_TEMPLATES["optional transposed"], "optional transposed"))),
    (_TEMPLATE, _Form()),
    (_TEMPLATE.replace(_PARTS, _TRANSPOSED_APART), _Form()),
    *((source, _Form(qk_norms=form)) for form, source in _QK_NORM_TEMPLATES.items()),
    (_FUSED_TEMPLATE, _Form(fused=True)),
    (_INTERLEAVED_TEMPLATE, _Form(interleaved=True)),
    (_COUNTED_HEADS_TEMPLATE, _Form(sized=True, counted_heads=True)),
    (_STABLELM_TEMPLATE, _Form(qk_norms="optional transposed", sized=True, partial_rotary=True, counted_heads=True)),
    (_SIZED_TEMPLATE, _Form(sized=True)),
    (_GATED_TEMPLATE, _Form(qk_norms="heads", gated=True)),
    (_SCALED_QUERY_TEMPLATE, _Form(scaled_query=True)),
    (_SUB_NORMED_TEMPLATE, _Form(sub_norm=True)),
    (_HEAD_GATED_TEMPLATE, _Form(qk_norms="heads", head_gate=True)),
    *((source, _Form(qk_norms=form, clipped=True)) for form, source in _CLIPPED_TEMPLATES.items()),
)
#: every recognised form: its source, its :class:`_Form` and whether its rotary
#: embedding is applied under a test (:data:`_CONDITIONAL_ROTARY`)
_FORMS = (
    *((source, form, False) for source, form in _BASE_FORMS),
    *((source.replace(always, conditional), form, True) for source, form in _BASE_FORMS
      for always, conditional in _CONDITIONAL_ROTARY if always in source),
)


@functools.lru_cache(maxsize=None)  # the templates' few sources
def _template(source: str = _TEMPLATE) -> list[str]:
    parsed = _body(ast.parse(source).body[0])  # type: ignore[arg-type]
    assert parsed is not None
    return parsed[0]


@functools.lru_cache(maxsize=None)
def recognise(cls: type) -> Optional[Recognised]:
    """``cls.forward`` as :class:`Recognised` when it is the template's code, else None."""
    inner = inspect.unwrap(cls.forward)
    if not isinstance(inner, types.FunctionType):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef):
        return None
    parsed = _body(function)
    if parsed is None:
        return None
    found = next(((form, conditional) for source, form, conditional in _FORMS if parsed[0] == _template(source)), None)
    if found is None:
        return None
    form, conditional = found
    dumps, unify, dropped = parsed
    if any(len(names) > 1 for names in unify.child_names.values()):
        return None  # two modules it calls by one name of the templates'
    norm_names = tuple(next(iter(unify.child_names.get(name, {name}))) for name in ("q_norm", "k_norm"))
    out_names = (next(iter(unify.child_names.get("o_proj", {"o_proj"}))),)
    if dropped and inner.__globals__.get("nn") is not nn:  # its dropout is not torch's
        return None
    if (form.gated or form.partial_rotary or form.head_gate) and inner.__globals__.get("torch") is not torch:
        return None  # its chunk and sigmoid, or its cat, are not torch's
    local = {a.arg for a in function.args.args} | {function.args.kwarg.arg} | {
        n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    # ``if position_embeddings is not None:`` (Granite-4.0's hybrid): no test of ``self``, the call's own tables
    optional = conditional and ast.dump(unify.rotary_condition) == _expression("position_embeddings is not None")
    conditional = conditional and not optional
    # each expression set aside, evaluated apart from the forward's frame: of these names and the globals only
    expressions = [*((name, value, ("self",)) for name, value in unify.forwarded.items()),
                   *([("rotary condition", unify.rotary_condition, ("self",))] if conditional else []),
                   *([("query scale", unify.query_scale, ("self", "position_ids", "query_states"))]
                     if form.scaled_query else [])]
    evaluated = {}
    for name, expression, parameters in expressions:
        if any(isinstance(n, ast.Name) and n.id in local - set(parameters) for n in ast.walk(expression)):
            return None
        source = ast.Expression(body=ast.Lambda(args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=p) for p in parameters], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=expression))
        ast.fix_missing_locations(source)
        evaluated[name] = eval(compile(source, inspect.getsourcefile(inner) or "<forward>", "eval"),  # noqa: S307
                               inner.__globals__)
    args = function.args
    required = frozenset(a.arg for a in args.args[1:len(args.args) - len(args.defaults)])
    return Recognised(inner.__code__, tuple((name, evaluated[name]) for name in unify.forwarded), cls, form.qk_norms,
                      form.fused, form.clipped, evaluated.get("rotary condition"), norm_names, optional, form.sized,
                      form.gated, evaluated.get("query scale"), required, out_names, form.sub_norm,
                      form.partial_rotary, form.interleaved, form.counted_heads, unify.ignored, form.head_gate,
                      _TAKEN_BY_NAME | {unify.cache_name} | unify.ignored)
