"""Compile-for-target mode: every DSL kernel launch compiled for GPUs, on a machine that has none.

In this mode a kernel launch does not run. Its exact Triton kernel, grid and arguments are
captured from Helion's generated host code (which takes a ``_launcher``), the arguments are
specialised as Triton's JIT specialises real launch arguments (the JIT's own binder: ints equal
to 1 become constexprs, 16-divisible ints and 16-byte-aligned pointers get ``tt.divisibility``),
and ``triton.compile`` builds the kernel for each target with Triton's own backends. The ops
layer lets the reference supply the results, so whole programs (an op call, the test harness,
a rewired model's forward and ``generate``) run through while every kernel they would launch
is compiled. Helion's code generation and Triton's backends are the only compilers involved.

Each kernel x config x target x specialisation gives one :class:`CompileRecord`: success or
the compiler's error, compile time, registers and spills (``ptxas -v`` as Triton runs it, or
the AMDGCN metadata), shared memory against the target's limit, the widest global load and
store, and the matrix instruction class (``tcgen05`` / ``wgmma`` / ``mma.sync`` / ``mfma`` /
``wmma`` / ``none``). :meth:`CompileRecord.problems` applies the rules a launch must pass:

* it compiles;
* no register spills (NVIDIA spill stores/loads, AMD VGPR spills or scratch; SGPR spills into
  VGPR lanes cost no memory traffic and are allowed). On NVIDIA targets a few spilled registers
  (:data:`MAX_OUT_OF_LOOP_SPILL_BYTES`) are allowed when the machine code (``nvdisasm`` of the
  cubin) shows every spill store and load outside the kernel's loops: a value parked in local
  memory before the loops and read back after them costs a few accesses per program, none per
  iteration;
* its shared memory (LDS) fits the target's per-program limit;
* a memory-bound kernel (:attr:`Launch.memory_bound`) reading rows that could be read with
  16-byte vectors (every floating-point tensor argument has unit inner stride, a 16-byte aligned
  start, row strides and row width that are multiples of 16 elements, the facts the JIT's
  specialisation can prove, and its tiles hold at least 16 bytes for each thread of a warp)
  uses 128-bit global loads. A config with more threads than 16-byte pieces of its tile
  breaks this rule: its threads load narrower pieces.

With ``compile=False`` the launches are only counted (:attr:`CompileLog.launches`), and with
``run_reference=False`` too nothing computes: what remains of a call is its host work, which
is how ``bench``'s decode-host suite measures the Python a decode step costs.

Turn it on for a whole process with ``HW_AGNOSTIC_COMPILE_TARGETS=sm_80,sm_90,sm_100,gfx942,
gfx1100`` (or ``all``), or for a block with :func:`compile_for`. Kernels must be generated
outside the CPU interpreters: under ``TRITON_INTERPRET=1`` Helion's generated module references
interpreter-patched functions and does not compile.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .launch_binding import HostLaunch

log = logging.getLogger("hw_agnostic.compile")

TARGETS_ENV = "HW_AGNOSTIC_COMPILE_TARGETS"
VECTOR_BYTES = 16  # a 128-bit global access
#: Spilled bytes (stores and loads, as ``ptxas -v`` counts them) allowed when none is inside a loop
MAX_OUT_OF_LOOP_SPILL_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU architecture Triton compiles for, with the limits its kernels must fit."""

    name: str
    backend: str  # Triton backend: "cuda" or "hip"
    arch: int | str  # compute capability (cuda) or gfx name (hip)
    warp_size: int
    shared_limit: int  # bytes of shared memory (LDS) one program may use
    matrix_instructions: tuple[str, ...]  # the classes this target has, best first
    devices: str

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


