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
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..ops.paged_attention import paged_attention
from ..ops.write_kv_cache import write_kv_cache
from .base import PluggableLayer, resolve



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
        # [B, seen] bool, which positions hold a real token; None while every position does
        self.real: Optional[Tensor] = None
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
        self._remember(real, q_len)
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

    def _remember(self, real: Optional[Tensor], q_len: int) -> None:
        """Keep which positions are real once a step has padding (for crop and for reading back)."""
        if real is None and self.real is None:
            return
        if self.real is None:
            self.real = torch.ones(self.batch_size, self.seen, dtype=torch.bool, device=self.device)
        step = real if real is not None else torch.ones(self.batch_size, q_len, dtype=torch.bool, device=self.device)
        self.real = torch.cat([self.real, step], dim=1)

    @property
    def padded(self) -> bool:
        """Whether some row may hold fewer tokens than :attr:`seen`."""
        return self.real is not None

    def read(self) -> tuple[Tensor, Tensor]:
        """Every position's K and V in Hugging Face's layout ``[B, Hkv, seen, D]`` (zeros at padding).

        What transformers' own cache layer would return from ``update``: the fallback path (attention
        weights, gradients) and ``cache.layers[i].keys`` read the pages through it.
        """
        shape = (self.batch_size, self.seen, self.num_kv_heads, self.head_dim)
        if self.k_pages is None or self.seen == 0:
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

    # -- batch operations (beam search, sampling several sequences, assisted decoding) ----------

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` (in that order; repeats allowed): a physical copy, so rows can diverge."""
        index = index.to(self.device)
        self.kv_lens = self.kv_lens[index]
        if self.real is not None:
            self.real = self.real[index]
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
        """Forget the last ``tokens`` positions (assisted and speculative decoding)."""
        tokens = min(tokens, self.seen)
        if tokens <= 0:
            return
        self.seen -= tokens
        if self.real is None:
            self.kv_lens -= tokens
        else:
            self.kv_lens -= self.real[:, self.seen:].sum(1, dtype=torch.int32)
            self.real = self.real[:, : self.seen]

    def reset(self) -> None:
        self.seen = 0
        self.real = None
        self.kv_lens.zero_()

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
    kv: Optional[PagedKVCache] = None  # this layer's own paged view, for plain (non-batching) caches
    # What the binding hands the attention function for the call in progress: the paged batch,
    # the transient pages of a forward without a cache, or None (the module's own attention).
    pending: Any = None


def _call_shape(forward: Callable[..., Any]) -> tuple[tuple[str, ...], str, bool]:
    unwrapped = inspect.unwrap(forward)
    params = list(inspect.signature(unwrapped).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = {p.name for p in params}
    cache_name = next((name for name in _CACHE_NAMES if name in names), "past_key_values")
    try:
        passes_window = "sliding_window=" in inspect.getsource(unwrapped)
    except (OSError, TypeError):
        passes_window = False
    return tuple(p.name for p in params if p.kind in kinds), cache_name, passes_window


@functools.lru_cache(maxsize=None)
def _paged_class(layer: type, base: type) -> type:
    return type(f"Paged{base.__name__}", (layer, base), {
        "_hw_agnostic_base": base, "__module__": layer.__module__,
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
    transformers would: in training, while gradients are needed, and while attention weights are
    being recorded (``output_attentions=True``).
    """

    _hw_agnostic_base: type

    @classmethod
    def adopt(cls, module: nn.Module, *, bind_cache: CacheBinding, attention_config: Any,
              block_size: int = 16) -> nn.Module:
        """Make ``module`` a paged attention layer in place (``cls`` resolved through the registry)."""
        if isinstance(module, PagedAttention):
            raise ValueError(f"{type(module).__name__} is paged already")
        layer = resolve("paged_attention")
        base = type(module)
        positional, cache_name, passes_window = _call_shape(base.forward)
        module.__dict__[_STATE] = _PagedState(bind_cache, attention_config, module.config, block_size, positional,
                                              cache_name, passes_window)
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

    @property
    def original_config(self) -> Any:
        return self.__dict__[_STATE].original_config

    def needs_fallback(self, hidden_states: Any) -> bool:
        """Whether this call must run the module's own attention (see the class docstring)."""
        if self.training or recording_attentions():
            return True
        if not torch.is_grad_enabled():
            return False
        return (isinstance(hidden_states, Tensor) and hidden_states.requires_grad) or any(
            p.requires_grad for p in self.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: _PagedState = self.__dict__[_STATE]
        if len(args) > len(state.positional):
            raise TypeError(f"{type(self).__name__}.forward takes {len(state.positional)} positional arguments")
        arguments = dict(zip(state.positional, args))
        arguments.update(kwargs)
        cache = None
        for name in _CACHE_NAMES:
            if name in arguments:
                value = arguments.pop(name)
                cache = value if cache is None else cache
        fallback = self.needs_fallback(arguments.get("hidden_states"))
        state.pending = None
        if cache is None:
            # No cache: the module's cache code must not run, so its K/V reach the attention
            # function directly, which pages them for this one forward.
            if not fallback:
                state.pending = TransientPages(state.block_size, arguments.get("attention_mask"))
        else:
            arguments[state.cache_name] = state.bind_cache(self, cache, arguments.get("attention_mask"), fallback)
        return type(self)._hw_agnostic_base.forward(self, **arguments)

    def extra_repr(self) -> str:
        return f"paged, block_size={self.block_size}"


def recording_attentions() -> bool:
    """Whether transformers is recording attention weights in this forward (``output_attentions=True``)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # an older transformers: it asks the attention function for weights itself
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected
