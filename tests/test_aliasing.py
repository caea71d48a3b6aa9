"""Ops that write their arguments refuse arguments that share memory, by address, not by storage.

The in-place fused norms write ``x`` and ``residual``, ``write_kv_cache`` writes the caches. A
written tensor whose elements alias each other (a stride of 0, interleaving strides), or that
shares memory with another argument (also through a second storage over the same buffer:
``torch.frombuffer``, an untyped-storage view, ``as_strided``), gets an error naming both; layouts
that only interleave without sharing an element (``buf[..., ::2]`` / ``buf[..., 1::2]``, the K and V
halves of one ``[blocks, 2, ...]`` cache) are accepted.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hw_agnostic import ops
from hw_agnostic.ops import checks


def _write(key, value, k_cache, v_cache, slots=None):
    slots = torch.arange(key.shape[0], dtype=torch.int32) if slots is None else slots
    ops.write_kv_cache(key, value, k_cache, v_cache, slots)


def _kv(tokens=3):
    return torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)


def _cache(blocks=4):
    return torch.zeros(blocks, 4, 2, 8)


def _two_storages_over_one_buffer():
    """Two caches through ``torch.frombuffer``, one slot row (2 x 8 floats) apart: two storages."""
    buffer = bytearray(4 * 4 * 2 * 8 * 4 * 2)
    k = torch.frombuffer(buffer, dtype=torch.float32, count=4 * 4 * 2 * 8).view(4, 4, 2, 8)
    v = torch.frombuffer(buffer, dtype=torch.float32, count=4 * 4 * 2 * 8, offset=2 * 8 * 4).view(4, 4, 2, 8)
    return k, v


def _untyped_view(cache):
    """A second tensor over ``cache``'s memory through its untyped storage (another storage object)."""
    alias = torch.empty(0, dtype=cache.dtype)
    alias.set_(cache.untyped_storage(), cache.storage_offset(), cache.shape, cache.stride())
    return alias


REFUSED = [
    # One buffer under both caches, with key and value rows written to the same memory (the reference
    # path reads the slots; the kernel path cannot without a host sync).
    ("k_cache and v_cache are views of one buffer", lambda: (lambda c: _write(*_kv(), c, c))(_cache())),
    ("k_cache and v_cache are views of one buffer", lambda: _write(*_kv(), *_two_storages_over_one_buffer())),
    ("k_cache and v_cache are views of one buffer", lambda: (lambda c: _write(*_kv(), c, _untyped_view(c)))(_cache())),
    ("k_cache and v_cache are views of one buffer",  # one slot row (16 elements) apart
     lambda: (lambda b: _write(*_kv(), b.as_strided((4, 4, 2, 8), (64, 16, 8, 1)),
                               b.as_strided((4, 4, 2, 8), (64, 16, 8, 1), 16)))(torch.zeros(300))),
    ("k_cache and key share memory",
     lambda: (lambda c: _write(c.view(-1, 2, 8)[:3], torch.randn(3, 2, 8), c, _cache()))(_cache())),
    ("v_cache and slot_mapping share memory",
     lambda: (lambda c: _write(*_kv(1), _cache(), c,
                               c.view(-1)[:2].view(torch.int32)[:1]))(_cache())),
    ("k_cache has elements that share memory", lambda: _write(*_kv(), torch.zeros(1, 4, 2, 8).expand(4, 4, 2, 8),
                                                               _cache())),
    ("v_cache has elements that share memory",
     lambda: _write(*_kv(), _cache(), torch.zeros(200).as_strided((4, 4, 2, 8), (16, 8, 4, 1)))),
    ("x has elements that share memory",
     lambda: ops.fused_add_rms_norm(torch.zeros(8).expand(3, 8), torch.zeros(3, 8), inplace=True)),
    ("residual has elements that share memory",
     lambda: ops.fused_add_rms_norm(torch.zeros(3, 8), torch.zeros(1, 8).expand(3, 8), inplace=True)),
    ("x and residual share memory",
     lambda: (lambda t: ops.fused_add_rms_norm(t[:, :5], t[:, 3:], inplace=True))(torch.zeros(3, 8))),
    ("x and residual share memory",
     lambda: (lambda t: ops.fused_add_rms_norm(t, _untyped_view(t), inplace=True))(torch.zeros(3, 8))),
    ("x and weight share memory",
     lambda: (lambda t: ops.fused_add_rms_norm(t[:2], torch.zeros(2, 8), t[1], inplace=True))(torch.zeros(3, 8))),
    ("residual and bias share memory",
     lambda: (lambda t: ops.fused_add_layer_norm(torch.zeros(2, 8), t[:2], None, t[1], inplace=True))(
         torch.zeros(3, 8))),
]


@pytest.mark.parametrize("message, call", REFUSED, ids=[f"{i}-{m}" for i, (m, _) in enumerate(REFUSED)])
def test_aliasing_arguments_are_refused(message, call):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_a_refused_call_writes_nothing():
    cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(ValueError):
        _write(*_kv(), cache, cache)
    assert not cache.any()


def _interleaved_pages(pages=8, page=4):
    """transformers' continuous-batching layout: K and V pages alternate in one buffer, and the K and V
    views are that buffer from page 0 and from page 1; blocks (two pages) keep them apart."""
    flat = torch.zeros(pages * page, 2, 8)
    k_pages = flat.view(-1, page, 2, 8)[:-1]
    v_pages = flat[page:].view(-1, page, 2, 8)
    return flat, k_pages, v_pages


