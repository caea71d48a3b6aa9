"""What every kernel module shares: a tunable-kernel description and a Helion launcher.

:class:`KernelSpec` names a kernel's tuned-config namespace, the DSL functions whose source the
tuned configs depend on, its built-in default config and its search space.

:class:`HelionFunction` compiles a Helion kernel for one explicit config and hands back Helion's
generated host function (as a :class:`.launch_binding.HostLaunch`), so the hot path is one call
into generated code: Helion's own per-call binding (tens of microseconds) runs once per
specialisation, when an op builds its plan, and for ops that opt in the host code itself runs once
per call signature (see :mod:`.launch_binding`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import targets
from .interpret import interpreter_mode
from .launch_binding import HostLaunch

Config = dict[str, Any]
INT32_MAX = 2**31 - 1
#: The annotation of a kernel's compile-time arguments. Annotations stay strings here and Helion
#: takes any whose text names ``constexpr``, so writing one needs no Helion import.
Constexpr = Any


@dataclasses.dataclass(frozen=True, eq=False)
class KernelSpec:
    """A tunable kernel: config namespace, source, default config and search space."""

    name: str
    functions: tuple[Callable[..., Any], ...]
    default_config: Callable[[Mapping[str, Any]], Config]
    candidate_configs: Callable[[Mapping[str, Any]], list[Config]]

    @functools.cached_property
    def source_hash(self) -> str:
        digest = hashlib.sha256(self.name.encode())
        for fn in self.functions:
            digest.update(inspect.getsource(getattr(fn, "fn", fn)).encode())
        return digest.hexdigest()[:16]


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def helion_available() -> str | None:
    """None when Helion imports, else why not."""
    try:
        import helion  # noqa: F401
    except Exception as err:  # ImportError, or an Inductor mismatch inside Helion
        return f"helion is not importable ({type(err).__name__}: {err})"
    return None


class HelionFunction:
    """One Helion kernel function, compiled per (config, index width, argument specialisation).

    ``memory_bound`` marks kernels whose speed is their memory traffic (norms, activations, KV
    writes): in compile-for-target mode they must read aligned contiguous rows with 128-bit loads.

    ``fp_fusion=False`` forbids the compiler to contract a multiply and an add into one FMA, so
    every rounding the kernel writes happens: kernels that follow a Hugging Face module's 16-bit
    roundings need it. Triton 3.6 (not 3.9) turns ``round(round(a * w) + b)`` on bf16 values into
    one ``fma.rn.bf16``, which rounded 23-30% of Chameleon's layer-norm outputs differently from
    the module on an H200. It costs a memory-bound kernel nothing.
    """

    def __init__(self, fn: Callable[..., Any], *, dot_precision: str | None = None, memory_bound: bool = False,
                 fp_fusion: bool = True) -> None:
        self.fn = fn
        self.name = fn.__name__.lstrip("_")
        self.dot_precision = dot_precision  # "ieee" for exact fp32 dots (Triton's default is TF32)
        self.memory_bound = memory_bound
        # Triton launch options Helion's config does not carry
        self.launch_options: dict[str, Any] = {} if fp_fusion else {"enable_fp_fusion": False}
        self._kernels: dict[tuple[bool, tuple[tuple[int, ...], ...] | None], Any] = {}

    def _kernel(self, int64: bool, size_class: tuple[tuple[int, ...], ...] | None) -> Any:
        kernel = self._kernels.get((int64, size_class))
        if kernel is None:
            import helion
            import helion.language

            # The kernel modules name ``helion.language`` as ``hl`` in function bodies alone, which
            # Helion reads from the module's globals when it compiles (checking it is the module
            # itself); they leave it unbound until here, as importing Helion takes seconds (4 of
            # the 8.5 importing hw_agnostic.ops took on a 2-core EPYC) that a process running no
            # kernel, such as any on a CPU without an interpreter, should not pay.
            self.fn.__globals__["hl"] = helion.language
            kernel = helion.kernel(
                self.fn,
                static_shapes=False,
                index_dtype=torch.int64 if int64 else torch.int32,
                autotune_effort="none",
                **({"dot_precision": self.dot_precision} if self.dot_precision else {}),
            )
            self._kernels[(int64, size_class)] = kernel
        return kernel

    def compile(self, config: Config, args: tuple[Any, ...], *, int64: bool) -> Callable[..., Any]:
        """A callable running the kernel with ``config`` on arguments specialised like ``args``.

        The result is valid for any arguments with the same dtypes, devices, constexpr values
        and aliasing as ``args``; callers cache it under a key that captures those. In
        compile-for-target mode (:mod:`.targets`) calling it compiles its launches for the
        mode's targets and runs nothing.
        """
        import helion

        compiling_for_targets = targets.active_mode() is not None
        if compiling_for_targets and interpreter_mode() is not None:
            raise RuntimeError(targets.INTERPRETER_CONFLICT)
        bound = self._kernel(int64, _size_class(config, args)).bind(args)
        if interpreter_mode() == "helion":
            # Eager interpret mode runs the kernel body as PyTorch; configs do not apply.
            return bound
        fitted = _fit_config(bound.config_spec, config)
        host = bound.compile_config(helion.Config(**fitted))
        if compiling_for_targets:
            return targets.TargetLaunch(self.name, fitted, host, memory_bound=self.memory_bound,
                                        launch_options=self.launch_options)
        return HostLaunch(host, _launcher_with(tuple(self.launch_options.items())))

    def launched_block_sizes(self, config: Config, args: tuple[Any, ...], *, int64: bool) -> list[int] | None:
        """The block sizes Helion launches ``config`` with on arguments like ``args`` (it raises a block
        below a dot's minimum on the device, for one); None under the eager interpreter, where a
        registered block size is its maximum and the others span their dims."""
        if interpreter_mode() == "helion":
            return None
        bound = self._kernel(int64, _size_class(config, args)).bind(args)
        normalized = bound.config_spec.normalized_config(_fit_config(bound.config_spec, config))
        return [int(size) for size in normalized.config["block_sizes"]]


@functools.lru_cache(maxsize=None)
def _launcher_with(options: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
    """Helion's default launcher (what its host code launches through), passing Triton these launch
    options too."""
    from helion.runtime import default_launcher

    if not options:
        return default_launcher
    extra = dict(options)

    def launch(triton_kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        return default_launcher(triton_kernel, grid, *args, **extra, **kwargs)

    return launch


def _size_class(config: Config, args: tuple[Any, ...]) -> tuple[tuple[int, ...], ...] | None:
    """What a bound kernel for ``config`` must have been bound on, beyond Helion's own key.

    Helion derives a bound kernel's reduction loops from the sizes of the first arguments it
    binds and reuses that bound kernel for every later size with the same specialisation key: a
    reduction loop at least as long as those first sizes becomes a persistent reduction. So a
    config asking for 4096-wide chunks, bound after a call on 37-wide rows, would generate the
    persistent layout at 65536 (255 registers and spills on every GPU target). Configs with a
    reduction loop therefore get a binding per power-of-two class of the tensor sizes; other
    configs share Helion's (its block sizes do not depend on the first sizes).
    """
    if not any(loop is not None for loop in config.get("reduction_loops") or ()):
        return None
    return tuple(tuple(next_power_of_2(int(s)) for s in a.shape) for a in args if isinstance(a, torch.Tensor))


def _fit_config(spec: Any, config: Config) -> Config:
    """Fit a key's config to one specialisation of the kernel.

    Drops per-loop settings for loops Helion specialised away (a size-1 hidden dim has no
    reduction loop), and uses block size 1 over dims Helion specialised to size 1: Helion 1.5
    drops such a dim's index and mask from stores, so a larger block writes every row to row 0.
    """
    fitted = dict(config)
    for name, value in config.items():
        expected = getattr(spec, name, None)
        if isinstance(value, list) and expected is not None and hasattr(expected, "__len__"):
            fitted[name] = value[: len(expected)]
    blocks = fitted.get("block_sizes")
    if isinstance(blocks, list):
        specs = list(getattr(spec, "block_sizes", []))
        fitted["block_sizes"] = [
            1 if i < len(specs) and getattr(specs[i], "size_hint", 2) <= 1 else block for i, block in enumerate(blocks)
        ]
    return fitted
