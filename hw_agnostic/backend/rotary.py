"""The rotary embedding of paged attention modules on ``rotary_embedding``, where it computes the same.

Hugging Face attention modules rotate their queries and keys with a function of their modeling
module, ``apply_rotary_pos_emb(q, k, cos, sin)``, looked up in that module's globals when the
forward runs (about ten kernel launches in eager PyTorch: two products, a negation, a
concatenation and a sum for each of q and k). For a paged attention module
(:class:`~hw_agnostic.layers.PagedAttention`) this rule gives the module a copy of its own
class's forward, same code, same closure, same decorators, whose globals resolve that one name to
a *router*; nothing of the modeling module is changed, and modules that were not paged run the
model's function as before.

The router calls the ``rotary_embedding`` op (one launch) only for calls it has seen the model's
function agree with, bit for bit. Per call signature (device, dtypes, heads, head and rotary dims;
not the batch or token counts, nor the strides) it probes once: the model's function and the op on the
same random ``q`` / ``k`` / ``cos`` / ``sin`` of the call's shapes and strides (random tables, so
a function that rotates another layout, e.g. GLM's interleaved one, or reads ``cos`` differently,
disagrees even where real tables would hide it). A signature that disagrees, or does not fit the
op, keeps the model's function, with the reason logged once and kept in :func:`verdicts`.
The model's function itself runs instead whenever the router cannot probe or must not replace:

* calls with more arguments (``unsqueeze_dim``, ``position_ids``) or other than four tensors;
* tensors that need gradients while autograd records (training runs the model's code);
* a call inside ``torch.compile`` for a signature no eager call has probed yet (a traced graph
  cannot probe; with a verdict it traces the custom op, without graph breaks either way), and
  calls on fake or meta tensors, or in compile-for-target mode that computes nothing;
* the modeling module's function was replaced after the rewire (a patch such as Liger's): the
  router calls what the module holds now.

The router also answers, without probing, whether a call would run the op (``routes``): the
direct attention path (:mod:`.attention_direct`) then runs it fused with the step's cache write,
``rotary_write_kv_cache`` (the same bits, one launch fewer).

The rewired model is still checked as a whole against the original (:mod:`.verify`); a change
that disagrees there is undone like any other.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import logging
import types
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from ..kernels import targets
from ..layers.attention import PagedAttention
from ..ops.rotary_embedding import rotary_embedding, rotary_embedding_op
from .changes import Change
from .report import RewireReport

log = logging.getLogger(__name__)

#: Global functions of a modeling module that rotate queries and keys (HF's names).
ROTARY_PREFIX = "apply_rotary_pos_emb"


@dataclasses.dataclass(frozen=True)
class Verdict:
    same: bool
    reason: str  # what the probe found


def _signature(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Any, ...]:
    """What the probe's outcome depends on: device, dtypes, ranks, heads and dims, whether one
    table serves every row; not the batch or token counts, nor the strides (elementwise math)."""
    table = cos.shape
    return (q.device, q.dtype, k.dtype, cos.dtype, sin.dtype, q.shape[1::2], k.shape[1::2], table[2:],
            sin.shape[2:], table[:1] == (1,))


def _probe_like(t: Tensor, g: torch.Generator, scale: float) -> Tensor:
    values = (torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1) * scale
    return torch.empty_like(t).copy_(values)


def _probe(function: Callable[..., Any], q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Verdict:
    """Whether ``function`` computes what ``rotary_embedding`` computes for calls like this one."""
    try:
        rotary_embedding_op.check(q, k, cos, sin)
    except (TypeError, ValueError) as err:
        return Verdict(False, f"the call does not fit rotary_embedding: {err}")
    g = torch.Generator().manual_seed(0)
    inputs = (_probe_like(q, g, 4.0), _probe_like(k, g, 4.0), _probe_like(cos, g, 1.0), _probe_like(sin, g, 1.0))
    try:
        want = function(*inputs)
    except Exception as err:  # the model's function refuses random tables: it is not the op's math
        return Verdict(False, f"the model's function fails on probe inputs ({type(err).__name__}: {err})")
    got = rotary_embedding(*inputs)
    if not (isinstance(want, tuple) and len(want) == 2 and all(isinstance(w, Tensor) for w in want)):
        return Verdict(False, f"the model's function returns {type(want).__name__}, not (q_embed, k_embed)")
    for name, w, o in (("q", want[0], got[0]), ("k", want[1], got[1])):
        if w.shape != o.shape or w.dtype != o.dtype:
            return Verdict(False, f"its {name} result is {tuple(w.shape)} {w.dtype}, rotary_embedding's "
                                  f"{tuple(o.shape)} {o.dtype}")
        if not torch.equal(w, o):
            error = (w.double() - o.double()).abs().max().item()
            return Verdict(False, f"its {name} result differs from rotary_embedding's (max |difference| {error:.3g}): "
                                  "another rotary layout or rounding")
    return Verdict(True, "bit-equal to rotary_embedding on a probe of the call's shapes")


def _can_probe(*tensors: Tensor) -> bool:
    if torch.compiler.is_compiling() or any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
        return False
    mode = targets.active_mode()
    return mode is None or mode.run_reference


def _router(name: str, namespace: dict[str, Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """What ``name`` resolves to in the rebuilt forwards (see the module docstring)."""
    found: dict[tuple[Any, ...], Verdict] = {}

    def routed(*args: Any, **options: Any) -> Any:
        current = namespace.get(name)
        if options or len(args) != 4 or current is not original:
            return current(*args, **options)
        q, k, cos, sin = args
        if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)):
            return original(q, k, cos, sin)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
            return original(q, k, cos, sin)
        signature = _signature(q, k, cos, sin)
        verdict = found.get(signature)
        if verdict is None:
            if not _can_probe(q, k, cos, sin):
                return original(q, k, cos, sin)
            verdict = found[signature] = _probe(original, q, k, cos, sin)
            if not verdict.same:
                log.info("hw_agnostic: %s.%s kept for %s: %s", original.__module__, name, signature, verdict.reason)
        if verdict.same:
            return rotary_embedding(q, k, cos, sin)
        return original(q, k, cos, sin)

    #: the last verdict ``routes`` found: ``(cos, sin, q's and k's shapes and dtypes, verdict)``
    last: list[Optional[tuple[Any, ...]]] = [None]

    def routes(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
        """Whether ``routed(q, k, cos, sin)`` would run ``rotary_embedding`` (a verdict found, none probed).

        Every layer of a step passes the same ``cos`` / ``sin``: for those very tables and q / k of
        the last call's shapes and dtypes, that call's verdict is this one's (the signature it was
        found under, 2 µs to build, is theirs), so it is kept, holding the tables."""
        if namespace.get(name) is not original or not (isinstance(cos, Tensor) and isinstance(sin, Tensor)):
            return False
        if torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
            return False
        if torch.compiler.is_compiling():  # a traced call's tensors are the graph's, not the run's: no memo
            verdict = found.get(_signature(q, k, cos, sin))
            return verdict is not None and verdict.same
        q_shape, k_shape, q_dtype, k_dtype = q.shape, k.shape, q.dtype, k.dtype
        seen = last[0]
        if (seen is not None and seen[0] is cos and seen[1] is sin and seen[2] == q_shape and seen[3] == k_shape
                and seen[4] is q_dtype and seen[5] is k_dtype):
            return seen[6].same
        verdict = found.get(_signature(q, k, cos, sin))
        if verdict is None:
            return False
        last[0] = (cos, sin, q_shape, k_shape, q_dtype, k_dtype, verdict)
        return verdict.same

    routed.verdicts = found  # type: ignore[attr-defined]
    routed.routes = routes  # type: ignore[attr-defined]
    routed.__wrapped__ = original  # type: ignore[attr-defined]
    routed.__name__ = f"routed_{name}"
    return routed


_routers: dict[tuple[int, str], Callable[..., Any]] = {}


def _router_for(namespace: dict[str, Any], name: str) -> Callable[..., Any]:
    key = (id(namespace), name)  # a modeling module's globals live as long as the module
    router = _routers.get(key)
    if router is None or router.__wrapped__ is not namespace[name]:  # type: ignore[attr-defined]
        router = _routers[key] = _router(name, namespace, namespace[name])
    return router


def _is_rotary_function(value: Any) -> bool:
    """A plain function, or the module that the ``kernels`` package (a dependency of transformers
    since 5.25) makes of a function decorated ``use_kernel_forward_from_hub``: called like the
    function, it runs the function unless a hub kernel was mapped onto it (the probe compares
    whichever runs)."""
    return isinstance(value, types.FunctionType) or (isinstance(value, nn.Module) and hasattr(value, "kernel_layer_name"))


def _global_names(code: types.CodeType) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:  # comprehensions and nested functions share the globals
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _imports_or_names(code: types.CodeType) -> bool:
    if any(i.opname in ("IMPORT_NAME", "IMPORT_FROM") for i in dis.get_instructions(code)) or "__name__" in _global_names(code):
        return True
    return any(_imports_or_names(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _rebuilt(function: types.FunctionType, namespace: dict[str, Any]) -> types.FunctionType:
    new = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                             function.__closure__)
    new.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(new, function)  # name, doc, annotations, __dict__; __wrapped__: the original
    return new


def _rewrapped(wrapper: types.FunctionType, inner: Callable[..., Any], new_inner: Callable[..., Any]) -> Optional[types.FunctionType]:
    """``wrapper`` (a decorator's closure around ``inner``) around ``new_inner`` instead."""
    closure = wrapper.__closure__ or ()
    cells = [types.CellType(new_inner) if _holds(cell, inner) else cell for cell in closure]
    if not any(_holds(cell, inner) for cell in closure):
        return None
    new = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(cells))
    new.__kwdefaults__ = wrapper.__kwdefaults__
    new.__dict__.update(wrapper.__dict__)
    new.__wrapped__ = new_inner
    return new


