"""The compiled reference, the CPU's default path, rounds where the Hugging Face modules round.

Inductor fuses a reference into one kernel and, unless told otherwise, keeps the intermediates of
that kernel in fp32, dropping the roundings to bf16/fp16 the eager modules make (llama-style
norms round the normalised value before the weight): a quarter of the elements would come out one
step off. The registry compiles references with ``emulate_precision_casts``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hw_agnostic import ops
from hw_agnostic.ops import registry
from tests.harness import seeded_generator
from tests.ops import hf_norms

gated = importlib.import_module("hw_agnostic.ops.gated_rms_norm")

ENTRIES = [e for e in hf_norms.GATED_NORMS + hf_norms.LAYER_NORMS
           if e.id in ("MambaRMSNormGated", "Qwen3NextRMSNormGated", "ChameleonLayerNorm-qk")]


@pytest.fixture
def compiled_reference(monkeypatch):
    monkeypatch.setenv(registry.COMPILE_ENV, "1")
    ops.reset()
    yield
    ops.reset()


@pytest.mark.slow
@pytest.mark.parametrize("entry,path", [(e, "compiled") for e in ENTRIES]
                         + [(e, "native") for e in ENTRIES if "Gated" in e.id], ids=repr)
def test_the_cpu_path_rounds_like_the_module(entry, path, compiled_reference, monkeypatch):
    """The lean compiled reference (Inductor keeps each 16-bit rounding, see
    ``compiled_reference._round_like_eager``) and, for the gated norms, the native form (the
    ``native`` mode an engine that compiles by itself runs)."""
    if path == "native":
        monkeypatch.setenv(registry.COMPILE_ENV, "native")
        ops.reset()
    g = seeded_generator(f"compiled-{entry.id}")
    module = hf_norms.build(entry, 60, g).to(torch.bfloat16)
    x, gate = hf_norms.inputs(entry, 60, torch.bfloat16, "cpu", g)
    want = hf_norms.run_module(entry, module, x, gate)
    with torch.no_grad(), ops.trace_dispatch() as ran:
        got = entry.ours(module, x, gate)
    if path == "compiled":  # the lean path, not torch.compile
        compiled = getattr(ran[0].run, "compiled", ran[0].run)  # gated norms: their groups-as-rows wrapper's
        assert isinstance(compiled, registry.CompiledReference) and compiled.has_compiled
        assert any(graph is not None for graph in compiled.lean.values()) and not compiled._dynamo
    else:
        assert ran[0].run.__name__ == "native"
    hf_norms.assert_same_rounding(got, want, share=0.0)


@pytest.mark.slow
def test_compiled_rms_norm_rounds_like_llama(compiled_reference):
    g = seeded_generator("compiled-llama")
    module = LlamaRMSNorm(64)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64, generator=g) * 1.5)
    module = module.to(torch.bfloat16)
    x = (torch.randn(8, 64, generator=g) * 3).to(torch.bfloat16)
    with torch.no_grad():
        want = module(x)
        got = ops.rms_norm(x, module.weight, module.variance_epsilon)
    hf_norms.assert_same_rounding(got, want, share=0.0)


@pytest.mark.skipif(registry.interpreter_mode() is not None, reason="checks the plain CPU path")
def test_a_repeated_call_runs_the_lean_graph_without_its_per_call_checks(compiled_reference, monkeypatch):
    """Dispatch binds the lean graph's entry to a call signature: a repeat skips the compiled
    reference's checks (counted here) and gives its results; another layout decides afresh."""
    from hw_agnostic.ops.compiled_reference import CompiledReference

    x = torch.randn(3, 64, generator=seeded_generator("bound x")).to(torch.bfloat16)
    weight = torch.randn(64, generator=seeded_generator("bound weight")).to(torch.bfloat16)
    want = ops.get_op("rms_norm").reference(x, weight, 1e-6, "llama")
    decided = []
    original = CompiledReference.__call__
    monkeypatch.setattr(CompiledReference, "__call__", lambda self, *a: decided.append(a) or original(self, *a))
    with torch.no_grad():
        results = [ops.rms_norm(x, weight) for _ in range(3)]
        assert decided == [] and all(torch.equal(r, want) for r in results)
        strided = torch.empty(3, 128, dtype=torch.bfloat16)[:, ::2].copy_(x)  # another layout: __call__ decides
        assert torch.equal(ops.rms_norm(strided, weight), want) and len(decided) == 1
