"""rms_norm and fused_add_rms_norm: DSL vs reference, HF parity, in-place contract, bad inputs."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from hw_agnostic import ops
from hw_agnostic.ops.rms_norm import fused_add_rms_norm_inplace_op, fused_add_rms_norm_op, rms_norm_op
from hw_agnostic.tolerances import assert_close, assert_within_ulps
from tests.harness import Case, check_provider, dsl_providers, fuzz_examples

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUMERICS = ("llama", "fp32_scale", "gemma")
#: Why the kernels decline a ``permuted`` layout.
UNCOLLAPSED_ROWS = "the kernels address rows at one stride; the reference runs such inputs"
SMALL_ROW_CONFIG = {"block_sizes": [2], "reduction_loops": [16], "num_warps": 4, "num_stages": 1}
SMALL_FUSED_CONFIGS = (
    {"variant": "row", "block_sizes": [2], "num_warps": 4, "num_stages": 1},
    {"variant": "chunked", "block_sizes": [2, 16], "num_warps": 4, "num_stages": 1},
)


def _generator(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def rows(lead: tuple[int, ...], hidden: int, dtype: torch.dtype, layout: str, g: torch.Generator,
         scale: float = 1.0) -> torch.Tensor:
    """A ``[*lead, hidden]`` input of standard deviation ``scale``, laid out as a real caller might hand it over."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).mul_(scale).to(dtype)

    if layout == "contiguous":
        return randn(*lead, hidden)
    if layout == "padded":  # rows of a wider buffer: buf[..., :hidden]
        return randn(*lead, hidden + 13)[..., :hidden]
    if layout == "inner_stride":
        return randn(*lead, 2 * hidden)[..., ::2]
    if layout == "permuted":  # leading dims that do not collapse into one row stride
        return randn(lead[1], lead[0], hidden).transpose(0, 1)
    raise ValueError(layout)


def _weight(hidden: int, dtype: torch.dtype | None, numerics: str, g: torch.Generator) -> torch.Tensor | None:
    if dtype is None:
        return None
    scale = 0.3 if numerics == "gemma" else 1.0
    return (scale * torch.randn(hidden, generator=g)).to(dtype)


def norm_case(lead, hidden, dtype, *, numerics="llama", weight_dtype="same", layout="contiguous", config=None,
              fused=False, eps=1e-6, scale=1.0):
    """``scale`` is the inputs' standard deviation: with ``scale**2`` near ``eps`` (small activations,
    a large eps) eps moves the result by a large factor, so a kernel that mishandles it fails."""
    weight_dtype = dtype if weight_dtype == "same" else weight_dtype
    wname = "none" if weight_dtype is None else str(weight_dtype).removeprefix("torch.")
    name = (f"{'x'.join(map(str, lead))}x{hidden}-{str(dtype).removeprefix('torch.')}-{numerics}-w{wname}-{layout}"
            + ("-small" if config else "") + (f"-{config['variant']}" if config and "variant" in config else "")
            + (f"-eps{eps:g}-scale{scale:g}" if (eps, scale) != (1e-6, 1.0) else ""))

    def make():
        g = _generator(name)
        x = rows(lead, hidden, dtype, layout, g, scale)
        w = _weight(hidden, weight_dtype, numerics, g)
        if fused:
            residual = rows(lead, hidden, dtype, "contiguous", g, scale)
            return x, residual, w, eps, numerics
        return x, w, eps, numerics

    return Case(name, make, config, expected_decline=UNCOLLAPSED_ROWS if layout == "permuted" else None)


