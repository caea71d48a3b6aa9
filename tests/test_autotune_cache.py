"""Platform names, the key policy, and config files: provenance, fallbacks, atomic writes."""

from __future__ import annotations

import json
import logging
import os

import pytest

from hw_agnostic.autotune import cache
from hw_agnostic.autotune.keys import key_string, make_key, nearest_key, token_bucket
from hw_agnostic.autotune.platform import platform_from_cli, platform_from_name
from hw_agnostic.kernels.runtime import KernelSpec


@pytest.mark.parametrize("reported, platform", [
    ("NVIDIA H100 80GB HBM3", "nvidia_h100"),
    ("NVIDIA H100 PCIe", "nvidia_h100"),
    ("NVIDIA H100 NVL", "nvidia_h100"),
    ("NVIDIA H200", "nvidia_h200"),
    ("NVIDIA H20", "nvidia_h20"),
    ("NVIDIA A100-SXM4-80GB", "nvidia_a100"),
    ("NVIDIA L40S", "nvidia_l40s"),
    ("NVIDIA GeForce RTX 4090", "nvidia_rtx_4090"),
    ("AMD Instinct MI300X", "amd_mi300x"),
    ("Intel(R) Data Center GPU Max 1550", "intel_max_1550"),
    ("Some New Accelerator 9000", "some_new_accelerator_9000"),
])
def test_platform_aliases(reported, platform):
    assert platform_from_name(reported) == platform


@pytest.mark.parametrize("typed, platform", [
    ("h100", "nvidia_h100"), ("H200", "nvidia_h200"), ("nvidia_h200", "nvidia_h200"),
    ("mi300x", "amd_mi300x"), ("cpu", "cpu"), ("a100", "nvidia_a100"),
])
def test_cli_names(typed, platform):
    assert platform_from_cli(typed) == platform


def test_token_buckets():
    assert [token_bucket(n) for n in (0, 1, 2, 3, 5, 16, 17, 16384, 10**9)] == [0, 1, 2, 4, 8, 16, 32, 16384, 65536]


def test_keys_are_canonical_and_nearest_matches_static_fields():
    key = make_key({"hidden": 4096, "dtype": "bfloat16"}, 200)
    assert key_string(key) == '{"dtype":"bfloat16","hidden":4096,"tokens":256}'
    stored = [make_key({"hidden": 4096, "dtype": "bfloat16"}, t) for t in (1, 64, 4096)]
    stored.append(make_key({"hidden": 8192, "dtype": "bfloat16"}, 256))
    assert nearest_key(key, stored)["tokens"] == 64
    tie = make_key({"hidden": 4096, "dtype": "bfloat16"}, 512)  # 64 and 4096 both 3 doublings away
    assert nearest_key(tie, stored)["tokens"] == 4096
    assert nearest_key(make_key({"hidden": 1, "dtype": "x"}, 1), stored) is None
    # a bucket more than NEAREST_OCTAVES away stands in for nothing: 1 token is not 16K tokens
    assert nearest_key(make_key({"hidden": 4096, "dtype": "bfloat16"}, 4), stored)["tokens"] == 1
    assert nearest_key(make_key({"hidden": 4096, "dtype": "bfloat16"}, 65536), stored) is None
    with pytest.raises(TypeError, match="key field 'hidden' must be int, str or bool"):
        make_key({"hidden": 1.5}, 1)


# --------------------------------------------------------------------------------------------
# files

KERNEL = KernelSpec("demo_kernel", (test_keys_are_canonical_and_nearest_matches_static_fields,),
                    lambda key: {"block": 64, "origin": "builtin"}, lambda key: [])
KEY = make_key({"hidden": 128, "dtype": "float16"}, 16)


@pytest.fixture
def roots(tmp_path, monkeypatch):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setenv(cache.USER_ROOT_ENV, str(user))
    monkeypatch.setattr(cache, "SHIPPED_ROOT", shipped)
    cache.invalidate()
    yield user, shipped
    cache.invalidate()


