"""``paged_attention``: attention of a varlen batch over the paged KV cache.

The cache's layout, and the op that writes it, are :mod:`.write_kv_cache`'s.

``paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, ...)`` attends a
varlen batch mixing prefill and decode sequences. ``q`` is ``[tokens, num_q_heads, head_dim]``;
sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and has ``kv_lens[s]`` keys
in the cache (its new tokens included: write them first). Queries are right-aligned with the
keys: query ``i`` of a sequence with ``q_len`` queries sits at position ``kv_len - q_len + i`` and
sees key ``j`` when ``j <= position`` (causal) and, with ``sliding_window=W``, ``j > position - W``
(W keys, itself included, as Hugging Face's sliding masks). Query head ``h`` reads KV head
``h // (num_q_heads // num_kv_heads)`` (GQA / MQA at any ratio). Logits are ``scale * q.k``, then
``softcap * tanh(logits / softcap)`` with a softcap (Gemma-2); ``sinks[h]`` (gpt-oss) is one more
logit in head ``h``'s softmax denominator with no value. Softmax and accumulation run in fp32
(fp64 for fp64 inputs); the output has ``q``'s dtype. Rows no sequence owns, and queries that see
no key (``q_len > kv_len``), are 0.

NaN and infinities: a NaN query, or a NaN among the keys a query sees, makes its output NaN (as
Hugging Face's attention does); a non-finite value among the values it sees makes that dim of its
output NaN or that infinity. Keys a query cannot see (the causal future, outside its window, a
block's unwritten tail, other sequences' blocks) never contribute, whatever they hold.

What is checked where
=====================

* Every call (every provider, also while ``torch.compile`` traces): metadata only, never a
  device sync: dtypes (float ``q`` and caches of one dtype, int32 ``block_table`` /
  ``cu_seqlens_q`` / ``kv_lens``), ranks, devices, head counts and head dims (``q`` against the
  cache), ``v_cache`` against ``k_cache``, one row of ``block_table`` per sequence, a block table
  wide enough for ``max_kv_len`` when it is given, the scalars.
* The reference path (CPU, and any call no kernel accepts) also checks the *data*, since it
  synchronises anyway: ``cu_seqlens_q`` non-decreasing within ``q``, every block a sequence uses
  within ``[0, num_blocks)``, ``kv_lens`` within the block table.
  :func:`validate_paged_attention_inputs` runs the same checks on demand, e.g. while debugging a
  GPU run.
* The kernel path does not read data on the host, so a decode step can be captured in a CUDA
  graph. Out-of-range block ids are clamped inside the kernels, so bad metadata gives wrong
  numbers, never an out-of-bounds access.

Dispatch and hints
==================

``max_q_len`` / ``max_kv_len`` are optional Python ints (no tensor is read to get them). They
size the grid (``max_q_len``, default: the number of query rows) and choose between the one-pass
kernel and the split-KV (flash-decoding) kernel (see
:func:`hw_agnostic.kernels.paged_attention.choose_num_splits`); a batch of single-query sequences
is a decode batch. A hint smaller than the truth is an error of the caller (queries or keys past
it are not computed: on the kernel path the output is allocated unfilled, so the rows of queries
past ``max_q_len`` hold whatever the memory held); a larger one only costs time. The public
function raises a valid ``max_kv_len`` to the largest hint it launches alike with
(:func:`widest_alike_kv_len`), so that a decode step's calls, whose hint grows by one a step, keep
one call signature for many steps.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import paged_attention as kernels
from ..kernels.launch_binding import HostLaunch, replayed
from ..kernels.runtime import helion_available
from . import checks
from .registry import Op, Provider
from .write_kv_cache import caches_flatten, check_caches, check_index, slot_view

MIN_KERNEL_HEAD_DIM = 16  # tensor-core dot products need K >= 16
MAX_KERNEL_HEAD_DIM = 256
NO_WINDOW = 1 << 30  # the kernels' window when there is none: longer than any sequence
MAX_REFERENCE_SCORES = 1 << 24  # logits per chunk in the reference: bounds its memory on long contexts
#: Block tables of up to this many entries are read to the host as one list for their checks and
#: layout (a decode step's few blocks: ~1 us, where the tensor ops and their reads took 4-9 us);
#: larger ones by tensor ops, which read one number (a list of thousands costs more).
LISTED_BLOCKS = 256
#: fp32 decode attention of up to this many ``keys x query heads x head dim`` runs SDPA with the
#: query heads as GQA heads of one row each, past it with them as rows of their KV head (see
#: :func:`_grouped_decode`).
MAX_GQA_DECODE_WORK = 1 << 18


# --------------------------------------------------------------------------------------------
# data checks (they synchronise: the reference path and debugging only)


def validate_paged_attention_inputs(
    q: Tensor, k_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor
) -> None:
    """The data checks of the reference path (they read the metadata on the host)."""
    _validated_metadata(q, k_cache, block_table, cu_seqlens_q, kv_lens)


def _validated_metadata(q: Tensor, k_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                        kv_lens: Tensor) -> tuple[list[int], list[int], Optional[list[list[int]]]]:
    """:func:`validate_paged_attention_inputs`, returning ``cu_seqlens_q`` and ``kv_lens`` as it read
    them, and the block table's columns every sequence reads as a list where it read them so (a
    small table whose sequences read as many blocks each; else None)."""
    op = "paged_attention"
    bounds, rows = cu_seqlens_q.tolist(), q.shape[0]
    # (comparisons, not generators over the offsets: a decode step's call took 4 µs in them)
    if bounds != sorted(bounds) or bounds and (bounds[0] < 0 or bounds[-1] > rows):
        raise ValueError(
            f"{op}: cu_seqlens_q must be non-decreasing offsets into q's {rows} rows; got {bounds}"
        )
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    max_blocks = block_table.shape[1]
    used_blocks, lengths = [], kv_lens.tolist()
    for seq, kv_len in enumerate(lengths):
        if kv_len < 0:
            raise ValueError(f"{op}: kv_lens[{seq}] is {kv_len}; lengths must be >= 0")
        used = -(-kv_len // block_size)
        if used > max_blocks:
            raise ValueError(
                f"{op}: kv_lens[{seq}] = {kv_len} needs {used} blocks of {block_size} but block_table has "
                f"{max_blocks} columns"
            )
        used_blocks.append(used)
    listed = None
    if used_blocks and min(used_blocks) == max(used_blocks):  # one check of the columns every sequence reads
        listed = _check_blocks(op, block_table.narrow(1, 0, used_blocks[0]), None, num_blocks)
    elif used_blocks:  # each sequence's own columns, in one pass (not one per sequence)
        widest = max(used_blocks)
        counts = torch.tensor(used_blocks, device=block_table.device)[:, None]
        used = torch.arange(widest, device=block_table.device) < counts
        _check_blocks(op, block_table.narrow(1, 0, widest), used, num_blocks)
    return bounds, lengths, listed


def _check_blocks(op: str, blocks: Tensor, used: Optional[Tensor], num_blocks: int) -> Optional[list[list[int]]]:
    """Raise naming the first entry of ``blocks`` (the block table's first columns; where ``used``
    says, None: all) that is not a block of the cache. Returns ``blocks`` as a list where it read
    them so (:data:`LISTED_BLOCKS`), for :func:`_regular_blocks`."""
    if not blocks.numel():
        return None
    listed = None
    if used is None and blocks.numel() <= LISTED_BLOCKS:  # one host read, compared in Python
        listed = blocks.tolist()
        entries = [entry for row in listed for entry in row]
        low, high = min(entries), max(entries)
    else:
        read = blocks if used is None else torch.where(used, blocks, 0)
        low, high = (int(v) for v in torch.aminmax(read))  # one op, where naming the bad entry takes four
    if low < 0 or high >= num_blocks:
        bad = (blocks < 0) | (blocks >= num_blocks)
        row, column = (int(i) for i in (bad if used is None else bad & used).nonzero()[0])
        raise ValueError(
            f"{op}: block_table[{row}, {column}] = {int(blocks[row, column])} is not a block of the "
            f"cache (num_blocks = {num_blocks})"
        )
    return listed


# --------------------------------------------------------------------------------------------
# the spec


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    kv_lens: Tensor,
    scale: float,
    sliding_window: Optional[int],
    softcap: Optional[float],
    sinks: Optional[Tensor],
    max_q_len: Optional[int],
    max_kv_len: Optional[int],
) -> Tensor:
    validate_paged_attention_inputs(q, k_cache, block_table, cu_seqlens_q, kv_lens)
    compute = torch.promote_types(q.dtype, torch.float32)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for seq, kv_len in enumerate(kv_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if end == start:
            continue
        blocks = block_table[seq, : -(-kv_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:kv_len].to(compute)  # [kv_len, Hkv, D]
        values = v_cache[blocks].flatten(0, 1)[:kv_len].to(compute)
        rows_per_chunk = max(1, MAX_REFERENCE_SCORES // max(num_q_heads * kv_len, 1))
        for chunk in range(start, end, rows_per_chunk):
            stop = min(chunk + rows_per_chunk, end)
            queries = q[chunk:stop].to(compute).view(stop - chunk, num_kv_heads, group, head_dim)
            logits = torch.einsum("qkgd,nkd->kgqn", queries, keys) * scale  # [Hkv, G, rows, kv_len]
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            positions = torch.arange(chunk - start, stop - start, device=q.device) + (kv_len - (end - start))
            key_index = torch.arange(kv_len, device=q.device)
            visible = key_index[None, :] <= positions[:, None]
            if sliding_window is not None:
                visible = visible & (key_index[None, :] > positions[:, None] - sliding_window)
            logits = logits.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = sinks.to(compute).view(num_kv_heads, group, 1, 1).expand(-1, -1, stop - chunk, 1)
                probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(logits, dim=-1)
                # A query that sees no key outputs 0 (its softmax is 0/0); a NaN query still gives NaN.
                probs = torch.where(visible.any(-1)[:, None], probs, 0.0)
            out[chunk:stop] = _attend(probs, values, visible).reshape(stop - chunk, num_q_heads, head_dim)
    return out.to(q.dtype)


class _ReferenceAttention:
    """Each sequence's pages gathered into SDPA, decode steps batched; softcap, sinks, fp64 eager.

    What the reference provider runs: PyTorch's ``scaled_dot_product_attention`` (on the CPU its
    flash kernel: blocked, multi-threaded, no ``[heads, q_len, kv_len]`` logits tensor) instead of
    the reference's einsums and per-sequence loop, in the inputs' dtype as Hugging Face's SDPA
    attention runs it: fp32 logits, softmax and accumulation, 16-bit probabilities into the value
    product, as the DSL kernel rounds them (within the spec's tolerance; upcasting the pages to
    fp32 first cost 2.5-3.5x the time: 8 decode sequences of 2048 tokens at Llama-3-8B's heads,
    39 against 14 ms). Pages laid out in order are read in place (:func:`_page_view`), scattered
    ones gathered into per-thread buffers (:func:`_gathered`). Decode sequences run as batches,
    each KV head's query heads as its query rows, in chunks whose gathered pages stay below
    :attr:`MAX_GATHER_BYTES`: those with the same number of keys as they are, those with
    different numbers (within 2x) padded and masked (:meth:`_attend_uneven`); a prompt owning every query row is
    returned as SDPA computed it. Softcap and sinks, which SDPA cannot express, fp64, and batches
    with queries that see no key run the reference itself.
    """

    MAX_GATHER_BYTES = 16 << 20

    def __init__(self, reference: Any) -> None:
        self.reference = reference

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                 kv_lens: Tensor, scale: float, sliding_window: Optional[int], softcap: Optional[float],
                 sinks: Optional[Tensor], max_q_len: Optional[int], max_kv_len: Optional[int]) -> Tensor:
        args = (q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, scale, sliding_window, softcap, sinks,
                max_q_len, max_kv_len)
        if softcap is not None or sinks is not None or q.dtype == torch.float64:
            return self.reference(*args)
        bounds, lengths, listed = _validated_metadata(q, k_cache, block_table, cu_seqlens_q, kv_lens)
        block_size, row_bytes = k_cache.shape[1], k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        if self._one_decode_batch(q, bounds, lengths, row_bytes) and lengths[0] >= 1:
            # sequence s owns row s, all have the same keys: the group below, with no row gathered or scattered
            kv_len = lengths[0]
            blocks = block_table[:, : -(-kv_len // block_size)]  # the columns validated (and listed) above
            out = self._attend_decode(q, k_cache, v_cache, blocks, kv_len, scale, sliding_window, listed).contiguous()
        else:
            spans = [(bounds[s], bounds[s + 1], n) for s, n in enumerate(lengths)]
            if any(end - start > n for start, end, n in spans):  # queries that see no key: the reference's zeros
                return self.reference(*args)
            out = self._attend_sequences(q, k_cache, v_cache, block_table, cu_seqlens_q, spans, scale, sliding_window,
                                         row_bytes)
        # NaN or infinities met in the pages: SDPA lets a key a row cannot see poison it (0 * NaN),
        # the reference does not (non-finite inputs that change nothing, a key at -inf, leave the
        # output finite); in the queries: CPU SDPA's causal flash path turns a NaN query into 0.
        # Either way the reference runs.
        if not (_finite(q) and _finite(out)):
            return self.reference(*args)
        return out

    @classmethod
    def _one_decode_batch(cls, q: Tensor, bounds: list[int], lengths: list[int], row_bytes: int) -> bool:
        """Whether every sequence is one decode query of row ``s`` with as many keys as the others,
        gathered in one chunk."""
        count = len(lengths)
        return (count > 0 and q.shape[0] == count and bounds == list(range(count + 1))
                and lengths.count(lengths[0]) == count and count <= cls._chunk(lengths[0], row_bytes)
                and q.is_contiguous())

    @classmethod
    def _chunk(cls, kv_len: int, row_bytes: int) -> int:
        """Decode sequences of ``kv_len`` keys gathered at once (below :attr:`MAX_GATHER_BYTES`)."""
        return max(1, cls.MAX_GATHER_BYTES // max(kv_len * row_bytes, 1))

    def _attend_sequences(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                          cu_seqlens_q: Tensor, spans: list[tuple[int, int, int]], scale: float,
                          sliding_window: Optional[int], row_bytes: int) -> Tensor:
        """Each prompt on its own; decode queries batched, in chunks (see :meth:`_decode_chunks`)."""
        block_size = k_cache.shape[1]
        if len(spans) == 1 and spans[0][:2] == (0, q.shape[0]) and q.shape[0] > 1:  # one prompt owns every row
            blocks = block_table[:1, : -(-spans[0][2] // block_size)]
            return self._attend(q[None], k_cache, v_cache, blocks, spans[0][2], scale, sliding_window)[0].contiguous()
        # rows no sequence owns are 0; where the sequences own every row, each is written below
        out = torch.empty_like(q) if spans and spans[0][0] == 0 and spans[-1][1] == q.shape[0] else torch.zeros_like(q)
        decode: dict[int, list[int]] = {}
        for seq, (start, end, kv_len) in enumerate(spans):
            if end - start == 1:
                decode.setdefault(kv_len, []).append(seq)
            elif end > start:
                blocks = block_table[seq: seq + 1, : -(-kv_len // block_size)]
                out[start:end] = self._attend(q[None, start:end], k_cache, v_cache, blocks, kv_len, scale,
                                              sliding_window)[0]
        uneven = caches_flatten(k_cache, v_cache)  # token-level gathers read slot rows; else one length per call
        for seqs in self._decode_chunks(decode, row_bytes, uneven):
            index = torch.tensor(seqs, device=q.device)
            rows = cu_seqlens_q[index].long()
            lengths = [spans[seq][2] for seq in seqs]  # ascending
            blocks = block_table[index, : -(-lengths[-1] // block_size)]
            if lengths[0] != lengths[-1]:
                out[rows] = self._attend_uneven(q[rows], k_cache, v_cache, blocks, lengths, scale, sliding_window)
            else:
                out[rows] = self._attend(q[rows][:, None], k_cache, v_cache, blocks, lengths[0], scale,
                                         sliding_window)[:, 0]
        return out

    @classmethod
    def _decode_chunks(cls, decode: dict[int, list[int]], row_bytes: int, uneven: bool) -> list[list[int]]:
        """The decode sequences (``{kv_len: [seq, ...]}``) in batches of one SDPA call each: by length,
        a batch's gathered pages (padded to its longest) below :attr:`MAX_GATHER_BYTES`, and its
        longest at most twice its shortest (one length unless ``uneven``), so padding at most doubles
        the keys read. One call per length was most of a batch of different lengths (continuous
        batching): 16 decodes of 64-128 keys at 8 heads of 64 took 1.55 ms, batched 0.63 (with the
        block table checked in one pass)."""
        chunks: list[list[int]] = []
        chunk: list[int] = []
        shortest = 0
        for kv_len in sorted(decode):
            for seq in decode[kv_len]:
                if chunk and (kv_len > (2 * shortest if uneven else shortest)
                              or len(chunk) + 1 > cls._chunk(kv_len, row_bytes)):
                    chunks.append(chunk)
                    chunk = []
                if not chunk:
                    shortest = kv_len
                chunk.append(seq)
        return chunks + [chunk] if chunk else chunks

    @staticmethod
    def _attend_uneven(queries: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, lengths: list[int],
                       scale: float, sliding_window: Optional[int]) -> Tensor:
        """``[b, Hq, D]`` decode queries over ``lengths[s]`` keys each (``blocks`` ``[b, n]``, ``n`` the
        longest's), in one masked SDPA call: each sequence's keys gathered token by token to the
        longest's count, the positions past its own filled with its first key and masked (with its
        window). Only keys the sequence wrote are read: a page past them holds anything (another
        sequence's keys, memory never written, NaN), and SDPA lets a NaN through a mask (0 * NaN)."""
        batch, block_size = queries.shape[0], k_cache.shape[1]
        keys = blocks.shape[1] * block_size
        counts = torch.tensor(lengths, device=queries.device)[:, None]
        position = torch.arange(keys, device=queries.device)
        visible = position < counts
        written = torch.where(visible, position, 0)
        slots = (blocks.gather(1, written // block_size).long() * block_size + written % block_size).reshape(-1)
        if sliding_window is not None:
            visible &= position >= counts - sliding_window

        def pages(cache: Tensor, slot: int) -> Tensor:  # [b, Hkv, keys, D]
            return _gathered(slot_view(cache), slots, slot).view(batch, keys, *cache.shape[2:]).transpose(1, 2)

        return _grouped_decode(queries, pages(k_cache, 0), pages(v_cache, 1), scale, visible[:, None, None, :])

    @staticmethod
    def _attend(queries: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, kv_len: int, scale: float,
                sliding_window: Optional[int]) -> Tensor:
        """``[b, q_len, Hq, D]`` attention of right-aligned ``queries`` over ``blocks`` ``[b, n]``."""
        q_len = queries.shape[1]
        if q_len == 1:
            return _ReferenceAttention._attend_decode(queries[:, 0], k_cache, v_cache, blocks, kv_len, scale,
                                                      sliding_window)[:, None]
        mask, causal = None, False
        if sliding_window is None and q_len == kv_len:
            causal = True
        else:
            positions = torch.arange(kv_len - q_len, kv_len, device=queries.device)[:, None]
            index = torch.arange(kv_len, device=queries.device)[None, :]
            mask = index <= positions
            if sliding_window is not None:
                mask &= index > positions - sliding_window

        # A whole prompt's causal flash kernel runs faster on contiguous heads (512 tokens at
        # Llama-3-8B's: 15.1 against 17.3 ms, the copy included); masked chunks read the strided
        # view faster.
        keys, values = _kv_pages(k_cache, v_cache, blocks, 0, kv_len, causal)
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        return attended.transpose(1, 2)

    @staticmethod
    def _attend_decode(queries: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Tensor, kv_len: int, scale: float,
                       sliding_window: Optional[int], listed: Optional[list[list[int]]] = None) -> Tensor:
        """``[b, Hq, D]``: one query per sequence (``queries`` ``[b, Hq, D]``) over its last ``kv_len``
        keys in ``blocks`` ``[b, n]`` (the window's last keys: no mask needed). Decode reads the
        strided page view faster than a contiguous copy (8 x 2048 decode: 17 against 44 ms with it)."""
        first = 0 if sliding_window is None else max(0, kv_len - sliding_window)
        return _grouped_decode(queries, *_kv_pages(k_cache, v_cache, blocks, first, kv_len, False, listed), scale)


#: the op's native form: what the reference provider runs when compiling is on or in native mode
_EAGER_ATTENTION = _ReferenceAttention(paged_attention_reference)

#: per thread, the buffers scattered blocks are gathered into: ``{(slot, dtype, device): flat tensor}``
_gather_buffers = threading.local()


def _grouped_decode(queries: Tensor, keys: Tensor, values: Tensor, scale: float,
                    mask: Optional[Tensor] = None) -> Tensor:
    """``[b, Hq, D]``: one query per sequence over ``keys`` / ``values`` ``[b, Hkv, n, D]``.

    The query heads of a KV head read the same keys, so they are that head's query rows (unmasked
    by position, no GQA expansion). CPU SDPA reads the strided page view about 3x faster that way
    than as GQA heads of one query row each (2048 keys at Llama-3-8B's heads: 0.45 against 1.3 ms;
    about what it takes on contiguous K/V)."""
    batch, num_q_heads, head_dim = queries.shape
    if mask is None and queries.dtype == torch.float32 and keys.shape[2] * num_q_heads * head_dim <= MAX_GQA_DECODE_WORK:
        # small fp32 calls run faster as GQA heads (8 query heads of 32 over 16 keys: 7 against 12 us;
        # Llama-3-8B's over 64 keys: 36 against 39); 16-bit ones never (bf16 at 64 keys: 4-13x slower)
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries.reshape(batch, num_q_heads, 1, head_dim), keys, values, scale=scale, enable_gqa=True)
        return attended.reshape(batch, num_q_heads, head_dim)
    grouped = queries.reshape(batch, keys.shape[1], num_q_heads // keys.shape[1], head_dim)
    attended = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return attended.reshape(batch, num_q_heads, head_dim)


def _gathered(cache: Tensor, blocks: Tensor, slot: int) -> Tensor:
    """``cache.index_select(0, blocks)``, written into this thread's buffer ``slot`` (0: keys, 1:
    values) where it fits :attr:`_ReferenceAttention.MAX_GATHER_BYTES` and the cache is in CPU memory.

    A fresh gather of a few MB is fresh memory from the OS on every call, and its page faults
    cost more than the copy (8 decode sequences of 2048 tokens at Llama-3-8B's heads: 18 against
    2.7 ms for the gathers alone). So each thread keeps one buffer per slot, dtype and device, grown
    to the largest gather that fits the limit (at most twice that limit per dtype and device); the
    attention reads it before the call returns, and a larger gather is fresh memory, as before."""
    shape = (blocks.shape[0], *cache.shape[1:])
    count = math.prod(shape)
    # (a device's own caching allocator reuses memory, and its queued reads would race a reused buffer)
    if cache.device.type != "cpu" or count * cache.element_size() > _ReferenceAttention.MAX_GATHER_BYTES:
        return cache.index_select(0, blocks)
    buffers = getattr(_gather_buffers, "buffers", None)
    if buffers is None:
        buffers = _gather_buffers.buffers = {}
    key = (slot, cache.dtype, cache.device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < count:
        # a normal tensor even when made inside inference_mode: it outlives the call, and an inference
        # tensor cannot be written outside that mode
        with torch.inference_mode(False):
            buffer = buffers[key] = torch.empty(count, dtype=cache.dtype, device=cache.device)
    return torch.index_select(cache, 0, blocks, out=buffer[:count].view(shape))


def _finite(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds only finite numbers, as far as its sum tells (a NaN or an infinity
    makes the sum NaN or infinite; a sum that overflows sends the call to the reference, which is
    only slower): first summed in its own dtype, which a 16-bit tensor's sum takes a fifth of the
    fp32 sum's time for (a 512-token bf16 prefill's queries: 71 against 400 µs), then, if that sum
    overflowed the 16-bit range, in fp32. Not ``isfinite().all()``: 2.6 ms there."""
    return math.isfinite(float(tensor.sum())) or math.isfinite(float(tensor.sum(dtype=torch.float32)))


def _regular_blocks(blocks: Tensor, listed: Optional[list[list[int]]] = None) -> Optional[tuple[int, int]]:
    """``(first, stride)`` where row ``s`` of ``blocks`` ``[b, n]`` is ``first + s * stride + arange(n)``
    (each sequence's blocks in order, as a paged ``DynamicCache`` lays them out), else None.
    ``listed``: ``blocks.tolist()`` where the caller read it already."""
    rows, columns = blocks.shape
    if not rows or not columns:
        return None
    if rows * columns <= LISTED_BLOCKS:
        table = blocks.tolist() if listed is None else listed
        first = table[0][0]
        stride = table[1][0] - first if rows > 1 else 0
        regular = stride >= 0 and all(row == list(range(first + s * stride, first + s * stride + columns))
                                      for s, row in enumerate(table))
        return (first, stride) if regular else None
    first = int(blocks[0, 0])
    stride = int(blocks[1, 0]) - first if rows > 1 else 0
    if stride < 0:
        return None
    if rows == 1 and columns == 1:
        return first, stride
    expected = torch.arange(first, first + columns, dtype=blocks.dtype, device=blocks.device)
    if rows > 1:
        expected = expected + torch.arange(rows, dtype=blocks.dtype, device=blocks.device)[:, None] * stride
    return (first, stride) if torch.equal(blocks, expected.expand(rows, columns)) else None


def _kv_pages(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, first: int, last: int,
              contiguous: bool, listed: Optional[list[list[int]]] = None) -> tuple[Tensor, Tensor]:
    """Keys and values ``[b, Hkv, last - first, D]``: positions ``first:last`` of the pages ``blocks``
    ``[b, n]`` lists, read in place where :func:`_page_view` can, else gathered (whole blocks copied,
    into the thread's gather buffers where they fit them). ``listed``: ``blocks.tolist()``, where the
    metadata checks read it already."""
    regular = _regular_blocks(blocks, listed)

    def pages(cache: Tensor, slot: int) -> Tensor:
        heads_first = _page_view(cache, blocks.shape, regular, first, last)
        if heads_first is None:
            tokens = _gathered(cache, blocks.reshape(-1), slot).view(*blocks.shape, *cache.shape[1:]).flatten(1, 2)
            heads_first = tokens[:, first:last].transpose(1, 2)
        return heads_first.contiguous() if contiguous else heads_first

    return pages(k_cache, 0), pages(v_cache, 1)


def _page_view(cache: Tensor, shape: torch.Size, regular: Optional[tuple[int, int]], first: int,
               last: int) -> Optional[Tensor]:
    """``[b, Hkv, last - first, D]``: keys ``first:last`` of the pages of a :func:`_regular_blocks`
    layout read in place (no gathered copy: 4 MB a cache for one 2048-token bf16 sequence at
    Llama-3-8B's heads), heads first, in one ``as_strided`` (what a view of the pages, a slice and a
    transpose make, at a microsecond each); None where the blocks are not regular, a cache's blocks
    do not follow one another in memory or the keys pass the blocks."""
    if regular is None:
        return None
    blocks, block_size, heads, dim = cache.shape
    step, token, head, element = cache.stride()
    rows, columns = shape
    if step != block_size * token and blocks > 1 or not 0 <= first <= last <= columns * block_size:
        return None
    start, stride = regular
    return cache.as_strided((rows, heads, last - first, dim), (stride * step, head, token, element),
                            cache.storage_offset() + start * step + first * token)


def _attend(probs: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    """``probs [Hkv, G, rows, n] @ values [n, Hkv, D]`` with only the keys each row sees contributing.

    A key a row cannot see has probability 0, but ``0 * NaN`` is NaN: the product takes the finite
    values, and a NaN (or both infinities) / an infinity among the values a row sees makes that
    row's output NaN / that infinity in that dim.
    """
    finite = torch.isfinite(values)
    attended = torch.einsum("kgqn,nkd->qkgd", probs, torch.where(finite, values, 0.0))
    if bool(finite.all()):
        return attended
    seen = visible.to(values.dtype)

    def seen_where(condition: Tensor) -> Tensor:  # [rows, Hkv, 1, D]: a seen key's value meets condition
        return (torch.einsum("qn,nkd->qkd", seen, condition.to(values.dtype)) > 0)[:, :, None, :]

    nans, positives, negatives = (seen_where(c) for c in (torch.isnan(values), values == float("inf"),
                                                            values == float("-inf")))
    poisoned = nans | (positives & negatives) | torch.isnan(attended)  # a NaN query stays NaN
    return torch.where(poisoned, float("nan"), torch.where(positives, float("inf"),
                       torch.where(negatives, float("-inf"), attended)))


def _paged_attention_shape(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
    scale: float, sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[Tensor],
    max_q_len: Optional[int], max_kv_len: Optional[int],
) -> Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# --------------------------------------------------------------------------------------------
# checks


def _optional_int(op: str, name: str, value: Any, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, torch.SymInt):
        return  # a hint traced symbolically (torch.compile with dynamic shapes): checked when it runs
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int or None, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum} (or None), got {value}")


def check_paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
    scale: float, sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[Tensor],
    max_q_len: Optional[int], max_kv_len: Optional[int],
) -> None:
    op = "paged_attention"
    checks.tensor(op, "q", q)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [tokens, num_q_heads, head_dim]; got shape {tuple(q.shape)}")
    check_caches(op, k_cache, v_cache)
    checks.same_device(op, "k_cache", k_cache, "q", q)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"{op}: k_cache and v_cache must have q's dtype ({q.dtype}); got {k_cache.dtype}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"{op}: q has head_dim {q.shape[2]} but k_cache has head_dim {k_cache.shape[3]} "
            f"(k_cache shape {tuple(k_cache.shape)})"
        )
    if q.shape[1] < 1 or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"{op}: q's {q.shape[1]} heads must be a positive multiple of k_cache's {k_cache.shape[2]} KV heads"
        )
    check_index(op, "block_table", block_table, 2, k_cache)
    check_index(op, "kv_lens", kv_lens, 1, k_cache)
    check_index(op, "cu_seqlens_q", cu_seqlens_q, 1, k_cache)
    num_seqs = kv_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{op}: cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries (kv_lens has {num_seqs}); "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"{op}: block_table must have one row per sequence ({num_seqs}); got {block_table.shape[0]}")
    number = checks.number(op, "scale", scale)
    if number <= 0:
        raise ValueError(f"{op}: scale must be > 0, got {scale}")
    _optional_int(op, "sliding_window", sliding_window, 1)
    if softcap is not None:
        checks.number(op, "softcap", softcap, positive=True)
    if sinks is not None:
        checks.tensor(op, "sinks", sinks)
        checks.same_device(op, "sinks", sinks, "q", q)
        if tuple(sinks.shape) != (q.shape[1],):
            raise ValueError(
                f"{op}: sinks must have one logit per query head, shape ({q.shape[1]},); got {tuple(sinks.shape)}"
            )
    _optional_int(op, "max_q_len", max_q_len, 0)
    _optional_int(op, "max_kv_len", max_kv_len, 0)
    capacity = block_table.shape[1] * k_cache.shape[1]
    if max_kv_len is not None and max_kv_len > capacity:
        raise ValueError(
            f"{op}: max_kv_len = {max_kv_len} but block_table's {block_table.shape[1]} columns of "
            f"{k_cache.shape[1]}-token blocks hold at most {capacity} keys per sequence"
        )


# --------------------------------------------------------------------------------------------
# keys


class AttentionKey(NamedTuple):
    device: str
    dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    softcap: bool
    sinks_dtype: Optional[torch.dtype]
    decode: bool
    num_seqs: int  # bucketed
    kv_len: int  # bucketed max_kv_len (the block table's capacity without a hint)
    caches_flatten: bool
    int64: bool
    tokens: int


def paged_attention_key(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
    scale: float, sliding_window: Optional[int], softcap: Optional[float], sinks: Optional[Tensor],
    max_q_len: Optional[int], max_kv_len: Optional[int],
) -> AttentionKey:
    num_seqs = kv_lens.shape[0]
    decode = max_q_len == 1 or (max_q_len is None and q.shape[0] <= num_seqs)
    longest = max_kv_len if max_kv_len is not None else block_table.shape[1] * k_cache.shape[1]
    return AttentionKey(
        q.device.type, q.dtype, q.shape[2], q.shape[1], k_cache.shape[2], k_cache.shape[1],
        softcap is not None, None if sinks is None else sinks.dtype, decode,
        token_bucket(num_seqs), token_bucket(longest), caches_flatten(k_cache, v_cache),
        checks.needs_int64(q, k_cache, v_cache), token_bucket(q.shape[0]),
    )


def widest_alike_kv_len(max_kv_len: int, k_cache: Any, block_table: Any) -> int:
    """The largest ``max_kv_len`` hint the op treats as ``max_kv_len``: the same key, the same split
    count, and the same verdict of the check (at most the block table's capacity); ``max_kv_len``
    itself where that holds for no larger one, or the hint is not a valid one.

    The hint reaches the launches only through its power-of-two bucket (the key's ``kv_len``),
    ``ceil(max_kv_len / MIN_TOKENS_PER_SPLIT)`` and whether it is below twice that
    (:func:`~hw_agnostic.kernels.paged_attention.choose_num_splits`). A decode step's hint grows by
    one every step, and each new value was a new call signature: the first layer of every step paid
    the whole dispatch (check, key, plan lookup, a new binding whose first call runs Helion's host
    code: 63 µs against 8 for a repeated call on the decode-host model) and the second one new guards
    (18 µs). Raised to this bound, the signature changes at the bucket's powers of two up to
    ``MIN_TOKENS_PER_SPLIT``, then once every ``MIN_TOKENS_PER_SPLIT`` tokens, and every launch stays
    what the exact hint gives."""
    try:
        capacity = block_table.shape[1] * k_cache.shape[1]
    except (AttributeError, IndexError, TypeError):  # arguments the check will name
        return max_kv_len
    if not 0 < max_kv_len <= capacity:
        return max_kv_len
    split = kernels.MIN_TOKENS_PER_SPLIT
    widest = split * -(-max_kv_len // split)  # the same count of split-sized pieces
    if max_kv_len < 2 * split:  # too short to split at all
        widest = min(widest, 2 * split - 1)
    bucket = token_bucket(max_kv_len)
    if bucket >= max_kv_len:  # below the largest bucket: the same bucket
        widest = min(widest, bucket)
    return min(widest, capacity)


# --------------------------------------------------------------------------------------------
# the Helion provider


def _attention_accepts(key: AttentionKey) -> str | None:
    if key.dtype not in checks.KERNEL_DTYPES:
        return f"dtype {key.dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    if not MIN_KERNEL_HEAD_DIM <= key.head_dim <= MAX_KERNEL_HEAD_DIM:
        return f"head_dim {key.head_dim} outside the kernel's {MIN_KERNEL_HEAD_DIM}..{MAX_KERNEL_HEAD_DIM}"
    if not key.caches_flatten:
        return "a cache's block and slot dims do not merge into one slot stride"
    return None


def _attention_tuning_key(key: AttentionKey) -> dict[str, object]:
    return {
        "dtype": str(key.dtype).removeprefix("torch."), "head_dim": key.head_dim,
        "group": key.num_q_heads // key.num_kv_heads, "block_size": key.block_size, "decode": key.decode,
        "kv_len": key.kv_len,
    }


class _AttentionLaunch:
    """Runs one plan: the one-pass kernel, or the split kernel and the merge.

    With ``num_splits="auto"`` the split count is chosen per call, from the call's number of
    sequences and its ``max_kv_len`` hint (Python ints: no device read) and the device's size, so
    a decode that grows from 1k to 8k keys inside one key bucket gets the splits each length
    needs; each variant (one-pass, split with a merge for that many splits) is compiled once.
    """

    def __init__(self, key: AttentionKey, config: dict, args: tuple) -> None:
        splits, self.helion_config = kernels.split_launch_config(config)
        if splits != "auto" and int(splits) < 1:
            raise ValueError(f"paged_attention: num_splits must be >= 1, got {splits}")
        self.splits = splits
        self.key = key
        self.group = key.num_q_heads // key.num_kv_heads
        q = args[0]
        self.programs = kernels.target_programs(q.device)
        self.placeholder = torch.zeros(1, dtype=torch.float32, device=q.device)  # stands in for absent partials
        self.placeholder_index = torch.zeros(1, dtype=torch.int32, device=q.device)  # for an absent block map
        self.placeholder_rows = self.placeholder.view(1, 1)
        # The configured rows until the kernel is bound (its launches do not depend on them), then Helion's.
        self.block_rows = int(self.helion_config["block_sizes"][0])
        # No sinks: -inf logits, which join no softmax.
        self.no_sinks = torch.full((key.num_q_heads,), float("-inf"), dtype=torch.float32, device=q.device)
        self._attention: dict[tuple[bool, bool], Any] = {}
        self._merges: dict[tuple, Any] = {}
        self.num_splits = self.splits_for(args)
        attention_args, _ = self._arguments(*args, num_splits=self.num_splits)
        self.block_rows = kernels.grid_block_rows(self.helion_config, attention_args, int64=key.int64)
        # Compiled now: the plan's first call pays for it.
        self._launches(*self._arguments(*args, num_splits=self.num_splits))

    def splits_for(self, args: tuple) -> int:
        if self.splits != "auto":
            return int(self.splits)
        block_table, kv_lens, max_kv_len = args[3], args[5], args[11]
        return kernels.choose_num_splits(
            decode=self.key.decode, num_seqs=kv_lens.shape[0], num_kv_heads=self.key.num_kv_heads,
            max_kv_len=max_kv_len if max_kv_len is not None else block_table.shape[1] * self.key.block_size,
            programs=self.programs,
        )

    def _launches(self, attention_args: tuple, merge_args: tuple | None) -> tuple[Any, Any]:
        """The attention kernel (per split and grid variant) and the merge (None without splits),
        compiled on first use."""
        variant = (merge_args is not None, attention_args[-1])
        attention = self._attention.get(variant)
        if attention is None:
            attention = self._attention[variant] = kernels.paged_attention_kernel.compile(
                self.helion_config, attention_args, int64=self.key.int64)
        merge = None
        if merge_args is not None:
            _, _, num_splits, packed_rows = merge_args[1].shape
            merge_config = kernels.merge_config(num_splits, packed_rows)
            shape = tuple(merge_config["block_sizes"])
            merge = self._merges.get(shape)
            if merge is None:
                merge = self._merges[shape] = kernels.merge_splits_kernel.compile(
                    merge_config, merge_args, int64=self.key.int64)
        return attention, merge

    def _arguments(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
        kv_lens: Tensor, scale: float, sliding_window: Optional[int], softcap: Optional[float],
        sinks: Optional[Tensor], max_q_len: Optional[int], max_kv_len: Optional[int], out: Tensor | None = None,
        *, num_splits: int, grid: kernels.QueryGrid | None = None, views: bool = True,
    ) -> tuple[tuple, tuple | None]:
        """The attention kernel's arguments, and the merge's (None without splits); ``grid``, where
        given, is :meth:`_grid`'s for these arguments. ``views=False``: the tensors the host code
        takes as views (q's rows, the caches' slots, out's rows, the flat table, the partials' rows)
        are given as the tensors they view, where those have the view's data pointer, for a bound
        launch's replay (``launch_binding.BoundLaunch.replays``)."""
        tokens, heads, head_dim = q.shape
        num_seqs = kv_lens.shape[0]
        max_q_len = max_q_len if max_q_len is not None else tokens
        packed = max_q_len * self.group  # the longest sequence's packed rows: the partials' and the merge's
        grid = grid if grid is not None else self._grid(q, kv_lens, max_q_len)
        block_seq = (kernels.block_sequences(cu_seqlens_q, self.group, self.block_rows, grid.blocks)
                     if grid.packed else self.placeholder_index)
        if out is None:
            out = torch.zeros((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        sinks = self.no_sinks if sinks is None else sinks
        rows = out.view(tokens * heads, head_dim) if views or num_splits > 1 else out
        merge_args = None
        if num_splits > 1:
            shape = (num_seqs, self.key.num_kv_heads, num_splits, packed)
            partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
            partial_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
            merge_args = (partial_out, partial_lse, cu_seqlens_q, sinks, rows, self.group)
            # the attention kernel writes them as flat rows (see the kernel)
            if views:
                partial_out, partial_lse = partial_out.view(-1, head_dim), partial_lse.view(-1)
        else:
            partial_out, partial_lse = self.placeholder_rows, self.placeholder
        if views:
            table, table_stride = _flat_table(block_table)
            q_rows, k_slots, v_slots = q.reshape(tokens * heads, head_dim), slot_view(k_cache), slot_view(v_cache)
        else:  # a contiguous table's flat view and a contiguous q's rows keep their pointers; the slots always
            flat = block_table.is_contiguous() and block_table.numel()
            table, table_stride = (block_table, block_table.shape[1]) if flat else _flat_table(block_table)
            q_rows = q if q.is_contiguous() else q.reshape(tokens * heads, head_dim)
            k_slots, v_slots = k_cache, v_cache
        attention_args = (
            q_rows, k_slots, v_slots, table, cu_seqlens_q, kv_lens, sinks, block_seq, rows, partial_out, partial_lse,
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else NO_WINDOW, num_splits, packed,
            max(block_table.shape[1], 1), table_stride, self.block_rows, grid.blocks_per_seq, grid.rows(self.block_rows),
            self.group, self.key.block_size, self.key.softcap, head_dim > kernels.KEY_BY_KEY_HEAD_DIM, num_splits > 1,
            grid.packed,
        )
        return attention_args, merge_args

    def _grid(self, q: Tensor, kv_lens: Tensor, max_q_len: Optional[int]) -> kernels.QueryGrid:
        tokens = q.shape[0]
        return kernels.query_grid(num_seqs=kv_lens.shape[0], tokens=tokens,
                                  max_q_len=max_q_len if max_q_len is not None else tokens, group=self.group,
                                  block_rows=self.block_rows)

    def __call__(self, *args: Any) -> Tensor:
        if self._empty(args):
            # No query rows to compute (an empty grid, which Helion's eager mode mishandles).
            return torch.zeros_like(args[0], memory_format=torch.contiguous_format)
        return self._run(args, self.splits_for(args), None)

    def bind(self, args: tuple) -> Callable[..., Tensor] | None:
        """The run for calls of ``args``' signature (see :mod:`..kernels.launch_binding`): the split
        count and the kernels follow from the signature (sizes and the ``max_kv_len`` hint); the
        first call picks the kernels and binds them."""
        if self._empty(args):
            return None
        num_splits, bound, grid = self.splits_for(args), [], self._grid(args[0], args[5], args[10])
        return lambda *args: self._run(args, num_splits, bound, grid)

    @staticmethod
    def _empty(args: tuple) -> bool:
        return args[0].shape[0] == 0 or args[5].shape[0] == 0 or args[10] == 0

    def _run(self, args: tuple, num_splits: int, bound: list | None, grid: kernels.QueryGrid | None = None) -> Tensor:
        """One call; ``bound`` holds a signature's bound kernels (empty until its first call), None
        for a call that picks them from its arguments; ``grid``: the signature's query grid."""
        q = args[0]
        self.num_splits = num_splits  # the last call's, for the tests
        # Not zero-filled: the kernel writes every row, those no sequence owns as zeros. ``empty_like``:
        # the cheapest allocation call (``new_empty(q.shape)`` cost a decode layer several µs in place).
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if bound:
            attention, merge = bound
            # a recorded binding: its replay takes the tensors the host code took views of
            attention_args, merge_args = self._arguments(*args, out=out, num_splits=num_splits, grid=grid,
                                                         views=False)
            if replayed(attention, *attention_args):
                if merge is not None:
                    merge(*merge_args)
                return out
        attention_args, merge_args = self._arguments(*args, out=out, num_splits=num_splits, grid=grid)
        if not bound:
            attention, merge = self._launches(attention_args, merge_args)
            if bound is not None:  # kernels without host code (the Helion interpreter) run as they are
                bound[:] = [k.bound() if isinstance(k, HostLaunch) else k for k in (attention, merge)]
                attention, merge = bound
        attention(*attention_args)
        if merge is not None:
            merge(*merge_args)
        return out


def _flat_table(block_table: Tensor) -> tuple[Tensor, int]:
    """``(flat, row stride)``: the block table's rows as one 1-D view of its memory (no copy unless
    its columns are strided), row ``s`` at ``s * stride``."""
    rows, columns = block_table.shape
    if not rows or not columns:  # nothing to read; the kernel clamps into a one-entry table
        return block_table.new_zeros(1), 0
    if block_table.is_contiguous():  # the usual table: the same flat view, for less host work
        return block_table.view(-1), columns
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    stride = block_table.stride(0) if rows > 1 else columns
    return block_table.as_strided(((rows - 1) * stride + columns,), (1,)), stride


def _build_attention(key: AttentionKey, config: dict, args: tuple) -> Any:
    return _AttentionLaunch(key, config, args)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck)


def example_paged_batch(
    q_lens: list[int], kv_lens: list[int], *, num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str | torch.device, spare_blocks: int = 2,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens)`` for a batch whose blocks are
    scattered over the cache in a random order (so a kernel that ignored the table would fail)."""
    g = generator or torch.Generator().manual_seed(0)
    used = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(used) + spare_blocks
    width = max(used + [1])
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(used):
        table[seq, :count] = order[taken:taken + count]
        taken += count
    def random(*shape: int) -> Tensor:
        if torch.device(device).type == "meta":  # no values to draw: model-sized caches cost nothing
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randn(shape, generator=g).to(dtype)

    k_cache = random(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = random(num_blocks, block_size, num_kv_heads, head_dim)
    q = random(sum(q_lens), num_q_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, table, cu, lens))  # type: ignore[return-value]


def _example_attention(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    """``tokens`` query rows at head dim ``width``: a decode batch of ``tokens`` sequences up to 256
    tokens, else one prefill sequence; GQA 4:1."""
    on_cpu = torch.device(device).type == "cpu"
    heads_kv = 2 if on_cpu else 8
    context = 20 if on_cpu else 2048  # on the CPU: across a block boundary, and cheap in the interpreters
    if tokens <= 256:
        q_lens, kv_lens = [1] * tokens, [context + 7 * i for i in range(tokens)]
    else:
        q_lens, kv_lens = [tokens], [tokens]
    batch = example_paged_batch(q_lens, kv_lens, num_q_heads=4 * heads_kv, num_kv_heads=heads_kv, head_dim=width,
                                block_size=16, dtype=dtype, device=device)
    return (*batch, width**-0.5, None, None, None, max(q_lens), max(kv_lens))


# --------------------------------------------------------------------------------------------
# the op


paged_attention_op = Op(
    "paged_attention", paged_attention_reference, check=check_paged_attention, key=paged_attention_key,
    providers=[Provider(
        "helion", _build_attention, interpreters=frozenset({"triton", "helion"}), accepts=_attention_accepts,
        kernel=kernels.PAGED_ATTENTION, tuning_key=_attention_tuning_key, available=helion_available,
    )],
    example_inputs=_example_attention, native=lambda key: _EAGER_ATTENTION, fake=_paged_attention_shape,
)


# --------------------------------------------------------------------------------------------
# public API


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    kv_lens: Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
) -> Tensor:
    """Causal attention of a varlen batch over a paged KV cache (see the module docstring).

    Args:
        q: ``[tokens, num_q_heads, head_dim]``, fp32/fp16/bf16 (fp64 runs on the reference).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``q``'s dtype.
        block_table: ``[num_seqs, max_blocks]`` int32: the blocks of each sequence, in order.
        cu_seqlens_q: ``[num_seqs + 1]`` int32: sequence ``s`` owns query rows
            ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``.
        kv_lens: ``[num_seqs]`` int32: keys of each sequence in the cache, new tokens included.
        scale: logit scale (default ``head_dim ** -0.5``).
        sliding_window: each query sees its last ``sliding_window`` keys (itself included).
        softcap: ``softcap * tanh(logits / softcap)`` (Gemma-2).
        sinks: ``[num_q_heads]`` per-head sink logits joining the softmax denominator (gpt-oss).
        max_q_len, max_kv_len: optional host-side bounds of the query / key lengths (they size the
            grid and pick the decode strategy; never read from the device).

    Returns:
        ``[tokens, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5 if isinstance(q, Tensor) and q.dim() == 3 else 1.0
    if type(max_kv_len) is int:
        max_kv_len = widest_alike_kv_len(max_kv_len, k_cache, block_table)
    return paged_attention_op.call(
        q, k_cache, v_cache, block_table, cu_seqlens_q, kv_lens, scale, sliding_window, softcap, sinks,
        max_q_len, max_kv_len,
    )
