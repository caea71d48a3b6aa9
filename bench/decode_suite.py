"""Decode rows: a whole decode step of a Llama-3-8B-shaped model, eager and as one CUDA graph.

What a user of ``generate()`` waits for per token, at batch 1, 8 and 64 with 1k and 8k tokens of
context (``--quick``: batch 1 and 8 at 1k), on a GPU:

* ``decode bB ctxC``: the rewired model on its paged ``DynamicCache`` (``hw_agnostic``) against HF
  eager with SDPA on its ``DynamicCache`` (``hf_eager``), both run eagerly: at small batches the
  host's time per step (launches, Python) is what these rows show.
* ``decode graphed bB ctxC``: both models on a ``StaticCache``, the step compiled as
  ``generate()`` compiles it for static caches (``torch.compile(fullgraph=True, dynamic=False,
  mode="reduce-overhead")``: one CUDA graph a step): the rewired model on static pages
  (``hw_agnostic``) against HF's own graphed step (``hf_graphs``) and HF eager (``hf_eager``, the
  same measurement as in the eager row).

The model has Llama-3-8B's widths and vocabulary with :data:`LAYERS` decoder layers and random
weights, in bf16; ``tokens_per_s`` is the batch over the step's time. Each step is cropped back,
so every sample decodes at the same context. On a CPU the suite measures nothing: CUDA graphs
need a GPU, and the model suite's decode row is the CPU's eager step.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from .model_suite import _config, _linear_params
from .model_suite import _row as model_row
from .rewired import rewired
from .timing import matmul_tflops, measure_all

LAYERS = 4
BATCHES, CONTEXTS = (1, 8, 64), (1024, 8192)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (1024,)
#: the compile ``generate()`` applies to the decode step on a static cache (transformers' CompileConfig defaults)
GRAPHED = dict(fullgraph=True, dynamic=False, mode="reduce-overhead")


def grid(quick: bool) -> list[tuple[int, int]]:
    return [(b, c) for c in (QUICK_CONTEXTS if quick else CONTEXTS) for b in (QUICK_BATCHES if quick else BATCHES)]


def labels(batch: int, context: int) -> tuple[str, str]:
    return f"decode b{batch} ctx{context}", f"decode graphed b{batch} ctx{context}"


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    if device.type == "cpu":
        return 0
    return sum(2 * only(labels(b, c)[0]) + 3 * only(labels(b, c)[1]) for b, c in grid(quick))


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    if device.type == "cpu":
        log("decode suite: measures on a GPU only (CUDA graphs); the model suite's decode row is the CPU's")
        return
    yield from measure_decode(device, grid(quick), config=_config(device, layers=LAYERS), log=log, only=only,
                              dtype=torch.bfloat16, graphed=GRAPHED)


def build(device: torch.device, config: Any, dtype: torch.dtype,
          log: Callable[[str], None] = print) -> tuple[torch.nn.Module, torch.nn.Module]:
    """HF's model (SDPA) and its rewired copy."""
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours = copy.deepcopy(hf)
    rewired(ours, log, "decode suite")
    return hf, ours


def measure_decode(device: torch.device, shapes: list[tuple[int, int]], *, config: Any, log: Callable[[str], None],
                   only: Callable[[str], bool], dtype: torch.dtype,
                   graphed: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The rows of every (batch, context) in ``shapes`` for a model of ``config`` (see the module
    docstring); ``graphed`` is the ``torch.compile`` of the graphed rows."""
    hf, ours = build(device, config, dtype, log)
    compiled = {"hw_agnostic": torch.compile(ours, **graphed), "hf_graphs": torch.compile(hf, **graphed)}
    params = _linear_params(hf)
    ceiling = matmul_tflops(device, dtype=dtype)
    vocab = hf.config.vocab_size
    for batch, context in shapes:
        eager_label, graphed_label = labels(batch, context)
        if not (only(eager_label) or only(graphed_label)):
            continue
        generator = torch.Generator().manual_seed(batch * 100003 + context)
        prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
        token = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
        steps: dict[str, Callable[[], Any]] = {}
        with torch.inference_mode():
            for name, model in (("hf_eager", hf), ("hw_agnostic", ours)):
                steps[name] = _prefilled(model, model, DynamicCache(config=hf.config), prompt, token)
        if only(graphed_label):
            # under no_grad, as generate() steps: the graphed steps update the static caches in place,
            # which inference tensors (a prefill under inference_mode) allow only inside inference_mode
            with torch.no_grad():
                for name, model in (("hw_agnostic_graphed", ours), ("hf_graphs", hf)):
                    cache = StaticCache(config=hf.config, max_cache_len=context + 16)
                    steps[name] = _prefilled(model, compiled[name.removesuffix("_graphed")], cache, prompt, token,
                                             no_grad=True)
        log(f"decode b{batch} ctx{context}: {', '.join(steps)}")
        timings = measure_all(steps, device)
        row = functools.partial(_row, batch=batch, context=context, width=config.hidden_size, params=params,
                                dtype=dtype, ceiling=ceiling)
        if only(eager_label):
            yield row(eager_label, "hw_agnostic", timings["hw_agnostic"])
            yield row(eager_label, "hf_eager", timings["hf_eager"])
        if only(graphed_label):
            yield row(graphed_label, "hw_agnostic", timings["hw_agnostic_graphed"])
            yield row(graphed_label, "hf_graphs", timings["hf_graphs"])
            yield row(graphed_label, "hf_eager", timings["hf_eager"])
        del steps
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _prefilled(model: torch.nn.Module, stepping: Callable[..., Any], cache: Any, prompt: torch.Tensor,
               token: torch.Tensor, *, no_grad: bool = False) -> Callable[[], Any]:
    """A decode step of ``stepping`` after ``model`` prefilled ``cache`` with ``prompt`` (eagerly, as
    ``generate()`` prefills), cropped back after each call."""
    model(prompt, past_key_values=cache, use_cache=True)

    def step() -> Any:
        with torch.no_grad() if no_grad else torch.inference_mode():
            logits = stepping(token, past_key_values=cache, use_cache=True).logits
            cache.crop(-1)
        return logits

    return step


def _row(op: str, provider: str, timing: dict[str, Any], *, batch: int, context: int, width: int, params: int,
         dtype: torch.dtype, ceiling: float) -> dict[str, Any]:
    row = model_row(op, batch, provider, timing, params, dtype, ceiling, suite="decode",
                    shape=f"b{batch}xctx{context}", width=width)
    return {**row, "tokens_per_s": batch / (timing["time_us"] * 1e-6)}
