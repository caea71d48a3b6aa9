"""Saving a rewired model under the checkpoint keys, shapes and class the original would write.

Rewiring merges projections (gate/up into ``gate_up_proj``, q/k/v into ``qkv_proj.proj``) and
renames them, so the model's ``state_dict`` no longer has the checkpoint's keys. transformers
reverts a model's weight conversions when it saves (``model._weight_conversions``, what
``from_pretrained`` records for the conversions it applied on load), so each change that merges or
renames carries the converters that describe it, and :func:`install_weight_conversions` appends
them to the model's own: ``save_pretrained`` then splits the merged weights back into the
original keys (as views; nothing is copied before writing), and plain ``from_pretrained`` loads
the directory with no key missing. Patterns are the full module paths, so each converter matches
exactly the module it was made for. The same converters let ``load_state_dict`` take a state dict
with the original keys (:func:`take_original_keys`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


@functools.lru_cache(maxsize=1)
def _ops() -> tuple[type, type]:
    from transformers.core_model_loading import ConversionOps

    class ConcatenateParts(ConversionOps):
        """Concatenate the sources along ``dim`` (in source order); reverts to :class:`SplitParts`."""

        def __init__(self, sizes: tuple[int, ...], dim: int = 0) -> None:
            self.sizes, self.dim = tuple(sizes), dim

        def __reduce__(self) -> tuple[Any, ...]:  # pickled with a rewired model: see _op
            return _op, (0, self.sizes, self.dim)

        @torch.no_grad()
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                    **kwargs: Any) -> dict[str, torch.Tensor]:
            parts = []
            for pattern in source_patterns:
                tensors = input_dict.pop(pattern)
                parts.extend(tensors if isinstance(tensors, list) else [tensors])
            return {target_patterns[0]: torch.cat(parts, dim=self.dim)}

        @property
        def reverse_op(self) -> Any:
            return SplitParts(self.sizes, self.dim)

    class SplitParts(ConversionOps):
        """Split one tensor along ``dim`` into parts of ``sizes`` (views), one per target."""

        def __init__(self, sizes: tuple[int, ...], dim: int = 0) -> None:
            self.sizes, self.dim = tuple(sizes), dim

        def __reduce__(self) -> tuple[Any, ...]:
            return _op, (1, self.sizes, self.dim)

        @torch.no_grad()
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                    **kwargs: Any) -> dict[str, torch.Tensor]:
            tensors = next(iter(input_dict.values()))
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            if tensor.shape[self.dim] != sum(self.sizes):
                raise ValueError(f"cannot split a tensor of {tensor.shape[self.dim]} rows into {self.sizes}")
            return dict(zip(target_patterns, torch.split(tensor, list(self.sizes), dim=self.dim)))

        @property
        def reverse_op(self) -> Any:
            return ConcatenateParts(self.sizes, self.dim)

    return ConcatenateParts, SplitParts


def _op(which: int, sizes: tuple[int, ...], dim: int) -> Any:
    """``ConcatenateParts`` (0) or ``SplitParts`` (1): classes made where transformers is imported,
    which pickle cannot find by name."""
    return _ops()[which](sizes, dim)


def merged(path: str, sources: list[str], target: str, sizes: tuple[int, ...]) -> list[Any]:
    """Converters saying that ``{path}.{target}`` holds ``{path}.{source}`` for each source, stacked
    on dim 0 with ``sizes`` rows each (``.weight`` and, where present, ``.bias``)."""
    from transformers.core_model_loading import WeightConverter

    concatenate, _ = _ops()
    prefix = f"{path}." if path else ""
    return [WeightConverter([prefix + s for s in sources], prefix + target, operations=[concatenate(sizes)])]


def renamed(path: str, source: str, target: str) -> list[Any]:
    """A converter saying that ``{path}.{target}`` is the checkpoint's ``{path}.{source}``."""
    from transformers.core_model_loading import WeightRenaming

    if source == target:
        return []
    prefix = f"{path}." if path else ""
    return [WeightRenaming(f"{prefix}{source}.", f"{prefix}{target}.")]


