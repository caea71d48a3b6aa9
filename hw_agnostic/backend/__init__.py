"""Rewire Hugging Face ``transformers`` models onto hw_agnostic layers, without per-model code."""

from .report import Entry, RewireReport
from .rewire import rewire

__all__ = ["Entry", "RewireReport", "rewire"]
