"""Gated activations ``act(gate) * up``: spec, checks and dispatch.

``silu_and_mul`` and ``gelu_and_mul`` take ``x = [..., 2 * I]`` with the gate half first (the
merged ``gate_up_proj`` output of Llama-style MLPs and of Phi-3); ``swiglu_oai`` is gpt-oss's
clamped SwiGLU on its interleaved layout (gate at even, up at odd positions) by default. The
references compute in the input dtype exactly as the Hugging Face modules do, so each
intermediate the HF module rounds is rounded here too; one Helion kernel implements all three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import activations as kernels
from ..kernels.launch_binding import bindable, replayed
from ..kernels.runtime import helion_available
from . import checks
from .compiled_reference import CompiledReference
from .faster_form import FasterForm
from .registry import Op, Provider

GELU_APPROXIMATIONS = ("none", "tanh")


# --------------------------------------------------------------------------------------------
# the spec


def silu_and_mul_reference(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul_reference(x: Tensor, approximate: str) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def swiglu_oai_reference(x: Tensor, alpha: float, limit: float, interleaved: bool) -> Tensor:
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


# --------------------------------------------------------------------------------------------
# what the reference provider runs (CPU). Contiguous 16-bit rows of the sigmoid-gated ops: the
# lean compiled reference, one fused call (single-threaded up to
# compiled_reference.SINGLE_THREAD_ELEMENTS, on the intra-op threads above) that rounds each
# intermediate as eager does, so bit-identical (the tests check, above and below that size) where
# the chain below makes up to seven calls and allocates an intermediate for each. Measured on an
# Intel Xeon (2 threads), fused against the chain: swiglu_oai 1 x 2880 bf16 16 against 26 us,
# 16 x 2880 74 against 86, 4096 x 2880 18.0 against 34.2 ms; silu_and_mul 16 x 2048 15 against
# 25 us, 4096 x 2048 2.9 against 3.4 ms; never slower beyond noise (256 rows: level). Everything
# else: the references' own ATen kernels, in the same order, with intermediates written in place
# or into buffers the chain no longer reads, so bit-identical too with at most one intermediate
# allocated besides the result (a fresh buffer costs page faults per 4 KiB at large sizes and an
# allocator call at decode sizes). Inductor's erf and tanh round differently from ATen's (GELU, in
# 16 bits too); fp32 swiglu_oai: see below. The two forms trade places with the CPU and the sizes
# (on an AVX2 EPYC the chain is faster from 256 rows: silu_and_mul 256 x 2048 bf16 413 against 483
# us, swiglu_oai 256 x 2880 1828 against 2075), so a repeated call signature (dispatch binds one)
# runs whichever its first calls time faster (:class:`.faster_form.FasterForm`); a first call runs
# the fused pass.


def _silu_and_mul_lean(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _gelu_and_mul_lean(x: Tensor, approximate: str) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate).mul_(up)


def _swiglu_oai_lean(x: Tensor, alpha: float, limit: float, interleaved: bool) -> Tensor:
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    clamped = gate.clamp(min=None, max=limit)
    glu = torch.mul(clamped, alpha).sigmoid_().mul_(clamped)  # gate * sigmoid(gate * alpha): products commute
    # the clamped gate's buffer takes the up half: one intermediate allocated, not two
    return glu.mul_(torch.clamp(up, min=-limit, max=limit, out=clamped).add_(1))


_LEAN = {"silu_and_mul": _silu_and_mul_lean, "gelu_and_mul": _gelu_and_mul_lean, "swiglu_oai": _swiglu_oai_lean}


_FUSED_DTYPES = (torch.bfloat16, torch.float16)
_FUSED_OPS = frozenset({"silu_and_mul", "swiglu_oai"})

# swiglu_oai in fp32 fuses too, compiled without Inductor's tiling heuristics: with them it leaves
# the interleaved halves' loop scalar, whose libm exp and double-precision product by alpha are an
# ulp off ATen's vectorised ones (3% of elements). Without them every full vector is ATen's
# arithmetic, bit for bit; a loop's scalar tail still is not, so fp32 fuses only where the output's
# element count is a multiple of :data:`_VECTOR_ELEMENTS` (no tail at any vector width up to 64).
# Interleaved halves, which Inductor gathers one element at a time (about 3 ns an output in fp32,
# 2 in bf16), are copied apart by ATen's strided copy first (0.2 ns an element), except in two
# cases: up to :data:`_GATHER_MAX_ROWS` rows, where the copy's call costs more than the gather,
# and from :data:`_GATHER_MIN_BYTES` of input, where a fresh buffer that large pays a page fault
# per 4 KiB on every call. Measured on an Intel Xeon (2 threads), swiglu_oai x 2880 interleaved,
# against the chain: fp32 1 row 11.4 against 17.6 us (fused in place), 16 rows 40 against 55, 256
# rows 610 against 886 (copied apart), 4096 rows 27.6 against 48 ms (fused in place, a same-size
# clone 24); bf16 against the fused pass on the interleaved input: 16 rows 75 against 80 us,
# 256 rows 909 against 1307 (copied apart), 4096 rows 30.2 against 20.5 ms (hence the byte limit).
_VECTOR_ELEMENTS = 64
_GATHER_MAX_ROWS = 2
_GATHER_MIN_BYTES = 16 << 20
_VECTORISED = {"cpp.enable_tiling_heuristics": False}


class _ReferenceActivation:
    """What the reference provider runs on the CPU: the lean compiled reference (see above) where it
    is bit-identical and faster, else the eager chain."""

    def __init__(self, op_name: str, reference: object) -> None:
        self.fused = CompiledReference(op_name, reference, lean=True) if op_name in _FUSED_OPS else None
        self.fused_fp32 = (CompiledReference(op_name, reference, lean=True, inductor_options=_VECTORISED)
                           if op_name == "swiglu_oai" else None)
        self.chain = _LEAN[op_name]

    def __call__(self, x: Tensor, *options: object) -> Tensor:
        compiled = self._compiled(x, options)
        if compiled is None:
            return self.chain(x, *options)
        if self._copies_halves_apart(x, options):
            return compiled(_gates_first(x), *options[:-1], False)
        return compiled(x, *options)

    def bind(self, args: tuple) -> object:
        """See :meth:`CompiledReference.bind`: for these arguments the compiled entry or the chain,
        whichever their first calls time faster (:class:`FasterForm`: the two compute the same bits;
        which is faster varies with the CPU and the sizes)."""
        x, options = args[0], args[1:]
        compiled = self._compiled(x, options)
        if compiled is None:
            return self.chain
        if not self._copies_halves_apart(x, options):
            entry = compiled.bind(args)
            return self.chain if entry is None else FasterForm(entry, self.chain)
        apart = compiled.bind((x, *options[:-1], False))  # the gates-first copy has x's metadata
        if apart is None:
            return self.chain

        def run(x: Tensor, *options: object) -> Tensor:
            return apart(_gates_first(x), *options[:-1], False)

        return FasterForm(run, self.chain)

    def _compiled(self, x: Tensor, options: tuple) -> CompiledReference | None:
        """The compiled reference that runs ``x`` bit-identically, or None (the chain runs it)."""
        if not (x.is_cpu and x.is_contiguous()):
            return None
        if x.dtype in _FUSED_DTYPES:
            return self.fused
        if x.dtype == torch.float32 and self.fused_fp32 is not None and (x.numel() // 2) % _VECTOR_ELEMENTS == 0:
            return self.fused_fp32
        return None

    def _copies_halves_apart(self, x: Tensor, options: tuple) -> bool:
        if self.fused_fp32 is None or not options[-1] or x.dim() == 0:  # swiglu_oai's interleaved flag
            return False
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return rows > _GATHER_MAX_ROWS and x.nbytes < _GATHER_MIN_BYTES


def _gates_first(x: Tensor) -> Tensor:
    """Interleaved ``x [..., 2 * I]`` (gate, up, gate, up, ...) copied as ``[..., 2 * I]`` gates first."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).contiguous().flatten(-2)


