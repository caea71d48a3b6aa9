"""Construction-time rewiring: build and load a Hugging Face model straight onto our layers.

``from_pretrained(path)`` / ``from_config(config)``:

1. build the model class on the meta device (no memory) and detect its structure exactly as
   :func:`~hw_agnostic.backend.rewire` does: which classes are RMS norms (and with which
   numerics) and which are gated MLPs (and how their projections are named);
2. register, through transformers' own hooks and only for the duration of the call, a patch
   mapping from each such class to an adapter subclass of our layer (it takes the HF class's
   constructor arguments and reads eps, sizes and activation from an instance built on meta), and
   a checkpoint-conversion mapping that concatenates ``gate``/``up`` into ``gate_up_proj`` as the
   checkpoint loads, so the merged weight is materialised once, layer by layer;
3. instantiate a subclass of the HF model class (named ``HwAgnostic<Class>``) whose conversion
   mapping is registered under its own name, so ``save_pretrained`` splits ``gate_up_proj`` back
   into the original keys (and writes the original class into ``config.json``) while plain HF
   models of the same type are unaffected;
4. rewire what is left in place (the fused decoder forwards).

q/k/v are not merged on this path: their checkpoint keys stay as they are.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..layers import resolve
from ..layers.made_class import made_by
from . import checkpoint
from .detect import MLPSpec, detect_gated_mlp
from .detect_norms import Detections, NormSpec, detect_rms_norm
from .report import RewireReport
from .changes import Change
from .rewire import rewire


def from_pretrained(name_or_path: str | os.PathLike, *args: Any, model_class: Any = None,
                    **kwargs: Any) -> tuple[nn.Module, RewireReport]:
    """``AutoModelForCausalLM.from_pretrained`` onto hw_agnostic layers; returns ``(model, report)``."""
    from transformers import AutoConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(name_or_path)
    hw_class, patches = prepare(config, model_class)
    with _patched(patches):
        model = hw_class.from_pretrained(name_or_path, *args, config=config, **kwargs)
    return model, _finish(model, patches)


def from_config(config: Any, *, model_class: Any = None, **kwargs: Any) -> tuple[nn.Module, RewireReport]:
    """``AutoModelForCausalLM.from_config`` onto hw_agnostic layers (random weights)."""
    hw_class, patches = prepare(config, model_class)
    with _patched(patches):
        model = hw_class._from_config(config, **kwargs)
    return model, _finish(model, patches)


# --------------------------------------------------------------------------------------------


class _Patches:
    def __init__(self) -> None:
        self.classes: dict[str, type[nn.Module]] = {}  # HF class name -> adapter
        self.notes: list[tuple[str, str]] = []  # (HF class name, what was decided)
        self.converters: list[Any] = []  # the checkpoint conversions of the layers built


def _hf_model_class(config: Any, model_class: Any) -> type:
    from transformers import AutoModelForCausalLM

    auto = model_class or AutoModelForCausalLM
    if hasattr(auto, "_model_mapping"):
        return auto._model_mapping[type(config)]
    return auto


def prepare(config: Any, model_class: Any = None) -> tuple[type, _Patches]:
    """The HwAgnostic subclass to instantiate and the class patches to apply while it is built."""
    hf_class = _hf_model_class(config, model_class)
    with torch.device("meta"):
        skeleton = hf_class(config)
    patches = _Patches()
    converters = patches.converters
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, module in skeleton.named_modules():
        by_class.setdefault(type(module), []).append((path, module))
    detections = Detections()
    for cls, instances in by_class.items():
        specs = [detections(detect_rms_norm, m) for _, m in instances]
        if all(isinstance(s, NormSpec) for s in specs):
            adapter = _norm_adapter(cls, specs)
            if adapter is not None:
                patches.classes[cls.__name__] = adapter
                patches.notes.append((cls.__name__, f"{resolve('rms_norm').__name__} ({specs[0].numerics})"))
            continue
        mlps = [detect_gated_mlp(m) for _, m in instances]
        if all(isinstance(s, MLPSpec) for s in mlps) and len({(s.gate, s.up, s.gate_up, s.down) for s in mlps}) == 1:
            patches.classes[cls.__name__] = _mlp_class(cls, resolve("gated_mlp"))
            patches.notes.append((cls.__name__, f"{resolve('gated_mlp').__name__} ({mlps[0].activation})"))
            converters += _mlp_converters(instances, mlps[0])
    return _hw_model_class(hf_class, config, converters), patches


def _norm_adapter(cls: type, specs: list[NormSpec]) -> type | None:
    first = specs[0]
    same = all((s.numerics, s.weight_name, s.eps_attribute) == (first.numerics, first.weight_name, first.eps_attribute)
               for s in specs)
    if not same or first.eps_attribute is None or first.weight_name not in (None, "weight"):
        return None  # instances differ, or eps/weight cannot be read from a constructed instance
    return _norm_class(cls, resolve("rms_norm"), first.numerics, first.weight_name, first.eps_attribute)


# The adapters are made once per class and arguments (``lru_cache``): their instances pickle with
# the recipe (see ..layers.made_class).


@functools.lru_cache(maxsize=None)
def _norm_class(cls: type, base: type, numerics: str, weight_name: str | None, eps_attribute: str) -> type:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        with torch.device("meta"):
            original = cls(*args, **kwargs)
        weight = getattr(original, weight_name) if weight_name else None
        base.__init__(self, weight.shape[0] if weight is not None else 1, getattr(original, eps_attribute),
                      numerics, has_weight=weight is not None)
        self.__dict__[_ORIGINAL] = (original, {weight_name: "weight"} if weight_name else {})

    return type(cls.__name__, (base,), {"__init__": __init__, "__module__": __name__, "replaces": cls,
                                        **made_by(_norm_class, cls, base, numerics, weight_name, eps_attribute)})


@functools.lru_cache(maxsize=None)
def _mlp_class(cls: type, base: type) -> type:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        with torch.device("meta"):
            original = cls(*args, **kwargs)
        found = detect_gated_mlp(original)
        if not isinstance(found, MLPSpec):
            raise RuntimeError(f"{cls.__name__} built with these arguments is not a gated MLP: {found}")
        base.__init__(self, found.hidden_size, found.intermediate_size, found.activation, bias=found.bias,
                      down_bias=found.down_bias, gate_multiplier=found.gate_multiplier,
                      up_multiplier=found.up_multiplier, down_multiplier=found.down_multiplier, dropout=found.dropout)
        self.__dict__[_ORIGINAL] = (original, found)

    return type(cls.__name__, (base,), {"__init__": __init__, "__module__": __name__, "replaces": cls,
                                        **made_by(_mlp_class, cls, base)})


def _mlp_converters(instances: list[tuple[str, nn.Module]], spec: MLPSpec) -> list[Any]:
    from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming

    attribute = instances[0][0].rpartition(".")[2]  # the MLP's name in its parent, e.g. "mlp"
    suffixes = ["weight"] + (["bias"] if spec.bias else [])
    converters: list[Any] = []
    if spec.gate_up is None:
        for suffix in suffixes:
            converters.append(WeightConverter(
                [f"{attribute}.{spec.gate}.{suffix}", f"{attribute}.{spec.up}.{suffix}"],
                f"{attribute}.gate_up_proj.{suffix}", operations=[Concatenate(dim=0)],
            ))
    elif spec.gate_up != "gate_up_proj":
        converters.append(WeightRenaming(f"{attribute}.{spec.gate_up}.", f"{attribute}.gate_up_proj."))
    if spec.down != "down_proj":
        converters.append(WeightRenaming(f"{attribute}.{spec.down}.", f"{attribute}.down_proj."))
    return converters


def _hw_model_class(hf_class: type, config: Any, converters: list[Any]) -> type:
    """``HwAgnostic<Class>``, with the checkpoint conversions of this construction registered under its name."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

    hw_class = _model_class(hf_class)
    existing = get_checkpoint_conversion_mapping(getattr(config, "model_type", "")) or []
    register_checkpoint_conversion_mapping(hw_class.__name__, [*existing, *converters], overwrite=True)
    return hw_class


