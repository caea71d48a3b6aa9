"""Layers: forward vs forward_native, the registry, and an out-of-tree plugin in a rewired model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hw_agnostic import rewire
from hw_agnostic.layers import (
    CustomOp,
    GatedMLP,
    GeluAndMul,
    LayerRegistryError,
    PluggableLayer,
    QKVProjection,
    RMSNorm,
    SiluAndMul,
    SwigluOai,
    registered_layers,
    resolve,
    unregister_oot,
)
from tests.backend.models import build, prompt


@pytest.mark.parametrize("numerics", ["llama", "fp32_scale", "gemma"])
def test_rms_norm_layer_matches_its_native_forward(numerics):
    norm = RMSNorm(32, 1e-5, numerics)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    for got, want in zip(norm(x, residual), norm.forward_native(x, residual)):
        torch.testing.assert_close(got, want)


def test_rms_norm_layer_shares_a_given_weight_and_checks_it():
    weight = nn.Parameter(torch.randn(16))
    assert RMSNorm(16, weight=weight).weight is weight
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\)"):
        RMSNorm(16, weight=nn.Parameter(torch.randn(8)))
    with pytest.raises(ValueError, match="numerics must be one of"):
        RMSNorm(16, numerics="olmo")
    assert torch.equal(RMSNorm(4, numerics="gemma").weight, torch.zeros(4))
    assert RMSNorm(4, has_weight=False).weight is None


@pytest.mark.parametrize("layer", [SiluAndMul(), GeluAndMul("tanh"), GeluAndMul(), SwigluOai()], ids=repr)
def test_activation_layers_match_their_native_forward(layer):
    x = torch.randn(2, 3, 16) * 3
    torch.testing.assert_close(layer(x), layer.forward_native(x))


def test_gated_mlp_computes_down_act_gate_times_up():
    mlp = GatedMLP(16, 24, "gelu_tanh", bias=True)
    x = torch.randn(2, 16)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    want = mlp.down_proj(torch.nn.functional.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(mlp(x), want)
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        GatedMLP(16, 24, "relu")


def test_qkv_projection_runs_one_matmul_per_input():
    qkv = QKVProjection(8, (8, 4, 4), bias=True)
    q, k, v = qkv.parts()
    x = torch.randn(3, 8)
    calls = []
    qkv.proj.register_forward_hook(lambda *a: calls.append(1))
    outputs = [q(x), k(x), v(x)]
    assert len(calls) == 1
    for part, out in zip((q, k, v), outputs):
        torch.testing.assert_close(out, torch.nn.functional.linear(x, part.weight, part.bias))
    k(torch.randn(3, 8))  # another input: computed afresh
    assert len(calls) == 2
    assert qkv._pending is not None and sum(1 for _ in q.parameters()) == 0


# --------------------------------------------------------------------------------------------
# registry


def test_builtin_layers_are_registered():
    layers = registered_layers()
    assert layers["rms_norm"] == (RMSNorm, None) and layers["gated_mlp"] == (GatedMLP, None)
    assert resolve("rms_norm") is RMSNorm and resolve(GatedMLP) is GatedMLP


def test_duplicate_and_mismatched_registrations_fail_loudly():
    with pytest.raises(LayerRegistryError, match="already registered as 'rms_norm'"):
        CustomOp.register("rms_norm")(type("Other", (CustomOp,), {}))
    with pytest.raises(LayerRegistryError, match="must subclass CustomOp"):
        CustomOp.register("not_a_custom_op")(type("Plain", (nn.Module,), {}))
    with pytest.raises(LayerRegistryError, match="must be a subclass of RMSNorm"):
        RMSNorm.register_oot(type("Stranger", (CustomOp,), {}))
    with pytest.raises(LayerRegistryError, match="must be a subclass of GatedMLP"):
        PluggableLayer.register_oot(type("Wrong", (RMSNorm,), {}), name="gated_mlp")
    with pytest.raises(LayerRegistryError, match="no layer is registered as 'group_norm'"):
        RMSNorm.register_oot(type("X", (RMSNorm,), {}), name="group_norm")
    with pytest.raises(LayerRegistryError, match="no layer is registered as 'nope'"):
        resolve("nope")


# --------------------------------------------------------------------------------------------
# an out-of-tree plugin


class PluginNorm(RMSNorm):
    """An accelerator's norm: its own forward, the constructor of the in-tree layer."""

    calls = 0

    def forward(self, x, residual=None):
        PluginNorm.calls += 1
        return self.forward_native(x, residual)


