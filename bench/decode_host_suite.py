"""Decode-host rows: what one decode step of a Llama-3-8B-shaped model costs the host, on any machine.

A decode step at batch 1 is host-bound on a GPU: the device finishes each kernel before the
host has issued the next. This suite measures the host side without a GPU. Our kernels run in
compile-for-target mode with ``compile=False, run_reference=False`` (:mod:`hw_agnostic.kernels.targets`):
each DSL launch goes through its op's dispatch and Helion's generated host code up to the
launcher, which only counts it. What a row's time holds is therefore the Python and the
PyTorch dispatch of a step, ours beside Hugging Face eager with SDPA.

*A launch* is a device kernel launch, counted the same way on both sides: every ATen op the step
dispatches that would launch a GPU kernel (all but views, allocations and metadata queries,
seen through a ``TorchDispatchMode``), plus every DSL kernel launch (the launch counter). Host
syncs (``.item()``, ``.tolist()``) are counted apart.

The model: Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128), bf16, one
sequence, a context of 16 tokens. The residual stream and MLP are narrowed (hidden 64, MLP
224) so that the ATen ops the step does run on the CPU (projections, rotary, and on HF's side
its norms, SDPA and cache concatenation) compute next to nothing; the launches and the host
code do not depend on those widths. Each provider is built at two depths; the per-layer cost
is the slope between them and the per-step cost at 32 layers is read off that line (the
intercept is the model's own per-step work: embedding, masks, final norm, LM head). The line
goes through each depth's fastest sample (other load on a shared machine only adds to a
sample), with one intra-op thread (a decode step's host work is one thread's). Each provider is
measured under ``no_grad`` (what ``generate()`` steps under) and under ``inference_mode`` (pipelines,
serving engines), one row each (see :data:`MODES`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hw_agnostic.kernels import targets

from .rewired import rewired
from .timing import Timing

LLAMA3_8B_ATTENTION = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=16, rope_theta=500000.0,
                           max_position_embeddings=4096)
NARROW = dict(hidden_size=64, intermediate_size=224, vocab_size=256)
DEPTHS = (2, 6)
REPORTED_LAYERS = 32
CONTEXT = 16
STEPS_PER_SAMPLE = 8
#: Launches are counted in the model's dtype; steps are timed in fp32, whose CPU matmuls and SDPA
#: at these widths take a microsecond or two (bf16's take 20-100). fp32 drops the casts bf16
#: needs around HF's norms and rotary (ours cast inside the kernels), so HF's time is the lower.
COUNTED_DTYPE, TIMED_DTYPE = torch.bfloat16, torch.float32
TARGET = "sm_90"
PROVIDERS = ("hw_agnostic", "hf_eager")
OP = "decode host Llama-3-8B b1"


def _config(layers: int) -> Any:
    config = AutoConfig.for_model("llama", num_hidden_layers=layers, **LLAMA3_8B_ATTENTION, **NARROW)
    config._attn_implementation = "sdpa"
    return config


def build(provider: str, layers: int, dtype: torch.dtype = torch.bfloat16,
          log: Callable[[str], None] = print) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(layers), dtype=dtype).eval()
    if provider == "hw_agnostic":
        rewired(model, log, "decode host")
    return model


#: ATen ops that launch no kernel although their schema does not say they alias an input
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view",
                       "_reshape_alias", "resize_", "set_", "sym_size", "sym_stride", "sym_numel",
                       "sym_storage_offset", "is_same_size", "is_nonzero", "size", "stride", "dim"})
SYNCS = frozenset({"_local_scalar_dense", "item"})


def launches_kernel(func: Any) -> bool:
    """Whether ATen op ``func`` launches a device kernel (a view, allocation or metadata query does not)."""
    name = func._schema.name.split("::")[-1]
    if name in NO_KERNEL or name in SYNCS:
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


class LaunchCount(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it that would launch a device kernel, and the host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: Counter[str] = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func._schema.name.split("::")[-1] in SYNCS:
            self.syncs += 1
        elif func.namespace == "aten" and launches_kernel(func):
            self.aten[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


class Decoding:
    """One provider at one depth: a prefilled cache and a decode step, cropped back between samples."""

    def __init__(self, provider: str, layers: int, dtype: torch.dtype, log: Callable[[str], None] = print) -> None:
        self.provider, self.layers = provider, layers
        self.model = build(provider, layers, dtype, log)
        generator = torch.Generator().manual_seed(1)
        vocab = NARROW["vocab_size"]
        self.context = torch.randint(0, vocab, (1, CONTEXT - 1), generator=generator)
        self.token = torch.randint(0, vocab, (1, 1), generator=generator)
        self.cache = DynamicCache(config=self.model.config)
        self.model(self.context, past_key_values=self.cache, use_cache=True)

    def step(self) -> None:
        self.model(self.token, past_key_values=self.cache, use_cache=True)

    def rewind(self, steps: int) -> None:
        self.cache.crop(-steps)

    def launches(self) -> tuple[int, int, int]:
        """ATen launches, DSL launches and host syncs of one step."""
        with targets.compile_for([TARGET], run_reference=False, compile=False) as counted, LaunchCount() as aten:
            self.step()
        self.rewind(1)
        return sum(aten.aten.values()), sum(counted.launches.values()), aten.syncs


def _samples(decodings: list[Decoding], min_time_s: float) -> dict[tuple[str, int], Timing]:
    """Interleaved rounds: each round times ``STEPS_PER_SAMPLE`` steps of every decoding (µs per step)."""
    samples: dict[tuple[str, int], list[float]] = {(d.provider, d.layers): [] for d in decodings}
    started, rounds = time.perf_counter(), 0
    while rounds < 7 or time.perf_counter() - started < min_time_s * len(decodings):
        for decoding in decodings:
            begin = time.perf_counter()
            for _ in range(STEPS_PER_SAMPLE):
                decoding.step()
            samples[(decoding.provider, decoding.layers)].append(
                (time.perf_counter() - begin) / STEPS_PER_SAMPLE * 1e6)
            decoding.rewind(STEPS_PER_SAMPLE)
        rounds += 1
    return {name: Timing(tuple(values), STEPS_PER_SAMPLE) for name, values in samples.items()}


def _line(low: float, high: float) -> tuple[float, float]:
    """(per layer, per step at ``REPORTED_LAYERS``) from the values at the two depths."""
    per_layer = (high - low) / (DEPTHS[1] - DEPTHS[0])
    return per_layer, low + per_layer * (REPORTED_LAYERS - DEPTHS[0])


#: The grad modes a step is measured under: ``generate()`` steps under ``no_grad``; pipelines and
#: serving engines under ``inference_mode``, whose tensors keep no version counter or view
#: tracking (cheaper views and in-place ops) and where the rewired layers run their last residual
#: add alone (a version counter is what lets a norm take the result the layer before computed).
MODES: dict[str, Callable[[], Any]] = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def measure(min_time_s: float, log: Callable[[str], None] = print,
            modes: tuple[str, ...] = tuple(MODES)) -> list[dict[str, Any]]:
    """Per grad mode, one row per provider: launches and host µs per layer and per 32-layer step
    (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A launch that only counts leaves its output as the allocator found it; where those bytes
    # read as subnormal floats, the CPU matmuls after it ran 5-8x slower (98 against 13 µs for
    # the qkv projection), which is arithmetic on garbage, not host time. HF's values are normal.
    torch.set_flush_denormal(True)
    try:
        return [row for mode in modes for row in _measure(min_time_s, log, mode)]
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _measure(min_time_s: float, log: Callable[[str], None], mode: str) -> list[dict[str, Any]]:
    rows = []
    grad_mode = MODES[mode]
    with torch.no_grad():  # rewire verifies on real kernels or the reference: outside inference_mode
        counted = [Decoding(provider, layers, COUNTED_DTYPE, log) for provider in PROVIDERS for layers in DEPTHS]
        timed = [Decoding(provider, layers, TIMED_DTYPE, log) for provider in PROVIDERS for layers in DEPTHS]
    with grad_mode(), targets.compile_for([TARGET], run_reference=False, compile=False):
        for decoding in counted + timed:  # warm-up: plans built, first-call work done
            for _ in range(3):
                decoding.step()
            decoding.rewind(3)
        counts = {(d.provider, d.layers): d.launches() for d in counted}
        timings = _samples(timed, min_time_s)
    for provider in PROVIDERS:
        low, high = (counts[(provider, depth)] for depth in DEPTHS)
        aten_layer, aten_step = _line(low[0], high[0])
        dsl_layer, dsl_step = _line(low[1], high[1])
        t_low, t_high = (timings[(provider, depth)] for depth in DEPTHS)
        us_layer, us_step = _line(t_low.min, t_high.min)
        # the 32-layer step's distribution, from the deeper model's samples scaled along the line
        scale = us_step / t_high.min
        scaled = Timing(tuple(s * scale for s in t_high.samples), t_high.calls_per_sample)
        log(f"decode host {mode} {provider}: {aten_layer + dsl_layer:.1f} launches/layer ({dsl_layer:.1f} DSL), "
            f"{us_layer:.1f} µs/layer, {us_step:.0f} µs per {REPORTED_LAYERS}-layer step, "
            f"{high[2]} host syncs/step")
        rows.append({
            "suite": "decode_host", "op": f"{OP} {mode}", "shape": f"{REPORTED_LAYERS}L ctx{CONTEXT}", "tokens": 1,
            "width": NARROW["hidden_size"], "dtype": "bfloat16",  # counted in bf16, timed in fp32
            "provider": provider, "ran": provider, "config_source": "", **scaled.columns(),
            "launches_per_layer": aten_layer + dsl_layer, "dsl_launches_per_layer": dsl_layer,
            "launches_per_step": aten_step + dsl_step, "host_us_per_layer": us_layer,
            "host_syncs_per_step": high[2],
            **{f"step_us_{depth}_layers": timings[(provider, depth)].min for depth in DEPTHS},
            "bytes": 0, "gbps": float("nan"),
        })
    return rows


def _modes(only: Callable[[str], bool]) -> tuple[str, ...]:
    return tuple(mode for mode in MODES if only(f"{OP} {mode}"))


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    return len(PROVIDERS) * len(_modes(only))


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    modes = _modes(only)
    if not modes:
        return
    if device.type != "cpu":
        log("decode host: measured on the CPU (launches are counted, not run), whatever --device says")
    log(f"{OP}: {', '.join(PROVIDERS)} at {DEPTHS[0]} and {DEPTHS[1]} layers, under {', '.join(modes)}")
    yield from measure(0.3 if quick else 2.0, log, modes)


if __name__ == "__main__":
    for row in measure(1.0):
        print({k: row[k] for k in ("op", "provider", "launches_per_layer", "host_us_per_layer", "time_us")})
