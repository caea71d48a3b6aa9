"""Transformers integration of paged attention: ``generate()`` and continuous batching on our kernels.

``enable_paged_attention(model)`` makes every Hugging Face self-attention module it recognises
(one that stores K/V through ``cache.update(k, v, layer_idx, ...)`` and dispatches its
attention through ``ALL_ATTENTION_FUNCTIONS``, as Llama, Mistral, Qwen3, Gemma-2, gpt-oss and most
decoder families do) a :class:`~hw_agnostic.layers.attention.PagedAttention` layer (its class is
switched, so it keeps its parameters, names and hooks), and returns the paths it changed. The
module's own projections, norms and rotary embedding keep running; K/V go to a paged cache
through ``write_kv_cache`` and attention runs in ``paged_attention`` with the module's scale,
sliding window, softcap and sinks.

Why the attention module is swapped (and the cache owned per layer) rather than only an
attention function registered: transformers gives an attention function K/V that the cache has
already concatenated (``DynamicCache``) or gathered from its pages (continuous batching with
SDPA/eager), so a function alone can only re-page what was just gathered. The swapped module
receives the cache object itself, so K/V are written once, into pages, and block tables reach the
kernel:

* ``generate()`` (any transformers ``Cache``, e.g. the ``DynamicCache`` generate creates): on
  the first write to an empty plain K/V slot of a cache (at the ``layer_idx`` the module passes to
  ``update``), a paged view, a :class:`PagedCacheLayer`, takes the slot, so the cache's
  bookkeeping (sequence length, mask sizes, beam reordering, ``batch_select_indices``, ``crop``)
  goes through the pages. Padding from the attention mask is skipped on write and masked by
  construction (see :mod:`hw_agnostic.layers.attention`). Sliding-window layers keep all their
  tokens (the kernel only visits the window). A slot that also holds other state (a hybrid
  model's conv/SSM state), or was filled without paged attention, keeps transformers' cache code
  and the module's own attention for that cache.
* calls the kernels cannot serve (training, gradients, ``output_attentions=True``) write the pages
  and run the module's own attention over every position's K/V read back from them.
* continuous batching (``generate_batch``, ``init_continuous_batching``): the layer receives
  transformers' ``PagedAttentionCache`` and uses *its* storage. For full-attention layers the
  cache's page views are exactly ``[num_pages, page_size, kv_heads, head_dim]``, its write indices
  are slots, and the block table is recovered per forward from its read indices with one small
  gather of ints (``ceil(max_len / page)`` entries per sequence); K/V are never gathered.
  Sliding-window layers of that cache are ring buffers: a decode-only step writes its tokens and
  reads each window where the ring holds it; a prefill chunk overwrites keys it still needs, so
  steps with longer queries read the window through the cache's own index path (a copy of at
  most ``window - 1 + chunk`` tokens per sequence) and attend with our kernel over it.
* no cache (``use_cache=False``): the module's cache code does not run (as in transformers); the
  attention function pages the K/V it receives for that one forward.

Modules that write the cache but compute attention in their own code (``bmm`` / ``matmul`` and
``softmax``, or their own SDPA call) are served by interpreting that code onto the same kernel:
:mod:`hw_agnostic.backend.attention_own_code`.

The model's own ``config._attn_implementation`` is left alone (continuous batching accepts only
``sdpa``/``eager``/flash there); each swapped module dispatches from a copy of the config naming
the ``hw_agnostic_paged`` attention function, which is also registered in ``AttentionInterface``
(called without a paged batch, e.g. in training mode, it runs the model's original attention).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..layers.attention import (
    _STATE, PagedAttention, PagedBatch, PagedKVCache, StepShare, TransientPages, attend,
)
from ..layers.base import resolve
from ..ops import checks
from ..ops.write_kv_cache import write_kv_cache
from .changes import Change
from .kv_flow import kv_flow

log = logging.getLogger(__name__)

ATTENTION_NAME = "hw_agnostic_paged"
_FALLBACK_ATTRIBUTE = "_hw_agnostic_fallback_attention"
_KV_HEADS_ATTRIBUTE = "_hw_agnostic_kv_heads"  # how the module expands the stored K/V heads (see kv_flow)


# --------------------------------------------------------------------------------------------
# the attention function


def paged_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` function: ``paged_attention`` over the batch a binding stored."""
    state = module.__dict__.get(_STATE)
    batch: Optional[PagedBatch | TransientPages] = None
    if state is not None:
        batch = state.take()
    if isinstance(batch, TransientPages):
        batch = batch.page(key, value, real_tokens(batch.attention_mask, key.shape[2]))
    if batch is None:
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return attend_paged(module, state, batch, query, key, value, attention_mask, scaling, dropout, kwargs)


