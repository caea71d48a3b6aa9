"""DSL kernels (Helion, Triton) and their launch helpers; they know nothing of ``torch.library``.

Importing this package applies the CPU-interpreter fixes when ``TRITON_INTERPRET=1`` or
``HELION_INTERPRET=1`` is set (see :mod:`.interpret`), and changes nothing otherwise.
"""

from . import interpret

interpret.apply()
