"""Every op as a custom op: opcheck, torch.compile(fullgraph=True), and the compiled reference."""

from __future__ import annotations

import logging

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.kernels.interpret import interpreter_mode
from hw_agnostic.ops import registry
from hw_agnostic.ops.registry import all_ops
from hw_agnostic.tolerances import assert_within_ulps
from tests.conftest import kernel_device
from tests.harness import dsl_providers

ALL_OPS = sorted(name for name in all_ops() if not name.startswith("test_"))  # test modules add test_* ops


def _providers() -> list:
    dsl = dsl_providers(all_ops()["rms_norm"]) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


def _opcheck_providers() -> list:
    """What opcheck checks is the op's registration (schema, fake, autograd, the writes it declares),
    which the Helion source decides, and the Helion interpreter tier runs them on the DSL provider: under
    the Triton interpreter the same checks only added code generation (each opcheck builds kernels for
    several argument specialisations; 57 s of the tier's CPU time on the EPYC)."""
    return ["reference"] if interpreter_mode() == "triton" else _providers()


@pytest.mark.parametrize("provider", _opcheck_providers())
@pytest.mark.parametrize("name", ALL_OPS)
def test_opcheck(name, provider):
    op = all_ops()[name]
    device = "cpu" if provider == "reference" else kernel_device()
    for tokens, width, dtype in ((3, 16, torch.float32), (5, 24, torch.bfloat16)):
        args = op.example_inputs(tokens, width, dtype, device)
        with ops.use_provider(provider, op):
            torch.library.opcheck(op.torch_op, args)


def _every_op(x, residual, weight):
    normed = ops.rms_norm(x, weight)
    gemma = ops.rms_norm(x, weight, 1e-5, numerics="gemma")
    fused, summed = ops.fused_add_rms_norm(x, residual, weight, numerics="fp32_scale")
    x2, residual2 = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x2, residual2, weight, inplace=True)
    return (ops.silu_and_mul(normed), ops.gelu_and_mul(gemma, "tanh"), ops.swiglu_oai(fused),
            summed, x2, residual2)


def _inputs(tokens: int, device: str):
    g = torch.Generator().manual_seed(tokens)
    x, residual, weight = (torch.randn(*shape, generator=g).to(device) for shape in ((tokens, 32), (tokens, 32), (32,)))
    return x, residual, weight


