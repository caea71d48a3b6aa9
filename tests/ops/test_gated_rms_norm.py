"""gated_rms_norm: DSL vs reference, parity with every HF gated RMSNorm, bad inputs."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops.gated_rms_norm import gated_rms_norm_op
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples, seeded_generator
from tests.ops import hf_norms
from tests.ops.test_rms_norm import UNCOLLAPSED_ROWS, rows

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ORDERS = ("norm_then_gate", "gate_then_norm")
NUMERICS = ("llama", "fp32_scale")
SMALL_CONFIG = {"block_sizes": [2, 2], "reduction_loops": [8], "num_warps": 4, "num_stages": 1}


def _name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def gated_case(lead, hidden, dtype, *, order="norm_then_gate", groups=1, numerics="llama", activation="silu",
               gate="same", weight="same", layout="contiguous", gate_layout="contiguous", config=None, scale=3.0,
               eps=1e-6):
    gate = dtype if gate == "same" else gate
    weight = dtype if weight == "same" else weight
    name = (f"{'x'.join(map(str, lead))}x{hidden}-{_name(dtype)}-{order}-g{groups}-{numerics}-{activation}"
            f"-gate{_name(gate)}-w{_name(weight)}-{layout}-{gate_layout}-s{scale}-e{eps}"
            + ("-small" if config else ""))

    def make():
        g = seeded_generator(name)
        x = rows(lead, hidden, torch.float32, layout, g).mul_(scale).to(dtype)
        z = None if gate is None else rows(lead, hidden, torch.float32, gate_layout, g).mul_(2.0).to(gate)
        w = None if weight is None else (torch.randn(hidden, generator=g) * 1.5).to(weight)
        return x, z, w, eps, order, hidden // groups, numerics, activation

    return Case(name, make, config, expected_decline=UNCOLLAPSED_ROWS if "permuted" in (layout, gate_layout) else None)


def _cases() -> list[Case]:
    cases = []
    # Every order x numerics x dtype on an odd shape, in groups; small blocks for each order x numerics.
    for order, numerics, dtype in itertools.product(ORDERS, NUMERICS, DTYPES):
        cases.append(gated_case((7,), 39, dtype, order=order, numerics=numerics, groups=3))
    for (order, numerics), dtype in zip(itertools.product(ORDERS, NUMERICS), (*DTYPES, torch.bfloat16)):
        cases.append(gated_case((5,), 45, dtype, order=order, numerics=numerics, groups=3, config=SMALL_CONFIG))
    cases += [
        gated_case((5,), 37, torch.bfloat16, activation="sigmoid", numerics="fp32_scale"),
        gated_case((5,), 37, torch.float16, activation="sigmoid", order="gate_then_norm"),
        gated_case((1,), 1, torch.float32),
        gated_case((3,), 64, torch.bfloat16, gate=None, order="gate_then_norm", groups=4),
        gated_case((3,), 64, torch.bfloat16, gate=None, numerics="fp32_scale"),
        gated_case((3,), 48, torch.float16, weight=None, order="gate_then_norm", groups=2),
        gated_case((3,), 48, torch.bfloat16, weight=None),
        gated_case((2, 3), 48, torch.float16, groups=8),
        gated_case((0,), 64, torch.bfloat16, order="gate_then_norm", groups=2),
        gated_case((4,), 1000, torch.bfloat16, layout="padded", gate_layout="inner_stride", groups=8,
                   order="gate_then_norm"),
        gated_case((3,), 40, torch.bfloat16, layout="inner_stride", gate_layout="padded"),
        gated_case((3, 2), 24, torch.float32, layout="permuted"),
        gated_case((2,), 20000, torch.float32, order="gate_then_norm"),
        gated_case((2,), 4097, torch.bfloat16, numerics="fp32_scale"),
        # eps visible in the result: the mean square (1e-4) is far below eps
        gated_case((4,), 33, torch.float32, scale=1e-2, eps=1e-2),
        gated_case((4,), 36, torch.bfloat16, scale=1e-2, eps=1e-2, order="gate_then_norm", groups=3),
        # dtypes: an fp32 gate on bf16 activations; an fp32 weight (llama: promotes, or rounds after the gate)
        gated_case((3,), 64, torch.bfloat16, gate=torch.float32, order="gate_then_norm", groups=2),
        gated_case((3,), 64, torch.bfloat16, weight=torch.float32, order="gate_then_norm", groups=2),
        gated_case((3,), 64, torch.bfloat16, weight=torch.float32),
        gated_case((3,), 64, torch.float16, weight=torch.bfloat16, numerics="fp32_scale"),
    ]
    return cases


CASES = _cases()


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(gated_rms_norm_op))
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_gated_rms_norm_dsl(provider, case, device):
    check_provider(gated_rms_norm_op, provider, case, device)


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(8, 30), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    group_size=st.integers(1, 80),
    groups=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    order=st.sampled_from(ORDERS),
    numerics=st.sampled_from(NUMERICS),
    activation=st.sampled_from(["silu", "sigmoid"]),
    layout=st.sampled_from(["contiguous", "padded", "inner_stride"]),
    has_gate=st.booleans(),
)
def test_fuzz_shapes_and_strides(lead, group_size, groups, dtype, order, numerics, activation, layout, has_gate):
    from tests.conftest import kernel_device

    case = gated_case(lead, group_size * groups, dtype, order=order, groups=groups, numerics=numerics,
                      activation=activation, layout=layout, gate=dtype if has_gate else None)
    for provider in dsl_providers(gated_rms_norm_op):
        check_provider(gated_rms_norm_op, provider, case, kernel_device())


# --------------------------------------------------------------------------------------------
# parity with the Hugging Face modules (reference here; DSL providers in the interpreter tiers)


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(gated_rms_norm_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry", hf_norms.GATED_NORMS, ids=repr)
def test_matches_hf_module(entry, dtype, provider):
    hf_norms.check_parity(entry, dtype, provider, ops.gated_rms_norm)


@pytest.mark.parametrize("entry", [e for e in hf_norms.GATED_NORMS if "Mamba" in e.id or "Falcon" in e.id], ids=repr)
def test_matches_hf_module_without_a_gate(entry):
    """Mamba-2's and Falcon-H1's modules take ``gate=None``: a grouped RMS norm."""
    g = seeded_generator(f"hf-nogate-{entry.id}")
    module = hf_norms.build(entry, 60, g).to(torch.bfloat16)
    x, _ = hf_norms.inputs(entry, 60, torch.bfloat16, "cpu", g)
    with torch.no_grad():
        want = module(x, None)
        got = entry.ours(module, x, None)
    hf_norms.assert_same_rounding(got, want)


def test_the_parity_check_sees_a_misplaced_cast():
    """The bit-level parity check above fails when our numerics differ from the module's."""
    g = seeded_generator("misplaced")
    entry = next(e for e in hf_norms.GATED_NORMS if e.id == "Qwen3NextRMSNormGated")
    module = hf_norms.build(entry, 60, g).to(torch.bfloat16)
    x, gate = hf_norms.inputs(entry, 60, torch.bfloat16, "cpu", g)
    want = hf_norms.run_module(entry, module, x, gate)
    wrong = ops.gated_rms_norm(x, gate, module.weight, module.variance_epsilon, numerics="fp32_scale")
    with pytest.raises(AssertionError, match="round differently"):
        hf_norms.assert_same_rounding(wrong, want)


