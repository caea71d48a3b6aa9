"""What an attention module's forward does with K/V between ``cache.update`` and its attention call.

Paged attention reads K/V from the cache, so it computes what the module computes only when the
module attends over the K/V it stored, or over a head expansion of them that the kernel can take
from the stored heads:

* ``same``: the attention call receives the names ``cache.update`` returned (Llama and most).
* ``interleave``: ``repeat_kv(k, n)`` / ``k.repeat_interleave(n, dim=1)``: stored head ``j // n``
  at head ``j``, the grouped-query layout the kernel reads natively.
* ``tile``: ``k.repeat(1, n, 1, 1)``: stored head ``j % Hkv`` at head ``j`` (JetMoE's mixture of
  attention heads); served by reordering the query heads (see ``paged_attention_forward``).

Anything else derived from the cached K/V (DiffLlama's value halves, split and re-tiled, attended
in two calls) cannot be read from the cache, and the module is declined up front with the reason.
The forward's source is read with :mod:`ast`; a forward whose data flow it cannot follow is not
declined here (the attention function still checks at run time that it receives the stored K/V).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Optional


@dataclasses.dataclass(frozen=True)
class KVFlow:
    expansion: Optional[str] = None  # "same", "interleave" or "tile"; None when the flow was not followed
    refusal: Optional[str] = None  # why the module cannot be paged (None: it can, as far as the flow shows)


@functools.lru_cache(maxsize=None)
def kv_flow(cls: type) -> KVFlow:
    """How ``cls.forward`` passes the K/V it wrote with ``cache.update`` to its attention function."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return KVFlow()
    function = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None:
        return KVFlow()
    return _follow(function)


def _follow(function: ast.FunctionDef | ast.AsyncFunctionDef) -> KVFlow:
    assignments = [n for n in ast.walk(function) if isinstance(n, ast.Assign)]
    updates = [a for a in assignments if _is_cache_update(a.value) and _pair(a.targets[0]) is not None]
    if not updates:
        return KVFlow()
    annotated = [n for n in ast.walk(function) if isinstance(n, ast.AnnAssign) and n.value is not None]
    interfaces = {t.id for a in [*assignments, *annotated] if "ALL_ATTENTION_FUNCTIONS" in ast.unparse(a.value)
                  for t in (a.targets if isinstance(a, ast.Assign) else [a.target]) if isinstance(t, ast.Name)}
    calls = sorted((n for n in ast.walk(function) if isinstance(n, ast.Call) and _is_attention_call(n, interfaces)),
                   key=lambda n: n.lineno)
    if not calls:
        return KVFlow()
    update = max(updates, key=lambda a: a.lineno)
    stored = _pair(update.targets[0])
    assert stored is not None
    kinds, derived = [], []
    for call in calls:
        for position, name in ((2, "key"), (3, "value")):
            argument = _argument(call, position, name)
            if not isinstance(argument, ast.Name):
                return KVFlow()
            kind = _expansion(argument.id, call.lineno, update, stored[position - 2], assignments)
            if kind is None:
                return KVFlow()
            if kind.startswith("derived"):
                derived.append(kind.partition(":")[2].strip())
            kinds.append(kind)
    why = f" ({'; '.join(dict.fromkeys(derived))})" if derived else ""
    if len(calls) > 1 and all(c.lineno > update.lineno for c in calls) and _in_one_block(function, calls):
        return KVFlow(refusal=f"calls its attention {len(calls)} times after one cache write{why}; the paged kernel "
                              "attends once over the K/V as stored")
    if derived:
        return KVFlow(refusal=f"computes attention with K/V derived from the cached ones after cache.update{why}; "
                              "the paged kernel reads the K/V as stored")
    if len(set(kinds)) != 1:
        return KVFlow(refusal=f"expands its keys and values differently after cache.update ({', '.join(kinds)})")
    return KVFlow(expansion=kinds[0])


def _is_cache_update(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
            and len(node.args) >= 2)


def _pair(target: ast.AST) -> Optional[tuple[str, str]]:
    if isinstance(target, ast.Tuple) and len(target.elts) == 2 and all(isinstance(e, ast.Name) for e in target.elts):
        return target.elts[0].id, target.elts[1].id  # type: ignore[union-attr]
    return None


def _is_attention_call(call: ast.Call, interfaces: set[str]) -> bool:
    func = call.func  # ``attention_interface(...)`` or ``ALL_ATTENTION_FUNCTIONS[name](...)``
    named = isinstance(func, ast.Name) and func.id in interfaces
    looked_up = isinstance(func, ast.Subscript) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(func.value)
    return (named or looked_up) and len(call.args) >= 2


def _argument(call: ast.Call, position: int, name: str) -> Optional[ast.AST]:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _in_one_block(function: ast.AST, calls: list[ast.Call]) -> bool:
    """Whether the calls run one after another (not in exclusive branches): one statement list holds them all."""
    for node in ast.walk(function):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and all(any(_contains(s, c) for s in block) for c in calls):
                holders = {id(s) for c in calls for s in block if _contains(s, c)}
                if len(holders) == len(calls):
                    return True
    return False


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


def _expansion(name: str, line: int, update: ast.Assign, stored: str, assignments: list[ast.Assign]) -> Optional[str]:
    """What ``name`` holds at ``line``, relative to ``stored`` as ``update`` returned it."""
    before = [a for a in assignments if a.lineno < line and any(name in _names(t) for t in a.targets)]
    if not before:
        return None
    last = max(before, key=lambda a: a.lineno)
    if last is update:
        return "same" if name == stored else None
    if last.lineno < update.lineno:
        return None  # set before the cache write: not a flow this reads
    value = last.value
    source = _source_of(value)
    if source == stored and _previous_is(update, stored, last, assignments):
        kind = _head_expansion(value)
        if kind is not None:
            return kind
    return f"derived: {ast.unparse(last)[:100]}"


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _source_of(value: ast.AST) -> Optional[str]:
    """The tensor an expansion reads: ``x`` of ``x.repeat(...)``, ``repeat_kv(x, n)``, ``x.repeat_interleave(...)``."""
    if isinstance(value, ast.Call):
        if isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name):
            return value.func.value.id
        if isinstance(value.func, ast.Name) and value.args and isinstance(value.args[0], ast.Name):
            return value.args[0].id
    return None


def _previous_is(update: ast.Assign, name: str, assignment: ast.Assign, assignments: list[ast.Assign]) -> bool:
    """Whether ``name``'s assignment before ``assignment`` is the cache update."""
    earlier = [a for a in assignments if a.lineno < assignment.lineno and any(name in _names(t) for t in a.targets)]
    return bool(earlier) and max(earlier, key=lambda a: a.lineno) is update


def _head_expansion(value: ast.AST) -> Optional[str]:
    if not isinstance(value, ast.Call):
        return None
    func = value.func
    if isinstance(func, ast.Name) and func.id == "repeat_kv" and len(value.args) == 2:
        return "interleave"
    if isinstance(func, ast.Attribute) and func.attr == "repeat_interleave":
        dim = next((k.value for k in value.keywords if k.arg == "dim"), value.args[1] if len(value.args) > 1 else None)
        return "interleave" if isinstance(dim, ast.Constant) and dim.value == 1 else None
    if isinstance(func, ast.Attribute) and func.attr == "repeat" and len(value.args) == 4:
        ones = [a for i, a in enumerate(value.args) if i != 1]
        return "tile" if all(isinstance(a, ast.Constant) and a.value == 1 for a in ones) else None
    return None
