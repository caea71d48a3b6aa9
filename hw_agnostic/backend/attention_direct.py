"""The direct path of paged attention modules whose forward is one of the common Hugging Face
attention forward's recognised forms (:mod:`.attention_forms`).

A paged module (:class:`~hw_agnostic.layers.PagedAttention`) runs that forward with its cache bound
to a paged view and its attention function dispatched by name: three projection-part calls, the
``kernels`` and ``deprecate_kwarg`` wrappers, a binding object and the attention-interface lookup,
host Python on every device before a kernel runs. Making the calls directly saves 20-36 µs per
layer of a decode step (the decode-host bench's model on a 2-core EPYC, both paths in one
process, three runs; about 10% of a layer).

For a module whose class forward is one of those forms (:func:`.attention_forms.recognise`),
:func:`direct_forward` makes the same calls itself: the merged q/k/v projection's forward once
(what its parts call; where that forward is :class:`QKVProjection`'s own and every part is whole
heads, its linear layer, the heads split off with one view, one transpose and one split), the
forward's own ``apply_rotary_pos_emb`` (the rotary router where that change stands; where the router
would run ``rotary_embedding``, the step's write rotates instead, ``rotary_write_kv_cache``: the same
bits in one launch instead of two), the step's write into the paged view and the attention function's work
(:func:`~hw_agnostic.backend.attention.store_step` and
:func:`~hw_agnostic.backend.attention.attend_paged`, which the general path runs too: padding read
from the mask, the mask checked against the kernel's), with the window, softcap and sinks the forward's
keywords evaluate to, then ``o_proj``. The tests run both paths on the recognised families and
compare them bit for bit.

A call takes the direct path only where the forward would run exactly those operations; any
other call returns ``NotImplemented`` and the module's forward runs as before:

* a call that must run the module's own attention (training, gradients, recorded attention
  weights), or a module whose masks the kernel has found it cannot serve;
* no cache, or a cache that is not a plain transformers ``Cache`` with a paged view for the
  module's layer (continuous batching, encoder-decoder caches, offloading);
* ``sliding_window`` / ``softcap`` / ``s_aux`` among the call's keywords (the forward passes them on);
* q/k/v that are not the parts of the module's merged projection (verification undid the merge;
  a fused form: no ``qkv_proj`` module),
  forward hooks on those parts or global module hooks (the parts' calls are not made), a config
  that no longer names the paged attention function, a forward other than the recognised one's
  code (a change or a patch replaced it), or a rotary function a ``kernels.kernelize`` call mapped.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..layers.attention import _STATE
from ..layers.module_call import call_in, no_global_hooks, own_attributes, plain_calls
from ..layers.qkv import QKVPart, QKVProjection
from .attention import (
    ATTENTION_NAME, _cache_classes, attend_paged, paged_attention_forward, paged_layer_of, store_step,
)
from .attention_forms import Recognised, recognise

#: keywords of a call that the forward would pass on to the attention function, which reads them
_PASSED_ON = ("sliding_window", "softcap", "s_aux")




def _qk_norms(children: dict[str, Optional[nn.Module]], names: tuple[str, str]) -> Optional[tuple[nn.Module, nn.Module]]:
    """The modules the forward calls as ``self.<names>`` (None: one is not a child module)."""
    q_norm, k_norm = children.get(names[0]), children.get(names[1])
    return (q_norm, k_norm) if isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module) else None


def _merged_projection(children: dict[str, Optional[nn.Module]]) -> Optional[QKVProjection]:
    """The merged projection whose parts q/k/v are, hook-free (None: they are not)."""
    qkv = children.get("qkv_proj")
    if not isinstance(qkv, QKVProjection) or len(qkv.sizes) != 3:
        return None
    for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
        part = children.get(name)
        if (type(part) is not QKVPart or part._projection is not qkv or part.index != index
                or part._forward_hooks or part._forward_pre_hooks):
            return None
    return qkv


def _counts_heads(module: nn.Module, qkv: Optional[nn.Module]) -> bool:
    """Whether the module's head counts (``num_heads``, ``num_key_value_heads``) of ``head_dim`` each are
    its merged projection's part widths: the forward's views by those counts are then the direct path's."""
    head_dim, heads, kv_heads = (getattr(module, name, None) for name in ("head_dim", "num_heads", "num_key_value_heads"))
    return (isinstance(qkv, QKVProjection) and all(type(n) is int for n in (head_dim, heads, kv_heads))
            and tuple(qkv.sizes) == (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))


