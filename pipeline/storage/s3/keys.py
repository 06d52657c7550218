"""Object keys: where a shard lives in a bucket.

A shard's key is `<prefix>/<hh>/<job>/step-<n>/rank-<r>-of-<w>.shard` (`object_key`, the one
place keys are made; `parse_object_key` the one place they are read): the two hex digits `hh`
hash the job and rank, so a step's objects spread over 256 prefixes.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import xxhash

from tierpipe.errors import TierpipeError
from tierpipe.names import shard_relpath

__all__ = ("HASH_PREFIXES", "ShardKey", "object_key", "parse_object_key")

#: A shard key below the prefix: `<hh>/<job>/step-<step>/rank-<rank>-of-<world>.shard`.
_SHARD_KEY = re.compile(
    r"([0-9a-f]{2})/([A-Za-z0-9_-]{1,64})/step-(\d{12})/rank-(\d{5})-of-(\d{5})\.shard"
)
#: Every hash prefix a key can have (the low byte of a 64-bit hash, as two hex digits).
HASH_PREFIXES = tuple(f"{b:02x}" for b in range(256))


class ShardKey(NamedTuple):
    """The shard an object key names."""

    job: str
    step: int
    rank: int
    world_size: int


def object_key(prefix: str, job: str, step: int, rank: int, world_size: int) -> str:
    """The object key of a shard: `<prefix>/<hh>/<job>/step-<n>/rank-<r>-of-<w>.shard`.

    The one place a key is made. `hh` is the low byte of xxh3_64 of `<job>/<rank>` as two hex
    digits, so one step's objects spread over 256 key prefixes (S3 scales request rates per
    prefix) while anyone can still derive a key from the job, step, rank and world size alone.

    Raises:
        InvalidNameError: `job` is not a valid job name.
        ValueError: step or rank out of range.
    """
    relpath = shard_relpath(job, step, rank, world_size)
    spread = f"{xxhash.xxh3_64_intdigest(f'{job}/{rank}'.encode()) & 0xFF:02x}"
    return "/".join(p for p in (prefix, spread, str(relpath)) if p)


def parse_object_key(prefix: str, key: str) -> ShardKey | None:
    """The shard that `key` is the object of, or None: not under `prefix`, not a shard key, or
    a hash that does not match its job and rank (a forged or misplaced object is no shard)."""
    if prefix and not key.startswith(prefix + "/"):
        return None
    m = _SHARD_KEY.fullmatch(key[len(prefix) + 1 :] if prefix else key)
    if m is None:
        return None
    shard = ShardKey(m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5)))
    try:
        return shard if object_key(prefix, *shard) == key else None
    except (TierpipeError, ValueError):  # a reserved job name, a rank outside its world
        return None
