"""The layer registry: in-tree layers, and out-of-tree replacements that plugins register.

Two bases share one registry:

* :class:`CustomOp`: a layer around one op. ``forward`` runs the op (through its providers),
  ``forward_native`` runs the op's PyTorch reference. A plugin subclasses the layer and
  overrides ``forward`` (e.g. to call its accelerator's kernel), keeping the constructor.
* :class:`PluggableLayer`: a layer composed of other modules (a gated MLP, an attention block).
  A plugin replaces the whole layer, parameters and all.

In-tree layers are registered with ``@CustomOp.register("rms_norm")``. A plugin registers its
replacement with ``@RMSNorm.register_oot`` (or ``register_oot(MyNorm, name="rms_norm")``); from
then on constructing the in-tree layer builds the plugin's class, and :func:`resolve` returns the
class the backend will build. The replacement must subclass the layer it replaces: Python runs
``__init__`` only for instances of the class being constructed, so anything else would be built
without ever being initialised. Duplicate names, a second replacement for one layer, or a
replacement for a name that is not registered all raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from torch import nn

L = TypeVar("L", bound=type)

_layers: dict[str, type[nn.Module]] = {}
_replacements: dict[str, type[nn.Module]] = {}


class LayerRegistryError(TypeError):
    """A registration that would build the wrong thing."""


class _Registered(nn.Module):
    layer_name: ClassVar[str | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        name = cls.__dict__.get("layer_name")
        if name is not None and _layers.get(name) is cls and name in _replacements:
            cls = _replacements[name]
        return super().__new__(cls)

    @classmethod
    def register(cls, name: str) -> Callable[[L], L]:
        """Class decorator registering an in-tree layer under ``name``."""

        def decorate(layer: L) -> L:
            if name in _layers:
                raise LayerRegistryError(f"a layer is already registered as {name!r}: {_layers[name].__qualname__}")
            if not (isinstance(layer, type) and issubclass(layer, cls)):
                raise LayerRegistryError(f"{getattr(layer, '__qualname__', layer)!r} must subclass {cls.__qualname__}")
            layer.layer_name = name
            _layers[name] = layer
            return layer

        return decorate

    @classmethod
    def register_oot(cls, replacement: L | None = None, *, name: str | None = None) -> Any:
        """Register an out-of-tree replacement for this layer (or the layer registered as ``name``).

        Use as ``@RMSNorm.register_oot``, ``@RMSNorm.register_oot(name="rms_norm")`` or
        ``RMSNorm.register_oot(MyNorm)``.
        """

        def decorate(layer: L) -> L:
            target = name or cls.__dict__.get("layer_name")
            if target is None or target not in _layers:
                known = ", ".join(sorted(_layers)) or "none"
                raise LayerRegistryError(f"no layer is registered as {target!r} (registered: {known})")
            base = _layers[target]
            if not (isinstance(layer, type) and issubclass(layer, base)) or layer is base:
                raise LayerRegistryError(
                    f"the replacement for {target!r} must be a subclass of {base.__qualname__}; got "
                    f"{getattr(layer, '__qualname__', layer)!r} (a non-subclass would be built but never initialised)"
                )
            current = _replacements.get(target)
            if current is not None and current is not layer:
                raise LayerRegistryError(
                    f"{target!r} is already replaced by {current.__qualname__}; unregister_oot({target!r}) first"
                )
            _replacements[target] = layer
            return layer

        return decorate(replacement) if replacement is not None else decorate


class CustomOp(_Registered):
    """A layer around one op: ``forward`` through the op's providers, ``forward_native`` the reference."""

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} has no forward_native")


class PluggableLayer(_Registered):
    """A composed layer that a plugin can replace whole."""


def _eps_alias() -> property:
    def read(self: Any) -> float:
        return self.eps

    def write(self: Any, value: float) -> None:
        self.eps = float(value)

    return property(read, write)


class EpsAliases:
    """A norm's ``eps`` under the names Hugging Face's norms give it, which code around a norm reads
    (Mamba-2 mixers pass ``self.norm.variance_epsilon`` to their fused training kernel)."""

    eps: float
    variance_epsilon = _eps_alias()
    epsilon = _eps_alias()


def resolve(layer: str | type[nn.Module]) -> type[nn.Module]:
    """The class built for a registered layer: the plugin's replacement if one is registered."""
    name = layer if isinstance(layer, str) else layer.__dict__.get("layer_name")
    if name not in _layers:
        raise LayerRegistryError(f"no layer is registered as {name!r} (registered: {', '.join(sorted(_layers))})")
    return _replacements.get(name, _layers[name])


def unregister_oot(name: str) -> None:
    """Remove the replacement registered for ``name`` (if any)."""
    _replacements.pop(name, None)


def registered_layers() -> dict[str, tuple[type[nn.Module], type[nn.Module] | None]]:
    """``{name: (in-tree class, replacement or None)}``."""
    return {name: (layer, _replacements.get(name)) for name, layer in _layers.items()}
