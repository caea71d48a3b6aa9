"""One mechanism for every op: the reference is the spec, providers run it fast.

An :class:`Op` is built from

* ``reference``: a plain-PyTorch function. Its annotated signature becomes the schema of the
  custom op ``torch.ops.hw_agnostic.<name>``, its result defines correctness, and it is also the
  fake implementation (run on fake tensors), so ops trace under ``torch.compile``; an op whose
  output shapes depend on data passes its own ``fake``.
* ``check``: checks the arguments, raising an error that names the bad one. It reads only
  metadata, so it also runs on fake tensors while ``torch.compile`` traces.
* ``key``: the call's key for valid arguments, a hashable ``NamedTuple`` with at least
  ``device`` (device type) and ``tokens`` (the bucketed row count, see
  :mod:`hw_agnostic.autotune.keys`). Everything a provider's predicate or config depends on
  must be in the key.
* ``providers``: tried in order; the first that accepts the key runs the call. A provider
  declares the device types it compiles for, the CPU interpreters it runs under, a predicate
  over the key, and the tuned-config kernel it launches. The reference is always appended last
  and accepts everything.

Dispatch builds a :class:`Plan` once per key (provider choice, config lookup, kernel binding)
and caches it, so a call costs ``check`` and ``key`` plus one dict lookup plus the launch.

Forcing a provider: ``HW_AGNOSTIC_PROVIDER=helion`` (all ops), ``HW_AGNOSTIC_PROVIDER=
rms_norm=reference,helion`` (one op, then all others), or :func:`use_provider` in code. A forced
provider that cannot run a call raises :class:`ProviderError` saying why. Which provider ran and
why the others were skipped: :meth:`Op.plan`, :func:`trace_dispatch`, and a DEBUG log line on
the ``hw_agnostic.ops`` logger each time a plan is made.

On the reference path the reference runs compiled or in an allocation-lean form with the same
results (the op's ``compiled_reference`` factory; see :mod:`.compiled_reference`), falling back
to eager if compiling fails; ``HW_AGNOSTIC_COMPILE_REFERENCE=0`` runs the plain reference, ``=native``
the native forms below without compiling anything (the plain reference elsewhere). Keys
for which the op has a faster eager form with the spec's results (its ``native(key)``: the one
ATen kernel of ``nn.LayerNorm`` where it beats the compiled pass) run that instead: such a call
then costs about what the module it replaces costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from ..autotune import cache as config_cache
from ..autotune.keys import make_key
from ..autotune.platform import compile_target, platform_of
from ..kernels import targets
from ..kernels.interpret import interpreter_mode
from ..kernels.runtime import KernelSpec
from . import call_signature, checks
from .compiled_reference import CompiledReference

log = logging.getLogger("hw_agnostic.ops")

PROVIDER_ENV = "HW_AGNOSTIC_PROVIDER"
COMPILE_ENV = "HW_AGNOSTIC_COMPILE_REFERENCE"
GPU_DEVICES = frozenset({"cuda", "xpu"})
CHECKED_SIGNATURES = 512  # per op; decode steps with changing lengths must not grow it without bound
#: Devices whose calls a Triton-generating provider takes in compile-for-target mode.
TARGET_MODE_DEVICES = frozenset({"cpu", "meta"})


class ProviderError(RuntimeError):
    """A forced provider cannot run the call (the message says why)."""


def _accept_all(call: Any) -> str | None:
    return None


def _always_available() -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation of an op.

    ``build(call, config, args)`` returns the function that runs calls with this key: it gets the
    key, the launch config (``None`` for providers without a tuned kernel) and the first call's
    arguments (to bind or compile against), and is called once per key.
    """

    name: str
    build: Callable[[Any, dict[str, Any] | None, tuple[Any, ...]], Callable[..., Any]]
    devices: frozenset[str] = GPU_DEVICES
    interpreters: frozenset[str] = frozenset()
    accepts: Callable[[Any], str | None] = _accept_all
    kernel: KernelSpec | None = None
    tuning_key: Callable[[Any], dict[str, Any]] | None = None
    available: Callable[[], str | None] = _always_available

    def compiles_for_targets(self, call: Any) -> bool:
        """In compile-for-target mode a provider generating Triton takes CPU and meta calls:
        its launches are compiled for the targets, and the reference computes the results."""
        return self._compiles_for_targets_on(call.device)

    def _compiles_for_targets_on(self, device: str) -> bool:
        return device in TARGET_MODE_DEVICES and "triton" in self.interpreters and targets.active_mode() is not None

    def takes_device(self, device: str) -> bool:
        """Whether calls on ``device`` reach this provider: its devices, the CPU under one of its
        interpreters, or compile-for-target mode."""
        return (device in self.devices or self._compiles_for_targets_on(device)
                or (device == "cpu" and interpreter_mode() in self.interpreters))

    def may_run_on(self, device: str) -> bool:
        """Whether this provider could take some call on ``device`` (device, interpreter, target
        mode and availability alone; the key's other fields may still refuse a call)."""
        return self.takes_device(device) and self.available() is None

    def why_not(self, call: Any) -> str | None:
        """None when this provider can run a call with this key, else the reason."""
        if not self.takes_device(call.device):
            supported = ", ".join(sorted(self.devices)) or "none"
            hint = ""
            if call.device == "cpu" and self.interpreters:
                hint = " (on the CPU it runs under " + " or ".join(
                    f"{m.upper()}_INTERPRET=1" for m in sorted(self.interpreters)) + ")"
            return f"device {call.device!r} is not supported (supports {supported}){hint}"
        reason = self.available()
        if reason is not None:
            return reason
        return self.accepts(call)


