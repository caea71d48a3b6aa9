"""Integrations with serving engines (the top floor: nothing in the package imports them).

* :mod:`hw_agnostic.integrations.vllm`: a ``vllm.general_plugins`` entry point that puts the
  library's ops under vLLM's hardware-agnostic Transformers-backend path.
"""
