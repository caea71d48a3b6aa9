"""The one key policy for tuned configs, for every op.

A key is a flat mapping of an op's *static* properties (hidden size, dtype, activation, head
dim, expert count, ...) matched exactly, plus ``tokens``: the number of rows the call works on,
bucketed to the next power of two (1, 2, 4, ..., 65536; larger counts share the last bucket).
Token counts vary call by call in serving, so they are bucketed; everything else changes which
kernel is best too much to share configs across values.

Keys are stored as canonical JSON (sorted keys) so a key reads the same in every file and
compares by string. When no entry matches a key exactly, the entry with the same static
properties and the nearest token bucket (in log2 distance, ties to the larger bucket) is used,
if it lies within :data:`NEAREST_OCTAVES` buckets: the best config for one token is not the best
for thousands (on an H200 the grouped MoE GEMM tuned at 1 token ran 8192 tokens 4x slower than
its built-in default would), so a farther key takes the defaults instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Union

KeyValue = Union[int, str, bool]
TOKENS = "tokens"
MAX_TOKEN_BUCKET = 1 << 16
#: How far (in powers of two) a tuned token bucket stands in for a key without an entry.
NEAREST_OCTAVES = 3


def token_bucket(tokens: int) -> int:
    """0 for no tokens, else the next power of two, capped at :data:`MAX_TOKEN_BUCKET`."""
    if tokens <= 0:
        return 0
    return min(1 << (tokens - 1).bit_length(), MAX_TOKEN_BUCKET)


def make_key(static: Mapping[str, KeyValue], tokens: int) -> dict[str, KeyValue]:
    """A key from an op's static properties and its (unbucketed) token count."""
    if TOKENS in static:
        raise ValueError(f"static key fields must not contain {TOKENS!r}")
    for name, value in static.items():
        if not isinstance(value, (int, str, bool)):
            raise TypeError(f"key field {name!r} must be int, str or bool, got {type(value).__name__}")
    return {**static, TOKENS: token_bucket(tokens)}


def key_string(key: Mapping[str, KeyValue]) -> str:
    """Canonical text of a key: compact JSON with sorted fields."""
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"))


def static_part(key: Mapping[str, KeyValue]) -> str:
    return key_string({k: v for k, v in key.items() if k != TOKENS})


def nearest_key(
    key: Mapping[str, KeyValue], candidates: Iterable[Mapping[str, KeyValue]]
) -> Mapping[str, KeyValue] | None:
    """The candidate with the same static fields and the closest token bucket, if one lies within
    :data:`NEAREST_OCTAVES` buckets."""
    wanted_static = static_part(key)
    wanted = max(int(key.get(TOKENS, 1)), 1).bit_length()
    best, best_rank = None, None
    for candidate in candidates:
        if static_part(candidate) != wanted_static:
            continue
        have = max(int(candidate.get(TOKENS, 1)), 1).bit_length()
        if abs(have - wanted) > NEAREST_OCTAVES:
            continue
        rank = (abs(have - wanted), -have)
        if best_rank is None or rank < best_rank:
            best, best_rank = candidate, rank
    return best
