"""``moe_align``: ``topk_ids`` -> the token/expert pairs sorted by expert, block-padded.

Each expert's segment is padded to a multiple of ``block_m``: ``sorted_pairs``,
``block_experts`` (the expert of each ``block_m`` rows) and ``expert_offsets``. Sized by upper
bounds computable from shapes, so nothing waits for the device. Pairs whose expert id is outside
``[0, E)`` (expert-parallel sentinels) go to one extra segment. :class:`Aligner` (the alignment
kernels compiled for one key) also serves :mod:`.fused_experts`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..autotune.shapes import moe_model
from ..kernels import moe_align as kernels
from ..kernels.launch_binding import bindable, bound_copy
from ..kernels.runtime import next_power_of_2
from . import checks
from .moe_common import MAX_KERNEL_EXPERTS, example_routing, helion_provider
from .registry import Op

INDEX_DTYPES = (torch.int32, torch.int64)
#: The most rows per GEMM block the alignment pads to.
MAX_BLOCK_M = 256


# --------------------------------------------------------------------------------------------
# the spec


def moe_align_reference(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pairs sorted by expert (stable), each segment padded with ``P`` to a multiple of ``block_m``.

    Bucket ``E`` collects pairs whose id is outside ``[0, E)``. Results (int32):
    ``sorted_pairs [S]``, ``block_experts [S // block_m]`` (bucket of each block, -1 past the
    last segment) and ``expert_offsets [E + 2]`` (segment ``e`` is
    ``sorted_pairs[offsets[e]:offsets[e + 1]]``), with ``S = max_slots(P, E, block_m)``.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    buckets = num_experts + 1
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(buckets, dtype=torch.int64, device=device).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, dim=0)
    order = torch.argsort(bucket, stable=True)
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, dim=0) - counts)[bucket[order]]
    slots = kernels.max_slots(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, (ends - padded)[bucket[order]] + rank, order)
    block_start = torch.arange(slots // block_m, device=device) * block_m
    owner = (ends[None, :] <= block_start[:, None]).sum(dim=1)
    block_experts = torch.where(owner < buckets, owner, -1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends])
    return sorted_pairs.to(torch.int32), block_experts.to(torch.int32), offsets.to(torch.int32)


# --------------------------------------------------------------------------------------------
# checks


def check_moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> None:
    op = "moe_align"
    checks.matrix(op, "topk_ids", topk_ids, dtypes=INDEX_DTYPES)
    checks.integer(op, "num_experts", num_experts, minimum=1)
    _check_block_m(op, block_m)


def _check_block_m(op: str, block_m: object) -> None:
    checks.integer(op, "block_m", block_m, minimum=1, maximum=MAX_BLOCK_M)
    if block_m & (block_m - 1):
        raise ValueError(f"{op}: block_m must be a power of two, got {block_m}")


# --------------------------------------------------------------------------------------------
# keys


class AlignKey(NamedTuple):
    device: str
    ids_dtype: torch.dtype
    experts: int
    top_k: int
    block_m: int
    tokens: int
    int64: bool


def moe_align_key(topk_ids: Tensor, num_experts: int, block_m: int) -> AlignKey:
    slots = kernels.max_slots(topk_ids.numel(), num_experts, block_m)
    return AlignKey(topk_ids.device.type, topk_ids.dtype, num_experts, topk_ids.shape[1], block_m,
                    token_bucket(topk_ids.shape[0]), slots > checks.INT32_MAX or checks.needs_int64(topk_ids))


# --------------------------------------------------------------------------------------------
# the alignment kernels, compiled for one key


def _pair_blocks(tokens_bucket: int, top_k: int, cap: int) -> int:
    """Pairs per program of the alignment kernels.

    Either one block holds every pair of the token bucket, or every call of the bucket has at
    least two blocks: Helion specialises size-1 dimensions, and a plan's kernels are compiled
    once for all calls of its bucket.
    """
    bucket = max(tokens_bucket, 1)
    if next_power_of_2(bucket * top_k) <= cap:
        return next_power_of_2(bucket * top_k)
    if bucket == 1:
        return cap  # one token: the pair count is fixed
    fewest = (bucket // 2 + 1) * top_k  # the fewest pairs of a call in this bucket
    return 1 << (min(cap, fewest - 1).bit_length() - 1)


class Aligner:
    """The three alignment kernels, compiled for one key (also run by fused_experts)."""

    def __init__(self, config: dict, num_experts: int, top_k: int, tokens_bucket: int, block_m: int,
                 example_ids: Tensor, int64: bool) -> None:
        self.num_experts, self.block_m = num_experts, block_m
        self.block_p = _pair_blocks(tokens_bucket, top_k, int(config.get("block_pairs", 64)))
        self.block_buckets = next_power_of_2(num_experts + 1)
        ids, counts, offsets, sorted_pairs, block_experts = self.buffers(example_ids.reshape(-1))
        self.count = kernels.count_pairs_kernel.compile(config["count"], (ids, counts, self.block_p), int64=int64)
        self.offsets = kernels.segment_offsets_kernel.compile(
            config["offsets"], (counts, torch.empty_like(counts), offsets, block_experts, block_m, self.block_buckets),
            int64=int64)
        self.scatter = kernels.scatter_pairs_kernel.compile(
            config["scatter"], (ids, counts, offsets, sorted_pairs, self.block_p), int64=int64)

    def buffers(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        pairs = ids.numel()
        slots = kernels.max_slots(pairs, self.num_experts, self.block_m)
        device = ids.device
        counts = torch.empty((-(-pairs // self.block_p), self.num_experts + 1), dtype=torch.int32, device=device)
        offsets = torch.zeros(self.num_experts + 2, dtype=torch.int32, device=device)
        sorted_pairs = torch.full((slots,), pairs, dtype=torch.int32, device=device)
        block_experts = torch.empty(slots // self.block_m, dtype=torch.int32, device=device)
        return ids, counts, offsets, sorted_pairs, block_experts

    def bound(self) -> Aligner:
        """This aligner for the calls of one signature (see :mod:`..kernels.launch_binding`)."""
        return bound_copy(self, "count", "offsets", "scatter")

    def __call__(self, topk_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ids, counts, offsets, sorted_pairs, block_experts = self.buffers(topk_ids.reshape(-1))
        if ids.numel():
            block_base = torch.empty_like(counts)
            self.count(ids, counts, self.block_p)
            self.offsets(counts, block_base, offsets, block_experts, self.block_m, self.block_buckets)
            self.scatter(ids, block_base, offsets, sorted_pairs, self.block_p)
        return sorted_pairs, block_experts, offsets


# --------------------------------------------------------------------------------------------
# the Helion provider


def _align_accepts(key: AlignKey) -> str | None:
    if key.experts > MAX_KERNEL_EXPERTS:
        return f"{key.experts} experts exceed the alignment kernel's {MAX_KERNEL_EXPERTS}"
    return None


def _align_tuning_key(key: AlignKey) -> dict[str, object]:
    return {"experts": key.experts, "top_k": key.top_k, "block_m": key.block_m}


def _build_align(key: AlignKey, config: dict, args: tuple) -> object:
    if key.tokens == 0:
        return lambda topk_ids, num_experts, block_m: moe_align_reference(topk_ids, num_experts, block_m)
    aligner = Aligner(config, key.experts, key.top_k, key.tokens, key.block_m, args[0], key.int64)

    def running(aligner: Aligner) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
        def run(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
            return aligner(topk_ids)

        return run

    return bindable(running, aligner)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck; see .moe_common)


def _example_align(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    model = moe_model(width)
    return example_routing(tokens, model.experts, model.top_k, device)[1], model.experts, 16


def _native(key: AlignKey) -> object:
    """On the CPU the reference as it is: compiled, it took 5-9 s per token bucket (Dynamo
    specialises the bucket's sizes) to save 20-30% of a call (AMD EPYC, 2 threads, 128 experts,
    top-8: 1 / 16 / 4096 tokens 202 / 283 / 1694 us compiled, 257 / 337 / 2434 eager)."""
    return moe_align_reference if key.device == "cpu" else None


moe_align_op = Op(
    "moe_align", moe_align_reference, check=check_moe_align, key=moe_align_key,
    providers=[helion_provider(_build_align, _align_accepts, kernels.MOE_ALIGN, _align_tuning_key)],
    example_inputs=_example_align, native=_native,
)


# --------------------------------------------------------------------------------------------
# public API


class MoEAlignment(NamedTuple):
    """What :func:`moe_align` returns and :func:`grouped_gemm` consumes (int32, on the device)."""

    sorted_pairs: Tensor
    block_experts: Tensor
    expert_offsets: Tensor

    @property
    def block_m(self) -> int:
        blocks = self.block_experts.shape[0]
        return self.sorted_pairs.shape[0] // blocks if blocks else 1


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the token/expert pairs of ``topk_ids [T, K]`` by expert, padded per expert to ``block_m`` rows.

    Pair ``p = t * K + k``. ``sorted_pairs`` lists each expert's pairs in order (then the pairs
    whose id is outside ``[0, num_experts)``), each segment padded with the value ``T * K`` to a
    multiple of ``block_m``; ``block_experts[j]`` is the expert of rows ``[j * block_m, (j + 1) *
    block_m)`` (``num_experts`` for the unrouted segment, -1 past the end); ``expert_offsets``
    (``[E + 2]``, non-decreasing) delimits the segments. Sizes are upper bounds computed from the
    shapes, so the call never waits for the device.
    """
    return MoEAlignment(*moe_align_op.call(topk_ids, num_experts, block_m))
