"""Tuned-config files: where a kernel's launch config for a key comes from.

Layout: ``<root>/<platform>/<kernel>.json`` with

.. code-block:: json

    {"schema_version": 1, "kernel": "rms_norm", "platform": "nvidia_h100",
     "source_hash": "<sha256 of the kernel's source>",
     "entries": [{"key": {"hidden": 4096, "dtype": "bfloat16", "tokens": 16},
                  "config": {...}, "time_us": 5.1}],
     "tuned_with": {"torch": "...", "triton": "...", "device_name": "..."}}

Two roots are searched, the user's first: ``$HW_AGNOSTIC_CACHE_DIR`` (default
``~/.cache/hw_agnostic/autotune_cache``), then the directory shipped in the package. For a key
the lookup takes, in order: an exact entry, the nearest token bucket with the same static
fields (within a few buckets, see :mod:`.keys`); the compile-chosen defaults of the device's
compile target (``<root>/sm_90/<kernel>.json``, see :mod:`.target_defaults`: exact, then nearest
bucket); and finally the kernel's built-in default, which depends on the key.

There is no per-file default config: files of an earlier version carry a ``default`` entry (the
config that won the most keys), which is ignored. On an H200 it sent prefill attention through a
decode key's 16x16 tiles with 32 KV splits, 60x slower than the built-in default.

A missing, unreadable, corrupt, stale (the kernel's source changed since tuning) or foreign
(another kernel's or platform's) file is skipped with one warning; a lookup never raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from .keys import TOKENS, KeyValue, key_string, nearest_key

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "autotune_cache"
USER_ROOT_ENV = "HW_AGNOSTIC_CACHE_DIR"

Source = Literal["user", "shipped", "target", "default"]
Match = Literal["exact", "nearest", "builtin"]


class TunableKernel(Protocol):
    """What the cache needs to know of a kernel (see :class:`hw_agnostic.kernels.KernelSpec`)."""

    name: str

    @property
    def source_hash(self) -> str: ...

    def default_config(self, key: Mapping[str, KeyValue]) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class ConfigChoice:
    """A launch config and where it came from."""

    config: dict[str, Any]
    source: Source
    match: Match
    key: dict[str, KeyValue]
    path: str | None = None

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.source}/{self.match}{where}"


def user_root() -> Path:
    configured = os.environ.get(USER_ROOT_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hw_agnostic" / "autotune_cache"


def config_path(root: Path, platform: str, kernel: str) -> Path:
    return root / platform / f"{kernel}.json"


# --------------------------------------------------------------------------------------------
# reading


class CacheFileError(Exception):
    """Why a config file cannot be used."""


@dataclasses.dataclass(frozen=True)
class _ParsedFile:
    entries: dict[str, tuple[dict[str, KeyValue], dict[str, Any]]]


_parsed: dict[Path, tuple[tuple[int, int], _ParsedFile]] = {}
_warned: set[tuple[str, str]] = set()
_listeners: list[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever tuned configs change (a save or :func:`invalidate`)."""
    _listeners.append(callback)


def invalidate() -> None:
    """Forget parsed files and warnings, and tell listeners (ops drop their cached plans)."""
    _parsed.clear()
    _warned.clear()
    for callback in _listeners:
        callback()


def _warn_once(path: Path, reason: str) -> None:
    marker = (str(path), reason)
    if marker not in _warned:
        _warned.add(marker)
        log.warning("hw_agnostic: ignoring tuned configs in %s: %s; using defaults", path, reason)


