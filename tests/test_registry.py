"""Dispatch: provider choice and fallback, forcing, plans, inspection, config provenance."""

from __future__ import annotations

import logging
from typing import NamedTuple

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.autotune import cache as config_cache
from hw_agnostic.autotune.keys import token_bucket
from hw_agnostic.kernels.interpret import interpreter_mode
from hw_agnostic.kernels.runtime import KernelSpec
from hw_agnostic.ops.registry import PROVIDER_ENV, Op, Provider, ProviderError
from tests.conftest import kernel_device
from tests.harness import dsl_providers


def _call(tokens: int = 3, hidden: int = 16):
    return torch.randn(tokens, hidden), torch.ones(hidden)


@pytest.mark.skipif(interpreter_mode() is not None, reason="checks the plain CPU path")
def test_cpu_falls_back_to_the_reference_and_says_why():
    plan = ops.get_op("rms_norm").plan(*_call(), 1e-6, "llama")
    assert plan.provider == "reference"
    assert "device 'cpu' is not supported" in plan.skipped["helion"]
    assert "TRITON_INTERPRET=1" in plan.skipped["helion"]


@pytest.mark.skipif(interpreter_mode() is not None, reason="checks the plain CPU path")
def test_forcing_a_provider_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv(PROVIDER_ENV, "helion")
    with pytest.raises(ProviderError, match=r"'helion' was forced \(HW_AGNOSTIC_PROVIDER\).*device 'cpu'"):
        ops.rms_norm(*_call())
    with ops.use_provider("helion", ops.silu_and_mul), pytest.raises(ProviderError, match="use_provider for silu_and_mul"):
        ops.silu_and_mul(torch.randn(2, 8))


def test_forcing_an_unknown_provider_names_the_ones_there_are(monkeypatch):
    monkeypatch.setenv(PROVIDER_ENV, "cuda_graphs")
    with pytest.raises(ProviderError, match="has no such provider \\(it has helion, reference\\)"):
        ops.rms_norm(*_call())


def test_environment_forcing_per_op(monkeypatch):
    monkeypatch.setenv(PROVIDER_ENV, "rms_norm=reference,helion")
    with ops.trace_dispatch() as ran:
        ops.rms_norm(*_call())
    assert ran[0].provider == "reference"
    monkeypatch.setenv(PROVIDER_ENV, "rms_nrom=reference")
    ops.reset()
    with pytest.raises(ProviderError, match="names op 'rms_nrom', which does not exist"):
        ops.rms_norm(*_call())


def test_use_provider_is_scoped_and_covers_the_inplace_variant():
    x, residual = torch.randn(2, 8), torch.randn(2, 8)
    with ops.use_provider("reference", ops.fused_add_rms_norm), ops.trace_dispatch() as ran:
        ops.fused_add_rms_norm(x, residual, inplace=True)
    assert [(p.op, p.provider) for p in ran] == [("fused_add_rms_norm_", "reference")]
    from hw_agnostic.ops.registry import forced_provider

    assert forced_provider("fused_add_rms_norm_") is None


def test_a_plan_is_built_once_per_key_and_counts_calls():
    op = ops.get_op("rms_norm")
    x, w = _call(5)
    first = op.plan(x, w, 1e-6, "llama")
    ops.rms_norm(x, w)
    ops.rms_norm(torch.randn(7, 16), w)  # same token bucket (8): same plan
    assert op.plan(x, w, 1e-6, "llama") is first and first.calls == 2
    ops.rms_norm(torch.randn(9, 16), w)  # next bucket: a new plan
    assert len(op.plans()) == 2


