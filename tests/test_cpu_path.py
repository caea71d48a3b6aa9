"""The CPU path: what the reference provider runs when compiling is on (the default on a CPU).

It must compute what the reference computes: on the reference-vs-float64 harness cases of
every op (odd sizes, strides, zero rows, in-place contracts, poisoned allocations), and
bit for bit where the spec is element-wise. Speed is the bench's business (``make bench``).
"""

from __future__ import annotations

import importlib
import re
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.kernels.interpret import interpreter_mode
from hw_agnostic.ops import compiled_reference, registry
from hw_agnostic.tolerances import assert_close
from tests.harness import Case, check_provider
from tests.ops import test_activations as activation_tests
from tests.ops import test_gated_rms_norm as gated_tests
from tests.ops import test_layer_norm as layer_norm_tests
from tests.ops import test_rotary_embedding as rotary_tests
from tests.ops import test_rotary_write_kv_cache as fused_rotary_tests
from tests.ops import test_paged_attention as attention_tests
from tests.ops import test_rms_norm as norm_tests

activations = importlib.import_module("hw_agnostic.ops.activations")
rms_norm = importlib.import_module("hw_agnostic.ops.rms_norm")
layer_norm = importlib.import_module("hw_agnostic.ops.layer_norm")
rotary = importlib.import_module("hw_agnostic.ops.rotary_embedding")
fused_rotary = importlib.import_module("hw_agnostic.ops.rotary_write_kv_cache")
gated = importlib.import_module("hw_agnostic.ops.gated_rms_norm")
route_module = importlib.import_module("hw_agnostic.ops.moe_route")

pytestmark = pytest.mark.skipif(interpreter_mode() is not None, reason="the plain CPU path (no interpreter)")


@pytest.fixture(autouse=True)
def _compiling(monkeypatch):
    monkeypatch.setenv(registry.COMPILE_ENV, "1")
    ops.reset()


def _without_config(case: Case) -> Case:
    return Case(case.id, case.make)  # launch configs are the kernels'; the reference takes none


# One case per dtype x numerics, plus strides, leading dims, zero rows and a wide row: each new
# (dtypes, ranks, scalars) combination compiles once (2-3 s with Inductor's cache cold, as on a fresh
# machine), so not the whole kernel grid. eps is a constant of the graph: another eps is another
# compile of the same code, so one dtype and numerics carries the large-eps variant.


def _one_large_eps(case: Case) -> bool:
    return "eps0.01" not in case.id or "bfloat16-llama" in case.id


NORM_CASES = [c for c in norm_tests.RMS_CASES if c.config is None and _one_large_eps(c) and (
              "-37-" in f"-{c.id}" or "7x37" in c.id
              or any(tag in c.id for tag in ("padded", "inner_stride", "permuted", "0x64", "2x3x48", "wfloat32")))]


@pytest.mark.slow
@pytest.mark.parametrize("case", NORM_CASES, ids=repr)
def test_rms_norm(case):
    check_provider(rms_norm.rms_norm_op, "reference", _without_config(case), "cpu")


FUSED_NORM_CASES = [c for c in norm_tests.FUSED_CASES if c.config is None and _one_large_eps(c) and (
    "7x37-bfloat16" in c.id or "7x37-float32-llama" in c.id or "padded" in c.id or "0x64" in c.id)]


@pytest.mark.slow
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", FUSED_NORM_CASES, ids=repr)
def test_fused_add_rms_norm(case, inplace):
    op = rms_norm.fused_add_rms_norm_inplace_op if inplace else rms_norm.fused_add_rms_norm_op
    check_provider(op, "reference", _without_config(case), "cpu")


def _inplace_accepts(case: Case) -> bool:
    try:
        rms_norm.check_fused_add_rms_norm_inplace(*case.make())
    except (TypeError, ValueError):
        return False
    return True


NATIVE_NORM_CASES = [(form, c) for c in norm_tests.FUSED_CASES if c.config is None
                     for form in ("norm", "add", "add_inplace") if form != "add_inplace" or _inplace_accepts(c)]


@pytest.mark.parametrize("form,case", NATIVE_NORM_CASES, ids=lambda v: v if isinstance(v, str) else repr(v))
@pytest.mark.parametrize("spoiled", [False, True], ids=["finite", "nan-and-inf-rows"])
def test_rms_norm_native_forms_are_bit_identical_to_the_reference(form, case, spoiled, monkeypatch):
    """Every numerics, dtype mix, layout and size of the harness; NaN and infinities too (in the
    first rows only: a row with one NaN normalises to NaN)."""
    monkeypatch.setenv(registry.COMPILE_ENV, "native")
    x, residual, weight, eps, numerics = case.make()
    if spoiled and x.numel():
        _spoil_row(x, 0, slice(None, None, 5), float("nan"))
        _spoil_row(residual, 1, slice(1, None, 7), float("inf"))
    key = rms_norm.fused_add_rms_norm_key(x, residual, weight, eps, numerics)._replace(tokens=1, hidden=1)
    native = rms_norm._native(form)(key)  # the form itself, whatever the call's size
    want = rms_norm.fused_add_rms_norm_reference(x, residual, weight, eps, numerics)
    if form == "norm":
        got, want = (native(x, weight, eps, numerics),), (rms_norm.rms_norm_reference(x, weight, eps, numerics),)
    elif form == "add":
        got = native(x, residual, weight, eps, numerics)
    else:
        native(x, residual, weight, eps, numerics)
        got = (x, residual)
    for mine, spec in zip(got, want):
        _assert_same_bits(mine, spec)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_inplace_norms_add_large_16_bit_rows_in_compiled_code_as_eager_adds(norm, dtype):
    """From rms_norm.COMPILED_ADD_ELEMENTS on, the in-place fused norms add the residual in a compiled
    graph: the sum must be eager's bit for bit (NaN and infinities included), the output the spec's,
    and below that size ATen adds (no graph)."""
    hidden = 160  # a vector tail on every row
    large = rms_norm.COMPILED_ADD_ELEMENTS // hidden + 3
    ops.reset(compiled_references=True)
    for rows in (large, 5):
        g = torch.Generator().manual_seed(rows)
        x = (4 * torch.randn(rows, hidden, generator=g)).to(dtype)
        residual = (4 * torch.randn(rows, hidden, generator=g)).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
        _spoil_row(x, 0, slice(None, None, 5), float("nan"))
        _spoil_row(residual, 1, slice(1, None, 7), float("inf"))
        _spoil_row(x, 1, slice(3, None, 7), float("-inf"))
        if norm == "rms":
            op, args, spec = rms_norm.fused_add_rms_norm_inplace_op, (weight, 1e-6, "llama"), rms_norm.rms_norm_reference
        else:
            op, args, spec = layer_norm.fused_add_layer_norm_inplace_op, (weight, None, 1e-5, "fp32"), \
                layer_norm.layer_norm_reference
        want_sum = residual + x
        run = op.plan(x, residual, *args).run
        assert isinstance(run, rms_norm.CompiledAddThenNormalise), run
        graphs = len(run.add_into.lean)
        op(x, residual, *args)
        _assert_same_bits(residual, want_sum)
        torch.testing.assert_close(x[2:], spec(want_sum, *args)[2:], rtol=1.6e-2, atol=1e-2)
        assert run.add_into.has_compiled and len(run.add_into.lean) == graphs + (rows == large)


def test_native_mode_runs_native_forms_at_every_size_and_compiles_nothing(monkeypatch):
    monkeypatch.setenv(registry.COMPILE_ENV, "native")
    ops.reset()
    op = ops.get_op("rms_norm")
    small, large = torch.randn(2, 64), torch.randn(4096, 64)
    assert op.plan(small, None, 1e-6, "llama").run.__name__ == "norm"
    assert op.plan(large, None, 1e-6, "llama").run.__name__ == "norm"
    moe = ops.get_op("moe_route")  # no native form: the plain reference, not a compiled one
    logits = torch.randn(4, 8)
    assert moe.plan(logits, None, 2, "softmax", True, 1, 1, 1.0).run is moe.reference


