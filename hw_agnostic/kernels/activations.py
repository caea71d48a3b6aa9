"""Helion kernel for the gated activations: ``act(gate) * up``.

One elementwise kernel over 2-D ``[rows, inter]`` views, so every layout is a pair of views the
op builds without copying: ``gate = x[..., :I], up = x[..., I:]`` for the usual gate-first
layout, and ``x[..., ::2], x[..., 1::2]`` for gpt-oss's interleaved one.

The math follows the Hugging Face modules, including where they round to the input dtype:

* ``silu`` / ``gelu`` / ``gelu_tanh``: ``act(gate)`` is computed in fp32 and rounded to the input
  dtype (``ACT2FN[...]`` on a bf16 tensor), then multiplied by ``up`` and rounded again.
* ``swiglu_oai`` (gpt-oss): ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``,
  ``glu = gate * sigmoid(gate * alpha)``, ``(up + 1) * glu``; HF runs each step in the input
  dtype, so each intermediate is rounded to it (a no-op in fp32).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

#: Values of the ``activation`` constexpr. Kernels compare constexprs with literals: Helion
#: folds those at compile time, but passes module-level constants in as runtime arguments.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")

_constexpr = Constexpr


def _gated_activation(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor,
    alpha: float,
    limit: float,
    activation: _constexpr,
) -> None:
    m, i = out.size()
    for tile_m, tile_i in hl.tile([m, i]):
        g = gate[tile_m, tile_i].to(torch.float32)
        u = up[tile_m, tile_i].to(torch.float32)
        if activation == "swiglu_oai":
            g = torch.clamp(g, max=limit)
            u = torch.clamp(u, min=-limit, max=limit)
            scaled = (g * alpha).to(out.dtype).to(torch.float32)
            sig = torch.sigmoid(scaled).to(out.dtype).to(torch.float32)
            glu = (g * sig).to(out.dtype).to(torch.float32)
            act = glu
            u = (u + 1.0).to(out.dtype).to(torch.float32)
        elif activation == "silu":
            act = (g * torch.sigmoid(g)).to(out.dtype).to(torch.float32)
        elif activation == "gelu":
            # erfc, not 1 + erf: no cancellation for negative g, where gelu is tiny.
            act = (0.5 * g * torch.erfc(g * -0.7071067811865476)).to(out.dtype).to(torch.float32)
        else:
            # 1 + tanh(z) == 2 * sigmoid(2z), without the cancellation for negative z.
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = (g * torch.sigmoid(2.0 * inner)).to(out.dtype).to(torch.float32)
        out[tile_m, tile_i] = (act * u).to(out.dtype)


gated_activation_kernel = HelionFunction(_gated_activation, memory_bound=True, fp_fusion=False)


# --------------------------------------------------------------------------------------------
# configs. Keys: {"activation", "dtype", "inter", "tokens"}.


def default_gated_activation_config(key: Mapping[str, Any]) -> Config:
    inter, tokens = int(key["inter"]), max(int(key["tokens"]), 1)
    if interpreter_mode() == "triton":
        block_i = min(next_power_of_2(inter), 1024)
        block_m = min(next_power_of_2(tokens), max(1, 8192 // block_i))
        return {"block_sizes": [block_m, block_i], "num_warps": 4, "num_stages": 1}
    block_i = min(next_power_of_2(inter), 1024)
    block_m = min(next_power_of_2(tokens), max(1, 2048 // block_i))
    # Up to 4 warps, as many as give every thread a 16-byte vector of the tile (64-wide AMD waves too).
    element_bytes = 4 if key.get("dtype") == "float32" else 2
    warps = min(4, max(1, block_m * block_i * element_bytes // (16 * 64)))
    return {"block_sizes": [block_m, block_i], "num_warps": warps, "num_stages": 1}


def gated_activation_candidates(key: Mapping[str, Any]) -> list[Config]:
    inter, tokens = int(key["inter"]), max(int(key["tokens"]), 1)
    candidates = [default_gated_activation_config(key)]
    for block_i in (128, 256, 512, 1024, 2048, 4096):
        if block_i > 2 * next_power_of_2(inter):
            continue
        for block_m in (1, 2, 4, 8, 16, 32):
            if block_m > next_power_of_2(tokens) or block_m * block_i > 16384:
                continue
            for warps in (2, 4, 8, 16):
                config = {"block_sizes": [block_m, block_i], "num_warps": warps, "num_stages": 1}
                if config not in candidates:
                    candidates.append(config)
    return candidates


GATED_ACTIVATION = KernelSpec(
    "gated_activation", (_gated_activation,), default_gated_activation_config, gated_activation_candidates
)
