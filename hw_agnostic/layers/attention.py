"""Paged attention as a layer: a per-layer paged KV cache and the attention layer that owns it.

:class:`PagedKVCache` is one layer's KV cache for a batch of rows (``generate()``): blocks of
``block_size`` tokens, a block table per row, per-row lengths on the device. Rows own contiguous
ranges of blocks (a static batch never frees blocks mid-sequence, so nothing better is needed to
allocate them); the block table is what the kernel reads, so other allocators (continuous
batching's) plug in unchanged. Appending a step writes the new K/V with ``write_kv_cache`` and
returns the :class:`PagedBatch` that ``paged_attention`` reads; nothing is gathered into
contiguous K/V and no host synchronisation happens (the only host state, the number of positions
seen, advances by the step's length).

Padding: a token that is padding (from the attention mask) is not written (slot ``-1``), so each
row's cache holds its real tokens only, in order. Its queries are compacted the same way: the
real query rows of all rows are gathered to the front of the batch and each row is one
sequence of ``paged_attention``; padding queries are left to no sequence and come out as zeros.
This gives Hugging Face's masking for left padding (what ``generate`` uses) and for padding
anywhere, except that a sliding window then counts real tokens only.

:class:`PagedAttention` is the layer. It takes over an attention module that follows the
Hugging Face pattern (projections, norms and rotary embedding in the module, then
``cache.update(k, v, layer_idx, kwargs=...)`` and an ``attention_interface(...)`` call) and runs
that module's own forward with the cache argument replaced by a *binding*: the binding stores
K/V in paged form and hands the paged batch to the attention function through ``kwargs``
(:mod:`hw_agnostic.backend.attention` provides the bindings for transformers' caches and the
attention function). The module's projections, norms and rotary code run unchanged, so what
differs from Hugging Face is exactly the KV storage and the attention kernel.

The layer shares the wrapped module's children, parameters and buffers (the same dicts), so
parameter names, ``state_dict`` keys and later rewiring of the projections (``rewire()`` merging
q/k/v) are the module's own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..ops.paged_attention import paged_attention
from ..ops.write_kv_cache import write_kv_cache
from .base import PluggableLayer

#: Keyword through which a binding hands the paged batch to the attention function.
PAGED_BATCH_KWARG = "hw_agnostic_paged_batch"


@dataclasses.dataclass
class PagedBatch:
    """What ``paged_attention`` reads for one layer and one forward.

    ``query_order`` (optional) lists the query rows, in the order the sequences own them: row
    ``query_order[i]`` of the forward's queries is row ``i`` of the op's ``q``.
    """

    k_cache: Tensor
    v_cache: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    kv_lens: Tensor
    max_q_len: int
    max_kv_len: int
    query_order: Optional[Tensor] = None


def attend(
    query: Tensor,
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """``paged_attention`` for queries in Hugging Face's layout ``[B, Hq, q, D]``; returns ``[B, q, Hq, D]``."""
    batch_size, heads, q_len, head_dim = query.shape
    rows = query.transpose(1, 2).reshape(batch_size * q_len, heads, head_dim)
    if batch.query_order is not None:
        rows = rows[batch.query_order]
    out = paged_attention(
        rows, batch.k_cache, batch.v_cache, batch.block_table, batch.cu_seqlens_q, batch.kv_lens, scale=scale,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks, max_q_len=batch.max_q_len,
        max_kv_len=batch.max_kv_len,
    )
    if batch.query_order is not None:
        ordered = torch.empty_like(out)
        ordered[batch.query_order] = out
        out = ordered
    return out.view(batch_size, q_len, heads, head_dim)


