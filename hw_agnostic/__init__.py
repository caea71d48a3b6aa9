"""hw_agnostic: hardware-agnostic LLM layers.

Ops (``hw_agnostic.ops``) are written once in Helion or Triton next to a PyTorch reference that
is their specification, registered as ``torch.ops.hw_agnostic.*``, tuned per device, and
composed into layers (``hw_agnostic.layers``) that the backend wires into Hugging Face models:
``hw_agnostic.rewire(model)`` for a built model, ``hw_agnostic.from_pretrained(path)`` to load
one straight onto our layers.
"""

from typing import Any

__version__ = "0.1.0"

from . import kernels  # noqa: F401  (applies the CPU-interpreter fixes when requested)

_BACKEND = {"rewire": "rewire", "from_pretrained": "construct", "from_config": "construct"}


def __getattr__(name: str) -> Any:
    # The backend imports transformers (seconds); load it when first asked for.
    if name in _BACKEND:
        import importlib

        module = importlib.import_module(f".backend.{_BACKEND[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'hw_agnostic' has no attribute {name!r}")
