"""The compile rules catch what they promise to, and the mode runs programs through.

Each rule gets a kernel or config that breaks it: a kernel whose code no target's assembler
accepts, a grouped-GEMM config whose tiles overflow shared memory, a norm config with more
threads than 16-byte pieces of its rows, and the failure message must name kernel, config and
target. The mode itself: results come from the reference, in-place ops mutate, plans say what
happened, bad target names and interpreter variables are refused.
"""

from __future__ import annotations

import json

import pytest
import torch

import helion.language as hl
from hw_agnostic import ops
from hw_agnostic.kernels import targets
from hw_agnostic.kernels.runtime import HelionFunction
from hw_agnostic.ops import registry


def _bad_asm(x: torch.Tensor, out: torch.Tensor) -> None:
    for tile in hl.tile(x.size(0)):
        out[tile] = hl.inline_asm_elementwise("no_such_instruction $0, $1;", "=r,r", [x[tile]], dtype=torch.float32,
                                              is_pure=True, pack=1)


bad_asm_kernel = HelionFunction(_bad_asm)
BLOCK = {"block_sizes": [1024], "num_warps": 4, "num_stages": 1}


def _launch(kernel: HelionFunction, config: dict, args: tuple) -> None:
    kernel.compile(config, args, int64=False)(*args)


def test_a_kernel_that_does_not_compile_fails_naming_kernel_config_and_target(all_targets):
    x = torch.randn(4096)
    with targets.compile_for(all_targets) as log:
        _launch(bad_asm_kernel, BLOCK, (x, torch.empty_like(x)))
    assert {r.target for r in log.records} == set(all_targets)
    assert not any(r.ok for r in log.records)
    with pytest.raises(targets.TargetCompileError) as raised:
        log.check()
    message = str(raised.value)
    for target in all_targets:
        assert f"kernel bad_asm, config {json.dumps(BLOCK, sort_keys=True)}, target {target}" in message
    assert "does not compile" in message and "no_such_instruction" in message


def test_a_config_overflowing_shared_memory_fails_naming_kernel_config_and_target(one_target_per_backend):
    gemm = ops.get_op("grouped_gemm")
    args = gemm.example_inputs(512, 4096, torch.bfloat16, "meta")
    huge = {"block_sizes": [256, 128], "num_warps": 8, "num_stages": 5}  # 256x128 bf16 B tiles, 5 stages: 272 KiB
    with targets.compile_for(one_target_per_backend, run_reference=False) as log, ops.use_config(gemm, huge):
        gemm(*args)
    overflowing = [r for r in log.records if r.ok and r.shared > r.shared_limit]
    assert {r.target for r in overflowing} == set(one_target_per_backend)
    with pytest.raises(targets.TargetCompileError) as raised:
        log.check()
    for record in overflowing:
        assert f"kernel grouped_gemm, config {record.config}, target {record.target}" in str(raised.value)
        assert f"over the target's {record.shared_limit}" in str(raised.value)


def test_narrow_loads_of_aligned_rows_fail_a_memory_bound_kernel(all_targets):
    # 32 warps on one 4096-wide bf16 row: 1024 threads for 512 16-byte pieces, so 8-byte loads.
    crowded = {"block_sizes": [1], "reduction_loops": [None], "num_warps": 32, "num_stages": 1}
    x = torch.randn(4, 4096, dtype=torch.bfloat16)
    with targets.compile_for(all_targets) as log, ops.use_config(ops.rms_norm, crowded):
        ops.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16))
    assert all(r.vector_rule == "required" and r.load_bits < 128 for r in log.records)
    config = json.dumps(crowded, sort_keys=True)
    with pytest.raises(targets.TargetCompileError) as raised:
        log.check()
    for target in all_targets:
        assert f"kernel rms_norm, config {config}, target {target} (op rms_norm): memory-bound kernel reads " \
               "16-byte-aligned contiguous rows with at most" in str(raised.value)


@pytest.mark.parametrize("layout", ["contiguous", "padded"])
def test_the_norm_reads_aligned_rows_with_128_bit_vectors(layout, all_targets):
    width = 4096 + (13 if layout == "padded" else 0)
    x = torch.randn(64, width, dtype=torch.bfloat16)[:, :4096]
    with targets.compile_for(all_targets) as log:
        ops.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16))
    log.check()
    for record in log.records:
        if layout == "contiguous":
            assert record.vector_rule == "required" and record.load_bits == 128 and record.store_bits == 128
        else:  # rows 4109 elements apart: no 16-byte vectors provable, and none demanded
            assert record.vector_rule == "exempt: rows not 16-element aligned"
        # the row width is specialised (hl.specialize): a constant of the kernel, not an argument
        assert "x_stride_1=1" in record.signature and "_RDIM_SIZE_1=4096" in record.signature
        assert " n:" not in record.signature


