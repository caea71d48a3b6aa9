"""vLLM plugin: the library's ops under vLLM's hardware-agnostic Transformers-backend path.

Installed as the ``vllm.general_plugins`` entry point ``hw_agnostic`` (``pip install
hw-agnostic[vllm]``), so vLLM calls :func:`register` once in each of its processes (API server,
engine core, every worker). It does nothing unless ``VLLM_USE_HW_AGNOSTIC`` is set, which is
also what makes vLLM's Transformers backend (``--model-impl transformers``) build its layers
from ``vllm.model_executor.hw_agnostic``. Then it registers, each as vLLM's own out-of-tree
override:

=================  ============================================  ===============================
override           vLLM class replaced                           library ops
=================  ============================================  ===============================
``rms_norm``       ``TPAwareRMSNorm`` (plain and residual)       ``rms_norm``, ``fused_add_rms_norm``
``gemma_rms_norm`` ``TPAwareGemmaRMSNorm``                       ``rms_norm``/... ``numerics="gemma"``
``silu_and_mul``   hw-agnostic ``SiluAndMul``                    ``silu_and_mul``
``gelu_and_mul``   ``GeluAndMul``                                ``gelu_and_mul``
``swiglu_oai``     ``SwigluOAIAndMul``                           ``swiglu_oai``
``moe``            ``UnquantizedFusedMoEMethod.apply``           ``fused_experts``
``attention``      the ``CPU_ATTN`` attention backend            ``write_kv_cache``, ``paged_attention``
=================  ============================================  ===============================

``HW_AGNOSTIC_VLLM_OVERRIDES`` turns overrides on or off, in vLLM's ``custom_ops`` style:
``-moe,-attention`` leaves those to vLLM, ``+attention`` turns on one that is off by default.
All are on by default except, on the CPU, ``attention`` and ``moe``: the library has no CPU
kernels for them, and their plain-PyTorch references (loops over sequences and over experts) ran
generation at a fraction of the speed of vLLM's C++ CPU kernels (``bench/results/cpu/vllm/vllm.md``).
Each override runs vLLM's own code for the calls or layers the ops do not cover (see its module).
An override whose vLLM names are missing in the installed vLLM is skipped, with one warning
naming them and the versions this plugin supports. Diagnostics go to the ``vllm.hw_agnostic``
logger, which vLLM's log configuration shows.

On the CPU the ops run the library's default CPU path, as outside vLLM: the reference traced
once per dtype and rank with every size symbolic, compiled by Inductor and called without
Dynamo's guards (or a native eager form where that is faster), so no shape of a step
recompiles. An earlier path that ran ``torch.compile`` once per shape key made generation ~10x
slower inside vLLM; this one generates at vLLM's own speed (``bench/results/cpu/vllm/vllm.md``,
the ``vllm`` suite of ``python -m bench``). ``HW_AGNOSTIC_COMPILE_REFERENCE=native`` runs nothing
compiled (each process then starts without the few seconds of first-call compiles).
"""

from __future__ import annotations

import importlib
import logging
import os

from ._compat import SUPPORTED_VERSIONS, missing_names

ENABLE_ENV = "VLLM_USE_HW_AGNOSTIC"
OVERRIDES_ENV = "HW_AGNOSTIC_VLLM_OVERRIDES"
OVERRIDES = ("rms_norm", "gemma_rms_norm", "silu_and_mul", "gelu_and_mul", "swiglu_oai", "moe", "attention")
CPU_ONLY = frozenset({"attention"})
# Where the library has no CPU kernel, its CPU provider is the plain-PyTorch reference, and for
# these two that is slower than vLLM's C++ CPU kernels (bench/results/cpu/vllm/vllm.md).
OFF_BY_DEFAULT_ON_CPU = {
    "attention": "off by default on the CPU, where the library's paged attention is its slow reference "
                 f"({OVERRIDES_ENV}=+attention turns it on)",
    "moe": "off by default on the CPU, where the library's fused_experts is its reference, a loop over "
           f"experts ({OVERRIDES_ENV}=+moe turns it on)",
}
REGISTRARS = {
    "rms_norm": (".layers", "register_rms_norm"),
    "gemma_rms_norm": (".layers", "register_gemma_rms_norm"),
    "silu_and_mul": (".layers", "register_silu_and_mul"),
    "gelu_and_mul": (".layers", "register_gelu_and_mul"),
    "swiglu_oai": (".layers", "register_swiglu_oai"),
    "moe": (".moe", "register_moe"),
    "attention": (".attention", "register_attention"),
}

