"""``rotary_write_kv_cache``: ``rotary_embedding`` and the ``write_kv_cache`` of its keys, in one launch.

A decode step's attention rotates its queries and keys, then writes the rotated keys and the
values into the paged cache: two launches of a few microseconds of GPU work each, whose host
code costs more than the work. This op is both, with the spec of each:

* ``q`` ``[B, Hq, T, D]``, ``k`` / ``v`` ``[B, Hkv, T, D]`` (Hugging Face's attention layout, any
  strides), ``cos`` / ``sin`` ``[B or 1, T, R]``: as :mod:`.rotary_embedding`;
* ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]`` and ``slot_mapping`` ``[B * T]``
  (token ``(b, t)`` goes to ``slot_mapping[b * T + t]``; negative: padding, not written): as
  :mod:`.write_kv_cache`, with the rotated keys and ``v`` as its ``key`` / ``value``.
* Results: ``(q_embed, k_embed)``, what ``rotary_embedding(q, k, cos, sin)`` returns, laid out
  tokens-major (``[B, T, H, D]`` tensors viewed as ``[B, H, T, D]``, as the projections' heads
  are; the strides of size-1 dims may differ, as PyTorch's own comparisons allow); the caches
  are written in place. The rotated keys must have the cache's dtype, and ``v``
  too.

The numerics are the two ops' (bit-identical to Hugging Face's eager rotary code in fp16 and
bf16). The kernel takes the calls whose q, k and v merge batch and tokens into one dimension
(every call whose heads are views of a projection's output, and any decode step); others, and
devices without a kernel, run the two ops one after the other. Who calls it: the direct
attention path (:mod:`hw_agnostic.backend.attention_direct`), where the model's rotary function
was shown to compute what ``rotary_embedding`` computes and a kernel can take the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import rotary_write_kv_cache as kernels
from ..kernels.launch_binding import bindable, replayed
from ..kernels.runtime import helion_available
from . import checks
from .registry import Op, Provider
from .rotary_embedding import _helion_accepts as _rotary_accepts
from .rotary_embedding import check_rotary_embedding, rope_tables, rotary_embedding_op, rotary_embedding_reference
from .write_kv_cache import (
    _EAGER_WRITE, SLOT_DTYPES, caches_flatten, check_caches, check_index, slot_view, write_kv_cache_reference,
)

OP = "rotary_write_kv_cache"


# --------------------------------------------------------------------------------------------
# the spec


def _tokens_major(x: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty ``[B, H, T, D]`` result for ``x``, laid out tokens-major."""
    batch, heads, tokens, dim = x.shape
    return torch.empty_strided((batch, heads, tokens, dim), (tokens * heads * dim, dim, heads * dim, 1), dtype=dtype,
                               device=x.device)


def _token_rows(x: Tensor) -> Tensor:
    """``x`` ``[B, H, T, D]`` as ``[B * T, H, D]`` rows, one per token (a view where batch and tokens merge)."""
    shape = x.shape
    return x.transpose(1, 2).reshape(shape[0] * shape[2], shape[1], shape[3])


def rotary_write_kv_cache_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                                    v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    return _two_steps(rotary_embedding_reference, write_kv_cache_reference, q, k, v, cos, sin, k_cache, v_cache,
                      slot_mapping)


