"""Shapes from real models, shared by the tuner and the benchmarks."""

from __future__ import annotations

from typing import NamedTuple

#: (model, hidden size, MLP intermediate size, head dim)
MODELS: tuple[tuple[str, int, int, int], ...] = (
    ("Llama-3-8B", 4096, 14336, 128),
    ("Llama-3-70B", 8192, 28672, 128),
    ("Qwen3-4B", 2560, 9728, 128),
    ("Qwen3-32B", 5120, 25600, 128),
    ("Gemma-2-9B", 3584, 14336, 256),
    ("Gemma-3-27B", 5376, 21504, 128),
    ("gpt-oss-20b", 2880, 2880, 64),
)

TOKEN_COUNTS: tuple[int, ...] = (1, 16, 128, 1024, 4096, 16384)


class MoEModel(NamedTuple):
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    n_group: int = 1  # > 1: DeepSeek-V3's group-limited sigmoid routing
    topk_group: int = 1


MOE_MODELS: tuple[MoEModel, ...] = (
    MoEModel("Qwen3-30B-A3B", 128, 8, 2048, 768),
    MoEModel("Mixtral-8x7B", 8, 2, 4096, 14336),
    MoEModel("DeepSeek-V3", 256, 8, 7168, 2048, n_group=8, topk_group=4),
    MoEModel("gpt-oss-20b", 32, 4, 2880, 2880),
)
MOE_OPS = ("moe_route", "moe_align", "grouped_gemm", "fused_experts")


def moe_model(width: int) -> MoEModel:
    """The MoE model with hidden size ``width``, or a small generic layer of that width."""
    return next((m for m in MOE_MODELS if m.hidden == width), MoEModel(f"generic-{width}", 8, 2, width, width))


def widths(op_name: str) -> list[int]:
    """The last-dimension sizes an op sees in these models (hidden for norms, intermediate for MLPs)."""
    if op_name in ("paged_attention", "write_kv_cache", "rotary_embedding", "rotary_write_kv_cache"):  # their example inputs take the head dim
        return sorted({head for *_, head in MODELS})
    if op_name in MOE_OPS:  # the MoE ops' example inputs take the model from its hidden size
        return sorted({m.hidden for m in MOE_MODELS})
    if op_name in ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm", "fused_add_layer_norm",
                   "fused_add_layer_norm_"):
        values = {hidden for _, hidden, _, _ in MODELS} | {head for *_, head in MODELS}  # q/k norms
    elif op_name == "gated_rms_norm":  # per-head rows (Qwen3-Next), Mamba-2 mixer rows (2 x hidden, in 8 groups)
        values = {head for *_, head in MODELS} | {2 * hidden for _, hidden, _, _ in MODELS}
    else:
        values = {inter for _, _, inter, _ in MODELS}
    return sorted(values)
