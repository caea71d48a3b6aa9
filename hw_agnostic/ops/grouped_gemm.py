"""``grouped_gemm``: one launch over all experts, row ``p`` of the result is
``a[p // pairs_per_row] @ W[expert(p)]^T`` (+ bias) (* scale[p]).

The experts of each pair come from a :class:`~.moe_align.MoEAlignment`; pairs whose expert is
outside ``[0, E)`` give zero rows. :class:`Gemm` (the kernel compiled for one key),
:func:`project` and :func:`example_weights` also serve :mod:`.fused_experts`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..autotune.keys import token_bucket
from ..autotune.shapes import moe_model
from ..kernels import grouped_gemm as kernels
from ..kernels.fused_experts import default_block_m
from ..kernels.launch_binding import bindable, bound_copy
from . import checks
from .moe_align import MoEAlignment, moe_align_reference
from .moe_common import dtype_name, example_routing, helion_provider
from .registry import Op


# --------------------------------------------------------------------------------------------
# the spec


def _pair_experts(sorted_pairs: Tensor, block_experts: Tensor, num_pairs: int, num_experts: int) -> Tensor:
    """The expert of each pair as the alignment lists it (``num_experts``: not routed)."""
    pair_expert = torch.full((num_pairs + 1,), num_experts, dtype=torch.int64, device=sorted_pairs.device)
    if block_experts.numel():
        slot_expert = block_experts.to(torch.int64).repeat_interleave(sorted_pairs.numel() // block_experts.numel())
        pairs = sorted_pairs.to(torch.int64)
        listed = (pairs >= 0) & (pairs < num_pairs) & (slot_expert >= 0) & (slot_expert < num_experts)
        pair_expert.scatter_(0, torch.where(listed, pairs, num_pairs), torch.where(listed, slot_expert, num_experts))
    return pair_expert[:num_pairs]


def project(x: Tensor, weight: Tensor, transposed: bool) -> Tensor:
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
        y = project(a[pairs // pairs_per_row], weight[expert], transposed)
        if bias is not None:
            y = y + bias[expert]
        if scale is not None:
            y = y * scale[pairs, None]
        out[pairs] = y.to(out_dtype)
    return out


def _grouped_gemm_fake(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                       transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    width = weight.shape[2] if transposed else weight.shape[1]
    out_dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    return a.new_empty((a.shape[0] * pairs_per_row, width), dtype=out_dtype)


def eager_reference(op_name: str, reference: object) -> object:
    """The reference provider runs these references eagerly: they loop over the experts present,
    which ``torch.compile(fullgraph=True)`` cannot trace (data-dependent shapes)."""
    return reference


# --------------------------------------------------------------------------------------------
# checks


def check_grouped_gemm(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                       transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> None:
    op = "grouped_gemm"
    checks.matrix(op, "a", a)
    checks.tensor(op, "weight", weight, min_dim=3)
    checks.same_device(op, "weight", weight, "a", a)
    checks.same_dtype(op, "weight", weight, "a", a)
    checks.flag(op, "transposed", transposed)
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
    checks.integer(op, "pairs_per_row", pairs_per_row, minimum=1)
    width = weight.shape[2] if transposed else weight.shape[1]
    if bias is not None:
        checks.tensor(op, "bias", bias)
        checks.same_device(op, "bias", bias, "a", a)
        checks.same_dtype(op, "bias", bias, "a", a)
        if bias.shape != (weight.shape[0], width):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]}, {width}); got {tuple(bias.shape)}")
    if scale is not None:
        checks.vector(op, "scale", scale, a.shape[0] * pairs_per_row, "a", a)


# --------------------------------------------------------------------------------------------
# keys


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


# --------------------------------------------------------------------------------------------
# the kernel, compiled for one key


def _flat(weight: Tensor) -> Tensor:
    """A 1-D view over ``weight``'s elements (strides are passed to the kernel separately)."""
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(weight.shape, weight.stride()))
    return weight.as_strided((extent if weight.numel() else 0,), (1,))


class Gemm:
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

    def bound(self) -> Gemm:
        """This GEMM for the calls of one signature (see :mod:`..kernels.launch_binding`)."""
        return bound_copy(self, "launch")

    def __call__(self, a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor,
                 bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
        out = self._out(a, weight)
        if sorted_pairs.numel() and out.numel():
            self.launch(*self._args(a, weight, sorted_pairs, block_experts, bias, scale, out))
        return out


# --------------------------------------------------------------------------------------------
# the Helion provider


def _gemm_accepts(key: GemmKey) -> str | None:
    return checks.kernel_dtype_problem("a / weight / scale", key.dtype, key.scale_dtype)


def _gemm_tuning_key(key: GemmKey) -> dict[str, object]:
    return {"dtype": dtype_name(key.dtype), "experts": key.experts, "n": key.n, "k": key.k,
            "pairs_per_row": key.pairs_per_row, "block_m": key.block_m}


def _build_gemm(key: GemmKey, config: dict, args: tuple) -> object:
    a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, bias, scale = args
    out_dtype = a.dtype if scale is None else torch.promote_types(a.dtype, scale.dtype)
    if key.tokens == 0:
        return _grouped_gemm_fake
    gemm = Gemm(config, a, weight, sorted_pairs, block_experts, pairs_per_row, transposed, bias, scale, out_dtype,
                 key.int64)

    def running(gemm: Gemm) -> Callable[..., Tensor]:
        def run(a: Tensor, weight: Tensor, sorted_pairs: Tensor, block_experts: Tensor, pairs_per_row: int,
                transposed: bool, bias: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
            return gemm(a, weight, sorted_pairs, block_experts, bias, scale)

        return run

    return bindable(running, gemm)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck; see .moe_common)


def example_weights(experts: int, rows: int, cols: int, dtype: torch.dtype, device: str) -> Tensor:
    return torch.randn(experts, rows, cols, device=device, dtype=dtype) * cols**-0.5


def _example_gemm(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    experts, top_k, inter = model.experts, model.top_k, model.inter
    _, ids = example_routing(tokens, experts, top_k, device)
    # The rows per block fused_experts would align these tokens to (prefill reaches 64: wgmma's M).
    block_m = default_block_m(tokens, top_k, experts)
    sorted_pairs, block_experts, _ = moe_align_reference(ids, experts, block_m)
    a = torch.randn(tokens, width, dtype=dtype, device=device)
    return a, example_weights(experts, 2 * inter, width, dtype, device), sorted_pairs, block_experts, top_k, False, \
        None, None


grouped_gemm_op = Op(
    "grouped_gemm", grouped_gemm_reference, check=check_grouped_gemm, key=grouped_gemm_key,
    providers=[helion_provider(_build_gemm, _gemm_accepts, kernels.GROUPED_GEMM, _gemm_tuning_key)],
    example_inputs=_example_gemm, fake=_grouped_gemm_fake, compiled_reference=eager_reference,
)


# --------------------------------------------------------------------------------------------
# public API


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
    return grouped_gemm_op.call(a, weight, alignment.sorted_pairs, alignment.block_experts, pairs_per_row,
                                transposed, bias, scale)
