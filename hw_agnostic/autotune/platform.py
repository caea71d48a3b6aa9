"""Canonical platform names: the folder a device's tuned configs live in.

A GPU reporting "NVIDIA H100 80GB HBM3" and one reporting "NVIDIA H100 PCIe" share the tuned
configs of ``nvidia_h100``; the alias table below says which marketing names map to which
platform. A device missing from the table gets a slug of its reported name, so its configs can
still be tuned and cached on site.
"""

from __future__ import annotations

import re

import torch

from ..kernels.interpret import interpreter_mode

#: (pattern searched in the reported device name, canonical platform). First match wins, so
#: longer names come before their prefixes (H200 before H20, MI325X before MI300).
PLATFORM_ALIASES: tuple[tuple[str, str], ...] = (
    (r"\bGB200\b", "nvidia_gb200"),
    (r"\bB200\b", "nvidia_b200"),
    (r"\bH200\b", "nvidia_h200"),
    (r"\bH100\b", "nvidia_h100"),
    (r"\bH800\b", "nvidia_h800"),
    (r"\bH20\b", "nvidia_h20"),
    (r"\bGH200\b", "nvidia_gh200"),
    (r"\bA100\b", "nvidia_a100"),
    (r"\bA800\b", "nvidia_a800"),
    (r"\bA10G\b", "nvidia_a10g"),
    (r"\bA10\b", "nvidia_a10"),
    (r"\bL40S\b", "nvidia_l40s"),
    (r"\bL40\b", "nvidia_l40"),
    (r"\bL4\b", "nvidia_l4"),
    (r"\bT4\b", "nvidia_t4"),
    (r"\bV100\b", "nvidia_v100"),
    (r"RTX 5090", "nvidia_rtx_5090"),
    (r"RTX 4090", "nvidia_rtx_4090"),
    (r"RTX 3090", "nvidia_rtx_3090"),
    (r"MI355X", "amd_mi355x"),
    (r"MI325X", "amd_mi325x"),
    (r"MI300X", "amd_mi300x"),
    (r"MI300A", "amd_mi300a"),
    (r"MI250X?", "amd_mi250"),
    (r"MI210", "amd_mi210"),
    (r"Max 1550", "intel_max_1550"),
    (r"Max 1100", "intel_max_1100"),
    (r"Arc.*B580", "intel_arc_b580"),
    (r"Arc.*A770", "intel_arc_a770"),
)

#: Short names accepted on the command line (`make bench DEVICE=h100`).
_SHORT_NAMES = {
    "cpu": "cpu",
    "interpreter": "triton_interpreter",
    "triton_interpreter": "triton_interpreter",
}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def platform_from_name(device_name: str) -> str:
    """Canonical platform for a device's reported name (``torch.cuda.get_device_name``)."""
    for pattern, platform in PLATFORM_ALIASES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return platform
    return _slug(device_name)


def platform_from_cli(name: str) -> str:
    """Canonical platform for a user-typed name: ``h100``, ``nvidia_h100``, ``mi300x``, ``cpu``."""
    lowered = name.strip().lower()
    if lowered in _SHORT_NAMES:
        return _SHORT_NAMES[lowered]
    if "_" in lowered and any(lowered == platform for _, platform in PLATFORM_ALIASES):
        return lowered
    return platform_from_name(name.replace("_", " "))


def device_name(device: torch.device) -> str:
    """The name the device reports, or ``"cpu"``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return device.type


def platform_of(device: torch.device | str) -> str:
    """Canonical platform of a device: ``nvidia_h100``, ``cpu``, ``triton_interpreter``, ..."""
    device = torch.device(device)
    if device.type == "cpu":
        return "triton_interpreter" if interpreter_mode() == "triton" else "cpu"
    if device.type in ("cuda", "xpu"):
        return platform_from_name(device_name(device))
    return _slug(device.type)


#: The compile target (:mod:`hw_agnostic.kernels.targets`) of each platform whose architecture is one.
PLATFORM_TARGETS: dict[str, str] = {
    "nvidia_a100": "sm_80", "nvidia_a800": "sm_80",
    "nvidia_h100": "sm_90", "nvidia_h200": "sm_90", "nvidia_h800": "sm_90", "nvidia_h20": "sm_90",
    "nvidia_gh200": "sm_90",
    "nvidia_b200": "sm_100", "nvidia_gb200": "sm_100",
    "amd_mi300x": "gfx942", "amd_mi300a": "gfx942", "amd_mi325x": "gfx942",
}


def compile_target(device: torch.device | str) -> str | None:
    """The compile target a device is (``sm_90``, ``gfx942``, ...), or None if it is none of them."""
    from ..kernels.targets import TARGETS

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        name = str(getattr(properties, "gcnArchName", "")).split(":")[0]
    else:
        name = f"sm_{properties.major}{properties.minor}"
    return name if name in TARGETS else None


def detect_platform() -> str:
    """The platform of the first accelerator this process sees, or ``cpu``."""
    if torch.cuda.is_available():
        return platform_of(torch.device("cuda", torch.cuda.current_device()))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return platform_of(torch.device("xpu", 0))
    return "cpu"


class DeviceMismatch(RuntimeError):
    """The device named on the command line is not the one this machine has."""


def resolve_device(requested: str) -> tuple[torch.device, str]:
    """The device and platform for ``DEVICE=...``; ``auto`` takes what is there.

    A name that contradicts the hardware (``h100`` on an H200, ``h200`` on a CPU-only machine)
    raises :class:`DeviceMismatch` saying what was found.
    """
    found = detect_platform()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        device = torch.device("xpu", 0)
    else:
        device = torch.device("cpu")
    if requested.strip().lower() in ("", "auto"):
        return device, found
    wanted = platform_from_cli(requested)
    if wanted == "triton_interpreter":
        return torch.device("cpu"), wanted
    if wanted != found:
        raise DeviceMismatch(
            f"DEVICE={requested} means platform {wanted!r}, but this machine has {found!r}"
            + (f" ({device_name(device)})" if device.type != "cpu" else "")
            + "; pass DEVICE=auto or the platform that is here"
        )
    return device, found
