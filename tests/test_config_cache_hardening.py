"""The config cache never raises on the lookup path, whatever a config file holds.

Any bytes, JSON nested past the parser's limit, numbers too long to convert, keys and configs
whose fields have the wrong types: one warning, then the fallback; and the tuner's save path
replaces such a file.
"""

from __future__ import annotations

import json
import logging

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hw_agnostic.autotune import cache
from tests.test_autotune_cache import KERNEL, KEY, _document, _write, roots  # noqa: F401 (roots: a fixture)

PLATFORM = "nvidia_h100"
HEADER = {"schema_version": cache.SCHEMA_VERSION, "kernel": KERNEL.name, "platform": PLATFORM,
          "source_hash": KERNEL.source_hash}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
# Documents with a valid header and arbitrary entries: past the header checks, into the entry checks.
headed_documents = st.fixed_dictionaries(
    {name: st.just(value) for name, value in HEADER.items()},
    optional={
        "entries": st.lists(
            st.fixed_dictionaries({"key": st.dictionaries(st.sampled_from(["hidden", "dtype", "tokens"]), json_values),
                                   "config": st.dictionaries(st.text(max_size=6), json_values)}),
            max_size=3),
        "default": st.fixed_dictionaries({"config": st.dictionaries(st.text(max_size=6), json_values)}),
        "tuned_with": json_values,
    },
)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _lookups_survive(shipped, data: bytes, caplog) -> None:
    cache.invalidate()
    caplog.clear()
    _write(shipped, "").write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="hw_agnostic.autotune.cache"):
        choices = [cache.lookup(KERNEL, PLATFORM, KEY) for _ in range(2)]
    for choice in choices:
        assert isinstance(choice.config, dict) and choice.source in ("shipped", "default")
        f"{choice.describe()} {choice.config}"  # printable: plans describe their config
    # A file it cannot use is reported once (a usable one without a matching entry is not reported).
    assert len([r for r in caplog.records if "ignoring tuned configs" in r.getMessage()]) <= 1


def _tuner_replaces(user, data: bytes) -> None:
    _write(user, "").write_bytes(data)
    cache.save_entry(KERNEL, PLATFORM, KEY, {"block": 7}, time_us=1.0)
    assert cache.lookup(KERNEL, PLATFORM, KEY).config == {"block": 7}
    cache.config_path(user, PLATFORM, KERNEL.name).unlink()
    cache.invalidate()


@SETTINGS
@given(data=st.binary(max_size=200))
@example(data=b"\xff\xfe\x00\x80 not utf-8")
@example(data=b"[" * 100_000)
@example(data=b'{"schema_version": 1' + b"0" * 5000 + b"}")
def test_any_bytes(roots, caplog, data):  # noqa: F811
    user, shipped = roots
    _lookups_survive(shipped, data, caplog)
    _tuner_replaces(user, data)


@SETTINGS
@given(document=headed_documents | json_values.map(lambda v: {**HEADER, "entries": v}))
@example(document={**HEADER, "entries": [{"key": {**KEY, "tokens": "16"}, "config": {}}]})
@example(document={**HEADER, "entries": [{"key": {**KEY, "tokens": [16]}, "config": {}}]})
@example(document={**HEADER, "entries": [{"key": {**KEY, "tokens": float("nan")}, "config": {}}]})
@example(document={**HEADER, "entries": [{"key": {**KEY, "tokens": float("inf")}, "config": {}}]})
@example(document={**HEADER, "entries": [{"key": {**KEY, "hidden": {"a": 1}}, "config": {}}]})
@example(document={**HEADER, "default": {"config": {"block": [[[[[1]]]]]}}})
@example(document={**HEADER, "default": {"config": {"block": 1}}, "tuned_with": [1, 2]})
def test_any_json_document(roots, caplog, document):  # noqa: F811
    user, shipped = roots
    data = json.dumps(document).encode()
    _lookups_survive(shipped, data, caplog)
    _tuner_replaces(user, data)


def test_a_wrongly_typed_key_names_the_entry_and_field(roots, caplog):  # noqa: F811
    _, shipped = roots
    _write(shipped, _document(entries=[{"key": KEY, "config": {}}, {"key": {**KEY, "tokens": "16"}, "config": {}}]))
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(KERNEL, PLATFORM, KEY).source == "default"
    assert any("entry 1's key has no token count" in r.getMessage() for r in caplog.records)


def test_a_file_without_entries_is_extended_by_the_tuner(roots):  # noqa: F811
    user, _ = roots
    _write(user, {**HEADER, "default": {"config": {"block": 3}}})  # an earlier version's file-wide default
    cache.save_entry(KERNEL, PLATFORM, KEY, {"block": 5}, time_us=2.0)
    assert cache.lookup(KERNEL, PLATFORM, KEY).config == {"block": 5}
    document = json.loads(cache.config_path(user, PLATFORM, KERNEL.name).read_text())
    assert "default" not in document and len(document["entries"]) == 1


def test_an_unusable_user_directory_falls_back(roots, monkeypatch, caplog):  # noqa: F811
    def no_home():
        raise RuntimeError("Could not determine home directory")

    monkeypatch.setattr(cache, "user_root", no_home)
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(KERNEL, PLATFORM, KEY).source == "default"
    assert any("user config directory is unusable" in r.getMessage() for r in caplog.records)


def test_every_kernels_configs_survive_a_save_and_a_lookup(roots):  # noqa: F811
    """The stricter reading accepts every config a kernel proposes (the tuner saves those)."""
    import torch

    from hw_agnostic.autotune.keys import make_key
    from hw_agnostic.ops import all_ops

    user, _ = roots
    seen = set()
    for name, op in sorted(all_ops().items()):
        if name.startswith("test_") or op.example_inputs is None:
            continue
        args = op.example_inputs(16, 64, torch.bfloat16, "cpu")
        call = op.key(*args)
        for provider in op.providers:
            if provider.kernel is None or provider.kernel.name in seen:
                continue
            seen.add(provider.kernel.name)
            key = make_key(provider.tuning_key(call), call.tokens)
            for config in [provider.kernel.default_config(key), *provider.kernel.candidate_configs(key)[:20]]:
                cache.save_entry(provider.kernel, PLATFORM, key, config, time_us=1.0)
                choice = cache.lookup(provider.kernel, PLATFORM, key)
                assert (choice.source, choice.config) == ("user", json.loads(json.dumps(config))), name
    assert len(seen) >= 10
