"""The unquantized MoE experts on the library's ``fused_experts``.

``UnquantizedFusedMoEMethod`` is vLLM's method object for unquantized ``FusedMoE`` layers (the
Transformers backend routes every HF MoE block through one). The override keeps vLLM's router,
shared experts and TP/EP reductions (all outside ``apply``) and replaces the expert GEMMs.

Whether the library serves a layer is decided once, when its weights are processed: a served
layer keeps vLLM's checkpoint layout (``w13_weight [E, 2I, H]`` gate rows first, ``w2_weight
[E, H, I]``), which ``fused_experts`` reads as it is; any other layer (expert parallelism or data
parallel dispatch, EPLB, LoRA, an activation the library lacks, no gate/up merge) goes through
vLLM's own weight processing (on the CPU it repacks the weights) and kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from . import note_built

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _activation(layer: Any) -> tuple[str, bool] | str:
    """The library's (activation, interleaved) for the layer's, or why there is none."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    act = layer.activation
    simple = {MoEActivation.SILU: "silu", MoEActivation.GELU: "gelu", MoEActivation.GELU_TANH: "gelu_tanh"}
    if act in simple:
        return simple[act], False
    if act in (MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUOAI_UNINTERLEAVE):
        # vLLM's SwigluOAI defaults are the library's (alpha 1.702, limit 7, up + 1)
        if any(getattr(layer, name, None) is not None for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit")):
            return "swigluoai with non-default alpha/beta/limit"
        return "swiglu_oai", act == MoEActivation.SWIGLUOAI
    return f"activation {act.value} is not one of the library's"


def why_not_served(method: Any, layer: Any) -> str | None:
    moe = method.moe
    parallel = moe.moe_parallel_config
    if not moe.is_act_and_mul:
        return "no gate/up (act-and-mul) experts"
    if getattr(moe, "is_lora_enabled", False):
        return "LoRA"
    if (parallel.use_ep or parallel.dp_size > 1 or parallel.pcp_size > 1 or parallel.enable_eplb
            or moe.is_sequence_parallel):
        return "expert/data/sequence parallelism or EPLB (vLLM dispatches those)"
    if getattr(layer, "expert_map", None) is not None:
        return "an expert map"
    if layer.w13_weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {layer.w13_weight.dtype}"
    activation = _activation(layer)
    if isinstance(activation, str):
        return activation
    return None


def register_moe() -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    @UnquantizedFusedMoEMethod.register_oot(name="UnquantizedFusedMoEMethod")
    class HwAgnosticUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        served: bool = False

        def process_weights_after_loading(self, layer: Any) -> None:
            reason = why_not_served(self, layer)
            if reason is not None:
                note_built("moe", reason)
                self.served = False
                return super().process_weights_after_loading(layer)
            from hw_agnostic import ops  # noqa: F401  (imported while loading, not while tracing)

            activation = _activation(layer)
            assert not isinstance(activation, str)
            self._library_activation = activation
            self.served = True
            note_built("moe")
            # No vLLM kernel is built: without one vLLM runs the shared experts itself and
            # all-reduces the routed output (see its MoE runner), which is what a served layer needs.

        @property
        def is_monolithic(self) -> bool:
            return False if self.served else super().is_monolithic

        def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  shared_experts: Any, shared_experts_input: torch.Tensor | None) -> torch.Tensor:
            if not self.served:
                return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
            from hw_agnostic import ops

            activation, interleaved = self._library_activation
            if layer.apply_router_weight_on_input:
                # vLLM scales the input by the (top-1) router weight, then sums unscaled experts.
                x = x * topk_weights.to(x.dtype)
                topk_weights = torch.ones_like(topk_weights)
            has_bias = self.moe.has_bias
            return ops.fused_experts(
                x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                activation=activation, interleaved=interleaved,
                gate_up_bias=layer.w13_bias if has_bias else None,
                down_bias=layer.w2_bias if has_bias else None,
            )
