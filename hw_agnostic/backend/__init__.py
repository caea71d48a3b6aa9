"""Rewire Hugging Face ``transformers`` models onto hw_agnostic layers, without per-model code."""

from .attention import disable_paged_attention, enable_paged_attention
from .construct import from_config, from_pretrained
from .experts import (
    EXPERTS_IMPLEMENTATION,
    disable_fused_experts,
    enable_fused_experts,
    moe_layer_from_hf,
    register_experts_implementation,
)
from .report import Entry, RewireReport
from .rewire import rewire

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "Entry",
    "RewireReport",
    "disable_fused_experts",
    "disable_paged_attention",
    "enable_fused_experts",
    "enable_paged_attention",
    "from_config",
    "from_pretrained",
    "moe_layer_from_hf",
    "register_experts_implementation",
    "rewire",
]
