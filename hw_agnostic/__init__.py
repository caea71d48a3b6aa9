"""hw_agnostic: hardware-agnostic LLM layers.

Ops (``hw_agnostic.ops``) are written once in Helion or Triton next to a PyTorch reference that
is their specification, registered as ``torch.ops.hw_agnostic.*``, tuned per device, and
composed into layers that a backend wires into Hugging Face models.
"""

__version__ = "0.1.0"

from . import kernels  # noqa: F401  (applies the CPU-interpreter fixes when requested)