def test_moe_align_runs_its_reference_uncompiled_on_the_cpu(monkeypatch):
    """Compiling it cost seconds per token bucket for a fraction of a 0.2 ms call (see its ``_native``)."""
    monkeypatch.setenv(registry.COMPILE_ENV, "1")
    ops.reset()
    op = ops.get_op("moe_align")
    for tokens in (1, 16, 300):
        assert op.plan(torch.randint(0, 8, (tokens, 2)), 8, 16).run is op.reference


@pytest.mark.slow
def test_norms_run_one_compiled_graph_per_specialisation_called_without_dynamo(monkeypatch):
    """Token counts and hidden sizes share a graph; small calls (up to 64K elements) have their own
    single-threaded one."""

    def no_dynamo(*args):
        raise AssertionError("a contiguous call went through torch.compile")

    monkeypatch.setattr(compiled_reference.CompiledReference, "_compiled", no_dynamo)
    ops.reset(compiled_references=True)  # count this test's graphs only
    weight = torch.randn(256, dtype=torch.bfloat16)
    for tokens in (1, 3, 16, 40, 300):  # up to 256 rows of 256 single-threaded, 300 rows not
        x = torch.randn(tokens, 256, dtype=torch.bfloat16)
        with ops.trace_dispatch() as ran:
            got = ops.rms_norm(x, weight)
        torch.testing.assert_close(got, rms_norm.rms_norm_reference(x, weight, 1e-6, "llama"), rtol=1.6e-2, atol=1e-2)
    compiled = ran[0].run
    assert isinstance(compiled, compiled_reference.CompiledReference)
    ours = ((torch.bfloat16, 2), (torch.bfloat16, 1), (compiled_reference._CONSTANT, 1e-6),
            (compiled_reference._CONSTANT, "llama"))
    graphs = {small: graph for (small, signature), graph in compiled.lean.items() if signature == ours}
    assert set(graphs) == {False, True}
    assert all(isinstance(g, compiled_reference._LeanGraph) for g in graphs.values())
    assert (graphs[True].threads, graphs[False].threads) == (1, None)
    before = len(compiled.lean)
    ops.rms_norm(torch.randn(5, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16))
    assert len(compiled.lean) == before  # another hidden size: the same graph


# Layer norms run F.layer_norm where the spec is nn.LayerNorm's computation, the compiled reference
# elsewhere (cast_then_affine, per-head parameters): every case of the DSL tiers but the small-config
# repeats (no kernel config applies here).
# Calls of more rows than NATIVE_ROWS allows run the compiled reference: one case of each form there.
# Of the 7x37 grid of dtypes and numerics, every numerics in bf16 and one case of each other dtype.


def _ln_grid_thinned(case: Case) -> bool:
    return not case.id.startswith("7x37-") or case.id.startswith(
        ("7x37-bfloat16-", "7x37-float32-fp32-", "7x37-float16-cast_then_affine-"))


LAYER_NORM_CASES = [*(c for c in layer_norm_tests.LN_CASES if c.config is None and _ln_grid_thinned(c)),
                    layer_norm_tests.ln_case((300,), 64, torch.bfloat16)]
FUSED_LAYER_NORM_CASES = [*(c for c in layer_norm_tests.FUSED_CASES if c.config is None and _ln_grid_thinned(c)),
                          layer_norm_tests.ln_case((300,), 64, torch.bfloat16, fused=True)]


@pytest.mark.parametrize("case", LAYER_NORM_CASES, ids=repr)
def test_layer_norm(case):
    check_provider(layer_norm.layer_norm_op, "reference", _without_config(case), "cpu")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", FUSED_LAYER_NORM_CASES, ids=repr)
def test_fused_add_layer_norm(case, inplace):
    op = layer_norm.fused_add_layer_norm_inplace_op if inplace else layer_norm.fused_add_layer_norm_op
    check_provider(op, "reference", _without_config(case), "cpu")


def test_layer_norms_of_nn_layer_norm_numerics_run_its_aten_kernel():
    x, weight, bias = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64), torch.randn(64)
    for w, b, numerics in ((weight, bias, "fp32"), (weight.bfloat16(), None, "fp32"), (None, None, "fp32"),
                           (weight, bias, "one_plus")):
        plan = layer_norm.layer_norm_op.plan(x, w, b, 1e-5, numerics)
        assert plan.run.__qualname__.endswith("native.<locals>.norm"), plan.describe()
    per_head = layer_norm.layer_norm_op.plan(torch.randn(3, 2, 64), torch.randn(2, 64), None, 1e-5, "fp32")
    chameleon = layer_norm.layer_norm_op.plan(x, weight, bias, 1e-5, "cast_then_affine")
    fp32_x_bf16_weight = layer_norm.layer_norm_op.plan(x.float(), weight.bfloat16(), None, 1e-5, "fp32")
    many_rows = layer_norm.layer_norm_op.plan(torch.randn(300, 64, dtype=torch.bfloat16), weight, bias, 1e-5, "fp32")
    for plan in (per_head, chameleon, fp32_x_bf16_weight, many_rows):
        assert isinstance(plan.run, compiled_reference.CompiledReference), plan.describe()
    # fp32 rows: ATen's kernel at every size (faster than Inductor's there)
    many_fp32_rows = layer_norm.layer_norm_op.plan(torch.randn(300, 64), weight, bias, 1e-5, "fp32")
    assert many_fp32_rows.run.__qualname__.endswith("native.<locals>.norm"), many_fp32_rows.describe()


def test_layer_norms_without_avx512_run_atens_kernel_but_in_place_from_32_mib(monkeypatch):
    """Where ATen's kernels are not AVX-512 ones (AVX2, Arm), F.layer_norm is faster at every size
    but the in-place form's largest (a fresh 32 MiB output faults in every call)."""
    monkeypatch.setattr(layer_norm, "_avx512", lambda: False)
    ops.reset()
    weight, bias = torch.randn(64), torch.randn(64)

    def runs_native(op: object, rows: int, dtype: torch.dtype) -> bool:
        x = torch.randn(rows, 64, dtype=dtype)
        args = (x, weight, bias) if op is layer_norm.layer_norm_op else (x, torch.randn_like(x), weight, bias)
        return getattr(op.plan(*args, 1e-5, "fp32").run, "__qualname__", "").startswith("_native.<locals>")

    for dtype in (torch.bfloat16, torch.float32):
        assert runs_native(layer_norm.layer_norm_op, 4096, dtype)
        assert runs_native(layer_norm.fused_add_layer_norm_op, 4096, dtype)
    inplace = layer_norm.fused_add_layer_norm_inplace_op
    assert runs_native(inplace, 2048, torch.bfloat16) and not runs_native(inplace, 2049, torch.bfloat16)
    assert runs_native(inplace, 1024, torch.float32) and not runs_native(inplace, 1025, torch.float32)


ROTARY_CASES = [
    *(c for c in rotary_tests.CASES if c.config is None),
    rotary_tests.rotary_case(2, 3, 3, 1, 20, torch.bfloat16, layout="fused_qkv"),  # not dense: laid out anew
    rotary_tests.rotary_case(2, 5, 4, 2, 64, torch.float32, layout="contiguous", shared_table=False),
]


@pytest.mark.parametrize("case", ROTARY_CASES, ids=repr)
def test_rotary_embedding(case):
    check_provider(rotary.rotary_embedding_op, "reference", _without_config(case), "cpu")


