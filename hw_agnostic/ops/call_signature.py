"""What an eager call of an op costs before its kernel: the signature of its metadata, per op.

:meth:`.registry.Op.dispatch` keeps ``check`` and ``key``'s verdict per call signature: the
shapes, strides, dtypes and devices of the tensor arguments and the type and value of the others
(1, 1.0 and True are equal but not the same argument). Every eager call builds that signature, and
``Op.__call__`` asks whether a tensor argument requires grad, before anything runs; at decode
sizes both are a good part of the call (a generic loop over the arguments took 1.4 µs and 0.65 µs
for a layer norm's five, the ATen kernel 2.7 µs).

So each op gets the two as functions written for its reference's parameters, compiled once: one
flat tuple, no loop, no ``isinstance`` where the annotation says ``Tensor``. A call that does not
fit (a non-tensor where a tensor belongs, an unhashable value) raises ``TypeError`` or
``AttributeError``, and the caller takes its slow path, where ``check`` names the bad argument.

A signature that repeats (every layer of a decode step calls an op alike) is then checked in C:
the op keeps its last few as Dynamo's own tensor guards (``TensorGuards``: Python type, dtype,
device, sizes, strides, ``requires_grad`` and dispatch keys of each tensor, one call for all of
them) beside the values of its other arguments, and a call they match takes that signature's
verdict without building it (a paged-attention call with six tensors: 7.7 against 10.3 µs in a
loop; about 11 µs of a decode-host layer, alternating in one process). Where this torch
has no such guards, or they do not tell apart what the signature does (checked once, on import),
every call builds its signature.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, Optional

import torch

_TENSOR = "tensor"
_OPTIONAL_TENSOR = "optional tensor"
_OTHER = "other"


def _kind(annotation: Any) -> str:
    if annotation is torch.Tensor:
        return _TENSOR
    if typing.get_origin(annotation) is typing.Union and set(typing.get_args(annotation)) == {torch.Tensor,
                                                                                                type(None)}:
        return _OPTIONAL_TENSOR
    return _OTHER


def _parameters(reference: Callable[..., Any]) -> list[tuple[str, str]]:
    hints = typing.get_type_hints(reference)
    names = list(inspect.signature(reference).parameters)
    return [(f"a{i}", _kind(hints.get(name))) for i, name in enumerate(names)]


def _metadata(name: str, kind: str) -> str:
    tensor = f"{name}.shape, {name}.stride(), {name}.dtype, {name}.device"
    if kind == _TENSOR:
        return tensor
    if kind == _OPTIONAL_TENSOR:
        return f"None if {name} is None else ({tensor})"
    return f"({tensor}) if isinstance({name}, Tensor) else (type({name}), {name})"


def _requires_grad(name: str, kind: str) -> str:
    if kind == _TENSOR:
        return f"{name}.requires_grad"
    if kind == _OPTIONAL_TENSOR:
        return f"({name} is not None and {name}.requires_grad)"
    return f"(isinstance({name}, Tensor) and {name}.requires_grad)"


def _compile(name: str, parameters: list[tuple[str, str]], body: str) -> Callable[..., Any]:
    source = f"def {name}({', '.join(p for p, _ in parameters)}):\n    return {body}\n"
    namespace: dict[str, Any] = {"Tensor": torch.Tensor}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - source built from parameter kinds only
    return namespace[name]


def signature_function(reference: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
    """``f(*args)``: the hashable metadata of a call of ``reference`` (see the module docstring)."""
    parameters = _parameters(reference)
    items = ", ".join(_metadata(p, kind) for p, kind in parameters)
    return _compile("call_signature", parameters, f"({items},)")


def requires_grad_function(reference: Callable[..., Any]) -> Callable[..., bool]:
    """``f(*args)``: whether a tensor argument of a call of ``reference`` requires grad."""
    parameters = _parameters(reference)
    tests = " or ".join(_requires_grad(p, kind) for p, kind in parameters) or "False"
    return _compile("any_requires_grad", parameters, f"bool({tests})")


#: repeated signatures an op keeps as tensor guards (see the module docstring), the latest first
RECENT_SIGNATURES = 4


def _tensor_guards() -> Optional[Callable[..., Any]]:
    """``guards(*tensors)``: a C check that tensors have these tensors' metadata (``guards(...).check(*t)``),
    or None where torch has none that tells apart what a call signature does."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def guards(*tensors: torch.Tensor) -> Any:
            return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                dynamic_dims_strides=[list(t.stride()) for t in tensors])

        seen = torch.zeros(2, 3)
        check = guards(seen).check
        alike = check(torch.ones(2, 3))
        differing = (seen.t().contiguous().t(), seen.double(), seen[:1], seen.view(3, 2), seen.view(1, 2, 3),
                     torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, device="meta"), torch.zeros(2, 6)[:, ::2])
        if alike and not any(check(other) for other in differing) and not check(None):
            return guards
    except Exception:  # another torch: its guards' API or semantics differ; signatures are built instead
        pass
    return None


