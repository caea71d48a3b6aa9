"""Op rows: each op vs the Hugging Face eager code it replaces, ``torch.compile`` of that code,
Liger where it is installed (GPUs), and a same-size copy.

Bytes are the fewest an op must move (each input read once, each output written once); GB/s
over the copy bandwidth measured in the same run says how close an op is to the memory ceiling.
The ``copy`` rows move the same number of bytes as the op, the way the op does: ``clone()`` of
a buffer (a fresh output, as ops returning new tensors allocate) or, for the in-place form, a
copy into an existing buffer. ``× vs copy`` is then the fraction of a same-size copy the op
reaches, on the same machine, in the same run, at the same size (so cache effects cancel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from hw_agnostic import ops
from hw_agnostic.autotune.shapes import TOKEN_COUNTS, widths
from hw_agnostic.ops.rotary_embedding import rope_tables

from .timing import measure_all

# transformers 5.25 renamed it
MambaRMSNormGated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated


class HFAddRMSNorm(nn.Module):
    """What an HF decoder layer does around a norm: ``residual + hidden``, then the norm."""

    def __init__(self, hidden: int, norm: type[nn.Module] = LlamaRMSNorm) -> None:
        super().__init__()
        self.norm = norm(hidden)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.norm(summed), summed


class HFGatedAct(nn.Module):
    """``act_fn(gate) * up`` of HF MLPs, on the merged ``[..., 2I]`` projection output."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


class HFGptOssGate(nn.Module):
    """gpt-oss's clamped SwiGLU (``GptOssExperts._apply_gate``)."""

    alpha, limit = 1.702, 7.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GptOssExperts._apply_gate(self, x)


class HFRotary(nn.Module):
    """Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` as a module (what the attention forward calls)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return apply_rotary_pos_emb(q, k, cos, sin)


#: Llama-3-8B's query and KV heads, for the rotary rows (width: the head dim)
ROTARY_HEADS = (32, 8)


@dataclasses.dataclass
class Workload:
    op: str
    tokens: int
    width: int
    dtype: torch.dtype
    bytes_moved: int
    ours: Callable[[], Any]
    baselines: dict[str, nn.Module]
    inputs: tuple[Any, ...]
    args: tuple[Any, ...]  # the op's own positional arguments, to read its plan

    @property
    def inplace(self) -> bool:
        return self.op.endswith("_")

    def same_size_copy(self) -> Callable[[], Any]:
        """A copy moving :attr:`bytes_moved` bytes: into an existing buffer for in-place ops, else a clone."""
        x = self.inputs[0]
        elements = max(self.bytes_moved // 2 // x.element_size(), 1)
        src = torch.randn(elements, generator=torch.Generator().manual_seed(0)).to(device=x.device, dtype=x.dtype)
        if self.inplace:
            dst = torch.empty_like(src)
            return lambda: dst.copy_(src)
        return src.clone


def _grid(device: torch.device, quick: bool) -> list[tuple[str, int, int, torch.dtype]]:
    if device.type != "cpu":
        dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
        tokens = (1, 128, 4096) if quick else TOKEN_COUNTS
        names = ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "silu_and_mul", "gelu_and_mul", "swiglu_oai",
                 "layer_norm", "fused_add_layer_norm", "fused_add_layer_norm_", "gated_rms_norm", "rotary_embedding")
        return [(op, t, w, d) for op in names for w in widths(op) for t in tokens for d in dtypes]
    # The CPU has minutes, not hours: Llama-3-8B/70B widths, a head-dim norm, four token counts.
    tokens = (1, 16, 4096) if quick else (1, 16, 256, 4096)
    grid = []
    for dtype in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)):
        for op, op_widths in (("rms_norm", (128, 4096, 8192)), ("fused_add_rms_norm", (4096, 8192)),
                              ("fused_add_rms_norm_", (4096, 8192)),
                              ("silu_and_mul", (2048, 4096, 14336)), ("gelu_and_mul", (4096,)),
                              ("swiglu_oai", (2880,)), ("layer_norm", (4096,)), ("fused_add_layer_norm", (4096,)),
                              ("fused_add_layer_norm_", (4096,)), ("gated_rms_norm", (128, 8192)),
                              ("rotary_embedding", (128,))):
            grid += [(op, t, w, dtype) for w in op_widths for t in tokens]
    return grid


def _workload(op: str, tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> Workload:
    g = torch.Generator(device="cpu").manual_seed(tokens * 7919 + width)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    size = torch.finfo(dtype).bits // 8
    if op in ("layer_norm", "fused_add_layer_norm", "fused_add_layer_norm_", "gated_rms_norm"):
        return _layer_or_gated_norm(op, tokens, width, dtype, device, randn, size)
    if op == "rotary_embedding":  # one sequence of Llama-3-8B's heads, as the projections leave them
        q_heads, k_heads = ROTARY_HEADS
        q, k = randn(1, tokens, q_heads, width).transpose(1, 2), randn(1, tokens, k_heads, width).transpose(1, 2)
        cos, sin = rope_tables(tokens, width, dtype, str(device))
        moved = (2 * (q_heads + k_heads) + 2) * tokens * width * size
        return Workload(op, tokens, width, dtype, moved, lambda: ops.rotary_embedding(q, k, cos, sin),
                        {"hf_eager": HFRotary()}, (q, k, cos, sin), (q, k, cos, sin))
    if op in ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_"):
        x = randn(tokens, width)
        hf = LlamaRMSNorm(width).to(device=device, dtype=dtype) if op == "rms_norm" else HFAddRMSNorm(width).to(
            device=device, dtype=dtype)
        weight = (hf.weight if op == "rms_norm" else hf.norm.weight).detach()
        weight.copy_(randn(width))
        if op == "rms_norm":
            return Workload(op, tokens, width, dtype, (2 * tokens + 1) * width * size,
                            lambda: ops.rms_norm(x, weight), {"hf_eager": hf}, (x,), (x, weight, 1e-6, "llama"))
        residual = randn(tokens, width)
        if op == "fused_add_rms_norm_":  # the serving form: results written over x and residual
            mine_x, mine_residual = x.clone(), residual.clone()
            ours = lambda: ops.fused_add_rms_norm(mine_x, mine_residual, weight, inplace=True)  # noqa: E731
        else:
            ours = lambda: ops.fused_add_rms_norm(x, residual, weight)  # noqa: E731
        return Workload(op, tokens, width, dtype, (4 * tokens + 1) * width * size, ours, {"hf_eager": hf},
                        (x, residual), (x, residual, weight, 1e-6, "llama"))
    x = randn(tokens, 2 * width)
    moved = 3 * tokens * width * size
    if op == "silu_and_mul":
        return Workload(op, tokens, width, dtype, moved, lambda: ops.silu_and_mul(x),
                        {"hf_eager": HFGatedAct("silu")}, (x,), (x,))
    if op == "gelu_and_mul":
        return Workload(op, tokens, width, dtype, moved, lambda: ops.gelu_and_mul(x, "tanh"),
                        {"hf_eager": HFGatedAct("gelu_pytorch_tanh")}, (x,), (x, "tanh"))
    return Workload(op, tokens, width, dtype, moved, lambda: ops.swiglu_oai(x), {"hf_eager": HFGptOssGate()},
                    (x,), (x, 1.702, 7.0, True))


def _layer_or_gated_norm(op: str, tokens: int, width: int, dtype: torch.dtype, device: torch.device,
                         randn: Callable[..., torch.Tensor], size: int) -> Workload:
    x = randn(tokens, width)
    if op == "gated_rms_norm":
        # Head-dim rows are Qwen3-Next's norm-then-gate; wide rows Mamba-2's gate-then-norm in 8 groups.
        if width <= 256:
            hf, kwargs = Qwen3NextRMSNormGated(width), {}
        else:
            hf, kwargs = MambaRMSNormGated(width, group_size=width // 8), {"order": "gate_then_norm",
                                                                           "group_size": width // 8}
        hf = hf.to(device=device, dtype=dtype)
        weight, gate = hf.weight.detach(), randn(tokens, width)
        weight.copy_(randn(width))
        args = (x, gate, weight, 1e-6, kwargs.get("order", "norm_then_gate"), kwargs.get("group_size"), "llama", "silu")
        return Workload(op, tokens, width, dtype, (3 * tokens + 1) * width * size,
                        lambda: ops.gated_rms_norm(x, gate, weight, 1e-6, **kwargs), {"hf_eager": hf}, (x, gate), args)
    hf = (nn.LayerNorm(width) if op == "layer_norm" else HFAddRMSNorm(width, nn.LayerNorm)).to(device=device, dtype=dtype)
    norm = hf if op == "layer_norm" else hf.norm
    weight, bias = norm.weight.detach(), norm.bias.detach()
    weight.copy_(randn(width))
    bias.copy_(randn(width))
    if op == "layer_norm":
        return Workload(op, tokens, width, dtype, (2 * tokens + 2) * width * size,
                        lambda: ops.layer_norm(x, weight, bias), {"hf_eager": hf}, (x,), (x, weight, bias, 1e-5, "fp32"))
    residual = randn(tokens, width)
    if op == "fused_add_layer_norm_":  # the serving form: results written over x and residual
        mine_x, mine_residual = x.clone(), residual.clone()
        ours = lambda: ops.fused_add_layer_norm(mine_x, mine_residual, weight, bias, inplace=True)  # noqa: E731
    else:
        ours = lambda: ops.fused_add_layer_norm(x, residual, weight, bias)  # noqa: E731
    return Workload(op, tokens, width, dtype, (4 * tokens + 2) * width * size, ours, {"hf_eager": hf},
                    (x, residual), (x, residual, weight, bias, 1e-5, "fp32"))


def _liger(workload: Workload) -> Callable[[], Any] | None:
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except Exception:
        return None
    x = workload.inputs[0]
    if workload.op == "rms_norm":
        norm = LigerRMSNorm(workload.width, eps=1e-6).to(device=x.device, dtype=x.dtype)
        return lambda: norm(x)
    if workload.op == "silu_and_mul":
        gate, up = x.chunk(2, dim=-1)
        gate, up = gate.contiguous(), up.contiguous()
        return lambda: LigerSiLUMulFunction.apply(gate, up)
    return None


PROVIDERS = ("hw_agnostic", "hf_eager", "hf_compile", "copy")


def _label(op: str, tokens: int, width: int, dtype: torch.dtype) -> str:
    return f"{op} {tokens}x{width} {str(dtype).removeprefix('torch.')}"


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    """How many rows :func:`run` yields (Liger rows aside)."""
    return len(PROVIDERS) * sum(only(_label(*item)) for item in _grid(device, quick))


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    """Yield one long-format row per (op, shape, dtype, provider)."""
    compiled: dict[tuple[str, int, torch.dtype], nn.Module] = {}
    grid = [item for item in _grid(device, quick) if only(_label(*item))]
    for index, (op, tokens, width, dtype) in enumerate(grid, 1):
        workload = _workload(op, tokens, width, dtype, device)
        log(f"[{index}/{len(grid)}] {_label(op, tokens, width, dtype)}")
        with torch.inference_mode():
            plan = ops.get_op(op).plan(*workload.args)
            candidates: dict[str, Callable[[], Any]] = {"hw_agnostic": workload.ours}
            hf = workload.baselines["hf_eager"]
            candidates["hf_eager"] = lambda hf=hf: hf(*workload.inputs)
            # One compiled module per op, width and dtype: dynamo recompiles once for the token count.
            module = compiled.setdefault((op, width, dtype), torch.compile(hf, dynamic=None))
            candidates["hf_compile"] = lambda module=module: module(*workload.inputs)
            liger = _liger(workload) if device.type == "cuda" else None
            if liger is not None:
                candidates["liger"] = liger
            candidates["copy"] = workload.same_size_copy()
            for provider, timing in measure_all(candidates, device).items():
                yield {
                    "suite": "ops", "op": op, "shape": f"{tokens}x{width}", "tokens": tokens, "width": width,
                    "dtype": str(dtype).removeprefix("torch."), "provider": provider,
                    "ran": plan.provider if provider == "hw_agnostic" else provider,
                    "config_source": plan.config.describe() if provider == "hw_agnostic" and plan.config else "",
                    **timing, "bytes": workload.bytes_moved,
                    "gbps": workload.bytes_moved / (timing["time_us"] * 1e-6) / 1e9,
                }
