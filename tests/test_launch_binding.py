"""Kernel launches bound to a call signature (``hw_agnostic.kernels.launch_binding``).

Every op whose DSL run binds is called three times with one signature: the first call records
its launches, the others replay them. A replay must launch what Helion's host code launches for
that call (``CHECK_REPLAYS`` compares every one), with that call's tensors: under an interpreter
or on a GPU its results equal the unbound run's on the same inputs, bit for bit; in
compile-for-target mode every launch is still counted.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.kernels import launch_binding, targets
from hw_agnostic.kernels.interpret import interpreter_mode
from hw_agnostic.kernels.launch_binding import BoundLaunch, HostLaunch

#: The ops whose Helion run binds its launches to a call signature.
BINDING = ["rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "layer_norm", "fused_add_layer_norm",
           "fused_add_layer_norm_", "gated_rms_norm", "silu_and_mul", "gelu_and_mul", "swiglu_oai",
           "rotary_embedding", "write_kv_cache", "rotary_write_kv_cache", "paged_attention", "moe_route", "moe_align",
           "grouped_gemm", "fused_experts"]


@pytest.fixture
def checked_replays(monkeypatch):
    monkeypatch.setattr(launch_binding, "CHECK_REPLAYS", True)


@pytest.fixture
def bound(monkeypatch):
    """Every BoundLaunch made in the test."""
    made: list[BoundLaunch] = []
    original = HostLaunch.bound
    monkeypatch.setattr(HostLaunch, "bound", lambda self: made.append(original(self)) or made[-1])
    return made


def _other_data(args: tuple, seed: int) -> tuple:
    """``args`` with new values in their contiguous floating-point tensors (the same metadata, so
    one signature); the others copied."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(a.shape, generator=g).to(a.dtype).to(a.device)
                 if isinstance(a, torch.Tensor) and a.is_floating_point() and a.is_contiguous()
                 else a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _produced(op, result, args: tuple) -> list[torch.Tensor]:
    """What a call produced: its results and the arguments it writes."""
    out = list(result) if isinstance(result, (tuple, list)) else [] if result is None else [result]
    names = list(inspect.signature(op.reference).parameters)
    return out + [args[names.index(name)] for name in op.mutates_args]


@pytest.mark.dsl
@pytest.mark.parametrize("name", BINDING)
def test_replayed_launches_compute_what_the_host_code_does(name, device, checked_replays, bound):
    _replays_compute_the_unbound_runs_bits(name, device, bound)


#: The ops whose bound run hands its replays its own tensors for the views its host code takes.
REPLAYING_WITHOUT_VIEWS = ["rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "silu_and_mul", "gelu_and_mul",
                           "swiglu_oai", "write_kv_cache", "rotary_write_kv_cache", "paged_attention"]


@pytest.mark.dsl
@pytest.mark.parametrize("name", REPLAYING_WITHOUT_VIEWS)
def test_replays_without_the_views_compute_the_unbound_runs_bits(name, device, bound, monkeypatch):
    """Unchecked, these runs replay through ``BoundLaunch.replays`` with their own tensors standing
    for the views (the checked test above takes the views): the same bits as the unbound run."""
    taken = []
    original = BoundLaunch.replays
    monkeypatch.setattr(BoundLaunch, "replays", lambda self, *args: taken.append(original(self, *args)) or taken[-1])
    _replays_compute_the_unbound_runs_bits(name, device, bound)
    # HELION_INTERPRET has no host code to bind; elsewhere both replays went without the views
    assert taken.count(True) >= 2 or (not bound and interpreter_mode() == "helion"), taken


def _replays_compute_the_unbound_runs_bits(name: str, device: str, bound: list[BoundLaunch]) -> None:
    op = ops.get_op(name)
    example = op.example_inputs(4, 64, torch.float32, device)
    with ops.use_provider("helion", op):
        op(*_copies(example))  # binds and records
        plan = op.plan(*example)
        for seed in (1, 2):
            args = _other_data(example, seed)
            direct = _copies(args)
            replayed = _produced(op, op(*args), args)  # replays (checked against the host code's launches
            # where the test sets CHECK_REPLAYS)
            unbound = _produced(op, plan.run(*direct), direct)
            assert len(replayed) == len(unbound)
            for got, want in zip(replayed, unbound):
                assert got.shape == want.shape and torch.equal(got.nan_to_num(0), want.nan_to_num(0))
    # HELION_INTERPRET runs the kernel body as PyTorch: no host code, nothing to bind
    assert (bound and all(b.replay is not None for b in bound)) or (not bound and interpreter_mode() == "helion")


def test_replays_are_counted_as_launches_in_compile_for_target_mode(checked_replays, bound):
    """The decode-host bench's mode: launches counted, nothing run; replays count as the host code's do."""
    pytest.importorskip("helion")
    for name in BINDING:
        op = ops.get_op(name)
        example = op.example_inputs(4, 64, torch.float32, "cpu")
        bound.clear()
        with targets.compile_for(["sm_90"], run_reference=False, compile=False) as log:
            for seed in range(3):
                op(*_other_data(example, seed))
        counted = sum(log.launches.values())
        assert counted and counted % 3 == 0, (name, dict(log.launches))
        assert bound and all(b.replay is not None for b in bound), name


