"""``write_kv_cache``: write keys and values into the paged KV cache; the cache's own checks.

The paged cache
===============

``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token slot
``s`` is ``(s // block_size, s % block_size)``; a sequence's keys live in the blocks its row of
``block_table [num_seqs, max_blocks]`` (int32) lists, key ``j`` in block ``block_table[seq, j //
block_size]`` at offset ``j % block_size``. Any block size from 1 up works; the kernels are tuned
for 16 to 256. :mod:`.paged_attention` attends over it, and shares the checks of the caches and
of their int32 metadata defined here.

``write_kv_cache(key, value, k_cache, v_cache, slot_mapping)`` writes token ``t`` of ``key`` /
``value`` (``[tokens, num_kv_heads, head_dim]``) into slot ``slot_mapping[t]`` of the caches, in
place; a negative slot marks a padding token and is skipped.

What is checked where
=====================

* Every call (every provider, also while ``torch.compile`` traces): metadata only, never a
  device sync: dtypes, ranks, devices, ``key`` / ``value`` against the cache, ``v_cache``
  against ``k_cache``, one slot per token.
* The reference path (CPU, and any call no kernel accepts) also checks the *data*, since it
  synchronises anyway: slots within the cache and not repeated. :func:`validate_slot_mapping`
  runs the same check on demand.
* The kernel path does not read data on the host, so a decode step can be captured in a CUDA
  graph. Out-of-range slots are masked inside the kernel, so bad metadata gives wrong numbers,
  never an out-of-bounds access or a corrupted neighbour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..autotune.keys import token_bucket
from ..kernels import write_kv_cache as kernels
from ..kernels.launch_binding import bindable, replayed
from ..kernels.runtime import helion_available
from . import checks
from .registry import Op, Provider

#: The dtype of the cache's metadata (block tables, query offsets, key lengths).
INDEX_DTYPES = (torch.int32,)
SLOT_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# data checks (they synchronise: the reference path and debugging only)


def validate_slot_mapping(op: str, slot_mapping: Tensor, num_slots: int) -> None:
    """Raise ``ValueError`` if a slot is past the cache or two tokens write one slot."""
    slots = slot_mapping[slot_mapping >= 0]
    if slots.numel() == 0:
        return
    largest = int(slots.max())
    if largest >= num_slots:
        raise ValueError(
            f"{op}: slot_mapping holds slot {largest}, past the cache's {num_slots} slots "
            "(num_blocks * block_size); negative slots mark padding"
        )
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError(f"{op}: slot_mapping writes one slot twice; every token needs its own slot")


def validate_written_rows(op: str, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Raise ``ValueError`` if a key row and a value row this call writes share memory (caches that
    are views of one buffer: the metadata must keep K and V apart)."""
    if not checks.overlap(k_cache, v_cache):
        return
    slots = slot_mapping[slot_mapping >= 0].long()
    if slots.numel() == 0:
        return

    def row_starts(cache: Tensor) -> Tensor:  # byte address of each written slot's [heads, dim] row
        block, offset = slots // cache.shape[1], slots % cache.shape[1]
        elements = block * cache.stride(0) + offset * cache.stride(1)
        return cache.data_ptr() + elements * cache.element_size()

    size = k_cache.element_size()
    span = ((k_cache.shape[2] - 1) * abs(k_cache.stride(2)) + (k_cache.shape[3] - 1) * abs(k_cache.stride(3)) + 1) * size
    keys, values = torch.sort(row_starts(k_cache))[0], row_starts(v_cache)
    at = torch.searchsorted(keys, values).clamp(max=keys.numel() - 1)
    before = (at - 1).clamp(min=0)
    clash = ((keys[at] - values).abs() < span) | ((keys[before] - values).abs() < span)
    if bool(clash.any()):
        slot = int(slots[int(clash.nonzero()[0])])
        raise ValueError(
            f"{op}: k_cache and v_cache are views of one buffer and slot {slot}'s value row shares memory with "
            "a key row this call writes; the slots (block table) must keep keys and values apart"
        )


# --------------------------------------------------------------------------------------------
# the spec


