"""Helion kernels for ``paged_attention``: attention over the paged KV cache, and the split-KV merge.

Why Helion and not raw Triton: the attention loop needs gathers through the block table
(``k_cache[block_table[s, n // page] * page + n % page]``), data-dependent loop bounds (each
sequence's causal / sliding-window range) and masked loads and stores; Helion expresses all of
them, generates the Triton we would have written by hand, and is tested in *both* CPU tiers
(``TRITON_INTERPRET=1`` runs the generated Triton, ``HELION_INTERPRET=1`` the kernel body as
eager PyTorch), where a raw ``@triton.jit`` kernel only runs in the first.

Layouts (the op module builds these views without copying):

* ``q``, ``out``: ``[tokens * num_q_heads, head_dim]``: row ``t * Hq + h``.
* caches: ``[num_blocks * block_size, num_kv_heads, head_dim]``: the paged cache
  ``[num_blocks, block_size, Hkv, D]`` with its first two dims merged (slot = block * block_size
  + offset); any strides otherwise (the layout :mod:`.write_kv_cache` writes).
* ``block_table [num_seqs, max_blocks]`` int32, ``cu_seqlens_q [num_seqs + 1]`` and
  ``kv_lens [num_seqs]`` int32.

One program of :func:`_paged_attention` owns one KV head, one KV split and a block of one
sequence's *packed* query rows: row ``p`` is query token ``p // group`` of the sequence and query
head ``kv_head * group + p % group``, so the ``group`` query heads sharing a KV head share every K/V
load (GQA packing; a decode step still gives the dot products ``group`` rows). The blocks are laid
out per sequence (:func:`query_grid`): as many as the longest sequence needs for each (a decode
batch, one prompt), or, for a mixed batch, as many as each needs, a device map naming each
block's sequence, so one long prompt does not give every decode step its number of programs.

Query token ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys sits at position ``kv_len - q_len + i``;
it sees key ``j`` when ``j <= pos`` and, with a sliding window ``W``, ``j > pos - W``. The KV loop
only visits the range some row of the tile can see (causal and window skipping).

Softmax runs online in fp32, in base 2 (``exp2``; the scale carries ``log2(e)``). Attention
sinks (gpt-oss) start each row's running max at the head's sink logit with a running sum of 1:
the sink joins the denominator and contributes no value; without sinks the op passes ``-inf``
logits (running sum 0), and without a window a window longer than any sequence, so neither is a
compile-time variant. Logit softcap (Gemma-2) is applied to
the scaled logits, ``softcap * tanh(s / softcap)``, before masking.

Split-KV (flash-decoding): with ``num_splits > 1`` the grid gains a split dimension; split ``k``
of a sequence covers keys ``[k * c, (k + 1) * c)`` with ``c = ceil(kv_len / num_splits)`` computed
on the device from ``kv_len`` (so a CUDA graph captured once stays right as sequences grow), and
writes its normalised partial output and log-sum-exp; :func:`_merge_splits` combines the splits
(and the sink) per row. When to split is decided by :func:`choose_num_splits` (see there), per
call, from the batch's Python-int sizes and the device's SM count.

The kernels write every row of ``out``, so the op allocates it unfilled (no zero-fill launch per
call): the rows no sequence owns (before ``cu_seqlens_q[0]``, from ``cu_seqlens_q[num_seqs]`` on:
the padding of a captured or compacted batch) are zeroed by the kernel that writes ``out`` (the
one-pass kernel, or with splits the merge), each program taking an equal share before its own
rows (:func:`_unowned_share`; well-formed offsets keep the two kinds of rows apart).

Every address that comes from data (block ids, slots, row offsets) is clamped or masked into its
tensor, so malformed metadata gives wrong numbers, never an out-of-bounds access; the op's
reference path validates the metadata and raises.

NaN and infinities: the P @ V product takes only the finite values (a key a row cannot see has
probability 0, and 0 * NaN would be NaN); when a program met non-finite values, a second pass
over its keys adds them to exactly the rows that see them (:func:`_nonfinite_values`; key by key at
head dims above 128, :func:`_add_nonfinite_values`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .interpret import interpreter_mode
from .runtime import Config, Constexpr, HelionFunction, KernelSpec, next_power_of_2

#: ``helion.language``, bound by :class:`.runtime.HelionFunction` before its first compile
hl: Any = None

_constexpr = Constexpr


def _slots(keys: torch.Tensor, seq: torch.Tensor, table: torch.Tensor, table_stride: int, page: int,
           max_blocks: int, num_slots: int) -> torch.Tensor:
    """The cache slots of a sequence's keys through its block table (a flat view, row ``s`` at
    ``s * table_stride``: one index, as a sequence's index is a tensor), clamped into the cache."""
    column = torch.clamp(keys // page, 0, max_blocks - 1)
    block = hl.load(table, [seq * table_stride + column]).to(torch.int64)
    return torch.clamp(block * page + keys % page, 0, num_slots - 1)


def _nonfinite_values(visible: torch.Tensor, v_tile: torch.Tensor) -> torch.Tensor:
    """``[rows, head_dim]``: NaN, +inf or -inf where a row sees a key whose value is NaN (or both
    infinities), +inf or -inf in that dim, else 0; inlined into the kernel.

    One dot counts, per row and dim, the visible keys of each kind at once: a NaN counts 1, +inf
    256 and -inf 65536, in bf16 operands (exact: powers of two) with an fp32 sum, which stays exact
    and does not carry between kinds while a tile has at most 255 keys (the configs allow 128).
    """
    values = v_tile.to(torch.float32)  # compared in fp32: libdevice has no bf16 isnan
    code = torch.where(values != values, 1.0, torch.where(values == float("inf"), 256.0,
                       torch.where(values == float("-inf"), 65536.0, 0.0)))
    counts = hl.dot(visible.to(torch.bfloat16), code.to(torch.bfloat16), out_dtype=torch.float32)
    negatives = torch.floor(counts * (1.0 / 65536.0))
    positives = torch.floor(counts * (1.0 / 256.0)) - negatives * 256.0
    nans = counts - torch.floor(counts * (1.0 / 256.0)) * 256.0
    poisoned = (nans > 0.0) | ((positives > 0.0) & (negatives > 0.0))
    return torch.where(poisoned, float("nan"), torch.where(positives > 0.0, float("inf"),
                       torch.where(negatives > 0.0, float("-inf"), 0.0)))


def _add_nonfinite_values(acc: torch.Tensor, seen: torch.Tensor, v_key: torch.Tensor) -> torch.Tensor:
    """``acc [rows, head_dim]`` plus the NaN and infinite values of one key (``v_key [1, head_dim]``)
    in the rows that see it (``seen [rows, 1]``); inlined into the kernel. Added key by key they
    are sticky, as in the full sum of the products: +inf and -inf give NaN, NaN stays NaN.

    One key at a time, elementwise: nothing but the accumulator is live, where a dot counting the
    visible non-finite values (a ``[rows, head_dim]`` count tile beside it) made every 64-row tile
    at head dim 256 spill registers on sm_90, keeping prefill there off ``wgmma``.
    """
    # the tile's one key as vectors (Helion does not broadcast a block-size-1 tile dim against a full one)
    values = torch.sum(v_key.to(torch.float32), dim=0, keepdim=True)  # fp32: libdevice has no bf16 isnan
    sees = torch.amax(torch.where(seen, 1.0, 0.0), dim=1, keepdim=True) > 0.0
    nonfinite = (torch.abs(values) == float("inf")) | (values != values)
    return acc + torch.where(sees & nonfinite, values, 0.0)


#: Head dims above which the pass over non-finite values goes key by key (:func:`_add_nonfinite_values`):
#: there the dot's ``[rows, head_dim]`` count tile beside the accumulator made every 64-row tile
#: spill on sm_90, keeping prefill off ``wgmma``; at 128 and below the dot's pass keeps gfx1100's
#: 64x64 tiles from spilling (the key-by-key one spills 792 bytes there).
KEY_BY_KEY_HEAD_DIM = 128


def _unowned_share(cu_seqlens_q: torch.Tensor, num_seqs: int, heads: int, q_rows: int, program: int,
                   programs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(begin, end, head_end, tail_begin)``: program ``program`` of ``programs`` zeroes positions
    ``[begin, end)`` of the ``q_rows``-row output's rows no sequence owns, numbered from the head's
    ``[0, head_end)`` on to the tail's ``[tail_begin, q_rows)``; inlined into the kernels.

    Equal shares of ``ceil(q_rows / programs)`` rows, a division of sizes (padding can be most of a
    captured batch: too much for one program); offsets out of range are clamped into the output.
    """
    head_end = torch.clamp(hl.load(cu_seqlens_q, [0]).to(torch.int64) * heads, 0, q_rows)
    tail_begin = torch.clamp(hl.load(cu_seqlens_q, [num_seqs]).to(torch.int64) * heads, 0, q_rows)
    unowned = head_end + (q_rows - tail_begin)
    # A tensor: one division per program (as a size, `program * share` expands into one per term).
    share = hl.full([], (q_rows + programs - 1) // programs, torch.int64)
    begin = unowned - torch.clamp(unowned - program * share, min=0)  # min(program * share, unowned)
    return begin, torch.minimum(begin + share, unowned), head_end, tail_begin


def _unowned_row(position: torch.Tensor, head_end: torch.Tensor, tail_begin: torch.Tensor) -> torch.Tensor:
    """The output row at ``position`` among the rows no sequence owns (see :func:`_unowned_share`)."""
    position = position.to(torch.int64)
    return torch.where(position < head_end, position, position + (tail_begin - head_end))


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    sinks: torch.Tensor,
    block_seq: torch.Tensor,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    num_splits: int,
    packed_rows: int,
    max_blocks: int,
    table_stride: int,
    rows_per_block: int,
    blocks_per_seq: int,
    grid_rows: int,
    group: _constexpr,
    page: _constexpr,
    has_softcap: _constexpr,
    nonfinite_key_by_key: _constexpr,
    split: _constexpr,
    packed: _constexpr,
) -> None:
    num_seqs = kv_lens.size(0)
    num_kv_heads = k_cache.size(1)
    head_dim = hl.specialize(q.size(1))
    q_rows = q.size(0)
    num_slots = k_cache.size(0)
    # The host lays the grid out in blocks of `rows_per_block` rows: this block size (see `grid_block_rows`).
    block_rows = hl.register_block_size(MIN_QUERY_ROWS, MAX_QUERY_ROWS)
    block_keys = hl.register_block_size(num_slots)  # one key tile for both passes over the keys
    for tile_h, tile_k, tile_b in hl.tile([num_kv_heads, num_splits, grid_rows], block_size=[1, 1, block_rows]):
        kv_head = tile_h.begin
        split_id = tile_k.begin
        # The query block this program owns, and its sequence (see `query_grid`).
        # Tensors, not sizes: size arithmetic nests into expressions the Triton interpreter rejects.
        block_begin = hl.full([], tile_b.begin, torch.int64)
        block = block_begin // rows_per_block
        if packed:
            seq = hl.load(block_seq, [block]).to(torch.int64)
            first_block = (hl.load(cu_seqlens_q, [seq]).to(torch.int64) * group
                           + seq * (rows_per_block - 1)) // rows_per_block
        else:
            seq = block // blocks_per_seq
            first_block = seq * blocks_per_seq
        first_row = first_block * rows_per_block
        # The sequence's packed rows this program owns, in 32 bits as the tile's own index was: 64-bit
        # row vectors live through the key loop spilled registers at 64 x 128 on sm_80 and gfx1100.
        packed_index = (tile_b.index - first_row).to(torch.int32)
        packed_begin = block_begin - first_row
        packed_end = packed_begin + block_rows
        dims = hl.arange(head_dim).to(torch.int64)
        dims_ok = dims < head_dim
        # Zeroes first: after the attention (with nothing else live) the compilers spilled more.
        if not split:  # with splits, the merge writes `out`
            program = (kv_head * num_splits + split_id) * tile_b.count + tile_b.id
            zero_begin, zero_end, head_end, tail_begin = _unowned_share(
                cu_seqlens_q, num_seqs, num_kv_heads * group, q_rows, program,
                num_kv_heads * num_splits * tile_b.count)
            for tile_z in hl.tile(zero_begin, zero_end, block_size=block_keys):
                spare = _unowned_row(tile_z.index, head_end, tail_begin)
                hl.store(out, [spare, dims], hl.zeros([tile_z, head_dim], dtype=out.dtype),
                         extra_mask=(spare < q_rows)[:, None] & dims_ok[None, :])

        q_start = cu_seqlens_q[seq]
        q_len = cu_seqlens_q[seq + 1] - q_start
        kv_len = kv_lens[seq]
        token = packed_index // group
        head = kv_head * group + packed_index % group
        rows = (q_start + token).to(torch.int64) * (num_kv_heads * group) + head
        row_ok = (packed_index >= 0) & (token < q_len) & (rows >= 0) & (rows < q_rows)
        q_tile = hl.load(q, [rows, dims], extra_mask=row_ok[:, None] & dims_ok[None, :])
        position = kv_len - q_len + token

        # Keys some row of this tile can see, within this program's split.
        chunk = (kv_len + num_splits - 1) // num_splits
        kv_begin = split_id * chunk
        kv_end = torch.minimum(kv_begin + chunk, kv_len)
        kv_end = torch.minimum(kv_end, kv_len - q_len + ((packed_end - 1) // group + 1))
        kv_begin = torch.maximum(kv_begin, kv_len - q_len + (packed_begin // group - window + 1))
        # A block past the sequence's queries (the grid's spare blocks) has nothing to do.
        kv_end = torch.where((q_len > packed_begin // group) & (packed_begin >= 0), kv_end, 0)
        kv_begin = torch.minimum(kv_begin, kv_end)  # an empty range, never a reversed one

        if split:  # the merge adds the sinks
            row_max = hl.full([tile_b], float("-inf"), dtype=torch.float32)
            row_sum = hl.zeros([tile_b], dtype=torch.float32)
        else:  # no sinks: the op passes -inf logits
            row_max = hl.load(sinks, [head]).to(torch.float32) * 1.4426950408889634
            row_sum = torch.where(row_max == float("-inf"), 0.0, 1.0)
        acc = hl.zeros([tile_b, head_dim], dtype=torch.float32)
        unusual = hl.zeros([tile_b], dtype=torch.float32)  # NaN / infinite values met in V
        for tile_n in hl.tile(kv_begin, kv_end, block_size=block_keys):
            keys = tile_n.index
            slot = _slots(keys, seq, table, table_stride, page, max_blocks, num_slots)
            # Slots past the sequence's keys (a block's unwritten tail) are never read.
            key_ok = (keys < kv_end)[:, None] & dims_ok[None, :]
            k_tile = hl.load(k_cache, [slot, kv_head, dims], extra_mask=key_ok)
            v_tile = hl.load(v_cache, [slot, kv_head, dims], extra_mask=key_ok)
            logits = hl.dot(q_tile, k_tile.T, out_dtype=torch.float32)
            if has_softcap:
                logits = softcap * torch.tanh(logits * (scale / softcap)) * 1.4426950408889634
            else:
                logits = logits * (scale * 1.4426950408889634)
            visible = (keys[None, :] <= position[:, None]) & (keys[None, :] > position[:, None] - window)
            visible = visible & row_ok[:, None]
            logits = torch.where(visible, logits, float("-inf"))
            new_max = torch.maximum(row_max, torch.amax(logits, dim=1))
            # A row that has seen nothing yet keeps -inf; shift by 0 so exp2 gives 0, not NaN.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            probs = torch.exp2(logits - shift[:, None])
            rescale = torch.exp2(row_max - shift)
            row_sum = row_sum * rescale + torch.sum(probs, dim=1)
            # A key a row cannot see has probability 0, but 0 * NaN is NaN: the product takes the
            # finite values, and non-finite ones reach the rows that see them after the loop.
            finite = torch.abs(v_tile.to(torch.float32)) < float("inf")  # False for NaN and infinities
            v_finite = torch.where(finite, v_tile, 0.0).to(v_tile.dtype)
            acc = acc * rescale[:, None] + hl.dot(probs.to(v_tile.dtype), v_finite, out_dtype=torch.float32)
            unusual = unusual + torch.sum(torch.sum(torch.where(finite, 0.0, 1.0), dim=1), dim=0)
            row_max = new_max
        if torch.amax(unusual, dim=0) > 0.0:
            # Rare: NaN or infinities among the values. A second pass adds them (sticky under the
            # rescaling) to the rows that see them; apart from it, the hot loop stays as lean as before.
            if nonfinite_key_by_key:  # head dims above 128: see KEY_BY_KEY_HEAD_DIM
                for tile_j in hl.tile(kv_begin, kv_end, block_size=1):
                    j = tile_j.index
                    v_key = hl.load(v_cache, [_slots(j, seq, table, table_stride, page, max_blocks, num_slots), kv_head, dims],
                                    extra_mask=(j < kv_end)[:, None] & dims_ok[None, :])
                    sees_j = (j[None, :] <= position[:, None]) & (j[None, :] > position[:, None] - window)
                    acc = _add_nonfinite_values(acc, sees_j & row_ok[:, None], v_key)
            else:
                for tile_r in hl.tile(kv_begin, kv_end, block_size=block_keys):
                    again = tile_r.index
                    v_again = hl.load(v_cache, [_slots(again, seq, table, table_stride, page, max_blocks, num_slots), kv_head, dims],
                                      extra_mask=(again < kv_end)[:, None] & dims_ok[None, :])
                    seen = (again[None, :] <= position[:, None]) & (again[None, :] > position[:, None] - window)
                    acc = acc + _nonfinite_values(seen & row_ok[:, None], v_again)

        normaliser = torch.where(row_sum == 0.0, 1.0, row_sum)
        result = acc / normaliser[:, None]
        if split:
            lse = torch.where(row_sum == 0.0, float("-inf"), row_max + torch.log2(normaliser))
            # Flat partial rows (a sequence's index is a tensor here, which Helion cannot broadcast
            # beside two tensor indices): the merge reads them as [seqs, kv heads, splits, packed rows].
            part = ((seq * num_kv_heads + kv_head) * num_splits + split_id) * packed_rows + packed_index.to(torch.int64)
            hl.store(partial_lse, [part], lse, extra_mask=row_ok)
            hl.store(partial_out, [part, dims], result, extra_mask=row_ok[:, None] & dims_ok[None, :])
        else:
            hl.store(out, [rows, dims], result.to(out.dtype), extra_mask=row_ok[:, None] & dims_ok[None, :])


def _merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    sinks: torch.Tensor,
    out: torch.Tensor,
    group: _constexpr,
) -> None:
    num_seqs, num_kv_heads, num_splits, packed_rows = partial_lse.size()
    head_dim = hl.specialize(out.size(1))
    q_rows = out.size(0)
    split_block = hl.register_block_size(num_splits)
    row_block = hl.register_block_size(q_rows)  # rows zeroed at a time
    for tile_s, tile_h, tile_p in hl.tile([num_seqs, num_kv_heads, packed_rows], block_size=[1, 1, None]):
        seq = tile_s.begin
        kv_head = tile_h.begin
        dims = hl.arange(head_dim).to(torch.int64)
        dims_ok = dims < head_dim
        program = (seq * num_kv_heads + kv_head) * tile_p.count + tile_p.id
        zero_begin, zero_end, head_end, tail_begin = _unowned_share(
            cu_seqlens_q, num_seqs, num_kv_heads * group, q_rows, program, num_seqs * num_kv_heads * tile_p.count)
        for tile_z in hl.tile(zero_begin, zero_end, block_size=row_block):
            spare = _unowned_row(tile_z.index, head_end, tail_begin)
            hl.store(out, [spare, dims], hl.zeros([tile_z, head_dim], dtype=out.dtype),
                     extra_mask=(spare < q_rows)[:, None] & dims_ok[None, :])

        q_start = cu_seqlens_q[seq]
        q_len = cu_seqlens_q[seq + 1] - q_start
        token = tile_p.index // group
        head = kv_head * group + tile_p.index % group
        rows = (q_start + token).to(torch.int64) * (num_kv_heads * group) + head
        row_ok = (token < q_len) & (rows >= 0) & (rows < q_rows)
        sink = hl.load(sinks, [head]).to(torch.float32) * 1.4426950408889634
        row_max = sink
        for tile_k in hl.tile(num_splits, block_size=split_block):
            lse = partial_lse[seq, kv_head, tile_k, tile_p]
            row_max = torch.maximum(row_max, torch.amax(lse, dim=0))
        shift = torch.where(row_max == float("-inf"), 0.0, row_max)
        row_sum = torch.exp2(sink - shift)  # 0 for an absent (-inf) sink
        acc = hl.zeros([tile_p, head_dim], dtype=torch.float32)
        for tile_k in hl.tile(num_splits, block_size=split_block):
            weight = torch.exp2(partial_lse[seq, kv_head, tile_k, tile_p] - shift[None, :])
            row_sum = row_sum + torch.sum(weight, dim=0)
            part = hl.load(partial_out, [seq, kv_head, tile_k, tile_p, dims], extra_mask=dims_ok[None, None, :])
            acc = acc + torch.sum(weight[:, :, None] * part, dim=0)
        result = acc / torch.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        hl.store(out, [rows, dims], result.to(out.dtype), extra_mask=row_ok[:, None] & dims_ok[None, :])


# --------------------------------------------------------------------------------------------
# the query grid


#: Bounds of the query rows one program owns (the eager interpreter runs blocks of the maximum).
MIN_QUERY_ROWS, MAX_QUERY_ROWS = 16, 256


def grid_block_rows(config: Config, args: tuple[Any, ...], *, int64: bool) -> int:
    """The block of query rows the attention kernel runs ``config`` with on arguments like ``args``,
    which the host lays its grid out in: Helion's, not the config's (it raises a block below a dot's
    minimum on the device: 16 on NVIDIA GPUs)."""
    launched = paged_attention_kernel.launched_block_sizes(config, args, int64=int64)
    return MAX_QUERY_ROWS if launched is None else launched[0]


class QueryGrid(NamedTuple):
    """How the programs of one (KV head, split) cover a batch's packed query rows, in blocks of
    ``block_rows`` (see :func:`query_grid`)."""

    packed: bool
    blocks_per_seq: int  # the uniform layout's blocks per sequence
    blocks: int

    def rows(self, block_rows: int) -> int:
        return self.blocks * block_rows


def query_grid(*, num_seqs: int, tokens: int, max_q_len: int, group: int, block_rows: int) -> QueryGrid:
    """The layout with fewer programs, from Python ints only (no device read).

    *Uniform*: every sequence gets the blocks the longest one needs, ``ceil(max_q_len * group /
    block_rows)``; sequence ``s`` owns blocks ``[s * m, (s + 1) * m)``. Exact for a decode batch
    or one prompt, but a mixed batch (one 512-token prompt beside 63 decodes) would leave ~95% of
    its programs idle.

    *Packed*: sequence ``s`` starts at block ``(cu_seqlens_q[s] * group + s * (block_rows - 1)) //
    block_rows``, so it owns at least ``ceil(q_len * group / block_rows)`` blocks (``floor(a + b) -
    floor(a) >= floor(b)``) and the batch at most ``(tokens * group + num_seqs * (block_rows - 1))
    // block_rows``; the device maps blocks to sequences (:func:`block_sequences`). The kernel
    reads the start of its own sequence from ``cu_seqlens_q``, so both sides agree on every
    block without the host knowing the query lengths.
    """
    per_seq = max(-(-max_q_len * group // block_rows), 1)
    uniform = max(num_seqs * per_seq, 1)  # an empty batch still compiles (and launches nothing)
    packed = (tokens * group + num_seqs * (block_rows - 1)) // block_rows
    if 0 < packed < uniform:
        return QueryGrid(True, per_seq, packed)
    return QueryGrid(False, per_seq, uniform)


def block_sequences(cu_seqlens_q: torch.Tensor, group: int, block_rows: int, blocks: int) -> torch.Tensor:
    """``[blocks]`` int32: the sequence owning each block of a packed :func:`query_grid` (blocks past
    the last sequence's go to it and find no rows). Six small launches, no host read: each
    sequence's first block, then a search of the blocks among them."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    device = cu_seqlens_q.device
    # s * (block_rows - 1) + cu_seqlens_q[s] * group, floored by block_rows (64-bit: no overflow)
    steps = torch.arange(0, (num_seqs + 1) * (block_rows - 1), block_rows - 1, device=device)
    first = torch.add(steps, cu_seqlens_q, alpha=group).floor_divide_(block_rows)
    owner = torch.searchsorted(first[1:], torch.arange(blocks, device=device), right=True, out_int32=True)
    return owner.clamp_(max=num_seqs - 1)


# fp32 dots in exact fp32: Triton's TF32 default would put fp32 attention outside the fp32 tolerance.
paged_attention_kernel = HelionFunction(_paged_attention, dot_precision="ieee")
merge_splits_kernel = HelionFunction(_merge_splits)


# --------------------------------------------------------------------------------------------
# the split-KV heuristic

#: A split below this many keys costs more in the merge than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 512
MAX_SPLITS = 32
#: From this many keys a decode key at head dim 128 takes the measured long-context default.
LONG_DECODE_KV = 2048


def target_programs(device: torch.device) -> int:
    """How many (sequence, KV head) programs it takes to fill ``device``: two per SM on GPUs."""
    if device.type == "cuda" and torch.cuda.is_available():
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return 2 * getattr(torch.xpu.get_device_properties(device), "gpu_subslice_count", 64)
    return 16  # the CPU interpreters: a token number, the tests force splits through configs


def choose_num_splits(*, decode: bool, num_seqs: int, num_kv_heads: int, max_kv_len: int, programs: int) -> int:
    """Flash-decoding's rule: split the KV range only where the grid would leave the device idle.

    A decode batch (one query per sequence) has ``num_seqs * num_kv_heads`` programs; when that is
    below ``programs`` (two per SM) and the context is long, each sequence's keys are cut into
    ``min(ceil(programs / (num_seqs * num_kv_heads)), ceil(max_kv_len / 512), 32)`` splits, merged by
    a second small kernel. Prefill and mixed batches have enough query tiles and never split.
    """
    work = max(num_seqs * num_kv_heads, 1)
    if not decode or work >= programs or max_kv_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    by_parallelism = -(-programs // work)
    by_length = -(-max_kv_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


# --------------------------------------------------------------------------------------------
# configs
#
# paged_attention keys: {"dtype", "head_dim", "group", "block_size", "decode", "kv_len", "tokens"}
# (kv_len bucketed like tokens). Configs: {"block_sizes": [rows, keys], "num_warps", "num_stages",
# "num_splits": "auto" | int}; "auto" applies choose_num_splits on the calling device.


def _query_rows(key: Mapping[str, Any]) -> int:
    group = int(key["group"])
    if key.get("decode"):
        return max(16, next_power_of_2(group))
    return 64 if group <= 4 else 128


def default_paged_attention_config(key: Mapping[str, Any]) -> Config:
    head_dim = int(key["head_dim"])
    rows = _query_rows(key)
    if interpreter_mode() == "triton":
        # The interpreter pays per element for the row max (a reduction with a custom combine
        # function runs element by element) and per op for everything else: no padding rows in
        # decode tiles, moderate tiles otherwise.
        rows = next_power_of_2(int(key["group"])) if key.get("decode") else 32
        return {"block_sizes": [rows, 64], "num_warps": 4, "num_stages": 1, "num_splits": "auto"}
    # A head dim that is not a power of two is padded to one in registers (80 -> 128).
    width = next_power_of_2(head_dim)
    if key.get("dtype") == "float32":
        # Exact fp32 products run on FMA units with both operands in registers: 64x64 tiles at
        # head dim 128 need ~230 fp32 registers a thread and spill on every NVIDIA target; 32x16
        # tiles at head dim 64 still spill a few bytes on 4 warps on sm_90.
        rows = min(rows, 32)
        return {"block_sizes": [rows, 16], "num_warps": 4 if rows * width < 32 * 64 else 8, "num_stages": 2,
                "num_splits": "auto"}
    if (key.get("decode") and head_dim == 128 and int(key["group"]) <= 16
            and int(key.get("kv_len", 0)) >= LONG_DECODE_KV):
        # Measured on an H200 (bench/results/h200/campaign-2026-12-04, group 4): at 2K-8K keys,
        # 16x16 tiles on 2 warps with 32 KV splits ran decode 2.1-2.5x faster than the tiles below
        # without splits (1x8192: 73 against 168 us; 64x2048: 419 against 890; 64x8192: 1403
        # against 3497) and won the tuner's 1x2048 search. At head dim 128 they compile without
        # spills on every target; at 64 and 256 they spill (sm_90, sm_100, gfx1100).
        return {"block_sizes": [16, 16], "num_warps": 2, "num_stages": 1, "num_splits": 32}
    keys = 64 if head_dim <= 128 else 32
    if width > 128:  # 64 x 256 tiles spill 120 bytes on gfx942 even on 8 warps
        rows = min(rows, 32)
    # With the non-finite bookkeeping of the hot loop, 16 rows x 128 dims on 4 warps already sit at
    # sm_90's 255-register limit (44 bytes spilled) and 64 x 128 spill hundreds of bytes on every
    # NVIDIA target: 8 warps from 16 x 128 (no spills on sm_90 or gfx942; sm_80 prefill still spills).
    warps = 4 if rows * width < 16 * 128 else 8
    return {"block_sizes": [rows, keys], "num_warps": warps, "num_stages": 2 if key.get("decode") else 3,
            "num_splits": "auto"}


def paged_attention_candidates(key: Mapping[str, Any]) -> list[Config]:
    candidates = [default_paged_attention_config(key)]
    decode = bool(key.get("decode"))
    group = int(key["group"])
    row_choices = (max(16, next_power_of_2(group)), max(32, next_power_of_2(group))) if decode else (32, 64, 128)
    split_choices: tuple[Any, ...] = ("auto", 1, 2, 4, 8, 16, 32) if decode else ("auto",)
    for rows in row_choices:
        for keys in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    for splits in split_choices:
                        config = {"block_sizes": [rows, keys], "num_warps": warps, "num_stages": stages,
                                  "num_splits": splits}
                        if config not in candidates:
                            candidates.append(config)
    return candidates


def split_launch_config(config: Config) -> tuple[Any, Config]:
    """``num_splits`` (ours) and the Helion config proper."""
    helion_config = dict(config)
    return helion_config.pop("num_splits", "auto"), helion_config


def merge_config(num_splits: int, packed_rows: int) -> Config:
    """The merge kernel's config (not tuned: it moves ``num_splits`` partial rows per output row)."""
    # block sizes: splits, rows zeroed at a time (those no sequence owns), packed rows
    return {"block_sizes": [next_power_of_2(num_splits), 16, min(next_power_of_2(max(packed_rows, 1)), 64)],
            "num_warps": 4, "num_stages": 1}


PAGED_ATTENTION = KernelSpec(
    "paged_attention",
    (_slots, _nonfinite_values, _add_nonfinite_values, _unowned_share, _unowned_row, _paged_attention, _merge_splits),
    default_paged_attention_config,
    paged_attention_candidates,
)
