"""``layer_norm`` and ``fused_add_layer_norm``: spec, checks and dispatch.

The references below are the specification. They subtract the mean and divide by the standard
deviation (biased variance, as ``nn.LayerNorm``) over the last dimension in fp32 (in fp64 for
fp64 inputs, so the tests can evaluate the spec exactly), and apply the weight and bias where
the Hugging Face module of each ``numerics`` applies them:

====================  ====================================================  ==========================
numerics              result                                                HF modules
====================  ====================================================  ==========================
``fp32``              ``(normed * weight + bias).to(x.dtype)``, all fp32    ``nn.LayerNorm`` (GPT-2,
                                                                            GPT-NeoX, Falcon, Phi, OPT,
                                                                            Bloom, StableLM, ...),
                                                                            Cohere (no bias), OLMo
                                                                            (neither)
``one_plus``          as ``fp32`` with ``weight + 1`` rounded to the        Nemotron ``LayerNorm1P``
                      weight's dtype first
``cast_then_affine``  ``normed.to(x.dtype) * weight + bias``, each step     Chameleon
                      in the promoted dtype
====================  ====================================================  ==========================

``weight`` and ``bias`` are optional and ``[hidden]``; ``layer_norm`` also takes per-head
parameters ``[heads, hidden]`` for ``x = [..., heads, hidden]`` (Cohere's and Chameleon's q/k
norms; StableLM's per-head norms once their heads are the second-to-last dim). The result has
``x``'s dtype, except in ``cast_then_affine``, where it is the promotion of ``x``'s and the
parameters' dtypes (the module multiplies after casting).

``fused_add_layer_norm`` adds the residual in the input dtype first (``residual + x``, as the
decoder layers do) and normalises that sum. The ``inplace=True`` form writes the normalised
output into ``x`` and the sum into ``residual``; they must own their memory, must not overlap
each other or the parameters, and the result dtype must be ``x``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import layer_norm as kernels
from ..kernels.launch_binding import bindable
from ..kernels.runtime import helion_available
from . import checks
from .compiled_reference import lean_compiled_reference
from .registry import Op, Provider, compile_reference_enabled
from .rms_norm import MAX_KERNEL_HIDDEN, CompiledAddThenNormalise, check_inplace_buffers

NUMERICS = kernels.NUMERICS


# --------------------------------------------------------------------------------------------
# the spec


def _normalise(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str) -> Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    centred = xf - xf.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if numerics == "cast_then_affine":
        y = normed.to(x.dtype)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y
    if weight is not None:
        scale = weight + 1.0 if numerics == "one_plus" else weight  # Nemotron adds 1 in the weight's dtype
        normed = normed * scale.to(compute)
    if bias is not None:
        normed = normed + bias.to(compute)
    return normed.to(x.dtype)


def layer_norm_reference(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> Tensor:
    return _normalise(x, weight, bias, eps, numerics)


def fused_add_layer_norm_reference(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return _normalise(summed, weight, bias, eps, numerics), summed


def fused_add_layer_norm_inplace_reference(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> None:
    normed, summed = fused_add_layer_norm_reference(x, residual, weight, bias, eps, numerics)
    residual.copy_(summed)
    x.copy_(normed)


def _normalise_into(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> None:
    x.copy_(_normalise(residual, weight, bias, eps, numerics))


# --------------------------------------------------------------------------------------------
# checks and keys


class LayerNormKey(NamedTuple):
    device: str
    dtype: torch.dtype
    weight_dtype: Optional[torch.dtype]
    bias_dtype: Optional[torch.dtype]
    out_dtype: torch.dtype
    hidden: int
    heads: int  # parameter rows: 1, or x.shape[-2] for per-head parameters
    tokens: int
    numerics: str
    rows_collapse: bool
    int64: bool
    flat_parameters: bool  # weight and bias are [hidden] or absent


def _check_parameter(op: str, name: str, value: Optional[Tensor], x: Tensor, *, per_head: bool) -> None:
    if value is None:
        return
    checks.tensor(op, name, value)
    checks.same_device(op, name, value, "x", x)
    hidden = x.shape[-1]
    if value.shape == (hidden,):
        return
    if per_head and x.dim() >= 2 and value.shape == (x.shape[-2], hidden):
        return
    expected = f"({hidden},)" + (f" or per head ({x.shape[-2]}, {hidden})" if per_head and x.dim() >= 2 else "")
    raise ValueError(f"{op}: {name} must have shape {expected} to match x {tuple(x.shape)}; got {tuple(value.shape)}")


def _check_norm_args(op: str, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                     numerics: str, *, per_head: bool) -> None:
    checks.tensor(op, "x", x)
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: x's last dimension (the normalised one) must be >= 1; got shape {tuple(x.shape)}")
    _check_parameter(op, "weight", weight, x, per_head=per_head)
    _check_parameter(op, "bias", bias, x, per_head=per_head)
    if weight is not None and bias is not None and weight.shape != bias.shape:
        raise ValueError(
            f"{op}: bias must have the shape of weight {tuple(weight.shape)}; got {tuple(bias.shape)}"
        )
    checks.number(op, "eps", eps, minimum=0.0)
    checks.choice(op, "numerics", numerics, NUMERICS)


def _out_dtype(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], numerics: str) -> torch.dtype:
    dtype = x.dtype
    if numerics == "cast_then_affine":
        for parameter in (weight, bias):
            if parameter is not None:
                dtype = torch.promote_types(dtype, parameter.dtype)
    return dtype


def _check_residual(op: str, x: Tensor, residual: Tensor) -> None:
    checks.tensor(op, "residual", residual)
    checks.same_device(op, "residual", residual, "x", x)
    checks.same_shape(op, "residual", residual, "x", x)
    checks.same_dtype(op, "residual", residual, "x", x)


def check_layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str) -> None:
    _check_norm_args("layer_norm", x, weight, bias, eps, numerics, per_head=True)


def check_fused_add_layer_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> None:
    _check_norm_args("fused_add_layer_norm", x, weight, bias, eps, numerics, per_head=False)
    _check_residual("fused_add_layer_norm", x, residual)


def check_fused_add_layer_norm_inplace(
    x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str
) -> None:
    op = "fused_add_layer_norm(inplace=True)"
    _check_norm_args(op, x, weight, bias, eps, numerics, per_head=False)
    _check_residual(op, x, residual)
    out_dtype = _out_dtype(x, weight, bias, numerics)
    if out_dtype != x.dtype:
        raise TypeError(
            f"{op}: the result dtype {out_dtype} (x {x.dtype} with weight "
            f"{None if weight is None else weight.dtype} and bias {None if bias is None else bias.dtype} in numerics "
            f"{numerics!r}) differs from x's, so it cannot be written into x; pass inplace=False"
        )
    check_inplace_buffers(op, x, residual, weight, bias)


def _heads(weight: Optional[Tensor], bias: Optional[Tensor]) -> int:
    for parameter in (weight, bias):
        if parameter is not None and parameter.dim() == 2:
            return parameter.shape[0]
    return 1


def layer_norm_key(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                   numerics: str) -> LayerNormKey:
    heads = _heads(weight, bias)
    return _key(x, weight, bias, numerics, heads, checks.rows_collapse(x, kept=2 if heads > 1 else 1))


def fused_add_layer_norm_key(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                             eps: float, numerics: str) -> LayerNormKey:
    return _key(x, weight, bias, numerics, 1, checks.rows_collapse(x) and checks.rows_collapse(residual), residual)


def _key(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], numerics: str, heads: int, collapse: bool,
         *more: Tensor) -> LayerNormKey:
    hidden = x.shape[-1]
    return LayerNormKey(
        x.device.type, x.dtype, None if weight is None else weight.dtype, None if bias is None else bias.dtype,
        _out_dtype(x, weight, bias, numerics), hidden, heads, token_bucket(x.numel() // (hidden * heads)), numerics,
        collapse, checks.needs_int64(x, *more), all(p is None or p.dim() == 1 for p in (weight, bias)),
    )


# --------------------------------------------------------------------------------------------
# the native path: where the spec is ``nn.LayerNorm``'s own computation (fp32 statistics and
# affine, one rounding), the reference provider runs its ATen kernel, ``F.layer_norm``, on the
# calls where that was measured faster than the compiled reference (:data:`NATIVE_ROWS`): one ATen
# call, as in the module it replaces.

_HALVES = (torch.bfloat16, torch.float16)
#: While the reference is compiled, the native form runs on these bucketed row counts (inclusive
#: ranges, None: no bound) per form and 16-bit (True) or fp32 (False) rows; the compiled reference,
#: faster there, on the others. Which is faster depends on the CPU's vector unit: this table holds on
#: CPUs whose ATen kernels are AVX-512 ones (:func:`_avx512`); :data:`NATIVE_ROWS_OTHER` elsewhere.
#: Measured on an Intel Xeon (2 threads), 4096 wide, median us, native against compiled (HF eager's
#: module in brackets):
#:
#: - ``norm``: bf16 16 rows 19.9 / 21.5 (23.3), 32 rows 34.8 / 31.8, 128 rows 129 / 109; fp32 rows
#:   natively at every size (16 rows 13.5 / 22.5, 128 rows 91 / 133, 256 rows 175 / 228).
#: - ``add``: bf16 2 rows 11.3 / 11.0 (14.7), 8 rows 27.5 / 23.0, 128 rows 212 / 158; fp32 natively
#:   (16 rows 21.1 / 28.5, 128 rows 211 / 247).
#: - ``add_inplace``, where the native form also copies F.layer_norm's result into x: one row 7.9 /
#:   10.6 (10.5) in bf16, 6.6 / 9.6 (9.2) in fp32; bf16 2 rows 14.8 / 13.7, 8 rows 38.8 / 28.2 (32.2);
#:   fp32 2 rows 15.6 / 11.4 (13.9), 8 rows 39.0 / 23.9 (29.9), 16 rows 25.7 / 30.1 (25.2), 32 rows
#:   40.6 / 45.5 (37.7), 64 rows 87 / 83 (ATen's kernel splits the rows between threads from 16).
NATIVE_ROWS: dict[tuple[str, bool], tuple[tuple[int, Optional[int]], ...]] = {
    ("norm", True): ((0, 16),), ("norm", False): ((0, None),),
    ("add", True): ((0, 2),), ("add", False): ((0, None),),
    ("add_inplace", True): ((0, 1),), ("add_inplace", False): ((0, 1), (16, 32)),
}
#: :data:`NATIVE_ROWS` on CPUs without AVX-512 (AVX2, Arm): ATen's kernel is faster at every size but
#: the in-place form's largest, where F.layer_norm's fresh output (32 MiB and up, which the allocator
#: maps anew on every call) pays a page fault per 4 KiB. Measured on an AMD EPYC (Zen 3, AVX2, 2
#: threads), 4096 wide, median us, native against compiled: ``norm`` bf16 16 rows 33.5 / 42.0, 256 rows
#: 420 / 494, 4096 rows 20.2 / 25.5 ms, fp32 16 rows 18.9 / 47.3; ``add`` bf16 16 rows 40.5 / 56.7, 4096
#: rows 35.1 / 38.0 ms, fp32 256 rows 305 / 662; ``add_inplace`` bf16 1 row 9.9 / 17.7, 2048 rows 4.1 /
#: 4.5 ms, 4096 rows 22.3 / 9.8 ms; fp32 1024 rows 1.8 / 2.2 ms, 2048 rows 39.2 / 5.6 ms.
NATIVE_ROWS_OTHER: dict[tuple[str, bool], tuple[tuple[int, Optional[int]], ...]] = {
    ("norm", True): ((0, None),), ("norm", False): ((0, None),),
    ("add", True): ((0, None),), ("add", False): ((0, None),),
    ("add_inplace", True): ((0, 2048),), ("add_inplace", False): ((0, 1024),),
}


@functools.lru_cache(maxsize=1)
def _avx512() -> bool:
    """Whether ATen runs its AVX-512 kernels here (``ATEN_CPU_CAPABILITY`` can lower it)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _native_rows(form: str, key: LayerNormKey) -> bool:
    table = NATIVE_ROWS if _avx512() else NATIVE_ROWS_OTHER
    return any(low <= key.tokens and (high is None or key.tokens <= high)
               for low, high in table[(form, key.dtype in _HALVES)])