@pytest.mark.parametrize("case", ROTARY_CASES, ids=repr)
def test_rotary_embedding_is_bit_identical_to_the_reference(case):
    """HF's roundings and layouts, infinities included; NaN where HF has NaN (a NaN's sign bit is the
    hardware's: HF negates x, this path the table)."""
    q, k, cos, sin = case.make()
    if q.numel():
        q[..., ::5] = float("nan")
        k[..., 0] = float("inf")
        k[..., -1] = float("-inf")
    with ops.trace_dispatch() as ran:
        got = ops.rotary_embedding(q, k, cos, sin)
    assert ran[0].provider == "reference"
    for mine, spec in zip(got, rotary.rotary_embedding_reference(q, k, cos, sin)):
        assert mine.stride() == spec.stride()
        _assert_same_bits(mine, spec)


@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["whole-head", "partial"])
def test_rotary_on_hf_transposed_views_runs_a_lean_graph_of_the_untransposed_tensors(rotary_dim, monkeypatch):
    """HF's q / k (``[B, T, H, D]`` transposed to ``[B, H, T, D]``) take the tokens-major lean graph:
    no ``torch.compile``, the spec's bits and strides."""

    def no_dynamo(*args):
        raise AssertionError("HF's transposed views went through torch.compile")

    monkeypatch.setattr(compiled_reference.CompiledReference, "_compiled", no_dynamo)
    q, k, cos, sin = rotary_tests.rotary_case(2, 7, 4, 2, 64, torch.bfloat16, rotary_dim=rotary_dim).make()
    assert not q.is_contiguous() and q.transpose(1, 2).is_contiguous()
    run = rotary.rotary_embedding_op.plan(q, k, cos, sin).run
    for _ in range(2):  # the first call binds, the second runs the bound form
        got = ops.rotary_embedding(q, k, cos, sin)
        for mine, spec in zip(got, rotary.rotary_embedding_reference(q, k, cos, sin)):
            assert mine.stride() == spec.stride()
            _assert_same_bits(mine, spec)
    assert run.compiled[(True, rotary_dim == 64)].has_compiled  # tokens-major


#: a decode step in each dtype, padding, per-row tables, partial rotary, a merged projection's views,
#: heads that do not merge (q / k laid out anew), no tokens
FUSED_ROTARY_CASES = [fused_rotary_tests.CASES[i] for i in (0, 1, 2, 3, 5, 6, 8, 11, 12)]


@pytest.mark.parametrize("case", FUSED_ROTARY_CASES, ids=repr)
def test_rotary_write_kv_cache(case):
    check_provider(fused_rotary.rotary_write_kv_cache_op, "reference", _without_config(case), "cpu")


@pytest.mark.parametrize("case", FUSED_ROTARY_CASES, ids=repr)
def test_rotary_write_kv_cache_is_bit_identical_to_the_reference(case):
    """Bound to the call's signature (the second call) too: rotary_embedding's run without its dispatch."""
    args = case.make()
    with ops.trace_dispatch() as ran:
        for _ in range(2):
            want_args = tuple(a.clone() for a in args)
            got = ops.rotary_write_kv_cache(*args)
            want = fused_rotary.rotary_write_kv_cache_reference(*want_args)
            for mine, spec in (*zip(got, want), (args[5], want_args[5]), (args[6], want_args[6])):
                assert _significant_strides(mine) == _significant_strides(spec)
                _assert_same_bits(mine, spec)
    assert [p.provider for p in ran] == ["reference", "reference"]


def _significant_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that place elements (PyTorch's own comparisons ignore those of size-1 dims)."""
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size > 1)


GATED_CASES = [c for c in gated_tests.CASES if c.config is None]


@pytest.mark.parametrize("case", GATED_CASES, ids=repr)
@pytest.mark.parametrize("spoiled", [False, True], ids=["finite", "nan-and-inf-rows"])
def test_gated_rms_norm_native_form_is_bit_identical_to_the_reference(case, spoiled, monkeypatch):
    """Every order, grouping, numerics, activation, dtype mix and layout; NaN and infinities too (in
    the first rows only: a group with one NaN normalises to NaN)."""
    x, gate, weight, eps, order, group_size, numerics, activation = case.make()
    if spoiled and x.numel():
        _spoil_row(x, 0, slice(None, None, 5), float("nan"))
        _spoil_row(x, 1, slice(1, None, 7), float("inf"))
        if gate is not None:
            _spoil_row(gate, 2, slice(2, None, 9), float("-inf"))
    key = gated.gated_rms_norm_key(x, gate, weight, eps, order, group_size, numerics, activation)
    monkeypatch.setenv(registry.COMPILE_ENV, "native")
    native = gated._native(key)  # the form itself, whatever the call's size
    got = native(x, gate, weight, eps, order, group_size, numerics, activation)
    want = gated.gated_rms_norm_reference(x, gate, weight, eps, order, group_size, numerics, activation)
    _assert_same_bits(got, want)
    if x.numel() and x.numel() // x.shape[-1] > 3:  # rows past the spoiled ones are compared as numbers
        assert not want.isnan().all()


#: Grouped calls past compiled_reference.SINGLE_THREAD_ELEMENTS, which the lean graph takes with each
#: group a row (gated_rms_norm._GroupsAsRows): both orders and numerics, no gate, fp16, a padded layout
#: (torch.compile of the views) and leading dims.
THREADED_GROUPED_CASES = [
    gated_tests.gated_case((40,), 1000, torch.bfloat16, order="gate_then_norm", groups=8),
    gated_tests.gated_case((2, 20), 1000, torch.float32, groups=4, numerics="fp32_scale"),
    gated_tests.gated_case((40,), 1000, torch.float16, gate=None, order="gate_then_norm", groups=8),
    gated_tests.gated_case((40,), 1000, torch.bfloat16, layout="padded", groups=8, activation="sigmoid"),
]


@pytest.mark.parametrize("case", THREADED_GROUPED_CASES, ids=repr)
def test_large_grouped_gated_norms_run_with_groups_as_rows(case):
    ops.reset(compiled_references=True)  # this test's graphs only
    x, gate, weight, eps, order, group_size, numerics, activation = case.make()
    plan = gated.gated_rms_norm_op.plan(x, gate, weight, eps, order, group_size, numerics, activation)
    graphs = dict(plan.run.compiled.lean)
    check_provider(gated.gated_rms_norm_op, "reference", _without_config(case), "cpu")
    new = [signature for signature in plan.run.compiled.lean if signature not in graphs]
    if case.make()[0].is_contiguous():  # the lean graph of rows one dimension deeper, none for the row itself
        assert new and all(signature[1][0] == (x.dtype, x.dim() + 1) for signature in new), new


@pytest.mark.parametrize("mode", ["1", "native"])
def test_gated_rms_norm_runs_its_native_form_in_native_mode_only(mode, monkeypatch):
    """Compiled, the lean reference at every size (one fused pass beats the native form's calls at
    decode sizes too); in ``native`` mode the native form at every size."""
    monkeypatch.setenv(registry.COMPILE_ENV, mode)
    ops.reset()
    small = gated_tests.gated_case((16,), 128, torch.bfloat16).make()
    large = gated_tests.gated_case((64,), 4096, torch.bfloat16).make()
    with ops.trace_dispatch() as ran:
        ops.gated_rms_norm(*small[:4])
        ops.gated_rms_norm(*large[:4])
    names = [getattr(plan.run, "__name__", None) for plan in ran]
    assert names == (["native", "native"] if mode == "native" else [None, None]), names
    ops.reset()


ACTIVATION_CASES = activation_tests.CASES