def _holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def routed_forward(forward: Callable[..., Any]) -> tuple[Optional[Callable[..., Any]], str]:
    """``forward`` with its rotary functions resolved to routers, or None and why not."""
    chain = [forward]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    inner = chain[-1]
    if not isinstance(inner, types.FunctionType):
        return None, f"its forward is a {type(inner).__name__}, not a Python function"
    namespace = inner.__globals__
    names = sorted(n for n in _global_names(inner.__code__)
                   if n.startswith(ROTARY_PREFIX) and _is_rotary_function(namespace.get(n)))
    if not names:
        return None, f"its forward calls no {ROTARY_PREFIX}* function of its module"
    if _imports_or_names(inner.__code__):
        return None, "its forward imports, or reads __name__ (a copy of its module's globals is not its module)"
    # A copy without ``__name__``: torch.compile reads the globals of a function whose globals
    # are named after a module from that module, which holds the model's function, not the router.
    routed_namespace = {key: value for key, value in namespace.items() if key != "__name__"}
    routed_namespace.update({name: _router_for(namespace, name) for name in names})
    rebuilt: Callable[..., Any] = _rebuilt(inner, routed_namespace)
    for wrapper, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if not isinstance(wrapper, types.FunctionType):
            return None, f"its forward's decorator {type(wrapper).__name__} cannot be rebuilt around a copy"
        rewrapped = _rewrapped(wrapper, wrapped, rebuilt)
        if rewrapped is None:
            return None, f"its forward's decorator {wrapper.__qualname__} does not hold the function it wraps"
        rebuilt = rewrapped
    return rebuilt, ", ".join(names)


