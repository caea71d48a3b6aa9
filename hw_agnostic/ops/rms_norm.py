"""``rms_norm`` and ``fused_add_rms_norm``: spec, checks and dispatch.

The references below are the specification. They normalise over the last dimension in fp32 (in
fp64 for fp64 inputs, so the tests can evaluate the spec exactly) and cast where the Hugging
Face module of each ``numerics`` casts:

==============  =======================================================  ======================
numerics        result                                                   HF modules
==============  =======================================================  ======================
``llama``       ``weight * normed.to(x.dtype)`` (dtype: promoted)        Llama, Mistral, Qwen,
                                                                         Phi-3, Granite, ...
``fp32_scale``  ``(weight * normed).to(x.dtype)``                        OLMo-2, gpt-oss
``gemma``       ``(normed * (1 + weight.float())).to(x.dtype)``          Gemma 1/2/3
==============  =======================================================  ======================

``fused_add_rms_norm`` adds the residual in the input dtype first (``residual + x``, as the
decoder layers do) and normalises that sum. In-place contract of the ``inplace=True`` form
(the serving-engine form, one pass over memory and no allocation): on return ``x`` holds the
normalised output and ``residual`` holds ``x + residual``; both are returned. It requires that
``x`` and ``residual`` do not overlap and that the result dtype equals ``x.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import rms_norm as kernels
from ..kernels.launch_binding import bindable, replayed
from ..kernels.runtime import helion_available
from . import checks, compiled_reference
from .compiled_reference import CompiledReference, lean_compiled_reference
from .registry import Op, Provider, compile_reference_enabled

NUMERICS = kernels.NUMERICS
MAX_KERNEL_HIDDEN = 65536


# --------------------------------------------------------------------------------------------
# the spec


def _mean_square_normalise(xf: Tensor, eps: float) -> Tensor:
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _normalise(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str,
               normalise: Callable[[Tensor, float], Tensor] = _mean_square_normalise) -> Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    normed = normalise(xf, eps)
    if weight is None:
        return normed.to(x.dtype)
    if numerics == "llama":
        return weight * normed.to(x.dtype)
    if numerics == "fp32_scale":
        return (weight.to(compute) * normed).to(x.dtype)
    return (normed * (1.0 + weight.to(compute))).to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> Tensor:
    return _normalise(x, weight, eps, numerics)


def fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str
) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return _normalise(summed, weight, eps, numerics), summed


def fused_add_rms_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str
) -> None:
    normed, summed = fused_add_rms_norm_reference(x, residual, weight, eps, numerics)
    residual.copy_(summed)
    x.copy_(normed)


def _normalise_into(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
    x.copy_(_normalise(residual, weight, eps, numerics))


def _add_into(residual: Tensor, x: Tensor) -> None:
    residual.add_(x)


#: 16-bit in-place calls of at least this many elements add the residual in compiled code: ATen's
#: bf16 add rounds each sum in a slower loop than Inductor's (measured on an Intel Xeon, 2 threads:
#: 16 x 4096 bf16 13.2 against 12.6 us, 256 rows 191 against 125, 4096 rows 9.5 against 3.7 ms;
#: 4 rows 5.1 against 6.3, where the compiled call's own cost shows). fp32 adds run at the same speed.
COMPILED_ADD_ELEMENTS = compiled_reference.SINGLE_THREAD_ELEMENTS
_COMPILED_ADD_DTYPES = (torch.bfloat16, torch.float16)


class CompiledAddThenNormalise:
    """An in-place fused norm's reference as the reference provider runs it when compiling.

    Inductor (torch 2.13) fails on a reduction over an input the same graph mutates (a ``KeyError``
    naming a buffer, in its outer-loop fusion with local buffers; also when the graph computes the
    sum twice instead of reading it back), so the residual is added in place first and only
    ``normalise_into(x, residual, *rest)``, which reads ``residual`` and writes ``x``, is compiled
    as a graph of its own. The add is a compiled graph too for large 16-bit calls (see
    :data:`COMPILED_ADD_ELEMENTS`), else ATen's. Same result as the reference: ``residual + x``
    rounds the same in place, either way. Both graphs split the rows into the same halves between
    the threads (the add's flat range falls on row boundaries for an even row count), so the
    normalising pass mostly reads rows its thread just wrote. (Splitting large calls into cache-sized
    row blocks was measured slower on the shared 2-core machine: every block adds two OpenMP
    regions, and a region waits for a scheduler quantum whenever the other core is busy.)
    """

    def __init__(self, op_name: str, normalise_into: Callable[..., None], *, lean: bool = False) -> None:
        self.add_into = CompiledReference(op_name, _add_into, lean=lean)
        self.normalise_into = CompiledReference(op_name, normalise_into, lean=lean)

    @classmethod
    def lean_over(cls, normalise_into: Callable[..., None]) -> Callable[[str, object], "CompiledAddThenNormalise"]:
        """The op's ``compiled_reference`` factory: a lean instance over ``normalise_into``."""

        def factory(op_name: str, reference: object) -> CompiledAddThenNormalise:
            return cls(op_name, normalise_into, lean=True)

        factory.__doc__ = cls.__doc__  # what ``hw-agnostic doctor`` says the CPU path runs
        return factory

    def __call__(self, x: Tensor, residual: Tensor, *rest: object) -> None:
        if _compiles_add(x, residual):
            self.add_into(residual, x)
        else:
            residual.add_(x)
        self.normalise_into(x, residual, *rest)

    def bind(self, args: tuple) -> Optional[Callable[..., None]]:
        """See :meth:`CompiledReference.bind`: both steps bound to these arguments, or None."""
        x, residual = args[0], args[1]
        normalise = self.normalise_into.bind(args)
        add = self.add_into.bind((residual, x)) if _compiles_add(x, residual) else _add_into
        if normalise is None or add is None:
            return None

        def run(x: Tensor, residual: Tensor, *rest: object) -> None:
            add(residual, x)
            normalise(x, residual, *rest)

        return run


def _compiles_add(x: Tensor, residual: Tensor) -> bool:
    """Large contiguous 16-bit CPU calls (the lean graph's: strided ones, and other devices, would go
    through Dynamo's guards for an add their own kernel does as well)."""
    return (x.dtype in _COMPILED_ADD_DTYPES and x.is_cpu and x.numel() >= COMPILED_ADD_ELEMENTS
            and x.is_contiguous() and residual.is_contiguous())


# --------------------------------------------------------------------------------------------
# the native path: on the CPU, ``torch.rms_norm`` of the upcast rows is the spec's mean-square
# normalisation op for op (bit-identical, NaN and overflow included; tests/test_cpu_path.py), one
# call where the spec makes five: the spec eagerly in fewer calls than the HF module makes, for
# engines that run the reference eagerly (the vLLM plugin's ``native`` mode).


def _rms_norm_normalise(xf: Tensor, eps: float) -> Tensor:
    return torch.rms_norm(xf, (xf.shape[-1],), None, eps)


def _native(form: str) -> Callable[["NormKey"], Optional[Callable[..., object]]]:
    """``native(key)`` of the op's ``form`` (``"norm"``, ``"add"`` or ``"add_inplace"``), or None."""

    def native(key: NormKey) -> Optional[Callable[..., object]]:
        # Not while the reference is compiled: the bench's decode rows ran 0.76-0.92x the HF module
        # natively, at least 1.0x on the lean compiled reference.
        if key.device != "cpu" or compile_reference_enabled():
            return None

        def norm(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> Tensor:
            return _normalise(x, weight, eps, numerics, _rms_norm_normalise)

        def add(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                numerics: str) -> tuple[Tensor, Tensor]:
            summed = residual + x
            return _normalise(summed, weight, eps, numerics, _rms_norm_normalise), summed

        def add_inplace(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
            residual.add_(x)  # residual + x, rounded as the reference rounds it
            x.copy_(_normalise(residual, weight, eps, numerics, _rms_norm_normalise))

        return {"norm": norm, "add": add, "add_inplace": add_inplace}[form]

    return native


# --------------------------------------------------------------------------------------------
# checks and keys


class NormKey(NamedTuple):
    device: str
    dtype: torch.dtype
    weight_dtype: Optional[torch.dtype]
    out_dtype: torch.dtype
    hidden: int
    tokens: int
    numerics: str
    rows_collapse: bool
    int64: bool


def _check_norm_args(op: str, x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
    checks.tensor(op, "x", x)
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: x's last dimension (the normalised one) must be >= 1; got shape {tuple(x.shape)}")
    if weight is not None:
        checks.tensor(op, "weight", weight)
        checks.same_device(op, "weight", weight, "x", x)
        if weight.shape != (x.shape[-1],):
            raise ValueError(
                f"{op}: weight must have shape ({x.shape[-1]},) to match x's last dimension; got {tuple(weight.shape)}"
            )
    checks.number(op, "eps", eps, minimum=0.0)
    checks.choice(op, "numerics", numerics, NUMERICS)


def _out_dtype(x: Tensor, weight: Optional[Tensor], numerics: str) -> torch.dtype:
    if weight is not None and numerics == "llama" and weight.dtype != x.dtype:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _check_residual(op: str, x: Tensor, residual: Tensor) -> None:
    checks.tensor(op, "residual", residual)
    checks.same_device(op, "residual", residual, "x", x)
    checks.same_shape(op, "residual", residual, "x", x)
    checks.same_dtype(op, "residual", residual, "x", x)


def check_rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
    _check_norm_args("rms_norm", x, weight, eps, numerics)


def check_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
    _check_norm_args("fused_add_rms_norm", x, weight, eps, numerics)
    _check_residual("fused_add_rms_norm", x, residual)


def check_fused_add_rms_norm_inplace(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str
) -> None:
    op = "fused_add_rms_norm(inplace=True)"
    _check_norm_args(op, x, weight, eps, numerics)
    _check_residual(op, x, residual)
    out_dtype = _out_dtype(x, weight, numerics)
    if out_dtype != x.dtype:
        raise TypeError(
            f"{op}: the result dtype {out_dtype} (x {x.dtype} times weight "
            f"{weight.dtype if weight is not None else None} in numerics {numerics!r}) differs from x's, "
            "so it cannot be written into x; pass inplace=False"
        )
    check_inplace_buffers(op, x, residual, weight)


def check_inplace_buffers(op: str, x: Tensor, residual: Tensor, *read: Optional[Tensor]) -> None:
    """The in-place fused norms write ``x`` and ``residual``: each must own its memory, and
    neither may share memory with the other or with a parameter the op reads."""
    checks.no_aliasing(op, (("x", x), ("residual", residual)), tuple(zip(("weight", "bias"), read)))


def rms_norm_key(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> NormKey:
    return _key(x, weight, numerics)


def fused_add_rms_norm_key(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str
) -> NormKey:
    return _key(x, weight, numerics, residual)


def _key(x: Tensor, weight: Optional[Tensor], numerics: str, *more: Tensor) -> NormKey:
    hidden = x.shape[-1]
    return NormKey(
        x.device.type, x.dtype, None if weight is None else weight.dtype, _out_dtype(x, weight, numerics), hidden,
        token_bucket(x.numel() // hidden), numerics,
        checks.rows_collapse(x) and all(checks.rows_collapse(t) for t in more),
        checks.needs_int64(x, *more),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: NormKey) -> str | None:
    if key.dtype not in checks.KERNEL_DTYPES or key.weight_dtype not in (None, *checks.KERNEL_DTYPES):
        return f"dtype {key.dtype} / weight {key.weight_dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    if key.hidden > MAX_KERNEL_HIDDEN:
        return f"hidden size {key.hidden} exceeds the kernel's {MAX_KERNEL_HIDDEN}"
    if not key.rows_collapse:
        return "the leading dimensions do not collapse into one row stride"
    return None


def _tuning_key(key: NormKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "hidden": key.hidden}


def _build_rms_norm(key: NormKey, config: dict, args: tuple) -> object:
    x, weight, eps, numerics = args
    hidden, has_weight = key.hidden, weight is not None
    rows = x.view(-1, hidden)
    out = torch.empty(rows.shape, dtype=key.out_dtype, device=x.device)
    launch = kernels.rms_norm_kernel.compile(
        config, (rows, weight if has_weight else rows, out, eps, numerics, has_weight), int64=key.int64
    )

    def running(launch: Any) -> Callable[..., Tensor]:
        def run(x: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> Tensor:
            # empty_like: the fastest allocation call
            out = torch.empty_like(x, dtype=key.out_dtype, memory_format=torch.contiguous_format)
            # x and out stand for their rows where the launch replays (see launch_binding.BoundLaunch.replays)
            if x.numel() and not replayed(launch, x, weight if has_weight else x, out, eps, numerics, has_weight):
                rows = x.view(-1, hidden)
                launch(rows, weight if has_weight else rows, out.view(-1, hidden), eps, numerics, has_weight)
            return out

        return run

    return bindable(running, launch)


def _build_fused(key: NormKey, config: dict, args: tuple, *, inplace: bool) -> object:
    x, residual, weight, eps, numerics = args
    hidden, has_weight = key.hidden, weight is not None
    variant, helion_config = kernels.split_variant(config)
    kernel = {
        "row": kernels.fused_add_rms_norm_row_kernel,
        "chunked": kernels.fused_add_rms_norm_chunked_kernel,
    }[variant]
    rows, residual_rows = x.view(-1, hidden), residual.view(-1, hidden)
    if inplace:
        out, residual_out = rows, residual_rows
    else:
        out = torch.empty(rows.shape, dtype=key.out_dtype, device=x.device)
        residual_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    launch = kernel.compile(
        helion_config,
        (rows, residual_rows, weight if has_weight else rows, out, residual_out, eps, numerics, has_weight),
        int64=key.int64,
    )

    def running_inplace(launch: Any) -> Callable[..., None]:
        def run(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, numerics: str) -> None:
            if x.numel() and not replayed(launch, x, residual, weight if has_weight else x, x, residual, eps,
                                          numerics, has_weight):
                rows, residual_rows = x.view(-1, hidden), residual.view(-1, hidden)
                launch(rows, residual_rows, weight if has_weight else rows, rows, residual_rows, eps, numerics,
                       has_weight)

        return run

    def running(launch: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        def run(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float,
                numerics: str) -> tuple[Tensor, Tensor]:
            out = torch.empty_like(x, dtype=key.out_dtype, memory_format=torch.contiguous_format)
            summed = torch.empty_like(x, memory_format=torch.contiguous_format)
            if x.numel() and not replayed(launch, x, residual, weight if has_weight else x, out, summed, eps,
                                          numerics, has_weight):
                rows = x.view(-1, hidden)
                launch(rows, residual.view(-1, hidden), weight if has_weight else rows,
                       out.view(-1, hidden), summed.view(-1, hidden), eps, numerics, has_weight)
            return out, summed

        return run

    return bindable(running_inplace if inplace else running, launch)


def _helion(build: object, spec: object) -> Provider:
    return Provider(
        "helion", build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
        kernel=spec, tuning_key=_tuning_key, available=helion_available,
    )


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks)


def _example_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    return x, weight, 1e-6, "llama"


def _example_fused(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    x, weight, eps, numerics = _example_rms_norm(tokens, hidden, dtype, device)
    return x, torch.randn_like(x), weight, eps, numerics


rms_norm_op = Op(
    "rms_norm", rms_norm_reference, check=check_rms_norm, key=rms_norm_key,
    providers=[_helion(_build_rms_norm, kernels.RMS_NORM)], example_inputs=_example_rms_norm,
    compiled_reference=lean_compiled_reference, differentiable=True, fusable=True, native=_native("norm"),
)
fused_add_rms_norm_op = Op(
    "fused_add_rms_norm", fused_add_rms_norm_reference, check=check_fused_add_rms_norm, key=fused_add_rms_norm_key,
    providers=[_helion(lambda k, c, a: _build_fused(k, c, a, inplace=False), kernels.FUSED_ADD_RMS_NORM)],
    example_inputs=_example_fused, compiled_reference=lean_compiled_reference, differentiable=True, fusable=True,
    native=_native("add"),
)
fused_add_rms_norm_inplace_op = Op(
    "fused_add_rms_norm_", fused_add_rms_norm_inplace_reference, check=check_fused_add_rms_norm_inplace,
    key=fused_add_rms_norm_key,
    providers=[_helion(lambda k, c, a: _build_fused(k, c, a, inplace=True), kernels.FUSED_ADD_RMS_NORM)],
    mutates_args=("x", "residual"), example_inputs=_example_fused,
    compiled_reference=CompiledAddThenNormalise.lean_over(_normalise_into),
    native=_native("add_inplace"),
)


# --------------------------------------------------------------------------------------------
# public API


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *, numerics: str = "llama") -> Tensor:
    """RMS-normalise ``x`` over its last dimension, as the Hugging Face RMSNorm of ``numerics`` does.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16 (fp64 runs on the reference). Rows may be strided,
            e.g. ``buf[..., :hidden]`` of a wider buffer.
        weight: ``[hidden]`` or None (no scale).
        eps: added to the mean square before the reciprocal square root.
        numerics: ``"llama"`` (default), ``"fp32_scale"`` (OLMo-2, gpt-oss) or ``"gemma"`` (``1 + w``).

    Returns:
        A new tensor shaped like ``x``; dtype ``x.dtype``, or in ``llama`` numerics the promotion
        of ``x.dtype`` and ``weight.dtype`` (HF multiplies after casting).
    """
    return rms_norm_op.call(x, weight, eps, numerics)


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    *,
    numerics: str = "llama",
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """``s = residual + x; return rms_norm(s, weight, eps, numerics=numerics), s`` in one pass over memory.

    With ``inplace=True`` the results are written into the arguments (``x`` receives the normed
    output and ``residual`` the sum) and those two tensors are returned; ``x`` and ``residual``
    must not overlap, and in ``llama`` numerics the weight must not promote the dtype.
    """
    if inplace:
        fused_add_rms_norm_inplace_op.call(x, residual, weight, eps, numerics)
        return x, residual
    return fused_add_rms_norm_op.call(x, residual, weight, eps, numerics)
