"""Mixture-of-experts ops: routing, alignment, grouped GEMM and fused experts.

``T`` tokens each pick ``K`` of ``E`` experts. A token/expert *pair* is numbered
``p = t * K + k`` (the row-major order of ``topk_ids [T, K]``); ``P = T * K``.

==================  =======================================================================
op                  what it computes
==================  =======================================================================
``moe_route``       router logits ``[T, E]`` -> ``(weights [T, K] fp32, ids [T, K] int64)``:
                    softmax then top-k (Qwen, Mixtral, OLMoE), sigmoid with correction bias
                    and group-limited top-k (DeepSeek-V3), or top-k then softmax (gpt-oss);
                    optional renormalisation and scaling factor.
``moe_align``       ``topk_ids`` -> pairs sorted by expert, each expert's segment padded to
                    a multiple of ``block_m``: ``sorted_pairs``, ``block_experts`` (the
                    expert of each ``block_m`` rows) and ``expert_offsets``. Sized by
                    upper bounds computable from shapes, so nothing waits for the device.
``grouped_gemm``    one launch over all experts: row ``p`` of the result is
                    ``a[p // pairs_per_row] @ W[expert(p)]^T`` (+ bias) (* scale[p]).
``fused_experts``   the experts block of a Hugging Face MoE layer: grouped GEMM (gate/up)
                    -> gated activation (the activation ops) -> grouped GEMM (down) scaled by
                    the router weight -> sum over the top-k.
==================  =======================================================================

The references are the specification and follow the Hugging Face code they replace, including
its roundings: each projection is rounded to the model dtype, a bias is added in it, the router
weight multiplies in ``promote(model dtype, weight dtype)`` (Qwen casts its router weights to
the model dtype, Mixtral and DeepSeek-V3 keep fp32), and the top-k sum accumulates in fp32 and
is rounded once (``grouped_mm`` experts, the transformers 5 default). Pairs whose expert id is
outside ``[0, E)`` (expert-parallel sentinels) contribute nothing, as in transformers.

Layouts (``transposed``): ``False`` is the Hugging Face default, ``gate_up_proj [E, 2I, H]``
(gate rows first, or gate/up interleaved with ``interleaved=True``) and ``down_proj [E, H, I]``;
``True`` is gpt-oss's ``[E, H, 2I]`` and ``[E, I, H]``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..autotune.keys import token_bucket
from ..autotune.shapes import moe_model
from ..kernels import moe as kernels
from ..kernels.runtime import helion_available, next_power_of_2
from . import activations, checks
from .registry import Op, Provider

SCORINGS = kernels.SCORINGS
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")
INDEX_DTYPES = (torch.int32, torch.int64)
#: Upper limits of the kernels (the reference runs beyond them).
MAX_KERNEL_EXPERTS = 1024
MAX_KERNEL_TOP_K = 32
MAX_KERNEL_GROUPS = 32
MAX_BLOCK_M = 256


# --------------------------------------------------------------------------------------------
# the spec


def moe_route_reference(
    router_logits: Tensor,
    correction_bias: Optional[Tensor],
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    compute = torch.promote_types(router_logits.dtype, torch.float32)
    logits = router_logits.to(compute)
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = logits
    choice = scores if correction_bias is None else scores + correction_bias.to(compute)
    num_experts = logits.shape[-1]
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.view(-1, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if scoring == "topk_then_softmax":
        weights = torch.softmax(weights, dim=-1)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    return weights * routed_scaling_factor, ids


def moe_align_reference(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pairs sorted by expert (stable), each segment padded with ``P`` to a multiple of ``block_m``.

    Bucket ``E`` collects pairs whose id is outside ``[0, E)``. Results (int32):
    ``sorted_pairs [S]``, ``block_experts [S // block_m]`` (bucket of each block, -1 past the
    last segment) and ``expert_offsets [E + 2]`` (segment ``e`` is
    ``sorted_pairs[offsets[e]:offsets[e + 1]]``), with ``S = max_slots(P, E, block_m)``.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    buckets = num_experts + 1
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(buckets, dtype=torch.int64, device=device).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, dim=0)
    order = torch.argsort(bucket, stable=True)
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, dim=0) - counts)[bucket[order]]
    slots = kernels.max_slots(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, (ends - padded)[bucket[order]] + rank, order)
    block_start = torch.arange(slots // block_m, device=device) * block_m
    owner = (ends[None, :] <= block_start[:, None]).sum(dim=1)
    block_experts = torch.where(owner < buckets, owner, -1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends])
    return sorted_pairs.to(torch.int32), block_experts.to(torch.int32), offsets.to(torch.int32)


def _pair_experts(sorted_pairs: Tensor, block_experts: Tensor, num_pairs: int, num_experts: int) -> Tensor:
    """The expert of each pair as the alignment lists it (``num_experts``: not routed)."""
    pair_expert = torch.full((num_pairs + 1,), num_experts, dtype=torch.int64, device=sorted_pairs.device)
    if block_experts.numel():
        slot_expert = block_experts.to(torch.int64).repeat_interleave(sorted_pairs.numel() // block_experts.numel())
        pairs = sorted_pairs.to(torch.int64)
        listed = (pairs >= 0) & (pairs < num_pairs) & (slot_expert >= 0) & (slot_expert < num_experts)
        pair_expert.scatter_(0, torch.where(listed, pairs, num_pairs), torch.where(listed, slot_expert, num_experts))
    return pair_expert[:num_pairs]


def _project(x: Tensor, weight: Tensor, transposed: bool) -> Tensor:
    return x @ weight if transposed else F.linear(x, weight)


def grouped_gemm_reference(
    a: Tensor,
    weight: Tensor,
    sorted_pairs: Tensor,
    block_experts: Tensor,
    pairs_per_row: int,
    transposed: bool,
    bias: Optional[Tensor],
    scale: Optional[Tensor],
) -> Tensor:
    num_experts = weight.shape[0]
    num_pairs = a.shape[0] * pairs_per_row
    width = weight.shape[2] if transposed else weight.shape[1]
    out_dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    out = torch.zeros(num_pairs, width, dtype=out_dtype, device=a.device)
    pair_expert = _pair_experts(sorted_pairs, block_experts, num_pairs, num_experts)
    for expert in torch.unique(pair_expert).tolist():
        if expert >= num_experts:
            continue
        pairs = (pair_expert == expert).nonzero().squeeze(1)
        y = _project(a[pairs // pairs_per_row], weight[expert], transposed)
        if bias is not None:
            y = y + bias[expert]
        if scale is not None:
            y = y * scale[pairs, None]
        out[pairs] = y.to(out_dtype)
    return out


def gated_reference(x: Tensor, activation: str, interleaved: bool, alpha: float, limit: float) -> Tensor:
    """The project's gated activations, as the Hugging Face experts apply them."""
    if activation == "swiglu_oai":
        return activations.swiglu_oai_reference(x, alpha, limit, interleaved)
    if activation == "silu":
        return activations.silu_and_mul_reference(x)
    return activations.gelu_and_mul_reference(x, "tanh" if activation == "gelu_tanh" else "none")