class PluginMLP(GatedMLP):
    calls = 0

    def forward(self, x):
        PluginMLP.calls += 1
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


@pytest.fixture
def plugin():
    RMSNorm.register_oot(PluginNorm)
    GatedMLP.register_oot(PluginMLP)
    PluginNorm.calls = PluginMLP.calls = 0
    yield
    unregister_oot("rms_norm")
    unregister_oot("gated_mlp")


def test_a_second_replacement_fails_loudly(plugin):
    with pytest.raises(LayerRegistryError, match="already replaced by PluginNorm"):
        RMSNorm.register_oot(type("Another", (RMSNorm,), {}))


def test_constructing_a_layer_builds_the_plugin(plugin):
    norm = RMSNorm(8, 1e-6)
    assert type(norm) is PluginNorm and norm.eps == 1e-6  # __init__ ran
    assert resolve("rms_norm") is PluginNorm


def test_a_rewired_model_runs_the_plugin(plugin):
    model = build("llama")
    reference = build("llama")
    report = rewire(model)
    assert report.count("PluginNorm") == 5 and report.count("PluginMLP") == 2
    PluginNorm.calls = PluginMLP.calls = 0  # rewire ran them to verify them
    ids = prompt()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert PluginNorm.calls > 0 and PluginMLP.calls == 2
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_fp32_router_inputs_follow_every_change_of_the_weight():
    """DeepSeek-V3-style routers multiply fp32 copies of 16-bit weights; the copy kept between calls
    is made again after an in-place update or a ``.data`` swap, and training differentiates the
    weight itself."""
    from hw_agnostic.layers.moe import RoutingSpec, router_logits

    spec = RoutingSpec(2, "sigmoid", logits="fp32_inputs")
    weight = nn.Parameter(torch.randn(8, 16).bfloat16())
    hidden = torch.randn(3, 16).bfloat16()

    def expected():
        return hidden.float() @ weight.detach().float().T

    with torch.no_grad():
        for change in (lambda: None, lambda: weight.mul_(2), lambda: setattr(weight, "data", torch.randn(8, 16).bfloat16())):
            change()
            for _ in range(2):  # the second call reads the kept copy
                torch.testing.assert_close(router_logits(spec, hidden, weight), expected(), rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(router_logits(spec, hidden, weight), expected(), rtol=0, atol=0)
    router_logits(spec, hidden, weight).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    from hw_agnostic.layers import moe

    key = id(weight)
    assert key in moe._fp32_copies
    del weight
    assert key not in moe._fp32_copies  # the copy leaves with its parameter


def test_an_fp32_router_copy_made_under_inference_mode_serves_autograd():
    """A frozen 16-bit router weight's fp32 copy, first made inside ``torch.inference_mode``, is kept
    as a normal tensor: a later call that autograd records (a trained input, LoRA-style) saves it."""
    from hw_agnostic.layers.moe import RoutingSpec, router_logits

    spec = RoutingSpec(2, "sigmoid", logits="fp32_inputs")
    weight = nn.Parameter(torch.randn(8, 16).bfloat16(), requires_grad=False)
    hidden = torch.randn(3, 16).bfloat16().requires_grad_()
    with torch.inference_mode():
        router_logits(spec, hidden.detach(), weight)
    router_logits(spec, hidden, weight).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def _hooked(kind: str, module: torch.nn.Module, seen: list[str]) -> object:
    """Give ``module`` what ``kind`` names and return its handle (or an undo); ``seen`` records its use."""
    record = lambda *a, **k: seen.append(kind)  # noqa: E731
    if kind == "forward hook":
        return module.register_forward_hook(record)
    if kind == "forward pre-hook":
        return module.register_forward_pre_hook(record)
    if kind == "backward hook":
        return module.register_full_backward_hook(record)
    if kind == "global forward hook":
        return torch.nn.modules.module.register_module_forward_hook(record)
    if kind == "global forward pre-hook":
        return torch.nn.modules.module.register_module_forward_pre_hook(record)
    if kind == "compiled":
        module._compiled_call_impl = lambda *a, **k: seen.append(kind) or module._call_impl(*a, **k)
        return None
    if kind == "own __call__":
        class OwnCall(torch.nn.Linear):
            def __call__(self, *args: object, **kwargs: object) -> object:
                seen.append(kind)
                return super().__call__(*args, **kwargs)

        module.__class__ = OwnCall
        return None
    raise AssertionError(kind)


class _Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hw_agnostic.layers.module_call import call

        return call(self.inner, x)


@pytest.mark.parametrize("kind", [None, "forward hook", "forward pre-hook", "backward hook", "global forward hook",
                                  "global forward pre-hook", "compiled", "own __call__", "jit trace",
                                  "fx trace"])
def test_calling_a_child_skips_module_call_only_where_it_would_only_call_forward(kind, monkeypatch):
    """``module_call.call`` runs ``forward`` directly for a module with nothing on it, and through
    ``nn.Module.__call__`` (its hooks, its compiled call) otherwise: the same result either way."""
    from hw_agnostic.layers.module_call import call

    through_call: list[int] = []
    original = torch.nn.Module._call_impl
    monkeypatch.setattr(torch.nn.Module, "_call_impl",
                        lambda self, *a, **k: through_call.append(1) or original(self, *a, **k))
    module = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=kind == "backward hook")
    want = torch.nn.functional.linear(x, module.weight, module.bias)
    seen: list[str] = []
    handle = None if kind in (None, "jit trace", "fx trace") else _hooked(kind, module, seen)
    try:
        if kind == "jit trace":
            torch.jit.trace(_Outer(module), (x,), check_trace=False)
            seen.append(kind)
        if kind == "fx trace":  # the child stays a call_module node of the traced graph
            graph = torch.fx.symbolic_trace(_Outer(module)).graph
            assert [node.target for node in graph.nodes if node.op == "call_module"] == ["inner"]
            seen.append(kind)
            through_call.append(1)  # the tracer's own wrapper of Module.__call__ took the call, not _call_impl
        got = call(module, x)
        if kind == "backward hook":
            got.sum().backward()
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(got, want)
    # traced: the outer module's call and its child's went through it; the call after the trace did not
    assert through_call == ([] if kind is None else [1, 1] if kind == "jit trace" else [1])
    assert seen == ([] if kind is None else [kind])