def _cases(fused: bool) -> list[Case]:
    small_configs = SMALL_FUSED_CONFIGS if fused else (SMALL_ROW_CONFIG,)
    cases = []
    # Every dtype x numerics on an odd shape, once with default and once with small blocks (masks).
    for dtype, numerics in itertools.product(DTYPES, NUMERICS):
        cases.append(norm_case((7,), 37, dtype, numerics=numerics, fused=fused))
        for config in small_configs:
            cases.append(norm_case((5,), 45, dtype, numerics=numerics, config=config, fused=fused))
        # eps comparable to the mean square: ignoring eps, or scaling it, changes every element
        cases.append(norm_case((7,), 37, dtype, numerics=numerics, fused=fused, eps=1e-2, scale=0.1))
    cases += [norm_case((5,), 45, torch.bfloat16, config=config, fused=fused, eps=1e-4, scale=0.01)
              for config in small_configs]
    cases += [
        norm_case((1,), 1, torch.float32, fused=fused),
        norm_case((3,), 128, torch.bfloat16, weight_dtype=None, fused=fused),
        norm_case((3,), 96, torch.bfloat16, numerics="gemma", weight_dtype=None, fused=fused),
        norm_case((2, 3), 48, torch.float16, fused=fused),
        norm_case((4,), 1000, torch.bfloat16, layout="padded", fused=fused),
        norm_case((2, 3), 77, torch.float32, layout="padded", fused=fused),
        norm_case((3,), 40, torch.bfloat16, layout="inner_stride", fused=fused),
        norm_case((0,), 64, torch.bfloat16, fused=fused),
        norm_case((1,), 4097, torch.bfloat16, fused=fused),
        norm_case((2,), 65536, torch.bfloat16, fused=fused),
        norm_case((2,), 20000, torch.float32, numerics="fp32_scale", fused=fused),
        norm_case((3, 2), 24, torch.float32, layout="permuted", fused=fused),
    ]
    if not fused:  # a fp32 weight promotes the llama-numerics result to fp32
        cases.append(norm_case((3,), 64, torch.bfloat16, weight_dtype=torch.float32))
    return cases


RMS_CASES = _cases(fused=False)
FUSED_CASES = _cases(fused=True)


# --------------------------------------------------------------------------------------------
# DSL providers vs the reference


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(rms_norm_op))
@pytest.mark.parametrize("case", RMS_CASES, ids=repr)
def test_rms_norm_dsl(provider, case, device):
    check_provider(rms_norm_op, provider, case, device)


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(fused_add_rms_norm_op))
@pytest.mark.parametrize("case", FUSED_CASES, ids=repr)
def test_fused_add_rms_norm_dsl(provider, case, device):
    check_provider(fused_add_rms_norm_op, provider, case, device)


@pytest.mark.dsl
@pytest.mark.parametrize("provider", dsl_providers(fused_add_rms_norm_inplace_op))
@pytest.mark.parametrize("case", [c for c in FUSED_CASES if "permuted" not in c.id], ids=repr)
def test_fused_add_rms_norm_inplace_dsl(provider, case, device):
    check_provider(fused_add_rms_norm_inplace_op, provider, case, device)


FUZZ_OPS = {"rms_norm": rms_norm_op, "fused": fused_add_rms_norm_op, "inplace": fused_add_rms_norm_inplace_op}


@pytest.mark.dsl
@settings(max_examples=fuzz_examples(16, 60), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    numerics=st.sampled_from(NUMERICS),
    layout=st.sampled_from(["contiguous", "padded", "inner_stride"]),
    form=st.sampled_from(sorted(FUZZ_OPS)),
    weight_dtype=st.sampled_from(["same", None, torch.float32]),
    eps=st.sampled_from([0.0, 1e-6, 1e-4, 1e-2]),
    scale=st.sampled_from([0.01, 0.1, 1.0, 8.0]),
)
def test_fuzz_shapes_strides_and_arguments(lead, hidden, dtype, numerics, layout, form, weight_dtype, eps, scale):
    """Shapes, strides, dtypes, numerics, weights (none, same dtype, fp32), eps against input
    scales (eps from invisible to dominant), out of place and in place."""
    from tests.conftest import kernel_device

    op = FUZZ_OPS[form]
    promotes = weight_dtype is torch.float32 and dtype != torch.float32 and numerics == "llama"
    assume(not (form == "inplace" and promotes))  # no in-place form: the result has another dtype
    case = norm_case(lead, hidden, dtype, numerics=numerics, weight_dtype=weight_dtype, layout=layout,
                     fused=form != "rms_norm", eps=eps, scale=scale)
    for provider in dsl_providers(op):
        check_provider(op, provider, case, kernel_device())


