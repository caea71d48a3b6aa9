"""Whole models, compared with Hugging Face at the logits tightly enough to see small errors.

Tiny two-layer models of the families that carry each feature: Llama (llama numerics), Mistral
(sliding window), Gemma-2 (softcap, gemma numerics, sandwich norms), OLMo-2 (fp32_scale, post
norms), Qwen3 (q/k norms), gpt-oss (sinks, MoE, clamped SwiGLU) and Qwen3-MoE. Their weights are
drawn so that every argument shows in the logits (HF's std=0.02 init makes attention nearly
uniform, so a scale or a softcap hardly matters): attention logits of unit spread, a softcap
that bends them, norm weights far from 1, routers that route decisively.

What is compared, per dtype:

* fp32: logits within 1e-5 relative (norm-wise) of HF eager.
* bf16 on the reference path: logits bit-equal to HF's. Without paged attention the rewired model
  rounds exactly where HF does; with it, HF's eager attention is run on the bf16 q/k/v in fp32
  (what our attention computes: fp32 scores and softmax, one rounding of the output) and the
  rest of HF's model is unchanged. Any different rounding anywhere (an eps off by 10x, llama
  numerics swapped for fp32_scale, an attention scale 1% off) changes the logits.
* bf16 through the DSL kernels (interpreter tiers): without paged attention, within 5e-3
  (bit-equal for the dense models; the grouped GEMM of the experts accumulates in another order
  than torch's, and one last-bit flip becomes about 3e-3 at the logits of a two-layer bf16 model,
  while a rounding in the wrong place moves them by 1e-2 or more). With it, no further from the fp32 model than HF's own bf16 logits are (within 1.5x): the
  attention kernels round the unnormalised probabilities to bf16 before P @ V (as flash
  attention does), and two bf16 layers turn any one-ulp difference into about 1e-2 at the
  logits, which is also how far HF's bf16 logits are from fp32. So bf16 there catches gross
  errors only; the same models in fp32 through the kernels catch the small ones.

Each test also checks from the dispatch trace that the replacements happened and ran on the
provider asked for: ``rewire(..., verify=False)`` keeps every replacement (verification, which
undoes replacements that disagree with the model, would hide a planted bug here).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hw_agnostic import ops, rewire
from hw_agnostic.kernels.interpret import interpreter_mode
from tests.backend.models import TINY, TOKENS
from tests.conftest import kernel_device
from tests.harness import dsl_providers

MODEL_FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "gemma2": {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 3.0},
    "olmo2": {},
    "qwen3": {"head_dim": 16},
    "gpt_oss": {"head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 24},
    "qwen3_moe": {"head_dim": 16, "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "norm_topk_prob": True},
}
#: What one forward of each rewired model runs: (norm modules, gated MLPs, MoE layers). Each HF
#: norm module runs as one rms_norm or one fused_add_rms_norm; the experts' activation runs as
#: an op of its own inside fused_experts on a DSL provider (the reference computes it inline).
EXPECTED_OPS = {
    "llama": (5, 2, 0), "mistral": (5, 2, 0), "gemma2": (9, 2, 0), "olmo2": (9, 2, 0), "qwen3": (9, 2, 0),
    "gpt_oss": (5, 0, 2), "qwen3_moe": (9, 0, 2),
}
#: Through the kernels in the interpreter tiers: one model per attention feature, and the MoE ones.
KERNEL_FAMILIES = ["mistral", "gemma2", "gpt_oss", "qwen3_moe"]
#: Ops left unforced in a family, and why: Qwen3's q/k norms read per-head rows of the merged
#: q/k/v projection's output, whose leading dims have no single row stride, so the kernels
#: decline them and the reference runs them (the other norms of the model run on the kernels).
UNFORCED = {"qwen3": ("rms_norm",), "qwen3_moe": ("rms_norm",)}
LAYERS = TINY["num_hidden_layers"]
PROMPT = torch.randint(3, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def build(family: str, dtype: torch.dtype) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **{**TINY, **TOKENS, **MODEL_FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            if tensor.dim() >= 2:  # unit-variance activations; routers that route decisively
                gain = 3.0 if name.endswith(("gate.weight", "router.weight")) else 1.0
                tensor.copy_(gain * torch.randn(tensor.shape, generator=g) / tensor.shape[-1] ** 0.5)
            elif "norm" in name:  # far from 1 (Gemma stores w of 1 + w)
                tensor.copy_((0.0 if gemma else 1.0) + 0.5 * torch.randn(tensor.shape, generator=g))
            else:  # biases, sinks
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=g))
    return model.to(dtype)


@contextlib.contextmanager
def attention_in_fp32(family: str):
    """HF's eager attention run on the bf16 q/k/v in fp32, its output rounded once."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    eager = module.eager_attention_forward

    def attention(attn_module, query, key, value, attention_mask, **kwargs):
        out, weights = eager(attn_module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), weights

    module.eager_attention_forward = attention
    try:
        yield
    finally:
        module.eager_attention_forward = eager


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _providers(families: list[str], *, triton_interpreter: bool = True) -> list:
    """The reference on every family, the DSL providers on ``families``; with ``triton_interpreter=False``
    none under the Triton interpreter, where each new kernel specialisation costs seconds of code
    generation and the test with paged attention runs the same kernels (and the attention too)."""
    here = kernel_device() and (triton_interpreter or interpreter_mode() != "triton")
    dsl = dsl_providers(ops.get_op("rms_norm")) if here else []
    params = [pytest.param(family, "reference", id=f"{family}-reference") for family in MODEL_FAMILIES]
    params += [pytest.param(family, provider, id=f"{family}-{provider}", marks=pytest.mark.dsl)
               for family in families for provider in dsl]
    return params