def _native_dtypes(key: LayerNormKey) -> bool:
    """Whether ``F.layer_norm`` reads the parameters as the spec does: in x's dtype, or fp32
    beside a 16-bit x (its mixed-dtype path computes in fp32), both parameters alike."""
    dtypes = {d for d in (key.weight_dtype, key.bias_dtype) if d is not None}
    return not dtypes or dtypes == {key.dtype} or dtypes == {torch.float32} and key.dtype in _HALVES


def _native(form: str) -> object:
    """``native(key)`` of the op's ``form`` (``"norm"``, ``"add"`` or ``"add_inplace"``): its run, bound
    to the key (the normalised shape, Nemotron's ``1 + w``), or None where the spec is not F.layer_norm's."""

    def native(key: LayerNormKey) -> object:
        if (compile_reference_enabled() and not _native_rows(form, key) or key.numerics == "cast_then_affine"
                or not key.flat_parameters or not _native_dtypes(key)):
            return None
        shape, one_plus = (key.hidden,), key.numerics == "one_plus" and key.weight_dtype is not None

        def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str) -> Tensor:
            # Nemotron's module adds the 1 in the weight's dtype
            return torch.layer_norm(x, shape, weight + 1.0 if one_plus else weight, bias, eps)

        def add(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                numerics: str) -> tuple[Tensor, Tensor]:
            summed = residual + x
            return norm(summed, weight, bias, eps, numerics), summed

        def add_inplace(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                        numerics: str) -> None:
            residual.add_(x)  # residual + x, rounded as the reference rounds it
            x.copy_(norm(residual, weight, bias, eps, numerics))

        return {"norm": norm, "add": add, "add_inplace": add_inplace}[form]

    return native


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: LayerNormKey) -> str | None:
    problem = checks.kernel_dtype_problem("input", key.dtype) or checks.kernel_dtype_problem(
        "parameter", key.weight_dtype, key.bias_dtype)
    if problem is not None:
        return problem
    if key.hidden > MAX_KERNEL_HIDDEN:
        return f"hidden size {key.hidden} exceeds the kernel's {MAX_KERNEL_HIDDEN}"
    if not key.rows_collapse:
        return "the leading dimensions do not collapse into one row stride"
    if key.numerics == "cast_then_affine" and key.weight_dtype is not None and key.bias_dtype is not None:
        product = torch.promote_types(key.dtype, key.weight_dtype)
        if product != key.out_dtype:
            return (f"in cast_then_affine the product rounds to {product} before a {key.bias_dtype} bias promotes "
                    f"it to {key.out_dtype}; the kernel rounds once")
    return None


