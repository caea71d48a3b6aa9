"""``gated_rms_norm``: RMS norm combined with an activation gate; spec, checks and dispatch.

The reference below is the specification. It reproduces the gated RMSNorms of the hybrid
linear-attention and Mamba-2 families, which differ in three ways:

* ``order``: ``"gate_then_norm"`` normalises ``x * act(gate)`` (Mamba-2 and its descendants);
  ``"norm_then_gate"`` multiplies the normalised, scaled ``x`` by ``act(gate)`` (Qwen3-Next,
  Kimi-Linear, Falcon-H1's default).
* ``group_size``: the statistics are taken over groups of ``group_size`` consecutive elements
  of the last dimension (Mamba-2's ``n_groups``); the default is the whole row.
* ``numerics``, where the module rounds:

  ==============  ==========================================================================
  ``llama``       normalise in fp32, round to ``x.dtype``, multiply by ``weight`` in the
                  promoted dtype; ``norm_then_gate`` then multiplies by the fp32 gate and
                  rounds to ``x.dtype``; ``gate_then_norm`` returns the product as it is
                  (dtype: ``x`` promoted with ``weight``)
  ``fp32_scale``  everything in fp32 (``weight.float() * normed``, the gate), one rounding to
                  ``x.dtype``
  ==============  ==========================================================================

The gate is always ``act(gate.float())``, and in ``gate_then_norm`` it multiplies the upcast
``x`` (``x.float() * act(gate.float())``). ``activation`` is ``"silu"`` or ``"sigmoid"``. A
missing gate (Mamba-2's ``gate=None``) leaves a (grouped) RMS norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import gated_rms_norm as kernels
from ..kernels.launch_binding import bindable
from ..kernels.runtime import helion_available
from . import checks
from .compiled_reference import SINGLE_THREAD_ELEMENTS, lean_compiled_reference
from .registry import Op, Provider, compile_reference_enabled
from .rms_norm import MAX_KERNEL_HIDDEN

ORDERS = kernels.ORDERS
NUMERICS = kernels.NUMERICS
ACTIVATIONS = kernels.ACTIVATIONS


# --------------------------------------------------------------------------------------------
# the spec


def _activate(gate: Tensor, activation: str) -> Tensor:
    return torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate)


def _mean_square_normalise(groups: Tensor, eps: float) -> Tensor:
    return groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)


def gated_rms_norm_reference(
    x: Tensor,
    gate: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    order: str,
    group_size: Optional[int],
    numerics: str,
    activation: str,
) -> Tensor:
    return _gated_rms_norm(x, gate, weight, eps, order, group_size, numerics, activation, _mean_square_normalise)


def _gated_rms_norm(
    x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], eps: float, order: str, group_size: Optional[int],
    numerics: str, activation: str, normalise: Callable[[Tensor, float], Tensor],
) -> Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    act = None if gate is None else _activate(gate.to(compute), activation)
    if act is not None and order == "gate_then_norm":
        h = h * act
    hidden = h.shape[-1]
    if group_size is None or group_size == hidden:
        normed = normalise(h, eps)
    else:
        normed = normalise(h.reshape(*h.shape[:-1], hidden // group_size, group_size), eps).reshape(h.shape)
    if numerics == "llama":
        y = normed.to(x.dtype)
        if weight is not None:
            y = weight * y
        if order == "gate_then_norm":
            return y
        if act is not None:
            y = y * act
        return y.to(x.dtype)
    y = normed if weight is None else weight.to(compute) * normed
    if act is not None and order == "norm_then_gate":
        y = y * act
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------
# the native path: on the CPU, ``torch.rms_norm`` of the fp32 groups is the spec's mean-square
# normalisation op for op (bit-identical, NaN and overflow included; tests/test_cpu_path.py), one
# call where the spec makes five, for engines that run the reference eagerly (the vLLM plugin's
# ``native`` mode). Not while the reference is compiled: the lean compiled reference, one fused
# pass, took 15 us where this took 35 at 1 x 8192 bf16, and 7 against 24 at 1 x 128.


def _rms_norm_normalise(groups: Tensor, eps: float) -> Tensor:
    return torch.rms_norm(groups, (groups.shape[-1],), None, eps)


def _native(key: "GatedKey") -> Optional[Callable[..., Tensor]]:
    if key.device != "cpu" or compile_reference_enabled():
        return None

    def native(x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], eps: float, order: str,
               group_size: Optional[int], numerics: str, activation: str) -> Tensor:
        return _gated_rms_norm(x, gate, weight, eps, order, group_size, numerics, activation, _rms_norm_normalise)

    return native


class _GroupsAsRows:
    """The lean compiled reference, given a large grouped call's groups as rows of their own.

    ``x [..., hidden]`` in groups of ``group_size`` is normalised as ``x [..., groups, group_size]``
    over its last dimension, with ``weight [groups, group_size]``: the same products per element,
    on views (so the result is the spec's), while the graph Inductor sees has no ``hidden //
    group_size`` to index by. Traced with the groups inside the row, every size symbolic, its
    pointwise pass took a modulo and a division per vector: 4096 x 8192 fp32 in 8 groups ran 96 ms,
    57 as rows (HF's module 184-197); 256 rows 1.29 against 1.03 ms. Calls that run on one thread
    (up to ``SINGLE_THREAD_ELEMENTS``, in cache) gain nothing and keep the row, without the views'
    microseconds."""

    def __init__(self, op_name: str, reference: Callable[..., Tensor]) -> None:
        self.compiled = lean_compiled_reference(op_name, reference)

    def __call__(self, *args: object) -> Tensor:
        shapes = _group_shapes(args)
        if shapes is None:
            return self.compiled(*args)
        return self.compiled(*_as_rows(args, *shapes)).view(args[0].shape)

    def bind(self, args: tuple) -> Optional[Callable[..., Tensor]]:
        """See :meth:`.CompiledReference.bind`: the views' shapes are the signature's."""
        shapes = _group_shapes(args)
        if shapes is None:
            return self.compiled.bind(args)
        run_rows = self.compiled.bind(_as_rows(args, *shapes))
        if run_rows is None:
            return None
        out_shape = args[0].shape

        def run(*args: object) -> Tensor:
            return run_rows(*_as_rows(args, *shapes)).view(out_shape)

        return run


def _group_shapes(args: tuple) -> Optional[tuple[tuple[int, ...], tuple[int, int]]]:
    """``(x's and the gate's shape, weight's shape)`` with each group a row, for a grouped call that
    runs on the intra-op threads; None for the others."""
    x, group_size = args[0], args[5]
    hidden = x.shape[-1]
    if group_size is None or group_size == hidden or x.numel() <= SINGLE_THREAD_ELEMENTS:
        return None
    groups = (hidden // group_size, group_size)
    return (*x.shape[:-1], *groups), groups


def _as_rows(args: tuple, rows_shape: tuple[int, ...], weight_shape: tuple[int, int]) -> tuple:
    x, gate, weight, eps, order, _, numerics, activation = args
    return (x.view(rows_shape), None if gate is None else gate.view(rows_shape),
            None if weight is None else weight.view(weight_shape), eps, order, None, numerics, activation)


# --------------------------------------------------------------------------------------------
# checks and keys


class GatedKey(NamedTuple):
    device: str
    dtype: torch.dtype
    gate_dtype: Optional[torch.dtype]
    weight_dtype: Optional[torch.dtype]
    out_dtype: torch.dtype
    hidden: int
    group_size: int
    tokens: int
    order: str
    numerics: str
    activation: str
    rows_collapse: bool
    int64: bool


OP = "gated_rms_norm"


def check_gated_rms_norm(
    x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], eps: float, order: str, group_size: Optional[int],
    numerics: str, activation: str,
) -> None:
    checks.tensor(OP, "x", x)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"{OP}: x's last dimension (the normalised one) must be >= 1; got shape {tuple(x.shape)}")
    if gate is not None:
        checks.tensor(OP, "gate", gate)
        checks.same_device(OP, "gate", gate, "x", x)
        checks.same_shape(OP, "gate", gate, "x", x)
    if weight is not None:
        checks.vector(OP, "weight", weight, hidden, "x", x)
    checks.number(OP, "eps", eps, minimum=0.0)
    checks.choice(OP, "order", order, ORDERS)
    if group_size is not None:
        checks.integer(OP, "group_size", group_size, minimum=1)
        if hidden % group_size:
            raise ValueError(
                f"{OP}: group_size must divide x's last dimension {hidden} into whole groups; got {group_size}"
            )
    checks.choice(OP, "numerics", numerics, NUMERICS)
    checks.choice(OP, "activation", activation, ACTIVATIONS)


def _out_dtype(x: Tensor, weight: Optional[Tensor], order: str, numerics: str) -> torch.dtype:
    if numerics == "llama" and order == "gate_then_norm" and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def gated_rms_norm_key(
    x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], eps: float, order: str, group_size: Optional[int],
    numerics: str, activation: str,
) -> GatedKey:
    hidden = x.shape[-1]
    group_size = hidden if group_size is None else group_size
    return GatedKey(
        x.device.type, x.dtype, None if gate is None else gate.dtype, None if weight is None else weight.dtype,
        _out_dtype(x, weight, order, numerics), hidden, group_size, token_bucket(x.numel() // hidden), order,
        numerics, activation, checks.rows_collapse(x) and (gate is None or checks.rows_collapse(gate)),
        checks.needs_int64(x, gate),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: GatedKey) -> str | None:
    problem = checks.kernel_dtype_problem("input", key.dtype) or checks.kernel_dtype_problem(
        "gate / weight", key.gate_dtype, key.weight_dtype)
    if problem is not None:
        return problem
    if key.group_size > MAX_KERNEL_HIDDEN:
        return f"group size {key.group_size} exceeds the kernel's {MAX_KERNEL_HIDDEN}"
    if not key.rows_collapse:
        return "the leading dimensions do not collapse into one row stride"
    return None


def _tuning_key(key: GatedKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "width": key.group_size,
            "groups": key.hidden // key.group_size}


def _build(key: GatedKey, config: dict, args: tuple) -> object:
    x, gate, weight, eps = args[:4]
    order, numerics, activation, group_size = key.order, key.numerics, key.activation, key.group_size
    groups = key.hidden // group_size
    has_gate, has_weight = gate is not None, weight is not None
    round_product = has_weight and torch.promote_types(key.dtype, key.weight_dtype) == key.dtype
    absent_gate = x.new_empty((1, 1, 1)).expand(1, groups, group_size)
    absent_weight = x.new_empty((1, 1)).expand(groups, group_size)
    constexprs = (order, numerics, activation, has_gate, has_weight, round_product)

    def launch_args(x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], out: Tensor, eps: float) -> tuple:
        return (
            x.view(-1, groups, group_size),
            absent_gate if gate is None else gate.view(-1, groups, group_size),
            absent_weight if weight is None else weight.view(groups, group_size),
            out.view(-1, groups, group_size), eps, *constexprs,
        )

    out = torch.empty(x.shape, dtype=key.out_dtype, device=x.device)
    launch = kernels.gated_rms_norm_kernel.compile(config, launch_args(x, gate, weight, out, eps), int64=key.int64)

    def running(launch: Any) -> Callable[..., Tensor]:
        def run(x: Tensor, gate: Optional[Tensor], weight: Optional[Tensor], eps: float, order: str,
                group_size: Optional[int], numerics: str, activation: str) -> Tensor:
            out = torch.empty_like(x, dtype=key.out_dtype, memory_format=torch.contiguous_format)
            if out.numel():
                launch(*launch_args(x, gate, weight, out, eps))
            return out

        return run

    return bindable(running, launch)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck)


def _example(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    gate = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    # Head-dim rows are Qwen3-Next's norm-then-gate; wide rows Mamba-2's gate-then-norm in 8 groups.
    if hidden <= 256 or hidden % 8:
        return x, gate, weight, 1e-6, "norm_then_gate", None, "llama", "silu"
    return x, gate, weight, 1e-6, "gate_then_norm", hidden // 8, "llama", "silu"


gated_rms_norm_op = Op(
    "gated_rms_norm", gated_rms_norm_reference, check=check_gated_rms_norm, key=gated_rms_norm_key,
    providers=[Provider(
        "helion", _build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
        kernel=kernels.GATED_RMS_NORM, tuning_key=_tuning_key, available=helion_available,
    )],
    example_inputs=_example, differentiable=True, fusable=True, native=_native, compiled_reference=_GroupsAsRows,
)


# --------------------------------------------------------------------------------------------
# public API


def gated_rms_norm(
    x: Tensor,
    gate: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    *,
    order: str = "norm_then_gate",
    group_size: Optional[int] = None,
    numerics: str = "llama",
    activation: str = "silu",
) -> Tensor:
    """RMS-normalise ``x`` over its last dimension (in groups) and gate it with ``act(gate)``.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16 (fp64 runs on the reference). Rows may be strided.
        gate: like ``x`` (any float dtype; it is upcast to fp32), or None for no gate.
        weight: ``[hidden]`` or None.
        eps: added to the mean square before the reciprocal square root.
        order: ``"norm_then_gate"`` (Qwen3-Next, Kimi-Linear, Falcon-H1) or ``"gate_then_norm"``
            (Mamba-2, Bamba, Nemotron-H, Zamba2, Granite-MoE-Hybrid).
        group_size: normalise over groups of this many elements (Mamba-2's ``hidden // n_groups``);
            None for the whole row.
        numerics: ``"llama"`` (round before the weight, as most modules) or ``"fp32_scale"``
            (all fp32: Falcon-H1, Kimi-Linear).
        activation: ``"silu"`` or ``"sigmoid"`` (Kimi-Linear).

    Returns:
        A new tensor shaped like ``x``; dtype ``x.dtype``, except ``llama`` with
        ``gate_then_norm``, which returns ``weight * normed`` in their promoted dtype as Mamba-2 does.
    """
    return gated_rms_norm_op.call(x, gate, weight, eps, order, group_size, numerics, activation)
