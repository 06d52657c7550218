"""The NVMe store: atomic sealed writes, temp sweeping, full disks, verification reads."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from tierpipe.errors import NoSpaceError, ShardFormatError
from tierpipe.recovery.load import load_shard
from tierpipe.state import plan_state, tensor_buffer
from tierpipe.storage.lock import INSTANCE
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.shard import parse_head


def staged_image(nbytes: int) -> tuple[mmap.mmap, object]:
    plan = plan_state(
        {"x": torch.arange(nbytes // 4, dtype=torch.int32)},
        job="j",
        step=1,
        rank=0,
        world_size=1,
        node="n",
    )
    buf = mmap.mmap(-1, plan.nbytes)
    buf[: len(plan.head)] = plan.head
    plan.copy_into(plan.destinations(torch.frombuffer(buf, dtype=torch.uint8)))
    return buf, parse_head(memoryview(buf), "<test>", sealed=False)


def test_write_is_idempotent_and_verifies(tmp_path: Path) -> None:
    """Writing the same staged image twice finds the first copy; it verifies from the device."""
    buf, head = staged_image(1 << 20)
    with NvmeStore(tmp_path) as store:
        final = tmp_path / "j" / "a.shard"
        first = store.write_image(memoryview(buf), head, final)
        again = store.write_image(memoryview(buf), head, final)
        assert not first.existed and again.existed and again.header_digest == first.header_digest
        ok = store.verify_file(final, header_digest=first.header_digest, nbytes=first.nbytes)
        assert ok.nbytes == os.path.getsize(final)
        with pytest.raises(ShardFormatError, match="bytes on disk"):
            store.verify_file(final, header_digest=first.header_digest, nbytes=first.nbytes + 4096)
        with pytest.raises(ShardFormatError, match="missing"):
            store.verify_file(tmp_path / "nope.shard", header_digest=first.header_digest, nbytes=1)


def test_sweep_removes_only_dead_writers_temp_files(tmp_path: Path) -> None:
    """Temp files of dead processes are removed; a live writer's temp file is kept."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    d = tmp_path / "j" / "step-000000000001"
    d.mkdir(parents=True)
    stale = d / f".rank-00000-of-00001.shard.verify.{dead.pid}-0a0b0c.tmp"
    old_style = d / f".rank-00000-of-00002.shard.{dead.pid}.tmp"
    live = d / f".rank-00001-of-00002.shard.verify.{os.getpid()}-0a0b0c.tmp"
    mine = d / f".rank-00001-of-00003.shard.nvme-write.{os.getpid()}-{INSTANCE}.tmp"
    for p in (stale, old_style, live, mine):
        p.write_bytes(b"x")
    with NvmeStore(tmp_path) as store:
        assert sorted(store.sweep_temp("nvme-write")) == sorted([str(stale), str(old_style)])
    assert live.exists() and mine.exists()


def test_sweep_removes_own_stage_temp_of_another_instance_with_our_pid(tmp_path: Path) -> None:
    """A temp of this stage left by another instance is swept even when its PID is ours (a
    restarted container reuses PIDs); the stage lock guarantees that instance is dead."""
    d = tmp_path / "j" / "step-000000000001"
    d.mkdir(parents=True)
    left = d / f".rank-00000-of-00001.shard.nvme-write.{os.getpid()}-deadbeef0000.tmp"
    left.write_bytes(b"x")
    with NvmeStore(tmp_path) as store:
        assert store.sweep_temp("nvme-write") == [str(left)]
    assert not left.exists()


def test_remove_by_digest_spares_a_newer_save(tmp_path: Path) -> None:
    """Removal with a header digest deletes the file only while it still holds that save."""
    buf, head = staged_image(1 << 16)
    with NvmeStore(tmp_path) as store:
        final = tmp_path / "j" / "step-000000000001" / "a.shard"
        done = store.write_image(memoryview(buf), head, final)
        assert not store.remove(final, header_digest="0" * 32)
        assert final.exists()
        assert store.remove(final, header_digest=done.header_digest)
        assert not final.exists() and not final.parent.exists()
        assert not store.remove(final, header_digest=done.header_digest)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root, as in CI and this project's dev machines)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root; test_pipeline covers the reserve check")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_filesystem_fails_before_any_byte_and_retries_cleanly(tiny_fs: Path) -> None:
    """ENOSPC surfaces as NoSpaceError from preallocation, leaving no file; once there is room,
    the same write succeeds."""
    buf, head = staged_image(4 << 20)
    final = tiny_fs / "j" / "a.shard"
    with NvmeStore(tiny_fs) as store:
        store.reserve_bytes = 0
        with pytest.raises(NoSpaceError) as err:
            store.write_image(memoryview(buf), head, final)
        assert err.value.needed == head.file_nbytes
        assert not final.parent.exists()  # nothing created, not even the directory
        subprocess.run(["mount", "-o", "remount,size=16m", str(tiny_fs)], check=True)
        assert not store.write_image(memoryview(buf), head, final).existed
    assert final.exists()


def test_unaligned_source_buffer_falls_back_to_buffered_writes(tmp_path: Path) -> None:
    """A source buffer O_DIRECT refuses is written buffered (decided once, race-free)."""
    plan = plan_state({"x": torch.randn(6 << 20)}, job="j", step=1, rank=0, world_size=1, node="n")
    raw = torch.empty(plan.nbytes + 4096, dtype=torch.uint8)
    shift = (64 - raw.data_ptr()) % 512  # 64 bytes past a sector boundary: O_DIRECT refuses
    image = raw[shift : shift + plan.nbytes]
    buf = tensor_buffer(image)
    buf[: len(plan.head)] = plan.head
    plan.copy_into(plan.destinations(image))
    head = parse_head(buf, "<test>", sealed=False)
    with NvmeStore(tmp_path, chunk_bytes=1 << 20, queue_depth=4) as store, capture_logs() as logs:
        for i in range(5):
            store.write_image(buf, head, tmp_path / f"{i}.shard")
    assert [e["event"] for e in logs].count("direct_io_unavailable") == 5
    _, state = load_shard(tmp_path / "4.shard")
    assert torch.equal(state["x"], plan.copies[0].src)


def test_shard_without_tensor_data_writes_and_verifies(tmp_path: Path) -> None:
    """A state of plain values only (no data region) still seals and verifies."""
    plan = plan_state(
        {"step": 3, "e": torch.empty(0)}, job="j", step=1, rank=0, world_size=1, node="n"
    )
    buf = mmap.mmap(-1, plan.nbytes)
    buf[: len(plan.head)] = plan.head
    head = parse_head(memoryview(buf), "<test>", sealed=False)
    with NvmeStore(tmp_path) as store:
        done = store.write_image(memoryview(buf), head, tmp_path / "a.shard")
        store.verify_file(
            tmp_path / "a.shard", header_digest=done.header_digest, nbytes=done.nbytes
        )
    assert load_shard(tmp_path / "a.shard")[1]["step"] == 3


def test_a_read_error_in_a_shard_head_comes_out_as_itself(tmp_path: Path) -> None:
    """An I/O error reading a shard's head (here EISDIR: a folder where the shard should be)
    is reported as that error, never masked by the read buffer's cleanup (`BufferError`,
    which crashed an agent's evict stage)."""
    from tierpipe.storage.reader import read_head

    folder = tmp_path / "rank-00000-of-00001.shard"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        read_head(folder)
    assert err.value.errno == errno.EISDIR