def test_the_eager_entry_names_a_missing_argument_and_leaves_fake_and_grad_calls_to_the_custom_op():
    """``op.call`` (what the public functions call) is one generated frame: its parameters are the
    reference's, and only a plain eager call takes its remembered-signature path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = ops.get_op("layer_norm")
    with pytest.raises(TypeError, match="numerics"):
        op.call(torch.randn(2, 16), None, None, 1e-5)
    x, weight = torch.randn(3, 16), torch.randn(16, requires_grad=True)
    op.call(x, weight.detach(), None, 1e-5, "fp32")
    out = op.call(x, weight, None, 1e-5, "fp32")  # same metadata, but autograd records it
    assert out.grad_fn is not None
    out.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    with FakeTensorMode() as mode:
        fake = op.call(mode.from_tensor(x), None, None, 1e-5, "fp32")
    assert type(fake).__name__ == "FakeTensor" and fake.shape == x.shape


def test_a_remembered_signature_is_taken_only_by_calls_alike_in_every_respect_the_signature_holds():
    """A repeated signature is checked by tensor guards (``ops.call_signature``): a call that differs
    from it in a tensor's shape, strides or dtype, in an argument's value or type, or in which optional
    tensor is None, is checked and keyed as a new signature (``_checked`` grows by one)."""
    from hw_agnostic.ops import call_signature

    assert call_signature._GUARDS is not None  # this torch's guards tell signatures apart: the path is tested
    op = ops.get_op("rms_norm")
    op.reset()
    x, w = torch.randn(4, 16), torch.randn(16)
    for _ in range(3):
        ops.rms_norm(x, w)
    assert len(op._checked) == 1 and len(op._recent) == 1
    variants = {
        "strides": lambda: ops.rms_norm(x.t().contiguous().t(), w),
        "shape": lambda: ops.rms_norm(torch.randn(5, 16), w),
        "dtype": lambda: ops.rms_norm(x.double(), w),
        "eps value": lambda: ops.rms_norm(x, w, 1e-5),
        "eps type": lambda: ops.rms_norm(x, w, 1),
        "numerics": lambda: ops.rms_norm(x, w, numerics="gemma"),
        "no weight": lambda: ops.rms_norm(x, None),
    }
    for name, call in variants.items():
        seen = len(op._checked)
        for _ in range(2):  # the second call is remembered; the next variant must not take it
            call()
        assert len(op._checked) == seen + 1, name
    seen = len(op._checked)
    torch.testing.assert_close(ops.rms_norm(x, w), op.reference(x, w, 1e-6, "llama"))
    assert len(op._checked) == seen


def test_without_tensor_guards_every_call_builds_its_signature(monkeypatch):
    """Where torch has no usable guards, the generated call is the plain signature lookup: it keeps
    nothing in ``_recent`` and an in-place call's placement still refuses shared memory."""
    from hw_agnostic.ops import call_signature

    monkeypatch.setattr(call_signature, "_GUARDS", None)
    op = ops.get_op("fused_add_rms_norm_")
    op.reset()
    call = call_signature.call_function(op, op.reference, op.mutates_args, [], op._call_general)
    x, residual, weight = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    want_x, want_residual = x.clone(), residual.clone()
    normed, summed = ops.get_op("fused_add_rms_norm").reference(want_x, want_residual, weight, 1e-6, "llama")
    call(x, residual, weight, 1e-6, "llama")
    torch.testing.assert_close((x, residual), (normed, summed))
    for _ in range(2):
        call(torch.randn(2, 8), torch.randn(2, 8), weight, 1e-6, "llama")
    assert op._recent == [] and len(op._checked) == 1
    for _ in range(2):  # the same views of two buffers, then of one: a signature seen, its placement not
        call(torch.zeros(3, 8)[:, :5], torch.zeros(3, 8)[:, 3:], weight[:5], 1e-6, "llama")
    shared = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="share memory"):
        call(shared[:, :5], shared[:, 3:], weight[:5], 1e-6, "llama")


def test_trace_dispatch_records_in_call_order():
    x = torch.randn(2, 16)
    with ops.trace_dispatch() as ran:
        ops.silu_and_mul(ops.rms_norm(x))
    assert [p.op for p in ran] == ["rms_norm", "silu_and_mul"]
    assert "rms_norm: " in ran[0].describe()


def test_plans_are_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="hw_agnostic.ops"):
        ops.gelu_and_mul(torch.randn(2, 8))
    assert any(r.getMessage().startswith("gelu_and_mul: ") for r in caplog.records)


def test_custom_ops_are_registered():
    x = torch.randn(2, 8)
    torch.testing.assert_close(torch.ops.hw_agnostic.rms_norm(x, None, 1e-6, "llama"), ops.rms_norm(x))
    assert set(ops.all_ops()) >= {"rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "silu_and_mul",
                                  "gelu_and_mul", "swiglu_oai"}