@pytest.mark.dsl
def test_int64_offsets(device):
    """A strided view whose element offsets pass 2**31 (with a tiny numel) is addressed right."""
    hidden, row_stride = 64, 2**31 + 64
    storage = torch.empty(row_stride + hidden, dtype=torch.bfloat16, device=device)  # untouched pages cost nothing
    x = storage.as_strided((2, hidden), (row_stride, 1))
    g = _generator("int64")
    x.copy_(torch.randn(2, hidden, generator=g).to(torch.bfloat16))
    weight = torch.randn(hidden, generator=g).to(torch.bfloat16).to(device)
    assert rms_norm_op.key(x, weight, 1e-6, "llama").int64
    expected = rms_norm_op.reference(x.double(), weight.double(), 1e-6, "llama")
    for provider in dsl_providers(rms_norm_op):
        with ops.use_provider(provider, ops.rms_norm):
            assert_close(ops.rms_norm(x, weight), expected, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# parity with the Hugging Face modules (reference here; DSL providers in the interpreter tiers)


def _providers_here() -> list:
    from tests.conftest import kernel_device

    dsl = dsl_providers(rms_norm_op) if kernel_device() else []
    return ["reference", *[pytest.param(p, marks=pytest.mark.dsl) for p in dsl]]


HF_MODULES = {"llama": LlamaRMSNorm, "fp32_scale": Olmo2RMSNorm, "gemma": GemmaRMSNorm}
#: (input standard deviation, eps): the usual regime, and eps comparable to the mean square.
REGIMES = {"unit": (4.0, 1e-6), "eps-visible": (0.1, 1e-2)}


def _hf_norm(numerics: str, hidden: int, eps: float, dtype: torch.dtype, device: str, g: torch.Generator):
    """The HF module of ``numerics`` with weights far from 1 (Gemma's ``w`` of ``1 + w`` far from 0)."""
    module = HF_MODULES[numerics](hidden, eps=eps)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden, generator=g) * 2.0 + (0.0 if numerics == "gemma" else 0.5))
    return module.to(device=device, dtype=dtype)


