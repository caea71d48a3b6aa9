"""Rewire Hugging Face ``transformers`` models onto hw_agnostic layers, without per-model code."""

from .construct import from_config, from_pretrained
from .report import Entry, RewireReport
from .rewire import rewire

__all__ = ["Entry", "RewireReport", "from_config", "from_pretrained", "rewire"]
