"""Fixes that make the CPU interpreters run our kernels exactly as a GPU would.

Kernels are tested on machines without a GPU through two interpreters:

* ``TRITON_INTERPRET=1`` executes ``@triton.jit`` code (ours, and the Triton that Helion
  generates) on CPU tensors through numpy.
* ``HELION_INTERPRET=1`` runs a Helion kernel body as eager PyTorch.

Both have defects that turn correct kernels into crashes or garbage. :func:`apply` patches
them, and it is called when :mod:`hw_agnostic.kernels` is imported, so a contributor's own
``TRITON_INTERPRET=1 python my_check.py`` behaves exactly as the test suite does. Nothing is
patched unless one of the two variables is set: a GPU process never sees these changes.

Triton interpreter (every triton release from 3.6 to 3.9):

1. ``triton.language.extra.libdevice`` functions are placeholders that only the GPU compiler
   replaces; under the interpreter they return ``None``. We rebind them to numpy.
2. bfloat16 values are held as raw 16-bit integers and arithmetic, comparisons, reductions and
   ``tl.dot`` run on the bits. We route every bf16 operation through float32 and round the
   result back to nearest-even, which is what the GPU's bf16 units do for a single operation.
3. triton 3.6 with numpy >= 2.4 fails on ``range()`` over tensor bounds; we convert the bounds.

Helion eager interpret mode:

4. ``torch.addmm``/``baddbmm``/``hl.dot`` call ``aten::mm.dtype``, which has no CPU kernel; we
   register one (upcast, matmul, cast).

And one speed fix for Helion under the Triton interpreter:

5. Helion lowers ``amax``/``amin`` to reductions with a NaN-propagating combine function, which
   the interpreter runs element by element in Python (~60 µs each); we give it the same result
   through ``tl.max``/``tl.min`` plus a NaN check, which the interpreter runs in numpy.

And two for every kernel under the Triton interpreter:

6. The interpreter's options turn integer-overflow sanitizing on, so every 32-bit ``+``, ``-``
   and ``*`` also runs in int64 with two bound comparisons, and the result goes to
   ``device_assert``, which returns without looking at it unless ``debug`` is set (the
   interpreter never sets it). We turn sanitizing off while ``debug`` is off: the same checks
   (none), about 60% less interpretation time on index-heavy kernels.
7. Every call of a ``@triton.jit`` helper inside a kernel (Helion's generated code calls several
   per tile) patches ``triton.language`` again: ``inspect.getmembers`` over four modules, about
   0.4 ms a call, for nothing, as the launch already patched them and the helper's patches are
   never undone. A helper call during a launch whose patches cover the helper's
   ``triton.language`` modules now skips it (a fifth of the paged-attention cases' time, profiled).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_applied: set[str] = set()


def triton_interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def helion_interpret_enabled() -> bool:
    return os.environ.get("HELION_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def interpreter_mode() -> str | None:
    """``"triton"``, ``"helion"`` or ``None``: which CPU interpreter this process runs kernels in."""
    triton_mode, helion_mode = triton_interpret_enabled(), helion_interpret_enabled()
    if triton_mode and helion_mode:
        raise RuntimeError(
            "TRITON_INTERPRET=1 and HELION_INTERPRET=1 are both set; Helion cannot run with both. "
            "Run the two interpreter tiers in separate processes."
        )
    return "triton" if triton_mode else "helion" if helion_mode else None


def apply() -> None:
    """Apply the fixes for whichever interpreter the environment selects (idempotent)."""
    mode = interpreter_mode()
    if mode == "triton" and "triton" not in _applied:
        _patch_libdevice()
        _patch_bf16_arithmetic()
        _patch_range_bounds()
        _patch_helion_nan_reductions()
        _skip_discarded_overflow_checks()
        _patch_language_once_per_launch()
        _applied.add("triton")
        log.debug("hw_agnostic: Triton interpreter fixes applied")
    elif mode == "helion" and "helion" not in _applied:
        _register_cpu_mm_dtype()
        _applied.add("helion")
        log.debug("hw_agnostic: Helion interpret-mode fixes applied")


# --------------------------------------------------------------------------------------------
# 1. libdevice


def _libdevice_table() -> dict[str, tuple[int, Callable[..., Any]]]:
    import numpy as np

    def round_half_away(x):
        return np.sign(x) * np.floor(np.abs(x) + 0.5)

    unary = {
        "abs": np.abs, "fabs": np.abs, "acos": np.arccos, "acosh": np.arccosh,
        "asin": np.arcsin, "asinh": np.arcsinh, "atan": np.arctan, "atanh": np.arctanh,
        "cbrt": np.cbrt, "ceil": np.ceil, "cos": np.cos, "cosh": np.cosh,
        "erf": np.vectorize(math.erf, otypes=[np.float64]),
        "erfc": np.vectorize(math.erfc, otypes=[np.float64]),
        "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(10.0, x), "expm1": np.expm1,
        "fast_expf": np.exp, "fast_exp10f": lambda x: np.power(10.0, x), "fast_logf": np.log,
        "fast_log2f": np.log2, "fast_log10f": np.log10, "fast_sinf": np.sin,
        "fast_cosf": np.cos, "fast_tanf": np.tan, "fast_tanhf": np.tanh,
        "floor": np.floor, "isinf": np.isinf, "isnan": np.isnan, "isfinited": np.isfinite,
        "finitef": np.isfinite, "lgamma": np.vectorize(math.lgamma, otypes=[np.float64]),
        "log": np.log, "log10": np.log10, "log1p": np.log1p, "log2": np.log2,
        "nearbyint": np.rint, "rint": np.rint, "round": round_half_away,
        "rcp_rn": np.reciprocal, "rsqrt": lambda x: 1.0 / np.sqrt(x),
        "sin": np.sin, "sinh": np.sinh, "sqrt": np.sqrt, "sqrt_rn": np.sqrt, "tan": np.tan,
        "tanh": np.tanh, "trunc": np.trunc, "signbit": np.signbit,
    }
    binary = {
        "pow": np.power, "powf": np.power, "fmod": np.fmod, "fmax": np.fmax, "fmin": np.fmin,
        "atan2": np.arctan2, "hypot": np.hypot, "copysign": np.copysign,
        "nextafter": np.nextafter, "fdim": lambda a, b: np.maximum(a - b, 0),
        "remainder": np.remainder, "fast_dividef": np.divide, "div_rn": np.divide,
        "div_rz": np.divide, "div_rd": np.divide, "div_ru": np.divide,
        "add_rn": np.add, "sub_rn": np.subtract, "mul_rn": np.multiply,
    }
    ternary = {"fma": lambda a, b, c: a * b + c, "fma_rn": lambda a, b, c: a * b + c}
    table: dict[str, tuple[int, Callable[..., Any]]] = {}
    for arity, group in ((1, unary), (2, binary), (3, ternary)):
        for name, fn in group.items():
            table[name] = (arity, fn)
    return table


def _numpy_libdevice(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    bool_result = name in ("isinf", "isnan", "isfinited", "finitef", "signbit")

    def call(*args: Any, _semantic: Any = None, **_: Any) -> Any:
        tensors = [a for a in args if isinstance(a, tl.tensor)]
        if not tensors:
            return fn(*args)
        like = max(tensors, key=lambda t: t.type.scalar.primitive_bitwidth)
        arrays = [_as_float_array(a) for a in args]
        result = np.asarray(fn(*arrays))
        if bool_result:
            return tl.tensor(TensorHandle(result.astype(np.bool_), tl.int1), _with_scalar(like.type, tl.int1))
        return tl.tensor(TensorHandle(_from_float(result, like.type.scalar), like.type.scalar), like.type)

    call.__name__ = name
    return call


def _with_scalar(ty: Any, scalar: Any) -> Any:
    import triton.language as tl

    return tl.block_type(scalar, ty.shape) if isinstance(ty, tl.block_type) else scalar


def _as_float_array(value: Any) -> Any:
    """A numpy view of a Triton value with bf16 bits decoded to float32."""
    import numpy as np
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if not isinstance(value, tl.tensor):
        return np.asarray(value, dtype=np.float32 if isinstance(value, float) else None)
    data = value.handle.data
    if value.type.scalar == tl.bfloat16:
        return _bf16_bits_to_f32(data)
    return data


def _from_float(result: Any, scalar: Any) -> Any:
    import triton.language as tl

    if scalar == tl.bfloat16:
        return _f32_to_bf16_bits(result)
    return result.astype(_np_dtype(scalar), copy=False)


def _np_dtype(scalar: Any) -> Any:
    from triton.runtime.interpreter import _get_np_dtype

    return _get_np_dtype(scalar)


def _bf16_bits_to_f32(bits: Any) -> Any:
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_bits(values: Any) -> Any:
    """Round float32 to bfloat16 (nearest-even, NaN kept quiet) and return the raw bits."""
    import numpy as np

    f32 = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    bits = f32.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out = np.where(nan, ((bits >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), out)
    return out.reshape(f32.shape)


def _patch_libdevice() -> None:
    import importlib

    table = _libdevice_table()
    for module_name in (
        "triton.language.extra.libdevice",
        "triton.language.extra.cuda.libdevice",
        "triton.language.extra.hip.libdevice",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, (_, fn) in table.items():
            if hasattr(module, name):
                setattr(module, name, _numpy_libdevice(name, fn))


# --------------------------------------------------------------------------------------------
# 2. bf16 arithmetic


def _patch_bf16_arithmetic() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    handle_cls = interp.TensorHandle

    def is_bf16(handle: Any) -> bool:
        return isinstance(handle, handle_cls) and handle.dtype.scalar == tl.bfloat16

    def widen(handle: Any) -> Any:
        if is_bf16(handle):
            return handle_cls(_bf16_bits_to_f32(handle.data), tl.float32)
        return handle

    def narrow(handle: Any) -> Any:
        if isinstance(handle, handle_cls) and handle.data.dtype == np.float32:
            return handle_cls(_f32_to_bf16_bits(handle.data), tl.bfloat16)
        return handle

    comparisons = {np.less, np.greater, np.less_equal, np.greater_equal, np.equal, np.not_equal}

    def through_f32(method: Callable[..., Any], result_like: Callable[[tuple], Any]) -> Callable[..., Any]:
        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not any(is_bf16(a) for a in args):
                return method(self, *args, **kwargs)
            decides_type = result_like(args)
            result = method(self, *(widen(a) for a in args), **kwargs)
            return narrow(result) if is_bf16(decides_type) else result

        return patched

    original_binary = builder_cls.binary_op

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return original_binary(self, lhs, rhs, op)
        result = original_binary(self, widen(lhs), widen(rhs), op)
        if op in comparisons:
            return handle_cls(np.asarray(result.data).astype(np.bool_), tl.int1)
        return narrow(result) if is_bf16(lhs) else result

    builder_cls.binary_op = binary_op
    builder_cls.unary_op = through_f32(builder_cls.unary_op, lambda a: a[0])
    builder_cls.create_fma = through_f32(builder_cls.create_fma, lambda a: a[2])
    builder_cls.create_erf = through_f32(builder_cls.create_erf, lambda a: a[0])
    builder_cls.create_rsqrt = through_f32(builder_cls.create_rsqrt, lambda a: a[0])
    builder_cls.create_clampf = through_f32(builder_cls.create_clampf, lambda a: a[0])
    builder_cls.create_dot = through_f32(builder_cls.create_dot, lambda a: a[2])

    original_cast = builder_cls.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        # The interpreter truncates f32 -> bf16 where the GPU rounds to nearest-even, and every
        # other cast from or to bf16 would reinterpret the bits.
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            return handle_cls(_f32_to_bf16_bits(src.data), tl.bfloat16)
        if is_bf16(src) and dst_type.scalar not in (tl.float32, tl.bfloat16):
            return original_cast(self, widen(src), dst_type)
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar not in (tl.float32, tl.bfloat16):
            return original_cast(self, original_cast(self, src, tl.float32), dst_type)
        return original_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl

    original_select = builder_cls.ternary_op

    def ternary_op(self: Any, lhs: Any, rhs: Any, other: Any, op: Any) -> Any:
        # np.where only moves bits, but np.clip compares them.
        if op is np.where or not any(is_bf16(h) for h in (lhs, rhs, other)):
            return original_select(self, lhs, rhs, other, op)
        return narrow(original_select(self, widen(lhs), widen(rhs), widen(other), op))

    builder_cls.ternary_op = ternary_op

    scan_base = interp.ReduceScanOpInterface
    original_apply = scan_base.apply

    def apply_reduce_or_scan(self: Any, input: Any) -> Any:
        inputs = input if isinstance(input, tuple) else (input,)
        if not any(isinstance(t, tl.tensor) and t.type.scalar == tl.bfloat16 for t in inputs):
            return original_apply(self, input)
        widened = tuple(
            tl.tensor(widen(t.handle), _with_scalar(t.type, tl.float32))
            if t.type.scalar == tl.bfloat16 else t
            for t in inputs
        )
        results = original_apply(self, widened if isinstance(input, tuple) else widened[0])
        as_tuple = results if isinstance(results, tuple) else (results,)
        narrowed = tuple(
            tl.tensor(narrow(r.handle), _with_scalar(r.type, tl.bfloat16))
            if i < len(inputs) and inputs[i].type.scalar == tl.bfloat16 and r.type.scalar == tl.float32
            else r
            for i, r in enumerate(as_tuple)
        )
        return narrowed if isinstance(results, tuple) else narrowed[0]

    scan_base.apply = apply_reduce_or_scan


# --------------------------------------------------------------------------------------------
# 3. range() over tensor bounds (triton < 3.7 with numpy >= 2.4)


def _patch_range_bounds() -> None:
    import numpy as np
    import triton
    from packaging.version import Version
    from triton.runtime import interpreter as interp

    if Version(triton.__version__).release >= (3, 7) or Version(np.__version__).release < (2, 4):
        return
    original = interp._patch_lang_core

    def as_int(value: Any) -> Any:
        data = getattr(getattr(value, "handle", None), "data", None)
        return int(np.asarray(data).reshape(-1)[0]) if data is not None else value

    def patch_lang_core(lang: Any, scope: Any) -> None:
        original(lang, scope)
        patched_range = lang.range

        def range_with_int_bounds(arg1: Any, arg2: Any = None, step: Any = None, **kwargs: Any) -> Any:
            return patched_range(
                as_int(arg1), None if arg2 is None else as_int(arg2),
                None if step is None else as_int(step), **kwargs,
            )

        scope.set_attr(lang, "range", range_with_int_bounds)
        scope.set_attr(lang, "static_range", range_with_int_bounds)

    interp._patch_lang_core = patch_lang_core


# --------------------------------------------------------------------------------------------
# 5. Helion's NaN-propagating max/min, vectorised


def _patch_helion_nan_reductions() -> None:
    try:
        import helion.runtime.triton.helpers as helpers
    except Exception:  # no Helion: nothing to speed up
        return
    # The interpreter needs triton.language among a jit function's module globals.
    from . import _interpreted_reductions as fast

    helpers.max_propagate_nan = fast.max_propagate_nan
    helpers.min_propagate_nan = fast.min_propagate_nan


# --------------------------------------------------------------------------------------------
# 6. integer-overflow checks that device_assert would discard


def _skip_discarded_overflow_checks() -> None:
    from triton.runtime import interpreter as interp

    builder = getattr(interp, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) or not getattr(options, "sanitize_overflow", False):
        return
    if getattr(options, "debug", False):  # then the checks assert: keep them
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


# --------------------------------------------------------------------------------------------
# 7. triton.language patched once per launch, not once per helper call


class _NothingPatched:
    def restore(self) -> None:
        pass


def _patch_language_once_per_launch() -> None:
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as interp

    original_patch, original_launch = interp._patch_lang, interp.GridExecutor.__call__
    #: per launch in progress, the ids of the triton.language modules patched since it began (the
    #: kernel's, then those of helpers such as ``tl.zeros``, whose module holds ``triton.language.core``)
    launches: list[set[int]] = []

    def languages(fn: Any) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn: Any) -> Any:
        needed = languages(fn)
        # Triton asserts every jit function sees triton.language, so the launch's own call (nothing
        # patched yet) never skips; a helper's patches are never undone: they hold for the rest of it
        if launches and needed and needed <= launches[-1]:
            return _NothingPatched()
        scope = original_patch(fn)
        if launches:
            launches[-1] |= needed
        return scope

    interp.GridExecutor.__call__ = launch
    interp._patch_lang = patch_lang


# --------------------------------------------------------------------------------------------
# 4. aten::mm.dtype on CPU (Helion eager mode)

_mm_dtype_library: Any = None


def _register_cpu_mm_dtype() -> None:
    import torch

    global _mm_dtype_library
    if _mm_dtype_library is not None:
        return
    try:
        torch.ops.aten.mm.dtype(
            torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16), torch.float32
        )
        return  # this torch already has a CPU kernel
    except (RuntimeError, NotImplementedError):
        pass
    library = torch.library.Library("aten", "IMPL")

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)

    library.impl("mm.dtype", mm_dtype, "CPU")
    _mm_dtype_library = library