def _assert_hf_parity(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within 1e-6 norm-wise; fp16/bf16: within HF_PARITY of the HF module, nearly all bit-equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        relative = ((got - want).norm() / want.norm()).item()
        assert relative <= 1e-6, relative
    else:
        assert_within_ulps(got, want)


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", NUMERICS)
def test_matches_hf_module(numerics, dtype, regime, provider):
    from tests.conftest import kernel_device

    device = "cpu" if provider == "reference" else kernel_device()
    scale, eps = REGIMES[regime]
    g = _generator(f"hf-{numerics}-{dtype}-{regime}")
    module = _hf_norm(numerics, 96, eps, dtype, device, g)
    x = (torch.randn(3, 5, 96, generator=g) * scale).to(device=device, dtype=dtype)
    with torch.no_grad():
        want = module(x)
    with ops.use_provider(provider, ops.rms_norm), ops.trace_dispatch() as ran:
        got = ops.rms_norm(x, module.weight, eps, numerics=numerics)
    assert [p.provider for p in ran] == [provider]
    _assert_hf_parity(got, want)


@pytest.mark.parametrize("provider", _providers_here())
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("numerics", NUMERICS)
def test_fused_matches_hf_decoder_pattern(numerics, inplace, provider):
    """``residual + hidden`` in the model dtype, then the norm: what HF decoder layers do."""
    from tests.conftest import kernel_device

    device = "cpu" if provider == "reference" else kernel_device()
    for dtype, regime in itertools.product(DTYPES, sorted(REGIMES)):
        scale, eps = REGIMES[regime]
        g = _generator(f"hf-fused-{numerics}-{dtype}-{regime}")
        norm = _hf_norm(numerics, 64, eps, dtype, device, g)
        hidden = (torch.randn(6, 64, generator=g) * scale).to(device=device, dtype=dtype)
        residual = (torch.randn(6, 64, generator=g) * scale).to(device=device, dtype=dtype)
        with torch.no_grad():
            summed = residual + hidden
            want = norm(summed)
        with ops.use_provider(provider, ops.fused_add_rms_norm), ops.trace_dispatch() as ran:
            got, got_sum = ops.fused_add_rms_norm(hidden, residual, norm.weight, eps, numerics=numerics,
                                                  inplace=inplace)
        assert [p.provider for p in ran] == [provider]
        assert (got is hidden and got_sum is residual) == inplace
        assert torch.equal(got_sum, summed)
        _assert_hf_parity(got, want)


# --------------------------------------------------------------------------------------------
# contracts and bad inputs (reference path: runs everywhere)


def test_inplace_contract_returns_and_fills_the_arguments():
    g = _generator("inplace")
    x, residual = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    weight = torch.randn(32, generator=g)
    want_normed, want_sum = ops.fused_add_rms_norm(x, residual, weight)
    x_before = x.clone()
    got_x, got_residual = ops.fused_add_rms_norm(x, residual, weight, inplace=True)
    assert got_x is x and got_residual is residual
    assert torch.equal(x, want_normed) and torch.equal(residual, want_sum)
    assert not torch.equal(x, x_before)


def test_functional_form_leaves_arguments_alone():
    g = _generator("functional")
    x, residual = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    x_before, residual_before = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x, residual, torch.ones(32))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_zero_rows_give_an_empty_result():
    out = ops.rms_norm(torch.empty(0, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


BAD_INPUTS = [
    ("x must be a torch.Tensor", lambda: ops.rms_norm([1.0, 2.0])),
    ("x must have dtype", lambda: ops.rms_norm(torch.ones(2, 4, dtype=torch.int32))),
    ("x must have at least 1 dimension", lambda: ops.rms_norm(torch.tensor(1.0))),
    ("last dimension (the normalised one) must be >= 1", lambda: ops.rms_norm(torch.ones(3, 0))),
    ("weight must have shape (4,)", lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(5))),
    ("weight must have shape (4,)", lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(1, 4))),
    ("weight must have dtype", lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int64))),
    ("weight is on meta but x is on cpu", lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, device="meta"))),
    ("eps must be >= 0.0", lambda: ops.rms_norm(torch.ones(2, 4), None, -1e-6)),
    ("eps must be a float", lambda: ops.rms_norm(torch.ones(2, 4), None, "1e-6")),
    ("eps must be finite", lambda: ops.rms_norm(torch.ones(2, 4), None, float("nan"))),
    ("numerics must be one of", lambda: ops.rms_norm(torch.ones(2, 4), numerics="olmo")),
    ("residual must have the shape of x", lambda: ops.fused_add_rms_norm(torch.ones(2, 4), torch.ones(3, 4))),
    ("residual must have the dtype of x",
     lambda: ops.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.float16))),
    ("residual is on meta", lambda: ops.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, device="meta"))),
    ("residual must be a torch.Tensor", lambda: ops.fused_add_rms_norm(torch.ones(2, 4), None)),
    ("x and residual share memory",
     lambda: (lambda t: ops.fused_add_rms_norm(t, t, inplace=True))(torch.ones(2, 4))),
    ("x and residual share memory",
     lambda: (lambda t: ops.fused_add_rms_norm(t[:, :3], t[:, 1:], inplace=True))(torch.ones(2, 4))),
    ("cannot be written into x",
     lambda: ops.fused_add_rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16),
                                    torch.ones(4), inplace=True)),
]


@pytest.mark.parametrize("message, call", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(message, call):
    with pytest.raises((TypeError, ValueError), match=_escape(message)):
        call()


def test_bad_input_leaves_caller_tensors_alone():
    x, residual = torch.randn(2, 4), torch.randn(2, 4)
    x_before, residual_before = x.clone(), residual.clone()
    with pytest.raises(ValueError):
        ops.fused_add_rms_norm(x, residual, torch.ones(5), inplace=True)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def _escape(text: str) -> str:
    import re

    return re.escape(text)
