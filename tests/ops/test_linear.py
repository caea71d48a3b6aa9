"""``ops.linear`` and ``layers.Linear``: ``F.linear``'s values bit for bit, blocked where the rule says."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from hw_agnostic.layers import GatedMLP, Linear, QKVProjection
from hw_agnostic.ops import linear
from hw_agnostic.ops.linear import BLOCK_COLUMNS, MAX_ROWS, MAX_THREADS, blocked_columns

MKL = torch.backends.mkl.is_available()
linear_module = importlib.import_module("hw_agnostic.ops.linear")  # ops.linear is the function
CACHE_BOUND = linear_module.min_blocked_weight_bytes  # before the fixture below replaces it


@pytest.fixture(autouse=True)
def _blocks_for_every_weight(monkeypatch):
    """The tests' weights are small: let the blocks take them whatever this machine's cache."""
    monkeypatch.setattr(linear_module, "min_blocked_weight_bytes", lambda rows: 0)


def _case(rows: int, columns: int, width: int, bias: bool, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    weight = torch.randn(columns, width, generator=g) / width**0.5
    return x, weight, torch.randn(columns, generator=g) if bias else None


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
# 2 * BLOCK_COLUMNS + 5: a last block of five columns alone is another MKL kernel (it differed)
@pytest.mark.parametrize("columns", [2 * BLOCK_COLUMNS - 1, 2 * BLOCK_COLUMNS, 2 * BLOCK_COLUMNS + 5,
                                     3 * BLOCK_COLUMNS + 17])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 64, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("threads", range(1, MAX_THREADS + 1))
def test_equals_f_linear_bit_for_bit(rows: int, columns: int, bias: bool, threads: int) -> None:
    x, weight, b = _case(rows, columns, 192, bias)
    unaligned = torch.empty(x.numel() + 1)[1:].view_as(x).copy_(x)  # a view 4 bytes past its allocation
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert blocked_columns(x, weight, b) == (MKL and 2 <= rows <= MAX_ROWS)
            assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))
            assert torch.equal(linear(unaligned, weight, b), F.linear(unaligned, weight, b))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_batched_input_keeps_its_shape_and_values(bias: bool) -> None:
    x, weight, b = _case(24, 2 * BLOCK_COLUMNS + 5, 96, bias)
    x = x.view(3, 8, 96)
    with torch.inference_mode():
        out = linear(x, weight, b)
        assert out.shape == (3, 8, weight.shape[0]) and out.is_contiguous()
        assert torch.equal(out, F.linear(x, weight, b))


@pytest.mark.skipif(not MKL, reason="the blocked schedule is for MKL's SGEMM")
def test_the_rule_blocks_few_fp32_rows_and_leaves_the_rest_to_f_linear() -> None:
    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 64, True)
    with torch.no_grad():
        assert blocked_columns(x, weight, b) and blocked_columns(x.view(2, 4, 64), weight, None)
        assert not blocked_columns(x[:1], weight, b)  # one row: MKL's GEMV
        assert not blocked_columns(torch.randn(MAX_ROWS + 1, 64), weight, b)
        assert not blocked_columns(x.bfloat16(), weight.bfloat16(), None)
        assert not blocked_columns(x.t().contiguous().t(), weight, b)  # a column-major input
        assert not blocked_columns(x, weight.t().contiguous().t(), b)
    assert not blocked_columns(x.requires_grad_(), weight, b)  # autograd records it: out= has no backward
    threads = torch.get_num_threads()
    torch.set_num_threads(MAX_THREADS + 1)  # MKL would split a block's sums unlike the whole product's
    try:
        with torch.no_grad():
            assert not blocked_columns(x, weight, b)
    finally:
        torch.set_num_threads(threads)


def test_gradients_flow_as_through_f_linear() -> None:
    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 32, True)
    leaves = [t.clone().requires_grad_() for t in (x, weight, b)]
    linear(*leaves).square().sum().backward()
    expected = [t.clone().requires_grad_() for t in (x, weight, b)]
    F.linear(*expected).square().sum().backward()
    for ours, theirs in zip(leaves, expected):
        assert torch.equal(ours.grad, theirs.grad)


def test_forward_ad_and_function_transforms_work_as_through_f_linear() -> None:
    """jvp, dual tensors and vmap have no rule for the blocks' out= calls: such calls take F.linear."""
    import torch.autograd.forward_ad as forward_ad

    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 32, True)
    tangent = torch.randn_like(x)
    ours = torch.func.jvp(lambda t: linear(t, weight, b), (x,), (tangent,))
    theirs = torch.func.jvp(lambda t: F.linear(t, weight, b), (x,), (tangent,))
    assert all(torch.equal(o, t) for o, t in zip(ours, theirs))
    with forward_ad.dual_level():
        dual = linear(forward_ad.make_dual(x, tangent), weight, b)
        assert torch.equal(forward_ad.unpack_dual(dual).tangent, theirs[1])
    batch = torch.randn(3, 8, 32)
    assert torch.equal(torch.func.vmap(lambda t: linear(t, weight, b))(batch), F.linear(batch, weight, b))
    grads = torch.func.grad(lambda w: linear(x, w, b).square().sum())(weight)
    assert torch.equal(grads, torch.func.grad(lambda w: F.linear(x, w, b).square().sum())(weight))


