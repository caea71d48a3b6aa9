"""The reference, compiled: what the reference provider runs when compiling is on.

By default the reference runs under ``torch.compile`` (Dynamo checks its guards on every call,
so any reference compiles correctly). Ops whose references are written to work for any sizes,
and whose tests check that on many shapes, opt into the lean path (``lean=True``):

On the CPU the reference is traced once per specialisation with ``make_fx`` (every size
symbolic, so one graph serves every token count), compiled by Inductor into C++ with
``emulate_precision_casts`` and every 16-bit pointwise result rounded explicitly (each rounding
the eager reference does to the input dtype is done too, see :func:`_round_like_eager`; what may
still differ is the order of a reduction's additions), and called straight
through the ``call`` function Inductor generates. ``torch.compile`` would put Dynamo's guards
and AOTAutograd's wrappers in front of every call: about 8 µs, more than a decode-size norm
takes. Calls of up to 32K elements run a single-threaded compile: an OpenMP region costs
microseconds on an idle machine and a scheduler quantum (milliseconds) on a loaded one, and a
decode-size row has nothing to share. Above that, where ATen splits an element-wise op across its
threads too, so does the compiled code: 16 x 4096 fp32 rows took 15 us on two threads against 23
on one, and a single thread after an eager add that ATen had split (the in-place fused norm)
read half the rows from the other core's cache: 63 us against 25.

The lean path checks no guards at run time, so a reference whose trace specialises on a size
(a Python ``int()`` of one, a branch on one) would silently compute garbage for other sizes:
hence opting in. What this path cannot take runs elsewhere: tensors that are not contiguous (the compiled code
assumes the layout it traced) and other devices go to ``torch.compile`` of the reference, empty
tensors and anything that fails to compile run the reference eagerly (with one warning).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("hw_agnostic.ops")

#: Calls whose first tensor has up to this many elements run a single-threaded compile on the CPU:
#: ATen's grain (``at::internal::GRAIN_SIZE``), up to which its element-wise ops stay on one thread.
SINGLE_THREAD_ELEMENTS = 1 << 15


class _Constant:
    """Marks a non-tensor argument in a specialisation key."""


_CONSTANT = _Constant()


class CompiledReference:
    """The reference under torch.compile, or the lean path (see the module docstring); eager on failure."""

    def __init__(self, op_name: str, reference: Callable[..., Any], *, lean: bool = False,
                 inductor_options: dict[str, Any] | None = None) -> None:
        self.op_name = op_name
        self.reference = reference
        self.use_lean = lean
        self.inductor_options = dict(inductor_options or {})  # Inductor settings every compile of it uses
        self.lean: dict[tuple[Any, ...], _LeanGraph | None] = {}
        self._dynamo: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.failed = False

    @property
    def has_compiled(self) -> bool:
        """Whether some specialisation runs compiled code (lean or torch.compile)."""
        return not self.failed and (bool(self._dynamo) or any(g is not None for g in self.lean.values()))

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return self.reference(*args)
        signature = _signature(args)
        graph = self._lean_graph(signature, args)
        if graph is _EMPTY:
            return self.reference(*args)
        if graph is not None:
            try:
                return graph.run(*args)
            except AssertionError:  # a layout the graph was not traced for (Inductor checks strides)
                pass
        return self._compiled(signature, args)

    def bind(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """What runs calls whose arguments have exactly these shapes, strides, dtypes, devices and
        non-tensor values (the caller keys the result on them, as dispatch does): the lean graph's
        entry without the checks :meth:`__call__` repeats per call (2.5 of a decode-size rms norm's
        10 µs), or None where :meth:`__call__` must decide."""
        if self.failed:
            return None
        graph = self._lean_graph(_signature(args), args)
        if graph is None or graph is _EMPTY:
            return None
        entry = graph.run

        def run(*args: Any) -> Any:
            try:
                return entry(*args)
            except AssertionError:  # as in __call__, which then takes the call elsewhere
                return self(*args)

        return run

    def _lean_graph(self, signature: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """The lean graph for these arguments (compiled on first use), None where the lean path
        does not take them, ``_EMPTY`` for an empty tensor (the reference runs it)."""
        if not self.use_lean:
            return None
        elements = None
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if not arg.is_cpu or not arg.is_contiguous():
                    return None
                if arg.numel() == 0:
                    return _EMPTY
                if elements is None:
                    elements = arg.numel()
        small = elements is not None and elements <= SINGLE_THREAD_ELEMENTS
        graph = self.lean.get((small, signature), _MISSING)
        if graph is _MISSING:
            graph = self.lean[(small, signature)] = self._compile_lean(args, 1 if small else None)
        return graph

    def _compile_lean(self, args: tuple[Any, ...], threads: int | None) -> _LeanGraph | None:
        try:
            return _LeanGraph(self.reference, args, threads, self.inductor_options)
        except Exception as err:  # an Inductor that lacks these entry points, no C++ compiler, ...
            log.info("hw_agnostic: %s: the lean compile failed (%s: %s); using torch.compile", self.op_name,
                     type(err).__name__, err)
            return None

    def _compiled(self, signature: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        try:
            compiled = self._dynamo.get(signature)
            if compiled is None:
                # Dynamo keeps compiled code, and its recompile budget, on the code object: a copy
                # per specialisation keeps each one's recompiles from crowding out the others'.
                private = types.FunctionType(self.reference.__code__.replace(), self.reference.__globals__,
                                             self.reference.__name__, self.reference.__defaults__,
                                             self.reference.__closure__)
                compiled = self._dynamo[signature] = torch.compile(
                    private, dynamic=None, fullgraph=True,
                    options={**self.inductor_options, "emulate_precision_casts": True})
            return compiled(*args)
        except Exception as err:  # no C++ compiler, an Inductor bug, ...
            self.failed = True
            log.warning("hw_agnostic: %s: compiling the reference failed (%s: %s); running it eagerly",
                        self.op_name, type(err).__name__, err)
        return self.reference(*args)


_MISSING: Any = object()
_EMPTY: Any = object()


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else (_CONSTANT, a) for a in args)


def lean_compiled_reference(op_name: str, reference: Callable[..., Any]) -> CompiledReference:
    """Traced once, compiled by Inductor, called without Dynamo (strided inputs: torch.compile)."""
    return CompiledReference(op_name, reference, lean=True)


class _LeanGraph:
    """One traced and compiled specialisation of a reference, called through Inductor's ``call``."""

    def __init__(self, reference: Callable[..., Any], args: tuple[Any, ...], threads: int | None,
                 inductor_options: dict[str, Any] | None = None) -> None:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        constants = list(args)
        returned: list[str] = []

        def graph(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(constants)
            for position, tensor in zip(positions, tensors):
                full[position] = tensor
            result = reference(*full)
            if result is None:
                returned.append("none")
                return ()
            if isinstance(result, torch.Tensor):
                returned.append("tensor")
                return (result,)
            returned.append("tuple")
            return tuple(result)

        from torch.fx.experimental import _config as shape_config

        examples = _examples([args[i] for i in positions])
        with shape_config.patch(use_duck_shape=False):  # equal sizes are not assumed to stay equal
            traced = make_fx(graph, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(*examples)
        _round_like_eager(traced)
        fakes = [node.meta["val"] for node in traced.graph.find_nodes(op="placeholder")]
        options: dict[str, Any] = {**(inductor_options or {}), "emulate_precision_casts": True}
        if threads is not None:
            options["cpp.threads"] = threads
        with inductor_config.patch(options):
            compiled = compile_fx_inner(traced, fakes)
        self.threads = threads
        graph_inputs = len(fakes)
        if graph_inputs != len(positions):
            raise RuntimeError(f"traced {graph_inputs} inputs for {len(positions)} tensor arguments")
        self.run = _entry(compiled.current_callable, positions, returned[0])


def _entry(call: Callable[[list[torch.Tensor]], Any], positions: list[int], returned: str) -> Callable[..., Any]:
    """The reference's calling convention over Inductor's ``call`` (a list of the tensor arguments in,
    a list of results out)."""
    if returned == "tensor":
        return lambda *args: call([args[i] for i in positions])[0]
    if returned == "tuple":
        return lambda *args: tuple(call([args[i] for i in positions]))

    def run(*args: Any) -> None:
        call([args[i] for i in positions])

    return run


#: Dtypes whose pointwise results eager PyTorch computes in fp32 and rounds to when it stores them.
_ROUNDED_DTYPES = (torch.bfloat16, torch.float16)


def _round_like_eager(traced: torch.fx.GraphModule) -> None:
    """Make each rounding of a 16-bit pointwise result explicit, as eager PyTorch rounds it.

    Eager stores every bf16/fp16 result, rounded. Inductor computes a fused chain in fp32 and
    rounds only where the graph converts explicitly (``emulate_precision_casts`` keeps those), so a
    16-bit product feeding another op stayed unrounded: Qwen3-Next's gated norm (``weight * y``
    in bf16, then times the fp32 gate) came out one step off in 27% of its elements, Chameleon's
    layer norm in 26%. Each such result gets a round trip through fp32, which Inductor then
    keeps; the trace through ``torch.compile`` did not have the problem, this one does not now."""
    graph = traced.graph
    convert = torch.ops.prims.convert_element_type.default
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        value = node.meta.get("val")
        if (target.namespace != "aten" or torch.Tag.pointwise not in target.tags
                or not isinstance(value, torch.Tensor) or value.dtype not in _ROUNDED_DTYPES):
            continue
        with graph.inserting_after(node):
            wide = graph.call_function(convert, (node, torch.float32))
        with graph.inserting_after(wide):
            rounded = graph.call_function(convert, (wide, value.dtype))
        wide.meta["val"], rounded.meta["val"] = value.to(torch.float32), value
        node.replace_all_uses_with(rounded, delete_user_cb=lambda user: user is not wide)
    graph.lint()
    traced.recompile()


def _examples(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tracing inputs shaped like ``tensors`` but with no size 0 or 1.

    Symbolic tracing specialises sizes 0 and 1: a graph traced on one token would serve only
    one token. Sizes that must match (x's hidden and weight's) are tied by the trace itself.
    """
    return [torch.zeros([max(size, 2) for size in t.shape], dtype=t.dtype, device=t.device) for t in tensors]