class _Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


@pytest.mark.parametrize("layer", ["linear", "rms_norm", "layer_norm"])
def test_layers_read_their_weight_as_the_attribute_gives_it(layer):
    """The layers read their parameters from ``_parameters`` (past ``nn.Module.__getattr__``) only
    where that is what the attribute gives: a parametrized weight (a property on a generated
    class) and a subclass's property are what their forwards use."""
    import torch.nn.utils.parametrize as parametrize

    from hw_agnostic.layers import LayerNorm, Linear

    torch.manual_seed(0)
    make = {"linear": lambda: Linear(8, 4, bias=True), "rms_norm": lambda: RMSNorm(8, eps=1e-6),
            "layer_norm": lambda: LayerNorm(8, eps=1e-5)}[layer]
    x = torch.randn(3, 8)
    module = make()
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        plain = module(x)
        parametrize.register_parametrization(module, "weight", _Doubled())
        doubled = module(x)
        reference = make()
        reference.load_state_dict({"weight": 2 * module.parametrizations.weight.original,
                                   **({"bias": module.bias} if layer != "rms_norm" else {})})
        torch.testing.assert_close(doubled, reference(x), rtol=0, atol=0)
        assert not torch.equal(doubled, plain)

        class Halved(type(reference)):  # a subclass whose weight is a property over the parameter
            @property
            def weight(self) -> torch.Tensor:
                return self._parameters["weight"] / 2

        halved = make()
        halved.load_state_dict(reference.state_dict())
        halved.__class__ = Halved
        want = make()
        want.load_state_dict({**reference.state_dict(), "weight": reference.weight / 2})
        torch.testing.assert_close(halved(x), want(x), rtol=0, atol=0)


def test_gated_mlp_reads_a_replaced_child():
    """A child put in place of the MLP's down projection (``_modules``, as an assignment puts it) is
    the one its forward calls, and so is a subclass's property."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 16, "silu")
    x = torch.randn(2, 8)
    with torch.no_grad():
        replacement = torch.nn.Linear(16, 8, bias=False)
        mlp.down_proj = replacement
        torch.testing.assert_close(mlp(x), replacement(mlp.act_fn(mlp.gate_up_proj(x))), rtol=0, atol=0)

        class Zeroed(GatedMLP):
            @property
            def down_proj(self) -> torch.nn.Module:
                return _ZeroOut()

        mlp.__class__ = Zeroed
        assert not mlp(x).any()


class _ZeroOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape[:-1], 8)
