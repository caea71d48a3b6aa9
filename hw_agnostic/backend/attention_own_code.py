"""Paged attention for modules that write ``cache.update`` but compute attention in their own code.

Many older Hugging Face modules (XGLM, TrOCR, MVP, the BERT-style decoders, Falcon) store K/V
through ``cache.update(k, v, layer_idx)`` like the modern ones, but then compute attention
themselves: ``softmax(q @ k^T * scale + mask) @ v`` written out with ``matmul`` / ``bmm``, or one
``F.scaled_dot_product_attention`` call, instead of dispatching through
``ALL_ATTENTION_FUNCTIONS``. Such a module is served without per-model code by *interpreting* its
own attention code:

* its class is switched to a paged attention layer exactly as for the modern modules (its
  parameters, hooks and projections untouched); its ``cache.update`` writes the step into the
  pages and returns, instead of every position's K/V, *placeholders* of their shape;
* while the rest of its forward runs, a :class:`~torch.overrides.TorchFunctionMode` follows every
  operation on a placeholder: the layout changes of K and V (``view`` / ``reshape`` /
  ``transpose``), the scores product ``q @ k^T`` (which captures the query), scaling by a
  constant, additive masks, ``softmax`` over the keys, dropout that is off, and finally
  ``probs @ v`` (or the single SDPA call), which runs ``paged_attention`` over the pages and
  returns its output in the layout the module's own product would have had;
* the masks the module added (or gave SDPA) are checked against what the kernel computes: causal
  over the cached tokens, padding (read from the same mask on write) excluded, nothing else. An
  ALiBi or relative-position bias, a window, a prefix-bidirectional mask, ``is_causal`` with a
  past, or any operation on a placeholder not listed above makes the call *unrecognised*.

An unrecognised call never computes garbage: while the change is being verified (``rewire``) it
raises :class:`UnrecognisedAttention`, so verification undoes the change and reports why; after
that (or with ``enable_paged_attention``, which verifies nothing), the module's forward is run
again on every position's K/V read back from the pages, its own attention computing what it
always did (the step is not written twice), and the module keeps doing so.

The fallbacks of the modern path hold unchanged: training, gradients and recorded attention
weights run the module's own attention over K/V read back from the pages; a forward without a
cache runs the module's own code untouched; a continuous-batching cache gathers K/V through its
own ``update``. Cross-attention calls (``key_value_states`` / ``encoder_hidden_states`` given)
run the module's own forward with the original cache. Inside a compiled model the module runs
eagerly (a graph break: a traced graph cannot follow placeholders by identity).

Before a step's placeholders are handed out, the padding read from a 4-D mask on write is checked
against that mask (causal, padding hidden, each padded query hiding its own position): a mask with
ALiBi folded in, say, would make real tokens read as padding. Such a step is taken back out of the
pages, and the module keeps its own cache code and attention (or, while verified, is refused).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..layers.attention import (_STATE, PagedAttention, PagedBatch, _call_shape, _PagedState, attend,
                                class_forward)
from ..layers.base import resolve
from ..layers.made_class import made_by
from .attention import StrictUntilReleased, _cache_classes, _masks_agree, bind_cache, paged_layer_of

log = logging.getLogger(__name__)

_OWN = "_hw_agnostic_own_code"
_CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention", "encdec_attention")
_CROSS_ARGUMENTS = ("key_value_states", "encoder_hidden_states")


class UnrecognisedAttention(NotImplementedError):
    """A module's own attention code does something ``paged_attention`` cannot compute."""


def own_code_refusal(path: str, module: nn.Module) -> Optional[str]:
    """Why a module that computes attention in its own code cannot be interpreted (None: it may be)."""
    name = path.rpartition(".")[2].lower()
    if any(cross in name for cross in _CROSS_NAMES):
        return "cross-attention (attends to an encoder's states, not causal over a cache)"
    if getattr(module, "is_decoder", True) is False or getattr(module, "is_causal", True) is False:
        return "not causal (an encoder's bidirectional self-attention)"
    return None


def own_code_change(path: str, module: nn.Module, block_size: int) -> StrictUntilReleased:
    """Make ``module`` (whose attention is its own code) a paged attention layer, in place."""
    original = type(module).__name__
    own = _OwnState()

    def apply(module: nn.Module = module) -> None:
        adopt_own_code(module, block_size=block_size, own=own)

    def undo(module: nn.Module = module) -> None:
        release_own_code(module)

    apply()
    return StrictUntilReleased(
        "attention", path, original, type(module).__name__,
        "K/V in a paged cache: write_kv_cache + paged_attention (its own attention code interpreted)", apply, undo,
        holder=own)


@dataclasses.dataclass(eq=False)
class _OwnState:
    # True while verification may still undo the change: an unrecognised call raises, so the change
    # is undone and the reason reported. Released, the module falls back to its own attention instead.
    strict: bool = True
    unrecognised: Optional[str] = None  # why this module's attention was not recognised (then: own code)
    replay: bool = False  # the forward is being rerun: update returns what the pages hold, writes nothing
    interpreter: Optional["_Interpreter"] = None



def adopt_own_code(module: nn.Module, *, block_size: int = 16, own: Optional[_OwnState] = None) -> nn.Module:
    """Switch ``module``'s class to a paged attention layer that interprets its own attention code."""
    if isinstance(module, PagedAttention):
        raise ValueError(f"{type(module).__name__} is paged already")
    base = type(module)
    positional, cache_name, passes_window = _call_shape(base.forward)
    config = getattr(module, "config", None)
    module.__dict__[_STATE] = _PagedState(_bind_own_code, config, config, block_size, positional, cache_name,
                                          passes_window, forward_recipe=class_forward(base))
    module.__dict__[_OWN] = own if own is not None else _OwnState(strict=False)
    module.__class__ = _own_code_class(resolve("paged_attention"), base)
    return module


def release_own_code(module: nn.Module) -> nn.Module:
    """Undo :func:`adopt_own_code` (the module's own class again; its config was never touched)."""
    module.__dict__.pop(_STATE)
    module.__dict__.pop(_OWN, None)
    module.__class__ = type(module)._hw_agnostic_base
    return module


class _OwnCodeAttention:
    """Mixed in before the paged layer: runs the module's forward with its attention interpreted."""

    # Its interpreter reads the positions seen as an int: a StaticCache's slots keep transformers'
    # static layers (graphable as they are) and the module's own attention.
    takes_static_pages = False

    # A traced graph cannot follow placeholders by identity: inside a compiled model the module runs
    # eagerly (a graph break), interpreted as it is outside one.
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: _PagedState = self.__dict__[_STATE]
        own: _OwnState = self.__dict__[_OWN]
        arguments = dict(zip(state.positional, args))
        arguments.update(kwargs)
        if any(arguments.get(name) is not None for name in _CROSS_ARGUMENTS):
            return state.base_forward(self, *args, **kwargs)  # cross-attention: the module as it was
        if own.unrecognised is not None:
            return self._replayed(own, args, kwargs, replay=False)
        interpreter = own.interpreter = _Interpreter(self)
        try:
            try:
                out = super().forward(*args, **kwargs)
            finally:
                interpreter.stop()
            interpreter.finish()
        except UnrecognisedAttention as err:
            if own.strict:
                raise
            own.unrecognised = str(err)
            log.warning("hw_agnostic: %s; it runs its own attention over K/V read back from the pages", err)
            return self._replayed(own, args, kwargs, replay=True)
        finally:
            own.interpreter = None
        return interpreter.sanitize(out)

    def _replayed(self, own: _OwnState, args: tuple, kwargs: dict, *, replay: bool) -> Any:
        """The module's own attention over every position's K/V (``replay``: the step is written already)."""
        own.replay = replay
        try:
            return super().forward(*args, **kwargs)
        finally:
            own.replay = False


@functools.lru_cache(maxsize=None)
def _own_code_class(layer: type, base: type) -> type:
    return type(f"Paged{base.__name__}", (_OwnCodeAttention, layer, base), {
        "_hw_agnostic_base": base, "__module__": layer.__module__, **made_by(_own_code_class, layer, base),
        "_hw_agnostic_release": staticmethod(release_own_code),
        "__doc__": f"{base.__name__} with its K/V in a paged cache and its own attention code run by paged_attention.",
    })


