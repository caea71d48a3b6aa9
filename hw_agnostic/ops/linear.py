"""``linear``: ``x @ weight.T + bias``, exactly as ``F.linear`` computes it, scheduled for the CPU's BLAS.

Dense projections belong to the device's BLAS (cuBLAS, hipBLASLt, oneDNN, MKL), and a compiled
graph plans them itself, so this op has no DSL kernel and is no custom op: everywhere but one
case it *is* ``F.linear``. The case: fp32 on the CPU through MKL, with a few to a few hundred
rows. MKL's SGEMM then re-packs the whole weight for every call, and a weight of tens of MB
packed at once leaves the caches: at 8 rows a Llama-3-8B ``gate_up`` projection (28672 x 4096)
took 74 ms in one call and 45 ms as 28 calls of 1024 output columns each, on a 2-core AMD EPYC
(two threads; one thread: 83 against 54). Each column block is one ``mm``/``addmm`` writing its
slice of the output in place, so every output element is the same dot product, summed in the
same order by the same kernel: the result equals ``F.linear``'s bit for bit (the tests check a
grid of shapes, with and without bias, 2-D and 3-D inputs, unaligned views). That holds on one or
two intra-op threads (1008 cases at each on an Intel Xeon, 576 at two on an AMD EPYC); with three
or more MKL partitions a block's work differently from the whole product's (it splits
the sums themselves: 58 of 360 cases differed in the last bits at 3-32 threads), so there the
one call runs. Single rows (MKL's GEMV, which packs nothing) and 16-bit weights (oneDNN, which
gained nothing) keep the one call too.

Measured speed-ups (F.linear / blocked, fp32, two threads), rows 4-32: ``gate_up`` 1.3-1.7x,
``down`` (4096 x 14336) 1.1-1.2x, ``qkv`` (6144 x 4096) 1.15-1.2x; at 512 rows 1.0-1.07x. That
machine's last-level cache is 32 MiB. On an Intel Xeon whose last level holds 504 MiB, measured
in the model suite's 2-layer Llama-3-8B-wide model (every projection's weight cycling through the
cache, as in a real step; one weight timed alone stays cached and misleads) the blocks took a
decode step of 8 rows from 197 to 191 ms and a 16-token prompt from 210 to 197, but a 64-token one
from 312 to 314 ms, 128 tokens from 486 to 493 and 512 from 1676 to 1688. A weight many times the
cache gains at every row count (the EPYC); one about the cache's size only at a few rows. So past
:data:`FEW_ROWS` rows the blocks run only for a weight over twice the CPU's largest cache
(:func:`min_blocked_weight_bytes`; never where the machine does not say).
"""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import Tensor

from ..autotune.platform import largest_cache_bytes

#: Output columns per BLAS call (the fastest of 256-4096 at 4-512 rows on the EPYC, within 3% of 512).
BLOCK_COLUMNS = 1024
#: Rows the blocked schedule takes: one row is MKL's GEMV; past a thousand rows the packing is amortised.
MIN_ROWS, MAX_ROWS = 2, 1024
#: Intra-op threads up to which MKL computes each block's elements as the whole product does.
MAX_THREADS = 2
_MKL = torch.backends.mkl.is_available()
_PLAIN = (Tensor, torch.nn.Parameter)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``: the same values, bit for bit, in less time where
    :func:`blocked_columns` applies (see the module docstring)."""
    if weight.shape[0] < 2 * BLOCK_COLUMNS or not blocked_columns(x, weight, bias):
        return F.linear(x, weight, bias)
    columns, width = weight.shape
    out = torch.empty((*x.shape[:-1], columns), dtype=x.dtype, device=x.device)
    rows, out_rows = x.view(-1, width), out.view(-1, columns)
    # The last block also takes the columns short of a whole block: a GEMM only a few columns wide
    # is another MKL kernel, summing in another order (5 trailing columns of 2053 came out different).
    last = (columns // BLOCK_COLUMNS - 1) * BLOCK_COLUMNS
    for start in range(0, last + 1, BLOCK_COLUMNS):
        block = slice(start, start + BLOCK_COLUMNS if start < last else columns)
        if bias is None:
            torch.mm(rows, weight[block].t(), out=out_rows[:, block])
        else:
            torch.addmm(bias[block], rows, weight[block].t(), out=out_rows[:, block])
    return out


#: Rows up to which the blocks pay for any weight (past them: only for a weight over twice the cache).
FEW_ROWS = 32


def min_blocked_weight_bytes(rows: int) -> int:
    """The weight size (bytes) above which the column blocks pay for ``rows`` rows: 0 up to
    :data:`FEW_ROWS` rows; past them twice the CPU's largest cache, or ``sys.maxsize`` (never) where
    the machine does not say its size (see the module docstring)."""
    if rows <= FEW_ROWS:
        return 0
    cache = _cpu_cache_bytes()
    return 2 * cache if cache else sys.maxsize


@functools.lru_cache(maxsize=1)
def _cpu_cache_bytes() -> int | None:
    return largest_cache_bytes(torch.device("cpu"))


def blocked_columns(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether this call's inputs admit the column blocks and its weight is large enough for them to
    pay (:func:`min_blocked_weight_bytes`; see the module docstring): :func:`linear` takes them when
    this holds and the weight has at least two blocks of output columns, else it calls ``F.linear``."""
    # Cheapest refusals first: this runs on every projection of a decode step (0.4 µs, not 1.2).
    # Compiling is asked before any size is read, so a traced call guards on no row count.
    if x.dtype != torch.float32 or not _MKL or x.dim() < 2 or torch.compiler.is_compiling():
        return False
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if not MIN_ROWS <= rows <= MAX_ROWS or torch.get_num_threads() > MAX_THREADS:
        return False
    if not (type(x) in _PLAIN and type(weight) in _PLAIN and (bias is None or type(bias) in _PLAIN)):
        return False
    if x.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] != width:
        return False
    if weight.nbytes <= min_blocked_weight_bytes(rows):
        return False
    if not (x.is_contiguous() and weight.is_contiguous() and weight.device.type == "cpu"):
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1] or bias.stride(0) != 1
                             or bias.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    # Forward-mode AD (jvp, dual tensors) and vmap have no rule for out= calls (they raise on
    # them); autocast skips out= calls (F.linear's output would be bf16, the blocks' fp32); a
    # dispatch mode (make_fx, a flop counter) would see mm.out calls where the model makes a linear.
    return not (forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
                or torch.is_autocast_enabled("cpu") or torch._C._len_torch_dispatch_stack())