def attend_paged(module: nn.Module, state: Any, batch: PagedBatch, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], scaling: Optional[float], dropout: float,
                 kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    """The attention function's work once the step is in the pages: ``paged_attention`` over ``batch``
    (the module's own attention for a mask the kernel does not read)."""
    if attention_mask is None and _sees_lost_padding(None, batch.store, query.shape[2]):
        raise _refuse_lost_padding(module, batch.store, query.shape[2])
    why = _mask_refusal(batch, attention_mask, query.shape[2], kwargs.get("sliding_window"))
    if why is not None:
        return _own_attention_instead(module, state, batch, why, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    order = None
    if key is not batch.key_states or value is not batch.value_states:
        order = _expanded_heads(module, query, key, value, batch)
    sinks = kwargs.get("s_aux")
    if order is not None:  # tiled K/V heads: query heads regrouped by the stored head they read
        query = query[:, order.forward]
        sinks = None if sinks is None else sinks[order.forward]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(query, batch, scale=scale, sliding_window=kwargs.get("sliding_window"),
                 softcap=kwargs.get("softcap"), sinks=sinks)
    if order is not None:
        out = out[:, :, order.inverse]
    return out, None


class KVChangedError(NotImplementedError):
    """An attention module computes with K/V other than the ones it stored in the cache."""


class UnservableMask(NotImplementedError):
    """A module's attention mask is not the kernel's causal one (ALiBi or another bias folded in,
    a bidirectional prefix): ``paged_attention`` would not compute what the module computes."""


#: an additive mask entry at or below this hides its key (exp underflows to 0 in every float dtype)
HIDDEN = -1.0e4
_STRICTNESS = "_hw_agnostic_strictness"  # the module's StrictUntilReleased holder, while verification runs


@dataclasses.dataclass(eq=False)
class Strictness:
    """True while verification may still undo a change: a call the kernel cannot serve raises, so
    the change is undone and the reason reported. Released, the module runs its own attention."""

    strict: bool = True


@dataclasses.dataclass(eq=False)
class StrictUntilReleased(Change):
    """An attention change that is strict until released (verification is over), then lenient."""

    holder: Any = None  # anything with a ``strict`` attribute

    def release(self) -> None:
        super().release()
        if self.holder is not None:
            self.holder.strict = False


def _mask_refusal(batch: PagedBatch, mask: Any, q_len: int, window: Optional[int]) -> Optional[str]:
    """Why the 4-D ``mask`` a plain cache's step (or a forward without a cache) gives the attention
    function is not the kernel's causal, padding-hiding (windowed) mask; None when it is.

    Checked once per step, mask and window for all the layers of a model (a host sync). Not while
    a graph is traced or captured: the eager calls verification makes have checked the model's masks.
    """
    store = batch.store
    if store is None or not isinstance(mask, Tensor) or mask.dim() != 4:
        return None  # continuous batching's own masks, no mask, or a 2-D padding mask read as it is
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    # A static store's counters are its own (each layer's): its step is told apart by the positions seen
    state = ("static", store.positions()) if store.static else (store.real, store.seen)
    agrees = store.share.once(("interface mask", mask, *state, q_len, window),
                              lambda: _is_the_kernels_mask(mask, store, q_len, window), versioned=True)
    if agrees:
        return None
    return ("is given an attention mask that is not causal over its cached tokens (e.g. ALiBi or a relative-position "
            "bias folded in, a bidirectional prefix, or another window than the one it passes), which the paged "
            "kernel does not read")


def _is_the_kernels_mask(mask: Tensor, store: PagedKVCache, q_len: int, window: Optional[int]) -> bool:
    seen, real = store.positions(), store.real
    if store.static:  # its map spans the capacity (an eager step: this check is not made while compiling)
        real = real[:, :seen]
    bias = _over_positions(mask, seen)
    if not bool((bias[..., seen:] <= HIDDEN).all()):  # past the positions seen (a static cache's capacity)
        return False
    return _masks_agree([(bias[..., :seen], 1.0)], real, seen, q_len, store.batch_size, mask.device, window)


def _over_positions(mask: Tensor, seen: int) -> Tensor:
    """The additive ``mask`` with its columns at positions 0, 1, ...: a sliding window's mask may
    span only the last ``seen`` positions (the earlier ones hidden), a static cache's its capacity."""
    bias, width = _additive(mask), mask.shape[-1]
    return torch.nn.functional.pad(bias, (seen - width, 0), value=float("-inf")) if width < seen else bias


def _sees_lost_padding(mask: Optional[Tensor], store: Optional[PagedKVCache], q_len: int) -> bool:
    """Whether a real query of the step (already written to ``store``) sees, under ``mask`` (None:
    every key), a position an earlier step wrote as padding: the pages keep no K/V for it. A host sync,
    made only where the step cannot take the kernel or was given no mask over a cache with padding."""
    if store is None or store.real is None or torch.compiler.is_compiling() or (
            store.real.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    seen = store.positions()
    past = seen - q_len
    real = store.real[:, :seen]
    lost = ~real[:, :past]  # [B, past]
    if not bool(lost.any()):
        return False
    visible = True if mask is None else _over_positions(mask, seen)[..., :past] > HIDDEN  # [B, H, q, past]
    return bool((lost[:, None, None, :] & real[:, None, past:, None] & visible).any())


def _refuse_lost_padding(module: nn.Module, store: PagedKVCache, q_len: int) -> ValueError:
    """The error for a step that sees lost padding, once the step this layer wrote is forgotten (the
    layers after it wrote nothing): the cache is as it was before the call."""
    store.crop(q_len)
    return ValueError(
        f"attention_mask: {type(module).__name__} is asked to attend to cached positions that were padding when "
        "their step was written (no mask, or a mask that shows them), and a paged cache keeps no K/V for padding; "
        "pass the mask the cache was written with (its padding hidden), or rewire with attention=False")


def _additive(mask: Tensor) -> Tensor:
    return torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask


def _own_attention_instead(module: nn.Module, state: Any, batch: PagedBatch, why: str, query: Tensor, key: Tensor,
                           value: Tensor, attention_mask: Tensor, **kwargs: Any) -> tuple[Tensor, Any]:
    """The module's own attention over every position's K/V, for a mask the kernel does not read.

    While verification runs this raises (the change is undone, with ``why`` in the report); after
    it, the module runs its own attention from now on (its binding writes every token to the pages,
    since padding cannot be read from such a mask, and reads them back).
    """
    message = f"{type(module).__name__} {why}"
    holder = module.__dict__.get(_STRICTNESS)
    if holder is not None and holder.strict:
        raise UnservableMask(message)
    if key is not batch.key_states or value is not batch.value_states:
        raise UnservableMask(f"{message}; it also changes K/V after storing them, so its own attention cannot be "
                             "run over the pages either")
    if _sees_lost_padding(attention_mask, batch.store, query.shape[2]):
        raise _refuse_lost_padding(module, batch.store, query.shape[2])
    if state.unservable is None:
        log.warning("hw_agnostic: %s; it runs its own attention over K/V read back from the pages", message)
        state.unservable = message
    store = batch.store
    # the step went to the pages with padding read from this mask: written again, every token kept
    store.crop(key.shape[2])
    store.append(key.transpose(1, 2), value.transpose(1, 2), None)
    keys, values = store.read_with(key, value)
    return _fallback(module)(module, query, keys, values, attention_mask, **kwargs)


@dataclasses.dataclass(frozen=True)
class HeadOrder:
    forward: Tensor  # kernel query head i is the module's query head forward[i]
    inverse: Tensor


def _expanded_heads(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    batch: PagedBatch) -> Optional[HeadOrder]:
    """The attention call got a head expansion of the K/V the module stored (``kv_flow`` found which):
    None when the kernel reads it as it is (grouped-query interleaving), the query head order that
    makes it so for tiled heads; anything else raises :class:`KVChangedError`."""
    expansion = getattr(module.config, _KV_HEADS_ATTRIBUTE, None)
    stored_k, stored_v = batch.key_states, batch.value_states
    assert stored_k is not None and stored_v is not None
    stored, heads = stored_k.shape[1], key.shape[1]
    expanded = (expansion in ("interleave", "tile") and heads % stored == 0 and query.shape[1] % heads == 0
                and key.shape == (stored_k.shape[0], heads, *stored_k.shape[2:])
                and value.shape == (stored_v.shape[0], heads, *stored_v.shape[2:]))
    if not expanded:
        raise KVChangedError(
            f"{type(module).__name__} changes K/V between cache.update and its attention call (e.g. splits or "
            "tiles them); the paged kernel reads the cache, so this module cannot be paged"
        )
    if expansion == "interleave":
        return None
    return _tiled_order(query.shape[1], heads, stored, query.device)


@functools.lru_cache(maxsize=64)
def _tiled_order(query_heads: int, heads: int, stored: int, device: torch.device) -> HeadOrder:
    """Query head ``i`` reads expanded head ``i // (query_heads // heads)``, which ``k.repeat(1, n, 1, 1)``
    filled from stored head ``(that) % stored``; the kernel gives query head ``i`` stored head
    ``i // (query_heads // stored)``. Sorting the query heads by the stored head they read (stably)
    lines the two up."""
    with torch.inference_mode(False):  # cached: normal tensors even when first asked for inside inference_mode
        reads = (torch.arange(query_heads) // (query_heads // heads)) % stored
        forward = torch.argsort(reads, stable=True)
        return HeadOrder(forward.to(device), torch.argsort(forward).to(device))


def _fallback(module: nn.Module) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module.config, _FALLBACK_ATTRIBUTE, "eager")
    own_class = getattr(type(module), "_hw_agnostic_base", type(module))
    eager = getattr(sys.modules[own_class.__module__], "eager_attention_forward", None)
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        if eager is None:
            raise RuntimeError(f"{type(module).__name__}: no paged batch and no eager attention to fall back to")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def register_attention_function() -> None:
    """Register ``hw_agnostic_paged`` in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


# --------------------------------------------------------------------------------------------
# generate(): the layer's paged view inside a transformers Cache


def _cache_layer_base() -> type:
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


def _as_stored(key_states: Tensor, value_states: Tensor, store: Optional[PagedKVCache]) -> tuple[Tensor, Tensor]:
    """K and V in one dtype, the pages': under autocast a step's K leaves the fp32 rotary code and
    its V the 16-bit projection (transformers' cache keeps each as it came; its attention casts both
    back to 16 bits). Only exact casts: a dtype the pages cannot hold exactly is left to the write's
    check, which names it."""
    dtype = key_states.dtype
    if value_states.dtype is dtype and (store is None or store.dtype is dtype):
        return key_states, value_states
    stored = store.dtype if store is not None else torch.promote_types(dtype, value_states.dtype)
    if torch.promote_types(stored, dtype) == stored and torch.promote_types(stored, value_states.dtype) == stored:
        return key_states.to(stored), value_states.to(stored)
    return key_states, value_states


class PagedCacheLayer(_cache_layer_base()):  # type: ignore[misc]
    """A transformers cache layer whose storage is a :class:`PagedKVCache` (one per attention layer).

    Paged attention layers write it through their binding; the cache container reads its length,
    mask sizes and reorders it (beam search) through the methods below. A module that was not
    paged (or a paged one on its fallback path) writes it through :meth:`update`, which appends
    and returns every position's K/V as transformers' own layer would, and ``keys`` / ``values``
    read the pages back in transformers' layout.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, *, is_sliding: bool = False, block_size: int = 16, share: Optional[StepShare] = None,
                 capacity: Optional[int] = None) -> None:
        super().__init__()
        self.is_sliding = is_sliding
        self.block_size = block_size
        # tokens per row of a static store (standing in for a StaticCache layer: see PagedKVCache)
        self.capacity = capacity
        self.is_compileable = capacity is not None
        # one per transformers Cache: its layers compute each step's metadata once (see StepShare)
        self.share = share if share is not None else StepShare()
        self.store: Optional[PagedKVCache] = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def append(self, key_states: Tensor, value_states: Tensor, real: Optional[Tensor],
               rotary: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> PagedBatch:
        """``key_states`` / ``value_states`` in transformers' layout ``[B, Hkv, q, D]``; with ``rotary``
        (``(query, cos, sin)``), the query and keys rotated by the write (see :meth:`PagedKVCache.append_rotating`)."""
        batch_size, heads, _, head_dim = key_states.shape
        key_states, value_states = _as_stored(key_states, value_states, self.store)
        if self.store is None:
            self.store = PagedKVCache(batch_size, heads, head_dim, block_size=self.block_size,
                                      dtype=key_states.dtype, device=key_states.device, share=self.share,
                                      capacity=self.capacity)
        if rotary is None:
            batch = self.store.append(key_states.transpose(1, 2), value_states.transpose(1, 2), real)
            batch.key_states = key_states
        else:
            query, cos, sin = rotary
            batch = self.store.append_rotating(query, key_states, value_states, cos, sin, real)
        batch.value_states = value_states
        return batch

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.append(key_states, value_states, None)
        return self.read_with(key_states, value_states)

    def read_with(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Every position's K/V after a step was appended (see :meth:`PagedKVCache.read_with`)."""
        if self.store is None:
            raise ValueError("this paged cache layer holds nothing yet")
        return self.store.read_with(key_states, value_states)

    def read(self) -> tuple[Tensor, Tensor]:
        """Every position's K/V, ``[B, Hkv, seen, D]`` (zeros at padding, which the mask hides)."""
        if self.store is None:
            raise ValueError("this paged cache layer holds nothing yet")
        return self.store.read()

    @property
    def is_initialized(self) -> bool:
        """Whether the layer holds pages (transformers' invariant: an initialized layer's ``keys`` is a tensor,
        which models read, e.g. Mllama's ``layer.keys.numel()``)."""
        return self.__dict__.get("store") is not None  # (the base class's __init__ asks before there is one)

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        if value != self.is_initialized:  # transformers' base class initialises the attribute to False
            raise AttributeError("a paged cache layer is initialized by its first write (update or append)")

    @property
    def keys(self) -> Optional[Tensor]:
        """Every position's keys, read back from the pages (transformers' ``layer.keys``)."""
        return None if self.store is None else self.store.read()[0]

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:  # transformers' base class initialises the attribute to None
            raise AttributeError("a paged cache layer's keys live in its pages; write them with update()")

    @property
    def values(self) -> Optional[Tensor]:
        """Every position's values, read back from the pages (transformers' ``layer.values``)."""
        return None if self.store is None else self.store.read()[1]

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a paged cache layer's values live in its pages; write them with update()")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.capacity is not None:  # as transformers' static layer: masks span the capacity
            return self.capacity, 0
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> Any:
        """Positions seen: an int, or (static, as transformers' static layers) a 0-d tensor."""
        return 0 if self.store is None else self.store.seen

    def get_max_length(self) -> int:
        return -1 if self.capacity is None else self.capacity

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None and (self.store.static or self.store.seen):
            self.store.select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.store is not None:
            self.store.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self.store.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' convention: 0 keeps all)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove (transformers' convention); "
                             f"got {tokens_to_remove}")
        if self.store is not None and tokens_to_remove < 0:
            self.store.crop(-tokens_to_remove)

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def _masks_agree(biases: list[tuple[Tensor, float]], real: Optional[Tensor], seen: int, q_len: int,
                 batch_size: int, device: torch.device, window: Optional[int] = None) -> bool:
    """Whether the sum of additive ``biases`` (each times its coefficient) is the kernel's mask:
    0 where a query sees a key (causal, within ``window``, not padding), hidden elsewhere."""
    past = seen - q_len
    rows = torch.arange(q_len, device=device)[:, None] + past
    columns = torch.arange(seen, device=device)[None, :]
    visible = columns <= rows
    if window is not None:
        visible = visible & (columns > rows - window)
    allowed = visible[None].expand(batch_size, q_len, seen)  # [B, q, L]
    queries = torch.ones(batch_size, q_len, dtype=torch.bool, device=device)
    if real is not None:
        real = real.to(device)
        allowed = allowed & real[:, None, :]
        queries = real[:, past:]
    total = torch.zeros((), dtype=torch.float32, device=device)
    for bias, coefficient in biases:
        total = total + bias.float() * coefficient
    total = torch.broadcast_to(total, torch.broadcast_shapes(total.shape, (batch_size, 1, q_len, seen)))
    # a real query sees exactly its causal, unpadded keys
    rows_ok = torch.where(allowed[:, None], total == 0, total <= HIDDEN).all(-1)  # [B, H, q]
    # and a query the pages take for padding hides its own position: the padding read on write
    # (from the mask's diagonal) must be the padding of the mask the module applies, not a bias
    # that merely moved the diagonal off zero (ALiBi folded into the mask, say)
    steps = torch.arange(q_len, device=device)
    own_hidden = total[:, :, steps, past + steps] <= HIDDEN  # [B, H, q]
    return bool(torch.where(queries[:, None], rows_ok, own_hidden).all())


def real_tokens(attention_mask: Any, q_len: int, past: Any = 0) -> Optional[Tensor]:
    """``[B, q]`` bool: which of a step's tokens are not padding, read from the mask the model made.

    ``None`` means no padding. ``past`` is the number of positions before the step (a static
    store's 0-d tensor, read on the device). A 4-D mask
    (SDPA's bool or eager's additive float) allows a real query to see itself, so the mask's
    entry for each query's own position marks the real tokens; its columns start at position 0
    (a static cache's mask spans the cache's whole capacity) unless the mask is narrower than the
    positions seen (a sliding window's), when they end at the step's last token. A 2-D padding
    mask is read directly.
    """
    if attention_mask is None or not isinstance(attention_mask, Tensor):
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -q_len:].bool()
    if attention_mask.dim() != 4:
        raise ValueError(
            f"paged attention: cannot read padding from an attention mask of shape {tuple(attention_mask.shape)}"
        )
    last_start = attention_mask.shape[-1] - q_len
    first = past.clamp(max=last_start) if isinstance(past, Tensor) else min(past, last_start)  # static: a tensor
    steps = torch.arange(q_len, device=attention_mask.device)
    diagonal = attention_mask[:, 0, steps, first + steps]
    return diagonal if diagonal.dtype == torch.bool else diagonal == 0