def test_interleaved_pages_are_written_where_the_slots_say():
    flat, k_pages, v_pages = _interleaved_pages()
    key, value = _kv(2)
    slots = torch.tensor([0, 2 * 4 + 1], dtype=torch.int32)  # blocks 0 and 2: K in pages 0 and 2
    ops.write_kv_cache(key, value, k_pages, v_pages, slots)
    assert torch.equal(flat[0], key[0]) and torch.equal(flat[4], value[0])
    assert torch.equal(flat[9], key[1]) and torch.equal(flat[13], value[1])
    with pytest.raises(ValueError, match="slot 0's value row shares memory with a key row"):
        ops.write_kv_cache(key, value, k_pages, v_pages, torch.tensor([0, 4], dtype=torch.int32))  # blocks 0, 1


def test_layouts_that_share_no_element_are_accepted():
    kv = torch.zeros(4, 2, 4, 2, 8)  # FlashInfer-style [blocks, 2, block_size, heads, dim]
    key, value = _kv()
    _write(key, value, kv[:, 0], kv[:, 1])
    assert torch.equal(kv[0, 0, :3], key) and torch.equal(kv[0, 1, :3], value)
    both = torch.zeros(3, 16)
    x, residual = both[:, ::2], both[:, 1::2]  # interleaved, no element shared
    x.copy_(torch.randn(3, 8)), residual.copy_(torch.randn(3, 8))
    summed = x + residual
    ops.fused_add_rms_norm(x, residual, None, inplace=True)
    assert torch.equal(residual, summed)
    qkv = torch.randn(3, 3, 2, 8)  # key and value: views of one projection output (read, not written)
    _write(qkv[:, 1], qkv[:, 2], _cache(), _cache())


# --------------------------------------------------------------------------------------------
# the address test against brute force


def _addresses(t: torch.Tensor) -> set[int]:
    size, base = t.element_size(), t.data_ptr()
    return {base + sum(i * s for i, s in zip(index, t.stride())) * size + byte
            for index in itertools.product(*(range(n) for n in t.shape)) for byte in range(size)}


layouts = st.integers(1, 3).flatmap(lambda dims: st.tuples(
    st.lists(st.integers(1, 4), min_size=dims, max_size=dims), st.lists(st.integers(0, 9), min_size=dims, max_size=dims),
    st.integers(0, 60)))


@settings(max_examples=300, deadline=None)
@given(a=layouts, b=layouts, same_layout=st.booleans())
def test_overlap_never_misses_a_shared_byte(a, b, same_layout):
    buffer = torch.zeros(512)
    if same_layout:
        b = (a[0], a[1], b[2])
    first, second = (buffer.as_strided(tuple(shape), tuple(stride), offset) for shape, stride, offset in (a, b))
    shared = bool(_addresses(first) & _addresses(second))
    assert checks.overlap(first, second) or not shared
    if same_layout and not checks.self_overlapping(first):
        assert checks.overlap(first, second) == shared  # exact for one layout
    offsets = [sum(i * s for i, s in zip(index, first.stride())) for index in itertools.product(*map(range, first.shape))]
    assert checks.self_overlapping(first) or len(set(offsets)) == len(offsets)


# A call's checks are kept per signature (metadata and where the tensors lie): the same shapes and
# strides with memory shared differently are checked again.
SAME_SIGNATURE = [
    ("k_cache and v_cache are views of one buffer",
     lambda: _write(*_kv(), _cache(), _cache()), lambda: (lambda c: _write(*_kv(), c, c))(_cache())),
    ("x and residual share memory",
     lambda: ops.fused_add_rms_norm(torch.zeros(3, 8)[:, :5], torch.zeros(3, 8)[:, 3:], inplace=True),
     lambda: (lambda t: ops.fused_add_rms_norm(t[:, :5], t[:, 3:], inplace=True))(torch.zeros(3, 8))),
    ("residual and bias share memory",
     lambda: ops.fused_add_layer_norm(torch.zeros(2, 8), torch.zeros(3, 8)[:2], None, torch.zeros(3, 8)[1],
                                      inplace=True),
     lambda: (lambda t: ops.fused_add_layer_norm(torch.zeros(2, 8), t[:2], None, t[1], inplace=True))(
         torch.zeros(3, 8))),
]


@pytest.mark.parametrize("message, accepted, refused", SAME_SIGNATURE, ids=[m for m, _, _ in SAME_SIGNATURE])
def test_a_signature_checked_once_still_refuses_shared_memory(message, accepted, refused):
    for _ in range(2):
        accepted()
        with pytest.raises(ValueError, match=re.escape(message)):
            refused()


@pytest.mark.parametrize("op_name", ["fused_add_rms_norm_", "fused_add_layer_norm_", "write_kv_cache"])
@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_each_ops_placement_sees_every_meeting_with_a_written_argument(op_name, data):
    """The placement written out per op equals the general loop's, restricted to the pairs with an
    argument the op writes (the only pairs its checks compare)."""
    from hw_agnostic.ops import registry

    op = registry.get_op(op_name)
    args = list(op.example_inputs(4, 8, torch.float32, "cpu"))
    pool = torch.zeros(4096)  # 4-byte elements of some arguments laid over one buffer, so some meet
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.element_size() == 4 and data.draw(st.booleans(), label=f"pool {i}"):
            offset = data.draw(st.integers(0, 64), label=f"offset {i}")
            args[i] = pool[offset:offset + arg.numel()].view(arg.dtype).view(arg.shape)
    written = set(op._mutated_positions)
    general = tuple(m for m in registry._placement(tuple(args)) if m[0] in written or m[1] in written)
    assert op._placement(*args) == general