def test_autocast_and_dispatch_modes_see_f_linear() -> None:
    """Autocast recasts F.linear (not out= calls); a dispatch mode sees the model's own linear."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 32, True)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, theirs = linear(x, weight, b), F.linear(x, weight, b)
        assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
        with Seen() as seen:
            linear(x, weight, b)
        assert not any(".out" in op for op in seen.ops), seen.ops


def test_traces_as_f_linear() -> None:
    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 32, True)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(linear, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, weight, b), F.linear(x, weight, b))
        # the rule reads no row count while tracing, so no size guard: 3 and 2000 rows reuse the graph
        for rows in (3, 2000):
            more = torch.randn(rows, 32)
            torch.testing.assert_close(compiled(more, weight, b), F.linear(more, weight, b))
    assert counter.frame_count == 1
    with FakeTensorMode() as mode:
        fake = linear(mode.from_tensor(x), mode.from_tensor(weight), mode.from_tensor(b))
    assert fake.shape == (8, 2 * BLOCK_COLUMNS)


def test_mismatched_widths_raise_as_f_linear_does() -> None:
    x, weight, _ = _case(8, 2 * BLOCK_COLUMNS, 32, False)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear(x[:, :31], weight)


def test_linear_layer_is_an_nn_linear() -> None:
    layer = Linear(64, 2 * BLOCK_COLUMNS, bias=True)
    plain = nn.Linear(64, 2 * BLOCK_COLUMNS, bias=True)
    plain.load_state_dict(layer.state_dict())
    assert isinstance(layer, nn.Linear) and list(layer.state_dict()) == list(plain.state_dict())
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), plain(x)) and torch.equal(layer.forward_native(x), plain(x))


def test_merged_projections_run_it() -> None:
    mlp = GatedMLP(64, BLOCK_COLUMNS + 3)
    qkv = QKVProjection(64, (BLOCK_COLUMNS, 512, 512))
    assert type(mlp.gate_up_proj) is Linear and type(mlp.down_proj) is Linear and type(qkv.proj) is Linear
    x = torch.randn(8, 64)
    with torch.no_grad():
        expected = F.linear(mlp.act_fn(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
        assert torch.equal(mlp(x), expected)
        assert torch.equal(torch.cat(qkv(x), dim=-1), F.linear(x, qkv.proj.weight))


@pytest.mark.skipif(not MKL, reason="the blocked schedule is for MKL's SGEMM")
def test_weights_the_cache_holds_keep_the_one_call(monkeypatch) -> None:
    """Past a few rows the blocks pay only for a weight the CPU's largest cache cannot hold (see the
    module docstring)."""
    x, weight, b = _case(8, 2 * BLOCK_COLUMNS, 64, True)
    calls, asked = [], []
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(1) or torch.ops.aten.addmm.out(
        *a, out=k["out"]))
    with torch.no_grad():
        monkeypatch.setattr(linear_module, "min_blocked_weight_bytes", lambda rows: asked.append(rows) or weight.nbytes)
        assert torch.equal(linear(x, weight, b), F.linear(x, weight, b)) and not calls and asked == [8]
        monkeypatch.setattr(linear_module, "min_blocked_weight_bytes", lambda rows: weight.nbytes - 1)
        assert torch.equal(linear(x, weight, b), F.linear(x, weight, b)) and len(calls) == 2
    cache = linear_module.largest_cache_bytes(torch.device("cpu"))
    few, many = linear_module.FEW_ROWS, linear_module.FEW_ROWS + 1
    assert (CACHE_BOUND(few), CACHE_BOUND(many)) == (0, 2 * cache if cache else sys.maxsize)