def _write(root, document, platform="nvidia_h100"):
    path = cache.config_path(root, platform, KERNEL.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def _document(**changes):
    document = {"schema_version": cache.SCHEMA_VERSION, "kernel": KERNEL.name, "platform": "nvidia_h100",
                "source_hash": KERNEL.source_hash,
                # an earlier version's per-file default: ignored (see the cache module's docstring)
                "default": {"config": {"block": 32, "origin": "file-default"}},
                "entries": [{"key": KEY, "config": {"block": 8, "origin": "entry"}, "time_us": 3.0}]}
    document.update(changes)
    return document


def test_missing_files_fall_back_to_the_builtin_default_with_one_warning(roots, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            choice = cache.lookup(KERNEL, "nvidia_h100", KEY)
    assert (choice.source, choice.match, choice.config["origin"]) == ("default", "builtin", "builtin")
    assert len([r for r in caplog.records if "no tuned configs" in r.getMessage()]) == 1


def test_shipped_entry_and_its_provenance(roots):
    _, shipped = roots
    path = _write(shipped, _document())
    choice = cache.lookup(KERNEL, "nvidia_h100", KEY)
    assert (choice.source, choice.match, choice.path, choice.config["origin"]) == ("shipped", "exact", str(path), "entry")
    assert choice.describe() == f"shipped/exact ({path})"


def test_user_directory_overrides_the_shipped_one(roots):
    user, shipped = roots
    _write(shipped, _document())
    _write(user, _document(entries=[{"key": KEY, "config": {"block": 4, "origin": "user"}}]))
    assert cache.lookup(KERNEL, "nvidia_h100", KEY).config["origin"] == "user"


def test_nearest_bucket_then_target_default_then_builtin(roots, monkeypatch):
    """A key without an entry takes a tuned bucket only within NEAREST_OCTAVES of its own, then the
    compile target's chosen default, then the built-in one; never a file-wide default config."""
    _, shipped = roots
    _write(shipped, _document())
    near = cache.lookup(KERNEL, "nvidia_h100", make_key({"hidden": 128, "dtype": "float16"}, 100))
    assert (near.match, near.config["origin"]) == ("nearest", "entry")
    for far in (make_key({"hidden": 128, "dtype": "float16"}, 4096), make_key({"hidden": 256, "dtype": "float16"}, 16)):
        choice = cache.lookup(KERNEL, "nvidia_h100", far)
        assert (choice.source, choice.match, choice.config["origin"]) == ("default", "builtin", "builtin")
    target_file = shipped / "sm_90" / f"{KERNEL.name}.json"
    target_file.parent.mkdir(parents=True, exist_ok=True)
    far = make_key({"hidden": 128, "dtype": "float16"}, 4096)
    target_file.write_text(json.dumps({**_document(platform="sm_90"),
                                       "entries": [{"key": far, "config": {"block": 16, "origin": "target"}}]}))
    cache.invalidate()
    choice = cache.lookup(KERNEL, "nvidia_h100", far, target="sm_90")
    assert (choice.source, choice.match, choice.config["origin"]) == ("target", "exact", "target")


@pytest.mark.parametrize("document, reason", [
    ("{not json", "corrupt JSON"),
    ("[1, 2]", "top level is not an object"),
    (_document(schema_version=99), "schema_version 99"),
    (_document(source_hash="0000"), "stale"),
    (_document(kernel="rms_norm"), "foreign file"),
    (_document(platform="amd_mi300x"), "foreign file"),
    (_document(entries={"a": 1}), "'entries' must be a list"),
    (_document(entries=[{"key": KEY}]), "entry 0 lacks"),
])
def test_bad_files_warn_once_and_fall_back(roots, caplog, document, reason):
    _, shipped = roots
    _write(shipped, document)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            choice = cache.lookup(KERNEL, "nvidia_h100", KEY)
    assert choice.source == "default"
    messages = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(messages) == 1, [r.getMessage() for r in caplog.records]


def test_save_is_atomic_and_merges(roots, monkeypatch):
    user, _ = roots
    path = cache.save_entry(KERNEL, "nvidia_h100", KEY, {"block": 2}, time_us=5.0)
    other = make_key({"hidden": 128, "dtype": "float16"}, 64)
    cache.save_entry(KERNEL, "nvidia_h100", other, {"block": 4}, time_us=6.0, tuned_with={"torch": "x"})
    cache.save_entry(KERNEL, "nvidia_h100", KEY, {"block": 3}, time_us=4.0)  # replaces the first entry
    document = json.loads(path.read_text())
    assert [e["config"]["block"] for e in document["entries"]] == [3, 4]
    assert document["source_hash"] == KERNEL.source_hash and document["tuned_with"] == {"torch": "x"}
    before = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        cache.save_entry(KERNEL, "nvidia_h100", KEY, {"block": 9}, time_us=1.0)
    assert path.read_text() == before
    leftovers = [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"]
    assert leftovers == []


def test_saving_over_a_stale_file_starts_afresh(roots, caplog):
    user, _ = roots
    _write(user, _document(source_hash="old"))
    with caplog.at_level(logging.WARNING):
        path = cache.save_entry(KERNEL, "nvidia_h100", KEY, {"block": 2}, time_us=1.0)
    assert len(json.loads(path.read_text())["entries"]) == 1
    assert cache.lookup(KERNEL, "nvidia_h100", KEY).config == {"block": 2}


def test_shipped_files_parse(roots):
    """Every config file shipped in the package is current for its kernel."""
    from hw_agnostic import ops

    kernels = {p.kernel.name: p.kernel for op in ops.all_ops().values() for p in op.providers if p.kernel}
    for path in cache.Path(cache.__file__).resolve().parent.parent.joinpath("autotune_cache").glob("*/*.json"):
        cache.parse_file(path, kernels[path.stem], path.parent.name)