def test_the_signature_is_specialised_as_the_jit_specialises_it():
    x = torch.randn(3, 48)
    with targets.compile_for(["sm_90"]) as log:
        ops.rms_norm(x, torch.ones(48))
    (record,) = log.records
    # 48 rows of fp32 (192 bytes): 16-divisible strides and sizes get tt.divisibility; stride 1 is a constexpr.
    assert record.signature.startswith("x:*fp32:16 weight:*fp32:16 out:*fp32:16 out_stride_0:i32:16 out_stride_1=1")
    with targets.compile_for(["sm_90"]) as log:
        ops.rms_norm(torch.randn(3, 37), torch.ones(37))
    assert "x_stride_0:i32 " in log.records[0].signature and "m:i32 " in log.records[0].signature


def test_results_come_from_the_reference_and_in_place_ops_mutate(all_targets):
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    want = ops.get_op("rms_norm").reference(x, weight, 1e-6, "llama")
    want_normed, want_sum = ops.get_op("fused_add_rms_norm").reference(x, residual, weight, 1e-6, "llama")
    with targets.compile_for(all_targets) as log, ops.trace_dispatch() as ran:
        got = ops.rms_norm(x, weight)
        ops.fused_add_rms_norm(x, residual, weight, inplace=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x, want_normed)
    torch.testing.assert_close(residual, want_sum)
    assert [p.provider for p in ran] == ["helion", "helion"]
    assert "compiled for " + ", ".join(all_targets) + ", results from the reference" in ran[0].describe()
    assert {r.op for r in log.records} == {"rms_norm", "fused_add_rms_norm_"}
    log.check()


def test_plans_made_outside_the_mode_are_not_reused_inside_it(monkeypatch):
    monkeypatch.delenv(targets.TARGETS_ENV)
    x, weight = torch.randn(4, 32), torch.randn(32)
    ops.rms_norm(x, weight)  # the reference on this CPU
    assert [p.provider for p in ops.get_op("rms_norm").plans()] == ["reference"]
    with targets.compile_for(["gfx942"]) as log:
        ops.rms_norm(x, weight)
    assert [r.target for r in log.records] == ["gfx942"]
    ops.rms_norm(x, weight)
    assert [p.provider for p in ops.get_op("rms_norm").plans()] == ["reference"]


def test_bad_target_names_and_interpreters_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="compile targets must be names from sm_80, sm_90, sm_100, gfx942, gfx1100"):
        targets.parse_targets("sm_90,h100")
    monkeypatch.setenv(targets.TARGETS_ENV, "sm_90,gfx9")
    with pytest.raises(ValueError, match="'sm_90,gfx9'"):
        targets.active_mode()
    monkeypatch.setenv(targets.TARGETS_ENV, "sm_90")
    assert [t.name for t in targets.active_mode().targets] == ["sm_90"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="cannot run under TRITON_INTERPRET=1"), targets.compile_for(["sm_90"]):
        pass


def test_meta_tensors_compile_without_memory():
    # A DeepSeek-V3 expert layer: 2 x 256 experts x 7168 x 2048 bf16 weights, 15 GB each on a real device.
    experts = ops.get_op("fused_experts")
    args = experts.example_inputs(64, 7168, torch.bfloat16, "meta")
    with targets.compile_for(["sm_90"], run_reference=False) as log:
        out = experts(*args)
    assert out.device.type == "meta" and out.shape == (64, 7168)
    kernels = {r.kernel for r in log.records}
    assert {"count_pairs", "segment_offsets", "scatter_pairs", "grouped_gemm", "gated_activation",
            "combine_topk"} <= kernels


def test_the_registry_accepts_cpu_and_meta_only_for_triton_providers(monkeypatch):
    monkeypatch.delenv(targets.TARGETS_ENV)
    provider = next(p for p in ops.get_op("rms_norm").providers if p.name == "helion")
    key = ops.get_op("rms_norm").key(torch.randn(2, 8), None, 1e-6, "llama")
    with targets.compile_for(["sm_80"]):
        assert provider.compiles_for_targets(key) and provider.why_not(key) is None
    assert not provider.compiles_for_targets(key)
    assert registry.TARGET_MODE_DEVICES == {"cpu", "meta"}