def _round_product(key: LayerNormKey) -> bool:
    """Whether ``normed * weight`` rounds to the input dtype (cast_then_affine), else it stays fp32."""
    return key.weight_dtype is not None and torch.promote_types(key.dtype, key.weight_dtype) == key.dtype


def _layer_norm_tuning_key(key: LayerNormKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "width": key.hidden, "groups": key.heads}


def _fused_tuning_key(key: LayerNormKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "hidden": key.hidden}


def _absent(like: Tensor, *shape: int) -> Tensor:
    """A stand-in for a parameter the kernel does not read (its constexpr flag is off): no memory."""
    return like.new_empty((1,) * len(shape)).expand(*shape)


def _build_layer_norm(key: LayerNormKey, config: dict, args: tuple) -> object:
    x, weight, bias, eps, numerics = args
    hidden, heads = key.hidden, key.heads
    has_weight, has_bias, round_product = weight is not None, bias is not None, _round_product(key)

    def parameter(p: Optional[Tensor]) -> Tensor:
        return _absent(x, heads, hidden) if p is None else p.view(-1, hidden).expand(heads, hidden)

    def launch_args(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], out: Tensor, eps: float) -> tuple:
        return (x.view(-1, heads, hidden), parameter(weight), parameter(bias), out.view(-1, heads, hidden), eps,
                numerics, has_weight, has_bias, round_product)

    out = torch.empty(x.shape, dtype=key.out_dtype, device=x.device)
    launch = kernels.layer_norm_kernel.compile(config, launch_args(x, weight, bias, out, eps), int64=key.int64)

    def running(launch: Any) -> Callable[..., Tensor]:
        def run(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, numerics: str) -> Tensor:
            out = torch.empty_like(x, dtype=key.out_dtype, memory_format=torch.contiguous_format)
            if out.numel():
                launch(*launch_args(x, weight, bias, out, eps))
            return out

        return run

    return bindable(running, launch)