#: Shared-memory limits are the per-block opt-in maxima (CUDA programming guide, CDNA3/RDNA3 ISA).
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_80", "cuda", 80, 32, 163 * 1024, ("mma.sync",), "NVIDIA Ampere: A100, A800"),
        Target("sm_90", "cuda", 90, 32, 227 * 1024, ("wgmma", "mma.sync"), "NVIDIA Hopper: H100, H200, GH200"),
        Target("sm_100", "cuda", 100, 32, 227 * 1024, ("tcgen05", "mma.sync"), "NVIDIA Blackwell: B200, GB200"),
        Target("gfx942", "hip", "gfx942", 64, 64 * 1024, ("mfma",), "AMD CDNA3: MI300X, MI300A, MI325X"),
        Target("gfx1100", "hip", "gfx1100", 32, 64 * 1024, ("wmma",), "AMD RDNA3: Radeon RX 7900 XTX, PRO W7900"),
    )
}
ALL_TARGETS = tuple(TARGETS)
MATRIX_CLASSES = ("tcgen05", "wgmma", "mma.sync", "mfma", "wmma", "none")


class TargetCompileError(AssertionError):
    """Launches compiled in compile-for-target mode broke a rule (the message lists them)."""


def parse_targets(spec: str | Iterable[str]) -> tuple[Target, ...]:
    """Targets from ``"sm_90,gfx942"``, ``"all"`` or a list of names; unknown names raise."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    if names == ["all"]:
        names = list(ALL_TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(
            f"compile targets must be names from {', '.join(ALL_TARGETS)} (or 'all'); got {spec!r}"
        )
    return tuple(TARGETS[n] for n in dict.fromkeys(names))


# --------------------------------------------------------------------------------------------
# records


@dataclasses.dataclass(frozen=True)
class Launch:
    """One captured kernel launch: the Triton kernel and exactly what it would be called with."""

    kernel: str
    config: Mapping[str, Any]
    jit_fn: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: Mapping[str, Any]  # num_warps, num_stages, ... as the launcher passes them
    memory_bound: bool
    op: str | None


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    op: str | None
    kernel: str
    config: str  # canonical JSON
    target: str
    source: str  # hash of the generated Triton source (constexprs Helion folds differ only here)
    signature: str  # the specialised signature: name:type[:16 when divisible, or =constexpr value]
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    ok: bool
    error: str | None
    seconds: float
    registers: int | None
    spill_bytes: int | None
    #: NVIDIA: bytes of the spill stores and loads (``STL``/``LDL`` in the SASS) inside a loop; None
    #: where not measured (AMD targets, no ``nvdisasm``), and then every spill counts as in a loop
    loop_spill_bytes: int | None
    shared: int | None
    shared_limit: int
    load_bits: int | None
    store_bits: int | None
    matrix: str | None
    #: Matrix products in the kernel (``tt.dot``) that matrix units could run: on 16- or 8-bit
    #: operands, or fp32 in tf32 (an exact fp32 product runs on FMA units on every target).
    matrix_dots: int | None
    memory_bound: bool
    vector_rule: str  # "required", or why the launch is exempt

    def identity(self) -> tuple[Any, ...]:
        return (self.op, self.kernel, self.config, self.target, self.source, self.signature, self.grid)

    def where(self) -> str:
        return f"kernel {self.kernel}, config {self.config}, target {self.target}"

    def problems(self) -> list[str]:
        """Each rule this launch breaks, as a message naming kernel, config and target."""
        where = f"{self.where()}" + (f" (op {self.op})" if self.op else "")
        if not self.ok:
            return [f"{where}: does not compile: {self.error}"]
        found = []
        if self.spill_bytes and not self.spills_outside_loops():
            inside = "" if self.loop_spill_bytes is None else f", {self.loop_spill_bytes} of them inside loops"
            found.append(f"{where}: spills {self.spill_bytes} bytes of registers{inside} "
                         f"({self.registers} registers used)")
        if self.shared is not None and self.shared > self.shared_limit:
            found.append(f"{where}: needs {self.shared} bytes of shared memory, over the target's "
                         f"{self.shared_limit}")
        if self.vector_rule == "required" and (self.load_bits or 0) < 8 * VECTOR_BYTES:
            found.append(f"{where}: memory-bound kernel reads 16-byte-aligned contiguous rows with at most "
                         f"{self.load_bits or 0}-bit global loads, not 128-bit vectors [{self.signature}]")
        return found

    def spills_outside_loops(self) -> bool:
        """Whether the launch's spills are the few the rules allow: all outside its loops (see the
        module docstring)."""
        return self.loop_spill_bytes == 0 and (self.spill_bytes or 0) <= MAX_OUT_OF_LOOP_SPILL_BYTES

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CompileLog:
    """The records of launches compiled while a mode was active (one per distinct compile)."""

    def __init__(self) -> None:
        self._records: dict[tuple[Any, ...], CompileRecord] = {}
        #: kernel name -> launches made while the mode was active (every launch, compiled or not)
        self.launches: collections.Counter[str] = collections.Counter()

    def add(self, record: CompileRecord) -> None:
        self._records.setdefault(record.identity(), record)

    @property
    def records(self) -> list[CompileRecord]:
        return list(self._records.values())

    def problems(self) -> list[str]:
        return [p for r in self.records for p in r.problems()]

    def check(self) -> None:
        """Raise :class:`TargetCompileError` listing every broken rule, if any."""
        problems = list(dict.fromkeys(self.problems()))
        if problems:
            raise TargetCompileError(f"{len(problems)} compile-for-target problem(s):\n" + "\n".join(problems))

    def to_frame(self) -> Any:
        import pandas as pd

        columns = [f.name for f in dataclasses.fields(CompileRecord)]
        return pd.DataFrame([r.row() for r in self.records], columns=columns)


# --------------------------------------------------------------------------------------------
# the mode


@dataclasses.dataclass(frozen=True)
class Mode:
    targets: tuple[Target, ...]
    #: True: the op layer runs the reference for results. False: kernel outputs are left as
    #: allocated (fine for meta tensors and for walking shapes too big to compute on a CPU).
    run_reference: bool = True
    #: Whose tuned configs the ops look up (e.g. ``nvidia_h100``); None: the calling device's.
    #: Each target also gets its own compile-chosen defaults where that platform has no file.
    platform: str | None = None
    #: False: launches are counted, not compiled (the host work of a call, without compiling).
    compile: bool = True


_modes: list[tuple[Mode, CompileLog]] = []
_process_log = CompileLog()
_env_mode: dict[str, Mode] = {}
_op_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("hw_agnostic_compile_op", default=None)
_only: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("hw_agnostic_compile_only",
                                                                               default=None)
_mode_listeners: list[Callable[[], None]] = []


def on_mode_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` when a :func:`compile_for` block starts or ends (ops drop cached plans)."""
    _mode_listeners.append(callback)