def model_conversions(model: nn.Module) -> list[Any]:
    """The conversions transformers reverts when saving ``model`` as it stands."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        return list(conversions)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return []
    try:
        found = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # not a transformers model, or one without a mapping
        return []
    return [c for c in found if not isinstance(c, PrefixChange)]


def install_weight_conversions(model: nn.Module, converters: list[Any]) -> None:
    """Append ``converters`` to what ``model.save_pretrained`` reverts (no-op for non-HF modules)."""
    if converters and hasattr(model, "save_pretrained"):
        model._weight_conversions = model_conversions(model) + list(converters)


# --------------------------------------------------------------------------------------------
# load_state_dict with the original keys

#: on a rewired model: the converters of its merges and renames, which its ``load_state_dict`` applies
_CONVERSIONS = "_hw_agnostic_checkpoint_conversions"


def take_original_keys(model: nn.Module, converters: list[Any]) -> None:
    """Let ``model.load_state_dict`` take a state dict with the original model's keys too.

    A state dict saved from the model before it was rewired (``torch.save(model.state_dict())``
    in a training script, an EMA copy) has the checkpoint's keys. A pre-hook applies the rewire's
    converters to the incoming keys (``load_state_dict`` works on its own copy of the dict): parts
    of a merged weight are concatenated where every part is there and the merged key is not, and
    renamed keys take their new names. A converter whose merged or renamed module is no longer in
    the model (a change undone after) is skipped; whatever else is missing or unexpected is
    reported as ``load_state_dict`` always reports it. The model's own ``state_dict`` keeps its keys.
    """
    if not converters:
        return
    if _CONVERSIONS not in model.__dict__:  # the first time: the hook, which reads the list as it grows
        model.register_load_state_dict_pre_hook(_convert_original_keys)
    model.__dict__[_CONVERSIONS] = [*model.__dict__.get(_CONVERSIONS, ()), *converters]


def _convert_original_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Apply the converters to ``state_dict``'s keys under ``prefix``. Their patterns are module paths
    from the model (a rewire's changes) or from any depth in it (the construction path's class-wide
    mapping, e.g. ``mlp.gate_proj.weight``); either way they match at a path boundary."""
    from transformers.core_model_loading import WeightRenaming

    for converter in module.__dict__.get(_CONVERSIONS, ()):
        sources, target = converter.source_patterns, converter.target_patterns[0]
        for key in [k for k in state_dict if k.startswith(prefix)]:
            local = key[len(prefix):]
            if isinstance(converter, WeightRenaming):
                at = _boundary(local, sources[0])
                if at is None or not _holds(module, (local[:at] + target).rstrip("."), submodule=True):
                    continue
                renamed = prefix + local[:at] + target + local[at + len(sources[0]):]
                if renamed not in state_dict:
                    state_dict[renamed] = state_dict.pop(key)
                continue
            base = local[:-len(sources[0])]
            if not local.endswith(sources[0]) or base and not base.endswith("."):
                continue
            parts = [prefix + base + source for source in sources]
            if (prefix + base + target not in state_dict and all(part in state_dict for part in parts)
                    and _holds(module, base + target, submodule=False)):
                state_dict[prefix + base + target] = torch.cat([state_dict.pop(part) for part in parts],
                                                               dim=converter.operations[0].dim)


def _boundary(path: str, pattern: str) -> int | None:
    """Where ``pattern`` first starts in ``path`` at a path boundary (None: nowhere)."""
    if path.startswith(pattern):
        return 0
    at = path.find("." + pattern)
    return None if at < 0 else at + 1


def _holds(module: nn.Module, path: str, *, submodule: bool) -> bool:
    for get in (module.get_submodule,) if submodule else (module.get_parameter, module.get_buffer):
        try:
            get(path)
            return True
        except AttributeError:
            pass
    return False
