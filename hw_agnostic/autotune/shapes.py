"""Shapes from real models, shared by the tuner and the benchmarks."""

from __future__ import annotations

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


def widths(op_name: str) -> list[int]:
    """The last-dimension sizes an op sees in these models (hidden for norms, intermediate for MLPs)."""
    if op_name in ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_"):
        values = {hidden for _, hidden, _, _ in MODELS} | {head for *_, head in MODELS}  # q/k norms
    else:
        values = {inter for _, _, inter, _ in MODELS}
    return sorted(values)
