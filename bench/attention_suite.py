"""Attention rows: ``paged_attention`` (and the cache write) against attention on contiguous K/V.

Decode (``op = "paged_attention decode"``): ``batch`` sequences of ``context`` keys each, one new
query per sequence; ``tokens`` is the batch and ``width`` the context. The op reads each
sequence's pages through a shuffled block table; the CPU's ``paged_attention decode in-order`` rows
through one whose blocks are each sequence's in order (the layout a rewired model's paged
``DynamicCache`` keeps, which the CPU path reads in place instead of gathering). Baselines: PyTorch SDPA on contiguous
``[B, Hkv, context, D]`` K/V (``torch_sdpa``, GQA without repeating K/V), and on GPUs FlashAttention's
paged ``flash_attn_with_kvcache`` and FlashInfer's paged decode when installed. Bytes are the K/V
read plus q and the output; ``bw_fraction`` divides by the same run's copy bandwidth. A baseline
that cannot run a shape (FlashAttention-2's paged path wants 256-token blocks) gets a row with
no time and the error.

Uneven decode (``op = "paged_attention decode uneven"``): as decode, but the sequences hold different
numbers of keys, spread evenly from half the context to all of it (continuous batching's steps);
``width`` is the longest. Baseline: SDPA over K/V padded to the longest with a mask (what a padded
batch costs it).

Decode step (``op = "paged_attention decode step"``): what one decode step's attention costs with its
cache update, on each side: the new token's K/V written into the pages and the op (``hw_agnostic``)
against what Hugging Face's eager attention does with a ``DynamicCache``, ``torch.cat`` of the new
K/V onto the cached ones (a fresh copy of the whole cache every step) and SDPA (``hf_eager``).

Prefill (``op = "paged_attention prefill"``): ``width`` fresh prompts of ``tokens`` tokens each,
causal, as one varlen batch. Baselines: SDPA with ``is_causal`` on ``[S, H, L, D]`` (the flash
backend on GPUs) and FlashAttention's varlen function when installed. FLOPs count the causal
half, ``2 * 2 * S * Hq * D * L * (L + 1) / 2``; ``matmul_fraction`` divides TFLOP/s by the same
run's bf16 matmul rate.

Mixed (``op = "paged_attention mixed"``, GPUs): one prompt of ``tokens`` tokens beside ``width``
decode steps over ``MIXED_CONTEXT`` keys each, as one batch (continuous batching's step). Baseline
``hw_agnostic_apart``: the same two parts as two calls (the prompt alone, the decode steps alone);
at about 1.0x the mixed call launches the work its sequences need, not the prompt's blocks for
every decode step.

``write_kv_cache`` rows (``op = "write_kv_cache"``) time a decode step's and a prefill's cache write.

Shapes follow Llama-3-8B (32 query heads, 8 KV heads, head dim 128, block size 16). The CPU (where
the op runs its PyTorch reference) gets a small grid; its rows say how far the reference is
from SDPA, not what the kernels do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hw_agnostic.ops.paged_attention import paged_attention, paged_attention_op
from hw_agnostic.ops.write_kv_cache import write_kv_cache, write_kv_cache_op

from .timing import measure_all, timed_row

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_CACHE_BYTES = 24 << 30  # per K or V cache: keeps the largest GPU rows (and SDPA's copy) in memory
MIXED_CONTEXT = 2048  # keys of each decode step beside a mixed row's prompt


def _grid(device: torch.device, quick: bool) -> list[tuple[str, int, int]]:
    mixed: list[tuple[int, int]] = []  # (decode steps, prompt tokens)
    in_order: list[tuple[int, int]] = []  # decode over each sequence's blocks in order (the CPU reads them in place)
    if device.type == "cpu":
        decode = [(b, c) for b in (1, 8) for c in ((512,) if quick else (512, 2048))]
        in_order = decode
        prefill = [(1, 256)] if quick else [(1, 512), (2, 256)]
    elif quick:
        decode = [(b, c) for b in (1, 64) for c in (2048, 8192)]
        prefill = [(1, 2048), (4, 2048)]
        mixed = [(63, 512)]
    else:
        decode = [(b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 8192, 32768)]
        prefill = [(s, t) for s in (1, 4, 8) for t in (512, 2048, 8192)]
        mixed = [(d, t) for d in (15, 63, 255) for t in (512, 2048)]
    uneven = [(16, 512)] if device.type == "cpu" else [(64, 2048)] if quick else [(64, 2048), (256, 8192)]
    steps = [(1, 512), (8, 2048)] if device.type == "cpu" else [(1, 8192)] if quick else [(1, 8192), (64, 2048)]
    return ([("decode", b, c) for b, c in decode] + [("decode in-order", b, c) for b, c in in_order]
            + [("decode uneven", b, c) for b, c in uneven] + [("decode step", b, c) for b, c in steps]
            + [("prefill", s, t) for s, t in prefill] + [("mixed", d, t) for d, t in mixed])


def _paged_cache(seqs: int, context: int, dtype: torch.dtype, device: torch.device,
                 in_order: bool = False) -> tuple[torch.Tensor, ...]:
    """K/V caches and a block table: blocks shuffled over the cache, or each sequence's in order
    one after the other (a rewired model's paged ``DynamicCache`` lays them out so)."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    shape = (seqs * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    order = (torch.arange if in_order else torch.randperm)(seqs * blocks_per_seq, device=device)
    table = order.view(seqs, blocks_per_seq).to(torch.int32)
    return k_cache, v_cache, table


def _flash_attn() -> Any:
    try:
        import flash_attn
    except Exception:
        return None
    return flash_attn


def _flashinfer() -> Any:
    try:
        import flashinfer
    except Exception:
        return None
    return flashinfer


def _decode(batch: int, context: int, dtype: torch.dtype, device: torch.device,
            in_order: bool = False, uneven: bool = False) -> tuple[dict, dict, tuple]:
    k_cache, v_cache, table = _paged_cache(batch, context, dtype, device, in_order)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    if uneven:  # from half the context to all of it
        lens = torch.linspace(context // 2, context, batch, device=device).round().to(torch.int32)
    args = (q, k_cache, v_cache, table, cu, lens, HEAD_DIM**-0.5, None, None, None, 1, context)
    candidates: dict[str, Callable[[], Any]] = {
        "hw_agnostic": lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=1, max_kv_len=context),
    }
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q4 = q[:, :, None]
    mask = (torch.arange(context, device=device) < lens[:, None])[:, None, None] if uneven else None
    candidates["torch_sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, attn_mask=mask,
                                                                                      enable_gqa=True)
    if device.type == "cuda":
        flash = _flash_attn()
        if flash is not None:
            qf = q[:, None]
            candidates["flash_attn"] = lambda: flash.flash_attn_with_kvcache(
                qf, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True)
        infer = _flashinfer()
        if infer is not None and not uneven:  # its decode helper here plans one length for all
            try:
                candidates["flashinfer"] = _flashinfer_decode(infer, q, k_cache, v_cache, table, context)
            except Exception:  # an API this version does not have: no FlashInfer row
                pass
    keys = int(lens.sum())
    moved = 2 * keys * KV_HEADS * HEAD_DIM * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return candidates, {"bytes": moved, "flops": 4 * Q_HEADS * HEAD_DIM * keys}, args


def _decode_step(batch: int, context: int, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict, tuple]:
    """The last of ``context`` keys written and attended to, on the paged side and on HF eager's."""
    k_cache, v_cache, table = _paged_cache(batch, context, dtype, device, in_order=True)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    key, value = (torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    last = (context - 1) // BLOCK_SIZE
    slots = (table[:, last].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE)  # each sequence's last position
    args = (q, k_cache, v_cache, table, cu, lens, HEAD_DIM**-0.5, None, None, None, 1, context)

    def ours() -> torch.Tensor:
        write_kv_cache(key, value, k_cache, v_cache, slots)
        return paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=1, max_kv_len=context)

    # the same cached keys, as a DynamicCache holds them: [B, Hkv, context - 1, D]
    past_k, past_v = (cache.view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context - 1].transpose(1, 2).contiguous()
                      for cache in (k_cache, v_cache))
    q4, new_k, new_v = q[:, :, None], key[:, :, None], value[:, :, None]

    def hf_eager() -> torch.Tensor:  # DynamicCache.update, then the SDPA attention function
        k, v = torch.cat([past_k, new_k], dim=-2), torch.cat([past_v, new_v], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    moved = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return ({"hw_agnostic": ours, "hf_eager": hf_eager},
            {"bytes": moved, "flops": 4 * batch * Q_HEADS * HEAD_DIM * context}, args)


def _flashinfer_decode(infer: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       table: torch.Tensor, context: int) -> Callable[[], Any]:
    batch = q.shape[0]
    blocks = table.shape[1]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = infer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * blocks
    last = torch.full((batch,), context - (blocks - 1) * BLOCK_SIZE, device=q.device, dtype=torch.int32)
    wrapper.plan(indptr, table.reshape(-1), last, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, q_data_type=q.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def _prefill(seqs: int, length: int, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict, tuple]:
    k_cache, v_cache, table = _paged_cache(seqs, length, dtype, device)
    q = torch.randn(seqs * length, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * length
    lens = torch.full((seqs,), length, device=device, dtype=torch.int32)
    args = (q, k_cache, v_cache, table, cu, lens, HEAD_DIM**-0.5, None, None, None, length, length)
    candidates: dict[str, Callable[[], Any]] = {
        "hw_agnostic": lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=length,
                                               max_kv_len=length),
    }
    q4 = q.view(seqs, length, Q_HEADS, HEAD_DIM).transpose(1, 2)
    k = torch.randn(seqs, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    candidates["torch_sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k, v, is_causal=True, enable_gqa=True)
    if device.type == "cuda":
        flash = _flash_attn()
        if flash is not None:
            kf = k.transpose(1, 2).reshape(seqs * length, KV_HEADS, HEAD_DIM)
            vf = v.transpose(1, 2).reshape(seqs * length, KV_HEADS, HEAD_DIM)
            candidates["flash_attn"] = lambda: flash.flash_attn_varlen_func(
                q, kf, vf, cu, cu, length, length, causal=True)
    flops = 2 * 2 * seqs * Q_HEADS * HEAD_DIM * length * (length + 1) / 2
    moved = 3 * q.numel() * q.element_size() + 2 * k.numel() * k.element_size()
    return candidates, {"bytes": moved, "flops": flops}, args


def _mixed(decodes: int, prompt: int, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict, tuple]:
    longest = max(prompt, MIXED_CONTEXT)
    k_cache, v_cache, table = _paged_cache(decodes + 1, longest, dtype, device)
    q = torch.randn(prompt + decodes, Q_HEADS, HEAD_DIM, device=device, dtype=dtype)
    q_lens, kv_lens = [prompt] + [1] * decodes, [prompt] + [MIXED_CONTEXT] * decodes
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    lens = torch.tensor(kv_lens, device=device, dtype=torch.int32)
    args = (q, k_cache, v_cache, table, cu, lens, HEAD_DIM**-0.5, None, None, None, prompt, longest)
    # the parts: the prompt's queries and the decode steps', each with its sequences' metadata
    prompt_cu = torch.tensor([0, prompt], device=device, dtype=torch.int32)
    decode_cu = torch.arange(decodes + 1, device=device, dtype=torch.int32)
    q_prompt, q_decode = q[:prompt], q[prompt:]

    def apart() -> tuple[torch.Tensor, torch.Tensor]:
        return (paged_attention(q_prompt, k_cache, v_cache, table[:1], prompt_cu, lens[:1], max_q_len=prompt,
                                max_kv_len=prompt),
                paged_attention(q_decode, k_cache, v_cache, table[1:], decode_cu, lens[1:], max_q_len=1,
                                max_kv_len=MIXED_CONTEXT))

    candidates: dict[str, Callable[[], Any]] = {
        "hw_agnostic": lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, max_q_len=prompt,
                                               max_kv_len=longest),
        "hw_agnostic_apart": apart,
    }
    element = q.element_size()
    keys = prompt + decodes * MIXED_CONTEXT
    moved = 2 * q.numel() * element + 2 * keys * KV_HEADS * HEAD_DIM * element
    flops = 2 * 2 * Q_HEADS * HEAD_DIM * (prompt * (prompt + 1) / 2 + decodes * MIXED_CONTEXT)
    return candidates, {"bytes": moved, "flops": flops}, args


def _write(tokens: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], int, tuple]:
    blocks = -(-tokens // BLOCK_SIZE) + 1
    k_cache = torch.zeros(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(blocks * BLOCK_SIZE, device=device)[:tokens]
    args = (key, value, k_cache, v_cache, slots)
    return lambda: write_kv_cache(*args), 4 * key.numel() * key.element_size(), args


def _label(kind: str, count: int, length: int) -> str:
    return f"paged_attention {kind} {count}x{length}"


def _write_tokens(device: torch.device) -> tuple[int, ...]:
    return (1, 512) if device.type == "cpu" else (1, 64, 8192)


def count(device: torch.device, quick: bool, only: Callable[[str], bool] = lambda label: True) -> int:
    providers = 2 if device.type == "cpu" else 4  # hw_agnostic and SDPA; FlashAttention, FlashInfer on GPUs
    attention = sum((2 if item[0] in ("mixed", "decode step") else providers) * only(_label(*item))
                    for item in _grid(device, quick))
    return attention + sum(only(f"write_kv_cache {t}") for t in _write_tokens(device))


def run(device: torch.device, *, quick: bool, log: Callable[[str], None],
        only: Callable[[str], bool] = lambda label: True) -> Iterator[dict[str, Any]]:
    """Yield one long-format row per (op, shape, dtype, provider)."""
    dtype = torch.bfloat16
    grid = [item for item in _grid(device, quick) if only(_label(*item))]
    element = torch.finfo(dtype).bits // 8
    for index, (kind, count, length) in enumerate(grid, 1):
        cache_bytes = count * length * KV_HEADS * HEAD_DIM * element  # per K or V cache
        if cache_bytes > MAX_CACHE_BYTES:
            log(f"[{index}/{len(grid)}] skip {kind} {count}x{length}: {cache_bytes / 2**30:.0f} GiB per cache")
            continue
        names = {"decode": ("batch", "context"), "decode in-order": ("batch", "context"),
                 "decode uneven": ("batch", "context"), "decode step": ("batch", "context"),
                 "prefill": ("seqs", "tokens"),
                 "mixed": ("decodes", "prompt")}[kind]
        log(f"[{index}/{len(grid)}] {_label(kind, count, length)} ({names[0]}={count} {names[1]}={length})")
        with torch.inference_mode():
            build = {"decode": _decode, "decode in-order": functools.partial(_decode, in_order=True),
                     "decode uneven": functools.partial(_decode, uneven=True), "decode step": _decode_step,
                     "prefill": _prefill,
                     "mixed": _mixed}[kind]
            candidates, work, args = build(count, length, dtype, device)
            plan = paged_attention_op.plan(*args)
            tokens, width = (count, length) if kind.startswith("decode") else (length, count)
            for provider, timing in measure_all(candidates, device).items():
                ours = provider == "hw_agnostic"
                us = timing["time_us"]
                yield {
                    "suite": "attention", "op": f"paged_attention {kind}", "shape": f"{count}x{length}",
                    "tokens": tokens, "width": width, "dtype": str(dtype).removeprefix("torch."),
                    "provider": provider, "ran": plan.provider if ours else provider,
                    "config_source": plan.config.describe() if ours and plan.config else "",
                    "config": str(plan.config.config) if ours and plan.config else "",
                    **timing, "bytes": work["bytes"], "gbps": work["bytes"] / (us * 1e-6) / 1e9,
                    "flops": work["flops"], "tflops": work["flops"] / (us * 1e-6) / 1e12,
                }
    for tokens in _write_tokens(device):
        if not only(f"write_kv_cache {tokens}"):
            continue
        fn, moved, args = _write(tokens, dtype, device)
        plan = write_kv_cache_op.plan(*args)
        log(f"write_kv_cache {tokens} tokens")
        with torch.inference_mode():
            timing = timed_row(fn, device)
        us = timing["time_us"]
        yield {
            "suite": "attention", "op": "write_kv_cache", "shape": f"{tokens}x{KV_HEADS * HEAD_DIM}",
            "tokens": tokens, "width": KV_HEADS * HEAD_DIM, "dtype": str(dtype).removeprefix("torch."),
            "provider": "hw_agnostic", "ran": plan.provider,
            "config_source": plan.config.describe() if plan.config else "", **timing,
            "bytes": moved, "gbps": moved / (us * 1e-6) / 1e9,
        }
