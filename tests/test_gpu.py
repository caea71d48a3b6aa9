"""Checks only a GPU can make: real launches at serving sizes, CUDA-graph capture, real tuning."""

from __future__ import annotations

import pytest
import torch

from hw_agnostic import ops
from hw_agnostic.autotune import cache
from hw_agnostic.autotune.tuner import tune
from hw_agnostic.tolerances import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, hidden", [(1, 4096), (4096, 8192), (3, 65536), (1000, 5120)])
def test_norms_and_activations_at_serving_sizes(tokens, hidden, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    weight = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    with ops.trace_dispatch() as ran:
        normed = ops.rms_norm(x, weight)
        fused, summed = ops.fused_add_rms_norm(x, residual, weight)
        act = ops.silu_and_mul(x)
    assert {p.provider for p in ran} == {"helion"}
    reference = ops.get_op("rms_norm").reference
    assert_close(normed, reference(x.double(), weight.double(), 1e-6, "llama"), dtype)
    assert_close(summed, residual.double() + x.double(), dtype)
    assert_close(fused, reference(summed.double(), weight.double(), 1e-6, "llama"), dtype)
    assert_close(act, ops.get_op("silu_and_mul").reference(x.double()), dtype)


def test_decode_step_ops_capture_in_a_cuda_graph():
    """No host synchronisation on the hot path: the ops record into a CUDA graph and replay right."""
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(8, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(x, weight), ops.fused_add_rms_norm(x, residual, weight), ops.silu_and_mul(gate_up)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed = ops.rms_norm(x, weight)
        fused, summed = ops.fused_add_rms_norm(x, residual, weight)
        act = ops.silu_and_mul(gate_up)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(normed, ops.rms_norm(x, weight))
    assert torch.equal(summed, residual + x)
    assert torch.equal(act, ops.silu_and_mul(gate_up))
    assert torch.equal(fused, ops.rms_norm(summed, weight))


def test_tuning_on_the_gpu_feeds_the_runtime(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.USER_ROOT_ENV, str(tmp_path))
    op = ops.get_op("rms_norm")
    results = tune(op, [(128, 4096)], dtype=torch.bfloat16, device="cuda", budget_s=20, progress=False)
    # within 20 s an H200 tunes part of the search space (seen 2026-12-04): either writes the entry
    assert results[0].status in ("tuned", "partial") and results[0].time_us > 0
    x, weight, eps, numerics = op.example_inputs(128, 4096, torch.bfloat16, "cuda")
    assert op.plan(x, weight, eps, numerics).config.config == results[0].config


def test_a_rewired_decode_step_captures_in_one_cuda_graph():
    """A whole decode step of a rewired model records into one CUDA graph: no host synchronisation
    and nothing the capture refuses on its path. The cache's host state advances once, at capture;
    cropping it back leaves the tensors the graph reads as they were (nothing writes the lengths
    in place), so a replay recomputes that step, and must give the eager step's logits."""
    from transformers import DynamicCache

    from hw_agnostic import rewire
    from tests.backend.models import build, prompt

    model = build("llama", dtype=torch.bfloat16).cuda()
    rewire(model)
    cache = DynamicCache(config=model.config)
    token = prompt(batch=2, length=1, seed=7).cuda()
    with torch.no_grad():
        model(prompt(batch=2, length=9).cuda(), past_key_values=cache, use_cache=True)
        want = model(token, past_key_values=cache, use_cache=True).logits.clone()  # plans built, kernels compiled
        cache.crop(-1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = model(token, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 9
