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

Static capacity (``capacity=``, what a transformers ``StaticCache`` asks for): the pages for that
many tokens per row are allocated up front and never move, and the bookkeeping lives on the
device, updated in place: the positions seen (a 0-d tensor, as transformers' static layers keep
it), each row's length, and which positions hold a real token (``[B, capacity]``). A step then
makes the same tensor calls on the same addresses whatever its position, with no host state that
changes, so a decode step traces once under ``torch.compile`` and can be captured as one CUDA
graph. Eager code keeps its own count of the positions (:meth:`PagedKVCache.host_seen`), read
back from the device only after steps that ran in a graph. The cost: each layer keeps and updates
its own counters (a dynamic store shares a step's metadata among its model's layers), and the
attention kernel's length hint is the capacity.

:class:`PagedAttention` is the layer. It takes over an attention module that follows the
Hugging Face pattern (projections, norms and rotary embedding in the module, then
``cache.update(k, v, layer_idx, ...)`` and an ``attention_interface(...)`` call) by
switching the module's class, and runs that module's own forward with the cache argument replaced
by a *binding*: the binding stores K/V in paged form and hands the paged batch to the attention
function through the module (:mod:`hw_agnostic.backend.attention` provides the bindings for
transformers' caches and the attention function). The module's projections, norms and rotary code
run unchanged, so what differs from Hugging Face is exactly the KV storage and the attention kernel;
the module keeps its parameters, names, hooks and ``isinstance``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..ops.paged_attention import paged_attention
from ..ops.rotary_write_kv_cache import rotary_write_kv_cache
from ..ops.write_kv_cache import write_kv_cache
from .base import PluggableLayer, resolve
from .made_class import made_by



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
    # The K/V tensors the cache update returned to the module: the attention call must receive
    # these very tensors, or the module changed K/V after storing them (and cannot be paged).
    key_states: Optional[Tensor] = None
    value_states: Optional[Tensor] = None
    # The rotated queries, where the step's write rotated them with its keys (see PagedKVCache.append).
    query_states: Optional[Tensor] = None
    # The layer's pages the step went to (None for pages owned elsewhere: continuous batching).
    store: Optional["PagedKVCache"] = None


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
    # one query a row (a decode step): the same rows as the transposed form's, in one view where it is one
    rows = (query.reshape(batch_size, heads, head_dim) if q_len == 1
            else query.transpose(1, 2).reshape(batch_size * q_len, heads, head_dim))
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
        dtype: torch.dtype, device: torch.device | str, share: Optional[StepShare] = None,
        capacity: Optional[int] = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"PagedKVCache: block_size must be >= 1, got {block_size}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(
                f"PagedKVCache: capacity must be a positive int (tokens per row) or None, got {capacity!r}")
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        # The metadata this layer computes alike with the other layers of its model (see StepShare).
        self.share = share if share is not None else StepShare()
        self.capacity = capacity  # tokens per row of a static store (module docstring); None: pages grow
        # positions seen per row, padding included (what Hugging Face counts): an int, or on a
        # static store a 0-d int64 tensor on the device
        self.seen: Any = 0
        # [B, seen] bool, which positions hold a real token; None while every position does.
        # Like kv_lens, never written in place: other layers may hold the same tensor.
        # (A static store's is [B, capacity], written in place, False past the positions seen.)
        self.real: Optional[Tensor] = None
        self.blocks_per_row = 0
        self.k_pages = self.v_pages = self.block_table = None
        self.kv_lens = self._zero_lengths()
        self._row_start: Optional[Tensor] = None
        if capacity is not None:
            self._make_static(capacity)

    @property
    def static(self) -> bool:
        return self.capacity is not None

    def on_device_only(self) -> bool:
        """Whether this step is traced or captured: a static store's counters are then read and
        written on the device alone."""
        if torch.compiler.is_compiling():
            return True
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def positions(self) -> Any:
        """The positions seen as the calling code may read them: an int, except inside a traced or
        captured step on a static store (its 0-d tensor on the device)."""
        if not self.static or self.on_device_only():
            return self.seen
        return self.host_seen()

    def host_seen(self) -> int:
        """A static store's positions seen, for eager code: read from the device only after a step
        that ran in a graph."""
        if self._host_seen is None:
            self._host_seen = int(self.seen)
        return self._host_seen

    def _make_static(self, capacity: int) -> None:
        self._reserve(capacity)
        self.seen = torch.zeros((), dtype=torch.int64, device=self.device)
        # What eager code knows of ``seen`` without reading the device: None after a step that ran
        # in a compiled graph or a CUDA graph capture (their replays advance ``seen`` on the device).
        self._host_seen: Optional[int] = 0
        self.kv_lens = torch.zeros(self.batch_size, dtype=torch.int32, device=self.device)
        self.real = torch.zeros(self.batch_size, capacity, dtype=torch.bool, device=self.device)
        self._mark_static()

    def _mark_static(self) -> None:
        if not torch.compiler.is_compiling():
            # Fixed addresses: a compiled graph reads them in place (a CUDA graph copies nothing in).
            for tensor in (self.k_pages, self.v_pages, self.block_table, self._row_start, self.seen, self.kv_lens,
                           self.real):
                torch._dynamo.mark_static_address(tensor)

    def _zero_lengths(self) -> Tensor:
        return self.share.once(("zeros", self.batch_size, self.device),
                               lambda: torch.zeros(self.batch_size, dtype=torch.int32, device=self.device))

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
        batch_size, block_size, device = self.batch_size, self.block_size, self.device

        def layout() -> tuple[Tensor, Tensor]:
            rows = torch.arange(batch_size, device=device, dtype=torch.int32)
            columns = torch.arange(blocks_per_row, device=device, dtype=torch.int32)
            return rows[:, None] * blocks_per_row + columns, rows.long() * (blocks_per_row * block_size)

        self.block_table, self._row_start = self.share.once(
            ("layout", batch_size, blocks_per_row, block_size, device), layout)

    def append(self, key: Tensor, value: Tensor, real: Optional[Tensor] = None) -> PagedBatch:
        """Write one step's ``key`` / ``value`` ``[B, q, Hkv, D]`` and return the batch to attend.

        ``real`` (``[B, q]`` bool, optional) marks the tokens that are not padding.
        """
        return self._append(key, value, real, None, key.shape[1])

    def append_rotating(self, query: Tensor, key: Tensor, value: Tensor, cos: Tensor, sin: Tensor,
                        real: Optional[Tensor] = None) -> PagedBatch:
        """:meth:`append` of a step whose ``query`` and ``key`` are rotated first, in the same launch as
        the write (``rotary_write_kv_cache``); all three in Hugging Face's layout ``[B, H, q, D]``, as the
        batch's ``query_states`` and ``key_states`` hold them rotated."""
        return self._append(key, value, real, (query, cos, sin), key.shape[2])

    def _append(self, key: Tensor, value: Tensor, real: Optional[Tensor],
                rotary: Optional[tuple[Tensor, Tensor, Tensor]], q_len: int) -> PagedBatch:
        """:meth:`append` (``key`` / ``value`` ``[B, q, Hkv, D]``) or, with ``rotary``, :meth:`append_rotating`."""
        batch_size = key.shape[0]
        if batch_size != self.batch_size:
            raise ValueError(f"PagedKVCache: a step of {batch_size} rows for a cache of {self.batch_size}")
        if self.static:
            return self._append_static(key, value, real, rotary, q_len)
        self._reserve(self.seen + q_len)
        assert self._row_start is not None and self.block_table is not None
        step = self.share.once(
            ("append", self.kv_lens, self._row_start, real, q_len, self.real, self.seen),
            lambda: _step_metadata(self.share, self.kv_lens, self._row_start, real, q_len, self.real, self.seen,
                                   self.device))
        rotated = self._write(key, value, step.slots, rotary)
        self.kv_lens, self.real = step.kv_lens, step.real
        self.seen += q_len
        return PagedBatch(self.k_pages, self.v_pages, self.block_table, step.cu_seqlens_q, self.kv_lens, q_len,
                          self.seen, step.query_order, store=self, query_states=rotated[0], key_states=rotated[1])

    def _write(self, key: Tensor, value: Tensor, slots: Tensor,
               rotary: Optional[tuple[Tensor, Tensor, Tensor]]) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Write ``key`` / ``value`` ``[B, q, Hkv, D]`` into their ``slots``; with ``rotary``, ``[B, Hkv, q, D]``
        rotating ``rotary``'s query and the keys first (see :meth:`append_rotating`); returns the rotated
        query and keys (None without ``rotary``)."""
        if rotary is None:
            tokens = key.shape[0] * key.shape[1]
            write_kv_cache(key.reshape(tokens, self.num_kv_heads, self.head_dim),
                           value.reshape(tokens, self.num_kv_heads, self.head_dim), self.k_pages, self.v_pages, slots)
            return None, None
        query, cos, sin = rotary
        return rotary_write_kv_cache(query, key, value, cos, sin, self.k_pages, self.v_pages, slots)

    def _append_static(self, key: Tensor, value: Tensor, real: Optional[Tensor],
                       rotary: Optional[tuple[Tensor, Tensor, Tensor]], q_len: int) -> PagedBatch:
        """:meth:`_append` on a static store: the step's metadata computed from the device counters,
        which are then advanced in place.

        A compiled or captured step reads no host state. An eager one (a prefill, a step outside a
        graph) checks the capacity and shares the step's layout with the other layers by the
        positions seen as eager code has kept them (:meth:`host_seen`: read from the device once
        after graphed steps)."""
        batch_size = key.shape[0]
        assert self._row_start is not None and self.block_table is not None and self.real is not None
        on_device = self.on_device_only()
        if on_device:
            self._host_seen = None
            positions = self.seen + torch.arange(q_len, device=self.device)
            fits = positions < self.capacity
            torch._assert_async(fits.all(), self._past_capacity())
            layout = _step_layout(real, q_len, batch_size, self.device)
        else:
            start = self.host_seen()
            if start + q_len > self.capacity:
                raise ValueError(f"{self._past_capacity()}: {start} positions seen, a step of {q_len}")
            # (a static cache's mask always spans the capacity, so a step always comes with its
            # padding read from it: one without any takes the layout without gathers)
            layout = self.share.once(("step layout", real, q_len, batch_size, self.device), lambda: _step_layout(
                None if real is None or bool(real.all()) else real, q_len, batch_size, self.device))
        slots = _slots(layout, self.kv_lens, self._row_start)
        if on_device:  # a position past the capacity is never written, whatever the assertion leaves running
            slots = torch.where(fits[None, :], slots, -1)
        rotated = self._write(key, value, slots.reshape(-1), rotary)
        if on_device:
            written = fits[None, :].expand(batch_size, q_len)
            if layout.real is not None:
                written = written & layout.real
            self.real.index_copy_(1, positions.clamp(max=self.capacity - 1), written)
        else:
            self.real[:, start:start + q_len] = True if layout.real is None else layout.real
            self._host_seen = start + q_len
        self.kv_lens.add_(layout.counts)
        self.seen.add_(q_len)
        return PagedBatch(self.k_pages, self.v_pages, self.block_table, layout.cu_seqlens_q, self.kv_lens, q_len,
                          self.capacity, layout.query_order, store=self, query_states=rotated[0],
                          key_states=rotated[1])

    def _past_capacity(self) -> str:
        return (f"PagedKVCache: a step past the static capacity of {self.capacity} tokens per row "
                "(a StaticCache's max_cache_len)")

    @property
    def padded(self) -> bool:
        """Whether some row may hold fewer tokens than :attr:`seen`."""
        return self.real is not None

    def read(self) -> tuple[Tensor, Tensor]:
        """Every position's K and V in Hugging Face's layout ``[B, Hkv, seen, D]`` (zeros at padding).

        What transformers' own cache layer would return from ``update``: the fallback path (attention
        weights, gradients) and ``cache.layers[i].keys`` read the pages through it.
        """
        width = self.capacity if self.static else self.seen  # a static store: every position it has room for
        shape = (self.batch_size, width, self.num_kv_heads, self.head_dim)
        if self.k_pages is None or width == 0:
            empty = torch.zeros(shape, dtype=self.dtype, device=self.device).transpose(1, 2)
            return empty, empty.clone()
        assert self._row_start is not None
        if self.real is None:
            slots = self._row_start[:, None] + torch.arange(self.seen, device=self.device)
        else:
            slots = torch.where(self.real, self._row_start[:, None] + self.real.cumsum(1) - 1, -1)
        flat_k = self.k_pages.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_pages.view(-1, self.num_kv_heads, self.head_dim)
        keys, values = flat_k[slots.clamp(min=0)], flat_v[slots.clamp(min=0)]
        if self.real is not None:
            pad = ~self.real[:, :, None, None]
            keys, values = keys.masked_fill(pad, 0), values.masked_fill(pad, 0)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def read_with(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Every position's K/V after a step ``[B, Hkv, q, D]`` was appended, the step's own given as
        they came (so gradients reach them, and its padding positions hold what the module computed)."""
        keys, values = self.read()
        steps = key_states.shape[2]
        # the step as the pages hold it (an autocast step's 16-bit V beside fp32 K: see PagedCacheLayer.append)
        key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
        if self.static:
            positions = (self.seen - steps + torch.arange(steps, device=self.device)).clamp(max=self.capacity - 1)
            return keys.index_copy(2, positions, key_states), values.index_copy(2, positions, value_states)
        return (torch.cat([keys[:, :, : keys.shape[2] - steps], key_states], dim=2),
                torch.cat([values[:, :, : values.shape[2] - steps], value_states], dim=2))

    # -- batch operations (beam search, sampling several sequences, assisted decoding) ----------

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` (in that order; repeats allowed): a physical copy, so rows can diverge."""
        index = index.to(self.device)
        if self.static and index.shape[0] == self.batch_size:
            self._select_in_place(index)
            return
        kv_lens, real = self.kv_lens, self.real
        self.kv_lens, self.real = self.share.once(
            ("select", kv_lens, real, index), lambda: (kv_lens[index], None if real is None else real[index]))
        if self.k_pages is not None:
            shape = (self.batch_size, self.blocks_per_row, *self.k_pages.shape[1:])
            self.k_pages = self.k_pages.view(shape)[index].flatten(0, 1)
            self.v_pages = self.v_pages.view(shape)[index].flatten(0, 1)
        self.batch_size = index.shape[0]
        if self.k_pages is not None:
            self._layout(self.blocks_per_row)
        if self.static:  # another batch size: new buffers, kept at their new addresses from now on
            self.seen, self.kv_lens, self.real = self.seen.clone(), self.kv_lens.clone(), self.real.clone()
            self._mark_static()

    def _select_in_place(self, index: Tensor) -> None:
        """:meth:`select` keeping the batch size, on a static store: its tensors keep their addresses."""
        assert self.k_pages is not None and self.v_pages is not None and self.real is not None
        shape = (self.batch_size, self.blocks_per_row, *self.k_pages.shape[1:])
        for pages in (self.k_pages, self.v_pages):
            pages.copy_(pages.view(shape)[index].flatten(0, 1))
        self.kv_lens.copy_(self.kv_lens[index])
        self.real.copy_(self.real[index])

    def repeat_interleave(self, repeats: int) -> None:
        batch_size, device = self.batch_size, self.device
        self.select(self.share.once(("repeat", batch_size, repeats, device),
                                    lambda: torch.arange(batch_size, device=device).repeat_interleave(repeats)))

    def crop(self, tokens: int) -> None:
        """Forget the last ``tokens`` positions (assisted and speculative decoding)."""
        if self.static:
            self._crop_static(tokens)
            return
        tokens = min(tokens, self.seen)
        if tokens <= 0:
            return
        seen = self.seen - tokens
        kv_lens, real = self.kv_lens, self.real

        def cropped() -> tuple[Tensor, Optional[Tensor]]:
            if real is None:
                return kv_lens - tokens, None
            return kv_lens - real[:, seen:].sum(1, dtype=torch.int32), real[:, :seen]

        self.kv_lens, self.real = self.share.once(("crop", kv_lens, real, seen, tokens), cropped)
        self.seen = seen

    def _crop_static(self, tokens: int) -> None:
        assert self.real is not None
        if tokens <= 0:
            return
        self.seen.sub_(tokens).clamp_(min=0)
        if self._host_seen is not None:
            self._host_seen = max(self._host_seen - tokens, 0)
        dropped = self.real & (torch.arange(self.real.shape[1], device=self.device) >= self.seen)
        self.kv_lens.sub_(dropped.sum(1, dtype=torch.int32))
        self.real.logical_and_(~dropped)

    def reset(self) -> None:
        if self.static:
            assert self.real is not None
            self.seen.zero_()
            self.kv_lens.zero_()
            self.real.zero_()
            self._host_seen = 0
            return
        self.seen = 0
        self.real = None
        self.kv_lens = self._zero_lengths()


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """What appending one step computes besides the write: the same for every layer of a model."""

    slots: Tensor  # [B * q] slot of each token, -1 for padding
    kv_lens: Tensor  # each row's real tokens after the step
    cu_seqlens_q: Tensor
    query_order: Optional[Tensor]
    real: Optional[Tensor]  # [B, seen + q] which positions are real, None while all are


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where a step's tokens go relative to each row's length: what the step's padding alone decides."""

    offsets: Tensor  # each token's place after its row's tokens: [q], or [B, q] with padding
    real: Optional[Tensor]  # [B, q] bool, None when every token is real
    counts: Any  # [B] int32 real tokens per row, or the int q
    cu_seqlens_q: Tensor
    query_order: Optional[Tensor]


def _step_layout(real: Optional[Tensor], q_len: int, batch_size: int, device: torch.device) -> StepLayout:
    if real is None:
        # Every token is real: each row appends its q tokens after the ones it holds.
        cu = (torch.arange(0, (batch_size + 1) * q_len, q_len, device=device, dtype=torch.int32) if q_len
              else torch.zeros(batch_size + 1, device=device, dtype=torch.int32))
        return StepLayout(torch.arange(q_len, device=device), None, q_len, cu, None)
    real = real.to(device=device, dtype=torch.bool)
    return _one_token_layout(real) if batch_size * q_len == 1 else _padded_layout(real, batch_size, device)


def _padded_layout(real: Tensor, batch_size: int, device: torch.device) -> StepLayout:
    counts = real.sum(1, dtype=torch.int32)
    cu = torch.zeros(batch_size + 1, device=device, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    order = torch.argsort((~real).reshape(-1).to(torch.int8), stable=True)
    return StepLayout(real.cumsum(1) - 1, real, counts, cu, order)


def _one_token_layout(real: Tensor) -> StepLayout:
    """:func:`_padded_layout` of a ``[1, 1]`` step (batch-1 decode): its sums, scans and sort, each a
    kernel that a graphed or traced step runs per layer, reduce to casts of the token's flag, and
    the one query row needs no order."""
    counts = real.view(1).to(torch.int32)
    return StepLayout(real.long() - 1, real, counts, torch.cat([counts.new_zeros(1), counts]), None)


def _slots(layout: StepLayout, kv_lens: Tensor, row_start: Tensor) -> Tensor:
    """``[B, q]``: each token's slot, after the ``kv_lens`` tokens its row holds (-1: padding)."""
    if layout.real is None:
        return row_start[:, None] + (kv_lens[:, None] + layout.offsets)
    return torch.where(layout.real, row_start[:, None] + (kv_lens[:, None].long() + layout.offsets), -1)


def _step_metadata(share: StepShare, kv_lens: Tensor, row_start: Tensor, real: Optional[Tensor], q_len: int,
                   seen_real: Optional[Tensor], seen: int, device: torch.device) -> StepMetadata:
    batch_size = kv_lens.shape[0]
    if real is None:
        # A step without padding (every decode step of unpadded rows): its layout, and each token's
        # slot before the row's length is added, are the same at every step (kept by the share).
        layout = share.once(("step layout", None, q_len, batch_size, device),
                            lambda: _step_layout(None, q_len, batch_size, device))
        base = share.once(("slot base", layout, row_start), lambda: row_start[:, None] + layout.offsets)
        slots = base + kv_lens[:, None]
    else:
        layout = _step_layout(real, q_len, batch_size, device)
        slots = _slots(layout, kv_lens, row_start)
    lengths = kv_lens + layout.counts
    # Which positions are real, kept once a step has padding (for crop and for reading back).
    known = seen_real
    if layout.real is not None or known is not None:
        if known is None:
            known = torch.ones(batch_size, seen, dtype=torch.bool, device=device)
        step = layout.real if layout.real is not None else torch.ones(batch_size, q_len, dtype=torch.bool,
                                                                       device=device)
        known = torch.cat([known, step], dim=1)
    return StepMetadata(slots.reshape(-1), lengths, layout.cu_seqlens_q, layout.query_order, known)


_SHARED_BY_VALUE = (int, float, str, bool, type(None), torch.device, torch.dtype)


class StepShare:
    """What the layers of one model compute alike, computed by the first layer that needs it.

    The layers' :class:`PagedKVCache` of one transformers ``Cache`` hold one share. A step's
    metadata (slots, lengths, query offsets, padding order, block layout) depends only on what
    it is computed from: the lengths before the step, the step's length and padding, the layout.
    Those inputs are the key: tensors by identity (a layer's lengths are the very tensor the
    share handed every layer at the previous step, and nothing writes them in place), other
    values by value. The last :attr:`KEPT` results are kept (holding their inputs, so no other
    tensor can take an identity while its entry lives), the least recently used dropped first.
    """

    KEPT = 8

    def __init__(self, *, versioned: bool = False) -> None:
        self._entries: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}
        self.computed = 0  # how many entries were computed (the rest were shared)
        # Inputs that someone else owns and may refill in place (continuous batching's index
        # buffers) are keyed on their version counter too; one without a counter (an inference
        # tensor) is never shared.
        self.versioned = versioned

    def once(self, inputs: tuple[Any, ...], compute: Callable[[], Any], *, versioned: Optional[bool] = None) -> Any:
        """``compute()``, or what it gave for the same inputs (``versioned``: as for the share)."""
        if torch.compiler.is_compiling():
            # A traced graph computes its metadata as it goes (its tensors' identities and version
            # counters are not the run's; the graph's own common-subexpression pass shares the work).
            return compute()
        if self.versioned if versioned is None else versioned:
            # Not kept: inputs without a version counter (inference tensors).
            if any(isinstance(x, Tensor) and x.is_inference() for x in inputs):
                return compute()
            key = tuple(x if isinstance(x, _SHARED_BY_VALUE) else
                        (id(x), x._version) if isinstance(x, Tensor) else id(x) for x in inputs)
        else:
            key = tuple(x if isinstance(x, _SHARED_BY_VALUE) else id(x) for x in inputs)
        found = self._entries.pop(key, None)
        if found is not None:
            self._entries[key] = found  # the most recently used last: what every step reads stays
            return found[1]
        value = compute()
        self.computed += 1
        if len(self._entries) >= self.KEPT:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (inputs, value)
        return value

# --------------------------------------------------------------------------------------------
# the layer

#: ``binding(layer, cache, attention_mask, fallback) -> cache object`` passed to the module's forward:
#: its ``update(k, v, layer_idx, ...)`` stores K/V and, on the paged path, hands the paged batch to
#: the attention function; on the fallback path it returns every position's K/V as transformers would.
CacheBinding = Callable[["PagedAttention", Any, Optional[Tensor], bool], Any]

@dataclasses.dataclass
class TransientPages:
    """Stands for the paged batch in a forward without a cache: the attention function writes the
    K/V it receives into pages for this forward alone (``page(key, value)``) and attends over them."""

    block_size: int
    attention_mask: Any

    def page(self, key: Tensor, value: Tensor, real: Optional[Tensor]) -> PagedBatch:
        """``key`` / ``value`` in transformers' layout ``[B, Hkv, S, D]``."""
        batch_size, heads, _, head_dim = key.shape
        store = PagedKVCache(batch_size, heads, head_dim, block_size=self.block_size, dtype=key.dtype,
                             device=key.device)
        batch = store.append(key.transpose(1, 2), value.transpose(1, 2), real)
        batch.key_states, batch.value_states = key, value
        return batch


_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
_STATE = "_hw_agnostic_paged"


@dataclasses.dataclass
class _PagedState:
    bind_cache: CacheBinding
    attention_config: Any  # what the module dispatches its attention function from while paged
    original_config: Any
    block_size: int
    positional: tuple[str, ...]  # the forward's positional parameter names
    cache_name: str  # the parameter (or keyword) the cache arrives as
    # Whether the module passes its sliding window to the attention function. One that does not
    # gets its window from the cache evicting old tokens, which a paged view does not do.
    passes_window: bool
    # What makes ``base_forward`` (the module's own class's forward, see PagedAttention.use_forward),
    # here and where the state is unpickled: functions made at run time (transformers' decorators,
    # the rotary routing's copies) pickle by name, which they do not have.
    forward_recipe: Callable[[], Callable[..., Any]]
    kv: Optional[PagedKVCache] = None  # this layer's own paged view, for plain (non-batching) caches
    # What the binding hands the attention function for the call in progress, per thread (one
    # model may serve several threads at once): the paged batch, the transient pages of a forward
    # without a cache, or nothing (the module's own attention). See hand() and take().
    handed: dict[int, Any] = dataclasses.field(default_factory=dict)
    base_forward: Optional[Callable[..., Any]] = dataclasses.field(init=False, default=None)
    cache_names: tuple[str, ...] = ()  # every name a cache may arrive under
    # Why the kernel cannot serve this module (its masks are not causal ones), once seen: from
    # then on it runs its own attention over the K/V its pages hold.
    unservable: Optional[str] = None
    # ``direct(module, arguments)``: what the module's forward returns for the call, computed
    # without running it, or NotImplemented (see hw_agnostic.backend.attention_direct)
    direct: Optional[Callable[[nn.Module, dict[str, Any]], Any]] = None

    def __post_init__(self) -> None:
        self.cache_names = tuple(dict.fromkeys((*_CACHE_NAMES, self.cache_name)))
        self.base_forward = self.forward_recipe()

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (and deep-copies): the forward as its recipe, no call in progress, and not
        the pages of the last cache (they belong to that cache, which holds them)."""
        return {**self.__dict__, "base_forward": None, "handed": {}, "kv": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.base_forward = self.forward_recipe()

    def hand(self, batch: Any) -> None:
        """Leave ``batch`` for this thread's next :meth:`take` (None: nothing)."""
        if batch is None:
            self.handed.pop(_thread(), None)
        else:
            self.handed[_thread()] = batch

    def take(self) -> Any:
        """What this thread's binding handed over for the call in progress (None: nothing), taken."""
        return self.handed.pop(_thread(), None)


@torch.compiler.assume_constant_result
def _thread() -> int:
    # A traced forward hands and takes within itself, so Dynamo may fold the id into a constant.
    # Not ``torch.compiler.is_compiling()``: one thread's compile makes it true in every thread.
    return threading.get_ident()


@functools.lru_cache(maxsize=None)  # per class's forward: reading its source for each layer cost 4 ms
def _call_shape(forward: Callable[..., Any]) -> tuple[tuple[str, ...], str, bool]:
    unwrapped = inspect.unwrap(forward)
    params = list(inspect.signature(unwrapped).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = {p.name for p in params}
    own = [p.name for p in params if "past" in p.name or "cache" in p.name]  # e.g. GPT-NeoX's layer_past
    cache_name = next((name for name in (*_CACHE_NAMES, *own) if name in names), "past_key_values")
    try:
        passes_window = "sliding_window=" in inspect.getsource(unwrapped)
    except (OSError, TypeError):
        passes_window = False
    return tuple(p.name for p in params if p.kind in kinds), cache_name, passes_window


def class_forward(cls: type) -> Callable[[], Callable[..., Any]]:
    """The recipe of ``cls.forward`` (see :attr:`_PagedState.forward_recipe`)."""
    return functools.partial(getattr, cls, "forward")


@functools.lru_cache(maxsize=None)
def _paged_class(layer: type, base: type) -> type:
    return type(f"Paged{base.__name__}", (layer, base), {
        "_hw_agnostic_base": base, "__module__": layer.__module__, **made_by(_paged_class, layer, base),
        "__doc__": f"{base.__name__} with its K/V in a paged cache and its attention in paged_attention.",
    })


@PluggableLayer.register("paged_attention")
class PagedAttention(PluggableLayer):
    """A Hugging Face attention module whose KV cache is paged and whose attention is ``paged_attention``.

    Not constructed: :meth:`adopt` switches an existing module's class to a subclass of both this
    layer (or the plugin's replacement for it) and the module's own class, so the module keeps its
    parameters, buffers, hooks, attributes, ``state_dict`` keys and ``isinstance`` (transformers'
    output recording finds it), and its own forward runs unchanged with the cache argument replaced
    by a *binding* (see :mod:`hw_agnostic.backend.attention`). :meth:`release` switches it back.

    A call the kernels cannot serve runs the module's own attention over every position's K/V, as
    transformers would: in training, while gradients are needed, while attention weights are
    being recorded (``output_attentions=True``), and under ``torch.autocast`` (which runs the
    module's attention in 16 bits; the pages hold K and V in one dtype, cast exactly).
    """

    _hw_agnostic_base: type

    @classmethod
    def adopt(cls, module: nn.Module, *, bind_cache: CacheBinding, attention_config: Any,
              block_size: int = 16, direct: Optional[Callable[[nn.Module, dict[str, Any]], Any]] = None) -> nn.Module:
        """Make ``module`` a paged attention layer in place (``cls`` resolved through the registry);
        ``direct``: its direct path, for calls whose result it computes without the forward."""
        if isinstance(module, PagedAttention):
            raise ValueError(f"{type(module).__name__} is paged already")
        layer = resolve("paged_attention")
        base = type(module)
        positional, cache_name, passes_window = _call_shape(base.forward)
        module.__dict__[_STATE] = _PagedState(bind_cache, attention_config, module.config, block_size, positional,
                                              cache_name, passes_window, forward_recipe=class_forward(base),
                                              direct=direct)
        module.__class__ = _paged_class(layer, base)
        module.config = attention_config
        return module

    @staticmethod
    def release(module: nn.Module) -> nn.Module:
        """Undo :meth:`adopt`: the module's own class and config again."""
        state: _PagedState = module.__dict__.pop(_STATE)
        module.__class__ = type(module)._hw_agnostic_base
        module.config = state.original_config
        return module

    @staticmethod
    def use_forward(module: nn.Module, forward: Optional[Callable[..., Any]],
                    recipe: Optional[Callable[[], Callable[..., Any]]] = None) -> None:
        """Run ``forward`` (a copy of the module's own class's forward, e.g. with its rotary
        function routed to a kernel) in its place, made again by ``recipe()`` (picklable) where the
        module is unpickled; None: the class's own forward again."""
        state: _PagedState = module.__dict__[_STATE]
        if forward is None:
            base = type(module)._hw_agnostic_base
            forward, recipe = base.forward, class_forward(base)
        elif recipe is None:
            raise ValueError("use_forward: a forward other than the class's own needs the recipe that makes it again")
        state.base_forward, state.forward_recipe = forward, recipe

    @staticmethod
    def forward_of(module: nn.Module) -> Callable[..., Any]:
        """The forward of the module's own class that the paged layer runs."""
        return module.__dict__[_STATE].base_forward

    @property
    def kv(self) -> Optional[PagedKVCache]:
        """This layer's paged KV cache for the last plain ``Cache`` it ran with (None before)."""
        return self.__dict__[_STATE].kv

    @property
    def block_size(self) -> int:
        return self.__dict__[_STATE].block_size

    @property
    def passes_window(self) -> bool:
        return self.__dict__[_STATE].passes_window

    #: Whether static-capacity pages (a StaticCache's, see PagedKVCache) may serve it: their
    #: counters live on the device, which a layer reading the positions seen on the host cannot use.
    takes_static_pages = True

    @property
    def original_config(self) -> Any:
        return self.__dict__[_STATE].original_config

    def needs_fallback(self, hidden_states: Any) -> bool:
        """Whether this call must run the module's own attention (see the class docstring)."""
        if self.training or recording_attentions():
            return True
        # autocast recasts the module's own attention (SDPA, matmuls) to 16 bits, which the kernel is not
        if (isinstance(hidden_states, Tensor) and _any_autocast()
                and torch.is_autocast_enabled(hidden_states.device.type)):
            return True
        if not torch.is_grad_enabled():
            return False
        return (isinstance(hidden_states, Tensor) and hidden_states.requires_grad) or any(
            p.requires_grad for p in self.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: _PagedState = self.__dict__[_STATE]
        if args:
            if len(args) > len(state.positional):
                raise TypeError(f"{type(self).__name__}.forward takes {len(state.positional)} positional arguments")
            arguments = dict(zip(state.positional, args))
            arguments.update(kwargs)
        else:
            arguments = kwargs
        if state.direct is not None:
            result = state.direct(self, arguments)
            if result is not NotImplemented:
                return result
        cache = None
        for name in state.cache_names:
            if name in arguments:
                value = arguments.pop(name)
                cache = value if cache is None else cache
        fallback = self.needs_fallback(arguments.get("hidden_states"))
        state.hand(None)
        if cache is None:
            # No cache: the module's cache code must not run, so its K/V reach the attention
            # function directly, which pages them for this one forward.
            if not fallback and state.unservable is None:
                state.hand(TransientPages(state.block_size, arguments.get("attention_mask")))
        else:
            arguments[state.cache_name] = state.bind_cache(self, cache, arguments.get("attention_mask"), fallback)
        return state.base_forward(self, **arguments)

    def extra_repr(self) -> str:
        return f"paged, block_size={self.block_size}"


#: whether autocast is on for any device: one C call (0.15 us) before the one for the tensor's device (0.5 us)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def recording_attentions() -> bool:
    """Whether transformers is recording attention weights in this forward (``output_attentions=True``)."""
    collector = _attention_collector()
    if collector is None:  # an older transformers: it asks the attention function for weights itself
        return False
    collected = collector.get()
    return bool(collected) and "attentions" in collected


@functools.lru_cache(maxsize=None)
def _attention_collector() -> Any:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector
