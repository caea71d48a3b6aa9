"""Model rows: a prefill and one decode step of a rewired model vs HF eager and ``torch.compile(HF)``.

The model has Llama-3-8B's widths (hidden 4096, intermediate 14336, 32 heads, 8 KV heads) and
2 decoder layers with random weights; on the CPU its vocabulary is cut to 32000 so the LM head
does not dominate. Prefill: 1 sequence of 512 tokens. Decode: one token for each of 8
sequences holding 128 tokens of context (the cache is cropped back after every step).
TFLOP/s count the linear layers' ``2 * params * tokens``; the ratio is to the same-run matmul rate.

A third row, ``small decode b1 ctx32``, is one sequence's decode step of the small model
``hw-agnostic demo`` builds (4 layers, hidden 256, 8 query and 4 KV heads of 32; 32 tokens of
context), against HF eager: where the host work of every call, not the arithmetic, is the step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hw_agnostic.demo import TINY

from .rewired import rewired
from .timing import matmul_tflops, measure_all

LLAMA3_8B_WIDTHS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        num_hidden_layers=2, max_position_embeddings=4096, rope_theta=500000.0)


def _config(device: torch.device, layers: int = LLAMA3_8B_WIDTHS["num_hidden_layers"]) -> Any:
    vocab = 128256 if device.type != "cpu" else 32000
    return AutoConfig.for_model("llama", vocab_size=vocab, **{**LLAMA3_8B_WIDTHS, "num_hidden_layers": layers})


def _linear_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


PROVIDERS = ("hw_agnostic", "hf_eager", "hf_compile")
STEPS = ("prefill 1x512", "decode b8 ctx128")
SMALL_STEP, SMALL_PROVIDERS, SMALL_CONTEXT = "small decode b1 ctx32", ("hw_agnostic", "hf_eager"), 32


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    return len(PROVIDERS) * sum(only(step) for step in STEPS) + len(SMALL_PROVIDERS) * only(SMALL_STEP)


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    if not (any(only(step) for step in STEPS) or only(SMALL_STEP)):
        return
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32  # CPU bf16 matmuls are slower than fp32
    ceiling = matmul_tflops(device, dtype=dtype)  # in the dtype the models run in
    min_time_s = 1.0 if not quick else 0.2
    if any(only(step) for step in STEPS):
        yield from _llama3_widths(device, dtype, ceiling, min_time_s, log, only)
    if only(SMALL_STEP):
        yield from _small_decode(device, dtype, ceiling, min_time_s, log)


def _llama3_widths(device: torch.device, dtype: torch.dtype, ceiling: float, min_time_s: float,
                   log: Callable[[str], None], only: Callable[[str], bool]) -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: ~0.9B random parameters take minutes on the host
        hf = AutoModelForCausalLM.from_config(_config(device), dtype=dtype).eval()
    ours = copy.deepcopy(hf)
    report = rewired(ours, log, "model suite")
    log(f"model suite: rewired {len(report.replaced)} modules, fused {len(report.fused)} layers")
    models = {"hw_agnostic": ours, "hf_eager": hf, "hf_compile": torch.compile(hf, dynamic=None)}
    params = _linear_params(hf)
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(0, vocab, (1, 512), generator=generator).to(device)
    context_ids = torch.randint(0, vocab, (8, 128), generator=generator).to(device)
    step_ids = torch.randint(0, vocab, (8, 1), generator=generator).to(device)

    with torch.inference_mode():
        if only(STEPS[0]):
            log(f"model {STEPS[0]}: {', '.join(models)}")
            prefills = {provider: functools.partial(_prefill, model, prefill_ids) for provider, model in models.items()}
            for provider, timing in measure_all(prefills, device, min_time_s=min_time_s).items():
                yield _row(STEPS[0], 512, provider, timing, params, dtype, ceiling)
        if only(STEPS[1]):
            log(f"model {STEPS[1]}: {', '.join(models)}")
            decodes = _decode_steps(models, context_ids, step_ids)
            for provider, timing in measure_all(decodes, device, min_time_s=min_time_s).items():
                yield _row(STEPS[1], 8, provider, timing, params, dtype, ceiling)


def _small_decode(device: torch.device, dtype: torch.dtype, ceiling: float, min_time_s: float,
                  log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), dtype=dtype).eval()
    ours = copy.deepcopy(hf)
    rewired(ours, log, "model suite (small)")
    generator = torch.Generator().manual_seed(2)
    context_ids = torch.randint(0, TINY["vocab_size"], (1, SMALL_CONTEXT), generator=generator).to(device)
    step_ids = torch.randint(0, TINY["vocab_size"], (1, 1), generator=generator).to(device)
    log(f"model {SMALL_STEP}: {', '.join(SMALL_PROVIDERS)}")
    with torch.inference_mode():
        decodes = _decode_steps(dict(zip(SMALL_PROVIDERS, (ours, hf))), context_ids, step_ids)
        timings = measure_all(decodes, device, min_time_s=min_time_s)
    for provider, timing in timings.items():
        yield _row(SMALL_STEP, 1, provider, timing, _linear_params(hf), dtype, ceiling, width=TINY["hidden_size"])


def _decode_steps(models: dict[str, Any], context_ids: torch.Tensor,
                  step_ids: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Per provider, one decode step of ``step_ids`` on its own cache, prefilled with ``context_ids``."""
    decodes = {}
    for provider, model in models.items():
        cache = DynamicCache(config=model.config)
        model(context_ids, past_key_values=cache, use_cache=True)
        decodes[provider] = functools.partial(_decode_step, model, step_ids, cache)
    return decodes


def _prefill(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def _decode_step(model: Any, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    out = model(ids, past_key_values=cache, use_cache=True).logits
    cache.crop(-1)  # back to the context tokens
    return out


def _row(op: str, tokens: int, provider: str, timing: dict[str, float], params: int, dtype: torch.dtype,
         ceiling: float, *, suite: str = "model", shape: str | None = None,
         width: int = LLAMA3_8B_WIDTHS["hidden_size"]) -> dict:
    """A whole-model step's row (the decode suite's too): TFLOP/s of its linear layers."""
    return {
        "suite": suite, "op": op, "shape": shape or op.split()[-1], "tokens": tokens, "width": width,
        "dtype": str(dtype).removeprefix("torch."), "provider": provider, "ran": provider, "config_source": "",
        **timing, "bytes": 0, "gbps": float("nan"),
        "tflops": 2 * params * tokens / (timing["time_us"] * 1e-6) / 1e12, "matmul_tflops": ceiling,
    }