def active_mode() -> Mode | None:
    """The compile-for-target mode in force: the innermost :func:`compile_for`, else the env var."""
    if _modes:
        return _modes[-1][0]
    spec = os.environ.get(TARGETS_ENV, "").strip()
    if not spec or spec.lower() in ("0", "off", "none"):
        return None
    mode = _env_mode.get(spec)
    if mode is None:
        mode = _env_mode[spec] = Mode(parse_targets(spec))
    return mode


def process_log() -> CompileLog:
    """Every record compiled in this process, whichever way the mode was turned on."""
    return _process_log


@contextlib.contextmanager
def compile_for(targets: str | Iterable[str] = ALL_TARGETS, *, run_reference: bool = True,
                platform: str | None = None, compile: bool = True) -> Iterator[CompileLog]:
    """Compile every kernel launch inside the block for ``targets`` instead of running it.

    Each target compiles the config a GPU of it would launch: ``platform``'s tuned configs
    (``nvidia_h100``; by default the calling device's, on a CPU none), else the target's
    compile-chosen defaults, else the kernel's built-in default. ``compile=False`` only counts
    the launches (:attr:`CompileLog.launches`).
    """
    from .interpret import interpreter_mode

    mode = Mode(parse_targets(targets), run_reference, platform, compile)
    if interpreter_mode() is not None:
        raise RuntimeError(INTERPRETER_CONFLICT)
    compile_log = CompileLog()
    _modes.append((mode, compile_log))
    _notify()
    try:
        yield compile_log
    finally:
        _modes.remove((mode, compile_log))
        _notify()


def _notify() -> None:
    for callback in _mode_listeners:
        callback()


