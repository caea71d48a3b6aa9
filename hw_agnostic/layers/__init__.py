"""Layers built from ops, and the registry through which plugins replace them.

``CustomOp`` layers run one op (``forward``) or its reference (``forward_native``);
``PluggableLayer`` layers compose modules. See :mod:`.base` for registering out-of-tree
replacements.
"""

from .activation import GeluAndMul, SiluAndMul, SwigluOai, act_and_mul
from .attention import PagedAttention, PagedBatch, PagedKVCache, attend
from .base import CustomOp, LayerRegistryError, PluggableLayer, registered_layers, resolve, unregister_oot
from .gated_rms_norm import GatedRMSNorm
from .layer_norm import LayerNorm
from .linear import Linear
from .mlp import GatedMLP
from .moe import MoE, MoEExperts, MoERouter, RoutingSpec
from .norm import RMSNorm
from .qkv import QKVPart, QKVProjection

__all__ = [
    "CustomOp",
    "GatedMLP",
    "GatedRMSNorm",
    "GeluAndMul",
    "LayerNorm",
    "LayerRegistryError",
    "Linear",
    "MoE",
    "MoEExperts",
    "MoERouter",
    "PagedAttention",
    "PagedBatch",
    "PagedKVCache",
    "PluggableLayer",
    "QKVPart",
    "QKVProjection",
    "RMSNorm",
    "RoutingSpec",
    "SiluAndMul",
    "SwigluOai",
    "act_and_mul",
    "attend",
    "registered_layers",
    "resolve",
    "unregister_oot",
]