@functools.lru_cache(maxsize=None)
def _pageable_layer_classes() -> tuple[type, ...]:
    """transformers' cache layers that hold plain K/V and nothing else: a paged view may stand in for them."""
    from transformers import cache_utils

    names = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer")
    return tuple(getattr(cache_utils, name) for name in names if hasattr(cache_utils, name))


def _is_static_layer(layer: Any) -> bool:
    from transformers import cache_utils

    return isinstance(layer, cache_utils.StaticLayer)


def paged_layer_of(cache: Any, index: int, block_size: int, windowed: bool = True,
                   static: bool = True) -> Optional[PagedCacheLayer]:
    """The paged view at ``cache.layers[index]``, installed if the slot is an empty plain K/V layer.

    ``None`` when the slot holds something a paged view cannot stand in for: a layer that also
    keeps other state (a hybrid model's conv/SSM state, compression weights), a layer already
    filled without paged attention, a sliding-window layer whose module does not pass the window
    to its attention (``windowed=False``: the window then comes from the cache evicting old
    tokens, which pages do not), or an offloading cache. Such a layer keeps transformers' own cache
    code for its whole life, so each layer of a cache is served consistently.
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        return None
    while len(layers) <= index:
        if getattr(cache, "layer_class_to_replicate", None) is None:
            return None
        layers.append(cache.layer_class_to_replicate())
    current = layers[index]
    if isinstance(current, PagedCacheLayer):
        return current
    if type(current) not in _pageable_layer_classes() or current.get_seq_length() > 0:
        return None
    if getattr(current, "is_sliding", False) and not windowed:
        return None
    capacity = None
    if _is_static_layer(current):
        # Its pages take the static layer's whole capacity at once (what makes a step graphable).
        # A static sliding-window layer keeps a ring of the window; pages do not evict: left as it is.
        if not static or getattr(current, "is_sliding", False):
            return None
        capacity = int(current.max_cache_len)
    share = next((layer.share for layer in layers if isinstance(layer, PagedCacheLayer)), None)
    paged = PagedCacheLayer(is_sliding=bool(getattr(current, "is_sliding", False)), block_size=block_size,
                            share=share, capacity=capacity)
    layers[index] = paged
    return paged


def store_step(state: Any, paged: PagedCacheLayer, key_states: Tensor, value_states: Tensor,
               mask: Any, rotary: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> PagedBatch:
    """Write a step ``[B, Hkv, q, D]`` into ``paged``, its padding read from ``mask`` (``rotary``: see
    :meth:`PagedCacheLayer.append`)."""
    past, q_len = (0 if paged.store is None else paged.store.positions()), key_states.shape[2]
    if state.unservable is not None or mask is None:  # no padding to read; or its masks are not the
        real = None  # kernel's: its own attention, every token kept
    else:
        # the mask is the caller's, who may refill it in place: keyed on its version too
        real = paged.share.once(("real", mask, q_len, past), lambda: real_tokens(mask, q_len, past), versioned=True)
    return paged.append(key_states, value_states, real, rotary)


class _StoreBinding:
    """What a paged module writes through when the cache is a transformers ``Cache`` (or None).

    The cache slot is resolved from the ``layer_idx`` the module passes to ``update`` (a module
    reused at several depths, or a shared block told its index at call time, writes where it says).
    On the paged path the step goes to the pages and the paged batch to the attention function; on
    the fallback path, and for slots a paged view cannot stand in for, ``update`` returns every
    position's K/V and the module's own attention runs.
    """

    def __init__(self, layer: PagedAttention, cache: Any, attention_mask: Any, fallback: bool) -> None:
        self.layer, self.cache, self.attention_mask, self.fallback = layer, cache, attention_mask, fallback

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: Any = None, *args: Any,
               kwargs: Optional[dict] = None, **extra: Any) -> tuple[Tensor, Tensor]:
        own = getattr(self.layer, "layer_idx", None)
        index = own if layer_idx is None else layer_idx
        paged = None if index is None else paged_layer_of(self.cache, int(index), self.layer.block_size,
                                                           self.layer.passes_window, self.layer.takes_static_pages)
        if paged is None:
            if kwargs is not None:
                extra["kwargs"] = kwargs
            return self.cache.update(key_states, value_states, layer_idx, *args, **extra)
        state = self.layer.__dict__[_STATE]
        batch = store_step(state, paged, key_states, value_states, self.attention_mask)
        if index == own:
            state.kv = paged.store
        if self.fallback or state.unservable is not None:
            return paged.read_with(key_states, value_states)
        state.hand(batch)
        return key_states, value_states

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


# --------------------------------------------------------------------------------------------
# continuous batching: transformers' PagedAttentionCache


#: each continuous-batching cache's StepShare: a forward's lengths and block tables, computed once for its layers
_batching_shares: "weakref.WeakKeyDictionary[Any, StepShare]" = weakref.WeakKeyDictionary()


def _batching_share(cache: Any) -> StepShare:
    try:
        share = _batching_shares.get(cache)
        if share is None:
            share = _batching_shares[cache] = StepShare(versioned=True)  # its index buffers may be refilled
        return share
    except TypeError:  # a cache that takes no weak reference: nothing shared
        return StepShare(versioned=True)


class _ContinuousBatchingBinding:
    def __init__(self, layer: PagedAttention, cache: Any, fallback: bool) -> None:
        self.layer, self.cache, self.fallback = layer, cache, fallback

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               kwargs: Optional[dict] = None, **extra: Any) -> tuple[Tensor, Tensor]:
        if self.fallback or kwargs is None:  # the cache's own update: K/V gathered, the module's attention
            return self.cache.update(key_states, value_states, layer_idx, kwargs, *args, **extra)
        allocator = self.cache.layer_to_allocator[layer_idx]
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
        if isinstance(cu_k, dict):
            cu_k, max_k = cu_k[allocator.layer_type], max_k[allocator.layer_type]
        cu_q, max_q = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
        if allocator.supports_block_table:
            share = _batching_share(self.cache)
            cu_k = share.once(("int32", cu_k), lambda: cu_k.to(torch.int32))
            batch = self._paged(share, allocator, layer_idx, key_states, value_states, cu_q, cu_k, max_q, int(max_k),
                                kwargs)
        else:
            batch = None
            if max_q == 1:
                batch = self._window_in_place(allocator, layer_idx, key_states, value_states, cu_q, cu_k, int(max_k),
                                              kwargs)
            if batch is None:
                batch = self._windowed(layer_idx, key_states, value_states, cu_q, max_q, kwargs)
        batch.key_states, batch.value_states = key_states, value_states
        self.layer.__dict__[_STATE].hand(batch)
        return key_states, value_states

    def _paged(self, share: StepShare, allocator: Any, layer_idx: int, key_states: Tensor, value_states: Tensor,
               cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, kwargs: dict) -> PagedBatch:
        """The layers of one forward read the same index tensors: their block table and lengths are
        computed by the first (``share``, keyed on those tensors)."""
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
        write_index = kwargs["write_index"][allocator.index]
        write_kv_cache(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), k_pages, v_pages, write_index)
        tables = kwargs.get("block_table")
        if tables is not None:
            table = tables[allocator.index]
        else:
            read_index, page = kwargs["read_index"][allocator.index], allocator.tokens_per_page
            table = share.once(("table", read_index, write_index, cu_q, cu_k, max_k, page),
                               lambda: _block_table(read_index, write_index, cu_q, cu_k, max_k, page))
        lengths = share.once(("lengths", cu_k), lambda: cu_k[1:] - cu_k[:-1])
        return PagedBatch(k_pages, v_pages, table, cu_q, lengths, max_q, max_k)

    def _window_in_place(self, allocator: Any, layer_idx: int, key_states: Tensor, value_states: Tensor,
                         cu_q: Tensor, cu_k: Tensor, max_k: int, kwargs: dict) -> PagedBatch | None:
        """A decode-only step of a sliding-window layer, read where its ring buffer holds it (None: the
        cache is not the ring buffer this reads, or the step has no cached keys).

        The ring keeps position ``p`` at slot ``p % window``, so a decode step's new token overwrites
        the one that has just left its window: written first, the window is the ring's own slots,
        one-token blocks read through a table of the cache's read indices (the new token's sentinel
        replaced by its write index), instead of ``index_select`` copying every sequence's window
        out. A step with longer queries reads through :meth:`_windowed`: a chunk's later tokens
        overwrite keys its earlier ones still see.
        """
        views, sentinel = getattr(allocator, "_kv_token_views", None), getattr(allocator, "sentinel_index", None)
        reads, writes = kwargs.get("read_index"), kwargs.get("write_index")
        if views is None or sentinel is None or reads is None or writes is None:
            return None
        read_index, write_index = reads[allocator.index], writes[allocator.index]
        if read_index.numel() == 0:
            return None
        k_tokens, v_tokens = views[layer_idx]  # [slots, Hkv, D], shifted views of one buffer
        slots_in_both = min(k_tokens.shape[0], v_tokens.shape[0])  # every index the cache hands out
        k_pages, v_pages = k_tokens[:slots_in_both, None], v_tokens[:slots_in_both, None]  # one-token blocks
        write_kv_cache(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), k_pages, v_pages, write_index)
        slots = read_index.masked_scatter(read_index == sentinel, write_index)
        cu_k = cu_k.to(torch.int32)
        table = slots[_token_rows(cu_k, max(max_k, 1), slots.numel())].to(torch.int32)
        return PagedBatch(k_pages, v_pages, table, cu_q, cu_k[1:] - cu_k[:-1], 1, max_k)

    def _windowed(self, layer_idx: int, key_states: Tensor, value_states: Tensor, cu_q: Tensor, max_q: int,
                  kwargs: dict) -> PagedBatch:
        keys, values = self.cache.update(key_states, value_states, layer_idx, kwargs)
        cu_k, max_k = kwargs["cu_seq_lens_k"].to(torch.int32), int(kwargs["max_length_k"])
        k_cache, v_cache = _one_token_blocks(keys), _one_token_blocks(values)
        table = _token_rows(cu_k, max(max_k, 1), max(k_cache.shape[0], 1))
        return PagedBatch(k_cache, v_cache, table, cu_q, cu_k[1:] - cu_k[:-1], max_q, max_k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def _block_table(read_index: Tensor, write_index: Tensor, cu_q: Tensor, cu_k: Tensor, max_k: int, page: int) -> Tensor:
    """Each sequence's pages, read off the cache's per-token indices: token ``j`` of a sequence sits at
    row ``index[start + j]`` of the page view, so its page is that row ``// page``. The read indices
    cover every token of every sequence; a batch without reads (fresh prompts only) has written
    all of its tokens this step."""
    source, starts = (read_index, cu_k) if read_index.numel() else (write_index, cu_q)
    width = max(-(-max_k // page), 1)
    if source.numel() == 0:
        return torch.zeros(starts.shape[0] - 1, width, dtype=torch.int32, device=starts.device)
    return (source[_token_rows(starts.long(), width, source.numel(), page)] // page).to(torch.int32)


def _token_rows(starts: Tensor, width: int, rows: int, step: int = 1) -> Tensor:
    """``[seqs, width]``: ``starts[s] + j * step`` for sequence ``s`` (``starts``: each sequence's first
    row, and the end past the last) and column ``j``, clamped below ``rows``: where a sequence's
    tokens sit in a flat buffer of ``rows`` rows."""
    columns = torch.arange(0, width * step, step, device=starts.device, dtype=starts.dtype)
    return (starts[:-1, None] + columns).clamp_(max=rows - 1)


def _one_token_blocks(states: Tensor) -> Tensor:
    """``[1, Hkv, N, D]`` K or V as a paged cache of N one-token blocks ``[N, 1, Hkv, D]`` (a view)."""
    rows = states[0].transpose(0, 1)
    return rows.as_strided((rows.shape[0], 1, rows.shape[1], rows.shape[2]),
                           (rows.stride(0), rows.stride(0), rows.stride(1), rows.stride(2)))


# --------------------------------------------------------------------------------------------
# binding and enabling


@functools.lru_cache(maxsize=None)
def _cache_classes() -> tuple[type, type, type]:
    from transformers.cache_utils import Cache, EncoderDecoderCache
    from transformers.generation.continuous_batching import PagedAttentionCache

    return Cache, EncoderDecoderCache, PagedAttentionCache


def bind_cache(layer: PagedAttention, cache: Any, attention_mask: Any, fallback: bool) -> Any:
    """The object the module writes K/V through, for the cache its forward received (None: none)."""
    Cache, EncoderDecoderCache, PagedAttentionCache = _cache_classes()
    if isinstance(cache, PagedAttentionCache):
        return _ContinuousBatchingBinding(layer, cache, fallback)
    if isinstance(cache, EncoderDecoderCache):  # a decoder's self-attention writes only its own half
        cache = cache.self_attention_cache
    if isinstance(cache, Cache):
        return _StoreBinding(layer, cache, attention_mask, fallback)
    raise TypeError(f"paged attention: unsupported cache object {type(cache).__name__} (expected a transformers Cache)")


def attention_refusal(module: nn.Module) -> str | None:
    """Why ``module`` is not a self-attention module paged attention can serve (None: it is one).

    Served: a module with a config whose forward writes K/V through ``cache.update(...)`` and
    dispatches its attention through ``ALL_ATTENTION_FUNCTIONS`` (the batch reaches the attention
    function through the module, so ``update`` may be called with or without ``kwargs``).
    ``NOT_ATTENTION`` marks modules that are no attention at all (not worth a report line).
    """
    if isinstance(module, PagedAttention) or not isinstance(module, nn.Module):
        return NOT_ATTENTION
    source = _forward_source(type(module))
    if source is None:
        return NOT_ATTENTION
    dispatches, writes = "ALL_ATTENTION_FUNCTIONS" in source, _WRITES_KV.search(source) is not None
    if not dispatches and not writes or not any(True for _ in module.parameters()):
        return NOT_ATTENTION
    if not dispatches:
        return OWN_CODE
    if not writes:
        return "dispatches attention but never writes a KV cache (an encoder, or a vision/audio tower)"
    if not hasattr(module, "config"):
        return "has no config to dispatch its attention from"
    if not getattr(module, "is_causal", True):
        return "not causal (bidirectional or cross-attention)"
    key_dim, value_dim = getattr(module, "qk_head_dim", None), getattr(module, "v_head_dim", None)
    if getattr(module, "kv_lora_rank", None) or (key_dim is not None and value_dim is not None and key_dim != value_dim):
        return "latent attention (low-rank K/V with their own head layout, as DeepSeek's MLA)"
    return kv_flow(type(module)).refusal


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    """The source of ``cls.forward`` (None: none to read). Asked of every module of a model, a class
    at a time: reading it took 0.4 of a 32-layer model's 1.1 s rewire before it was kept."""
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None