def _rotary_write_kv_cache_shapes(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                                  v_cache: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    return _tokens_major(q, dtype), _tokens_major(k, dtype)


def _two_steps(rotate: Callable[..., tuple[Tensor, Tensor]], write: Callable[..., None], q: Tensor, k: Tensor,
               v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
               slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """``rotate(q, k, cos, sin)``, its results laid out tokens-major, then ``write`` of the rotated keys
    and ``v``, one row per token: the spec with the two specs, the reference provider's form with the
    two ops as they run here."""
    q_rotated, k_rotated = rotate(q, k, cos, sin)
    q_embed, k_embed = _as_tokens_major(q_rotated), _as_tokens_major(k_rotated)
    write(_token_rows(k_embed), _token_rows(v), k_cache, v_cache, slot_mapping)
    return q_embed, k_embed


class _TwoOps:
    """The reference provider's form: the two ops one after the other, as fast as they run apart (on
    the CPU the rotation is ``rotary_embedding``'s compiled spec). Bound to a call signature (see
    :meth:`.Plan.bound`) it runs ``rotary_embedding``'s run for that signature without its
    dispatch (the signature fixes its plan; forcing a provider or a config resets both ops)."""

    def __call__(self, *args: Tensor) -> tuple[Tensor, Tensor]:
        return _two_steps(rotary_embedding_op.call, _EAGER_WRITE, *args)

    def bind(self, args: tuple) -> Callable[..., tuple[Tensor, Tensor]]:
        q, k, _, cos, sin = args[:5]
        rotation = (q, k, cos, sin)
        return functools.partial(_two_steps, rotary_embedding_op.plan(*rotation).bound(rotation), _EAGER_WRITE)


_TWO_OPS = _TwoOps()


def _as_tokens_major(x: Tensor) -> Tensor:
    """``x`` laid out tokens-major: itself where it is (``rotary_embedding`` lays its results out like
    its arguments, tokens-major where they are the projections' heads), else a copy."""
    return x if x.transpose(1, 2).is_contiguous() else _tokens_major(x, x.dtype).copy_(x)


# --------------------------------------------------------------------------------------------
# checks and keys


def check_rotary_write_kv_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                                v_cache: Tensor, slot_mapping: Tensor) -> None:
    check_rotary_embedding(q, k, cos, sin, op=OP)
    checks.tensor(OP, "v", v)
    checks.same_device(OP, "v", v, "k", k)
    checks.same_shape(OP, "v", v, "k", k)
    check_caches(OP, k_cache, v_cache)
    checks.same_device(OP, "k_cache", k_cache, "k", k)
    batch, heads, tokens, head_dim = k.shape
    if (heads, head_dim) != tuple(k_cache.shape[2:]):
        raise ValueError(f"{OP}: k has {heads} heads of dim {head_dim} but the cache holds {k_cache.shape[2]} heads "
                         f"of dim {k_cache.shape[3]} (k_cache shape {tuple(k_cache.shape)})")
    rotated = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
    if rotated != k_cache.dtype:
        raise TypeError(f"{OP}: the rotated keys ({rotated}: k's and cos's dtypes promoted) must have the cache's "
                        f"dtype ({k_cache.dtype})")
    if v.dtype != k_cache.dtype:
        raise TypeError(f"{OP}: v must have the cache's dtype ({k_cache.dtype}); got {v.dtype}")
    check_index(OP, "slot_mapping", slot_mapping, 1, k_cache, SLOT_DTYPES)
    if slot_mapping.shape[0] != batch * tokens:
        raise ValueError(f"{OP}: slot_mapping must have one slot per token (batch * tokens = {batch * tokens}); "
                         f"got {slot_mapping.shape[0]}")
    checks.no_aliasing(OP, (("k_cache", k_cache), ("v_cache", v_cache)),
                       (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("slot_mapping", slot_mapping)),
                       among_written=False)


def _tokens_merge(x: Tensor) -> bool:
    """Whether ``x`` ``[B, H, T, D]`` views as one row per token (:func:`_token_rows` without a copy)."""
    batch, _, tokens, _ = x.shape
    return batch == 1 or tokens == 1 or x.stride(0) == tokens * x.stride(2)


class RotaryWriteKey(NamedTuple):
    device: str
    dtype: torch.dtype
    table_dtype: torch.dtype  # cos and sin
    slot_dtype: torch.dtype
    head_dim: int
    rotary_dim: int
    q_heads: int
    k_heads: int
    tokens_merge: bool  # q, k and v: see _tokens_merge
    caches_flatten: bool
    tokens: int
    int64: bool


def rotary_write_kv_cache_key(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                              v_cache: Tensor, slot_mapping: Tensor) -> RotaryWriteKey:
    return RotaryWriteKey(
        q.device.type, q.dtype, cos.dtype, slot_mapping.dtype, q.shape[3], cos.shape[2], q.shape[1], k.shape[1],
        _tokens_merge(q) and _tokens_merge(k) and _tokens_merge(v), caches_flatten(k_cache, v_cache),
        token_bucket(q.shape[0] * q.shape[2]), checks.needs_int64(q, k, v, cos, sin, k_cache, v_cache),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: RotaryWriteKey) -> str | None:
    reason = _rotary_accepts(key)  # type: ignore[arg-type]  # the fields rotary_embedding's check reads
    if reason is not None:
        return reason
    if not key.tokens_merge:
        return "q, k or v do not merge batch and tokens into one dimension (row-major [B, H, T, D] with B, T > 1)"
    if not key.caches_flatten:
        return "a cache's block and slot dims do not merge into one slot stride"
    return None


def _tuning_key(key: RotaryWriteKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "head_dim": key.head_dim, "rotary_dim": key.rotary_dim,
            "q_heads": key.q_heads, "k_heads": key.k_heads}


def _table_rows(table: Tensor, batch: int, tokens: int) -> Tensor:
    """``[B or 1, T, R]`` as one row per token (a copy only for one table shared by several rows)."""
    if table.shape[0] != batch:
        table = table.expand(batch, tokens, table.shape[2])
    return table.reshape(batch * tokens, table.shape[2])


def _table_views(table: Tensor, batch: int, tokens: int) -> bool:
    """Whether :func:`_table_rows` of ``table`` is a view (the same memory: a replayed launch reads the table itself)."""
    return table.shape[0] == batch and (batch == 1 or tokens == 1 or table.stride(0) == tokens * table.stride(1))


def _build(key: RotaryWriteKey, config: dict, args: tuple) -> object:
    q, k, v, cos, sin, k_cache, v_cache, slot_mapping = args
    half = key.rotary_dim // 2
    batch, _, tokens, _ = q.shape
    launch = kernels.rotary_write_kv_cache_kernel.compile(
        config, (_token_rows(q), _token_rows(k), _token_rows(v), _table_rows(cos, batch, tokens),
                 _table_rows(sin, batch, tokens), _token_rows(_tokens_major(q, q.dtype)),
                 _token_rows(_tokens_major(k, k.dtype)), slot_view(k_cache), slot_view(v_cache), slot_mapping, half),
        int64=key.int64)

    def running(launch: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        def run(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
            q_embed, k_embed = _tokens_major(q, q.dtype), _tokens_major(k, k.dtype)
            if q.numel() or k.numel():
                batch, tokens = q.shape[0], q.shape[2]
                # Replayed, each tensor stands for the view the kernel takes of it (the same memory);
                # recording, or where a table is copied per call, the views are made.
                if not (_table_views(cos, batch, tokens) and _table_views(sin, batch, tokens) and replayed(
                        launch, q, k, v, cos, sin, q_embed, k_embed, k_cache, v_cache, slot_mapping, half)):
                    launch(_token_rows(q), _token_rows(k), _token_rows(v), _table_rows(cos, batch, tokens),
                           _table_rows(sin, batch, tokens), _token_rows(q_embed), _token_rows(k_embed),
                           slot_view(k_cache), slot_view(v_cache), slot_mapping, half)
            return q_embed, k_embed

        return run

    return bindable(running, launch)


_HELION = Provider(
    "helion", _build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
    kernel=kernels.ROTARY_WRITE_KV_CACHE, tuning_key=_tuning_key, available=helion_available,
)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck): Llama-3-8B's heads (32 query, 8 KV), one sequence
# as the projections leave it, written after 16 tokens of context


def _example(tokens: int, head_dim: int, dtype: torch.dtype, device: str) -> tuple:
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, tokens, 32, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, 8, head_dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, tokens, 8, head_dim, generator=g).to(dtype).transpose(1, 2)
    cos, sin = rope_tables(16 + tokens, head_dim, dtype, "cpu")
    block_size = 16
    num_blocks = -(-(16 + tokens) // block_size)
    k_cache = torch.zeros(num_blocks, block_size, 8, head_dim, dtype=dtype)
    slots = torch.arange(16, 16 + tokens)
    cos, sin = (t[:, 16:].clone(memory_format=torch.contiguous_format) for t in (cos, sin))  # as HF's tables hold them
    return tuple(t.to(device) for t in (q, k, v, cos, sin, k_cache, k_cache.clone(), slots))


rotary_write_kv_cache_op = Op(
    OP, rotary_write_kv_cache_reference, check=check_rotary_write_kv_cache, key=rotary_write_kv_cache_key,
    providers=[_HELION], mutates_args=("k_cache", "v_cache"), example_inputs=_example,
    native=lambda key: _TWO_OPS, fake=_rotary_write_kv_cache_shapes,
)


# --------------------------------------------------------------------------------------------
# public API


def rotary_write_kv_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                          slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """``rotary_embedding(q, k, cos, sin)`` and the ``write_kv_cache`` of its keys and ``v``, in one launch.

    ``q`` ``[B, Hq, T, D]``, ``k`` / ``v`` ``[B, Hkv, T, D]`` (any strides); ``cos`` / ``sin`` ``[B or 1,
    T, R]``; the caches ``[num_blocks, block_size, Hkv, D]``, written in place: token ``(b, t)``'s
    rotated key and value at slot ``slot_mapping[b * T + t]`` (negative: skipped). Returns
    ``(q_embed, k_embed)``, new tensors laid out tokens-major.
    """
    return rotary_write_kv_cache_op.call(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
