"""``rotary_embedding``: queries and keys rotated by a rotary position embedding, in one call.

The spec is Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` (Llama's, and the partial
form of Phi, GPT-NeoX, GLM and others): with ``R = cos.shape[-1]``, the first ``R`` dims of each
head become ``x * cos + rotate_half(x) * sin`` (the neox layout: ``rotate_half`` of halves
``x1, x2`` is ``cat(-x2, x1)``) and the remaining ``D - R`` dims pass through unchanged.

* ``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]``: Hugging Face's attention layout, any
  strides (its queries are transposed views of the projection's ``[B, T, H, D]`` output).
* ``cos`` / ``sin`` ``[B, T, R]`` or ``[1, T, R]``, broadcast over the heads (HF's
  ``cos.unsqueeze(1)``); ``R`` even, ``2 <= R <= D``.
* Results: two new tensors laid out like ``q`` and ``k`` (``torch.empty_like``), of the dtype
  ``q * cos`` has (HF's type promotion; the rotary modules cast ``cos`` / ``sin`` to the
  hidden states' dtype, so it is ``q.dtype`` in practice). The arguments are not written: the
  call site (HF's attention forward) keeps the tensors it passed.

Numerics: HF computes in the dtype of its operands, rounding each product and then their sum;
the reference does exactly that, and so does the kernel (bit-identical to HF's eager code in
fp16 and bf16; in fp32 a GPU compiler may contract a product and the sum into one FMA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from ..autotune.keys import token_bucket
from ..kernels import rotary_embedding as kernels
from ..kernels.launch_binding import bindable
from ..kernels.runtime import helion_available
from . import checks
from .compiled_reference import CompiledReference
from .registry import Op, Provider, compile_reference_enabled

OP = "rotary_embedding"


# --------------------------------------------------------------------------------------------
# the spec


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, passed = x[..., :rotary], x[..., rotary:]
    embedded = rot * cos + _rotate_half(rot) * sin
    return torch.cat((embedded, passed.to(embedded.dtype)), dim=-1)


def _like(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=dtype)


def _laid_like(x: Tensor, value: Tensor) -> Tensor:
    """``value`` laid out like ``x`` (``torch.empty_like``), copied only if the arithmetic picked
    another layout: the fake implementation and every provider agree on the strides, which
    compiled graphs rely on."""
    like = torch.empty_like(x, dtype=value.dtype)
    return value if value.stride() == like.stride() else like.copy_(value)


def rotary_embedding_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _laid_like(q, _rotated(q, cos, sin)), _laid_like(k, _rotated(k, cos, sin))


def _rotary_embedding_shapes(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    return _like(q, dtype), _like(k, dtype)


def _lean_rotary(tokens_major: bool) -> Callable[..., tuple[Tensor, Tensor]]:
    """The spec for a lean graph: q and k row-major as ``[B, H, T, D]`` or, tokens-major, as
    ``[B, T, H, D]`` (the projections' layout, which HF's attention transposes into ``[B, H, T, D]``
    views); tables ``[B, T, R]`` (the lean path traces sizes of 2 and up, so a graph traced on one
    table for every row would take the batch sizes for equal). The same products per element as the
    spec; row-major results."""
    table_dim = 2 if tokens_major else 1

    def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = cos.unsqueeze(table_dim), sin.unsqueeze(table_dim)
        return _rotated(q, cos, sin), _rotated(k, cos, sin)

    return rotary


class _CompiledRotary:
    """The spec compiled, as the reference provider runs it while compiling is on (the default).

    Bit-identical to HF's eager code: the lean graph rounds each 16-bit product and sum as eager
    does (``compiled_reference._round_like_eager``), and Inductor does not contract a product and
    a sum into one FMA (the tests check, NaN and infinities included). One pass instead of six
    kernels and their intermediates. The lean path takes row-major tensors only, so HF's queries
    and keys (``[B, H, T, D]`` views of row-major ``[B, T, H, D]`` tensors) go to a graph of the spec
    on the untransposed tensors, a decode step's single token (row-major either way) to one on
    ``[B, H, T, D]``, and other layouts through ``torch.compile``. Measured on an Intel Xeon (2
    threads), Llama-3-8B's heads, median us, HF's transposed views, native form / compiled (HF's
    ``apply_rotary_pos_emb``): one token bf16 23.2 / 18.2 (34.8); 16 tokens bf16 98 / 45 (97), fp32
    68 / 34 (94); 256 tokens bf16 939 / 505 (925); 4096 tokens bf16 41.3 / 32.4 ms (50.9).

    The spec branches on whether the whole head rotates, and the lean path keeps no guard on sizes,
    so each branch has compiled references of its own. Other devices run the spec eagerly: a GPU
    compiler contracts an fp32 product and sum into one FMA, which HF's code does not."""

    def __init__(self, op_name: str, reference: Callable[..., tuple[Tensor, Tensor]]) -> None:
        self.reference = reference
        #: (tokens-major, whole head) -> the compiled spec for that layout and branch
        self.compiled = {(tokens_major, whole): CompiledReference(op_name, _lean_rotary(tokens_major), lean=True)
                         for tokens_major in (False, True) for whole in (False, True)}
        #: the spec under torch.compile (its guards see the branch), for q / k in other layouts
        self.strided = CompiledReference(op_name, reference)

    def _route(self, args: tuple) -> tuple[CompiledReference, Optional[bool]]:
        """The compiled reference for the call, and whether it runs tokens-major (None: on the spec's
        own arguments)."""
        q, k, cos = args[0], args[1], args[2]
        if q.is_contiguous() and k.is_contiguous():
            tokens_major = False
        elif q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
            tokens_major = True
        else:
            return self.strided, None
        return self.compiled[(tokens_major, cos.shape[-1] == q.shape[-1])], tokens_major

    def __call__(self, *args: Tensor) -> tuple[Tensor, Tensor]:
        if not args[0].is_cpu:
            return self.reference(*args)
        compiled, tokens_major = self._route(args)
        if tokens_major is None:
            return compiled(*args)
        results = compiled(*_lean_arguments(args, tokens_major))
        return _laid_as(results, tokens_major, _restrides(args, tokens_major))

    def bind(self, args: tuple) -> Optional[Callable[..., tuple[Tensor, Tensor]]]:
        """See :meth:`.CompiledReference.bind` (the signature fixes the layouts, so the restriding too)."""
        if not args[0].is_cpu:
            return self.reference
        compiled, tokens_major = self._route(args)
        if tokens_major is None:
            return compiled.bind(args)
        run_lean = compiled.bind(_lean_arguments(args, tokens_major))
        if run_lean is None:
            return None
        restrides = _restrides(args, tokens_major)
        return lambda *args: _laid_as(run_lean(*_lean_arguments(args, tokens_major)), tokens_major, restrides)


