"""The catalog fold: events in stream order -> copies per shard and tier."""

from __future__ import annotations

from tests.oracle_catalog import Catalog
from tierpipe.schemas import ShardEvicted, ShardStaged, ShardVerified, ShardWritten, StageFailed

ID = dict(job="j", node="n", ts=0.0, rank=0, world_size=1)


def staged(step: int) -> ShardStaged:
    return ShardStaged(
        **ID, step=step, staging_path="/s", slot=0, nbytes=8192, tensors=1, stall_s=0
    )


def written(step: int, digest: str = "a" * 32) -> ShardWritten:
    return ShardWritten(
        **ID, step=step, path="/p", nbytes=8192, header_digest=digest, tensors=1, seconds=0
    )


def verified(step: int, digest: str = "a" * 32) -> ShardVerified:
    return ShardVerified(**ID, step=step, path="/p", nbytes=8192, header_digest=digest, seconds=0)


def test_lifecycle_and_idempotence() -> None:
    """staged -> written -> verified -> ram evicted, and applying events twice changes nothing."""
    cat = Catalog()
    evicted = ShardEvicted(**ID, step=1, tier="ram", location="/s", reason="r")
    for e in [staged(1), written(1), verified(1), evicted] * 2:
        cat.apply(e)
    (shard,) = cat.shards("j")
    nvme, ram = shard.copy("nvme", "n"), shard.copy("ram", "n")
    assert nvme is not None and nvme.usable and ram is not None and ram.evicted


def test_rewrite_with_other_content_restarts_verification() -> None:
    """A `written` with a different header digest (a different save) is not verified yet."""
    cat = Catalog()
    for e in (written(2), verified(2), written(2, "b" * 32)):
        cat.apply(e)
    nvme = cat.shard("j", 2, 0).copy("nvme", "n")  # type: ignore[union-attr]
    assert nvme is not None and not nvme.verified and nvme.header_digest == "b" * 32


def test_permanent_verify_failure_marks_copy_corrupt() -> None:
    """A permanent verify failure makes the NVMe copy unusable; poison reports are ignored."""
    cat = Catalog()
    cat.apply(written(3))
    cat.apply(
        StageFailed(
            **ID,
            step=3,
            stage="verify",
            error="IntegrityError",
            message="m",
            retryable=False,
            attempt=1,
        )
    )
    cat.apply(
        StageFailed(
            job="j",
            node="n",
            ts=0,
            stage="verify",
            error="DecodeError",
            message="x",
            retryable=False,
            attempt=1,
        )
    )
    shard = cat.shard("j", 3, 0)
    assert shard is not None and shard.copy("nvme", "n").corrupt and len(shard.failures) == 1  # type: ignore[union-attr]
    assert [s.step for s in cat.shards("j")] == [3]