@contextlib.contextmanager
def launched_by(op: str) -> Iterator[None]:
    """Label the records of launches made inside the block with the op that made them."""
    token = _op_label.set(op)
    try:
        yield
    finally:
        _op_label.reset(token)


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Compile the launches made inside the block for these of the mode's targets only (a plan
    builds one launcher per config, and targets that get different configs use different ones)."""
    token = _only.set(tuple(names))
    try:
        yield
    finally:
        _only.reset(token)


INTERPRETER_CONFLICT = (
    f"compile-for-target mode ({TARGETS_ENV} / compile_for) cannot run under TRITON_INTERPRET=1 or "
    "HELION_INTERPRET=1: kernels generated for an interpreter reference interpreter-patched functions "
    "and do not compile; unset the interpreter variable"
)


class TargetLaunch(HostLaunch):
    """What a kernel's compile step returns in this mode: a host function whose launches compile.

    Calling it runs Helion's generated host code with a capturing ``_launcher`` (or replays its
    launches, see :mod:`.launch_binding`); each launch is compiled for every target of the active
    mode (once per distinct specialisation) and recorded. Nothing runs on any device.
    """

    def __init__(self, kernel: str, config: Mapping[str, Any], host: Callable[..., Any], *, memory_bound: bool,
                 launch_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, self._capture)
        self.kernel, self.config, self.memory_bound = kernel, dict(config), memory_bound
        self.launch_options = dict(launch_options or {})  # what the real launch adds (see HelionFunction)

    def _capture(self, jit_fn: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        mode = active_mode()
        if mode is None:
            raise RuntimeError(f"{self.kernel}: a kernel built in compile-for-target mode was launched after it ended")
        for _, compile_log in _modes:
            compile_log.launches[self.kernel] += 1
        if not mode.compile:
            return
        args, options = _launch_arguments(args, {**options, **self.launch_options})
        launch = Launch(self.kernel, self.config, jit_fn, tuple(grid), args, options, self.memory_bound,
                        _op_label.get())
        chosen = _only.get()
        for target in mode.targets:
            if chosen is not None and target.name not in chosen:
                continue
            record = compile_launch(launch, target)
            for _, compile_log in _modes:
                compile_log.add(record)
            if record.problems() and not _process_log_has(record):
                for problem in record.problems():
                    log.warning("hw_agnostic: %s", problem)
            _process_log.add(record)


def _process_log_has(record: CompileRecord) -> bool:
    return record.identity() in _process_log._records


def _launch_arguments(args: tuple[Any, ...], options: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What Helion's default launcher would pass to ``JITFunction.run``, minus launch-only options."""
    try:
        from helion.runtime.triton.launcher import compile_only_launch_args
    except ImportError:
        compile_only_launch_args = None
    if compile_only_launch_args is not None:
        args, options = compile_only_launch_args(*args, **options)
    options = {k: v for k, v in options.items() if not k.startswith("_") and v is not None}
    return tuple(args), options


# --------------------------------------------------------------------------------------------
# compiling one launch for one target

_compiled: dict[tuple[Any, ...], CompileRecord] = {}
_binders: dict[tuple[Any, ...], Any] = {}


def compile_launch(launch: Launch, target: Target) -> CompileRecord:
    """Compile ``launch`` for ``target`` as the JIT would on that GPU, and measure the result."""
    import triton
    from triton.compiler import ASTSource

    config = json.dumps(dict(launch.config), sort_keys=True)
    common = dict(op=launch.op, kernel=launch.kernel, config=config, target=target.name,
                  source=str(launch.jit_fn.cache_key)[:12], grid=launch.grid,
                  num_warps=int(launch.options.get("num_warps", 4)),
                  num_stages=int(launch.options.get("num_stages", 3)),
                  shared_limit=target.shared_limit, memory_bound=launch.memory_bound)
    start = time.perf_counter()
    try:
        backend, src_args, options, cache_key = _specialise(launch, target)
    except Exception as err:  # the JIT's binder rejects the arguments: a launch error on the GPU too
        return CompileRecord(**common, signature="?", ok=False, error=_error_text(err), seconds=0.0,
                             registers=None, spill_bytes=None, loop_spill_bytes=None, shared=None, load_bits=None,
                             store_bits=None, matrix=None, matrix_dots=None, vector_rule="n/a")
    signature = _signature_text(launch.jit_fn, *src_args)
    common["signature"] = signature
    cached = _compiled.get(cache_key)
    if cached is not None:
        return dataclasses.replace(cached, **common)
    try:
        with _ptxas_log_capture(target):
            compiled = triton.compile(ASTSource(launch.jit_fn, *src_args), target=target.gpu_target(),
                                      options=options.__dict__)
    except Exception as err:
        record = CompileRecord(**common, ok=False, error=_error_text(err), seconds=time.perf_counter() - start,
                               registers=None, spill_bytes=None, loop_spill_bytes=None, shared=None,
                               load_bits=None, store_bits=None, matrix=None, matrix_dots=None, vector_rule="n/a")
    else:
        record = _measure(compiled, launch, target, common, time.perf_counter() - start)
    _compiled[cache_key] = record
    return record