def _build_fused(key: LayerNormKey, config: dict, args: tuple, *, inplace: bool) -> object:
    from ..kernels.rms_norm import split_variant

    x, residual, weight, bias, eps, numerics = args
    hidden = key.hidden
    has_weight, has_bias, round_product = weight is not None, bias is not None, _round_product(key)
    variant, helion_config = split_variant(config)
    kernel = {
        "row": kernels.fused_add_layer_norm_row_kernel,
        "chunked": kernels.fused_add_layer_norm_chunked_kernel,
    }[variant]
    absent = _absent(x, hidden)
    flags = (has_weight, has_bias, round_product)

    def params(weight: Optional[Tensor], bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        return (absent if weight is None else weight), (absent if bias is None else bias)

    rows, residual_rows = x.view(-1, hidden), residual.view(-1, hidden)
    if inplace:
        out, residual_out = rows, residual_rows
    else:
        out = torch.empty(rows.shape, dtype=key.out_dtype, device=x.device)
        residual_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    launch = kernel.compile(
        helion_config, (rows, residual_rows, *params(weight, bias), out, residual_out, eps, numerics, *flags),
        int64=key.int64,
    )

    def running_inplace(launch: Any) -> Callable[..., None]:
        def run(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                numerics: str) -> None:
            rows, residual_rows = x.view(-1, hidden), residual.view(-1, hidden)
            if rows.shape[0]:
                launch(rows, residual_rows, *params(weight, bias), rows, residual_rows, eps, numerics, *flags)

        return run

    def running(launch: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        def run(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                numerics: str) -> tuple[Tensor, Tensor]:
            out = torch.empty_like(x, dtype=key.out_dtype, memory_format=torch.contiguous_format)
            summed = torch.empty_like(x, memory_format=torch.contiguous_format)
            rows = x.view(-1, hidden)
            if rows.shape[0]:
                launch(rows, residual.view(-1, hidden), *params(weight, bias), out.view(-1, hidden),
                       summed.view(-1, hidden), eps, numerics, *flags)
            return out, summed

        return run

    return bindable(running_inplace if inplace else running, launch)


def _helion(build: object, spec: object, tuning_key: object) -> Provider:
    return Provider(
        "helion", build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
        kernel=spec, tuning_key=tuning_key, available=helion_available,
    )


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck)


def _example_layer_norm(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    bias = 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    return x, weight, bias, 1e-5, "fp32"


def _example_fused(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> tuple:
    x, weight, bias, eps, numerics = _example_layer_norm(tokens, hidden, dtype, device)
    return x, torch.randn_like(x), weight, bias, eps, numerics


layer_norm_op = Op(
    "layer_norm", layer_norm_reference, check=check_layer_norm, key=layer_norm_key,
    providers=[_helion(_build_layer_norm, kernels.LAYER_NORM, _layer_norm_tuning_key)],
    example_inputs=_example_layer_norm, native=_native("norm"), differentiable=True, fusable=True,
    compiled_reference=lean_compiled_reference,
)
fused_add_layer_norm_op = Op(
    "fused_add_layer_norm", fused_add_layer_norm_reference, check=check_fused_add_layer_norm,
    key=fused_add_layer_norm_key,
    providers=[_helion(lambda k, c, a: _build_fused(k, c, a, inplace=False), kernels.FUSED_ADD_LAYER_NORM,
                       _fused_tuning_key)],
    example_inputs=_example_fused, native=_native("add"), differentiable=True, fusable=True,
    compiled_reference=lean_compiled_reference,
)
fused_add_layer_norm_inplace_op = Op(
    "fused_add_layer_norm_", fused_add_layer_norm_inplace_reference, check=check_fused_add_layer_norm_inplace,
    key=fused_add_layer_norm_key,
    providers=[_helion(lambda k, c, a: _build_fused(k, c, a, inplace=True), kernels.FUSED_ADD_LAYER_NORM,
                       _fused_tuning_key)],
    mutates_args=("x", "residual"), example_inputs=_example_fused,
    compiled_reference=CompiledAddThenNormalise.lean_over(_normalise_into),
    native=_native("add_inplace"),
)


# --------------------------------------------------------------------------------------------
# public API


def layer_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    numerics: str = "fp32",
) -> Tensor:
    """Layer-normalise ``x`` over its last dimension, as the Hugging Face LayerNorm of ``numerics`` does.

    Args:
        x: ``[..., hidden]``, fp32/fp16/bf16 (fp64 runs on the reference). Rows may be strided.
        weight, bias: ``[hidden]``, per head ``[heads, hidden]`` for ``x = [..., heads, hidden]``,
            or None.
        eps: added to the variance before the reciprocal square root.
        numerics: ``"fp32"`` (default: ``nn.LayerNorm``), ``"one_plus"`` (Nemotron's ``1 + w``) or
            ``"cast_then_affine"`` (Chameleon).

    Returns:
        A new tensor shaped like ``x``; dtype ``x.dtype`` (``cast_then_affine``: promoted with the
        parameters' dtypes).
    """
    return layer_norm_op.call(x, weight, bias, eps, numerics)


def fused_add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    numerics: str = "fp32",
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """``s = residual + x; return layer_norm(s, weight, bias, eps, numerics=numerics), s`` in one pass.

    ``weight`` and ``bias`` are ``[hidden]`` or None. With ``inplace=True`` the results are
    written into the arguments (``x`` receives the normed output and ``residual`` the sum) and
    those two tensors are returned.
    """
    if inplace:
        fused_add_layer_norm_inplace_op.call(x, residual, weight, bias, eps, numerics)
        return x, residual
    return fused_add_layer_norm_op.call(x, residual, weight, bias, eps, numerics)