@pytest.mark.parametrize("activation,case", ACTIVATION_CASES, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_activations(activation, case):
    check_provider(activation_tests.OPS[activation], "reference", _without_config(case), "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _spoil_row(t: torch.Tensor, row: int, columns: slice, value: float) -> None:
    """Write ``value`` at ``columns`` of row ``row`` of ``t`` (rows: its leading dims flattened), in
    place whatever its layout. A norm reads whole rows, so spoiling every row would leave nothing
    but NaN to compare; rows past those spoiled stay finite."""
    lead = t.shape[:-1]
    rows = torch.arange(max(1, t.numel() // max(t.shape[-1], 1))).view(lead) == row
    chosen = torch.zeros(t.shape[-1], dtype=torch.bool)
    chosen[columns] = True
    t.masked_fill_(rows[..., None] & chosen, value)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got.masked_fill(nan, 0)), _bits(want.masked_fill(nan, 0)))


#: Rows past compiled_reference.SINGLE_THREAD_ELEMENTS, where the fused compile runs on the intra-op
#: threads: each thread's share and a vector tail, in both 16-bit dtypes and both swiglu layouts.
THREADED_ACTIVATION_CASES = [
    (activation, activation_tests.act_case(activation, lead, inter, dtype, interleaved=interleaved))
    for activation in ("silu", "swiglu_oai")
    for lead, inter, dtype, interleaved in (((37,), 1001, torch.bfloat16, True), ((3, 11), 2880, torch.float16, True),
                                            ((29,), 1536, torch.bfloat16, False))
    if interleaved or activation == "swiglu_oai"
]


@pytest.mark.parametrize("activation,case", ACTIVATION_CASES + THREADED_ACTIVATION_CASES,
                         ids=lambda v: v if isinstance(v, str) else repr(v))
def test_activations_are_bit_identical_to_the_reference(activation, case):
    """The eager chain and what the reference provider runs (16-bit rows: the fused compile)."""
    op = activation_tests.OPS[activation]
    args = case.make()
    if args[0].numel():
        _spoil_row(args[0], 0, slice(None, None, 7), float("nan"))
        _spoil_row(args[0], 0, slice(3, None, 7), float("inf"))
        _spoil_row(args[0], 0, slice(5, None, 7), float("-inf"))
    want = op.reference(*args)
    provided = activations._ReferenceActivation(op.name, op.reference)
    for got in (activations._LEAN[op.name](*args), provided(*args)):
        _assert_same_bits(got, want)


@pytest.mark.parametrize("name,options", [("silu_and_mul", ()), ("swiglu_oai", (1.702, 7.0, True))])
def test_a_repeated_activation_call_runs_the_faster_of_its_bit_identical_forms(name, options):
    """Bound to its call signature, a 16-bit activation times its fused compiled pass (swiglu_oai:
    with the halves copied apart) against the eager chain on its first calls and keeps the faster;
    every call, timed or not, gives the reference's bits."""
    from hw_agnostic.ops.faster_form import TIMED_CALLS, FasterForm

    op = ops.get_op(name)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = op.reference(x, *options)
    for _ in range(2 * (TIMED_CALLS + 1) + 2):
        _assert_same_bits(op(x, *options), want)
    [(_, run)] = op._checked.values()
    assert isinstance(run, FasterForm) and run.chosen in run.forms


#: fp32 swiglu_oai: (leading dims, I, interleaved, what runs it). Interleaved rows are fused as they
#: lie up to _GATHER_MAX_ROWS rows and from _GATHER_MIN_BYTES of input (730 x 5760 fp32), copied apart
#: between; the chain runs an output whose element count leaves a vector tail (37, 3 x 100).
FP32_SWIGLU_CASES = [
    ((1,), 2880, True, "fused"), ((2,), 1024, True, "fused"), ((3,), 64, True, "apart"), ((2, 9), 2880, True, "apart"),
    ((730,), 2880, True, "fused"), ((5,), 1024, False, "fused"), ((1,), 37, True, "chain"), ((3,), 100, False, "chain"),
]


@pytest.mark.parametrize("lead,inter,interleaved,path", FP32_SWIGLU_CASES, ids=repr)
def test_fp32_swiglu_oai_is_bit_identical_on_each_path(lead, inter, interleaved, path):
    """Each of fp32 swiglu_oai's paths (fused as the rows lie, halves copied apart first, the chain)
    gives the reference's bits, called unbound and bound to the call's signature as dispatch binds it."""
    op = activation_tests.OPS["swiglu_oai"]
    args = activation_tests.act_case("swiglu_oai", lead, inter, torch.float32, interleaved=interleaved).make()
    _spoil_row(args[0], 0, slice(None, None, 7), float("nan"))
    _spoil_row(args[0], 0, slice(3, None, 7), float("inf"))
    _spoil_row(args[0], 0, slice(5, None, 7), float("-inf"))
    provided = activations._ReferenceActivation(op.name, op.reference)
    compiled = provided._compiled(args[0], args[1:])
    taken = "chain" if compiled is None else "apart" if provided._copies_halves_apart(args[0], args[1:]) else "fused"
    assert taken == path
    assert compiled in (None, provided.fused_fp32)
    want = op.reference(*args)
    for got in (provided(*args), provided.bind(args)(*args)):
        _assert_same_bits(got, want)
        assert got.stride() == want.stride()
    if compiled is not None:  # the lean graph ran, not torch.compile or the eager reference
        assert any(graph is not None for graph in compiled.lean.values()) and not compiled._dynamo


@pytest.mark.parametrize("case", attention_tests.ATTENTION_CASES, ids=repr)
def test_paged_attention(case):
    check_provider(importlib.import_module("hw_agnostic.ops.paged_attention").paged_attention_op, "reference",
                   _without_config(case), "cpu")


def _decode_batch(lengths: list[int], dtype: torch.dtype) -> tuple:
    from hw_agnostic.ops.paged_attention import example_paged_batch

    q, k_cache, v_cache, table, cu, lens = example_paged_batch(
        [1] * len(lengths), lengths, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype,
        device="cpu")
    return q, k_cache, v_cache, table, cu, lens, 32 ** -0.5, None, None, None, 1, max(lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", [[13], [9, 9, 9], [9, 5, 9]], ids=["one", "even", "uneven"])
def test_a_decode_batch_attends_as_the_grouped_path_does(lengths, dtype, monkeypatch):
    """Decode queries with as many keys each, one per row in order, run as one batch with no row
    gathered or scattered: the grouped path's bits (which other batches keep running)."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    provided = attention._ReferenceAttention(attention.paged_attention_reference)
    args = _decode_batch(lengths, dtype)
    row_bytes = args[1].shape[2] * args[1].shape[3] * args[1].element_size()
    grouped = provided._attend_sequences(*args[:5], [(s, s + 1, n) for s, n in enumerate(lengths)], args[6], None,
                                         row_bytes)
    ran = []
    original = attention._ReferenceAttention._attend_sequences
    monkeypatch.setattr(attention._ReferenceAttention, "_attend_sequences",
                        lambda self, *a: ran.append(1) or original(self, *a))
    got = provided(*args)
    assert ran == ([] if len(set(lengths)) == 1 else [1])
    _assert_same_bits(got, grouped)
    assert got.is_contiguous()
    want = _float64_spec(args)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("caches", ["own", "halves"])
def test_decodes_of_different_lengths_attend_in_few_calls(caches, window, dtype, monkeypatch):
    """Decode queries over different numbers of keys (continuous batching) run as one masked SDPA
    call per batch of lengths within 2x of each other (one call per length where K and V are the
    halves of one buffer, whose blocks and slots do not view as one dim), reading only keys their
    sequences wrote: NaN in the rest of the pages and table entries past a sequence's blocks that
    name no block change nothing. The spec's result, and the reference never runs."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    lengths, block_size = [9, 5, 7, 10, 30], 4  # 5, 7, 9, 10 in one call; 30 (more than twice 5) in another
    q, k_cache, v_cache, table, cu, lens = attention.example_paged_batch(
        [1] * len(lengths), lengths, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype,
        device="cpu")
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for seq, count in enumerate(lengths):
        for position in range(count):
            written[table[seq, position // block_size], position % block_size] = True
        table[seq, -(-count // block_size):] = -1 if seq % 2 else 10 ** 6
    for cache in (k_cache, v_cache):
        cache[~written] = float("nan")
    if caches == "halves":
        buffer = torch.stack([k_cache, v_cache], dim=1)  # [blocks, 2, block_size, heads, dim]
        k_cache, v_cache = buffer[:, 0], buffer[:, 1]
    args = (q, k_cache, v_cache, table, cu, lens, 32 ** -0.5, window, None, None, 1, max(lengths))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    got = attention._ReferenceAttention(lambda *a: pytest.fail("the reference ran"))(*args)
    assert len(calls) == (2 if caches == "own" else len(set(lengths)))
    assert_close(got, _float64_spec(args), dtype)


def _regular_batch(q_lens: list[int], kv_lens: list[int], stride: int, dtype: torch.dtype, *,
                   heads: tuple[int, int] = (8, 2), dim: int = 32, block_size: int = 4, spare_columns: int = 0,
                   seed: int | None = None) -> tuple:
    """A batch whose sequence ``s`` reads blocks ``1 + s * stride + arange(n)`` (a paged cache's layout);
    ``spare_columns`` widen the table with columns no sequence reads."""
    g = torch.Generator().manual_seed(len(q_lens) if seed is None else seed)
    (num_q_heads, kv_heads), width = heads, -(-max(kv_lens) // block_size) + spare_columns
    k_cache, v_cache = (torch.randn(1 + len(kv_lens) * max(stride, width), block_size, kv_heads, dim,
                                    generator=g).to(dtype) for _ in range(2))
    table = (1 + torch.arange(len(kv_lens))[:, None] * stride + torch.arange(width)).int()
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, dim, generator=g).to(dtype)
    return (q, k_cache, v_cache, table, cu, torch.tensor(kv_lens, dtype=torch.int32), dim ** -0.5, None, None, None,
            max(q_lens), max(kv_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_lens, kv_lens, stride", [([1], [13], 0), ([1, 1, 1], [9, 9, 9], 5),
                                                     ([1, 1], [9, 14], 4), ([6, 1], [6, 11], 3), ([5], [5], 0)],
                         ids=["decode", "decode-batch", "uneven", "prompt-and-decode", "prompt"])
def test_pages_in_a_regular_layout_are_read_in_place(q_lens, kv_lens, stride, dtype, monkeypatch):
    """Blocks laid out as a paged cache lays them (each sequence's in order) are read through a view
    of the cache, no gathered copy: the gathered copy's bits."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    args = _regular_batch(q_lens, kv_lens, stride, dtype)
    assert attention._regular_blocks(args[3][:, :1]) is not None
    got = attention._EAGER_ATTENTION(*args)
    monkeypatch.setattr(attention, "_regular_blocks", lambda blocks, listed=None: None)
    _assert_same_bits(got, attention._EAGER_ATTENTION(*args))
    want = _float64_spec(args)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("listed", ["read", "given", "tensor-ops"])
@pytest.mark.parametrize("table, regular", [([[3, 4, 5]], (3, 0)), ([[3, 5, 6]], None), ([[0, 1], [4, 5]], (0, 4)),
                                            ([[4, 5], [0, 1]], None), ([[2, 3], [2, 3]], (2, 0)), ([[7]], (7, 0)),
                                            ([[0, 1], [3, 4], [7, 8]], None)],
                         ids=["one-row", "gap", "rows", "backwards", "shared", "one-block", "uneven-rows"])
def test_regular_block_layouts(table, regular, listed, monkeypatch):
    """Small tables are read as one list (or take the list the metadata checks read), larger ones by
    tensor ops: the same verdicts."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    if listed == "tensor-ops":
        monkeypatch.setattr(attention, "LISTED_BLOCKS", 0)
    blocks = torch.tensor(table, dtype=torch.int32)
    assert attention._regular_blocks(blocks, table if listed == "given" else None) == regular


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa-heads", "query-rows"])
@pytest.mark.parametrize("q_lens, kv_lens, stride", [([1], [13], 0), ([1, 1, 1], [9, 9, 9], 5), ([1, 1], [9, 14], 4)],
                         ids=["decode", "decode-batch", "uneven"])
def test_small_fp32_decode_runs_gqa_heads_or_query_rows_alike(q_lens, kv_lens, stride, gqa, monkeypatch):
    """Small fp32 decode calls pass the query heads to SDPA as GQA heads, larger ones as their KV
    head's query rows: either form computes the spec (within fp32's tolerance)."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    monkeypatch.setattr(attention, "MAX_GQA_DECODE_WORK", 1 << 30 if gqa else 0)
    args = _regular_batch(q_lens, kv_lens, stride, torch.float32)
    assert_close(attention._EAGER_ATTENTION(*args), _float64_spec(args), torch.float32)


def _fuzzed_batch(draw_lengths: list[tuple[int, int]], decode: bool, heads: tuple[int, int], head_dim: int,
                  block_size: int, dtype: torch.dtype, layout: str, seed: int) -> tuple:
    """``(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens)`` with the blocks ``layout`` says:
    scattered at random, each sequence's in order (a paged cache's layout), or one shared run."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    q_lens = [1 if decode else q for q, _ in draw_lengths]
    kv_lens = [max(q, kv) for q, (_, kv) in zip(q_lens, draw_lengths)]
    if layout == "shared":  # every sequence reads the same blocks: one length for all
        kv_lens = [max(kv_lens)] * len(kv_lens)
    if layout == "scattered":
        return attention.example_paged_batch(q_lens, kv_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                                             head_dim=head_dim, block_size=block_size, dtype=dtype, device="cpu",
                                             generator=torch.Generator().manual_seed(seed))
    width = -(-max(kv_lens) // block_size) + 1  # with a spare column no sequence reads
    stride = 0 if layout == "shared" else width + 1
    return _regular_batch(q_lens, kv_lens, stride, dtype, heads=heads, dim=head_dim, block_size=block_size,
                          spare_columns=1, seed=seed)[:6]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=4),
    decode=st.booleans(),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 2), (4, 1)]),
    head_dim=st.sampled_from([8, 32]),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    window=st.sampled_from([None, 1, 5]),
    softcap=st.sampled_from([None, 5.0]),
    sinks=st.booleans(),
    layout=st.sampled_from(["scattered", "regular", "shared"]),
    unowned=st.integers(0, 2),
    hints=st.booleans(),
)
def test_fuzz_the_cpu_attention_against_the_spec(lengths, decode, heads, head_dim, block_size, dtype, window,
                                                 softcap, sinks, layout, unowned, hints):
    """The CPU path's attention (its decode-batch, in-place-view and grouped forms, whichever a batch
    takes) against the float64 spec on random batches, block layouts and options; rows no sequence
    owns come out as the spec's zeros."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    seed = zlib.crc32(repr((lengths, decode, heads, head_dim, block_size, layout)).encode())
    q, k_cache, v_cache, table, cu, kv_lens = _fuzzed_batch(lengths, decode, heads, head_dim, block_size, dtype,
                                                            layout, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.cat([q, torch.randn(unowned, *q.shape[1:], generator=g).to(dtype)])
    q_lens, kv = (cu[1:] - cu[:-1]).tolist(), kv_lens.tolist()
    args = (q, k_cache, v_cache, table, cu, kv_lens, head_dim ** -0.5, window, softcap,
            torch.randn(heads[0], generator=g) if sinks else None, max(q_lens) if hints else None,
            max(kv) if hints else None)
    got = attention._EAGER_ATTENTION(*args)
    assert got.shape == q.shape and got.dtype == dtype
    want = _float64_spec(args)
    assert_close(got, want, dtype)


def _float64_spec(args: tuple) -> torch.Tensor:
    """The attention spec of ``args`` computed in float64."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    return attention.paged_attention_reference(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                                  else a for a in args])


def _scattered(q_lens: list[int], kv_lens: list[int], dtype: torch.dtype, seed: int = 0) -> tuple:
    """A batch whose blocks are scattered (gathered on the CPU path), with its scalar arguments."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    while True:  # the first seed from ``seed`` whose random layout is not one a page view reads in place
        batch = attention.example_paged_batch(q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, head_dim=32,
                                              block_size=4, dtype=dtype, device="cpu",
                                              generator=torch.Generator().manual_seed(seed))
        if attention._regular_blocks(batch[3]) is None:
            return (*batch, 32 ** -0.5, None, None, None, None, None)
        seed += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scattered_blocks_are_gathered_into_the_threads_buffers(dtype, monkeypatch):
    """Scattered blocks are copied into the thread's gather buffers (one for keys, one for values),
    kept between calls; no result aliases them, so later calls leave it as it was; a gather past
    the limit takes fresh memory and leaves the buffers alone."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    small, large = _scattered([1, 1], [9, 20], dtype), _scattered([1, 1, 5], [30, 30, 40], dtype, seed=1)
    first = attention._EAGER_ATTENTION(*small)
    kept = first.clone()
    buffers = attention._gather_buffers.buffers
    assert {(slot, dtype) for slot, dtype, _ in buffers} >= {(0, dtype), (1, dtype)}
    got = attention._EAGER_ATTENTION(*large)  # grows them
    assert_close(got, _float64_spec(large), dtype)
    places = {key: buffer.data_ptr() for key, buffer in buffers.items()}
    again = attention._EAGER_ATTENTION(*small)
    assert {key: buffer.data_ptr() for key, buffer in buffers.items()} == places  # reused, not made again
    _assert_same_bits(first, kept)
    _assert_same_bits(again, first)
    assert_close(again, _float64_spec(small), dtype)
    monkeypatch.setattr(attention._ReferenceAttention, "MAX_GATHER_BYTES", 64)
    before = {key: buffer.clone() for key, buffer in buffers.items()}
    _assert_same_bits(attention._EAGER_ATTENTION(*small), first)
    for key, buffer in buffers.items():
        _assert_same_bits(buffer, before[key])


def test_threads_gather_into_their_own_buffers():
    """Threads attending at once gather into buffers of their own: each gets its batch's result."""
    import threading

    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    batches = [_scattered([1, 1, 1], [17, 17, 17], torch.float32, seed=s) for s in range(2)]
    alone = [attention._EAGER_ATTENTION(*batch) for batch in batches]
    wrong: list[int] = []

    def attend(index: int) -> None:
        for _ in range(200):
            if not torch.equal(attention._EAGER_ATTENTION(*batches[index]), alone[index]):
                wrong.append(index)

    threads = [threading.Thread(target=attend, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []



def test_what_a_call_under_inference_mode_keeps_serves_later_calls_outside_it():
    """The CPU path keeps tensors between calls (the thread's gather buffers); made inside
    ``torch.inference_mode`` they are still normal tensors: a later call outside that mode writes
    the buffers (an inference tensor does not allow it: a rewire after an inference-mode call saw its
    attention raise and left it undone)."""
    import threading

    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    batch = _scattered([1, 1], [9, 20], torch.float32)
    results: list = []

    def attend() -> None:  # a thread of its own: gather buffers made in this test, under inference_mode
        with torch.inference_mode():
            attention._EAGER_ATTENTION(*batch)
        assert all(not buffer.is_inference() for buffer in attention._gather_buffers.buffers.values())
        with torch.no_grad():
            results.append(attention._EAGER_ATTENTION(*batch))

    thread = threading.Thread(target=attend)
    thread.start()
    thread.join()
    assert len(results) == 1
    assert_close(results[0], _float64_spec(batch), torch.float32)

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_cpu_attentions_finiteness_check(dtype):
    """A NaN or an infinity anywhere is seen; finite values whose sum overflows a 16-bit dtype are
    finite (fp16: the sum is redone in fp32)."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    values = torch.full((4, 256), 1000.0, dtype=dtype)
    assert attention._finite(values)
    for position in (0, 517, 1023):
        for poison in (float("nan"), float("inf"), -float("inf")):
            poisoned = values.clone()
            poisoned.view(-1)[position] = poison
            assert not attention._finite(poisoned)
    both = values.clone()
    both.view(-1)[:2] = torch.tensor([float("inf"), -float("inf")])
    assert not attention._finite(both)


def test_large_finite_fp16_queries_take_sdpa():
    """fp16 queries whose fp16 sum overflows are finite: SDPA runs, not the reference."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    args = _scattered([1, 1], [9, 9], torch.float16)
    q = torch.full_like(args[0], 300.0)
    assert not torch.isfinite(q.sum())
    ran = []
    provided = attention._ReferenceAttention(lambda *a: ran.append(1) or attention.paged_attention_reference(*a))
    got = provided(q, *args[1:])
    assert ran == []
    assert_close(got, _float64_spec((q, *args[1:])), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len, kv_len, window", [(7, 7, None), (5, 13, None), (9, 9, 4)],
                         ids=["prompt", "chunk", "window"])
def test_a_prompt_owning_every_row(q_len, kv_len, window, dtype):
    """One prompt owning every query row: its attention is the result, contiguous, as the spec computes it."""
    attention = importlib.import_module("hw_agnostic.ops.paged_attention")
    args = list(_scattered([q_len], [kv_len], dtype))
    args[7] = window
    got = attention._EAGER_ATTENTION(*args)
    assert got.is_contiguous() and got.shape == args[0].shape
    assert_close(got, _float64_spec(tuple(args)), dtype)


def _write_case(tokens: int, *, slots: list[int] | None = None, dtype: torch.dtype = torch.float32,
                slot_dtype: torch.dtype = torch.int64, one_buffer: bool = False) -> tuple:
    g = torch.Generator().manual_seed(tokens)
    key, value = (torch.randn(tokens, 2, 8, generator=g).to(dtype) for _ in range(2))
    if tokens:
        key[0, 0, 0], value[-1, 1, 3] = float("nan"), float("-inf")
    if one_buffer:  # K and V as the two halves of one [blocks, 2, block_size, ...] buffer
        buffer = torch.full((4, 2, 4, 2, 8), 7.0, dtype=dtype)
        k_cache, v_cache = buffer[:, 0], buffer[:, 1]
    else:
        k_cache, v_cache = (torch.full((4, 4, 2, 8), 7.0, dtype=dtype) for _ in range(2))
    chosen = slots if slots is not None else torch.randperm(16, generator=g)[:tokens].tolist()
    return key, value, k_cache, v_cache, torch.tensor(chosen, dtype=slot_dtype)


WRITES = {
    "decode-token": (lambda: _write_case(1), "copies"),
    "tokens": (lambda: _write_case(5, slot_dtype=torch.int32), "copies"),
    "bf16-tokens": (lambda: _write_case(6, dtype=torch.bfloat16), "copies"),
    "padding": (lambda: _write_case(3, slots=[4, -1, 9]), "spec"),
    "one-buffer": (lambda: _write_case(3, one_buffer=True), "spec"),
    "no-tokens": (lambda: _write_case(0, slots=[]), "spec"),
}


def _cloned(args: tuple) -> tuple:
    key, value, k_cache, v_cache, slots = args
    if k_cache._base is not None and k_cache._base is v_cache._base:
        buffer = k_cache._base.clone()
        return key, value, buffer[:, 0], buffer[:, 1], slots
    return key, value, k_cache.clone(), v_cache.clone(), slots


@pytest.mark.parametrize("name", WRITES)
def test_the_cpu_write_lands_the_specs_bytes(name):
    """Where no slot is padding and the caches lie apart, the reference provider writes with one
    copy per cache; the caches end up with the spec's bytes, NaN and infinities included."""
    write = importlib.import_module("hw_agnostic.ops.write_kv_cache")
    make, path = WRITES[name]
    got = make()
    want = _cloned(got)
    write.write_kv_cache_reference(*want)
    ran = []
    write._ReferenceWrite(lambda *a: ran.append(1) or write.write_kv_cache_reference(*a))(*got)
    assert ran == ([] if path == "copies" else [1])
    _assert_same_bits(got[2], want[2])
    _assert_same_bits(got[3], want[3])


@pytest.mark.parametrize("listed", ["read", "given", "tensor-ops"])
@pytest.mark.parametrize("slots, message", [([3, 20], "past the cache's 16 slots"),
                                            ([3, 5, 3], "writes one slot twice")], ids=["past-the-cache", "twice"])
def test_the_cpu_write_raises_as_the_spec_does(slots, message, listed, monkeypatch):
    """Its checks read a few slots as one list, more by tensor ops: the spec's error either way."""
    write = importlib.import_module("hw_agnostic.ops.write_kv_cache")
    if not listed:
        monkeypatch.setattr(write, "LISTED_SLOTS", 0)
    provided = write._ReferenceWrite(write.write_kv_cache_reference)
    args = _write_case(len(slots), slots=slots)
    caches = [a.clone() for a in args[2:4]]
    with pytest.raises(ValueError, match=message):
        provided(*args)
    assert all(torch.equal(a, b) for a, b in zip(args[2:4], caches))  # nothing written


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(slots=st.lists(st.integers(-2, 17), max_size=8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       slot_dtype=st.sampled_from([torch.int32, torch.int64]),
       one_buffer=st.booleans())
def test_fuzz_the_cpu_write_against_the_spec(slots, dtype, slot_dtype, one_buffer):
    """Random slot mappings (padding, repeats, slots past the 16-slot cache), K/V in one buffer or
    two: the CPU write lands the spec's bytes, or raises the spec's error and writes nothing."""
    write = importlib.import_module("hw_agnostic.ops.write_kv_cache")
    args = _write_case(len(slots), slots=slots, dtype=dtype, slot_dtype=slot_dtype, one_buffer=one_buffer)
    want, before = _cloned(args), _cloned(args)
    try:
        write.write_kv_cache_reference(*want)
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            write._EAGER_WRITE(*args)
        want = before
    else:
        write._EAGER_WRITE(*args)
    _assert_same_bits(args[2], want[2])
    _assert_same_bits(args[3], want[3])


# --------------------------------------------------------------------------------------------
# the dispatch shortcut


def test_a_repeated_call_skips_check_and_key(monkeypatch):
    op = ops.get_op("silu_and_mul")
    calls = []
    original = op.check
    monkeypatch.setattr(op, "check", lambda *a: calls.append(1) or original(*a))
    x = torch.randn(3, 16)
    for _ in range(3):
        ops.silu_and_mul(x)
    ops.silu_and_mul(torch.randn(3, 16))  # same metadata, other data: still no check
    assert len(calls) == 1
    ops.silu_and_mul(torch.randn(3, 16, dtype=torch.bfloat16))
    ops.silu_and_mul(torch.randn(3, 32)[:, :16])  # another stride
    assert len(calls) == 3
    with pytest.raises(ValueError, match="must be even"):
        ops.silu_and_mul(torch.randn(3, 15))  # a bad call is checked, and never remembered


def test_the_shortcut_still_sees_overlapping_inplace_buffers():
    weight = torch.ones(8)
    x, residual = torch.randn(4, 8), torch.randn(4, 8)
    ops.fused_add_rms_norm(x, residual, weight, inplace=True)
    buffer = torch.randn(8, 8)
    with pytest.raises(ValueError, match="share memory"):
        ops.fused_add_rms_norm(buffer[0:4], buffer[2:6], weight, inplace=True)


def test_scalars_of_another_type_are_another_signature():
    x = torch.randn(2, 8)
    ops.rms_norm(x, None, 1e-6)
    with pytest.raises(TypeError, match="eps must be a float"):
        ops.rms_norm(x, None, True)


def _moe_cases():
    from tests.ops import test_fused_experts, test_grouped_gemm, test_moe_align, test_moe_route, test_write_kv_cache

    op = importlib.import_module
    return ([(op("hw_agnostic.ops.moe_route").moe_route_op, c) for c in test_moe_route.ROUTE_CASES]
            + [(op("hw_agnostic.ops.moe_align").moe_align_op, c) for c in test_moe_align.ALIGN_CASES]
            + [(op("hw_agnostic.ops.grouped_gemm").grouped_gemm_op, c) for c in test_grouped_gemm.GEMM_CASES]
            + [(op("hw_agnostic.ops.fused_experts").fused_experts_op, c) for c in test_fused_experts.FUSED_CASES]
            + [(op("hw_agnostic.ops.write_kv_cache").write_kv_cache_op, c) for c in test_write_kv_cache.WRITE_CASES])


@pytest.mark.slow
@pytest.mark.parametrize("op,case", _moe_cases(), ids=lambda v: v.name if hasattr(v, "name") else repr(v))
def test_moe_and_cache_ops(op, case, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="hw_agnostic.ops"):
        check_provider(op, "reference", _without_config(case), "cpu")
    assert not [r for r in caplog.records if "running it eagerly" in r.getMessage()]


def _grouped_mm_calls(monkeypatch) -> list[int]:
    """Counts the calls of ``torch._grouped_mm`` (the CPU experts' products; its probe made before)."""
    experts = importlib.import_module("hw_agnostic.ops.fused_experts")
    for dtype in experts.GROUPED_MM_DTYPES:
        experts._cpu_grouped_mm(dtype)
    calls: list[int] = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [
    dict(tokens=9, experts=5, top_k=2), dict(tokens=1, experts=8, top_k=2), dict(tokens=6, experts=5, top_k=1,
    pattern="one_expert"), dict(tokens=8, experts=13, top_k=2, pattern="two_experts"), dict(tokens=9, experts=5,
    top_k=2, pattern="sentinels"), dict(tokens=3, experts=5, top_k=5), dict(tokens=0, experts=5, top_k=2),
    dict(tokens=9, experts=5, top_k=2, weights_dtype=torch.float32), dict(tokens=9, experts=5, top_k=2,
    activation="gelu_tanh"), dict(tokens=9, experts=5, top_k=2, gpt_oss=True)], ids=repr)
def test_the_cpu_experts_group_their_products(case, dtype, monkeypatch):
    """The CPU path's experts (products as ``torch._grouped_mm`` over the pairs sorted by expert, where
    its stride rules allow) give the reference's bits: layouts, idle experts, sentinels, no tokens,
    fp32 router weights, biases."""
    from tests.ops.test_fused_experts import fused_case

    experts = importlib.import_module("hw_agnostic.ops.fused_experts")
    case = dict(case)  # the parameter is shared by the dtypes' runs
    args = fused_case(case.pop("tokens"), case.pop("experts"), case.pop("top_k"), 16, 24, dtype, **case).make()
    calls = _grouped_mm_calls(monkeypatch)
    got = experts._grouped_experts(*args)
    assert len(calls) == 2
    _assert_same_bits(got, experts.fused_experts_reference(*args))


@pytest.mark.parametrize("hidden, inter, layout", [(13, 24, "contiguous"), (16, 13, "contiguous"),
                                                   (16, 24, "padded")], ids=["hidden", "inter", "padded-rows"])
def test_the_cpu_experts_run_the_reference_where_grouped_mm_would_refuse(hidden, inter, layout, monkeypatch):
    """Rows or weights whose strides ``torch._grouped_mm`` refuses (not a multiple of 16 bytes) run
    the reference loop."""
    from tests.ops.test_fused_experts import fused_case

    experts = importlib.import_module("hw_agnostic.ops.fused_experts")
    args = list(fused_case(9, 5, 2, hidden, inter, torch.float32, layout=layout).make())
    if layout == "padded":  # weights whose rows are 17 floats apart
        args[1] = torch.randn(5, 2 * inter, hidden + 1)[:, :, :hidden]
    calls = _grouped_mm_calls(monkeypatch)
    got = experts._grouped_experts(*args)
    assert calls == []
    _assert_same_bits(got, experts.fused_experts_reference(*args))


def test_the_cpu_experts_loop_where_grouped_mm_does_not_run(monkeypatch):
    """A torch whose ``_grouped_mm`` has no CPU kernel for the dtype (the probe says so) runs the reference loop."""
    from tests.ops.test_fused_experts import fused_case

    experts = importlib.import_module("hw_agnostic.ops.fused_experts")

    def refuse(*args, **kwargs):
        raise NotImplementedError("no CPU kernel")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    experts._cpu_grouped_mm.cache_clear()
    try:
        args = fused_case(9, 5, 2, 16, 24, torch.bfloat16).make()
        _assert_same_bits(experts._grouped_experts(*args), experts.fused_experts_reference(*args))
        assert not experts._cpu_grouped_mm(torch.bfloat16)
    finally:
        experts._cpu_grouped_mm.cache_clear()


def _routing_cases(g: torch.Generator):
    """Routing calls of every scoring and dtype, with ties (bf16 logits, equal rows and groups), NaN and
    infinite logits and biases, scores that underflow to 0, with and without renormalisation and scaling."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for tokens, experts, top_k, n_group, topk_group in ((1, 32, 8, 8, 4), (16, 32, 8, 8, 4), (9, 12, 3, 4, 2),
                                                            (5, 8, 3, 4, 2), (7, 10, 4, 1, 1), (0, 16, 2, 4, 2),
                                                            (37, 60, 4, 1, 1)):
            logits = (3 * torch.randn(tokens, experts, generator=g)).to(dtype)
            if tokens >= 5:
                logits[1] = 0.0  # every score tied
                logits[2, 0] = float("nan")
                logits[3, ::3] = float("inf")
                logits[4, : experts // 2] = -float("inf")
            for scoring in route_module.SCORINGS:
                groups = (n_group, topk_group) if scoring == "sigmoid" else (1, 1)
                for bias in (None, 0.05 * torch.randn(experts, generator=g),
                             torch.where(torch.arange(experts) % 5 == 0, float("inf"), 0.0),
                             torch.full((experts,), float("nan"))):
                    for renormalize, factor in ((True, 2.5), (False, 1.0)):
                        yield (logits, bias, top_k, scoring, renormalize, *groups, factor)


def test_the_keyed_choice_is_the_reference_bit_for_bit():
    """Eagerly, the choice with keyed top-k computes the reference's results bit for bit (what the
    compiled path traces)."""
    g = torch.Generator().manual_seed(4)
    for args in _routing_cases(g):
        scores = route_module._scores(args[0], args[3])
        (w1, i1), (w2, i2) = route_module._choose_keyed(scores, *args[1:]), route_module.moe_route_reference(*args)
        assert w1.dtype == w2.dtype and torch.equal(i1, i2), args
        assert torch.equal(w1.nan_to_num(nan=-7.0), w2.nan_to_num(nan=-7.0)), args


def test_keyed_top_k_orders_as_the_stable_sort():
    """Ties (bf16 logits, equal rows), zeros of both signs, infinities, subnormals, scores that
    underflow to 0 (-inf and far-off logits), NaN rows made +inf, many rows: torch.topk of the keys
    picks what the stable descending sort picks, in its order."""
    g = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(300, 128, generator=g)).bfloat16().float()
    logits[1] = 0.0  # all tied
    logits[2, :100] = -float("inf")  # 100 zeros
    logits[3] = torch.where(torch.arange(128) < 3, 200.0, -200.0)  # 3 ones, 125 zeros that underflow
    logits[4, 7] = float("nan")  # a NaN row
    logits[5, ::2] = float("inf")  # inf - inf: NaN
    logits[6] = 1e-3 * torch.arange(128)  # neighbouring fp32 scores
    scores = route_module._nan_as_inf(torch.softmax(logits, dim=-1))
    assert (scores[3] == 0).sum() == 125 and scores[4].isinf().all()
    signed = (2 * torch.randn(300, 128, generator=g)).bfloat16().float()
    signed[0] = torch.tensor([0.0, -0.0] * 64)  # zeros of both signs tie
    signed[1, ::2], signed[1, 1::2] = -float("inf"), float("inf")
    signed[2] = torch.tensor([1e-45, -1e-45, 1e-40, -1e-40] * 32)  # subnormals
    signed[3] = torch.linspace(-3.0, 3.0, 128)
    for values in (scores, signed):
        for k in (1, 8, 127, 128):
            assert torch.equal(route_module._top_keyed(values, k), route_module._top(values, k)), k
    for experts in (1, 2, 3, 257):
        few = torch.randn(9, experts, generator=g).bfloat16().float()
        assert torch.equal(route_module._top_keyed(few, experts), route_module._top(few, experts))


@pytest.mark.parametrize("args", [
    (torch.bfloat16, 128, 8, "softmax", None, True, 1, 1, 1.0),  # Qwen3-MoE
    (torch.float32, 32, 8, "sigmoid", "bias", True, 8, 4, 2.5),  # DeepSeek-V3
], ids=lambda args: f"{args[3]}-{args[0]}")
def test_the_compiled_choice_picks_the_reference_experts(args):
    """The reference provider's compiled path, on calls with ties, NaN and infinite logits and
    biases, several row counts of one compiled graph: the reference's experts, and its weights up to
    the order of one sum. (Each graph compiles for seconds: the other scorings' compiled graphs are
    checked on the op's cases by test_moe_and_cache_ops, fp64's sort eagerly above.)"""
    dtype, experts, top_k, scoring, bias, renormalize, n_group, topk_group, factor = args
    route = route_module._KeyedRoute("moe_route", route_module.moe_route_reference)
    g = torch.Generator().manual_seed(6)
    for tokens in (1, 16, 200):  # one graph: up to SINGLE_THREAD_ELEMENTS
        logits = (3 * torch.randn(tokens, experts, generator=g)).to(dtype)
        logits[0, :3] = logits[0, 3]  # tied
        if tokens > 4:
            logits[1] = 0.0
            logits[2, 0] = float("nan")
            logits[3, ::3] = float("inf")
            logits[4, : experts // 2] = -float("inf")
        correction = None if bias is None else torch.where(torch.arange(experts) % 7 == 0, float("inf"),
                                                           0.05 * torch.randn(experts, generator=g))
        call = (logits, correction, top_k, scoring, renormalize, n_group, topk_group, factor)
        expected_weights, expected_ids = route_module.moe_route_reference(*call)
        bound = route.bind(call)
        assert bound is not None, "the call takes the compiled graph"
        for weights, ids in (route(*call), bound(*call)):
            assert torch.equal(ids, expected_ids)
            assert_close(weights, expected_weights, torch.float32)
    assert route.choose.has_compiled


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_a_rewired_model_on_the_cpu_path_matches_hf(family):
    """What a user gets by default: the rewired model's logits and greedy tokens, compiled norms,
    lean activations and batched attention included (qwen3 norms strided q/k heads, gemma2 has a
    window and a softcap)."""
    import copy

    from hw_agnostic import rewire
    from tests.backend.models import build, prompt

    model = build(family)
    reference = copy.deepcopy(model)
    rewire(model)
    ids = prompt()
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = model(ids).logits
    want = reference(ids).logits
    assert (got - want).norm() / want.norm() <= 1e-5
    assert {"rms_norm", "paged_attention"} <= {p.op for p in ran}
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, expected)