# --------------------------------------------------------------------------------------------
# compile and bad inputs (reference path: runs everywhere)


def test_compile_fullgraph():
    def model(x, gate, weight):
        return (ops.gated_rms_norm(x, gate, weight, 1e-6, order="gate_then_norm", group_size=8),
                ops.gated_rms_norm(x, gate, weight, numerics="fp32_scale", activation="sigmoid"),
                ops.gated_rms_norm(x, None, None))

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    g = seeded_generator("gated-compile")
    for tokens in (3, 7):
        args = (torch.randn(tokens, 32, generator=g), torch.randn(tokens, 32, generator=g), torch.randn(32, generator=g))
        for got, want in zip(compiled(*args), model(*args)):
            torch.testing.assert_close(got, want)


BAD_INPUTS = [
    ("x must be a torch.Tensor", lambda: ops.gated_rms_norm([1.0, 2.0])),
    ("x must have dtype", lambda: ops.gated_rms_norm(torch.ones(2, 4, dtype=torch.int32))),
    ("last dimension (the normalised one) must be >= 1", lambda: ops.gated_rms_norm(torch.ones(3, 0))),
    ("gate must be a torch.Tensor", lambda: ops.gated_rms_norm(torch.ones(2, 4), [1.0])),
    ("gate must have the shape of x", lambda: ops.gated_rms_norm(torch.ones(2, 4), torch.ones(2, 8))),
    ("gate must have dtype", lambda: ops.gated_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.int64))),
    ("gate is on meta but x is on cpu", lambda: ops.gated_rms_norm(torch.ones(2, 4), torch.ones(2, 4, device="meta"))),
    ("weight must have shape (4,)", lambda: ops.gated_rms_norm(torch.ones(2, 4), None, torch.ones(2, 4))),
    ("eps must be >= 0.0", lambda: ops.gated_rms_norm(torch.ones(2, 4), None, None, -1.0)),
    ("order must be one of", lambda: ops.gated_rms_norm(torch.ones(2, 4), order="before")),
    ("group_size must be an int", lambda: ops.gated_rms_norm(torch.ones(2, 4), group_size=2.0)),
    ("group_size must be >= 1", lambda: ops.gated_rms_norm(torch.ones(2, 4), group_size=0)),
    ("group_size must divide x's last dimension 6 into whole groups; got 4",
     lambda: ops.gated_rms_norm(torch.ones(2, 6), group_size=4)),
    ("numerics must be one of", lambda: ops.gated_rms_norm(torch.ones(2, 4), numerics="gemma")),
    ("activation must be one of", lambda: ops.gated_rms_norm(torch.ones(2, 4), torch.ones(2, 4), activation="gelu")),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        call()
