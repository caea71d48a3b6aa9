"""The CPU-interpreter fixes: what they repair, and that they stay away when not asked for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hw_agnostic.kernels.interpret import interpreter_mode

import helion.language as hl  # noqa: E402  (the kernel below refers to it)

triton_tier = pytest.mark.skipif(interpreter_mode() != "triton", reason="needs TRITON_INTERPRET=1")


def test_nothing_is_patched_without_an_interpreter_variable():
    probe = (
        "import triton.language.extra.libdevice as ld, triton.runtime.interpreter as it\n"
        "before = (ld.rsqrt, it.InterpreterBuilder.binary_op, it.InterpreterBuilder.cast_impl)\n"
        "import hw_agnostic.ops, hw_agnostic.backend, sys\n"
        "after = (ld.rsqrt, it.InterpreterBuilder.binary_op, it.InterpreterBuilder.cast_impl)\n"
        "assert before == after, 'patched without an interpreter'\n"
        "assert 'helion' not in sys.modules, 'Helion imported by a process that compiles no kernel'\n"
        "import torch\n"
        "try:\n"
        "    torch.ops.aten.mm.dtype(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16), torch.float32)\n"
        "    print('has-mm-dtype')\n"
        "except (RuntimeError, NotImplementedError):\n"
        "    print('untouched')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("untouched", "has-mm-dtype")


def test_both_interpreters_at_once_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HELION_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="separate processes"):
        interpreter_mode()


@pytest.mark.dsl
@pytest.mark.skipif(interpreter_mode() != "helion", reason="needs HELION_INTERPRET=1")
def test_mm_dtype_has_a_cpu_kernel_in_helion_interpret_mode():
    a, b = torch.randn(3, 4).to(torch.bfloat16), torch.randn(4, 5).to(torch.bfloat16)
    got = torch.ops.aten.mm.dtype(a, b, torch.float32)
    torch.testing.assert_close(got, a.float() @ b.float())


# --------------------------------------------------------------------------------------------
# Triton interpreter: raw kernels exercising each repaired path



@triton.jit
def unary(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    if OP == "rsqrt":
        y = libdevice.rsqrt(x)
    elif OP == "tanh":
        y = libdevice.tanh(x)
    elif OP == "erf":
        y = libdevice.erf(x)
    elif OP == "exp":
        y = libdevice.exp(x)
    elif OP == "pow":
        y = libdevice.pow(x, 2.5)
    else:
        y = libdevice.log1p(x)
    tl.store(out_ptr + offs, y, mask=mask)

@triton.jit
def bf16_math(a_ptr, b_ptr, sum_ptr, prod_ptr, less_ptr, rowsum_ptr, dot_ptr, to_bf16_ptr, f32_ptr,
              N: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + rows * N + cols)
    b = tl.load(b_ptr + rows * N + cols)
    tl.store(sum_ptr + rows * N + cols, a + b)
    tl.store(prod_ptr + rows * N + cols, a * b)
    tl.store(less_ptr + rows * N + cols, (a < b).to(tl.int8))
    tl.store(rowsum_ptr + tl.arange(0, N), tl.sum(a.to(tl.float32), axis=1).to(tl.bfloat16))
    tl.store(dot_ptr + rows * N + cols, tl.dot(a, b, out_dtype=tl.float32))
    f = tl.load(f32_ptr + rows * N + cols)
    tl.store(to_bf16_ptr + rows * N + cols, f.to(tl.bfloat16))




@triton_tier
@pytest.mark.dsl
@pytest.mark.parametrize("op, reference", [
    ("rsqrt", torch.rsqrt), ("tanh", torch.tanh), ("erf", torch.erf), ("exp", torch.exp),
    ("pow", lambda t: t.pow(2.5)), ("log1p", torch.log1p),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_libdevice_functions_compute(op, reference, dtype):
    x = (torch.rand(37) * 2 + 0.1).to(dtype)
    out = torch.full_like(x, float("nan"))
    unary[(1,)](x, out, 37, OP=op, BLOCK=64)
    want = reference(x.double()).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want.double(), rtol=tol, atol=tol)


@triton_tier
@pytest.mark.dsl
def test_bf16_arithmetic_and_rounding_match_torch():
    n = 16
    a = torch.randn(n, n).to(torch.bfloat16)
    b = torch.randn(n, n).to(torch.bfloat16)
    f32 = torch.randn(n, n) * 100
    outs = dict(
        sum=torch.empty_like(a), prod=torch.empty_like(a), less=torch.empty(n, n, dtype=torch.int8),
        rowsum=torch.empty(n, dtype=torch.bfloat16), dot=torch.empty(n, n), to_bf16=torch.empty_like(a),
    )
    bf16_math[(1,)](a, b, outs["sum"], outs["prod"], outs["less"], outs["rowsum"], outs["dot"], outs["to_bf16"], f32, N=n)
    assert torch.equal(outs["sum"], a + b)
    assert torch.equal(outs["prod"], a * b)
    assert torch.equal(outs["less"].bool(), a < b)
    torch.testing.assert_close(outs["rowsum"], a.float().sum(1).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(outs["dot"], a.float() @ b.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["to_bf16"], f32.to(torch.bfloat16)), "float32 -> bf16 must round to nearest-even"


def _row_max(x, out):
    m, n = x.size()
    for tile_m in hl.tile(m):
        out[tile_m] = torch.amax(x[tile_m, :], dim=-1)


@triton_tier
@pytest.mark.dsl
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_helion_amax_keeps_nan_and_dtype_under_the_faster_reduction(dtype):
    import helion

    kernel = helion.kernel(_row_max, static_shapes=False,
                           config=helion.Config(block_sizes=[2], reduction_loops=[None]))
    x = torch.randn(5, 33).to(dtype)
    x[1, 3] = float("nan")
    out = torch.empty(5, dtype=dtype)
    kernel(x, out)
    assert torch.equal(out.isnan(), x.amax(-1).isnan())
    assert torch.equal(out[~out.isnan()], x.amax(-1)[~out.isnan()])


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def helper_calls(x_ptr, out_ptr, rowmax_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    acc = tl.zeros([N], dtype=tl.float32) + x  # tl.zeros, tl.sum, tl.max: helpers from triton.language.core's module
    tl.store(out_ptr + row, _scaled(tl.sum(acc, axis=0), 2.0))
    tl.store(rowmax_ptr + row, tl.max(acc, axis=0))


@triton.jit
def int32_product(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(a_ptr + offs) * tl.load(b_ptr + offs))


@triton_tier
@pytest.mark.dsl
def test_helpers_inside_a_launch_compute_and_the_language_is_restored_after_it():
    """triton.language is patched once per launch (fix 7): every program's helper calls still compute,
    and after the launch, a failing one included, the language is Triton's again."""
    from triton.language.core import is_builtin

    x = torch.randn(5, 8)
    out, rowmax = torch.empty(5), torch.empty(5)
    for _ in range(2):  # the second launch starts from the restored language
        helper_calls[(5,)](x, out, rowmax, N=8)
        torch.testing.assert_close(out, 2 * x.sum(1))
        assert torch.equal(rowmax, x.amax(1))
        assert is_builtin(tl.load) and is_builtin(tl.store) and is_builtin(tl.program_id)
    with pytest.raises(Exception):
        helper_calls[(5,)](x, out, rowmax, N=7)  # tl.arange needs a power of two
    assert is_builtin(tl.load) and is_builtin(tl.arange)
    helper_calls[(5,)](x, out, rowmax, N=8)
    torch.testing.assert_close(out, 2 * x.sum(1))


@triton_tier
@pytest.mark.dsl
def test_int32_arithmetic_wraps_as_on_a_gpu_without_the_discarded_overflow_check():
    """The interpreter's overflow check asserts only under ``debug``, which it never sets; without it
    (fix 6) a product that overflows int32 wraps, as the GPU's does."""
    from triton.runtime import interpreter

    assert not interpreter.interpreter_builder.options.debug
    a = torch.tensor([2**20, 3, -(2**20), 46341] * 4, dtype=torch.int32)
    b = torch.tensor([2**12, 5, 2**12, 46341] * 4, dtype=torch.int32)
    out = torch.empty_like(a)
    int32_product[(1,)](a, b, out, N=16)
    assert torch.equal(out, a * b)  # torch's int32 product wraps too