log = logging.getLogger("vllm.hw_agnostic")

_registered: dict[str, str] | None = None
_announced = False
_fallbacks_logged: set[tuple[str, str]] = set()


def enabled() -> bool:
    """vLLM's own reading of ``VLLM_USE_HW_AGNOSTIC``."""
    return os.environ.get(ENABLE_ENV, "False").lower() in ("true", "1")


def override_choices() -> dict[str, bool]:
    """``HW_AGNOSTIC_VLLM_OVERRIDES`` parsed: override -> on (``+name``) or off (``-name``)."""
    spec = os.environ.get(OVERRIDES_ENV, "")
    choices: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        sign, name = item[0], item[1:].strip()
        if sign not in "+-" or name not in OVERRIDES:
            raise ValueError(f"{OVERRIDES_ENV}={spec!r}: {item!r} is not +name or -name of an override of the "
                             f"hw_agnostic vLLM plugin (they are: {', '.join(OVERRIDES)})")
        choices[name] = sign == "+"
    return choices


def registered() -> dict[str, str]:
    """What :func:`register` did in this process: override -> "registered" or why not."""
    return dict(_registered or {})


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent: the first call decides)."""
    global _registered
    if _registered is not None:
        return
    _registered = {}
    if not enabled():
        return
    from vllm.platforms import current_platform

    from . import counts

    choices = override_choices()
    missing: dict[str, list[str]] = {}
    for name in OVERRIDES:
        choice = choices.get(name)
        if choice is False:
            _registered[name] = f"turned off by {OVERRIDES_ENV}"
            continue
        if choice is None and name in OFF_BY_DEFAULT_ON_CPU and current_platform.is_cpu():
            _registered[name] = OFF_BY_DEFAULT_ON_CPU[name]
            continue
        if name in CPU_ONLY and not current_platform.is_cpu():
            _registered[name] = f"not available on {current_platform.device_type} (CPU only in this version)"
            continue
        lacking = missing_names(name)
        if lacking:
            missing[name] = lacking
            _registered[name] = "missing vLLM names: " + "; ".join(lacking)
            continue
        module, function = REGISTRARS[name]
        getattr(importlib.import_module(module, __name__), function)()
        _registered[name] = "registered"
    if missing:
        import vllm

        log.warning(
            "hw_agnostic: vLLM %s lacks names the plugin relies on, so %s stay vLLM's (the plugin supports %s): %s",
            getattr(vllm, "__version__", "?"), ", ".join(missing), SUPPORTED_VERSIONS,
            "; ".join(f"{name}: {', '.join(names)}" for name, names in missing.items()),
        )
    counts.start_if_requested()


def note_built(override: str, fallback_reason: str | None = None) -> None:
    """Called by each override as vLLM builds a module: counts it, and logs (once per process)
    what the plugin registered and (once per reason) what it left to vLLM. Logging waits until
    here because vLLM configures its loggers after loading plugins."""
    from . import counts

    counts.built(override, fallback_reason)
    global _announced
    if not _announced:
        _announced = True
        on = [name for name, state in registered().items() if state == "registered"]
        log.info("hw_agnostic: serving %s on the library's ops (left to vLLM: %s)", ", ".join(on) or "nothing",
                 ", ".join(f"{n} ({s})" for n, s in registered().items() if s != "registered") or "nothing")
    if fallback_reason is not None and (override, fallback_reason) not in _fallbacks_logged:
        _fallbacks_logged.add((override, fallback_reason))
        log.info("hw_agnostic: %s: a layer stays vLLM's: %s", override, fallback_reason)