def _lean_arguments(args: tuple, tokens_major: bool) -> tuple:
    """The lean graph's arguments: q and k untransposed for a tokens-major graph, and one table for
    every row copied out per row (1/H of q's bytes; see :func:`_lean_rotary` for why not ``[1, T,
    R]``; on ``[T, R]`` tables Inductor generated a slower loop: 80 against 36 us at 16 tokens)."""
    q, k, cos, sin = args
    if tokens_major:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if cos.shape[0] != q.shape[0]:
        cos, sin = cos.expand(q.shape[0], -1, -1).contiguous(), sin.expand(q.shape[0], -1, -1).contiguous()
    return q, k, cos, sin


Restride = Optional[tuple[torch.Size, tuple[int, ...]]]


def _restrides(args: tuple, tokens_major: bool) -> tuple[Restride, Restride]:
    """Per q and k, the ``(shape, strides)`` a lean graph's result takes to be laid out as
    ``empty_like`` lays out the argument, or None where it comes out so. The graph's results are
    row-major in the layout it ran, as q and k are, except where a size-1 dimension's stride differs
    (a decode step's one token of ``[B, H, T, D]``, transposed from ``[B, T, H, D]``): the same
    elements, restrided."""
    restrides = []
    for x in args[:2]:
        strides = list(make_contiguous_strides_for(x.transpose(1, 2).shape if tokens_major else x.shape))
        if tokens_major:
            strides[1], strides[2] = strides[2], strides[1]
        restrides.append(None if tuple(strides) == x.stride() else (x.shape, x.stride()))
    return restrides[0], restrides[1]