def _specialise(launch: Launch, target: Target) -> tuple[Any, tuple[Any, Any, Any], Any, tuple[Any, ...]]:
    """The JIT's own binding of the launch arguments for ``target``'s backend.

    Returns the backend, ``(signature, constexprs, attrs)`` for ``ASTSource``, the parsed
    options, and a key identifying this compile (kernel source, target, specialisation, options).
    """
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit_fn = launch.jit_fn
    binder_key = (id(jit_fn), target.name)
    entry = _binders.get(binder_key)
    if entry is None:
        backend = make_backend(target.gpu_target())
        entry = _binders[binder_key] = (jit_fn, backend,
                                        create_function_from_signature(jit_fn.signature, jit_fn.params, backend))
    _, backend, binder = entry
    # The options JITFunction.run adds before binding.
    kwargs = dict(launch.options)
    kwargs["debug"] = kwargs.get("debug", jit_fn.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound_args, specialization, options)
    cache_key = (jit_fn.cache_key, target.name, repr(specialization), repr(sorted(options.__dict__.items())))
    return backend, (signature, constexprs, attrs), options, cache_key


def _signature_text(jit_fn: Any, signature: Mapping[str, str], constexprs: Mapping[tuple, Any],
                    attrs: Mapping[tuple, Any]) -> str:
    parts = []
    for index, (name, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            value = constexprs.get((index,))
            parts.append(f"{name}={value}")
            continue
        flags = attrs.get((index,), [])
        divisible = any(attr[0] == "tt.divisibility" for attr in flags)
        parts.append(f"{name}:{kind}{':16' if divisible else ''}")
    return " ".join(parts)


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    # Triton's errors carry the whole kernel source; keep the head and the line that failed.
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 12:
        lines = lines[:6] + ["..."] + lines[-5:]
    return " | ".join(lines)


# --------------------------------------------------------------------------------------------
# what the compiled kernel uses

_PTXAS_LOG_KEY = "hw_agnostic_ptxas_log"


@contextlib.contextmanager
def _ptxas_log_capture(target: Target) -> Iterator[None]:
    """Keep the ``ptxas -v`` output of Triton's own ptxas run in the kernel's metadata.

    Triton runs ptxas with ``-v`` but deletes the log; a stage-inspection hook wraps its cubin
    stage, has Triton print the log, and stores it in the metadata (which Triton's cache keeps,
    under a cache key of its own), so a cached kernel still reports its registers and spills.
    """
    from triton import knobs

    if target.backend != "cuda" or not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        yield
        return

    def hook(backend: Any = None, stages: Any = None, options: Any = None, language: Any = None,
             capability: Any = None) -> Any:
        if backend is None:
            return _PTXAS_LOG_KEY, _PTXAS_LOG_KEY
        make_cubin = stages.get("cubin")
        if make_cubin is None:
            return None

        def cubin(src: Any, metadata: dict[str, Any]) -> Any:
            text = io.StringIO()
            with contextlib.redirect_stdout(text), knobs.nvidia.scope():
                knobs.nvidia.dump_ptxas_log = True
                result = make_cubin(src, metadata)
            metadata[_PTXAS_LOG_KEY] = text.getvalue()
            return result

        stages["cubin"] = cubin
        return None

    with knobs.runtime.scope():
        knobs.runtime.add_stages_inspection_hook = hook
        yield


def _ptxas_resources(compiled: Any, target: Target) -> tuple[int | None, int | None]:
    text = getattr(compiled.metadata, _PTXAS_LOG_KEY, None)
    if text is None:
        text = _run_ptxas(compiled.asm["ptx"], target)
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(registers.group(1)) if registers else None,
            sum(int(a) + int(b) for a, b in spills) if spills else None)