_GUARDS = _tensor_guards()
#: stands for an optional tensor passed as None in the guards (whether it was None is checked apart)
_ABSENT = torch.empty(())


def _remembering(recent: list[Any]) -> Optional[Callable[..., None]]:
    """``remember(others, entry, *tensors)``: keep a repeated signature's verdict ``entry`` as the guards
    of its ``tensors`` and the values of its ``others`` in ``recent`` (None without guards)."""
    if _GUARDS is None:
        return None
    guards = _GUARDS

    def remember(others: tuple[Any, ...], entry: Any, *tensors: torch.Tensor) -> None:
        if any(isinstance(value, torch.Tensor) for value in others):  # a tensor where a value belongs
            return
        recent.insert(0, (guards(*tensors).check, others, entry))
        del recent[RECENT_SIGNATURES:]

    return remember


_NAMES_THE_CALL_USES = frozenset({"Tensor", "type", "isinstance", "bool"})


def call_function(op: Any, reference: Callable[..., Any], mutated: tuple[str, ...], tracers: list[Any],
                  general: Callable[..., Any]) -> Callable[..., Any]:
    """``f(*args)``: an eager call of ``op`` in one frame, written out for ``reference``'s parameters.

    The repeated call (its signature checked before) costs the guards of ``Op.__call__``, the
    signature, one lookup in ``op._checked`` and the run; anything else goes to ``general`` (traced or
    differentiated calls, arguments whose metadata cannot be read: ``Op.__call__``'s own path) or to
    ``op.dispatch`` (a signature not seen yet). Spelled out as one function, not three calls with
    ``*args`` each: a decode-size layer norm's overhead over its ATen kernel dropped from 2.8 to 2.3 µs,
    below ``nn.LayerNorm``'s module call (2.6). The parameters keep the reference's names, so a call with
    one missing says which."""
    names = list(inspect.signature(reference).parameters)
    kinds = [kind for _, kind in _parameters(reference)]
    taken = [name for name in names if name.startswith("_") or name in _NAMES_THE_CALL_USES]
    if taken:
        raise ValueError(f"{op.name}: reference parameters {taken} would hide names the generated call uses "
                         f"(names starting with '_', {sorted(_NAMES_THE_CALL_USES)})")
    arguments = ", ".join(names)
    metadata = ", ".join(_metadata(name, kind) for name, kind in zip(names, kinds))
    requires_grad = " or ".join(_requires_grad(name, kind) for name, kind in zip(names, kinds)) or "False"
    remember = _remembering(op._recent)
    if remember is None:  # no guards here: the signature, built and looked up on every call
        placement = f"        _signature = (_signature, _placement({arguments}))\n" if mutated else ""
        lookup = f"        _signature = ({metadata},)\n{placement}        _entry = _checked.get(_signature)\n"
    else:
        # what the guards check (the tensors, an absent optional one standing as _ABSENT) and what is
        # compared apart (the other arguments' types and values, which optional tensors are None, and
        # for an in-place op where its tensors lie, last)
        guarded = ", ".join(name if kind == _TENSOR else f"(_ABSENT if {name} is None else {name})"
                            for name, kind in zip(names, kinds) if kind != _OTHER)
        others = [f"type({name}), {name}" if kind == _OTHER else f"{name} is None"
                  for name, kind in zip(names, kinds) if kind != _TENSOR]
        if mutated:
            others.append(f"_placement({arguments})")
        placement = "            _signature = (_signature, _others[-1])\n" if mutated else ""
        lookup = (
            f"        _others = ({''.join(part + ', ' for part in others)})\n"
            "        for _check, _seen, _found in _recent:\n"
            f"            if _seen == _others and _check({guarded}):\n"
            "                _entry = _found\n"
            "                break\n"
            "        else:\n"
            f"            _signature = ({metadata},)\n"
            f"{placement}"
            "            _entry = _checked.get(_signature)\n"
            "            if _entry is not None:\n"
            f"                _remember(_others, _entry, {guarded})\n"
        )
    written = ", ".join(mutated)
    finish = (f"    _result = _run({arguments})\n    _increment_version(({written},))\n    return _result\n"
              if mutated else f"    return _run({arguments})\n")
    source = (
        f"def call({arguments}):\n"
        "    try:\n"
        f"        if (_is_compiling() or _is_fx_tracing() or isinstance({names[0]}, _FakeTensor)\n"
        f"                or _grad_enabled() and ({requires_grad})):\n"
        f"            return _general({arguments})\n"
        f"{lookup}"
        "    except (TypeError, AttributeError, RuntimeError, NotImplementedError):\n"
        f"        return _general({arguments})\n"
        "    if _entry is None:\n"
        f"        return _dispatch({arguments})\n"
        "    _plan, _run = _entry\n"
        "    _plan.calls += 1\n"
        "    if _tracers:\n"
        "        for _record in _tracers:\n"
        "            _record.append(_plan)\n"
        f"{finish}"
    )
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing

    namespace: dict[str, Any] = {
        "Tensor": torch.Tensor, "_FakeTensor": FakeTensor, "_is_compiling": torch.compiler.is_compiling,
        "_is_fx_tracing": is_fx_symbolic_tracing, "_grad_enabled": torch.is_grad_enabled, "_tracers": tracers,
        "_general": general, "_dispatch": op.dispatch, "_checked": op._checked, "_placement": op._placement,
        "_increment_version": torch.autograd.graph.increment_version, "_recent": op._recent,
        "_remember": remember, "_ABSENT": _ABSENT,
    }
    exec(compile(source, f"<{op.name} call>", "exec"), namespace)  # noqa: S102 - source built from parameter kinds only
    return namespace["call"]