def write_kv_cache_reference(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    validate_slot_mapping("write_kv_cache", slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    validate_written_rows("write_kv_cache", k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _write_kv_cache_shape(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    return None


class _ReferenceWrite:
    """What the reference provider runs (eagerly: the spec's checks read the slots on the host,
    which a full-graph compile cannot trace): where no slot is padding and the caches lie apart,
    the spec's checks as one ``aminmax`` (and, for more than one token, a sort for a slot written
    twice; up to :data:`LISTED_SLOTS` slots, one read of them as a list) and its writes as one
    ``index_copy_`` into each cache's slots; the spec itself
    otherwise, or where its checks would raise (it names the bad slot). The same bytes land in the
    same places: one bf16 token 1024 wide, 16 µs against the spec's 51 (its checks and boolean-mask
    gathers cost 15 ATen ops and three host reads); 512 tokens 246 against 559."""

    def __init__(self, reference: Any) -> None:
        self.reference = reference

    def __call__(self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        tokens = slot_mapping.shape[0]
        if not tokens or checks.overlap(k_cache, v_cache):
            return self.reference(key, value, k_cache, v_cache, slot_mapping)
        try:
            k_slots, v_slots = slot_view(k_cache), slot_view(v_cache)
        except RuntimeError:  # blocks and offsets that do not merge into one slot dimension
            return self.reference(key, value, k_cache, v_cache, slot_mapping)
        slots = slot_mapping.long()
        if tokens <= LISTED_SLOTS:  # one host read, compared in Python
            listed = slot_mapping.tolist()
            low, high, repeats = min(listed), max(listed), tokens > 1 and len(set(listed)) < tokens
        else:
            low, high = (int(v) for v in torch.aminmax(slot_mapping))
            repeats = tokens > 1 and _repeats(slots)
        if low < 0 or high >= k_slots.shape[0] or repeats:
            return self.reference(key, value, k_cache, v_cache, slot_mapping)
        k_slots.index_copy_(0, slots, key.to(k_cache.dtype))
        v_slots.index_copy_(0, slots, value.to(v_cache.dtype))


#: Calls of up to this many slots read them to the host as one list for the checks (a decode step:
#: ~1 us, where ``aminmax`` and its two reads took ~4); more by tensor ops (a sort finds repeats).
LISTED_SLOTS = 256

#: the op's native form: what the reference provider runs when compiling is on or in native mode
_EAGER_WRITE = _ReferenceWrite(write_kv_cache_reference)


def _repeats(slots: Tensor) -> bool:
    ordered = slots.sort().values
    return bool((ordered[1:] == ordered[:-1]).any())


# --------------------------------------------------------------------------------------------
# checks (the caches and their metadata: also paged_attention's)


def _check_cache(op: str, name: str, cache: Tensor) -> None:
    checks.tensor(op, name, cache)
    if cache.dim() != 4:
        raise ValueError(
            f"{op}: {name} must be [num_blocks, block_size, num_kv_heads, head_dim]; got shape {tuple(cache.shape)}"
        )
    if cache.shape[1] < 1 or cache.shape[2] < 1 or cache.shape[3] < 1:
        raise ValueError(f"{op}: {name} must have block_size, num_kv_heads and head_dim >= 1; got {tuple(cache.shape)}")


def check_caches(op: str, k_cache: Tensor, v_cache: Tensor) -> None:
    _check_cache(op, "k_cache", k_cache)
    _check_cache(op, "v_cache", v_cache)
    checks.same_device(op, "v_cache", v_cache, "k_cache", k_cache)
    checks.same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    checks.same_shape(op, "v_cache", v_cache, "k_cache", k_cache)


def check_index(op: str, name: str, value: Any, dim: int, reference: Tensor,
                 dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {names}; got {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimension(s); got shape {tuple(value.shape)}")
    checks.same_device(op, name, value, "k_cache", reference)
    return value


def check_write_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    op = "write_kv_cache"
    check_caches(op, k_cache, v_cache)
    for name, tensor in (("key", key), ("value", value)):
        checks.tensor(op, name, tensor)
        checks.same_device(op, name, tensor, "k_cache", k_cache)
        if tensor.dim() != 3:
            raise ValueError(f"{op}: {name} must be [tokens, num_kv_heads, head_dim]; got shape {tuple(tensor.shape)}")
        if tuple(tensor.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(
                f"{op}: {name} has {tensor.shape[1]} heads of dim {tensor.shape[2]} but the cache holds "
                f"{k_cache.shape[2]} heads of dim {k_cache.shape[3]} (k_cache shape {tuple(k_cache.shape)})"
            )
        if tensor.dtype != k_cache.dtype:
            raise TypeError(f"{op}: {name} must have the cache's dtype ({k_cache.dtype}); got {tensor.dtype}")
    checks.same_shape(op, "value", value, "key", key)
    check_index(op, "slot_mapping", slot_mapping, 1, k_cache, SLOT_DTYPES)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping must have one slot per token ({key.shape[0]}); got {slot_mapping.shape[0]}"
        )
    # The two caches may be views of one buffer (transformers' continuous-batching cache interleaves
    # K and V pages, and its block table keeps them apart): the slots written are checked on the
    # reference path (validate_written_rows), the caches against everything the op reads here.
    checks.no_aliasing(op, (("k_cache", k_cache), ("v_cache", v_cache)),
                       (("key", key), ("value", value), ("slot_mapping", slot_mapping)), among_written=False)


# --------------------------------------------------------------------------------------------
# keys


def caches_flatten(*caches: Tensor) -> bool:
    """Whether each cache views as ``[num_blocks * block_size, heads, dim]`` (one slot stride)."""
    return all(c.shape[0] <= 1 or c.stride(0) == c.shape[1] * c.stride(1) for c in caches)


class WriteKey(NamedTuple):
    device: str
    dtype: torch.dtype
    slot_dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    caches_flatten: bool
    tokens: int
    int64: bool


def write_kv_cache_key(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> WriteKey:
    return WriteKey(
        key.device.type, key.dtype, slot_mapping.dtype, key.shape[1], key.shape[2], caches_flatten(k_cache, v_cache),
        token_bucket(key.shape[0]), checks.needs_int64(key, value, k_cache, v_cache),
    )


# --------------------------------------------------------------------------------------------
# the Helion provider


def _write_accepts(key: WriteKey) -> str | None:
    if key.dtype not in checks.KERNEL_DTYPES:
        return f"dtype {key.dtype} not supported (kernel dtypes: fp32, fp16, bf16)"
    if not key.caches_flatten:
        return "a cache's block and slot dims do not merge into one slot stride"
    return None


def _write_tuning_key(key: WriteKey) -> dict[str, object]:
    return {"dtype": str(key.dtype).removeprefix("torch."), "head_dim": key.head_dim, "num_kv_heads": key.num_kv_heads}


def slot_view(cache: Tensor) -> Tensor:
    shape = cache.shape  # read once: each read builds a torch.Size (four cost 0.3 us of a decode-step call)
    return cache.view(shape[0] * shape[1], shape[2], shape[3])


def _build_write(key: WriteKey, config: dict, args: tuple) -> Any:
    k, v, k_cache, v_cache, slot_mapping = args
    launch = kernels.write_kv_cache_kernel.compile(
        config, (k, v, slot_view(k_cache), slot_view(v_cache), slot_mapping), int64=key.int64
    )

    def running(launch: Any) -> Callable[..., None]:
        def run(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
            # the caches stand for their slot views where the launch replays (see launch_binding.BoundLaunch.replays)
            if key.shape[0] and k_cache.shape[0] and not replayed(launch, key, value, k_cache, v_cache, slot_mapping):
                launch(key, value, slot_view(k_cache), slot_view(v_cache), slot_mapping)

        return run

    return bindable(running, launch)


# --------------------------------------------------------------------------------------------
# example inputs (tuner, benchmarks, opcheck)


def _example_write(tokens: int, width: int, dtype: torch.dtype, device: str) -> tuple:
    g = torch.Generator().manual_seed(tokens)
    heads, block_size = 2, 16
    num_blocks = -(-tokens // block_size) + 2
    key = torch.randn(tokens, heads, width, generator=g).to(dtype)
    value = torch.randn(tokens, heads, width, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    k_cache = torch.zeros(num_blocks, block_size, heads, width, dtype=dtype)
    return tuple(t.to(device) for t in (key, value, k_cache, k_cache.clone(), slots))


# --------------------------------------------------------------------------------------------
# the op


write_kv_cache_op = Op(
    "write_kv_cache", write_kv_cache_reference, check=check_write_kv_cache, key=write_kv_cache_key,
    providers=[Provider(
        "helion", _build_write, interpreters=frozenset({"triton", "helion"}), accepts=_write_accepts,
        kernel=kernels.WRITE_KV_CACHE, tuning_key=_write_tuning_key, available=helion_available,
    )],
    mutates_args=("k_cache", "v_cache"), example_inputs=_example_write, native=lambda key: _EAGER_WRITE,
    fake=_write_kv_cache_shape,
)


# --------------------------------------------------------------------------------------------
# public API


def write_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key`` / ``value`` ``[tokens, num_kv_heads, head_dim]`` into the paged caches, in place.

    Token ``t`` goes to slot ``slot_mapping[t]`` (int32 or int64): block ``slot // block_size``,
    offset ``slot % block_size`` of ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. A negative slot marks a padding token, which is skipped. ``key`` / ``value`` may
    be strided views (e.g. of a fused QKV projection); they must have the caches' dtype.
    """
    write_kv_cache_op.call(key, value, k_cache, v_cache, slot_mapping)
