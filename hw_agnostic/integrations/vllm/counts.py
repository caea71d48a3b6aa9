"""A cross-process record of what the plugin did, for tests and diagnostics.

vLLM runs the model in other processes (the engine core, one worker per rank), where
:func:`hw_agnostic.ops.trace_dispatch` cannot look. With ``HW_AGNOSTIC_VLLM_COUNTS_DIR`` set,
every process that loads the plugin writes ``<dir>/ops-<pid>.json``:

* ``ops``: ``{op: {provider: calls}}``, the library's own dispatch counts (``Plan.calls``), so
  a call counts where it ran, also when it was a ``torch.ops.hw_agnostic`` node of a compiled
  graph; except the ``fusable`` overloads (on the CPU the norms and activations under vLLM's
  ``torch.compile``), which Inductor inlines into its own code: nothing of ours dispatches them,
  so a compiled CPU run counts none of them (``layers`` still says what was built);
* ``layers``: how many vLLM modules each override built, and how many fell back to vLLM (with
  the reason), e.g. ``{"attention": 2, "moe:vllm": 0}``;
* ``graph_breaks``: Dynamo's graph-break count in that process.

The file is rewritten by a daemon thread whenever the numbers change (at most twice a second)
and once more at exit, so a worker that is killed rather than shut down still leaves its counts.
Nothing runs without the variable.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

COUNTS_ENV = "HW_AGNOSTIC_VLLM_COUNTS_DIR"
FLUSH_SECONDS = 0.5

_layers: collections.Counter[str] = collections.Counter()
_fallbacks: dict[str, str] = {}
_lock = threading.Lock()
_started = False


def built(override: str, fallback_reason: str | None = None) -> None:
    """Record that ``override`` built a module (or left one to vLLM, and why)."""
    with _lock:
        if fallback_reason is None:
            _layers[override] += 1
        else:
            _layers[f"{override}:vllm"] += 1
            _fallbacks.setdefault(override, fallback_reason)


def snapshot() -> dict[str, Any]:
    ops: dict[str, dict[str, int]] = {}
    if "hw_agnostic.ops" in sys.modules:  # never import the ops (and Helion) just to count
        from hw_agnostic.ops import all_ops

        for name, op in all_ops().items():
            for plan in op.plans():
                if plan.calls:
                    by_provider = ops.setdefault(name, {})
                    by_provider[plan.provider] = by_provider.get(plan.provider, 0) + plan.calls
    graph_breaks = 0
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        graph_breaks = sum(counters["graph_break"].values())
    with _lock:
        layers, fallbacks = dict(_layers), dict(_fallbacks)
    return {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "", "ops": ops, "layers": layers,
            "fallbacks": fallbacks, "graph_breaks": graph_breaks}


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def start_if_requested() -> Path | None:
    """Start writing this process's counts when ``HW_AGNOSTIC_VLLM_COUNTS_DIR`` is set."""
    global _started
    directory = os.environ.get(COUNTS_ENV)
    if not directory or _started:
        return None
    _started = True
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"ops-{os.getpid()}.json"
    last: list[dict[str, Any] | None] = [None]
    writing = threading.Lock()  # the flush thread and the exit hook write through one temporary file

    def flush() -> None:
        with writing:
            data = snapshot()
            if data != last[0]:
                _write(path, data)
                last[0] = data

    def loop() -> None:
        while True:
            time.sleep(FLUSH_SECONDS)
            try:
                flush()
            except Exception:  # a full disk must not take the worker down
                pass

    flush()
    threading.Thread(target=loop, name="hw_agnostic-counts", daemon=True).start()
    atexit.register(flush)
    return path


def read_counts(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every process's record under ``directory``."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("ops-*.json"))]


def total_calls(records: list[dict[str, Any]], op: str) -> int:
    return sum(sum(r["ops"].get(op, {}).values()) for r in records)