def _read_document(path: Path) -> dict[str, Any]:
    """The file's JSON object; raises :class:`CacheFileError` for anything else (any bytes at all)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CacheFileError(f"unreadable ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CacheFileError(f"not UTF-8 text (invalid byte at offset {err.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CacheFileError(f"corrupt JSON ({err.msg} at line {err.lineno})") from None
    except (RecursionError, ValueError) as err:  # nested past the parser's depth; a number of 5000 digits
        raise CacheFileError(f"corrupt JSON ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(data, dict):
        raise CacheFileError("corrupt: top level is not an object")
    return data


def parse_file(path: Path, kernel: TunableKernel, platform: str) -> _ParsedFile:
    """Read and check one config file; raises :class:`CacheFileError` saying what is wrong."""
    return _parse(_read_document(path), kernel, platform)


def _parse(data: dict[str, Any], kernel: TunableKernel, platform: str) -> _ParsedFile:
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CacheFileError(
            f"schema_version {_short(data.get('schema_version'))}, this library reads {SCHEMA_VERSION}"
        )
    if data.get("kernel") != kernel.name or data.get("platform") != platform:
        raise CacheFileError(
            f"foreign file: it is for kernel {_short(data.get('kernel'))} on {_short(data.get('platform'))}, "
            f"not {kernel.name!r} on {platform!r}"
        )
    if data.get("source_hash") != kernel.source_hash:
        raise CacheFileError("stale: the kernel's source changed since these configs were tuned")
    raw_entries = data.get("entries", [])
    if not isinstance(raw_entries, list):
        raise CacheFileError("corrupt: 'entries' must be a list")
    entries = {}
    for index, entry in enumerate(raw_entries):
        if not (_is_config_holder(entry) and isinstance(entry.get("key"), dict)):
            raise CacheFileError(f"corrupt: entry {index} lacks an object 'key' or 'config'")
        problem = _key_problem(entry["key"]) or _config_problem(entry["config"])
        if problem:
            raise CacheFileError(f"corrupt: entry {index}'s {problem}")
        entries[key_string(entry["key"])] = (entry["key"], entry["config"])
    return _ParsedFile(entries=entries)


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _key_problem(key: dict[str, Any]) -> str | None:
    """Why a stored key cannot be a key (:mod:`.keys`: int, str or bool fields, an int token bucket)."""
    for name, value in key.items():
        if not isinstance(value, (int, str, bool)):
            return f"key field {name!r} is {_short(value)}, not an int, str or bool"
    tokens = key.get(TOKENS)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return f"key has no token count (an int >= 0) but {_short(tokens)}"
    return None


# Helion configs hold lists of ints and lists of those; multi-kernel ops hold one config per kernel.
_CONFIG_DEPTH = 4


def _config_problem(config: dict[str, Any]) -> str | None:
    """Why a stored config is not a launch config: numbers, strings, and lists or objects of them,
    nested a few levels at most."""

    def plain(value: Any, depth: int) -> bool:
        if value is None or isinstance(value, (bool, int, str)):
            return True
        if isinstance(value, float):
            return math.isfinite(value)
        if depth >= _CONFIG_DEPTH:
            return False
        if isinstance(value, list):
            return all(plain(v, depth + 1) for v in value)
        return isinstance(value, dict) and all(plain(v, depth + 1) for v in value.values())

    for name, value in config.items():
        if not plain(value, 0):
            return f"config field {name!r} is not a number, string, or lists and objects of them nested at most " \
                   f"{_CONFIG_DEPTH} deep"
    return None


def _is_config_holder(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("config"), dict)


def _load(path: Path, kernel: TunableKernel, platform: str, *, expected: bool) -> _ParsedFile | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        if expected:
            _warn_once(path, "no tuned configs for this platform (run `make autotune`)")
        return None
    except (OSError, ValueError) as err:
        _warn_once(path, f"unreadable ({getattr(err, 'strerror', None) or err})")
        return None
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _parsed.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        parsed = parse_file(path, kernel, platform)
    except CacheFileError as err:
        _warn_once(path, str(err))
        return None
    except Exception as err:  # a file content parse_file did not foresee: still never the caller's problem
        _warn_once(path, f"unusable ({type(err).__name__}: {str(err)[:80]})")
        return None
    _parsed[path] = (stamp, parsed)
    return parsed


def lookup(
    kernel: TunableKernel, platform: str, key: Mapping[str, KeyValue], *, warn_if_missing: bool = True,
    target: str | None = None,
) -> ConfigChoice:
    """The config to launch ``kernel`` with for ``key`` on ``platform`` (compile target ``target``,
    e.g. ``sm_90``, if the device is one); never raises."""
    key = dict(key)
    files: list[tuple[Source, Path, _ParsedFile]] = []
    roots: list[tuple[Source, Path]] = [("shipped", SHIPPED_ROOT)]
    try:
        roots.insert(0, ("user", user_root()))
    except (RuntimeError, ValueError, OSError) as err:  # e.g. no home directory to expand ``~`` in
        _warn_once(Path(os.environ.get(USER_ROOT_ENV, "~")), f"the user config directory is unusable ({err})")
    for source, root in roots:
        path = config_path(root, platform, kernel.name)
        # A missing user file is the normal case; a missing shipped file is worth one warning,
        # unless the target's compile-chosen defaults stand in for it.
        expected = warn_if_missing and source == "shipped" and target is None
        parsed = _load(path, kernel, platform, expected=expected)
        if parsed is not None:
            files.append((source, path, parsed))

    wanted = key_string(key)
    for source, path, parsed in files:
        if wanted in parsed.entries:
            return ConfigChoice(dict(parsed.entries[wanted][1]), source, "exact", key, str(path))
    for source, path, parsed in files:
        near = nearest_key(key, (stored for stored, _ in parsed.entries.values()))
        if near is not None:
            return ConfigChoice(dict(parsed.entries[key_string(near)][1]), source, "nearest", key, str(path))
    if target is not None:
        chosen = _target_default(kernel, target, key)
        if chosen is not None:
            return chosen
    return ConfigChoice(kernel.default_config(key), "default", "builtin", key)


def _target_default(kernel: TunableKernel, target: str, key: dict[str, KeyValue]) -> ConfigChoice | None:
    """The compile-chosen default of ``target`` for ``key``: an exact entry, else the nearest bucket."""
    files = [(path, parsed) for path in (config_path(root, target, kernel.name) for root in (user_root(), SHIPPED_ROOT))
             if (parsed := _load(path, kernel, target, expected=False)) is not None]
    wanted = key_string(key)
    for path, parsed in files:
        if wanted in parsed.entries:
            return ConfigChoice(dict(parsed.entries[wanted][1]), "target", "exact", key, str(path))
    for path, parsed in files:
        near = nearest_key(key, (stored for stored, _ in parsed.entries.values()))
        if near is not None:
            return ConfigChoice(dict(parsed.entries[key_string(near)][1]), "target", "nearest", key, str(path))
    return None


# --------------------------------------------------------------------------------------------
# writing


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<file>.lock`` exclusively for a read-modify-write, and remove it afterwards.

    The lock file is unlinked while held; a writer that opened it before the unlink finds, once
    it holds the lock, that the path no longer names its file, and starts over with a new one.
    """
    lock_path = path.with_name(path.name + ".lock")
    try:
        import fcntl
    except ImportError:  # not POSIX: last writer wins
        yield
        return
    while True:
        handle = open(lock_path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                continue
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path)
            return
        finally:
            handle.close()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _update(
    kernel: TunableKernel, platform: str, root: Path | None, tuned_with: Mapping[str, str] | None,
    change: Callable[[dict[str, Any]], None],
) -> Path:
    """Read-modify-write one config file under a lock; a stale or corrupt file is started afresh."""
    root = user_root() if root is None else Path(root)
    path = config_path(root, platform, kernel.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            data = _read_document(path)
            _parse(data, kernel, platform)
        except CacheFileError as err:
            if path.exists():
                log.warning("hw_agnostic: replacing %s (%s)", path, err)
            data = {"entries": []}
        data.setdefault("entries", [])
        data.update(schema_version=SCHEMA_VERSION, kernel=kernel.name, platform=platform,
                    source_hash=kernel.source_hash)
        previous = data.get("tuned_with")
        data["tuned_with"] = dict(tuned_with or (previous if isinstance(previous, dict) else None) or {})
        change(data)
        data["entries"].sort(key=lambda e: key_string(e["key"]))
        order = ("schema_version", "kernel", "platform", "source_hash", "entries", "tuned_with")  # an old "default" goes
        document = {name: data[name] for name in order if name in data}
        _atomic_write(path, json.dumps(document, indent=1) + "\n")
    invalidate()
    return path


def save_entry(
    kernel: TunableKernel,
    platform: str,
    key: Mapping[str, KeyValue],
    config: Mapping[str, Any],
    *,
    time_us: float | None,
    root: Path | None = None,
    tuned_with: Mapping[str, str] | None = None,
) -> Path:
    """Add (or replace) the entry for ``key``, atomically."""
    entry: dict[str, Any] = {"key": dict(key), "config": dict(config)}
    if time_us is not None:
        entry["time_us"] = round(float(time_us), 3)

    def change(data: dict[str, Any]) -> None:
        data["entries"] = [e for e in data["entries"] if key_string(e["key"]) != key_string(key)] + [entry]

    return _update(kernel, platform, root, tuned_with, change)


def save_entries(
    kernel: TunableKernel,
    platform: str,
    entries: Iterable[tuple[Mapping[str, KeyValue], Mapping[str, Any], Mapping[str, Any]]],
    *,
    root: Path | None = None,
    tuned_with: Mapping[str, str] | None = None,
) -> Path:
    """Add (or replace) many entries ``(key, config, extra fields)`` in one write."""
    new = [{"key": dict(key), "config": dict(config), **dict(extra)} for key, config, extra in entries]
    replaced = {key_string(e["key"]) for e in new}

    def change(data: dict[str, Any]) -> None:
        data["entries"] = [e for e in data["entries"] if key_string(e["key"]) not in replaced] + new

    return _update(kernel, platform, root, tuned_with, change)