def test_registering_an_op_twice_fails():
    op = ops.get_op("rms_norm")
    with pytest.raises(ValueError, match="already registered"):
        Op("rms_norm", op.reference, check=op.check, key=op.key)


def test_unknown_op_name_in_the_api():
    with pytest.raises(ValueError, match="unknown op 'group_norm'"):
        ops.use_provider("reference", "group_norm").__enter__()


@pytest.mark.dsl
def test_a_declined_call_falls_back_to_the_reference(device):
    """Leading dims that do not collapse into one row stride: the kernel declines, the result is right."""
    x = torch.randn(4, 3, 16, device=device).transpose(0, 1)
    with ops.trace_dispatch() as ran:
        got = ops.rms_norm(x)
    assert ran[0].provider == "reference"
    assert "do not collapse" in ran[0].skipped["helion"]
    torch.testing.assert_close(got, ops.get_op("rms_norm").reference(x, None, 1e-6, "llama"))


@pytest.mark.dsl
def test_kernel_dtypes_are_declined_not_miscomputed(device):
    x = torch.randn(3, 16, dtype=torch.float64, device=device)
    with ops.trace_dispatch() as ran:
        ops.silu_and_mul(x)
    assert ran[0].provider == "reference" and "float64" in ran[0].skipped["helion"]


# --------------------------------------------------------------------------------------------
# tuned configs reach the plan: a test op whose provider runs on the CPU and records its config


class _ScaleKey(NamedTuple):
    device: str
    width: int
    tokens: int


def _scale_reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_launched: list[dict] = []


def _build_scale(key, config, args):
    def run(x):
        _launched.append(config)
        return x * 2

    return run


SCALE_KERNEL = KernelSpec("test_scale", (_scale_reference,), lambda key: {"block": 1},
                          lambda key: [{"block": 1}, {"block": 2}])