def _affine_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    for tile in hl.tile(x.size(0)):
        product = (x[tile].to(torch.float32) * w[tile].to(torch.float32)).to(torch.bfloat16)  # rounded, as HF does
        out[tile] = (product.to(torch.float32) + b[tile].to(torch.float32)).to(torch.bfloat16)


@pytest.mark.parametrize("fp_fusion", [False, True])
def test_a_kernel_following_roundings_compiles_without_fma_contraction(fp_fusion, monkeypatch):
    """``fp_fusion=False`` reaches the compiler: no multiply-add is contracted across a rounding
    (with fusion, Triton 3.6 and 3.9 both compile ``round(round(x * w) + b)`` on bf16 to one
    ``fma.rn.bf16``: one rounding where the module makes two)."""
    compiled = []
    measure = targets._measure
    monkeypatch.setattr(targets, "_measure", lambda c, *a: compiled.append(c) or measure(c, *a))
    kernel = HelionFunction(_affine_bf16, fp_fusion=fp_fusion)
    args = tuple(torch.randn(4096).to(torch.bfloat16) for _ in range(4))
    with targets.compile_for(["sm_90"], run_reference=False):
        _launch(kernel, BLOCK, args)
    (binary,) = compiled
    assert binary.metadata.enable_fp_fusion is fp_fusion
    if not fp_fusion:
        assert "fma.rn.bf16" not in binary.asm["ptx"] and "mul.rn.bf16" in binary.asm["ptx"]


SASS_WITH_A_LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1+0x4], R105 ;
.L_x_3:
        /*0020*/                   HGMMA.64x16x16.F32.BF16 R96, gdesc[UR52], RZ, !UPT ;
        /*0030*/                   {IN_LOOP}
        /*0040*/              @!P6 BRA `(.L_x_3) ;
        /*0050*/              @P0 BRA `(.L_x_4) ;
.L_x_4:
        /*0060*/                   LDL.LU R151, [R1+0x4] ;
        /*0070*/                   EXIT ;
.L_x_5:
        /*0080*/                   BRA `(.L_x_5);
"""


@pytest.mark.parametrize("in_loop, inside", [("NOP ;", 0), ("STL.64 [R1+0x8], R4 ;", 8), ("LDL.128 R4, [R1] ;", 16),
                                             ("STS [R3], R4 ;", 0)])
def test_spill_accesses_are_placed_inside_or_outside_the_loops(in_loop, inside):
    """A loop is a label and a later branch back to it (not the forward branch, not the trailing
    self-loop after EXIT, which holds no spill); shared-memory stores are not spills."""
    assert targets.sass_loop_spill_bytes(SASS_WITH_A_LOOP.replace("{IN_LOOP}", in_loop)) == inside


def test_a_few_spills_outside_the_loops_pass_and_spills_in_a_loop_fail():
    """Head-dim-256 prefill attention on 64x32 tiles: with Triton 3.9 it parks two registers in
    local memory before its loops and reads them back after (16 bytes; 3.6 spills nothing), which
    the rule allows: that is what gives sm_90 prefill at head dim 256 wgmma. 64x64 tiles spill
    more, inside the hot loop (3.9) or past the allowance (3.6, 224 bytes): a problem naming where."""
    attention = ops.get_op("paged_attention")
    args = attention.example_inputs(4096, 256, torch.bfloat16, "meta")
    records = {}
    for keys in (32, 64):
        config = {"block_sizes": [64, keys], "num_warps": 8, "num_stages": 2, "num_splits": "auto"}
        with targets.compile_for(["sm_90"], run_reference=False) as log, ops.use_config(attention, config):
            attention(*args)
        (records[keys],) = [r for r in log.records if r.kernel == "paged_attention"]
    few, many = records[32], records[64]
    assert few.problems() == [] and few.matrix == "wgmma"
    assert not few.spill_bytes or (few.loop_spill_bytes == 0 and few.spill_bytes <= targets.MAX_OUT_OF_LOOP_SPILL_BYTES)
    assert many.spill_bytes and not many.spills_outside_loops()
    (problem,) = many.problems()
    assert f"spills {many.spill_bytes} bytes of registers, {many.loop_spill_bytes} of them inside loops" in problem