NOT_ATTENTION = "not an attention module"
#: served by :mod:`hw_agnostic.backend.attention_own_code` where its attention code is recognised
OWN_CODE = "writes the cache but computes attention in its own code (not through ALL_ATTENTION_FUNCTIONS)"
#: ``cache.update(k, v, <...>layer_idx, ...)``: a forward that writes K/V into a cache layer
_WRITES_KV = re.compile(r"\.update\(\s*[\w.\[\]]+\s*,\s*[\w.\[\]]+\s*,\s*[\w.]*(layer_idx|idx)")


def looks_like_attention(module: nn.Module) -> bool:
    return attention_refusal(module) is None


def paging_changes(model: nn.Module, *, block_size: int = 16) -> tuple[list[Change], list[tuple[str, nn.Module, str]]]:
    """Make every servable self-attention module of ``model`` paged, in place.

    Returns the changes (applied) and the attention-like modules left, ``(path, module, reason)``.
    """
    from .attention_direct import direct_path_for

    checks.integer("paged attention", "block_size", block_size, minimum=1)
    register_attention_function()
    layer_class = resolve("paged_attention")
    changes: list[Change] = []
    left: list[tuple[str, nn.Module, str]] = []
    unnamed: list[tuple[str, nn.Module]] = []  # modules called attention that are none of the above
    for path, module in list(model.named_modules()):
        if not path:
            continue
        reason = attention_refusal(module)
        if reason == OWN_CODE:  # its own attention code may still be interpreted onto the kernel
            from .attention_own_code import own_code_change, own_code_refusal

            reason = own_code_refusal(path, module)
            if reason is None:
                changes.append(own_code_change(path, module, block_size))
                continue
        if reason is not None:
            if reason != NOT_ATTENTION:
                left.append((path, module, reason))
            elif type(module).__name__.lower().endswith("attention") and any(True for _ in module.parameters()):
                unnamed.append((path, module))
            continue
        config = copy.copy(module.config)
        setattr(config, _FALLBACK_ATTRIBUTE, module.config._attn_implementation)
        setattr(config, _KV_HEADS_ATTRIBUTE, kv_flow(type(module)).expansion)
        config._attn_implementation_internal = ATTENTION_NAME
        original = type(module).__name__

        strictness = Strictness()
        direct = direct_path_for(type(module))

        def apply(module: nn.Module = module, config: Any = config, strictness: Strictness = strictness,
                  direct: Any = direct) -> None:
            layer_class.adopt(module, bind_cache=bind_cache, attention_config=config, block_size=block_size,
                              direct=direct)
            module.__dict__[_STRICTNESS] = strictness

        def undo(module: nn.Module = module) -> None:
            module.__dict__.pop(_STRICTNESS, None)
            PagedAttention.release(module)

        apply()
        changes.append(StrictUntilReleased("attention", path, original, layer_class.__name__,
                                           "K/V in a paged cache: write_kv_cache + paged_attention"
                                           + ("; its forward recognised: its calls made directly" if direct else ""),
                                           apply, undo,
                                           holder=strictness))
    if changes:
        _install_pages_first(model)
    covered = [p for p, _, _ in left] + [c.path for c in changes]
    for path, module in unnamed:  # the report explains them, unless they wrap one explained already
        if not any(p.startswith(path + ".") for p in covered):
            left.append((path, module, "no softmax attention over a KV cache written with cache.update "
                                       "(linear or recurrent attention, or attention with its own cache)"))
    return changes, left


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
#: per hooked module: the caches whose slots its hook paged already, with their layer count then
#: (the hook runs before every forward, a decode step's too: looking at every slot again costs per layer)
_paged_caches: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakKeyDictionary[Any, int]]" = weakref.WeakKeyDictionary()