@functools.lru_cache(maxsize=64)
def _head_counts(projection: type, sizes: tuple[int, ...], head_dim: int) -> Optional[tuple[int, ...]]:
    """The heads of q, k and v in a merged projection of ``sizes`` whose forward is
    :class:`QKVProjection`'s own, where each part splits into whole heads (None: they do not).

    Then the forward's ``part.view(*input_shape, -1, head_dim).transpose(1, 2)`` of each part is
    the same view (storage offset, sizes, strides) as the matching split of the merged output's
    ``[B, T, heads, head_dim]`` view, transposed: one view, one transpose and one split where the
    parts took a split, three views and three transposes (about 1.3 µs each under ``no_grad``)."""
    if projection.forward is not QKVProjection.forward or any(size % head_dim for size in sizes):
        return None
    return tuple(size // head_dim for size in sizes)


@functools.lru_cache(maxsize=64)
def _namespace(forward: Callable[..., Any], code: types.CodeType) -> Optional[dict[str, Any]]:
    """The globals ``forward`` (a paged module's, maybe its rotary-routed copy) resolves names in,
    when it runs the recognised ``code``."""
    # The first function down the chain of wrappers that runs that code: a rotary-routed copy
    # names its original as ``__wrapped__`` (functools.update_wrapper), so unwrapping to the end
    # would reach the modeling module's globals, not the copy's.
    inner: Any = forward
    while getattr(inner, "__code__", None) is not code:
        inner = getattr(inner, "__wrapped__", None)
        if inner is None:
            return None
    return inner.__globals__


def _mapped_kernel(module: nn.Module) -> bool:
    """Whether ``kernels.kernelize`` mapped a hub kernel onto one of the module's functions (the
    ``kernels`` wrapper of its forward would route the rotary function to it)."""
    funcs = module.__dict__.get("_kernel_funcs")
    return bool(funcs) and any("forward" in vars(func) for func in funcs.values())


def _names_paged_attention(config: Any, namespace: dict[str, Any]) -> bool:
    """Whether the forward, run with ``config`` in its module's ``namespace``, would dispatch its
    attention function to ``paged_attention_forward``."""
    functions = namespace.get("ALL_ATTENTION_FUNCTIONS")
    return (_attn_implementation(config) == ATTENTION_NAME and functions is not None
            and functions.get(ATTENTION_NAME) is paged_attention_forward)


def _attn_implementation(config: Any) -> Any:
    """``config._attn_implementation``, read from the instance's attributes where transformers keeps it:
    the property, and reading ``config.__dict__`` itself, go through two ``__getattribute__`` overrides
    (1 µs alone, about 4 of a decode layer); ``object.__getattribute__`` reads the same dict without them
    (Dynamo, which cannot trace that call, reads ``config.__dict__``)."""
    attributes = config.__dict__ if torch.compiler.is_compiling() else object.__getattribute__(config, "__dict__")
    implementation = attributes.get("_attn_implementation_internal", _UNSET)
    return config._attn_implementation if implementation is _UNSET else implementation


def _rotates_in_the_write(rotate: Any, query: Tensor, key: Tensor, value: Tensor, cos: Any, sin: Any,
                          paged: Any) -> bool:
    """Whether the step's write can rotate the query and keys too (``rotary_write_kv_cache``, one
    launch for two): ``rotate`` is a rotary router that would run ``rotary_embedding`` on them
    (:mod:`.rotary`), and the keys, values, tables and pages share one dtype (the write stores
    the rotated keys as they come)."""
    routes = getattr(rotate, "routes", None)
    dtype = query.dtype
    return (routes is not None and key.dtype is dtype and value.dtype is dtype and getattr(cos, "dtype", None) is dtype
            and getattr(sin, "dtype", None) is dtype and (paged.store is None or paged.store.dtype is dtype) and routes(query, key, cos, sin))


def _head_views(merged: Tensor, hidden_shape: tuple[int, ...], heads: tuple[int, ...], plain: bool) -> list[Tensor]:
    """``merged.view(hidden_shape).transpose(1, 2).split_with_sizes(heads, dim=1)``: the query, key and
    value heads of a merged projection's output ``[B, T, W]`` (``hidden_shape``: ``(B, T, -1, head_dim)``,
    every part whole heads). Outside a trace, for a contiguous output, the transposed view is one
    ``as_strided`` of the same sizes, strides and offset (under ``no_grad`` each view op also records
    its view: 3 µs a decode layer less in place); a traced call, and a tensor subclass (whose
    ``as_strided`` is its own), keep the forward's own ops."""
    if plain and type(merged) is Tensor and merged.is_contiguous():
        batch, tokens, width = merged.shape
        head_dim = hidden_shape[-1]
        transposed = merged.as_strided((batch, width // head_dim, tokens, head_dim), (tokens * width, head_dim, width, 1))
    else:
        transposed = merged.view(hidden_shape).transpose(1, 2)
    return transposed.split_with_sizes(heads, dim=1)


def _sliced_heads(module: nn.Module, qkv: Tensor, hidden_shape: tuple[int, ...], plain: bool) -> list[Tensor]:
    """The query, key and value heads :data:`.attention_forms._FUSED_TEMPLATE`'s forward slices out of ``qkv`` ``[B, T, W]``.

    Where every slice is whole heads of a contiguous ``qkv`` of three dims, the three views of the
    forward's nine (slice, view, transpose each) come from one view, one transpose and one split:
    the same offsets, sizes and strides (see :func:`_head_counts`)."""
    head_dim = module.head_dim
    query_pos = module.config.num_attention_heads * head_dim
    key_end = query_pos + module.num_key_value_heads * head_dim
    width = qkv.shape[-1]
    if (qkv.dim() == 3 and qkv.is_contiguous() and type(head_dim) is int and head_dim > 0
            and 0 <= query_pos <= key_end <= width and not (query_pos % head_dim or key_end % head_dim or width % head_dim)):
        heads = (query_pos // head_dim, (key_end - query_pos) // head_dim, (width - key_end) // head_dim)
        return list(_head_views(qkv, hidden_shape, heads, plain))
    parts = (qkv[..., :query_pos], qkv[..., query_pos:key_end], qkv[..., key_end:])
    return [part.view(hidden_shape).transpose(1, 2) for part in parts]


_UNSET = object()
_PROJ = ("proj",)


def direct_forward(recognised: Recognised, module: nn.Module, arguments: dict[str, Any]) -> Any:
    """What ``module``'s forward returns for ``arguments``, computed directly, or ``NotImplemented``
    (see the module docstring)."""
    state = module.__dict__[_STATE]
    hidden, rotary = arguments.get("hidden_states"), arguments.get("position_embeddings")
    if (state.unservable is not None or not isinstance(hidden, Tensor) or not recognised.required <= arguments.keys()
            or not (isinstance(rotary, (tuple, list)) and len(rotary) == 2 or rotary is None and recognised.rotary_optional)
            or recognised.sized and hidden.dim() != 3  # the forward's own unpacking raises: let it
            or module.needs_fallback(hidden) or not no_global_hooks()):
        return NotImplemented
    kwargs = {}  # what the forward passes on as ``**kwargs``; one it would pass to the attention function refuses
    for name, given in arguments.items():  # a loop, not generators (about 1 µs less), which Dynamo traces too
        if name in _PASSED_ON:
            return NotImplemented
        if name not in recognised.not_passed_on:
            kwargs[name] = given
    cache = None
    for name in state.cache_names:
        cache = arguments.get(name)
        if cache is not None:
            break
    Cache, EncoderDecoderCache, PagedAttentionCache = _cache_classes()
    if not isinstance(cache, Cache) or isinstance(cache, (EncoderDecoderCache, PagedAttentionCache)):
        return NotImplemented
    qk_norms = recognised.qk_norms
    if qk_norms == "optional heads":  # the forward's ``if self.use_qk_norm:``
        qk_norms = "heads" if module.use_qk_norm else None
    elif qk_norms == "optional transposed":  # ``if self.qk_layernorm:``
        qk_norms = "transposed" if module.qk_layernorm else None
    children = module._modules
    if recognised.fused or recognised.interleaved:  # called as the forward calls it (its hooks run), whatever it is
        qkv = children.get("query_key_value" if recognised.interleaved else "qkv_proj")
        qkv = qkv if isinstance(qkv, nn.Module) else None
    else:
        qkv = _merged_projection(children)
    norms = _qk_norms(children, recognised.norm_names) if qk_norms else None
    sub_norm = children.get("attn_sub_norm") if recognised.sub_norm else None
    if recognised.sub_norm and not isinstance(sub_norm, nn.Module):
        return NotImplemented
    if recognised.counted_heads and not _counts_heads(module, qkv):
        return NotImplemented  # the forward's views by its head counts are not the merged projection's parts: let it say so
    namespace = _namespace(state.base_forward, recognised.code)
    layer_idx = getattr(module, "layer_idx", None)
    if (qkv is None or namespace is None or type(layer_idx) is not int or _mapped_kernel(module)
            or qk_norms and norms is None or not _names_paged_attention(module.config, namespace)):
        return NotImplemented
    paged = paged_layer_of(cache, layer_idx, state.block_size, state.passes_window)
    if paged is None:
        return NotImplemented

    # the forward's statements, with the cache binding and the attention function's dispatch inlined
    plain = plain_calls()
    input_shape = hidden.shape[:-1]
    whole = qk_norms == "whole" or recognised.clipped  # the whole projections first, then their heads
    separate = not (recognised.fused or recognised.interleaved or whole or recognised.gated)
    head_dim = module.head_size if recognised.interleaved else module.head_dim
    hidden_shape = (*input_shape, -1, head_dim)
    heads = _head_counts(type(qkv), qkv.sizes, head_dim) if hidden.dim() == 3 and separate else None
    gate = None
    if recognised.interleaved:  # each head's q, k and v side by side, chunked apart as the forward does
        qkv_heads = call_in(plain, qkv, hidden).view(*input_shape, -1, 3 * head_dim).transpose(1, 2)
        query, key, value = qkv_heads.chunk(3, dim=-1)
    elif recognised.gated:  # each head's queries and gate chunked apart, as the forward does
        q, k, v = qkv.forward(hidden)
        query, gate = torch.chunk(q.view(*input_shape, -1, module.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        query = call_in(plain, norms[0], query.view(hidden_shape)).transpose(1, 2)
        key = call_in(plain, norms[1], k.view(hidden_shape)).transpose(1, 2)
        value = v.view(hidden_shape).transpose(1, 2)
    elif recognised.fused:
        query, key, value = _sliced_heads(module, call_in(plain, qkv, hidden), hidden_shape, plain)
    elif whole:  # the whole q / k projections normed, clamped in place where the forward does, split into heads
        q, k, v = qkv.forward(hidden)
        if qk_norms == "whole":
            q, k = call_in(plain, norms[0], q), call_in(plain, norms[1], k)
        clip = module.config.clip_qkv if recognised.clipped else None
        if clip is not None:
            for part in (q, k, v):
                part.clamp_(min=-clip, max=clip)
        query, key, value = [part.view(hidden_shape).transpose(1, 2) for part in (q, k, v)]
    elif qk_norms == "heads":  # the q / k heads [B, T, H, D] normed, then transposed, as the forward does
        if heads is None:
            q, k, v = [part.view(hidden_shape) for part in qkv.forward(hidden)]
        else:
            (proj,) = own_attributes(qkv, "_modules", _PROJ)
            q, k, v = call_in(plain, proj, hidden).view(hidden_shape).split_with_sizes(heads, dim=-2)
        query = call_in(plain, norms[0], q).transpose(1, 2)
        key = call_in(plain, norms[1], k).transpose(1, 2)
        value = v.transpose(1, 2)
    elif heads is None:
        q, k, v = qkv.forward(hidden)  # what its q/k/v parts run
        query, key, value = [part.view(hidden_shape).transpose(1, 2) for part in (q, k, v)]
    else:  # the same three views, made from the merged output at once (3 ATen calls instead of 7)
        (proj,) = own_attributes(qkv, "_modules", _PROJ)
        merged = call_in(plain, proj, hidden)
        query, key, value = _head_views(merged, hidden_shape, heads, plain)
    if qk_norms == "transposed":
        query, key = call_in(plain, norms[0], query), call_in(plain, norms[1], key)
    cos, sin = rotary if rotary is not None else (None, None)
    rotate, mask = namespace["apply_rotary_pos_emb"], arguments.get("attention_mask")
    # (no rotation where the forward's test says so, or the call brings no tables)
    rotates = rotary is not None and (recognised.rotary_condition is None or recognised.rotary_condition(module))
    # the rotated heads normed or the rotated queries scaled: the write stores them as they come
    changed_after = qk_norms == "after rotary" or recognised.query_scale is not None
    rotated = (query, key)  # what the forward rotates: each head, or its first ``rotary_ndims`` dims
    writable = rotates and not changed_after
    if rotates and recognised.partial_rotary:
        dims = module.rotary_ndims
        rotated, passed = (query[..., :dims], key[..., :dims]), (query[..., dims:], key[..., dims:])
        # the write rotates as many dims as the tables are wide and passes the rest on, as the forward's
        # cat does: where the tables are as wide as the forward's slices (else its rotary call has its say)
        writable = writable and getattr(cos, "shape", (None,))[-1] == dims
    if writable and _rotates_in_the_write(rotate, *rotated, value, cos, sin, paged):
        batch = store_step(state, paged, key, value, mask, (query, cos, sin))
        query, key = batch.query_states, batch.key_states
    else:
        if rotates and recognised.partial_rotary:
            rotated = rotate(*rotated, cos, sin)
            query, key = torch.cat((rotated[0], passed[0]), dim=-1), torch.cat((rotated[1], passed[1]), dim=-1)
        elif rotates:
            query, key = rotate(query, key, cos, sin)
        if qk_norms == "after rotary":
            query, key = call_in(plain, norms[0], query), call_in(plain, norms[1], key)
        if recognised.query_scale is not None:
            query = query * recognised.query_scale(module, arguments.get("position_ids"), query)
        batch = store_step(state, paged, key, value, mask)
    state.kv = paged.store
    for name, value_of in recognised.forwarded:
        kwargs[name] = value_of(module)
    out, weights = attend_paged(module, state, batch, query, key, value, mask, module.scaling, 0.0, kwargs)
    (o_proj,) = own_attributes(module, "_modules", recognised.out_names)
    head_gate = module.g_proj if recognised.head_gate else None
    if head_gate is not None:  # each head's output by its gate, ``[B, q, H, 1]``, as the forward scales it
        out = out * torch.sigmoid(call_in(plain, head_gate, hidden)).unsqueeze(-1)
    out = out.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        out = out * torch.sigmoid(gate)
    if sub_norm is not None:
        out = call_in(plain, sub_norm, out)
    return call_in(plain, o_proj, out), weights


def direct_path_for(cls: type) -> Optional[Callable[[nn.Module, dict[str, Any]], Any]]:
    """The direct path for paged modules of class ``cls`` (None: its forward is not recognised)."""
    recognised = recognise(cls)
    return None if recognised is None else functools.partial(direct_forward, recognised)