def routed_class_forward(cls: type) -> Callable[..., Any]:
    """A routed copy of ``cls.forward``, made again for a module unpickled with its forward routed."""
    forward, detail = routed_forward(cls.forward)
    if forward is None:
        raise RuntimeError(f"the rotary routing of {cls.__qualname__}.forward cannot be made again here: {detail}")
    return forward


def verdicts(module: nn.Module) -> dict[tuple[Any, ...], Verdict]:
    """What the probes found for the calls ``module``'s rotary router has seen (empty when not routed)."""
    forward = PagedAttention.forward_of(module) if isinstance(module, PagedAttention) else None
    found: dict[tuple[Any, ...], Verdict] = {}
    while forward is not None:
        namespace = getattr(forward, "__globals__", {})
        for value in namespace.values():
            if getattr(value, "verdicts", None) is not None and value.__name__.startswith(f"routed_{ROTARY_PREFIX}"):
                found.update(value.verdicts)
        forward = getattr(forward, "__wrapped__", None)
    return found


@dataclasses.dataclass(eq=False)
class RotaryChange(Change):
    module: Optional[nn.Module] = None  # the paged module whose forward is routed


def rotary_changes(model: nn.Module) -> tuple[list[Change], list[tuple[str, nn.Module, str]]]:
    """Route the rotary embedding of every paged attention module of ``model`` (applied).

    Returns the changes and the paged modules whose forward calls a rotary function but cannot be
    given a routed copy, ``(path, module, reason)``.
    """
    changes: list[Change] = []
    left: list[tuple[str, nn.Module, str]] = []
    rebuilt: dict[type, tuple[Optional[Callable[..., Any]], str]] = {}  # one copy per class
    for path, module in model.named_modules():
        if not isinstance(module, PagedAttention):
            continue
        base = type(module)._hw_agnostic_base
        if PagedAttention.forward_of(module) is not base.forward:
            continue  # routed already (a second rewire), or running another copy of its forward
        if base not in rebuilt:
            rebuilt[base] = routed_forward(base.forward)
        forward, detail = rebuilt[base]
        if forward is None:
            if "calls no" not in detail:
                left.append((path, module, f"rotary embedding runs as the model defines it: {detail}"))
            continue

        def apply(module: nn.Module = module, forward: Callable[..., Any] = forward, base: type = base) -> None:
            if isinstance(module, PagedAttention):  # a paging undone by verification leaves nothing to route
                PagedAttention.use_forward(module, forward, functools.partial(routed_class_forward, base))

        def undo(module: nn.Module = module) -> None:
            if isinstance(module, PagedAttention):
                PagedAttention.use_forward(module, None)

        apply()
        changes.append(RotaryChange("rotary", path, base.__name__, "rotary_embedding",
                                    f"{detail} -> rotary_embedding where a probe shows it computes the same",
                                    apply, undo, module=module))
    return changes, left


def settle_rotary(changes: list[Change], report: RewireReport) -> None:
    """After whole-model verification ran the model: undo the routing of modules whose every probed
    call kept the model's function (another rotary layout, e.g. GLM's or Cohere's interleaved one),
    and report why. Modules not probed yet (verification deferred or off) keep their routers."""
    for change in changes:
        if change.kind != "rotary" or not change.active:
            continue
        found = verdicts(change.module) if isinstance(change, RotaryChange) else {}
        if found and not any(v.same for v in found.values()):
            change.undo()
            reason = next(iter(found.values())).reason
            report.add("left", change.path, change.original,
                       detail=f"rotary embedding runs as the model defines it: {reason}")