def _install_pages_first(model: nn.Module) -> None:
    """Before a forward that receives a cache, put the paged views into the slots paged modules own.

    transformers builds the attention masks (and reads padding into them) from the cache's layers
    before any attention module runs, so the slots must already be paged when it does: a static
    cache's masks, for one, span its whole capacity, which a paged view does not. The hook goes on
    every ancestor of a paged module whose forward takes a cache (the model and its base model),
    but not on the blocks of a layer stack (members of a ``ModuleList`` / ``ModuleDict``): they
    build no masks, their attention pages its slot when it writes, and a hook would cost every
    block call of every step PyTorch's slow call path.

    The hook is one module-level function that finds the paged modules under the module it runs
    on: a ``copy.deepcopy`` of the model (whose hooks are the same function) pages its own
    modules, holds no reference to the original's, and :func:`disable_paged_attention` finds it.
    """
    paths = [path for path, m in model.named_modules() if isinstance(m, PagedAttention)]
    ancestors = {""} | {path.rsplit(".", depth)[0] for path in paths for depth in range(1, path.count(".") + 1)}
    stacks = (nn.ModuleList, nn.ModuleDict)
    for path in sorted(ancestors):
        module = model.get_submodule(path)
        if _page_slots_first in module._forward_pre_hooks.values():
            continue
        parent = model.get_submodule(path.rpartition(".")[0]) if path else None
        if isinstance(parent, stacks):
            continue
        try:
            names = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        if any(name in names for name in _CACHE_ARGUMENTS):
            module.register_forward_pre_hook(_page_slots_first, with_kwargs=True)