def _run_ptxas(ptx: str, target: Target) -> str:
    """``ptxas -v`` on the PTX, for Triton versions without a stage-inspection hook."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as handle:
            handle.write(ptx)
        done = subprocess.run([get_ptxas(target.arch).path, "-v", f"--gpu-name={sm_arch_from_capability(target.arch)}",
                               path, "-o", os.devnull], capture_output=True, text=True)
    return done.stderr + done.stdout


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*)")
_SASS_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+`?\((\.L_x_\d+)\)")
_SASS_SPILL = re.compile(r"\b(?:STL|LDL)(?:\.(U?\d+|LU))*\b")


def _sass_loop_spill_bytes(cubin: bytes | None) -> int | None:
    """Bytes of spill stores and loads inside the loops of ``cubin``'s machine code (None: no
    ``nvdisasm`` or no cubin)."""
    import subprocess
    import tempfile

    from triton import knobs

    try:
        tool = knobs.nvidia.nvdisasm.path
    except Exception:  # a Triton without the bundled tool: not measured
        return None
    if not cubin or not tool:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        done = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    return sass_loop_spill_bytes(done.stdout) if done.returncode == 0 else None


def sass_loop_spill_bytes(sass: str) -> int:
    """Bytes of local-memory accesses (``STL``/``LDL``: spills, in Triton's kernels) inside loops of
    ``nvdisasm -c`` output. A loop is the address range from a label to a later branch back to it."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instructions: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        instruction = _SASS_INSTRUCTION.search(line)
        if instruction:
            address = int(instruction.group(1), 16)
            for name in pending:
                labels[name] = address
            pending.clear()
            instructions.append((address, instruction.group(2)))
    loops = []
    for address, text in instructions:
        branch = _SASS_BRANCH.search(text)
        if branch and branch.group(1) in labels and labels[branch.group(1)] <= address:
            loops.append((labels[branch.group(1)], address))
    total = 0
    for address, text in instructions:
        spill = _SASS_SPILL.search(text)
        if spill and any(begin <= address <= end for begin, end in loops):
            width = re.search(r"\.(?:U|S)?(\d+)\b", spill.group(0))
            total += int(width.group(1)) // 8 if width else 4
    return total


def _amdgcn_resources(amdgcn: str) -> tuple[int | None, int | None]:
    def field(name: str) -> int:
        found = re.search(rf"^\s*\.{name}:\s+(\d+)", amdgcn, flags=re.MULTILINE)
        return int(found.group(1)) if found else 0

    registers = field("vgpr_count") + field("agpr_count")
    # Spilled VGPRs live in scratch (private segment): report its bytes when there is any. SGPR
    # spills are not counted: the compiler parks them in lanes of a VGPR (v_writelane), no memory
    # traffic, and they go to scratch (counted above) only when no VGPR is free.
    scratch = field("private_segment_fixed_size")
    spills = scratch if scratch else 4 * field("vgpr_spill_count")
    return registers or None, spills


_PTX_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_PTX_ASYNC_COPY = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(\d+)")
_AMD_ACCESS = re.compile(r"\b(?:global|buffer)_(load|store)_(?:lds_)?(\w+)")
_AMD_WIDTHS = {"dwordx4": 128, "dwordx3": 96, "dwordx2": 64, "dword": 32, "b128": 128, "b96": 96, "b64": 64,
               "b32": 32, "ushort": 16, "sshort": 16, "short": 16, "u16": 16, "i16": 16, "b16": 16,
               "ubyte": 8, "sbyte": 8, "byte": 8, "u8": 8, "i8": 8, "b8": 8}


def _ptx_access_bits(ptx: str) -> tuple[int | None, int | None]:
    widest = {"ld": 0, "st": 0}
    for kind, suffixes in _PTX_ACCESS.findall(ptx):
        vector, bits = 1, 0
        for part in suffixes.split("."):
            if re.fullmatch(r"v\d+", part):
                vector = int(part[1:])
            elif re.fullmatch(r"[bsuf]\d+", part):
                bits = int(part[1:])
        widest[kind] = max(widest[kind], vector * bits)
    for size in _PTX_ASYNC_COPY.findall(ptx):  # global -> shared copies are global reads
        widest["ld"] = max(widest["ld"], 8 * int(size))
    if "cp.async.bulk" in ptx:  # TMA: whole tiles per instruction
        widest["ld"] = max(widest["ld"], 8 * VECTOR_BYTES)
    return widest["ld"] or None, widest["st"] or None


def _amd_access_bits(amdgcn: str) -> tuple[int | None, int | None]:
    widest = {"load": 0, "store": 0}
    for kind, width in _AMD_ACCESS.findall(amdgcn):
        suffix = width.removeprefix("short_").removeprefix("d16_")
        bits = _AMD_WIDTHS.get(suffix) or _AMD_WIDTHS.get(suffix.split("_")[0], 0)
        if width.startswith("d16") or width.startswith("short_d16"):
            bits = 16
        widest[kind] = max(widest[kind], bits)
    return widest["load"] or None, widest["store"] or None


def _matrix_class(asm: str, target: Target) -> str:
    checks = (("tcgen05", r"\btcgen05\.mma"), ("wgmma", r"\bwgmma\.mma_async"), ("mma.sync", r"\bmma\.sync"),
              ("mfma", r"\bv_mfma"), ("wmma", r"\bv_wmma"))
    for name, pattern in checks:
        if re.search(pattern, asm):
            return name
    return "none"


_TTIR_DOT = re.compile(r"\btt\.dot\b[^\n]*")


def _matrix_dots(ttir: str) -> int:
    return sum(1 for line in _TTIR_DOT.findall(ttir)
               if "inputPrecision = tf32" in line or re.search(r"x(?:bf16|f16|f8\w*|i8)>\s*\*", line))


_TTIR_LOAD = re.compile(r"tt\.load\b[^\n]*?:\s*tensor<([0-9x]+)x!tt\.ptr<(\w+)>>")
_FLOAT_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "f8E4M3FN": 1, "f8E5M2": 1}