class PagedKVCache:
    """One layer's paged KV cache for a batch of ``batch_size`` rows (see the module docstring)."""

    def __init__(
        self, batch_size: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"PagedKVCache: block_size must be >= 1, got {block_size}")
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.seen = 0  # positions seen per row, padding included (what Hugging Face counts)
        self.padded = False  # whether some row may hold fewer tokens than `seen`
        self.blocks_per_row = 0
        self.k_pages = self.v_pages = self.block_table = None
        self.kv_lens = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        self._row_start: Optional[Tensor] = None

    # -- storage -------------------------------------------------------------------------------

    def _reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens per row (doubling, so growth is amortised)."""
        needed = -(-tokens // self.block_size)
        if needed <= self.blocks_per_row:
            return
        blocks = max(needed, 2 * self.blocks_per_row)
        shape = (self.batch_size * blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k_pages = torch.empty(shape, dtype=self.dtype, device=self.device)
        v_pages = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self.k_pages is not None:
            rows = (self.batch_size, -1, *shape[1:])
            k_pages.view(rows)[:, : self.blocks_per_row] = self.k_pages.view(rows)
            v_pages.view(rows)[:, : self.blocks_per_row] = self.v_pages.view(rows)
        self.k_pages, self.v_pages = k_pages, v_pages
        self._layout(blocks)

    def _layout(self, blocks_per_row: int) -> None:
        """Row ``b`` owns blocks ``b * blocks_per_row ...``: its block table row and first slot."""
        self.blocks_per_row = blocks_per_row
        rows = torch.arange(self.batch_size, device=self.device, dtype=torch.int32)
        columns = torch.arange(blocks_per_row, device=self.device, dtype=torch.int32)
        self.block_table = rows[:, None] * blocks_per_row + columns
        self._row_start = rows.long() * (blocks_per_row * self.block_size)

    def append(self, key: Tensor, value: Tensor, real: Optional[Tensor] = None) -> PagedBatch:
        """Write one step's ``key`` / ``value`` ``[B, q, Hkv, D]`` and return the batch to attend.

        ``real`` (``[B, q]`` bool, optional) marks the tokens that are not padding.
        """
        batch_size, q_len = key.shape[0], key.shape[1]
        if batch_size != self.batch_size:
            raise ValueError(f"PagedKVCache: a step of {batch_size} rows for a cache of {self.batch_size}")
        self._reserve(self.seen + q_len)
        device = self.device
        steps = torch.arange(q_len, device=device)
        assert self._row_start is not None and self.block_table is not None
        if real is None:
            # Every token is real: each row appends its q tokens after the ones it holds.
            positions = (self.kv_lens[:, None] + steps).long()
            slots = self._row_start[:, None] + positions
            self.kv_lens += q_len
            counts = None
        else:
            real = real.to(device=device, dtype=torch.bool)
            rank = real.cumsum(1) - 1
            positions = self.kv_lens[:, None].long() + rank
            slots = torch.where(real, self._row_start[:, None] + positions, -1)
            counts = real.sum(1, dtype=torch.int32)
            self.kv_lens += counts
            self.padded = True
        write_kv_cache(
            key.reshape(batch_size * q_len, self.num_kv_heads, self.head_dim),
            value.reshape(batch_size * q_len, self.num_kv_heads, self.head_dim),
            self.k_pages, self.v_pages, slots.reshape(-1),
        )
        self.seen += q_len
        if counts is None:
            cu = torch.arange(batch_size + 1, device=device, dtype=torch.int32) * q_len
            order = None
        else:
            cu = torch.zeros(batch_size + 1, device=device, dtype=torch.int32)
            cu[1:] = counts.cumsum(0)
            order = torch.argsort((~real).reshape(-1).to(torch.int8), stable=True)
        return PagedBatch(self.k_pages, self.v_pages, self.block_table, cu, self.kv_lens, q_len, self.seen, order)

    # -- batch operations (beam search, sampling several sequences, assisted decoding) ----------

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` (in that order; repeats allowed): a physical copy, so rows can diverge."""
        index = index.to(self.device)
        self.kv_lens = self.kv_lens[index]
        if self.k_pages is not None:
            shape = (self.batch_size, self.blocks_per_row, *self.k_pages.shape[1:])
            self.k_pages = self.k_pages.view(shape)[index].flatten(0, 1)
            self.v_pages = self.v_pages.view(shape)[index].flatten(0, 1)
        self.batch_size = index.shape[0]
        if self.k_pages is not None:
            self._layout(self.blocks_per_row)

    def repeat_interleave(self, repeats: int) -> None:
        self.select(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens: int) -> None:
        """Forget the last ``tokens`` positions (assisted decoding)."""
        if tokens <= 0:
            return
        if self.padded:
            raise NotImplementedError(
                "PagedKVCache.crop: the cache holds padded rows, whose real lengths the host does not know; "
                "cropping them is not supported"
            )
        tokens = min(tokens, self.seen)
        self.seen -= tokens
        self.kv_lens -= tokens

    def reset(self) -> None:
        self.seen = 0
        self.padded = False
        self.kv_lens.zero_()


# --------------------------------------------------------------------------------------------
# the layer

#: ``binding(layer, cache, attention_mask, forward_kwargs) -> cache object`` passed to the wrapped
#: forward: its ``update(k, v, layer_idx, kwargs=...)`` stores K/V and puts the paged batch in kwargs.
CacheBinding = Callable[["PagedAttention", Any, Optional[Tensor], dict], Any]


@PluggableLayer.register("paged_attention")
class PagedAttention(PluggableLayer):
    """An HF-style attention module whose KV cache is paged and whose attention is ``paged_attention``.

    Args:
        attention: the module taken over (its forward must call ``cache.update(k, v, layer_idx,
            kwargs=kwargs)`` and an attention function with ``kwargs``).
        bind_cache: turns the cache a forward receives into the object the module writes K/V
            through (see :mod:`hw_agnostic.backend.attention`).
        attention_config: the config the module dispatches its attention function from (a copy of
            the model's naming the paged attention function).
        block_size: tokens per block of the caches this layer allocates.
    """

    def __init__(self, attention: nn.Module, *, bind_cache: CacheBinding, attention_config: Any,
                 block_size: int = 16) -> None:
        super().__init__()
        # One module, two views: the same children, parameters and buffers (see the module docstring).
        self._modules = attention._modules
        self._parameters = attention._parameters
        self._buffers = attention._buffers
        object.__setattr__(self, "wrapped", attention)
        self.training = attention.training
        self.original_config = attention.config  # restored when the layer is taken out again
        attention.config = attention_config
        self.layer_idx = getattr(attention, "layer_idx", None)
        self.block_size = block_size
        self.bind_cache = bind_cache
        self.kv: Optional[PagedKVCache] = None  # the view this layer owns for plain (non-batching) caches
        self._signature = inspect.signature(type(attention).forward)
        self._extra_kwargs = next(
            (p.name for p in self._signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )

    def train(self, mode: bool = True) -> "PagedAttention":
        super().train(mode)
        self.wrapped.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            return self.wrapped(*args, **kwargs)
        bound = self._signature.bind_partial(self.wrapped, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        extra = arguments.pop(self._extra_kwargs, {}) if self._extra_kwargs else {}
        cache = arguments.pop("cache", None)
        if cache is None:
            cache = extra.pop("past_key_values", None)
        arguments.update(extra)
        arguments["cache"] = self.bind_cache(self, cache, arguments.get("attention_mask"), arguments)
        return self.wrapped(**arguments)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, block_size={self.block_size}, wraps {type(self.wrapped).__name__}"