def _bind_own_code(layer: PagedAttention, cache: Any, attention_mask: Any, fallback: bool) -> Any:
    own: _OwnState = layer.__dict__[_OWN]
    if own.replay:  # the step is in the pages: the binding reads it back
        return _OwnCodeBinding(layer, bind_cache(layer, cache, attention_mask, True), own)
    plain_cache = isinstance(cache, _cache_classes()[0])
    unreadable = isinstance(attention_mask, Tensor) and attention_mask.dim() not in (2, 4)
    if unreadable and plain_cache and own.strict:
        raise UnrecognisedAttention(f"{type(layer).__name__} is given a {attention_mask.dim()}-D attention mask, "
                                    "from which the padding its pages must skip cannot be read")
    if plain_cache and (unreadable or own.unrecognised is not None):
        # its own cache code: a paged slot stores every position and reads them back (PagedCacheLayer.update)
        return cache
    # a module that never passes kwargs to update cannot use a continuous-batching cache's pages
    if not plain_cache:
        fallback = True
    return _OwnCodeBinding(layer, bind_cache(layer, cache, attention_mask, fallback), own)


class _OwnCodeBinding:
    """Wraps the paged binding: on the paged path ``update`` returns placeholders of every position's K/V."""

    def __init__(self, layer: PagedAttention, inner: Any, own: _OwnState) -> None:
        self.layer, self.inner, self.own = layer, inner, own

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: Any = None, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        state: _PagedState = self.layer.__dict__[_STATE]
        if self.own.replay:
            paged = self._paged_layer(layer_idx)
            if paged is None:
                raise RuntimeError(f"{type(self.layer).__name__}: no paged cache layer to read back from")
            return paged.read_with(key_states, value_states)
        keys, values = self.inner.update(key_states, value_states, layer_idx, *args, **kwargs)
        batch = state.take()
        paged = self._paged_layer(layer_idx)
        if paged is None or paged.store is None:
            return keys, values  # a slot pages cannot hold: the cache's own K/V
        store, q_len = paged.store, key_states.shape[2]
        mask = getattr(self.inner, "attention_mask", None)
        if not store.share.once(("own-code padding", mask, store.real, store.seen, q_len),
                                lambda: _padding_read_agrees(mask, store, q_len), versioned=True):
            # the padding the step was written with was read from a mask that is no causal padding
            # mask (ALiBi folded in, a bidirectional prefix): the step is taken back out of the pages
            store.crop(q_len)
            why = (f"{type(self.layer).__name__} is given an attention mask that is not causal over its "
                   "cached tokens (e.g. ALiBi folded in, a window or a bidirectional prefix), so neither the "
                   "padding its pages must skip nor its attention can be read from it")
            if self.own.strict:
                raise UnrecognisedAttention(why)
            self.own.unrecognised = why
            log.warning("hw_agnostic: %s; it runs its own attention over K/V read back from the pages", why)
            return paged.update(key_states, value_states)
        interpreter = self.own.interpreter
        if not isinstance(batch, PagedBatch) or interpreter is None:
            return keys, values  # the fallback path: every position's K/V, read back from the pages
        return interpreter.start(batch, store, key_states, value_states)

    def _paged_layer(self, layer_idx: Any) -> Any:
        index = getattr(self.layer, "layer_idx", None) if layer_idx is None else layer_idx
        return paged_layer_of(self.inner.cache, int(index), self.layer.block_size, self.layer.passes_window,
                              static=self.layer.takes_static_pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --------------------------------------------------------------------------------------------
# the interpreter


@dataclasses.dataclass(eq=False)
class _Step:
    """One ``cache.update`` call: what its attention reads."""

    batch: PagedBatch
    real: Optional[Tensor]  # [B, seen] which positions are real tokens (None: all)
    seen: int
    q_len: int
    batch_size: int
    kv_heads: int
    head_dim: int
    share: Any  # the cache's StepShare
    attended: bool = False


@dataclasses.dataclass(eq=False)
class _KV:
    step: _Step
    role: str  # "key" or "value"
    flat: bool  # [B * H, L, D] rather than [B, H, L, D]
    transposed: bool  # the last two dimensions swapped


@dataclasses.dataclass(eq=False)
class _Scores:
    step: _Step
    query: Tensor  # [B, Hq, q, D]
    flat: bool
    scale: float
    biases: list[tuple[Tensor, float]]  # additive terms in the 4-D layout, each with its coefficient
    dtype: torch.dtype
    probabilities: bool = False

    def shape(self, flat: bool) -> tuple[int, ...]:
        batch, heads, q_len = self.query.shape[:3]
        length = self.step.seen
        return (batch * heads, q_len, length) if flat else (batch, heads, q_len, length)


_METADATA = frozenset({"size", "dim", "numel", "is_floating_point", "is_contiguous", "element_size", "get_device",
                       "__len__"})
_GETTERS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_meta",
                      "grad_fn", "is_sparse", "is_quantized", "is_nested"})