def _laid_as(results: tuple[Tensor, Tensor], tokens_major: bool,
             restrides: tuple[Restride, Restride]) -> tuple[Tensor, Tensor]:
    """A lean graph's results laid out as q and k: transposed back if it ran tokens-major, restrided
    as :func:`_restrides` found."""
    if tokens_major:
        results = (results[0].transpose(1, 2), results[1].transpose(1, 2))
    return tuple(out if restride is None else out.as_strided(*restride)  # type: ignore[return-value]
                 for out, restride in zip(results, restrides))


def _native(key: RotaryKey) -> object:
    """Where the whole head rotates and the tables have q's dtype, except on the CPU while the
    reference is compiled (the compiled spec is faster there): the spec's products and sum, rounded
    as HF rounds them, in fewer kernels and allocations (the tests check it bit for bit).

    ``rotate_half(x) * sin`` is ``[-(x2 * s1), x1 * s2]``, which is ``roll(x, R/2) * [-s1, s2]``
    exactly (negation is exact and rounding is symmetric); the signed table is computed once per
    call for q and k, and the sum is added in place into ``x * cos``."""
    if (key.rotary_dim != key.head_dim or key.table_dtype != key.dtype
            or key.device == "cpu" and compile_reference_enabled()):
        return None
    half = key.rotary_dim // 2
    signs: dict[torch.device, Tensor] = {}

    def rotated(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        out = torch.mul(x, cos)
        out.add_(x.roll(half, -1).mul_(signed_sin))
        # laid out like x when x is dense (as empty_like(x)); else as the reference lays it out
        return out if out.stride() == x.stride() else _laid_like(x, out)

    def run(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        sign = signs.get(sin.device)
        if sign is None:
            sign = signs[sin.device] = torch.ones(2 * half, dtype=sin.dtype, device=sin.device)
            sign[:half] = -1
        cos, signed_sin = cos.unsqueeze(1), (sin * sign).unsqueeze(1)
        return rotated(q, cos, signed_sin), rotated(k, cos, signed_sin)

    return run


# --------------------------------------------------------------------------------------------
# checks and keys


class RotaryKey(NamedTuple):
    device: str
    dtype: torch.dtype
    table_dtype: torch.dtype  # cos and sin
    head_dim: int
    rotary_dim: int
    q_heads: int
    k_heads: int
    tokens: int
    int64: bool


def check_rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, op: str = OP) -> None:
    """The checks of ``q``, ``k``, ``cos`` and ``sin`` (``op``: the op the errors name, one that rotates them)."""
    for name, x in (("q", q), ("k", k)):
        checks.tensor(op, name, x)
        if x.dim() != 4:
            raise ValueError(f"{op}: {name} must be [batch, heads, tokens, head_dim] (4-D); got shape {tuple(x.shape)}")
    checks.same_device(op, "k", k, "q", q)
    checks.same_dtype(op, "k", k, "q", q)
    batch, _, tokens, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, tokens, head_dim):
        raise ValueError(f"{op}: k must match q's batch, tokens and head_dim ({batch}, {tokens}, {head_dim}); "
                         f"got k of shape {tuple(k.shape)} for q of shape {tuple(q.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        checks.tensor(op, name, table)
        checks.same_device(op, name, table, "q", q)
        if table.dim() != 3:
            raise ValueError(f"{op}: {name} must be [batch or 1, tokens, rotary_dim] (3-D); got shape {tuple(table.shape)}")
    checks.same_shape(op, "sin", sin, "cos", cos)
    checks.same_dtype(op, "sin", sin, "cos", cos)
    table_batch, table_tokens, rotary = cos.shape
    if table_batch not in (1, batch) or table_tokens != tokens:
        raise ValueError(f"{op}: cos and sin must be [{batch} or 1, {tokens}, rotary_dim] for q of shape "
                         f"{tuple(q.shape)}; got {tuple(cos.shape)}")
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"{op}: the rotary dim (cos.shape[-1]) must be even and within 2..head_dim ({head_dim}); "
                         f"got {rotary}")