def fused_experts_reference(
    hidden: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    gate_up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    transposed: bool,
    interleaved: bool,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> Tensor:
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.shape[0]
    pair_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    expert_of = topk_ids.reshape(-1)
    weight_of = topk_weights.reshape(-1)
    pair_out = torch.zeros(num_tokens * top_k, hidden_size, dtype=pair_dtype, device=hidden.device)
    for expert in torch.unique(expert_of).tolist():
        if not 0 <= expert < num_experts:
            continue  # an expert-parallel sentinel: contributes nothing
        pairs = (expert_of == expert).nonzero().squeeze(1)
        gate_up = _project(hidden[pairs // top_k], w_gate_up[expert], transposed)
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert]
        gated = gated_reference(gate_up, activation, interleaved, swiglu_alpha, swiglu_limit)
        y = _project(gated, w_down[expert], transposed)
        if down_bias is not None:
            y = y + down_bias[expert]
        pair_out[pairs] = y * weight_of[pairs, None]
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def _grouped_gemm_fake(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                       transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    width = weight.shape[2] if transposed else weight.shape[1]
    out_dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    return a.new_empty((a.shape[0] * pairs_per_row, width), dtype=out_dtype)


def _fused_experts_fake(hidden: Tensor, *args: object) -> Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def _eager_reference(op_name: str, reference: object) -> object:
    """The reference provider runs these references eagerly: they loop over the experts present,
    which ``torch.compile(fullgraph=True)`` cannot trace (data-dependent shapes)."""
    return reference


# --------------------------------------------------------------------------------------------
# checks


def _integer(op: str, name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{op}: {name} must be {bound}, got {value}")
    return value


def _flag(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def _matrix(op: str, name: str, value: object, *, dtypes: tuple[torch.dtype, ...] = checks.FLOAT_DTYPES) -> Tensor:
    tensor = checks.tensor(op, name, value, dtypes=dtypes)
    if tensor.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D; got shape {tuple(tensor.shape)}")
    return tensor


def _vector(op: str, name: str, value: object, length: int, reference_name: str, reference: Tensor,
            *, dtypes: tuple[torch.dtype, ...] = checks.FLOAT_DTYPES) -> None:
    tensor = checks.tensor(op, name, value, dtypes=dtypes)
    checks.same_device(op, name, tensor, reference_name, reference)
    if tensor.shape != (length,):
        raise ValueError(f"{op}: {name} must have shape ({length},); got {tuple(tensor.shape)}")


def _check_routing_tensors(op: str, topk_weights: Tensor | None, topk_ids: Tensor, num_tokens: int,
                           hidden_name: str, hidden: Tensor) -> None:
    _matrix(op, "topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    checks.same_device(op, "topk_ids", topk_ids, hidden_name, hidden)
    if topk_ids.shape[0] != num_tokens or topk_ids.shape[1] == 0:
        raise ValueError(f"{op}: topk_ids must have shape ({num_tokens}, top_k >= 1) to match {hidden_name}; "
                         f"got {tuple(topk_ids.shape)}")
    if topk_weights is not None:
        _matrix(op, "topk_weights", topk_weights)
        checks.same_device(op, "topk_weights", topk_weights, hidden_name, hidden)
        checks.same_shape(op, "topk_weights", topk_weights, "topk_ids", topk_ids)


def check_moe_route(router_logits: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str,
                    renormalize: bool, n_group: int, topk_group: int, routed_scaling_factor: float) -> None:
    op = "moe_route"
    _matrix(op, "router_logits", router_logits)
    num_experts = router_logits.shape[1]
    if num_experts == 0:
        raise ValueError(f"{op}: router_logits must have at least one expert column; got shape "
                         f"{tuple(router_logits.shape)}")
    _integer(op, "top_k", top_k, minimum=1, maximum=num_experts)
    checks.choice(op, "scoring", scoring, SCORINGS)
    _flag(op, "renormalize", renormalize)
    if correction_bias is not None:
        _vector(op, "correction_bias", correction_bias, num_experts, "router_logits", router_logits)
    _integer(op, "n_group", n_group, minimum=1, maximum=num_experts)
    _integer(op, "topk_group", topk_group, minimum=1, maximum=n_group)
    if num_experts % n_group:
        raise ValueError(f"{op}: n_group ({n_group}) must divide the number of experts ({num_experts})")
    if n_group > 1 and scoring != "sigmoid":
        raise ValueError(f"{op}: group-limited routing (n_group={n_group}) is DeepSeek-V3's and needs "
                         f"scoring='sigmoid'; got scoring={scoring!r}")
    eligible = topk_group * (num_experts // n_group)
    if top_k > eligible:
        raise ValueError(f"{op}: top_k ({top_k}) exceeds the {eligible} experts of the topk_group={topk_group} "
                         f"best groups")
    checks.number(op, "routed_scaling_factor", routed_scaling_factor)


def check_moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> None:
    op = "moe_align"
    _matrix(op, "topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    _integer(op, "num_experts", num_experts, minimum=1)
    _check_block_m(op, block_m)


def _check_block_m(op: str, block_m: object) -> None:
    _integer(op, "block_m", block_m, minimum=1, maximum=MAX_BLOCK_M)
    if block_m & (block_m - 1):
        raise ValueError(f"{op}: block_m must be a power of two, got {block_m}")


def check_grouped_gemm(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                       transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> None:
    op = "grouped_gemm"
    _matrix(op, "a", a)
    checks.tensor(op, "weight", weight, min_dim=3)
    checks.same_device(op, "weight", weight, "a", a)
    checks.same_dtype(op, "weight", weight, "a", a)
    _flag(op, "transposed", transposed)
    layout = "[E, K, N]" if transposed else "[E, N, K]"
    inner = weight.shape[1] if transposed else weight.shape[-1]
    if a.shape[1] == 0:
        raise ValueError(f"{op}: a must have at least one column; got shape {tuple(a.shape)}")
    if weight.dim() != 3 or 0 in weight.shape or inner != a.shape[1]:
        raise ValueError(f"{op}: weight must be {layout} with E, N >= 1 and K = a.shape[1] = {a.shape[1]} "
                         f"(transposed={transposed}); got {tuple(weight.shape)}")
    for name, value in (("sorted_pairs", sorted_pairs), ("block_experts", block_experts)):
        checks.tensor(op, name, value, dtypes=(torch.int32,))
        checks.same_device(op, name, value, "a", a)
        if value.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D (from moe_align); got shape {tuple(value.shape)}")
    slots, blocks = sorted_pairs.shape[0], block_experts.shape[0]
    block_m = slots // blocks if blocks else 1
    if (blocks == 0) != (slots == 0) or slots != blocks * block_m or block_m & (block_m - 1):
        raise ValueError(f"{op}: sorted_pairs ({slots} rows) must hold a power-of-two number of rows per entry of "
                         f"block_experts ({blocks}), as moe_align returns them")
    _integer(op, "pairs_per_row", pairs_per_row, minimum=1)
    width = weight.shape[2] if transposed else weight.shape[1]
    if bias is not None:
        checks.tensor(op, "bias", bias)
        checks.same_device(op, "bias", bias, "a", a)
        checks.same_dtype(op, "bias", bias, "a", a)
        if bias.shape != (weight.shape[0], width):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]}, {width}); got {tuple(bias.shape)}")
    if scale is not None:
        _vector(op, "scale", scale, a.shape[0] * pairs_per_row, "a", a)


def _fused_dims(w_gate_up: Tensor, w_down: Tensor, transposed: bool) -> tuple[int, int, int, int]:
    """(experts, hidden, 2 * inter, inter) as the weights' layout says."""
    experts = w_gate_up.shape[0]
    if transposed:
        return experts, w_gate_up.shape[1], w_gate_up.shape[2], w_down.shape[1]
    return experts, w_gate_up.shape[2], w_gate_up.shape[1], w_down.shape[2]


def check_fused_experts(hidden: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                        gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str,
                        transposed: bool, interleaved: bool, swiglu_alpha: float, swiglu_limit: float) -> None:
    op = "fused_experts"
    _matrix(op, "hidden", hidden)
    if hidden.shape[1] == 0:
        raise ValueError(f"{op}: hidden must have at least one column; got shape {tuple(hidden.shape)}")
    _flag(op, "transposed", transposed)
    _flag(op, "interleaved", interleaved)
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        checks.tensor(op, name, weight, min_dim=3)
        checks.same_device(op, name, weight, "hidden", hidden)
        checks.same_dtype(op, name, weight, "hidden", hidden)
        if weight.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D [experts, ., .]; got shape {tuple(weight.shape)}")
    experts, hidden_size, gate_up_width, inter = _fused_dims(w_gate_up, w_down, transposed)
    gate_up_layout, down_layout = ("[E, H, 2I]", "[E, I, H]") if transposed else ("[E, 2I, H]", "[E, H, I]")
    if experts == 0 or hidden_size != hidden.shape[1] or gate_up_width == 0 or gate_up_width % 2:
        raise ValueError(f"{op}: w_gate_up must be {gate_up_layout} (transposed={transposed}) with E >= 1, "
                         f"H = hidden.shape[1] = {hidden.shape[1]} and an even 2I >= 2; got {tuple(w_gate_up.shape)}")
    expected_down = (experts, inter, hidden_size) if transposed else (experts, hidden_size, inter)
    if inter != gate_up_width // 2 or w_down.shape != expected_down:
        want = (experts, gate_up_width // 2, hidden_size) if transposed else (experts, hidden_size, gate_up_width // 2)
        raise ValueError(f"{op}: w_down must be {down_layout} = {want} to match w_gate_up {tuple(w_gate_up.shape)}; "
                         f"got {tuple(w_down.shape)}")
    _check_routing_tensors(op, topk_weights, topk_ids, hidden.shape[0], "hidden", hidden)
    for name, bias, width in (("gate_up_bias", gate_up_bias, gate_up_width), ("down_bias", down_bias, hidden_size)):
        if bias is not None:
            checks.tensor(op, name, bias)
            checks.same_device(op, name, bias, "hidden", hidden)
            checks.same_dtype(op, name, bias, "hidden", hidden)
            if bias.shape != (experts, width):
                raise ValueError(f"{op}: {name} must have shape ({experts}, {width}); got {tuple(bias.shape)}")
    checks.choice(op, "activation", activation, ACTIVATIONS)
    if interleaved and activation != "swiglu_oai":
        raise ValueError(f"{op}: interleaved gate/up columns are gpt-oss's layout and need activation='swiglu_oai'; "
                         f"got activation={activation!r}")
    checks.number(op, "swiglu_alpha", swiglu_alpha)
    checks.number(op, "swiglu_limit", swiglu_limit, positive=True)


# --------------------------------------------------------------------------------------------
# keys


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


class RouteKey(NamedTuple):
    device: str
    dtype: torch.dtype
    bias_dtype: Optional[torch.dtype]
    experts: int
    top_k: int
    scoring: str
    renormalize: bool
    n_group: int
    topk_group: int
    tokens: int
    int64: bool


class AlignKey(NamedTuple):
    device: str
    ids_dtype: torch.dtype
    experts: int
    top_k: int
    block_m: int
    tokens: int
    int64: bool


class GemmKey(NamedTuple):
    device: str
    dtype: torch.dtype
    experts: int
    n: int
    k: int
    pairs_per_row: int
    block_m: int
    transposed: bool
    has_bias: bool
    scale_dtype: Optional[torch.dtype]
    tokens: int  # bucketed pairs
    int64: bool


class FusedKey(NamedTuple):
    device: str
    dtype: torch.dtype
    weights_dtype: torch.dtype
    ids_dtype: torch.dtype
    experts: int
    hidden: int
    inter: int
    top_k: int
    activation: str
    transposed: bool
    interleaved: bool
    has_gate_up_bias: bool
    has_down_bias: bool
    tokens: int
    int64: bool


def moe_route_key(router_logits: Tensor, correction_bias: Optional[Tensor], top_k: int, scoring: str,
                  renormalize: bool, n_group: int, topk_group: int, routed_scaling_factor: float) -> RouteKey:
    return RouteKey(
        router_logits.device.type, router_logits.dtype, None if correction_bias is None else correction_bias.dtype,
        router_logits.shape[1], top_k, scoring, renormalize, n_group, topk_group,
        token_bucket(router_logits.shape[0]), checks.needs_int64(router_logits),
    )


def moe_align_key(topk_ids: Tensor, num_experts: int, block_m: int) -> AlignKey:
    slots = kernels.max_slots(topk_ids.numel(), num_experts, block_m)
    return AlignKey(topk_ids.device.type, topk_ids.dtype, num_experts, topk_ids.shape[1], block_m,
                    token_bucket(topk_ids.shape[0]), slots > checks.INT32_MAX or checks.needs_int64(topk_ids))


def grouped_gemm_key(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                     transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> GemmKey:
    blocks = block_experts.shape[0]
    block_m = sorted_pairs.shape[0] // blocks if blocks else 1
    n = weight.shape[2] if transposed else weight.shape[1]
    pairs = a.shape[0] * pairs_per_row
    return GemmKey(
        a.device.type, a.dtype, weight.shape[0], n, a.shape[1], pairs_per_row, block_m, transposed, bias is not None,
        None if scale is None else scale.dtype, token_bucket(pairs),
        checks.needs_int64(a, weight, bias, scale) or pairs * n > checks.INT32_MAX,
    )


def fused_experts_key(hidden: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                      gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, transposed: bool,
                      interleaved: bool, swiglu_alpha: float, swiglu_limit: float) -> FusedKey:
    experts, hidden_size, gate_up_width, inter = _fused_dims(w_gate_up, w_down, transposed)
    pairs = topk_ids.numel()
    return FusedKey(
        hidden.device.type, hidden.dtype, topk_weights.dtype, topk_ids.dtype, experts, hidden_size, inter,
        topk_ids.shape[1], activation, transposed, interleaved, gate_up_bias is not None, down_bias is not None,
        token_bucket(hidden.shape[0]),
        checks.needs_int64(hidden, w_gate_up, w_down, gate_up_bias, down_bias)
        or pairs * gate_up_width > checks.INT32_MAX,
    )


# --------------------------------------------------------------------------------------------
# launchers shared by the providers


def _flat(weight: Tensor) -> Tensor:
    """A 1-D view over ``weight``'s elements (strides are passed to the kernel separately)."""
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(weight.shape, weight.stride()))
    return weight.as_strided((extent if weight.numel() else 0,), (1,))


def _pair_blocks(tokens_bucket: int, top_k: int, cap: int) -> int:
    """Pairs per program of the alignment kernels.

    Either one block holds every pair of the token bucket, or every call of the bucket has at
    least two blocks: Helion specialises size-1 dimensions, and a plan's kernels are compiled
    once for all calls of its bucket.
    """
    bucket = max(tokens_bucket, 1)
    if next_power_of_2(bucket * top_k) <= cap:
        return next_power_of_2(bucket * top_k)
    if bucket == 1:
        return cap  # one token: the pair count is fixed
    fewest = (bucket // 2 + 1) * top_k  # the fewest pairs of a call in this bucket
    return 1 << (min(cap, fewest - 1).bit_length() - 1)


class _Aligner:
    """The three alignment kernels, compiled for one key."""

    def __init__(self, config: dict, num_experts: int, top_k: int, tokens_bucket: int, block_m: int,
                 example_ids: Tensor, int64: bool) -> None:
        self.num_experts, self.block_m = num_experts, block_m
        self.block_p = _pair_blocks(tokens_bucket, top_k, int(config.get("block_pairs", 64)))
        self.block_buckets = next_power_of_2(num_experts + 1)
        ids, counts, offsets, sorted_pairs, block_experts = self.buffers(example_ids.reshape(-1))
        self.count = kernels.count_pairs_kernel.compile(config["count"], (ids, counts, self.block_p), int64=int64)
        self.offsets = kernels.segment_offsets_kernel.compile(
            config["offsets"], (counts, torch.empty_like(counts), offsets, block_experts, block_m, self.block_buckets),
            int64=int64)
        self.scatter = kernels.scatter_pairs_kernel.compile(
            config["scatter"], (ids, counts, offsets, sorted_pairs, self.block_p), int64=int64)

    def buffers(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        pairs = ids.numel()
        slots = kernels.max_slots(pairs, self.num_experts, self.block_m)
        device = ids.device
        counts = torch.empty((-(-pairs // self.block_p), self.num_experts + 1), dtype=torch.int32, device=device)
        offsets = torch.zeros(self.num_experts + 2, dtype=torch.int32, device=device)
        sorted_pairs = torch.full((slots,), pairs, dtype=torch.int32, device=device)
        block_experts = torch.empty(slots // self.block_m, dtype=torch.int32, device=device)
        return ids, counts, offsets, sorted_pairs, block_experts

    def __call__(self, topk_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ids, counts, offsets, sorted_pairs, block_experts = self.buffers(topk_ids.reshape(-1))
        if ids.numel():
            block_base = torch.empty_like(counts)
            self.count(ids, counts, self.block_p)
            self.offsets(counts, block_base, offsets, block_experts, self.block_m, self.block_buckets)
            self.scatter(ids, block_base, offsets, sorted_pairs, self.block_p)
        return sorted_pairs, block_experts, offsets


class _Gemm:
    """The grouped GEMM kernel, compiled for one key; ``out`` rows are pairs."""

    def __init__(self, config: dict, a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor,
                 pairs_per_row: int, transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor],
                 out_dtype: torch.dtype, int64: bool) -> None:
        self.block_m = sorted_pairs.shape[0] // max(block_experts.shape[0], 1)
        self.pairs_per_row, self.transposed, self.out_dtype = pairs_per_row, transposed, out_dtype
        self.has_bias, self.has_scale = bias is not None, scale is not None
        args = self._args(a, weight, sorted_pairs, block_experts, bias, scale, self._out(a, weight))
        self.launch = kernels.grouped_gemm_kernel.compile(config, args, int64=int64)

    def _width(self, weight: Tensor) -> int:
        return weight.shape[2] if self.transposed else weight.shape[1]

    def _out(self, a: Tensor, weight: Tensor) -> Tensor:
        return torch.empty((a.shape[0] * self.pairs_per_row, self._width(weight)), dtype=self.out_dtype,
                           device=a.device)

    def _args(self, a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, bias: Optional[Tensor],
              scale: Optional[Tensor], out: Tensor) -> tuple:
        weight_flat = _flat(weight)
        stride_e, stride_1, stride_2 = weight.stride()
        stride_k, stride_n = (stride_1, stride_2) if self.transposed else (stride_2, stride_1)
        bias_flat = _flat(bias) if bias is not None else weight_flat
        bias_stride = bias.stride(0) if bias is not None else 0
        if bias is not None and bias.stride(1) != 1:
            bias_flat, bias_stride = bias.contiguous().view(-1), bias.shape[1]
        return (a, weight_flat, sorted_pairs, block_experts, bias_flat, scale if scale is not None else weight_flat,
                out, weight.shape[0], self.pairs_per_row, stride_e, stride_k, stride_n, bias_stride, self.block_m,
                self.has_bias, self.has_scale)

    def __call__(self, a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor,
                 bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
        out = self._out(a, weight)
        if sorted_pairs.numel() and out.numel():
            self.launch(*self._args(a, weight, sorted_pairs, block_experts, bias, scale, out))
        return out


def _kernel_dtype_problem(what: str, *dtypes: torch.dtype | None) -> str | None:
    for dtype in dtypes:
        if dtype is not None and dtype not in checks.KERNEL_DTYPES:
            return f"{what} dtype {dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    return None


# --------------------------------------------------------------------------------------------
# moe_route: the Helion provider


def _route_accepts(key: RouteKey) -> str | None:
    problem = _kernel_dtype_problem("router_logits / correction_bias", key.dtype, key.bias_dtype)
    if problem:
        return problem
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the routing kernel's {MAX_KERNEL_EXPERTS}"
    if key.top_k > MAX_KERNEL_TOP_K or key.n_group > MAX_KERNEL_GROUPS:
        return f"top_k {key.top_k} / n_group {key.n_group} exceed the routing kernel's {MAX_KERNEL_TOP_K} / " \
               f"{MAX_KERNEL_GROUPS} (its loops over them are unrolled)"
    return None


def _route_tuning_key(key: RouteKey) -> dict[str, object]:
    return {"dtype": _name(key.dtype), "experts": key.experts, "top_k": key.top_k, "scoring": key.scoring}


def _build_route(key: RouteKey, config: dict, args: tuple) -> object:
    logits, bias = args[0], args[1]
    top_k, has_bias = key.top_k, key.bias_dtype is not None
    block_e, block_k = next_power_of_2(key.experts), next_power_of_2(top_k)
    constants = (block_e, block_k, top_k, key.scoring, key.renormalize, has_bias, key.n_group, key.topk_group)

    def outputs(logits: Tensor) -> tuple[Tensor, Tensor]:
        rows = logits.shape[0]
        return (torch.empty((rows, top_k), dtype=torch.float32, device=logits.device),
                torch.empty((rows, top_k), dtype=torch.int64, device=logits.device))

    if key.tokens == 0:  # this key only ever sees empty calls
        return lambda logits, *rest: outputs(logits)
    weights, ids = outputs(logits)
    # Without a correction bias the kernel never reads that argument; any 1-D tensor binds it.
    launch = kernels.route_kernel.compile(
        config, (logits, bias if has_bias else logits[0], weights, ids, float(args[7]), *constants), int64=key.int64)

    def run(logits: Tensor, bias: Optional[Tensor], top_k: int, scoring: str, renormalize: bool, n_group: int,
            topk_group: int, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
        weights, ids = outputs(logits)
        if logits.shape[0]:
            launch(logits, bias if has_bias else logits[0], weights, ids, float(routed_scaling_factor), *constants)
        return weights, ids

    return run


# --------------------------------------------------------------------------------------------
# moe_align: the Helion provider


def _align_accepts(key: AlignKey) -> str | None:
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the alignment kernel's {MAX_KERNEL_EXPERTS}"
    return None


def _align_tuning_key(key: AlignKey) -> dict[str, object]:
    return {"experts": key.experts, "top_k": key.top_k, "block_m": key.block_m}


def _build_align(key: AlignKey, config: dict, args: tuple) -> object:
    if key.tokens == 0:
        return lambda topk_ids, num_experts, block_m: moe_align_reference(topk_ids, num_experts, block_m)
    aligner = _Aligner(config, key.experts, key.top_k, key.tokens, key.block_m, args[0], key.int64)

    def run(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
        return aligner(topk_ids)

    return run


# --------------------------------------------------------------------------------------------
# grouped_gemm: the Helion provider


def _gemm_accepts(key: GemmKey) -> str | None:
    return _kernel_dtype_problem("a / weight / scale", key.dtype, key.scale_dtype)


def _gemm_tuning_key(key: GemmKey) -> dict[str, object]:
    return {"dtype": _name(key.dtype), "experts": key.experts, "n": key.n, "k": key.k,
            "pairs_per_row": key.pairs_per_row, "block_m": key.block_m}


def _build_gemm(key: GemmKey, config: dict, args: tuple) -> object:
    a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, bias, scale = args
    out_dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    if key.tokens == 0:
        return _grouped_gemm_fake
    gemm = _Gemm(config, a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, bias, scale, out_dtype,
                 key.int64)

    def run(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
            transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
        return gemm(a, weight, sorted_pairs, block_experts, bias, scale)

    return run


# --------------------------------------------------------------------------------------------
# fused_experts: the Helion provider


def _fused_accepts(key: FusedKey) -> str | None:
    problem = _kernel_dtype_problem("hidden / weights / topk_weights", key.dtype, key.weights_dtype)
    if problem:
        return problem
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the alignment kernel's {MAX_KERNEL_EXPERTS}"
    return None


def _fused_tuning_key(key: FusedKey) -> dict[str, object]:
    return {"dtype": _name(key.dtype), "experts": key.experts, "hidden": key.hidden, "inter": key.inter,
            "top_k": key.top_k, "activation": key.activation}


def _activation(activation: str, interleaved: bool, alpha: float, limit: float) -> tuple[Op, tuple]:
    """The activation op and its arguments after ``x`` (the op, not a copy of its math)."""
    if activation == "swiglu_oai":
        return activations.swiglu_oai_op, (float(alpha), float(limit), interleaved)
    if activation == "silu":
        return activations.silu_and_mul_op, ()
    return activations.gelu_and_mul_op, ("tanh" if activation == "gelu_tanh" else "none",)


def _build_fused(key: FusedKey, config: dict, args: tuple) -> object:
    hidden, w_gate_up, w_down, topk_weights, topk_ids, gate_up_bias, down_bias = args[:7]
    top_k, block_m = key.top_k, int(config["block_m"])
    pair_dtype = torch.promote_types(key.dtype, key.weights_dtype)
    if key.tokens == 0:
        return lambda hidden, *rest: hidden.new_empty((0, key.hidden))
    aligner = _Aligner(config["align"], key.experts, top_k, key.tokens, block_m, topk_ids, key.int64)
    sorted_pairs, block_experts = aligner.buffers(topk_ids.reshape(-1))[3:]
    pairs = topk_ids.numel()
    gate_up = _Gemm(config["gate_up"], hidden, w_gate_up, sorted_pairs, block_experts, top_k, key.transposed,
                    gate_up_bias, None, key.dtype, key.int64)
    act_example = torch.empty((pairs, key.inter), dtype=key.dtype, device=hidden.device)
    down = _Gemm(config["down"], act_example, w_down, sorted_pairs, block_experts, 1, key.transposed, down_bias,
                 topk_weights.reshape(-1), pair_dtype, key.int64)
    out_example = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    pair_example = torch.empty((hidden.shape[0], top_k, key.hidden), dtype=pair_dtype, device=hidden.device)
    combine = kernels.combine_topk_kernel.compile(config["combine"], (pair_example, out_example, top_k),
                                                  int64=key.int64)

    def run(hidden: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor, topk_ids: Tensor,
            gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, transposed: bool,
            interleaved: bool, swiglu_alpha: float, swiglu_limit: float) -> Tensor:
        num_tokens = hidden.shape[0]
        out = torch.empty((num_tokens, key.hidden), dtype=key.dtype, device=hidden.device)
        if num_tokens == 0:
            return out
        sorted_pairs, block_experts, _ = aligner(topk_ids)
        projected = gate_up(hidden, w_gate_up, sorted_pairs, block_experts, gate_up_bias, None)
        act_op, options = _activation(activation, interleaved, swiglu_alpha, swiglu_limit)
        # Through the op's plan, not its dispatch: the activation is part of this call, not a call
        # of its own in trace_dispatch.
        gated = act_op.plan(projected, *options).run(projected, *options)
        pair_out = down(gated, w_down, sorted_pairs, block_experts, down_bias, topk_weights.reshape(-1))
        combine(pair_out.view(num_tokens, top_k, key.hidden), out, top_k)
        return out

    return run


def _helion_provider(build: object, accepts: object, spec: object, tuning_key: object) -> Provider:
    return Provider("helion", build, interpreters=frozenset({"triton", "helion"}), accepts=accepts, kernel=spec,
                    tuning_key=tuning_key, available=helion_available)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck)
#
# ``width`` is the hidden size. Widths of the MoE models below get their experts, top-k, expert
# width and routing; any other width gets a small generic layer (8 experts, top-2, I = width).


def example_routing(tokens: int, experts: int, top_k: int, device: str | torch.device,
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Distinct experts per token, spread over all experts, and positive weights summing to 1."""
    g = generator or torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return weights.to(device), ids.to(device)


def _example_route(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    logits = torch.randn(tokens, model.experts, dtype=dtype, device=device)
    if model.n_group > 1:
        bias = 0.1 * torch.randn(model.experts, device=device)
        return logits, bias, model.top_k, "sigmoid", True, model.n_group, model.topk_group, 2.5
    return logits, None, model.top_k, "softmax", True, 1, 1, 1.0


def _example_align(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    return example_routing(tokens, model.experts, model.top_k, device)[1], model.experts, 16


def _example_weights(experts: int, rows: int, cols: int, dtype: torch.dtype, device: str) -> Tensor:
    return torch.randn(experts, rows, cols, device=device, dtype=dtype) * cols**-0.5


def _example_gemm(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    experts, top_k, inter = model.experts, model.top_k, model.inter
    _, ids = example_routing(tokens, experts, top_k, device)
    sorted_pairs, block_experts, _ = moe_align_reference(ids, experts, 16)
    a = torch.randn(tokens, width, dtype=dtype, device=device)
    return a, _example_weights(experts, 2 * inter, width, dtype, device), sorted_pairs, block_experts, top_k, False, \
        None, None


def _example_fused(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    experts, top_k, inter = model.experts, model.top_k, model.inter
    weights, ids = example_routing(tokens, experts, top_k, device)
    hidden = torch.randn(tokens, width, dtype=dtype, device=device)
    return (hidden, _example_weights(experts, 2 * inter, width, dtype, device),
            _example_weights(experts, width, inter, dtype, device), weights, ids, None, None, "silu", False, False,
            1.702, 7.0)


moe_route_op = Op(
    "moe_route", moe_route_reference, check=check_moe_route, key=moe_route_key,
    providers=[_helion_provider(_build_route, _route_accepts, kernels.MOE_ROUTE, _route_tuning_key)],
    example_inputs=_example_route,
)
moe_align_op = Op(
    "moe_align", moe_align_reference, check=check_moe_align, key=moe_align_key,
    providers=[_helion_provider(_build_align, _align_accepts, kernels.MOE_ALIGN, _align_tuning_key)],
    example_inputs=_example_align,
)
grouped_gemm_op = Op(
    "grouped_gemm", grouped_gemm_reference, check=check_grouped_gemm, key=grouped_gemm_key,
    providers=[_helion_provider(_build_gemm, _gemm_accepts, kernels.GROUPED_GEMM, _gemm_tuning_key)],
    example_inputs=_example_gemm, fake=_grouped_gemm_fake, compiled_reference=_eager_reference,
)
fused_experts_op = Op(
    "fused_experts", fused_experts_reference, check=check_fused_experts, key=fused_experts_key,
    providers=[_helion_provider(_build_fused, _fused_accepts, kernels.FUSED_EXPERTS, _fused_tuning_key)],
    example_inputs=_example_fused, fake=_fused_experts_fake, compiled_reference=_eager_reference,
)


# --------------------------------------------------------------------------------------------
# public API


class MoEAlignment(NamedTuple):
    """What :func:`moe_align` returns and :func:`grouped_gemm` consumes (int32, on the device)."""

    sorted_pairs: Tensor
    block_experts: Tensor
    expert_offsets: Tensor

    @property
    def block_m(self) -> int:
        blocks = self.block_experts.shape[0]
        return self.sorted_pairs.shape[0] // blocks if blocks else 1


def moe_route(
    router_logits: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Pick ``top_k`` experts per token from router logits ``[T, E]``.

    Args:
        router_logits: ``[T, E]``; scored in fp32 whatever their dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (softmax over all experts, then top-k: Qwen-MoE, Mixtral, OLMoE),
            ``"sigmoid"`` (DeepSeek-V3: sigmoid scores, chosen by ``score + correction_bias``,
            weighted by the unbiased score) or ``"topk_then_softmax"`` (gpt-oss, Granite-MoE:
            top-k of the logits, softmax over those k).
        renormalize: divide the k weights by their sum (DeepSeek-V3 adds 1e-20 to the sum).
        correction_bias: ``[E]``, added to the scores only to choose experts.
        n_group, topk_group: DeepSeek-V3's group-limited routing: experts form ``n_group``
            groups, a group scores the sum of its two best (biased) scores, and only experts of
            the ``topk_group`` best groups are eligible (``scoring="sigmoid"`` only).
        routed_scaling_factor: multiplies the final weights.

    Returns:
        ``(weights [T, top_k] fp32, ids [T, top_k] int64)``, best expert first. Between equal
        scores the kernels pick the lower expert index; the reference follows ``torch.topk``,
        which leaves that choice unspecified (as the Hugging Face routers do). Cast the weights
        as the model does (Qwen casts them to the model dtype, Mixtral and DeepSeek-V3 keep fp32).
    """
    return moe_route_op(router_logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group,
                        routed_scaling_factor)


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the token/expert pairs of ``topk_ids [T, K]`` by expert, padded per expert to ``block_m`` rows.

    Pair ``p = t * K + k``. ``sorted_pairs`` lists each expert's pairs in order (then the pairs
    whose id is outside ``[0, num_experts)``), each segment padded with the value ``T * K`` to a
    multiple of ``block_m``; ``block_experts[j]`` is the expert of rows ``[j * block_m, (j + 1) *
    block_m)`` (``num_experts`` for the unrouted segment, -1 past the end); ``expert_offsets``
    (``[E + 2]``, non-decreasing) delimits the segments. Sizes are upper bounds computed from the
    shapes, so the call never waits for the device.
    """
    return MoEAlignment(*moe_align_op(topk_ids, num_experts, block_m))


def grouped_gemm(
    a: Tensor,
    weight: Tensor,
    alignment: MoEAlignment,
    *,
    pairs_per_row: int = 1,
    transposed: bool = False,
    bias: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
) -> Tensor:
    """One GEMM over all experts: ``out[p] = (a[p // pairs_per_row] @ W[e]^T + bias[e]) * scale[p]``.

    ``e`` is pair ``p``'s expert in ``alignment`` (from :func:`moe_align`); unrouted pairs give
    zero rows. With ``pairs_per_row = top_k`` and ``a`` the hidden states ``[T, K_in]`` the rows
    are gathered from the tokens inside the kernel (no ``[T * top_k, K_in]`` copy).

    Args:
        a: ``[M, K_in]``; the result has ``M * pairs_per_row`` rows.
        weight: ``[E, N, K_in]`` (``nn.Linear`` layout), or ``[E, K_in, N]`` with ``transposed=True``
            (``torch.nn.functional.grouped_mm``'s). Same dtype as ``a``.
        bias: ``[E, N]`` or None. scale: ``[M * pairs_per_row]`` (router weights) or None.

    Returns:
        ``[M * pairs_per_row, N]`` in pair order; dtype ``a.dtype``, or ``promote(a.dtype,
        scale.dtype)`` with a scale. Each product is rounded to ``a.dtype`` before the bias and the
        scale are applied, as ``grouped_mm`` followed by ``+ bias`` and ``* scale`` rounds.
    """
    return grouped_gemm_op(a, weight, alignment.sorted_pairs, alignment.block_experts, pairs_per_row, transposed,
                           bias, scale)


def fused_experts(
    hidden: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: str = "silu",
    transposed: bool = False,
    interleaved: bool = False,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> Tensor:
    """The routed experts of an MoE layer: ``sum_k w[t, k] * down_e(act(gate_up_e(hidden[t])))``.

    Args:
        hidden: ``[T, H]``, fp32/fp16/bf16 (fp64 runs on the reference).
        w_gate_up: ``[E, 2I, H]`` with the gate rows first (Hugging Face), or gate/up interleaved
            with ``interleaved=True``; ``[E, H, 2I]`` with ``transposed=True`` (gpt-oss). Same dtype
            as ``hidden``.
        w_down: ``[E, H, I]``, or ``[E, I, H]`` with ``transposed=True``.
        topk_weights: ``[T, K]`` router weights (any float dtype; the product is computed in
            ``promote(hidden.dtype, topk_weights.dtype)`` as Hugging Face does).
        topk_ids: ``[T, K]`` int32/int64; ids outside ``[0, E)`` contribute nothing.
        activation: ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` (``act(gate) * up``) or
            ``"swiglu_oai"`` (gpt-oss's clamped SwiGLU with ``swiglu_alpha``/``swiglu_limit``).
        gate_up_bias, down_bias: ``[E, 2I]`` / ``[E, H]`` or None (gpt-oss has both).

    Returns:
        ``[T, H]`` in ``hidden.dtype``.
    """
    return fused_experts_op(hidden, w_gate_up, w_down, topk_weights, topk_ids, gate_up_bias, down_bias, activation,
                            transposed, interleaved, swiglu_alpha, swiglu_limit)