# --------------------------------------------------------------------------------------------
# checks and keys


class ActKey(NamedTuple):
    device: str
    dtype: torch.dtype
    inter: int
    tokens: int
    activation: str
    interleaved: bool
    rows_collapse: bool
    int64: bool


def _check_x(op: str, x: Tensor) -> None:
    checks.tensor(op, "x", x)
    if x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x's last dimension must be even and >= 2 (gate and up halves); got shape {tuple(x.shape)}")


def check_silu_and_mul(x: Tensor) -> None:
    _check_x("silu_and_mul", x)


def check_gelu_and_mul(x: Tensor, approximate: str) -> None:
    _check_x("gelu_and_mul", x)
    checks.choice("gelu_and_mul", "approximate", approximate, GELU_APPROXIMATIONS)


def check_swiglu_oai(x: Tensor, alpha: float, limit: float, interleaved: bool) -> None:
    _check_x("swiglu_oai", x)
    checks.number("swiglu_oai", "alpha", alpha)
    checks.number("swiglu_oai", "limit", limit, positive=True)
    if not isinstance(interleaved, bool):
        raise TypeError(f"swiglu_oai: interleaved must be a bool, got {type(interleaved).__name__}")


def _key(x: Tensor, activation: str, interleaved: bool = False) -> ActKey:
    width = x.shape[-1]
    return ActKey(
        x.device.type, x.dtype, width // 2, token_bucket(x.numel() // width), activation, interleaved,
        checks.rows_collapse(x), checks.needs_int64(x),
    )