def rotary_embedding_key(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> RotaryKey:
    return RotaryKey(
        q.device.type, q.dtype, cos.dtype, q.shape[3], cos.shape[2], q.shape[1], k.shape[1],
        token_bucket(q.shape[0] * q.shape[2]), checks.needs_int64(q, k, cos, sin),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _helion_accepts(key: RotaryKey) -> str | None:
    if key.dtype not in checks.KERNEL_DTYPES:
        return f"dtype {key.dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    if key.table_dtype != key.dtype:
        return f"cos/sin dtype {key.table_dtype} differs from q's {key.dtype} (the result type-promotes)"
    return None


def _tuning_key(key: RotaryKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "head_dim": key.head_dim, "rotary_dim": key.rotary_dim,
            "q_heads": key.q_heads, "k_heads": key.k_heads}


def _per_row(table: Tensor, batch: int) -> Tensor:
    """The kernel reads row ``b``'s table at ``table[b]``: one table shared by every row is expanded
    (a view with batch stride 0; no view at all at batch 1, the decode step's)."""
    return table if table.shape[0] == batch else table.expand(batch, -1, -1)


def _build(key: RotaryKey, config: dict, args: tuple) -> object:
    q, k, cos, sin = args
    batch = q.shape[0]
    half = key.rotary_dim // 2
    launch = kernels.rotary_embedding_kernel.compile(
        config, (q, k, _per_row(cos, batch), _per_row(sin, batch), _like(q, q.dtype), _like(k, k.dtype), half),
        int64=key.int64)

    def running(launch: Any) -> Callable[..., tuple[Tensor, Tensor]]:
        def run(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
            q_out, k_out = _like(q, q.dtype), _like(k, k.dtype)
            if q.numel() or k.numel():
                batch = q.shape[0]
                launch(q, k, _per_row(cos, batch), _per_row(sin, batch), q_out, k_out, half)
            return q_out, k_out

        return run

    return bindable(running, launch)


_HELION = Provider(
    "helion", _build, interpreters=frozenset({"triton", "helion"}), accepts=_helion_accepts,
    kernel=kernels.ROTARY_EMBEDDING, tuning_key=_tuning_key, available=helion_available,
)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks): Llama-3-8B's heads (32 query, 8 KV), one sequence


def rope_tables(tokens: int, rotary_dim: int, dtype: torch.dtype, device: str, base: float = 500000.0,
                batch: int = 1) -> tuple[Tensor, Tensor]:
    """Llama's ``cos`` / ``sin`` ``[batch, tokens, rotary_dim]`` for positions ``0 .. tokens - 1``."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.arange(tokens, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(batch, tokens, rotary_dim)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _example(tokens: int, head_dim: int, dtype: torch.dtype, device: str) -> tuple:
    q = torch.randn(1, tokens, 32, head_dim, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(1, tokens, 8, head_dim, dtype=dtype, device=device).transpose(1, 2)
    return (q, k, *rope_tables(tokens, head_dim, dtype, device))


rotary_embedding_op = Op(
    OP, rotary_embedding_reference, check=check_rotary_embedding, key=rotary_embedding_key, providers=[_HELION],
    example_inputs=_example, compiled_reference=_CompiledRotary, native=_native, fake=_rotary_embedding_shapes,
    differentiable=True,
)


# --------------------------------------------------------------------------------------------
# public API


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` in one launch: ``(q_embed, k_embed)``.

    ``q`` ``[B, Hq, T, D]``, ``k`` ``[B, Hk, T, D]`` (any strides); ``cos`` / ``sin`` ``[B or 1, T, R]``
    with ``R`` even and at most ``D``: the first ``R`` dims of every head are rotated (neox
    layout), the rest pass through. Returns new tensors laid out like ``q`` and ``k``.
    """
    return rotary_embedding_op.call(q, k, cos, sin)
