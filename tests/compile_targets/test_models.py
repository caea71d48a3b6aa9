"""A rewired model's forward and generate() run through in compile-for-target mode.

Every kernel the model would launch (norms, fused add+norm, activations, the KV-cache write,
paged attention, MoE routing/alignment/GEMMs/combine) is compiled for a target of each backend at
the shapes and specialisations the model really produces, while the reference computes: the
tokens are HF eager's, and every launch passes the rules.
"""

from __future__ import annotations

import pytest
import torch

import hw_agnostic
from hw_agnostic import ops
from hw_agnostic.kernels import targets
from tests.test_attention_integration import padded_prompts
from tests.test_moe_integration import build

NEW_TOKENS = 6
#: Kernels each family must launch (the norms, attention and MLP or experts of its layers).
EXPECTED_KERNELS = {
    # qwen3's attention takes the direct path: its rotary embedding runs inside the KV write
    "qwen3": {"rms_norm", "fused_add_rms_norm_row", "gated_activation", "rotary_write_kv_cache", "paged_attention"},
    # gpt-oss's decoder layers are not fused (rewire reports why), so no fused add+norm.
    "gpt_oss": {"rms_norm", "write_kv_cache", "paged_attention", "route", "count_pairs", "segment_offsets",
                "scatter_pairs", "grouped_gemm", "gated_activation", "combine_topk"},
}


def _model(family: str) -> torch.nn.Module:
    if family == "gpt_oss":
        return build("gpt_oss")
    from tests.backend.models import build as build_dense

    return build_dense(family)


@pytest.mark.parametrize("family", sorted(EXPECTED_KERNELS))
def test_a_rewired_model_generates_hf_tokens_while_every_kernel_compiles(family, one_target_per_backend):
    """One target per backend: every kernel meets every target at the headline shapes in the per-op walk
    (test_default_configs); five targets of a model's kernels cost a minute more each, on a clean machine."""
    wanted = one_target_per_backend
    model, reference = _model(family), _model(family)
    ids, mask = padded_prompts(length=13)
    with torch.no_grad():
        want_logits = reference(ids, attention_mask=mask).logits
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with targets.compile_for(wanted) as log:
        report = hw_agnostic.rewire(model)
        with torch.no_grad(), ops.trace_dispatch() as ran:
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), report.table()
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    # Everything runs on the kernels but what the kernel provider itself declines (Qwen3's q/k norms
    # read views of the merged q/k/v projection whose leading dims do not collapse into one stride).
    fallbacks = {p.describe() for p in ran if p.provider != "helion" and "helion" not in p.skipped}
    assert not fallbacks, fallbacks
    compiled = {r.kernel for r in log.records}
    assert EXPECTED_KERNELS[family] <= compiled, EXPECTED_KERNELS[family] - compiled
    assert {r.target for r in log.records} == set(wanted)
    log.check()