SCALE_OP = Op(
    "test_scale", _scale_reference,
    check=lambda x: None, key=lambda x: _ScaleKey(x.device.type, x.shape[-1], token_bucket(x.numel() // x.shape[-1])),
    providers=[Provider("fast", _build_scale, devices=frozenset({"cpu"}), kernel=SCALE_KERNEL,
                        tuning_key=lambda key: {"width": key.width})],
    example_inputs=lambda tokens, width, dtype, device: (torch.randn(tokens, width, dtype=dtype, device=device),),
)


def test_a_saved_config_is_the_one_the_runtime_picks(tmp_path, monkeypatch):
    monkeypatch.setenv(config_cache.USER_ROOT_ENV, str(tmp_path))
    x = torch.randn(6, 4)
    assert SCALE_OP.plan(x).config.source == "default"
    config_cache.save_entry(SCALE_KERNEL, "cpu", {"width": 4, "tokens": 8}, {"block": 2}, time_us=1.0)
    _launched.clear()
    with ops.trace_dispatch() as ran:
        SCALE_OP(x)
    choice = ran[0].config
    assert (choice.source, choice.match, choice.config) == ("user", "exact", {"block": 2})
    assert choice.path == str(tmp_path / "cpu" / "test_scale.json")
    assert _launched == [{"block": 2}]
    # another token count with the same static key takes the nearest tuned bucket, if near enough
    assert SCALE_OP.plan(torch.randn(40, 4)).config.match == "nearest"
    assert SCALE_OP.plan(torch.randn(1000, 4)).config.match == "builtin"


def test_use_config_overrides_tuned_configs(tmp_path, monkeypatch):
    monkeypatch.setenv(config_cache.USER_ROOT_ENV, str(tmp_path))
    with ops.use_config(SCALE_OP, {"block": 7}):
        choice = SCALE_OP.plan(torch.randn(2, 4)).config
    assert (choice.source, choice.config) == ("override", {"block": 7})
    assert SCALE_OP.plan(torch.randn(2, 4)).config.source == "default"


def test_a_config_that_fails_to_build_falls_back_to_the_default(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(config_cache.USER_ROOT_ENV, str(tmp_path))
    config_cache.save_entry(SCALE_KERNEL, "cpu", {"width": 5, "tokens": 2}, {"block": "bad"}, time_us=None)
    original = SCALE_OP.providers[0].build

    def picky_build(key, config, args):
        if config["block"] == "bad":
            raise ValueError("block must be an int")
        return original(key, config, args)

    object.__setattr__(SCALE_OP.providers[0], "build", picky_build)
    try:
        with caplog.at_level(logging.WARNING):
            plan = SCALE_OP.plan(torch.randn(2, 5))
    finally:
        object.__setattr__(SCALE_OP.providers[0], "build", original)
    assert plan.provider == "fast" and plan.config.source == "default"
    assert any("failed to build" in r.getMessage() for r in caplog.records)


def test_use_config_with_an_unknown_field_is_an_error_naming_it():
    with ops.use_config(SCALE_OP, {"blokc": 2}), pytest.raises(ValueError, match=r"unknown config field\(s\) 'blokc'"
                                                                "; test_scale's kernels take block"):
        SCALE_OP(torch.randn(2, 4))
    with ops.use_config(ops.rms_norm, {"block_sizes": [4], "reduction_loop": [None]}), pytest.raises(
            ValueError, match="'reduction_loop'; rms_norm's kernels take block_sizes, .*reduction_loops"):
        ops.rms_norm(*_call())


@pytest.mark.skipif(interpreter_mode() is not None, reason="checks the plain CPU path, which takes no config")
def test_use_config_on_a_path_without_configs_warns_once(caplog):
    config = {"block_sizes": [4], "num_warps": 8}
    with caplog.at_level(logging.WARNING, logger="hw_agnostic.ops"), ops.use_config(ops.rms_norm, config):
        ops.rms_norm(*_call(3))
        ops.rms_norm(*_call(3))
        ops.rms_norm(*_call(100))  # another key, same override: still one warning
    warnings = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(warnings) == 1
    assert "rms_norm runs the reference provider, which takes no config" in warnings[0]
    assert "helion: device 'cpu' is not supported" in warnings[0]


class _Rows(NamedTuple):
    device: str
    tokens: int


def _add_one_reference(x: torch.Tensor) -> None:
    x.add_(1)


def _build_add_one_behind_autograd(key, config, args):
    def run(x):  # stores as a kernel makes them: through memory autograd does not see (.data)
        x.data.add_(1)

    return run


ADD_ONE_OP = Op(
    "test_add_one_", _add_one_reference, check=lambda x: None, key=lambda x: _Rows(x.device.type, x.shape[0]),
    providers=[Provider("kernel_like", _build_add_one_behind_autograd, devices=frozenset({"cpu"}))],
    mutates_args=("x",),
)


def test_an_inplace_ops_writes_bump_the_version_counters_of_what_it_wrote():
    """A kernel's stores do not bump version counters as ATen's in-place ops do; dispatch does, so
    autograd refuses a backward through a tensor saved before the op wrote it, as it would after
    ``x.add_(1)``, instead of differentiating with the new values."""
    weight = torch.ones(3, requires_grad=True)
    x = torch.ones(3)
    product = weight * x  # saves x for weight's gradient
    version = x._version
    ADD_ONE_OP(x)
    assert torch.equal(x, torch.full((3,), 2.0)) and x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


@pytest.mark.dsl
@pytest.mark.parametrize("inplace_op", ["fused_add_rms_norm_", "fused_add_layer_norm_", "write_kv_cache"])
def test_the_kernels_of_the_inplace_ops_bump_what_they_write(inplace_op):
    op = ops.get_op(inplace_op)
    args = op.example_inputs(4, 64, torch.float32, str(kernel_device()))
    written = [args[i] for i in op._mutated_positions]
    before = [t._version for t in written]
    (provider,) = dsl_providers(op)
    with torch.no_grad(), ops.use_provider(provider, op), ops.trace_dispatch() as ran:
        op(*args)
    assert [p.provider for p in ran] == [provider]
    assert all(t._version > v for t, v in zip(written, before))


def test_a_reference_parameter_that_would_hide_a_name_of_the_generated_call_is_refused():
    def reference(x: torch.Tensor, type: str) -> torch.Tensor:
        return x

    with pytest.raises(ValueError, match=r"\['type'\] would hide names"):
        Op("hides_a_name", reference, check=lambda x, type: None, key=lambda x, type: None)
    assert "hides_a_name" not in ops.all_ops() and not hasattr(torch.ops.hw_agnostic, "hides_a_name")