# --------------------------------------------------------------------------------------------
# the binding itself, on a stand-in for Helion's host code


class _Host:
    """Launches once: the grid from x's rows (or from a value of x), x's row stride as an integer."""

    def __init__(self, make_inside: bool = False, grid_from_values: bool = False) -> None:
        self.calls, self.make_inside, self.grid_from_values = 0, make_inside, grid_from_values

    def __call__(self, x, out, scale, *, _launcher):
        self.calls += 1
        grid = (int(x[0, 0]) if self.grid_from_values else x.shape[0],)
        _launcher("kernel", grid, x, torch.empty(1) if self.make_inside else out, x.stride(0), scale, num_warps=4)


def _bound(host: _Host, launched: list) -> BoundLaunch:
    return HostLaunch(host, lambda kernel, grid, *args, **options: launched.append((kernel, grid, args, options))).bound()


def test_a_replay_launches_the_calls_tensors_with_the_recorded_integers():
    host, launched = _Host(), []
    launch = _bound(host, launched)
    for _ in range(3):
        x, out = torch.randn(4, 8), torch.empty(4, 8)
        launch(x, out, 0.5)
        kernel, grid, (x_got, out_got, stride, scale), options = launched[-1]
        assert x_got is x and out_got is out
        assert (kernel, grid, stride, scale, options) == ("kernel", (4,), 8, 0.5, {"num_warps": 4})
    assert host.calls == 1


def test_arguments_passed_twice_must_be_one_tensor_again():
    host, launched = _Host(), []
    launch = _bound(host, launched)
    x = torch.randn(4, 8)
    launch(x, x, 1.0)  # in place: recorded with x as its own output
    launch(x, x, 1.0)
    assert host.calls == 1
    y, out = torch.randn(4, 8), torch.empty(4, 8)
    launch(y, out, 1.0)  # the replay would write y: the host code runs, from now on
    assert host.calls == 2 and launched[-1][2][:2] == (y, out)
    launch(x, x, 1.0)
    assert host.calls == 3


def test_replays_take_other_views_of_the_recorded_memory_and_refuse_before_recording(checked_replays, monkeypatch):
    host, launched = _Host(), []
    launch = _bound(host, launched)
    x, out = torch.randn(2, 4, 8), torch.empty(2, 4, 8)
    assert not launch.replays(x, out, 0.5) and not launched  # nothing recorded yet
    launch(x.view(-1, 8), out.view(-1, 8), 0.5)
    assert not launch.replays(x, out, 0.5) and len(launched) == 1  # the checks take the host code's views
    monkeypatch.setattr(launch_binding, "CHECK_REPLAYS", False)
    y, out = torch.randn(2, 4, 8), torch.empty(2, 4, 8)
    assert launch.replays(y, out, 0.5)
    assert launched[-1][1:3] == ((8,), (y, out, 8, 0.5)) and host.calls == 1  # the recorded grid and stride


def test_a_tensor_made_by_the_host_code_is_never_replayed():
    host, launched = _Host(make_inside=True), []
    launch = _bound(host, launched)
    for _ in range(3):
        launch(torch.randn(4, 8), torch.empty(4, 8), 0.5)
    assert host.calls == 3 and len(launched) == 3


def test_checked_replays_catch_a_host_code_that_reads_values(checked_replays):
    """The contract a run that binds keeps: nothing it hands the host code launches differently
    for other values. A replay whose recorded grid came from a value fails the check."""
    host, launched = _Host(grid_from_values=True), []
    launch = _bound(host, launched)
    launch(torch.full((4, 8), 2.0), torch.empty(4, 8), 0.5)
    launch(torch.full((4, 8), 2.0), torch.empty(4, 8), 0.5)  # the same values: the same launch
    with pytest.raises(AssertionError, match="bound launch"):
        launch(torch.full((4, 8), 3.0), torch.empty(4, 8), 0.5)


def test_bindings_of_one_launch_shape_compile_their_replay_once():
    """A decode step's paged attention rebinds at every context length (a new ``max_kv_len``, the same
    launches): the replay's code is compiled once, and each binding still launches its own integers."""
    host, launched = _Host(), []
    launch_binding._compiled.cache_clear()
    for rows in (4, 5, 6):
        launch = _bound(host, launched)
        for _ in range(2):
            x, out = torch.randn(rows, 8), torch.empty(rows, 8)
            launch(x, out, float(rows))
            assert launched[-1][1:3] == ((rows,), (x, out, 8, float(rows)))
    assert host.calls == 3
    info = launch_binding._compiled.cache_info()
    assert (info.misses, info.hits) == (1, 2)