@functools.lru_cache(maxsize=None)
def _model_class(hf_class: type) -> type:
    """``hf_class`` saving under its own name; one per class, which its instances pickle with."""
    return type(f"HwAgnostic{hf_class.__name__}", (hf_class,), {
        "save_pretrained": _save_pretrained, "_hw_agnostic_saves_as": hf_class, "__module__": hf_class.__module__,
        **made_by(_model_class, hf_class),
    })


def _save_pretrained(self: Any, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    hf_class = type(self)._hw_agnostic_saves_as
    result = hf_class.save_pretrained(self, save_directory, *args, **kwargs)
    config_file = Path(save_directory) / "config.json"
    if config_file.exists():  # name the class anyone can load, not this subclass
        document = json.loads(config_file.read_text())
        document["architectures"] = [hf_class.__name__]
        config_file.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return result


@contextlib.contextmanager
def _patched(patches: _Patches) -> Iterator[None]:
    from transformers.monkey_patching import get_patch_mapping, register_patch_mapping, unregister_patch_mapping

    taken = [name for name in patches.classes if name in get_patch_mapping()]
    if taken:
        raise RuntimeError(f"transformers already has patches registered for {taken}; not overriding them")
    register_patch_mapping(patches.classes)
    try:
        yield
    finally:
        unregister_patch_mapping(list(patches.classes))


#: Where an adapter keeps the HF module it stands for (built on meta, weightless until undone).
_ORIGINAL = "_hw_agnostic_original"


def construction_changes(model: nn.Module) -> list[Change]:
    """The layers built at construction, as changes verification can undo: undoing one puts the
    HF module back, its weights shared with (or views of) the layer's, so nothing is copied."""
    changes: list[Change] = []
    for path, module in list(model.named_modules()):
        original_and_spec = module.__dict__.get(_ORIGINAL)
        if original_and_spec is None or not path:
            continue
        original, spec = original_and_spec
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        kind = "mlp" if isinstance(spec, MLPSpec) else "norm"
        apply, undo = _materialized_swap(parent, name, module, original, spec)
        # The class's checkpoint-conversion mapping (registered by prepare()) saves these under the original keys.
        changes.append(Change(kind, path, type(original).__name__, type(module).__mro__[1].__name__,
                              "built at construction", apply, undo))
    return changes


def _materialized_swap(parent: nn.Module, name: str, layer: nn.Module, original: nn.Module, spec: Any) -> tuple:
    def materialize() -> nn.Module:
        if isinstance(spec, MLPSpec):
            inter = spec.intermediate_size
            state = {f"{spec.down}.weight": layer.down_proj.weight}
            if spec.down_bias:
                state[f"{spec.down}.bias"] = layer.down_proj.bias
            for suffix in ("weight", "bias") if spec.bias else ("weight",):
                merged = getattr(layer.gate_up_proj, suffix)
                if spec.gate_up:
                    state[f"{spec.gate_up}.{suffix}"] = merged
                else:
                    grad = merged.requires_grad
                    state[f"{spec.gate}.{suffix}"] = nn.Parameter(merged.data[:inter], requires_grad=grad)
                    state[f"{spec.up}.{suffix}"] = nn.Parameter(merged.data[inter:], requires_grad=grad)
        else:
            state = {hf_name: getattr(layer, ours) for hf_name, ours in spec.items()}
        original.load_state_dict(state, strict=True, assign=True)
        return original

    def apply() -> None:
        setattr(parent, name, layer)

    def undo() -> None:
        setattr(parent, name, materialize())

    return apply, undo


def _finish(model: nn.Module, patches: _Patches) -> RewireReport:
    report = rewire(model, merge_qkv=False, changes=construction_changes(model))
    checkpoint.take_original_keys(model, patches.converters)
    return report