@dataclasses.dataclass
class Plan:
    """What runs for one key: the provider, its config, and why other providers were skipped."""

    op: str
    key: Any
    provider: str
    config: config_cache.ConfigChoice | None
    skipped: dict[str, str]
    run: Callable[..., Any]
    calls: int = 0
    note: str | None = None

    def bound(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """What runs calls with exactly the metadata and non-tensor values of ``args``: ``run``'s
        ``bind(args)`` where it has one (a run that decides per call, bound to its decision), else ``run``."""
        bind = getattr(self.run, "bind", None)
        return (bind(args) if bind is not None else None) or self.run

    def describe(self) -> str:
        parts = [f"{self.op}: {self.provider}"]
        if self.config is not None:
            parts.append(f"config {self.config.config} from {self.config.describe()}")
        if self.note:
            parts.append(self.note)
        if self.skipped:
            parts.append("skipped " + "; ".join(f"{name}: {why}" for name, why in self.skipped.items()))
        return ", ".join(parts) + f" [{self.key}]"


_ops: dict[str, Op] = {}
_tracers: list[list[Plan]] = []
_forced_in_code: dict[str | None, str] = {}
_config_overrides: dict[str, dict[str, Any]] = {}
_ignored_overrides: set[tuple[str, str]] = set()  # (op, config) pairs already warned about


class Op:
    """A registered op; call it with the reference's positional arguments."""

    def __init__(
        self,
        name: str,
        reference: Callable[..., Any],
        *,
        check: Callable[..., None],
        key: Callable[..., Any],
        providers: Sequence[Provider] = (),
        mutates_args: Sequence[str] = (),
        example_inputs: Callable[..., tuple[Any, ...]] | None = None,
        compiled_reference: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None,
        fake: Callable[..., Any] | None = None,
        differentiable: bool = False,
        fusable: bool = False,
        native: Callable[[Any], Callable[..., Any] | None] | None = None,
    ) -> None:
        if name in _ops:
            raise ValueError(f"op {name!r} is already registered")
        self.name = name
        self.reference = reference
        self.check = check
        self.key = key
        self.mutates_args = tuple(mutates_args)
        self.example_inputs = example_inputs
        # What the reference provider runs when compiling is on: a factory given the op's name
        # and reference, called once per key (for ops whose reference Inductor cannot compile as
        # is, or that run faster another way with the reference's results).
        self.compiled_reference = compiled_reference or CompiledReference
        # For a key, a faster eager form of the spec with its results, or None (see the module docstring).
        self.native = native
        # The fake implementation: the reference itself unless its output shapes depend on data.
        self.fake = fake or reference
        # Differentiable ops get a backward: the reference's, recomputed (kernels forward, autograd back).
        self.differentiable = differentiable
        names = list(inspect.signature(reference).parameters)
        self._signature = call_signature.signature_function(reference)
        self._any_requires_grad = call_signature.requires_grad_function(reference)
        self._mutated_positions = tuple(names.index(name) for name in self.mutates_args)
        # the written tensors of a call: one tensor, or a tuple of them (increment_version takes either)
        self._written = operator.itemgetter(*self._mutated_positions) if self._mutated_positions else None
        self._placement = (call_signature.placement_function(reference, self.mutates_args, _placement)
                           if self.mutates_args else None)
        self.providers: tuple[Provider, ...] = (*providers, _reference_provider(self))
        self._plans: dict[Any, Plan] = {}
        # call signature -> (plan, what runs it), see dispatch
        self._checked: dict[tuple[Any, ...], tuple[Plan, Callable[..., Any]]] = {}
        # the last repeated signatures as guards: (check, other arguments, entry), see call_signature
        self._recent: list[tuple[Callable[..., bool], tuple[Any, ...], tuple[Plan, Callable[..., Any]]]] = []
        # Plans of calls made inside another op under that op's forcing (see run_inside).
        self._inherited_plans: dict[tuple[str, Any], Plan] = {}
        # An eager call in one frame (the public functions call it): see call_signature.call_function.
        # Made first: it refuses parameter names it cannot take before anything is registered.
        self.call = call_signature.call_function(self, reference, self.mutates_args, _tracers, self._call_general)
        self.torch_op = self._register_custom_op()
        self.fusable_op = self._register_fusable_overload() if fusable else None
        _ops[name] = self

    # -- custom op ------------------------------------------------------------------------------

    def _register_custom_op(self) -> Any:
        """``torch.ops.hw_agnostic.<name>``: defined and implemented on the library fragment directly.

        ``torch.library.custom_op`` wraps every call in Python layers (its own autograd kernel,
        an ADInplaceOrView kernel for mutated arguments, its backend wrapper): 10 µs over the
        implementation for a functional op and 22 for an in-place one, on every call a compiled
        graph (``torch.compile``, vLLM) makes. Here a call costs the dispatcher, one Python
        autograd kernel (the reference's backward, or the refusal below) and the implementation,
        which bumps the version counters of what it writes (see :meth:`dispatch`).
        """
        schema = torch.library.infer_schema(self.reference, mutates_args=self.mutates_args)
        qualname, lib = f"hw_agnostic::{self.name}", _library()
        lib.define(f"{self.name}{schema}")
        dispatch = self.dispatch

        def implementation(*args: Any) -> Any:
            return dispatch(*args)

        lib.impl(self.name, implementation, "CompositeExplicitAutograd")
        check, shapes = self.check, self.fake

        def fake(*args: Any) -> Any:
            check(*args)
            return shapes(*args)

        torch.library.register_fake(qualname, fake, lib=lib)
        overload = getattr(torch.ops.hw_agnostic, self.name).default
        if self.differentiable and self.mutates_args:
            raise ValueError(f"op {self.name!r} mutates its arguments; it cannot be differentiable")
        backward = self.reference if self.differentiable else None
        lib.impl(self.name, _autograd_kernel(overload, self.name, backward), "Autograd", with_keyset=True)
        return overload

    def kernel_may_run(self, device: torch.device | str) -> bool:
        """Whether a provider other than the reference could run a call on ``device`` here (or one is forced)."""
        forced = forced_provider(self.name)
        if forced is not None:
            return forced[0] != "reference"
        device = torch.device(device).type
        return any(p.may_run_on(device) for p in self.providers if p.name != "reference")

    def _register_fusable_overload(self) -> Any:
        """``torch.ops.hw_agnostic.<name>.fusable``: the op as its reference's tensor code
        (``CompositeImplicitAutograd``), for graphs where no kernel can take the call.

        Dynamo's graph keeps a ``torch.ops.hw_agnostic`` node, and AOTAutograd decomposes it
        into the reference, which Inductor fuses with its neighbours (a residual add into the
        norm, the activation into the projection's epilogue): the custom op there would be an
        eager call of the same reference that nothing can fuse across."""
        if self.mutates_args:
            raise ValueError(f"op {self.name!r} mutates its arguments; only functional ops are fusable")
        schema = torch.library.infer_schema(self.reference, mutates_args=())
        _library().define(f"{self.name}.fusable{schema}")
        _library().impl(f"{self.name}.fusable", self.reference, "CompositeImplicitAutograd")
        return getattr(torch.ops.hw_agnostic, self.name).fusable

    # -- dispatch -------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def _call_general(self, *args: Any) -> Any:
        """A call that :attr:`call`'s repeated-signature path does not take: traced, differentiated,
        or with metadata it cannot read (one whose signature it has not seen goes to :meth:`dispatch`)."""
        if (
            torch.compiler.is_compiling()
            or is_fx_symbolic_tracing()
            or isinstance(args[0], FakeTensor)
            or (torch.is_grad_enabled() and self._requires_grad(args))
        ):
            # Traced graphs (dynamo, fx, make_fx) see the custom op; autograd sees its backward
            # (differentiable ops) or an op without a derivative, which raises on backward.
            if (self.fusable_op is not None and torch.compiler.is_compiling()
                    and not _kernel_may_run(self.name, args[0].device.type)):
                return self.fusable_op(*args)
            if torch.is_grad_enabled() and any(_requires_grad((args[i],)) for i in self._mutated_positions):
                raise RuntimeError(
                    f"{self.name} writes {', '.join(self.mutates_args)} in place and has no backward, but an argument "
                    "it writes requires grad; use the out-of-place form, or call it under torch.no_grad()"
                )
            return self.torch_op(*args)
        return self.dispatch(*args)

    def _requires_grad(self, args: tuple[Any, ...]) -> bool:
        try:
            return self._any_requires_grad(*args)
        except (TypeError, AttributeError):  # arguments that do not fit the reference's: check names them
            return _requires_grad(args)

    def dispatch(self, *args: Any) -> Any:
        """Run the call on the chosen provider (eager, no custom-op dispatcher in between).

        ``check`` and ``key`` read only metadata, so their verdict for one set of shapes,
        strides, dtypes, devices and scalar values (and storages, for in-place ops) is kept:
        a repeated call costs one lookup of that signature instead of both.
        """
        try:
            # What check and key read (the metadata, never the data): every eager call pays it
            # (see .call_signature).
            signature = self._signature(*args)
            if self._placement is not None:  # the in-place checks compare where the tensors lie
                signature = (signature, self._placement(*args))
            checked = self._checked.get(signature)
        except (TypeError, AttributeError, RuntimeError, NotImplementedError):
            # unfit arguments (check names them), unhashable ones, a tensor without storage: no shortcut
            signature, checked = None, None
        if checked is None:
            self.check(*args)
            key = self.key(*args)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._make_plan(key, args)
            run = plan.run
            if signature is not None:
                run = plan.bound(args)
                if len(self._checked) >= CHECKED_SIGNATURES:
                    self._checked.clear()
                    self._recent.clear()
                self._checked[signature] = (plan, run)
        else:
            plan, run = checked
        plan.calls += 1
        if _tracers:
            for record in _tracers:
                record.append(plan)
        if not self._mutated_positions:
            return run(*args)
        result = run(*args)
        self._mark_written(args)
        return result

    def _mark_written(self, args: tuple[Any, ...]) -> None:
        # A kernel's stores reach memory behind autograd's back (an ATen in-place op bumps the
        # version counters itself): without the bump, a tensor autograd saved before this op
        # wrote it would be used in backward as if unchanged, silently.
        torch.autograd.graph.increment_version(self._written(args))

    def run_inside(self, caller: str, *args: Any) -> Any:
        """Run a call that a provider of op ``caller`` makes as one step of its own work.

        The call is traced (``trace_dispatch`` lists it after its caller's plan) and forced like
        its caller: unless this op is forced itself, a provider forced for ``caller`` that this
        op also has is forced here too, so ``use_provider("helion", fused_experts)`` also runs the
        activation inside it on helion, or raises :class:`ProviderError` saying why it cannot.
        """
        self.check(*args)
        key = self.key(*args)
        inherited = forced_provider(caller) if forced_provider(self.name) is None else None
        if inherited is not None and all(p.name != inherited[0] for p in self.providers):
            inherited = None
        if inherited is None:
            plan = self._plans.get(key) or self._make_plan(key, args)
        else:
            inherited = (inherited[0], f"{inherited[1]}, inside {caller}")
            plan = self._inherited_plans.get((inherited[0], key)) or self._make_plan(key, args, inherited)
        plan.calls += 1
        for record in _tracers:
            record.append(plan)
        result = plan.run(*args)
        if self._mutated_positions:
            self._mark_written(args)
        return result

    def plan(self, *args: Any) -> Plan:
        """The plan a call with these arguments would run, without running it."""
        self.check(*args)
        key = self.key(*args)
        return self._plans.get(key) or self._make_plan(key, args)

    def plans(self) -> list[Plan]:
        return list(self._plans.values())

    def reset(self) -> None:
        self._plans.clear()
        self._checked.clear()
        self._recent.clear()
        self._inherited_plans.clear()

    def _make_plan(self, key: Any, args: tuple[Any, ...], inherited: tuple[str, str] | None = None) -> Plan:
        forced = inherited or forced_provider(self.name)
        names = [p.name for p in self.providers]
        if forced is not None and forced[0] not in names:
            raise ProviderError(
                f"{self.name}: provider {forced[0]!r} was forced ({forced[1]}) but {self.name} has no such "
                f"provider (it has {', '.join(names)})"
            )
        skipped: dict[str, str] = {}
        for provider in self.providers:
            if forced is not None and provider.name != forced[0]:
                continue
            reason = provider.why_not(key)
            if reason is None:
                _check_override(self, provider, key, skipped)
                note = None
                if provider.compiles_for_targets(key):
                    built, note = self._build_for_targets(provider, key, args, skipped)
                else:
                    built = self._build(provider, key, args, skipped)
                if built is not None:
                    run, choice = built
                    plan = Plan(self.name, key, provider.name, choice, skipped, run, note=note)
                    if inherited is None:
                        self._plans[key] = plan
                    else:
                        self._inherited_plans[(inherited[0], key)] = plan
                    log.debug("%s", plan.describe())
                    return plan
            else:
                skipped[provider.name] = reason
        if forced is not None:
            raise ProviderError(
                f"{self.name}: provider {forced[0]!r} was forced ({forced[1]}) but cannot run this call: "
                f"{skipped[forced[0]]}"
            )
        raise AssertionError(f"{self.name}: the reference provider refused a call: {skipped}")

    def _build(
        self, provider: Provider, key: Any, args: tuple[Any, ...], skipped: dict[str, str], target: str | None = None
    ) -> tuple[Callable[..., Any], config_cache.ConfigChoice | None] | None:
        choice = self._config_for(provider, key, args, target) if provider.kernel is not None else None
        try:
            return provider.build(key, None if choice is None else choice.config, args), choice
        except Exception as err:
            if choice is None or choice.source in ("default", "override"):
                if forced_provider(self.name) is not None:
                    raise
                log.warning("hw_agnostic: %s: provider %s failed to build (%s); trying the next one",
                            self.name, provider.name, err)
                skipped[provider.name] = f"failed to build: {err}"
                return None
            log.warning("hw_agnostic: %s: config %s from %s failed to build (%s); using the built-in default",
                        self.name, choice.config, choice.describe(), err)
            assert provider.kernel is not None
            choice = config_cache.ConfigChoice(
                provider.kernel.default_config(choice.key), "default", "builtin", choice.key
            )
            return provider.build(key, choice.config, args), choice

    def _build_for_targets(
        self, provider: Provider, key: Any, args: tuple[Any, ...], skipped: dict[str, str]
    ) -> tuple[tuple[Callable[..., Any], config_cache.ConfigChoice | None] | None, str | None]:
        """Compile-for-target mode: each target builds with the config a GPU of it would get, the
        launches compile instead of running, and the reference computes (unless the mode says not)."""
        mode = targets.active_mode()
        assert mode is not None
        groups: dict[str, list[str]] = {}
        for target in mode.targets:
            choice = self._config_for(provider, key, args, target.name) if provider.kernel is not None else None
            groups.setdefault(repr(choice and choice.config), []).append(target.name)
        launches = []
        for names in groups.values():
            built = self._build(provider, key, args, skipped, target=names[0])
            if built is None:
                return None, None
            launches.append((tuple(names), *built))
        reference_run = self.providers[-1].build(key, None, args) if mode.run_reference else None
        name = self.name
        if not mode.compile and reference_run is None and len(launches) == 1:
            # Launches only counted, nothing computed: the call is its host work, as on a GPU.
            run = launches[0][1]
        else:
            run = self._target_run(name, launches, reference_run)
        where = "; ".join(", ".join(names) + (f" (config {choice.config} from {choice.describe()})"
                                               if len(launches) > 1 and choice is not None else "")
                          for names, _, choice in launches)
        done = "compiled for" if mode.compile else "launches counted for"
        note = f"{done} {where}, " + ("results from the reference" if reference_run else "not run")
        return (run, launches[0][2]), note

    @staticmethod
    def _target_run(name: str, launches: list, reference_run: Callable[..., Any] | None) -> Callable[..., Any]:
        def run(*call_args: Any) -> Any:
            result = None
            with targets.launched_by(name):
                for names, kernel_run, _ in launches:
                    with targets.only(names):
                        result = kernel_run(*call_args)
            return result if reference_run is None else reference_run(*call_args)

        return run

    def _config_for(self, provider: Provider, key: Any, args: tuple[Any, ...],
                    target: str | None = None) -> config_cache.ConfigChoice:
        assert provider.kernel is not None and provider.tuning_key is not None
        tuning_key = make_key(provider.tuning_key(key), key.tokens)
        override = _config_overrides.get(_family(self.name))
        if override is not None:
            return config_cache.ConfigChoice(dict(override), "override", "exact", tuning_key)
        device = _first_device(args)
        if provider.compiles_for_targets(key):  # what a GPU of this target would launch
            mode = targets.active_mode()
            return config_cache.lookup(provider.kernel, mode.platform or platform_of(device), tuning_key,
                                       warn_if_missing=False, target=target)
        platform = platform_of(device)
        return config_cache.lookup(
            provider.kernel, platform, tuning_key, warn_if_missing=platform != "triton_interpreter",
            target=compile_target(device),
        )


def _config_fields(op: Op, key: Any) -> tuple[set[str], set[str]]:
    """The config fields ``op``'s kernels use for calls with ``key``, and Helion's other settings."""
    fields: set[str] = set()
    for provider in op.providers:
        if provider.kernel is None or provider.tuning_key is None:
            continue
        tuning_key = make_key(provider.tuning_key(key), key.tokens)
        for config in (provider.kernel.default_config(tuning_key), *provider.kernel.candidate_configs(tuning_key)):
            fields.update(config)
    helion = sys.modules.get("helion")  # Helion's own settings are valid too (not imported just to ask)
    settings: set[str] = set()
    if fields and helion is not None:
        settings = {name for name, p in inspect.signature(helion.Config.__init__).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return fields, settings


def _check_override(op: Op, provider: Provider, key: Any, skipped: dict[str, str]) -> None:
    """A :func:`use_config` override with a field no kernel takes is an error; one nothing uses, a warning."""
    override = _config_overrides.get(_family(op.name))
    if override is None:
        return
    fields, settings = _config_fields(op, key)
    unknown = sorted(set(override) - fields - settings)
    if fields and unknown:
        raise ValueError(f"use_config({op.name}, ...): unknown config field(s) {', '.join(map(repr, unknown))}; "
                         f"{op.name}'s kernels take {', '.join(sorted(fields))}"
                         + (" (or any other helion.Config setting)" if settings else ""))
    if provider.kernel is None:
        marker = (op.name, repr(sorted(override.items())))
        if marker not in _ignored_overrides:
            _ignored_overrides.add(marker)
            why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
            log.warning("hw_agnostic: use_config(%s, %s) has no effect here: %s runs the %s provider, which takes "
                        "no config%s", op.name, override, op.name, provider.name, f" ({why})" if why else "")


def _placement(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Where the tensor arguments lie, as far as the in-place checks can tell (the general form of
    :func:`.call_signature.placement_function`): they compare places
    only through overlap (:func:`.checks.overlap`), so the pairs of arguments whose address ranges
    (a contiguous tensor's own bytes, else its storage's) meet, with their addresses, and nothing
    of a tensor that meets no other (a decode step's fresh K/V written into the same caches keeps
    one signature)."""
    spans = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if arg.is_contiguous():  # the bytes its elements span (raises without storage: no shortcut then)
                start = arg.data_ptr()
                spans.append((i, start, start + arg.nbytes, arg))
            else:  # its storage's, which holds them
                storage = arg.untyped_storage()
                start = storage.data_ptr()
                spans.append((i, start, start + storage.nbytes(), arg))
    meeting: list[Any] = []
    for n, (i, start, end, arg) in enumerate(spans):
        for j, other_start, other_end, other in spans[n + 1:]:
            if start < other_end and other_start < end or start == other_start:
                meeting.append((i, j, arg.data_ptr(), other.data_ptr()))
    return tuple(meeting)


class _ReferenceVJP(torch.autograd.Function):
    """The forward runs the op below autograd (its kernel); the backward is the vector-Jacobian
    product of its reference, recomputed from the inputs.

    Until backward kernels exist this keeps training, gradient checkpointing and inputs that need
    gradients correct on every provider: the forward runs the kernel, the backward differentiates
    the specification.
    """

    @staticmethod
    def forward(run: Callable[..., Any], reference: Callable[..., Any], *inputs: Any) -> Any:
        return run(*inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.reference, args = inputs[1], inputs[2:]
        is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.is_tensor = is_tensor
        ctx.constants = [None if t else a for t, a in zip(is_tensor, args)]
        ctx.save_for_backward(*(a for t, a in zip(is_tensor, args) if t))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if t else c for t, c in zip(ctx.is_tensor, ctx.constants)]
        positions = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     and ctx.needs_input_grad[i + 2]]
        reference = ctx.reference

        def differentiated(*tensors: torch.Tensor) -> Any:
            args = list(inputs)
            for i, tensor in zip(positions, tensors):
                args[i] = tensor
            return reference(*args)

        with torch.enable_grad():
            _, vjp = torch.func.vjp(differentiated, *(inputs[i] for i in positions))
        found = vjp(grads[0] if len(grads) == 1 else tuple(grads))
        result: list[Any] = [None] * len(inputs)
        for i, grad in zip(positions, found):
            result[i] = grad
        return (None, None, *result)


class _NoDerivative(torch.autograd.Function):
    """Outputs of an op without a derivative, computed from inputs that need gradients: backward
    through them raises, naming the op, instead of passing no gradient on."""

    @staticmethod
    def forward(ctx: Any, name: str, outputs: int, *tensors: torch.Tensor) -> Any:
        ctx.name = name
        return tuple(t.view_as(t) for t in tensors[:outputs])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"hw_agnostic::{ctx.name} has no derivative: it cannot be differentiated (call it on "
                           "inputs that do not require grad, or under torch.no_grad())")


def _autograd_kernel(overload: Any, name: str, reference: Callable[..., Any] | None) -> Callable[..., Any]:
    """The op's Autograd kernel: straight below autograd when no input needs a gradient; else the
    reference's backward (differentiable ops, :class:`_ReferenceVJP`) or a backward that raises
    (:class:`_NoDerivative`)."""
    below = torch._C._after_autograd_keyset

    def autograd_kernel(keyset: Any, *args: Any) -> Any:
        if not torch.is_grad_enabled() or not _requires_grad(args):
            return overload.redispatch(keyset & below, *args)
        if reference is not None:
            return _ReferenceVJP.apply(functools.partial(overload.redispatch, keyset & below), reference, *args)
        result = overload.redispatch(keyset & below, *args)
        if result is None:
            return result
        outputs = result if isinstance(result, tuple) else (result,)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        marked = _NoDerivative.apply(name, len(outputs), *outputs, *inputs)
        return marked if isinstance(result, tuple) else marked[0]

    return autograd_kernel


def _requires_grad(args: tuple[Any, ...]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _first_device(args: tuple[Any, ...]) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# the reference provider


#: ``HW_AGNOSTIC_COMPILE_REFERENCE=native``: the ops' native eager forms where they have one, the
#: plain reference elsewhere, nothing compiled (inside an engine that compiles or runs small
#: steps itself, e.g. vLLM, where per-key compiles cost more than they save).
NATIVE_ONLY = "native"


def reference_mode() -> str:
    """How the reference provider runs: ``"compiled"`` (the default), ``"native"`` or ``"plain"``."""
    value = os.environ.get(COMPILE_ENV, "1").lower()
    if value == NATIVE_ONLY:
        return "native"
    return "plain" if value in ("0", "false", "no", "off") else "compiled"


def compile_reference_enabled() -> bool:
    return reference_mode() == "compiled"


#: Each op's compiled references. They survive :func:`reset` (configs and modes do not change
#: what a reference computes, and recompiling costs seconds), unless it is asked to drop them.
_compiled_references: list[dict[Any, Callable[..., Any]]] = []


_fusable_library: list[torch.library.Library] = []


def _library() -> torch.library.Library:
    """The library fragment holding the ``fusable`` overloads."""
    if not _fusable_library:
        _fusable_library.append(torch.library.Library("hw_agnostic", "FRAGMENT"))
    return _fusable_library[0]


@torch.compiler.assume_constant_result
def _kernel_may_run(op_name: str, device: str) -> bool:
    """:meth:`Op.kernel_may_run`, evaluated once while Dynamo traces (a constant of the graph)."""
    return _ops[op_name].kernel_may_run(device)


def _reference_provider(op: Op) -> Provider:
    compiled: dict[Any, Callable[..., Any]] = {}
    _compiled_references.append(compiled)

    def build(key: Any, config: dict[str, Any] | None, args: tuple[Any, ...]) -> Callable[..., Any]:
        mode = reference_mode()
        if mode == "plain" or key.device not in ("cpu", "cuda"):
            return op.reference
        native = op.native and op.native(key)
        if native:
            return native
        if mode == "native":
            return op.reference
        # On the CPU one compiled reference per op: it traces one graph per dtypes, ranks and
        # scalar arguments, every size symbolic. Elsewhere one per key up to the token count,
        # which dynamo keeps dynamic.
        specialisation = "cpu" if key.device == "cpu" else key._replace(tokens=None)
        if specialisation not in compiled:
            compiled[specialisation] = op.compiled_reference(op.name, op.reference)
        return compiled[specialisation]

    return Provider("reference", build, devices=frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "meta"}))


# --------------------------------------------------------------------------------------------
# forcing providers and configs, inspecting dispatch


def _env_forcing() -> dict[str | None, str]:
    spec = os.environ.get(PROVIDER_ENV, "").strip()
    forcing: dict[str | None, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op_name, sep, provider = item.partition("=")
        if not sep:
            op_name, provider = None, item
        elif op_name not in _ops:
            raise ProviderError(
                f"{PROVIDER_ENV}={spec!r} names op {op_name!r}, which does not exist (ops: {', '.join(sorted(_ops))})"
            )
        forcing[op_name] = provider.strip()
    return forcing


def _family(op_name: str) -> str:
    """An in-place variant (``fused_add_rms_norm_``) shares forcing and configs with its op."""
    return op_name.rstrip("_")


def forced_provider(op_name: str) -> tuple[str, str] | None:
    """The provider forced for ``op_name`` and by what, if any (code wins over the environment)."""
    env = _env_forcing()
    for table, source in ((_forced_in_code, "use_provider"), (env, PROVIDER_ENV)):
        for name in (op_name, _family(op_name)):
            if name in table:
                return table[name], f"{source} for {name}"
    for table, source in ((_forced_in_code, "use_provider"), (env, PROVIDER_ENV)):
        if None in table:
            return table[None], source
    return None


def reset(*, compiled_references: bool = False) -> None:
    """Drop every cached plan (forcing, configs and environment are re-read on the next call), and
    with ``compiled_references=True`` the compiled references too (they compile again when used)."""
    _ignored_overrides.clear()
    for op in _ops.values():
        op.reset()
    if compiled_references:
        for compiled in _compiled_references:
            compiled.clear()


config_cache.on_change(reset)
targets.on_mode_change(reset)


def _op_name(op: str | Op | Callable[..., Any]) -> str:
    if isinstance(op, Op):
        return op.name
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in _ops:
        raise ValueError(f"unknown op {name!r} (ops: {', '.join(sorted(_ops))})")
    return name


@contextlib.contextmanager
def use_provider(provider: str, *ops: str | Op | Callable[..., Any]) -> Iterator[None]:
    """Force ``provider`` for ``ops`` (all ops when none are named) inside the block."""
    targets: list[str | None] = [_op_name(op) for op in ops] or [None]
    saved = dict(_forced_in_code)
    _forced_in_code.update({target: provider for target in targets})
    reset()
    try:
        yield
    finally:
        _forced_in_code.clear()
        _forced_in_code.update(saved)
        reset()


@contextlib.contextmanager
def use_config(op: str | Op | Callable[..., Any], config: dict[str, Any]) -> Iterator[None]:
    """Launch ``op``'s kernel with ``config`` inside the block, whatever the tuned configs say."""
    name = _family(_op_name(op))
    saved = _config_overrides.get(name)
    _config_overrides[name] = dict(config)
    reset()
    try:
        yield
    finally:
        if saved is None:
            _config_overrides.pop(name, None)
        else:
            _config_overrides[name] = saved
        reset()


@contextlib.contextmanager
def trace_dispatch() -> Iterator[list[Plan]]:
    """Record the plan of every op call made inside the block, in call order."""
    record: list[Plan] = []
    _tracers.append(record)
    try:
        yield record
    finally:
        _tracers.remove(record)


def get_op(name: str | Callable[..., Any]) -> Op:
    return _ops[_op_name(name)]


def all_ops() -> dict[str, Op]:
    return dict(_ops)
