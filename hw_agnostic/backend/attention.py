"""Transformers integration of paged attention: ``generate()`` and continuous batching on our kernels.

``enable_paged_attention(model)`` replaces every Hugging Face self-attention module it recognises
(one that stores K/V through ``cache.update(k, v, layer_idx, kwargs=...)`` and dispatches its
attention through ``ALL_ATTENTION_FUNCTIONS``, as Llama, Mistral, Qwen3, Gemma-2, gpt-oss and most
decoder families do) by a :class:`~hw_agnostic.layers.attention.PagedAttention` layer, and
returns the paths it replaced. The module's own projections, norms and rotary embedding keep
running; K/V go to a paged cache through ``write_kv_cache`` and attention runs in
``paged_attention`` with the module's scale, sliding window, softcap and sinks.

Why the attention module is swapped (and the cache owned per layer) rather than only an
attention function registered: transformers gives an attention function K/V that the cache has
already concatenated (``DynamicCache``) or gathered from its pages (continuous batching with
SDPA/eager), so a function alone can only re-page what was just gathered. The swapped module
receives the cache object itself, so K/V are written once, into pages, and block tables reach the
kernel:

* ``generate()`` (any transformers ``Cache``, e.g. the ``DynamicCache`` generate creates): on
  its first call for a cache, each layer installs its own paged view, a :class:`PagedCacheLayer`,
  at its index in the cache, so the cache's bookkeeping (sequence length, mask sizes, beam
  reordering, ``batch_select_indices``) goes through the pages. Padding from the attention mask
  is skipped on write and masked by construction (see :mod:`hw_agnostic.layers.attention`).
  Sliding-window layers keep all their tokens (the kernel only visits the window).
* continuous batching (``generate_batch``, ``init_continuous_batching``): the layer receives
  transformers' ``PagedAttentionCache`` and uses *its* storage. For full-attention layers the
  cache's page views are exactly ``[num_pages, page_size, kv_heads, head_dim]``, its write indices
  are slots, and the block table is recovered per forward from its read indices with one small
  gather of ints (``ceil(max_len / page)`` entries per sequence); K/V are never gathered.
  Sliding-window layers of that cache are ring buffers that a prefill chunk overwrites while it
  still needs them, so those layers read their window through the cache's own index path
  (at most ``window - 1 + chunk`` tokens per sequence) and attend with our kernel over it.
* no cache (``use_cache=False``): a paged view for the one forward.

The model's own ``config._attn_implementation`` is left alone (continuous batching accepts only
``sdpa``/``eager``/flash there); each swapped module dispatches from a copy of the config naming
the ``hw_agnostic_paged`` attention function, which is also registered in ``AttentionInterface``
(called without a paged batch, e.g. in training mode, it runs the model's original attention).
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..layers.attention import PAGED_BATCH_KWARG, PagedAttention, PagedBatch, PagedKVCache, attend
from ..layers.base import resolve
from ..ops.write_kv_cache import write_kv_cache

ATTENTION_NAME = "hw_agnostic_paged"
_FALLBACK_ATTRIBUTE = "_hw_agnostic_fallback_attention"
_NO_KWARGS = "paged attention: the attention module must pass its kwargs to cache.update(..., kwargs=kwargs)"


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
    batch: Optional[PagedBatch] = kwargs.pop(PAGED_BATCH_KWARG, None)
    if batch is None:
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(query, batch, scale=scale, sliding_window=kwargs.get("sliding_window"),
                 softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return out, None


def _fallback(module: nn.Module) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module.config, _FALLBACK_ATTRIBUTE, "eager")
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
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


class PagedCacheLayer(_cache_layer_base()):  # type: ignore[misc]
    """A transformers cache layer whose storage is a :class:`PagedKVCache` (one per attention layer).

    Only paged attention layers write it; the cache container reads its length, mask sizes and
    reorders it (beam search) through the methods below.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, *, is_sliding: bool = False, block_size: int = 16) -> None:
        super().__init__()
        self.is_sliding = is_sliding
        self.block_size = block_size
        self.store: Optional[PagedKVCache] = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def append(self, key_states: Tensor, value_states: Tensor, real: Optional[Tensor]) -> PagedBatch:
        """``key_states`` / ``value_states`` in transformers' layout ``[B, Hkv, q, D]``."""
        batch_size, heads, _, head_dim = key_states.shape
        if self.store is None:
            self.store = PagedKVCache(batch_size, heads, head_dim, block_size=self.block_size,
                                      dtype=key_states.dtype, device=key_states.device)
        return self.store.append(key_states.transpose(1, 2), value_states.transpose(1, 2), real)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise RuntimeError(
            "this cache layer is paged and written by hw_agnostic's PagedAttention layer; a module that "
            "was not swapped by enable_paged_attention() tried to update it"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.store is None else self.store.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None and self.store.seen:
            self.store.select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.store is not None:
            self.store.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            self.store.repeat_interleave(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove (transformers' convention)")
        if self.store is not None:
            self.store.crop(-tokens_to_remove)

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def real_tokens(attention_mask: Any, q_len: int) -> Optional[Tensor]:
    """``[B, q]`` bool: which of a step's tokens are not padding, read from the mask the model made.

    ``None`` means no padding. A 4-D mask (SDPA's bool or eager's additive float) allows a real
    query to see itself, so its diagonal over the step's (last) key columns marks the real
    tokens; a 2-D padding mask is read directly.
    """
    if attention_mask is None or not isinstance(attention_mask, Tensor):
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -q_len:].bool()
    if attention_mask.dim() != 4:
        raise ValueError(
            f"paged attention: cannot read padding from an attention mask of shape {tuple(attention_mask.shape)}"
        )
    steps = torch.arange(q_len, device=attention_mask.device)
    diagonal = attention_mask[:, 0, steps, attention_mask.shape[-1] - q_len + steps]
    return diagonal if diagonal.dtype == torch.bool else diagonal == 0


class _StoreBinding:
    """What the wrapped module writes through when the cache is a transformers ``Cache`` (or None)."""

    def __init__(self, cache: Any, layer: PagedCacheLayer, attention_mask: Any) -> None:
        self.cache, self.layer, self.attention_mask = cache, layer, attention_mask

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               kwargs: Optional[dict] = None, **extra: Any) -> tuple[Tensor, Tensor]:
        if kwargs is None:
            raise TypeError(_NO_KWARGS)
        real = real_tokens(self.attention_mask, key_states.shape[2])
        kwargs[PAGED_BATCH_KWARG] = self.layer.append(key_states, value_states, real)
        return key_states, value_states

    def __getattr__(self, name: str) -> Any:
        if self.cache is None:
            raise AttributeError(name)
        return getattr(self.cache, name)


def _paged_layer_of(cache: Any, layer: PagedAttention) -> PagedCacheLayer:
    index = layer.layer_idx
    if index is None:
        raise ValueError(f"{type(layer.wrapped).__name__} has no layer_idx; it cannot share a transformers cache")
    while len(cache.layers) <= index:
        if getattr(cache, "layer_class_to_replicate", None) is None:
            raise ValueError(f"the cache has {len(cache.layers)} layers; layer {index} has no slot in it")
        cache.layers.append(cache.layer_class_to_replicate())
    current = cache.layers[index]
    if isinstance(current, PagedCacheLayer):
        return current
    if current.get_seq_length() > 0:
        raise ValueError(
            f"layer {index} of the cache already holds {current.get_seq_length()} tokens written without paged "
            "attention; start generation from an empty cache"
        )
    paged = PagedCacheLayer(is_sliding=bool(getattr(current, "is_sliding", False)), block_size=layer.block_size)
    cache.layers[index] = paged
    return paged


# --------------------------------------------------------------------------------------------
# continuous batching: transformers' PagedAttentionCache


class _ContinuousBatchingBinding:
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               kwargs: Optional[dict] = None, **extra: Any) -> tuple[Tensor, Tensor]:
        if kwargs is None:
            raise TypeError(_NO_KWARGS)
        allocator = self.cache.layer_to_allocator[layer_idx]
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
        if isinstance(cu_k, dict):
            cu_k, max_k = cu_k[allocator.layer_type], max_k[allocator.layer_type]
        cu_q, max_q = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
        if allocator.supports_block_table:
            batch = self._paged(allocator, layer_idx, key_states, value_states, cu_q, cu_k.to(torch.int32), max_q,
                                int(max_k), kwargs)
        else:
            batch = self._windowed(layer_idx, key_states, value_states, cu_q, max_q, kwargs)
        kwargs[PAGED_BATCH_KWARG] = batch
        return key_states, value_states

    def _paged(self, allocator: Any, layer_idx: int, key_states: Tensor, value_states: Tensor, cu_q: Tensor,
               cu_k: Tensor, max_q: int, max_k: int, kwargs: dict) -> PagedBatch:
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
        write_kv_cache(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), k_pages, v_pages,
                       kwargs["write_index"][allocator.index])
        tables = kwargs.get("block_table")
        if tables is not None:
            table = tables[allocator.index]
        else:
            table = _block_table(kwargs["read_index"][allocator.index], kwargs["write_index"][allocator.index],
                                 cu_q, cu_k, max_k, allocator.tokens_per_page)
        return PagedBatch(k_pages, v_pages, table, cu_q, cu_k[1:] - cu_k[:-1], max_q, max_k)

    def _windowed(self, layer_idx: int, key_states: Tensor, value_states: Tensor, cu_q: Tensor, max_q: int,
                  kwargs: dict) -> PagedBatch:
        keys, values = self.cache.update(key_states, value_states, layer_idx, kwargs)
        cu_k, max_k = kwargs["cu_seq_lens_k"].to(torch.int32), int(kwargs["max_length_k"])
        k_cache, v_cache = _one_token_blocks(keys), _one_token_blocks(values)
        columns = torch.arange(max(max_k, 1), device=cu_k.device, dtype=torch.int32)
        table = (cu_k[:-1, None] + columns).clamp_(max=max(k_cache.shape[0] - 1, 0))
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
    index = starts[:-1, None].long() + torch.arange(width, device=starts.device) * page
    return (source[index.clamp_(max=source.numel() - 1)] // page).to(torch.int32)


def _one_token_blocks(states: Tensor) -> Tensor:
    """``[1, Hkv, N, D]`` K or V as a paged cache of N one-token blocks ``[N, 1, Hkv, D]`` (a view)."""
    rows = states[0].transpose(0, 1)
    return rows.as_strided((rows.shape[0], 1, rows.shape[1], rows.shape[2]),
                           (rows.stride(0), rows.stride(0), rows.stride(1), rows.stride(2)))


# --------------------------------------------------------------------------------------------
# binding and enabling


def bind_cache(layer: PagedAttention, cache: Any, attention_mask: Any, arguments: dict) -> Any:
    """The object the wrapped module writes K/V through, for the cache its forward received."""
    from transformers.cache_utils import Cache
    from transformers.generation.continuous_batching import PagedAttentionCache

    if isinstance(cache, PagedAttentionCache):
        return _ContinuousBatchingBinding(cache)
    if cache is None:
        return _StoreBinding(None, PagedCacheLayer(block_size=layer.block_size), attention_mask)
    if isinstance(cache, Cache):
        paged = _paged_layer_of(cache, layer)
        binding = _StoreBinding(cache, paged, attention_mask)
        layer.kv = paged.store
        return binding
    raise TypeError(f"paged attention: unsupported cache object {type(cache).__name__} (expected a transformers Cache)")


def looks_like_attention(module: nn.Module) -> bool:
    """An HF self-attention module: a layer index, and a forward that writes K/V through
    ``cache.update(..., kwargs=...)`` and dispatches through ``ALL_ATTENTION_FUNCTIONS``."""
    if isinstance(module, PagedAttention) or not hasattr(module, "layer_idx") or not hasattr(module, "config"):
        return False
    if not getattr(module, "is_causal", True):
        return False
    key_dim, value_dim = getattr(module, "qk_head_dim", None), getattr(module, "v_head_dim", None)
    if getattr(module, "kv_lora_rank", None) or (key_dim is not None and value_dim is not None and key_dim != value_dim):
        return False  # latent attention (DeepSeek's MLA): low-rank K/V with their own head layout
    try:
        source = inspect.getsource(inspect.unwrap(type(module).forward))
    except (OSError, TypeError):
        return False
    return ".update(" in source and "kwargs=kwargs" in source and "ALL_ATTENTION_FUNCTIONS" in source


def enable_paged_attention(model: nn.Module, *, block_size: int = 16) -> list[str]:
    """Swap every recognised self-attention module of ``model`` for a paged attention layer, in place.

    Returns the paths of the modules replaced (already swapped ones are skipped, so calling it again
    is harmless). ``block_size`` is the page size of the caches the layers allocate for
    ``generate()``; continuous batching uses its own cache's page size.
    """
    register_attention_function()
    layer_class = resolve("paged_attention")
    replaced = []
    for path, module in list(model.named_modules()):
        if not path or not looks_like_attention(module):
            continue
        config = copy.copy(module.config)
        setattr(config, _FALLBACK_ATTRIBUTE, module.config._attn_implementation)
        config._attn_implementation_internal = ATTENTION_NAME
        parent_path, _, name = path.rpartition(".")
        layer = layer_class(module, bind_cache=bind_cache, attention_config=config, block_size=block_size)
        setattr(model.get_submodule(parent_path), name, layer)
        replaced.append(path)
    return replaced


def disable_paged_attention(model: nn.Module) -> list[str]:
    """Undo :func:`enable_paged_attention`: put the original modules (and their configs) back."""
    restored = []
    for path, module in list(model.named_modules()):
        if not isinstance(module, PagedAttention):
            continue
        original = module.wrapped
        original.config = module.original_config
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, original)
        restored.append(path)
    return restored
