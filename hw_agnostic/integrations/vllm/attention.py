"""Attention with the KV-cache write on the library's ``write_kv_cache`` and ``paged_attention``.

vLLM's ``Attention`` layer has no out-of-tree hook; its attention *backend* is the override
point. On the CPU platform vLLM always picks ``CPU_ATTN``, so the plugin registers
:class:`HwAgnosticCPUAttentionBackend` under that name (``register_backend`` overrides). It is
vLLM's CPU backend with another implementation: the metadata builder, the KV-cache layout and
the metadata are vLLM's, and they map one to one onto the ops:

==========================  ==========================================================
vLLM                        library
==========================  ==========================================================
per-layer ``kv_cache``      ``k_cache``/``v_cache`` ``[blocks, block_size, kv_heads, D]``
                            (views of vLLM's pages, no copy)
``slot_mapping``            ``write_kv_cache(..., slot_mapping)`` (``-1`` = padding)
``query_start_loc``         ``cu_seqlens_q``
``seq_lens``                ``kv_lens`` (new tokens included)
``block_table``             ``block_table``
``max_query_len/seq_len``   ``max_q_len`` / ``max_kv_len`` hints
``scale``, window, softcap  ``scale``, ``sliding_window`` (keys, itself included), ``softcap``
sinks                       ``sinks``
==========================  ==========================================================

Inside a page the library keeps each head's keys and values as plain ``[block_size, D]`` rows;
vLLM's CPU kernels pack the keys their own way. So a layer uses one or the other for both the
write and the attention: a layer the ops do not cover (encoder or cross attention, ALiBi, a
quantised KV cache) keeps vLLM's CPU kernels for both, and a served layer refuses what it
cannot run (a non-causal batch, fused output quantisation) with an error rather than mixing.
KV-transfer connectors, which move pages in vLLM's CPU layout, are not supported with this
override. On the CPU it is off unless ``HW_AGNOSTIC_VLLM_OVERRIDES=+attention``: the library's
attention there is its reference, far slower than vLLM's C++ kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from . import note_built

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKEND_PATH = f"{__name__}.HwAgnosticCPUAttentionBackend"

try:  # the classes subclass vLLM's; this module is imported only where vLLM is
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
except ImportError as err:  # pragma: no cover - vLLM without the CPU backend
    raise ImportError(f"hw_agnostic's vLLM attention backend needs vLLM's CPU attention backend: {err}") from err


def split_cpu_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-layer CPU cache ``[blocks, kv_heads, block_size, 2 * D]`` as the library's key and
    value caches ``[blocks, block_size, kv_heads, D]``: per (block, head), the first half of the
    page holds the keys and the second the values (as in vLLM's CPU backend, whose key rows are
    packed differently inside that half)."""
    blocks, heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    return key_cache.transpose(1, 2), value_cache.transpose(1, 2)


class HwAgnosticCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.why_not_served = self._why_not_served()
        note_built("attention", self.why_not_served)
        if self.why_not_served is None:
            from hw_agnostic import ops  # noqa: F401  (imported while building, not while running)

    def _why_not_served(self) -> str | None:
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.kv_cache_dtype != "auto":
            return f"KV-cache dtype {self.kv_cache_dtype}"
        return None

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if self.why_not_served is not None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        from hw_agnostic import ops

        k_cache, v_cache = split_cpu_kv_cache(kv_cache)
        tokens = slot_mapping.shape[0]
        ops.write_kv_cache(key[:tokens], value[:tokens], k_cache, v_cache, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.why_not_served is not None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("hw_agnostic's attention backend does not fuse output quantization")
        if attn_metadata.causal is not True or attn_metadata.dynamic_causal is not None:
            raise NotImplementedError(
                "hw_agnostic's attention backend serves causal decoder attention only; this batch is "
                f"non-causal (causal={attn_metadata.causal!r}) but the layer was built as a decoder layer")
        from hw_agnostic import ops

        k_cache, v_cache = split_cpu_kv_cache(kv_cache)
        tokens = attn_metadata.num_actual_tokens
        num_seqs = attn_metadata.seq_lens.shape[0]
        attended = ops.paged_attention(
            query[:tokens], k_cache, v_cache, attn_metadata.block_table[:num_seqs],
            attn_metadata.query_start_loc[: num_seqs + 1], attn_metadata.seq_lens,
            scale=self.scale,
            sliding_window=None if self.sliding_window < 0 else self.sliding_window,
            softcap=self.logits_soft_cap if self.logits_soft_cap else None,
            sinks=self.sinks,
            max_q_len=attn_metadata.max_query_len, max_kv_len=attn_metadata.max_seq_len,
        )
        output[:tokens].copy_(attended)
        return output


class HwAgnosticCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (its name, metadata and cache layout) on the library's ops."""

    @staticmethod
    def get_impl_cls() -> type[HwAgnosticCPUAttentionImpl]:
        return HwAgnosticCPUAttentionImpl


def register_attention() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
