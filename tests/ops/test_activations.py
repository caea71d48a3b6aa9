"""silu_and_mul, gelu_and_mul, swiglu_oai: DSL vs reference, HF parity, bad inputs."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.activations import ACT2FN

from hw_agnostic import ops
from hw_agnostic.ops.activations import gelu_and_mul_op, silu_and_mul_op, swiglu_oai_op
from hw_agnostic.tolerances import assert_within_ulps
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples
from tests.ops.test_rms_norm import UNCOLLAPSED_ROWS, rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SMALL_CONFIG = {"block_sizes": [2, 16], "num_warps": 4, "num_stages": 1}
OPS = {"silu": silu_and_mul_op, "gelu": gelu_and_mul_op, "gelu_tanh": gelu_and_mul_op, "swiglu_oai": swiglu_oai_op}


def act_case(activation, lead, inter, dtype, *, layout="contiguous", config=None, interleaved=True, scale=3.0):
    name = (f"{activation}-{'x'.join(map(str, lead))}x{inter}-{str(dtype).removeprefix('torch.')}-{layout}"
            + ("" if interleaved else "-split") + ("-small" if config else "") + (f"-x{scale:g}" if scale != 3.0 else ""))

    def make():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        # Wide enough a range that swiglu_oai's clamps at +-7 are hit.
        x = rows(lead, 2 * inter, dtype, layout, g, scale)
        if activation == "silu":
            return (x,)
        if activation in ("gelu", "gelu_tanh"):
            return (x, "tanh" if activation == "gelu_tanh" else "none")
        return (x, 1.702, 7.0, interleaved)

    return Case(name, make, config, expected_decline=UNCOLLAPSED_ROWS if layout == "permuted" else None)


def _cases(activation: str) -> list[Case]:
    cases = []
    for dtype in DTYPES:
        cases.append(act_case(activation, (7,), 37, dtype))
        cases.append(act_case(activation, (5,), 45, dtype, config=SMALL_CONFIG))
    cases += [
        act_case(activation, (1,), 1, torch.float32),
        act_case(activation, (2, 3), 64, torch.bfloat16),
        act_case(activation, (0,), 64, torch.bfloat16),
        act_case(activation, (3,), 1000, torch.float16, layout="padded"),
        act_case(activation, (2,), 5000, torch.bfloat16),
        act_case(activation, (3, 2), 24, torch.float32, layout="permuted"),
    ]
    if activation == "swiglu_oai":
        cases.append(act_case(activation, (4,), 33, torch.bfloat16, interleaved=False))
    return cases


CASES = [(activation, case) for activation in OPS for case in _cases(activation)]


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(silu_and_mul_op))
@pytest.mark.parametrize("activation, case", CASES, ids=[c.id for _, c in CASES])
def test_gated_activation_dsl(activation, case, provider, device):
    check_provider(OPS[activation], provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(16, 60), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    activation=st.sampled_from(sorted(OPS)),
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    inter=st.integers(1, 200),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["contiguous", "padded", "inner_stride"]),
    interleaved=st.booleans(),
    scale=st.sampled_from([0.1, 3.0, 20.0]),
)
def test_fuzz_shapes_and_strides(activation, lead, inter, dtype, layout, interleaved, scale):
    from tests.conftest import kernel_device

    case = act_case(activation, lead, inter, dtype, layout=layout, interleaved=interleaved, scale=scale)
    for provider in dsl_providers(OPS[activation]):
        check_provider(OPS[activation], provider, case, kernel_device())


# --------------------------------------------------------------------------------------------
# parity with what the Hugging Face modules compute


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(silu_and_mul_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


def _hf_gpt_oss_gate(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GptOssExperts._apply_gate, called on a module-free stand-in."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    holder = type("Holder", (), {"alpha": alpha, "limit": limit})()
    return GptOssExperts._apply_gate(holder, gate_up)


_HF_ACT = {"silu": ACT2FN["silu"], "gelu": ACT2FN["gelu"], "gelu_tanh": ACT2FN["gelu_pytorch_tanh"]}


def _hf_rounding_exactly(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` rounded where HF rounds (``act(gate)``, then the product), each step exact
    (in float64, with GELU written without the cancellation of ``1 + erf`` / ``1 + tanh``)."""
    g = gate.double()
    if activation == "silu":
        act = torch.nn.functional.silu(g)
    elif activation == "gelu":
        act = 0.5 * g * torch.erfc(-g / 2**0.5)
    else:
        act = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))
    return (act.to(gate.dtype).double() * up.double()).to(gate.dtype)


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(OPS))
def test_matches_hf(activation, dtype, provider):
    """fp32: within 1e-6 norm-wise; fp16/bf16: within HF_PARITY of HF, nearly all bit-equal, so a
    kernel that does not round ``act(gate)`` to the input dtype before the multiply fails.

    HF's GELU computes ``1 + erf(g / sqrt 2)``, which cancels for very negative ``g``; the kernel
    does not. Those elements (where HF's result is not its exact value rounded as HF rounds) are
    left out of the comparison; everywhere else the kernel matches HF.
    """
    from tests.conftest import kernel_device

    device = "cpu" if provider == "reference" else kernel_device()
    g = torch.Generator().manual_seed(zlib.crc32(f"{activation}{dtype}".encode()))
    x = (torch.randn(4, 3, 2 * 160, generator=g) * 4).to(device=device, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    with ops.use_provider(provider), ops.trace_dispatch() as ran:
        if activation == "swiglu_oai":
            want, got = _hf_gpt_oss_gate(x, 1.702, 7.0), ops.swiglu_oai(x, 1.702, 7.0)
        else:
            want = _HF_ACT[activation](gate) * up
            got = ops.silu_and_mul(x) if activation == "silu" else ops.gelu_and_mul(
                x, "tanh" if activation == "gelu_tanh" else "none")
    assert [p.provider for p in ran] == [provider]
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        relative = ((got - want).norm() / want.norm()).item()
        assert relative <= 1e-6, relative
        return
    compared = torch.ones(want.shape, dtype=torch.bool)  # on the CPU, where the comparison runs
    if activation.startswith("gelu"):
        compared = want.cpu() == _hf_rounding_exactly(activation, gate.cpu(), up.cpu())
        assert compared.float().mean() > 0.85  # only GELU's far negative tail is left out
    assert_within_ulps(got.cpu()[compared], want.cpu()[compared])


# --------------------------------------------------------------------------------------------
# bad inputs

BAD_INPUTS = [
    ("x must be a torch.Tensor", lambda: ops.silu_and_mul((1.0, 2.0))),
    ("x must have dtype", lambda: ops.silu_and_mul(torch.ones(2, 4, dtype=torch.int64))),
    ("x's last dimension must be even", lambda: ops.silu_and_mul(torch.ones(2, 5))),
    ("x's last dimension must be even", lambda: ops.gelu_and_mul(torch.ones(2, 0))),
    ("x must have at least 1 dimension", lambda: ops.silu_and_mul(torch.tensor(2.0))),
    ("approximate must be one of", lambda: ops.gelu_and_mul(torch.ones(2, 4), approximate="erf")),
    ("limit must be > 0", lambda: ops.swiglu_oai(torch.ones(2, 4), 1.702, 0.0)),
    ("alpha must be a float", lambda: ops.swiglu_oai(torch.ones(2, 4), None)),
    ("alpha must be finite", lambda: ops.swiglu_oai(torch.ones(2, 4), float("inf"))),
    ("interleaved must be a bool", lambda: ops.swiglu_oai(torch.ones(2, 4), interleaved=1)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    import re

    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()


def test_zero_rows_give_an_empty_result():
    out = ops.silu_and_mul(torch.empty(0, 3, 8))
    assert out.shape == (0, 3, 4)


@pytest.mark.parametrize("activation, dtype", list(itertools.product(sorted(OPS), DTYPES)))
def test_reference_keeps_dtype_and_shape(activation, dtype):
    x = torch.randn(2, 3, 16).to(dtype)
    fn = {"silu": ops.silu_and_mul, "gelu": ops.gelu_and_mul,
          "gelu_tanh": lambda t: ops.gelu_and_mul(t, "tanh"), "swiglu_oai": ops.swiglu_oai}[activation]
    out = fn(x)
    assert out.shape == (2, 3, 8) and out.dtype == dtype