def _run(family: str, dtype: torch.dtype, provider: str, *, attention: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewired logits, HF logits) for one forward of the prompt, checking what ran."""
    device = "cpu" if provider == "reference" else kernel_device()
    original = build(family, dtype).to(device)
    model = copy.deepcopy(original)
    rewire(model, attention=attention, verify=False)
    ids = PROMPT.to(device)
    forced = [op for name, op in ops.all_ops().items() if name not in UNFORCED.get(family, ())]
    with torch.no_grad(), ops.use_provider(provider, *forced), ops.trace_dispatch() as ran:
        got = model(ids).logits
    with torch.no_grad(), attention_in_fp32(family) if attention and dtype != torch.float32 else contextlib.nullcontext():
        want = original(ids).logits
    _assert_replacements_ran(family, ran, provider, attention)
    return got, want


def _assert_replacements_ran(family: str, ran: list, provider: str, attention: bool) -> None:
    norms, mlps, moe = EXPECTED_OPS[family]
    activations = mlps + (moe if provider != "reference" else 0)
    calls = Counter(plan.op for plan in ran)
    described = sorted({plan.describe() for plan in ran})
    assert calls["rms_norm"] + calls["fused_add_rms_norm"] + calls["fused_add_rms_norm_"] == norms, described
    assert calls["silu_and_mul"] + calls["gelu_and_mul"] + calls["swiglu_oai"] == activations, described
    assert calls["fused_experts"] == moe and calls["moe_route"] == moe, described
    assert calls["paged_attention"] == (LAYERS if attention else 0), described
    assert {plan.provider for plan in ran if plan.op not in UNFORCED.get(family, ())} == {provider}, described
    for plan in ran:  # an unforced op runs on the provider unless that provider declines it
        assert plan.provider == provider or provider in plan.skipped, plan.describe()


@pytest.mark.parametrize("family, provider", _providers(KERNEL_FAMILIES, triton_interpreter=False))
def test_bf16_logits_match_hf_without_paged_attention(family, provider):
    got, want = _run(family, torch.bfloat16, provider, attention=False)
    if provider == "reference":
        assert torch.equal(got, want), f"rewired bf16 logits differ from HF's: {_relative(got, want):.3g} relative"
    else:
        assert _relative(got, want) <= 5e-3


@pytest.mark.parametrize("family, provider", _providers(KERNEL_FAMILIES))
def test_bf16_logits_with_paged_attention(family, provider):
    got, want = _run(family, torch.bfloat16, provider, attention=True)
    if provider == "reference":
        assert torch.equal(got, want), (f"rewired bf16 logits differ from HF's (attention in fp32): "
                                        f"{_relative(got, want):.3g} relative")
        return
    original = build(family, torch.float32)
    with torch.no_grad():
        exact = original(PROMPT).logits
        hf_bf16 = original.to(torch.bfloat16)(PROMPT).logits
    ours, theirs = _relative(got.cpu(), exact), _relative(hf_bf16, exact)
    assert ours <= 1.5 * theirs, f"bf16 logits {ours:.3g} from fp32 (relative), HF's bf16 {theirs:.3g}"


@pytest.mark.parametrize("family, provider", _providers(["mistral", "gpt_oss"]))
def test_fp32_logits_match_hf(family, provider):
    got, want = _run(family, torch.float32, provider, attention=True)
    assert _relative(got, want) <= 1e-5