def _span(name: str, index: int) -> str:
    """Source setting ``s<index>``/``e<index>`` to the address range of tensor ``name`` (its own bytes
    when contiguous, else its storage's, which holds them)."""
    return (f"    if {name}.is_contiguous():\n"
            f"        s{index} = {name}.data_ptr(); e{index} = s{index} + {name}.nbytes\n"
            f"    else:\n"
            f"        st = {name}.untyped_storage(); s{index} = st.data_ptr(); e{index} = s{index} + st.nbytes()\n")


def placement_function(reference: Callable[..., Any], mutated: tuple[str, ...],
                       general: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    """``f(*args)``: where an in-place call's tensors lie, as far as its checks can tell: the pairs
    of arguments (positions and addresses) whose address ranges meet, among the pairs with an
    argument the op writes (its checks compare nothing else). ``general(args)`` (a loop over any
    arguments, :func:`.registry._placement`) takes calls with a tensor where the annotations say
    otherwise. Written out per op as :func:`signature_function` is: the loop cost 2.5 µs of an
    in-place layer norm's 12 at one row."""
    parameters = _parameters(reference)
    names = list(inspect.signature(reference).parameters)
    written = {f"a{names.index(name)}" for name in mutated}
    tensors = [(p, kind) for p, kind in parameters if kind != _OTHER]
    others = [p for p, kind in parameters if kind == _OTHER]
    lines = [f"def placement({', '.join(p for p, _ in parameters)}):\n"]
    if others:
        lines.append(f"    if {' or '.join(f'isinstance({p}, Tensor)' for p in others)}:\n"
                     f"        return general(({', '.join(p for p, _ in parameters)},))\n")
    for index, (p, kind) in enumerate(tensors):
        span = _span(p, index)
        if kind == _OPTIONAL_TENSOR:
            span = f"    if {p} is not None:\n" + "".join(f"    {line}\n" for line in span.splitlines())
        lines.append(span)
    lines.append("    meeting = ()\n")
    for i, (p, kind_p) in enumerate(tensors):
        for j, (q, kind_q) in enumerate(tensors[i + 1:], i + 1):
            if p not in written and q not in written:
                continue
            test = f"(s{i} < e{j} and s{j} < e{i} or s{i} == s{j})"
            present = [f"{name} is not None" for name, kind in ((p, kind_p), (q, kind_q)) if kind == _OPTIONAL_TENSOR]
            condition = " and ".join([*present, test])
            lines.append(f"    if {condition}:\n"
                         f"        meeting += (({p[1:]}, {q[1:]}, {p}.data_ptr(), {q}.data_ptr()),)\n")
    lines.append("    return meeting\n")
    namespace: dict[str, Any] = {"Tensor": torch.Tensor, "general": general}
    exec(compile("".join(lines), "<placement>", "exec"), namespace)  # noqa: S102 - source built from parameter kinds only
    return namespace["placement"]