_LAYOUT = frozenset({"view", "reshape", "flatten", "unflatten"})
_SCALES = frozenset({"mul", "mul_", "__mul__", "__rmul__", "__imul__", "div", "div_", "__truediv__", "__itruediv__",
                     "true_divide", "multiply", "divide"})
_ADDS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
_MATMULS = frozenset({"matmul", "bmm", "__matmul__"})


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return "get:" + getattr(getattr(func, "__self__", None), "__name__", "")
    return name


class _Interpreter(TorchFunctionMode):
    """Follows the module's attention code from the placeholders ``cache.update`` returned (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module_name = type(module).__name__
        self.module = module
        self.symbols: dict[int, tuple[Tensor, Any]] = {}  # id -> (placeholder, meaning); holds the tensor
        self.steps: list[_Step] = []
        self.constants: dict[int, tuple[Tensor, Any]] = {}  # id -> (0-dim tensor, its value), made in the mode
        self.active = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, batch: PagedBatch, store: Any, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        batch_size, heads, q_len, head_dim = key.shape
        seen = store.seen
        step = _Step(batch, store.real, seen, q_len, batch_size, heads, head_dim, store.share)
        self.steps.append(step)
        shape = (batch_size, heads, seen, head_dim)
        k = self._placeholder(shape, key.dtype, key.device, _KV(step, "key", False, False))
        v = self._placeholder(shape, value.dtype, value.device, _KV(step, "value", False, False))
        if not self.active:
            self.__enter__()
            self.active = True
        return k, v

    def stop(self) -> None:
        if self.active:
            self.__exit__(None, None, None)
            self.active = False

    def finish(self) -> None:
        if any(not step.attended for step in self.steps):
            self.fail("never attends over the K/V its cache update returned")

    def sanitize(self, out: Any) -> Any:
        """The module's outputs, placeholders (attention weights nobody asked for) replaced by None."""
        if not self.symbols:
            return out
        return tree_map(lambda x: None if isinstance(x, Tensor) and id(x) in self.symbols and
                        self.symbols[id(x)][0] is x else x, out)

    def fail(self, why: str) -> None:
        raise UnrecognisedAttention(f"{self.module_name}'s own attention code {why}, which paged_attention "
                                    "cannot compute")

    def _placeholder(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, meaning: Any) -> Tensor:
        # NaN-filled and zero-strided: no memory, and a placeholder that escaped would poison, never pass
        tensor = torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)
        self.symbols[id(tensor)] = (tensor, meaning)
        return tensor

    def _meaning(self, x: Any) -> Any:
        if isinstance(x, Tensor):
            found = self.symbols.get(id(x))
            if found is not None and found[0] is x:
                return found[1]
        return None

    # -- dispatch -------------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if not any(self._meaning(x) is not None for x in flat):
            out = func(*args, **kwargs)
            if _name(func) == "full" and isinstance(out, Tensor) and out.dim() == 0 and len(args) > 1:
                # a constant the module makes (XGLM's clamp floor): known without reading the device
                self.constants[id(out)] = (out, args[1])
            return out
        name = _name(func)
        if name in _METADATA or name.startswith("get:") and name[4:] in _GETTERS:
            return func(*args, **kwargs)
        if name == "scaled_dot_product_attention":
            return self._sdpa(*args, **kwargs)
        if name == "baddbmm":
            operands = dict(zip(("input", "batch1", "batch2"), args), **kwargs)
            if isinstance(self._meaning(operands.get("batch2")), _KV):
                return self._baddbmm(**operands)
        subject = self._meaning(args[0]) if args else None
        if isinstance(subject, _KV):
            return self._kv_op(name, func, args, kwargs, subject)
        if name in _MATMULS and len(args) == 2 and isinstance(self._meaning(args[1]), _KV):
            return self._product(args[0], args[1], self._meaning(args[1]))
        if isinstance(subject, _Scores):
            return self._scores_op(name, func, args, kwargs, subject)
        if name in _SCALES | _ADDS and len(args) == 2 and isinstance(self._meaning(args[1]), _Scores):
            return self._scores_op(name, func, (args[1], args[0]), kwargs, self._meaning(args[1]))
        self.fail(f"applies {name or func} to the attention's K/V or scores")

    # -- K and V --------------------------------------------------------------------------------

    def _kv_op(self, name: str, func: Any, args: tuple, kwargs: dict, kv: _KV) -> Any:
        tensor = args[0]
        if name == "contiguous":
            return tensor
        step = kv.step
        if name in _LAYOUT and not kv.transposed:
            out = func(*args, **kwargs)
            four = (step.batch_size, step.kv_heads, step.seen, step.head_dim)
            three = (step.batch_size * step.kv_heads, step.seen, step.head_dim)
            if tuple(out.shape) not in (four, three):
                self.fail(f"reshapes its {kv.role}s to {tuple(out.shape)}")
            return self._register(out, _KV(step, kv.role, tuple(out.shape) == three, False))
        if name in ("transpose", "swapaxes", "swapdims") and len(args) + len(kwargs) == 3:
            dims = sorted(d % tensor.dim() for d in (*args[1:], *kwargs.values()))
            if dims == [tensor.dim() - 2, tensor.dim() - 1]:
                return self._register(func(*args, **kwargs), _KV(step, kv.role, kv.flat, not kv.transposed))
        if name == "get:mT":
            return self._register(func(*args, **kwargs), _KV(step, kv.role, kv.flat, not kv.transposed))
        self.fail(f"applies {name} to its {kv.role}s")

    def _register(self, tensor: Tensor, meaning: Any) -> Tensor:
        self.symbols[id(tensor)] = (tensor, meaning)
        return tensor

    def _product(self, left: Any, right: Tensor, kv: _KV) -> Tensor:
        """``left @ right`` with ``right`` K or V: the scores product (left is the query) or the output."""
        step = kv.step
        scores = self._meaning(left)
        if kv.role == "key":
            if not kv.transposed or not isinstance(left, Tensor) or scores is not None:
                self.fail("multiplies its keys other than as query @ key^T")
            if left.dim() != (3 if kv.flat else 4):
                self.fail(f"multiplies a {left.dim()}-D query with {'3' if kv.flat else '4'}-D keys")
            query = left.view(step.batch_size, -1, *left.shape[-2:]) if kv.flat else left
            if query.shape[0] != step.batch_size or query.shape[2] != step.q_len or query.shape[1] % step.kv_heads:
                self.fail(f"multiplies a query of shape {tuple(left.shape)} with keys of {step.kv_heads} heads")
            if kv.flat and query.shape[1] != step.kv_heads:
                self.fail("multiplies a query with keys of another head count")
            meaning = _Scores(step, query, kv.flat, 1.0, [], left.dtype)
            return self._placeholder(meaning.shape(kv.flat), left.dtype, left.device, meaning)
        if not isinstance(scores, _Scores) or not scores.probabilities or kv.transposed or kv.flat != scores.flat:
            self.fail("multiplies its values with something other than its attention probabilities")
        if scores.step is not step:
            self.fail("mixes the K/V of two cache updates")
        if scores.dtype != right.dtype:
            self.fail(f"multiplies {scores.dtype} probabilities with {right.dtype} values")
        out = self._attend(scores)  # [B, Hq, q, D]
        out = out.reshape(-1, *out.shape[2:]) if scores.flat else out
        return out.to(right.dtype)

    def _baddbmm(self, input: Any, batch1: Any, batch2: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
        """``beta * input + alpha * (q @ k^T)`` (GPT-NeoX style): the product, scaled, plus ``input`` as a bias."""
        if self._meaning(input) is not None:
            self.fail("adds its attention scores to themselves")
        scores = self._product(batch1, batch2, self._meaning(batch2))
        scaled = self._scores_op("mul", None, (scores, alpha), {}, self._meaning(scores))
        if not isinstance(input, Tensor):
            if self._number(input) != 0:
                self.fail(f"adds {input!r} to its attention scores")
            return scaled
        return self._scores_op("add", None, (scaled, input * beta if beta != 1 else input), {},
                               self._meaning(scaled))

    # -- scores and probabilities -------------------------------------------------------------

    def _scores_op(self, name: str, func: Any, args: tuple, kwargs: dict, scores: _Scores) -> Any:
        tensor = args[0]
        other = args[1] if len(args) > 1 else None
        in_place = name.endswith("_") and not name.endswith("__") or name.startswith("__i")
        if name in ("contiguous", "clone"):
            return tensor
        if name in _LAYOUT:
            out = func(*args, **kwargs)
            if tuple(out.shape) not in (scores.shape(True), scores.shape(False)):
                self.fail(f"reshapes its attention scores to {tuple(out.shape)}")
            return self._register(out, dataclasses.replace(scores, flat=tuple(out.shape) == scores.shape(True)))
        if name == "dropout":
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and p > 0:
                self.fail("applies dropout to its attention probabilities")
            return tensor
        if name in ("to", "float", "half", "bfloat16", "type_as"):
            dtype = self._cast_dtype(name, args, kwargs)
            if dtype is None:
                self.fail(f"casts its attention {'probabilities' if scores.probabilities else 'scores'} oddly")
            return self._derived(dataclasses.replace(scores, dtype=dtype), tensor, dtype)
        if name == "softmax":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            dtype = kwargs.get("dtype") or (args[3] if len(args) > 3 else None) or scores.dtype
            if scores.probabilities or dim is None or dim % tensor.dim() != tensor.dim() - 1:
                self.fail("takes a softmax other than over the keys")
            return self._derived(dataclasses.replace(scores, probabilities=True, dtype=dtype), tensor, dtype)
        if scores.probabilities:
            self.fail(f"applies {name} to its attention probabilities")
        if name in _SCALES and len(args) == 2 and not kwargs:
            factor = None if self._meaning(other) is not None else self._number(other)
            if factor is None or factor <= 0 or not math.isfinite(factor):
                self.fail(f"scales its attention scores by {other!r}")
            if "div" in name:
                factor = 1.0 / factor
            updated = dataclasses.replace(scores, scale=scores.scale * factor,
                                          biases=[(b, c * factor) for b, c in scores.biases])
            return self._derived(updated, tensor, scores.dtype, in_place)
        if name in _ADDS and len(args) == 2 and kwargs.get("alpha", 1) == 1:
            if not isinstance(other, Tensor) or self._meaning(other) is not None:
                self.fail("adds something other than a mask tensor to its attention scores")
            shape = scores.shape(scores.flat)
            if torch.broadcast_shapes(other.shape, shape) != torch.Size(shape):
                self.fail(f"adds a {tuple(other.shape)} tensor to {shape} attention scores")
            bias = other.expand(shape).reshape(scores.shape(False)) if scores.flat else other
            updated = dataclasses.replace(scores, biases=[*scores.biases, (bias, 1.0)])
            return self._derived(updated, tensor, scores.dtype, in_place)
        if name in ("max", "maximum", "clamp", "clamp_min") and len(args) == 2 and not kwargs:
            floor = self._number(other)
            if floor is not None and floor <= torch.finfo(scores.dtype).min / 2:
                return tensor  # lifts -inf to the dtype's lowest value: hidden keys stay hidden
        self.fail(f"applies {name} to its attention scores")

    def _derived(self, new: _Scores, tensor: Tensor, dtype: torch.dtype, in_place: bool = False) -> Tensor:
        """``tensor`` changed to mean ``new``: itself for an in-place operation, else a new placeholder."""
        if in_place:
            self.symbols[id(tensor)] = (tensor, new)
            return tensor
        return self._placeholder(tuple(tensor.shape), dtype, tensor.device, new)

    def _number(self, x: Any) -> Optional[float]:
        """A scalar operand's value (a one-element tensor's too: unless the module made it with
        ``torch.full`` under the interpreter, reading it synchronises with the device)."""
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return float(x)
        known = self.constants.get(id(x))
        if known is not None and known[0] is x and isinstance(known[1], (int, float)):
            return float(known[1])
        if isinstance(x, Tensor) and x.numel() == 1:
            return float(x.item())
        return None

    def _cast_dtype(self, name: str, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
        if name == "float":
            return torch.float32
        if name == "half":
            return torch.float16
        if name == "bfloat16":
            return torch.bfloat16
        if name == "type_as":
            return args[1].dtype if len(args) > 1 and isinstance(args[1], Tensor) else None
        dtypes = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)]
        others = [a for a in (*args[1:], *kwargs.values()) if not isinstance(a, (torch.dtype, bool))]
        return dtypes[0] if len(dtypes) == 1 and not others else None

    # -- SDPA -----------------------------------------------------------------------------------

    def _sdpa(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> Tensor:
        k, v = self._meaning(key), self._meaning(value)
        plain = (isinstance(k, _KV) and isinstance(v, _KV) and k.role == "key" and v.role == "value"
                 and k.step is v.step and not (k.flat or v.flat or k.transposed or v.transposed))
        if not plain or self._meaning(query) is not None or self._meaning(attn_mask) is not None:
            self.fail("calls scaled_dot_product_attention with other than its cached keys and values")
        step = k.step
        if dropout_p:
            self.fail("calls scaled_dot_product_attention with dropout")
        if query.dim() != 4 or query.shape[0] != step.batch_size or query.shape[2] != step.q_len or \
                query.shape[1] % step.kv_heads:
            self.fail(f"calls scaled_dot_product_attention with a query of shape {tuple(query.shape)}")
        meaning = _Scores(step, query, False, query.shape[-1] ** -0.5 if scale is None else scale, [], query.dtype)
        if is_causal:
            if attn_mask is not None or step.seen != step.q_len or step.real is not None:
                self.fail("calls scaled_dot_product_attention with is_causal over a past or padding")
            causal = torch.ones(step.q_len, step.seen, dtype=torch.bool, device=query.device).tril()
            attn_mask = causal
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # SDPA's boolean mask: True attends
                attn_mask = torch.where(attn_mask, 0.0, float("-inf"))
            shape = meaning.shape(False)
            if torch.broadcast_shapes(attn_mask.shape, shape) != torch.Size(shape):
                self.fail(f"gives scaled_dot_product_attention a {tuple(attn_mask.shape)} mask for {shape} scores")
            meaning.biases.append((attn_mask, 1.0))
        return self._attend(meaning).to(value.dtype)

    # -- the kernel -----------------------------------------------------------------------------

    def _attend(self, scores: _Scores) -> Tensor:
        step = scores.step
        self._check_masks(scores)
        step.attended = True
        out = attend(scores.query, step.batch, scale=scores.scale)  # [B, q, Hq, D]
        return out.transpose(1, 2).contiguous()

    def _check_masks(self, scores: _Scores) -> None:
        """The masks added must be the kernel's own: causal over the cached tokens, padding hidden."""
        step = scores.step
        # checked once per mask, step and padding for all the layers of a forward (a model builds one mask)
        key = tuple(x for bias, coefficient in scores.biases for x in (bias, coefficient))
        compute = functools.partial(_masks_agree, scores.biases, step.real, step.seen, step.q_len,
                                    step.batch_size, scores.query.device)
        if not step.share.once(("own-code masks", *key, step.real, step.seen, step.q_len), compute, versioned=True):
            self.fail("masks its attention scores other than causally over the cached tokens (e.g. ALiBi or a "
                      "relative-position bias, a window, a bidirectional prefix, or no causal mask)")


def _padding_read_agrees(mask: Any, store: Any, q_len: int) -> bool:
    """Whether the padding read from a 4-D ``mask`` on write (its diagonal) is the mask's padding: the
    mask must be the kernel's causal, padding-hiding one over the positions the pages have seen."""
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        return True  # none, or a 2-D padding mask: read as it is
    if mask.shape[-1] != store.seen or mask.shape[-2] != q_len:
        return False
    additive = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask
    return _masks_agree([(additive, 1.0)], store.real, store.seen, q_len, store.batch_size, mask.device)