def silu_and_mul_key(x: Tensor) -> ActKey:
    return _key(x, "silu")


def gelu_and_mul_key(x: Tensor, approximate: str) -> ActKey:
    return _key(x, "gelu_tanh" if approximate == "tanh" else "gelu")


def swiglu_oai_key(x: Tensor, alpha: float, limit: float, interleaved: bool) -> ActKey:
    return _key(x, "swiglu_oai", interleaved)


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: ActKey) -> str | None:
    if key.dtype not in checks.KERNEL_DTYPES:
        return f"dtype {key.dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    if not key.rows_collapse:
        return "the leading dimensions do not collapse into one row stride"
    return None


def _tuning_key(key: ActKey) -> dict[str, object]:
    return {"activation": key.activation, "dtype": str(key.dtype).removeprefix("torch."), "inter": key.inter}


def _halves(rows: Tensor, inter: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    if interleaved:
        return rows[..., 0::2], rows[..., 1::2]
    return rows.split_with_sizes((inter, inter), -1)  # the two slices' views in one call (1.4 against 2.8 us)


def _build(key: ActKey, config: dict, args: tuple) -> object:
    inter, activation, interleaved = key.inter, key.activation, key.interleaved
    x, alpha, limit = args[0], 0.0, 0.0
    if activation == "swiglu_oai":
        alpha, limit = float(args[1]), float(args[2])
    gate, up = _halves(x.view(-1, 2 * inter), inter, interleaved)
    out = torch.empty((gate.shape[0], inter), dtype=x.dtype, device=x.device)
    launch = kernels.gated_activation_kernel.compile(config, (gate, up, out, alpha, limit, activation), int64=key.int64)

    def running(launch: Any) -> Callable[..., Tensor]:
        def run(x: Tensor, *options: object) -> Tensor:
            # x's own halves and out stand for the rows' where the launch replays (launch_binding.BoundLaunch.replays)
            gate, up = _halves(x, inter, interleaved)
            out = torch.empty_like(gate, memory_format=torch.contiguous_format)  # [..., inter]: the cheapest allocation
            if not x.numel():
                return out
            alpha, limit = (float(options[0]), float(options[1])) if activation == "swiglu_oai" else (0.0, 0.0)
            if not replayed(launch, gate, up, out, alpha, limit, activation):
                gate, up = _halves(x.view(-1, 2 * inter), inter, interleaved)
                launch(gate, up, out.view(-1, inter), alpha, limit, activation)
            return out

        return run

    return bindable(running, launch)


_HELION = Provider(
    "helion", _build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
    kernel=kernels.GATED_ACTIVATION, tuning_key=_tuning_key, available=helion_available,
)


def _example(tokens: int, inter: int, dtype: torch.dtype, device: str) -> tuple:
    return (torch.randn(tokens, 2 * inter, dtype=dtype, device=device),)


silu_and_mul_op = Op(
    "silu_and_mul", silu_and_mul_reference, check=check_silu_and_mul, key=silu_and_mul_key,
    providers=[_HELION], example_inputs=_example, compiled_reference=_ReferenceActivation, differentiable=True,
    fusable=True,
)
gelu_and_mul_op = Op(
    "gelu_and_mul", gelu_and_mul_reference, check=check_gelu_and_mul, key=gelu_and_mul_key,
    providers=[_HELION], example_inputs=lambda *a: (*_example(*a), "tanh"), compiled_reference=_ReferenceActivation,
    differentiable=True, fusable=True,
)
swiglu_oai_op = Op(
    "swiglu_oai", swiglu_oai_reference, check=check_swiglu_oai, key=swiglu_oai_key,
    providers=[_HELION], example_inputs=lambda *a: (*_example(*a), 1.702, 7.0, True),
    compiled_reference=_ReferenceActivation, differentiable=True, fusable=True,
)


# --------------------------------------------------------------------------------------------
# public API


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x = [..., 2 * I]``; result ``[..., I]``."""
    return silu_and_mul_op.call(x)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x[..., :I], approximate) * x[..., I:]``; ``approximate="tanh"`` is Gemma's GELU."""
    return gelu_and_mul_op.call(x, approximate)


def swiglu_oai(x: Tensor, alpha: float = 1.702, limit: float = 7.0, *, interleaved: bool = True) -> Tensor:
    """gpt-oss's clamped SwiGLU: ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = gate.clamp(max=limit)``.

    ``x = [..., 2 * I]`` holds gate and up interleaved (gpt-oss's layout) or, with
    ``interleaved=False``, as two halves with the gate first.
    """
    return swiglu_oai_op.call(x, alpha, limit, interleaved)
