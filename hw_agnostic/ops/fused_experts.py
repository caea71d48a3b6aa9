"""``fused_experts``: the experts block of a Hugging Face MoE layer.

Grouped GEMM (gate/up) -> gated activation (the activation ops) -> grouped GEMM (down) scaled by
the router weight -> sum over the top-k, in one op: one alignment (:mod:`.moe_align`), two
grouped GEMMs (:mod:`.grouped_gemm`) and a combine kernel.

The reference is the specification and follows the Hugging Face code it replaces, including
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

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..autotune.shapes import moe_model
from ..kernels import fused_experts as kernels
from ..kernels.launch_binding import bindable
from . import activations, checks
from .grouped_gemm import Gemm, eager_reference, example_weights, project
from .moe_align import INDEX_DTYPES, Aligner
from .moe_common import MAX_KERNEL_EXPERTS, dtype_name, example_routing, helion_provider
from .registry import Op

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swiglu_oai")


# --------------------------------------------------------------------------------------------
# the spec


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
        gate_up = project(hidden[pairs // top_k], w_gate_up[expert], transposed)
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert]
        gated = gated_reference(gate_up, activation, interleaved, swiglu_alpha, swiglu_limit)
        y = project(gated, w_down[expert], transposed)
        if down_bias is not None:
            y = y + down_bias[expert]
        pair_out[pairs] = y * weight_of[pairs, None]
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


#: dtypes ``torch._grouped_mm`` multiplies on the CPU
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_experts(
    hidden: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor, topk_ids: Tensor,
    gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, transposed: bool, interleaved: bool,
    swiglu_alpha: float, swiglu_limit: float,
) -> Tensor:
    """What the reference provider runs on the CPU (the op's native form): the reference's computation with each
    projection one ``torch._grouped_mm`` over the pairs sorted by expert (its CPU kernel multiplies
    each expert's rows as the reference's per-expert product does: the same bits, the tests check)
    instead of a Python loop over the experts present. Qwen3-30B-A3B's experts in bf16: 16 tokens
    58 against 83 ms, 256 tokens 108 against 120. Other dtypes (and a torch whose ``_grouped_mm``
    does not, see :func:`_cpu_grouped_mm`) run the reference; other devices never come here (:func:`_native`)."""
    args = (hidden, w_gate_up, w_down, topk_weights, topk_ids, gate_up_bias, down_bias, activation, transposed,
            interleaved, swiglu_alpha, swiglu_limit)
    gate_up_weights = w_gate_up if transposed else w_gate_up.transpose(1, 2)
    down_weights = w_down if transposed else w_down.transpose(1, 2)
    num_tokens, hidden_size = hidden.shape
    if (hidden.dtype not in GROUPED_MM_DTYPES or not _cpu_grouped_mm(hidden.dtype)
            or not all(_fits_grouped_mm(w) for w in (gate_up_weights, down_weights))
            or (hidden_size * hidden.element_size()) % 16 or (down_weights.shape[1] * hidden.element_size()) % 16):
        return fused_experts_reference(*args)
    grouped_mm, top_k, num_experts = torch._grouped_mm, topk_ids.shape[1], w_gate_up.shape[0]
    expert_of = topk_ids.reshape(-1)
    # expert-parallel sentinels (ids outside [0, E)) sort last, past every expert's rows: no product reads them
    group = torch.where((expert_of >= 0) & (expert_of < num_experts), expert_of, num_experts)
    ends = torch.bincount(group, minlength=num_experts + 1)[:num_experts].cumsum(0).to(torch.int32)
    pairs = torch.argsort(group, stable=True)[: int(ends[-1])]
    gate_up = grouped_mm(hidden[pairs // top_k], gate_up_weights, offs=ends)
    experts = group[pairs] if gate_up_bias is not None or down_bias is not None else None
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[experts]
    gated = gated_reference(gate_up, activation, interleaved, swiglu_alpha, swiglu_limit)
    y = grouped_mm(gated, down_weights, offs=ends)
    if down_bias is not None:
        y = y + down_bias[experts]
    pair_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    pair_out = torch.zeros(num_tokens * top_k, hidden_size, dtype=pair_dtype, device=hidden.device)
    pair_out[pairs] = y * topk_weights.reshape(-1)[pairs, None]
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


@functools.lru_cache(maxsize=None)
def _cpu_grouped_mm(dtype: torch.dtype) -> bool:
    """Whether this torch's ``torch._grouped_mm`` multiplies ``dtype`` matrices on the CPU as the
    reference's per-expert ``F.linear`` does, bit for bit (probed once per dtype on a small problem
    in the Hugging Face layout, one expert idle)."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    g = torch.Generator().manual_seed(0)
    rows, weights = torch.randn(5, 16, generator=g).to(dtype), torch.randn(3, 8, 16, generator=g).to(dtype)
    try:
        out = grouped_mm(rows, weights.transpose(1, 2), offs=torch.tensor([2, 2, 5], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return (torch.equal(out[:2], torch.nn.functional.linear(rows[:2], weights[0]))
            and torch.equal(out[2:], torch.nn.functional.linear(rows[2:], weights[2])))


def _fits_grouped_mm(matrices: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``matrices`` (``[E, K, N]``) as its second operand, as it
    checks one: 16-byte aligned data, one of the last two dims unit-stride and the other's stride
    at least that dim's size and a multiple of 16 bytes. (Its first operands here, the gathered rows
    ``[M, H]`` and the activation ``[M, I]``, are fresh contiguous tensors: their row bytes are checked.)"""
    rows_stride, columns_stride = matrices.stride()[-2:]
    rows, columns = matrices.shape[-2:]
    if matrices.data_ptr() % 16:
        return False
    if columns_stride == 1 and rows_stride >= max(1, columns):
        outer = rows_stride
    elif rows_stride == 1 and columns_stride >= max(1, rows):
        outer = columns_stride
    else:
        return False
    return outer * matrices.element_size() % 16 == 0


def _native(key: FusedKey) -> object:
    """The op's faster eager form (see :func:`_grouped_experts`): on the CPU, compiling or not."""
    return _grouped_experts if key.device == "cpu" else None


def _fused_experts_fake(hidden: Tensor, *args: object) -> Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# checks


def _check_routing_tensors(op: str, topk_weights: Tensor | None, topk_ids: Tensor, num_tokens: int,
                           hidden_name: str, hidden: Tensor) -> None:
    checks.matrix(op, "topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    checks.same_device(op, "topk_ids", topk_ids, hidden_name, hidden)
    if topk_ids.shape[0] != num_tokens or topk_ids.shape[1] == 0:
        raise ValueError(f"{op}: topk_ids must have shape ({num_tokens}, top_k >= 1) to match {hidden_name}; "
                         f"got {tuple(topk_ids.shape)}")
    if topk_weights is not None:
        checks.matrix(op, "topk_weights", topk_weights)
        checks.same_device(op, "topk_weights", topk_weights, hidden_name, hidden)
        checks.same_shape(op, "topk_weights", topk_weights, "topk_ids", topk_ids)


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
    checks.matrix(op, "hidden", hidden)
    if hidden.shape[1] == 0:
        raise ValueError(f"{op}: hidden must have at least one column; got shape {tuple(hidden.shape)}")
    checks.flag(op, "transposed", transposed)
    checks.flag(op, "interleaved", interleaved)
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
# the Helion provider


def _fused_accepts(key: FusedKey) -> str | None:
    problem = checks.kernel_dtype_problem("hidden / weights / topk_weights", key.dtype, key.weights_dtype)
    if problem:
        return problem
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the alignment kernel's {MAX_KERNEL_EXPERTS}"
    return None


def _fused_tuning_key(key: FusedKey) -> dict[str, object]:
    return {"dtype": dtype_name(key.dtype), "experts": key.experts, "hidden": key.hidden, "inter": key.inter,
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
    aligner = Aligner(config["align"], key.experts, top_k, key.tokens, block_m, topk_ids, key.int64)
    sorted_pairs, block_experts = aligner.buffers(topk_ids.reshape(-1))[3:]
    pairs = topk_ids.numel()
    gate_up = Gemm(config["gate_up"], hidden, w_gate_up, sorted_pairs, block_experts, top_k, key.transposed,
                    gate_up_bias, None, key.dtype, key.int64)
    act_example = torch.empty((pairs, key.inter), dtype=key.dtype, device=hidden.device)
    down = Gemm(config["down"], act_example, w_down, sorted_pairs, block_experts, 1, key.transposed, down_bias,
                 topk_weights.reshape(-1), pair_dtype, key.int64)
    out_example = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    pair_example = torch.empty((hidden.shape[0], top_k, key.hidden), dtype=pair_dtype, device=hidden.device)
    combine = kernels.combine_topk_kernel.compile(config["combine"], (pair_example, out_example, top_k),
                                                  int64=key.int64)

    def running(aligner: Aligner, gate_up: Gemm, down: Gemm, combine: Any) -> Callable[..., Tensor]:
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
            # A step of this call: traced after it, and forced as it is (see Op.run_inside).
            gated = act_op.run_inside("fused_experts", projected, *options)
            pair_out = down(gated, w_down, sorted_pairs, block_experts, down_bias, topk_weights.reshape(-1))
            combine(pair_out.view(num_tokens, top_k, key.hidden), out, top_k)
            return out

        return run

    return bindable(running, aligner, gate_up, down, combine)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck; see .moe_common)


def _example_fused(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    experts, top_k, inter = model.experts, model.top_k, model.inter
    weights, ids = example_routing(tokens, experts, top_k, device)
    hidden = torch.randn(tokens, width, dtype=dtype, device=device)
    return (hidden, example_weights(experts, 2 * inter, width, dtype, device),
            example_weights(experts, width, inter, dtype, device), weights, ids, None, None, "silu", False, False,
            1.702, 7.0)


fused_experts_op = Op(
    "fused_experts", fused_experts_reference, check=check_fused_experts, key=fused_experts_key,
    providers=[helion_provider(_build_fused, _fused_accepts, kernels.FUSED_EXPERTS, _fused_tuning_key)],
    example_inputs=_example_fused, fake=_fused_experts_fake, compiled_reference=eager_reference, native=_native,
)


# --------------------------------------------------------------------------------------------
# public API


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
    return fused_experts_op.call(hidden, w_gate_up, w_down, topk_weights, topk_ids, gate_up_bias, down_bias,
                                 activation, transposed, interleaved, swiglu_alpha, swiglu_limit)
