"""The storage contract, proven by mypy (`make typecheck` checks this file with the package): both
tiers' stores are `ShardStore`s. Kept out of the package so that `tierpipe.storage.store`, the
contract, imports neither implementation. Nothing here runs."""

from __future__ import annotations

from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.store import SealedFile, ShardStore, StagedShard


def _nvme_keeps_the_contract(store: NvmeStore) -> ShardStore[StagedShard]:
    return store


def _s3_keeps_the_contract(store: S3Store) -> ShardStore[SealedFile]:
    return store