@pytest.mark.parametrize("provider", _providers())
def test_compile_fullgraph_through_every_op(provider):
    device = "cpu" if provider == "reference" else kernel_device()
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True, backend="aot_eager", dynamic=True)
    with ops.use_provider(provider):
        for tokens in (3, 7):
            args = _inputs(tokens, device)
            for got, want in zip(compiled(*args), _every_op(*args)):
                torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_compile_with_inductor():
    """The custom ops inside an Inductor graph (the backend users get by default)."""
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True)
    args = _inputs(4, "cpu")
    for got, want in zip(compiled(*args), _every_op(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_fusable_ops_are_fused_by_inductor_where_no_kernel_runs():
    """Dynamo's graph keeps a ``torch.ops.hw_agnostic`` node either way; where no kernel can run
    (the CPU outside the interpreters) it is the ``fusable`` overload, which Inductor compiles
    into its own fused code, and where one may run it stays a call of the op."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    def norm_then_act(x, residual, weight):
        normed, summed = ops.fused_add_rms_norm(x, residual, weight)
        return ops.silu_and_mul(torch.cat([normed, summed], -1)) * 2.0

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return compile_fx(gm, example_inputs)

    kernel = ops.get_op("rms_norm").kernel_may_run(kernel_device() or "cpu")
    device = kernel_device() or "cpu"
    args = _inputs(4, device)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(norm_then_act, fullgraph=True, backend=record)(*args), norm_then_act(*args))
    overload = "default" if kernel else "fusable"
    for name in ("fused_add_rms_norm", "silu_and_mul"):
        assert f"torch.ops.hw_agnostic.{name}.{overload}(" in graphs[0], graphs[0]
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(norm_then_act, fullgraph=True), *args)
    calls = [line for line in code[0].splitlines() if "= torch.ops.hw_agnostic." in line]
    assert bool(calls) == kernel, calls


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_and_mul", "swiglu_oai"])
def test_differentiable_ops_backpropagate_through_their_reference(name):
    """The kernel runs forward; the backward is the reference's, so gradients match autograd's."""
    op = ops.get_op(name)
    assert op.differentiable
    args = tuple(a.double().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in op.example_inputs(5, 16, torch.float32, "cpu"))
    assert torch.autograd.gradcheck(lambda *t: op(*t), args)
    compiled = torch.compile(lambda *t: op(*t), fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    (out if isinstance(out, torch.Tensor) else out[0]).sum().backward()
    assert all(a.grad is not None for a in args if isinstance(a, torch.Tensor) and a.requires_grad)


def test_ops_that_mutate_have_no_backward():
    x, residual = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="writes x, residual in place and has no backward"):
        ops.fused_add_rms_norm(x, residual, torch.ones(8), inplace=True)
    with torch.no_grad():
        ops.fused_add_rms_norm(x, residual, torch.ones(8), inplace=True)


# --------------------------------------------------------------------------------------------
# the compiled reference (the CPU fast path)


@pytest.mark.slow
def test_reference_runs_compiled_and_rounds_where_eager_does(monkeypatch):
    """Compiled, the reference keeps the spec's roundings (Inductor would otherwise fuse the bf16
    casts away: llama numerics would become fp32_scale); the activations' eager in-place form is
    bit-identical to the reference."""
    monkeypatch.setenv(registry.COMPILE_ENV, "1")
    ops.reset()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=g).to(torch.bfloat16)
    for tokens in (1, 5, 9, 33):  # one compile, then the token count goes dynamic
        x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
        with ops.trace_dispatch() as ran:
            got, act = ops.rms_norm(x, weight), ops.silu_and_mul(x)
        norm = ran[0]
        assert isinstance(norm.run, registry.CompiledReference) and norm.run.has_compiled
        assert_within_ulps(got, ops.get_op("rms_norm").reference(x, weight, 1e-6, "llama"))
        assert torch.equal(act, ops.get_op("silu_and_mul").reference(x))


def test_reference_falls_back_to_eager_when_compiling_fails(monkeypatch, caplog, request):
    from hw_agnostic.ops import compiled_reference

    monkeypatch.setenv(registry.COMPILE_ENV, "1")

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    def broken_lean(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(compiled_reference, "_LeanGraph", broken_lean)
    ops.reset(compiled_references=True)  # what other tests compiled would not fail
    request.addfinalizer(lambda: ops.reset(compiled_references=True))  # nor leave these broken
    x, weight = torch.randn(3, 16), torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="hw_agnostic.ops"):
        got = ops.rms_norm(x, weight)
        ops.rms_norm(x, weight)
    torch.testing.assert_close(got, ops.get_op("rms_norm").reference(x, weight, 1e-6, "llama"))
    warnings = [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert len(warnings) == 1


def test_compiling_the_reference_can_be_disabled(monkeypatch):
    monkeypatch.setenv(registry.COMPILE_ENV, "0")
    ops.reset()
    plan = ops.get_op("rms_norm").plan(torch.randn(2, 8), None, 1e-6, "llama")
    assert plan.run is ops.get_op("rms_norm").reference


@pytest.mark.slow
def test_inplace_reference_compiles_without_falling_back(monkeypatch, caplog):
    """Inductor cannot compile the in-place reference as written; its compiled form must still run compiled."""
    monkeypatch.setenv(registry.COMPILE_ENV, "1")
    ops.reset()
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(6, 48, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(48, generator=g).to(torch.bfloat16)
    want_normed, want_sum = ops.get_op("fused_add_rms_norm").reference(x, residual, weight, 1e-6, "llama")
    with caplog.at_level(logging.WARNING, logger="hw_agnostic.ops"):
        ops.fused_add_rms_norm(x, residual, weight, inplace=True)
    assert not [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert torch.equal(residual, want_sum)
    torch.testing.assert_close(x, want_normed, rtol=1.6e-2, atol=1e-2)


def test_ops_without_a_derivative_refuse_backward_naming_the_op():
    """An op that is not differentiable passes no silent zero gradient on: its outputs carry a
    backward that raises, whether called through the API or ``torch.ops``; without inputs that
    need gradients its outputs need none."""
    op = ops.get_op("moe_route")
    logits, *rest = op.example_inputs(4, 64, torch.float32, "cpu")
    weights, ids = op(logits.requires_grad_(), *rest)
    assert weights.requires_grad and not ids.requires_grad and ids.dtype in (torch.int32, torch.int64)
    with pytest.raises(RuntimeError, match="hw_agnostic::moe_route has no derivative"):
        weights.sum().backward()
    weights, _ = op.torch_op(logits.detach(), *rest)
    assert not weights.requires_grad
    with torch.no_grad():
        assert not op.torch_op(logits, *rest)[0].requires_grad


def test_a_custom_op_call_costs_one_python_autograd_kernel():
    """The ops are defined on the library directly, not through ``torch.library.custom_op``, whose
    Python layers cost 10-16 µs on every call a compiled graph makes: each op has exactly one
    Python kernel at the Autograd key and one at CompositeExplicitAutograd."""
    for name in ops.all_ops():
        qualname = f"hw_agnostic::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "ADInplaceOrView"), name
