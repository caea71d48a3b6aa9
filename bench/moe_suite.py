"""MoE rows: the routed experts of three MoE models, and their routing, against what transformers runs.

Experts (``op = "moe_experts <model>"``): ``fused_experts`` vs transformers' ``grouped_mm``
experts (the default of transformers 5, ``provider = hf_grouped_mm``) and its eager per-expert
loop (``hf_eager``), all on the same module weights and the same routing. FLOPs are
``2 * tokens * top_k * 3 * H * I``; the report divides TFLOP/s by the dense bf16 matmul rate
measured in the same run (``matmul_fraction``). Bytes are the weights of the experts that receive a token plus the
hidden states in and out (what decode is bound by).

Routing (``op = "moe_route <model>"``): the router's linear layer plus top-k, through
:func:`hw_agnostic.layers.moe.route`, vs the transformers router module of that family.

Shapes: Qwen3-30B-A3B (E=128, top-8, H=2048, I=768), Mixtral-8x7B (E=8, top-2, H=4096,
I=14336) and a DeepSeek-V3-like routed layer (E=256, top-8, H=7168, I=2048, 8 groups, top-4
groups) at 1 to 16384 tokens on GPUs. The CPU has minutes and 20-odd GB: fewer token counts, and
the DeepSeek-like layer with 32 experts (its full 22 GB of bf16 weights do not fit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hw_agnostic import ops
from hw_agnostic.layers.moe import RoutingSpec, route, router_logits
from hw_agnostic.autotune.shapes import MOE_MODELS, MoEModel
from hw_agnostic.ops.fused_experts import fused_experts
from hw_agnostic.ops.moe_common import example_routing

from .timing import measure_all


def _routing(model: MoEModel) -> RoutingSpec:
    if model.n_group > 1:  # DeepSeek-V3
        return RoutingSpec(model.top_k, "sigmoid", True, model.n_group, model.topk_group, 2.5,
                           logits="fp32_inputs", weights_dtype="fp32")
    return RoutingSpec(model.top_k, "softmax", True, weights_dtype="logits")


MODELS = tuple(m for m in MOE_MODELS if m.name in ("Qwen3-30B-A3B", "Mixtral-8x7B", "DeepSeek-V3"))
GPU_TOKENS = (1, 16, 128, 1024, 4096, 8192, 16384)


def _grid(device: torch.device, quick: bool) -> list[tuple[MoEModel, int]]:
    if device.type != "cpu":
        tokens = (1, 128, 8192) if quick else GPU_TOKENS
        return [(model, t) for model in MODELS for t in tokens]
    qwen, mixtral, deepseek = MODELS
    deepseek = deepseek._replace(name="DeepSeek-V3-like (32 experts)", experts=32)
    return [(qwen, t) for t in ((1, 64) if quick else (1, 16, 256))] + \
        [(mixtral, t) for t in ((1,) if quick else (1, 16))] + \
        [(deepseek, t) for t in ((1,) if quick else (1, 16))]


def _hf_experts(model: MoEModel, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model("qwen3_moe", hidden_size=model.hidden, moe_intermediate_size=model.inter,
                                  num_experts=model.experts)
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config).to(dtype)
    experts = experts.to_empty(device=device)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(std=param.shape[-1] ** -0.5)
    return experts


def _hf_router(model: MoEModel, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    kw = dict(num_experts_per_tok=model.top_k, num_experts=model.experts, num_local_experts=model.experts,
              hidden_size=model.hidden, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=model.n_group,
              topk_group=model.topk_group)
    config = type("Config", (), kw)()
    router = (DeepseekV3TopkRouter if model.n_group > 1 else Qwen3MoeTopKRouter)(config)
    router = router.to(device=device, dtype=dtype)
    with torch.no_grad():
        router.weight.normal_(std=model.hidden ** -0.5)
    return router


def _rows(model: MoEModel, op: str, tokens: int, dtype: torch.dtype, device: torch.device, flops: float, moved: int,
          candidates: dict[str, tuple[str, str, Callable[[], Any]]]) -> Iterator[dict[str, Any]]:
    """One row per candidate (``provider: (ran, config source, fn)``), measured together."""
    timings = measure_all({provider: fn for provider, (_, _, fn) in candidates.items()}, device)
    for provider, (ran, source, _) in candidates.items():
        yield _row(model, op, tokens, dtype, provider, ran, source, timings[provider], flops, moved)


def _row(model: MoEModel, op: str, tokens: int, dtype: torch.dtype, provider: str, ran: str, source: str,
         timing: dict[str, Any], flops: float, moved: int) -> dict[str, Any]:
    us = timing["time_us"]
    return {
        "suite": "moe", "op": f"{op} {model.name}", "model": model.name, "shape": f"{tokens}x{model.hidden}",
        "tokens": tokens, "width": model.hidden, "experts": model.experts, "top_k": model.top_k,
        "inter": model.inter, "dtype": str(dtype).removeprefix("torch."), "provider": provider, "ran": ran,
        "config_source": source, **timing, "bytes": moved,
        "gbps": moved / (us * 1e-6) / 1e9, "flops": flops, "tflops": flops / (us * 1e-6) / 1e12,
    }


def _experts_rows(model: MoEModel, tokens: int, dtype: torch.dtype, device: torch.device,
                  experts: nn.Module) -> Iterator[dict[str, Any]]:
    from transformers.integrations.moe import grouped_mm_experts_forward

    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, model.hidden, generator=g).to(device=device, dtype=dtype)
    weights, ids = example_routing(tokens, model.experts, model.top_k, device, g)
    weights = weights.to(dtype)
    size = torch.finfo(dtype).bits // 8
    touched = int(torch.unique(ids).numel())
    moved = touched * 3 * model.hidden * model.inter * size + 2 * tokens * model.hidden * size
    flops = 2.0 * tokens * model.top_k * 3 * model.hidden * model.inter
    args = (hidden, experts.gate_up_proj, experts.down_proj, weights, ids, None, None, "silu", False, False,
            1.702, 7.0)
    plan = ops.get_op("fused_experts").plan(*args)
    original_forward = type(experts).forward.__wrapped__  # the per-expert loop under transformers' dispatch
    candidates = {
        "hw_agnostic": (plan.provider, plan.config.describe() if plan.config else "",
                        lambda: fused_experts(hidden, experts.gate_up_proj, experts.down_proj, weights, ids)),
        "hf_grouped_mm": ("hf_grouped_mm", "", lambda: grouped_mm_experts_forward(experts, hidden, ids, weights)),
        "hf_eager": ("hf_eager", "", lambda: original_forward(experts, hidden, ids, weights)),
    }
    yield from _rows(model, "moe_experts", tokens, dtype, device, flops, moved, candidates)


def _route_rows(model: MoEModel, tokens: int, dtype: torch.dtype, device: torch.device) -> Iterator[dict[str, Any]]:
    router = _hf_router(model, dtype, device)
    hidden = torch.randn(tokens, model.hidden, generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
    spec = _routing(model)
    correction = getattr(router, "e_score_correction_bias", None)
    size = torch.finfo(dtype).bits // 8
    moved = (model.experts + tokens) * model.hidden * size
    flops = 2.0 * tokens * model.experts * model.hidden
    logits = router_logits(spec, hidden, router.weight)
    plan = ops.get_op("moe_route").plan(logits, correction, spec.top_k, spec.scoring, spec.renormalize, spec.n_group,
                                        spec.topk_group, spec.routed_scaling_factor)
    candidates = {
        "hw_agnostic": (plan.provider, plan.config.describe() if plan.config else "",
                        lambda: route(spec, hidden, router.weight, None, correction)),
        "hf_eager": ("hf_eager", "", lambda: router(hidden)),
    }
    yield from _rows(model, "moe_route", tokens, dtype, device, flops, moved, candidates)


def _label(model: MoEModel, tokens: int) -> str:
    return f"moe {model.name} {tokens} tokens"


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    return 5 * sum(only(_label(*item)) for item in _grid(device, quick))  # 3 experts rows, 2 routing rows


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    """Yield one long-format row per (op, model, tokens, dtype, provider)."""
    dtype = torch.bfloat16  # the dtype of bench/__main__'s same-run matmul rate, the TFLOP/s ceiling
    grid = [item for item in _grid(device, quick) if only(_label(*item))]
    experts_by_model: dict[str, nn.Module] = {}
    with torch.inference_mode():
        for index, (model, tokens) in enumerate(grid, 1):
            log(f"[{index}/{len(grid)}] {_label(model, tokens)}")
            if model.name not in experts_by_model:
                experts_by_model.clear()  # one model's weights at a time
                experts_by_model[model.name] = _hf_experts(model, dtype, device)
            yield from _experts_rows(model, tokens, dtype, device, experts_by_model[model.name])
            yield from _route_rows(model, tokens, dtype, device)