def _page_slots_first(module: nn.Module, args: tuple, kwargs: dict) -> None:
    cache = next((kwargs[n] for n in _CACHE_ARGUMENTS if kwargs.get(n) is not None), None)
    if not isinstance(cache, _cache_classes()[0]):
        return
    if torch.compiler.is_compiling():  # traced once: no bookkeeping for the graph's guards to read
        if not _every_slot_paged(cache):
            _page_slots(module, cache)
        return
    done = _paged_caches.get(module)
    if done is None:
        done = _paged_caches[module] = weakref.WeakKeyDictionary()
    layers = getattr(cache, "layers", None)
    count = len(layers) if isinstance(layers, list) else -1
    try:
        if done.get(cache) == count:
            return
    except TypeError:  # a cache that takes no weak reference: look every time
        pass
    _page_slots(module, cache)
    layers = getattr(cache, "layers", None)
    try:
        done[cache] = len(layers) if isinstance(layers, list) else -1
    except TypeError:
        pass


def _every_slot_paged(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a paged view already (a step after the prefill paged them),
    so :func:`_page_slots` would change nothing. A compiled step checks this instead of walking the
    modules: the walk reads every module's children and attributes, each read a guard the compiled
    step evaluates on every call (at 6 layers, two hooked ancestors: about 2.5x HF's guards a layer)."""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and bool(layers) and all(isinstance(layer, PagedCacheLayer) for layer in layers)


def _page_slots(module: nn.Module, cache: Any) -> None:
    for layer in module.modules():
        index = getattr(layer, "layer_idx", None)
        if isinstance(layer, PagedAttention) and isinstance(index, int):
            paged_layer_of(cache, index, layer.block_size, layer.passes_window, layer.takes_static_pages)


def _remove_pages_first(module: nn.Module) -> None:
    """Remove :func:`_page_slots_first` from ``module``'s hooks (what its handle's ``remove`` does)."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook is _page_slots_first:
            del module._forward_pre_hooks[hook_id]
            module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    _paged_caches.pop(module, None)


def enable_paged_attention(model: nn.Module, *, block_size: int = 16) -> list[str]:
    """Swap every recognised self-attention module of ``model`` for a paged attention layer, in place.

    Returns the paths of the modules replaced (already swapped ones are skipped, so calling it again
    is harmless). ``block_size`` is the page size of the caches the layers allocate for
    ``generate()``; continuous batching uses its own cache's page size. ``rewire`` does this and
    verifies the result; called alone, nothing is verified.
    """
    changes, _ = paging_changes(model, block_size=block_size)
    for change in changes:
        change.release()
    return [change.path for change in changes]


def disable_paged_attention(model: nn.Module) -> list[str]:
    """Undo :func:`enable_paged_attention`: the modules' own classes (and configs) again."""
    restored = []
    for path, module in list(model.named_modules()):
        if isinstance(module, PagedAttention):
            getattr(type(module), "_hw_agnostic_release", PagedAttention.release)(module)
            restored.append(path)
        _remove_pages_first(module)
    return restored