def _vector_rule(launch: Launch, ttir: str, warp_size: int) -> str:
    """Whether this launch must read with 16-byte vectors, or why not."""
    if not launch.memory_bound:
        return "exempt: not memory-bound"
    for arg in launch.args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.numel() > 0:
            if arg.dim() == 0 or arg.stride(-1) != 1:
                return "exempt: strided rows"
            # What the JIT can prove (its specialisation marks 16-divisible ints and 16-byte-aligned
            # pointers): rows start aligned and are a multiple of 16 elements wide and apart.
            if arg.data_ptr() % VECTOR_BYTES or arg.shape[-1] % 16 or any(
                stride % 16 for stride, extent in zip(arg.stride()[:-1], arg.shape[:-1]) if extent > 1
            ):
                return "exempt: rows not 16-element aligned"
    tile_bytes = max((_numel(shape) * _FLOAT_BYTES[dtype] for shape, dtype in _TTIR_LOAD.findall(ttir)
                      if dtype in _FLOAT_BYTES), default=0)
    if tile_bytes < VECTOR_BYTES * warp_size:
        return f"exempt: tiles of {tile_bytes} bytes give under 16 bytes to each thread of one warp"
    return "required"


def _numel(shape: str) -> int:
    total = 1
    for extent in shape.split("x"):
        total *= int(extent)
    return total


def _measure(compiled: Any, launch: Launch, target: Target, common: dict[str, Any], seconds: float) -> CompileRecord:
    asm = compiled.asm
    loop_spills = None
    if target.backend == "cuda":
        code = asm["ptx"]
        registers, spills = _ptxas_resources(compiled, target)
        load_bits, store_bits = _ptx_access_bits(code)
        if spills:
            loop_spills = _sass_loop_spill_bytes(asm.get("cubin"))
    else:
        code = asm["amdgcn"]
        registers, spills = _amdgcn_resources(code)
        load_bits, store_bits = _amd_access_bits(code)
    return CompileRecord(**common, ok=True, error=None, seconds=seconds, registers=registers, spill_bytes=spills,
                         loop_spill_bytes=loop_spills,
                         shared=int(compiled.metadata.shared), load_bits=load_bits, store_bits=store_bits,
                         matrix=_matrix_class(code, target), matrix_dots=_matrix_dots(asm["ttir"]),
                         vector_rule=_vector_rule(launch, asm["ttir"], target.warp_size))
