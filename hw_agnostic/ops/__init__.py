"""Public ops: ``from hw_agnostic.ops import rms_norm``.

Each op is also a ``torch.library`` custom op, ``torch.ops.hw_agnostic.<name>``; see
:mod:`.registry` for dispatch, forcing a provider and inspecting which one ran.
"""

from .activations import gelu_and_mul, silu_and_mul, swiglu_oai
from .fused_experts import fused_experts
from .gated_rms_norm import gated_rms_norm
from .grouped_gemm import grouped_gemm
from .layer_norm import fused_add_layer_norm, layer_norm
from .linear import linear
from .moe_align import MoEAlignment, moe_align
from .moe_route import moe_route
from .paged_attention import paged_attention, validate_paged_attention_inputs
from .registry import (
    Op,
    Plan,
    Provider,
    ProviderError,
    all_ops,
    get_op,
    reset,
    trace_dispatch,
    use_config,
    use_provider,
)
from .rms_norm import fused_add_rms_norm, rms_norm
from .rotary_embedding import rotary_embedding
from .rotary_write_kv_cache import rotary_write_kv_cache
from .write_kv_cache import write_kv_cache

__all__ = [
    "MoEAlignment",
    "Op",
    "Plan",
    "Provider",
    "ProviderError",
    "all_ops",
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "fused_experts",
    "gated_rms_norm",
    "gelu_and_mul",
    "get_op",
    "grouped_gemm",
    "layer_norm",
    "linear",
    "moe_align",
    "moe_route",
    "paged_attention",
    "reset",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv_cache",
    "silu_and_mul",
    "swiglu_oai",
    "trace_dispatch",
    "use_config",
    "use_provider",
    "validate_paged_attention_inputs",
    "write_kv_cache",
]
