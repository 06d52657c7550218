"""How a restore reads a shard off NVMe: O_DIRECT when the page cache does not hold it, through
the cache when it does, every digest checked either way (issue 22, item 4)."""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierpipe.errors import IntegrityError
from tierpipe.recovery.load import load_into
from tierpipe.storage.aligned import (
    O_DIRECT,
    aligned_buffer,
    cached_share,
    read_direct_unless_cached,
    unmap_later,
)
from tierpipe.storage.reader import read_head
from tierpipe.storage.shardfile import write_shard

needs_direct_io = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def cold_fd(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A 4 MiB file on the test filesystem, none of it in the page cache, opened buffered."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 << 20))
    _drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_share(fd, 4 << 20) != 0.0:
            pytest.skip("this filesystem keeps the file cached (DONTNEED ignored)")
        yield fd, 4 << 20
    finally:
        os.close(fd)


def test_cached_share_counts_the_pages_the_cache_holds(cold_fd: tuple[int, int]) -> None:
    """Nothing cached: 0; the first half read: about half; all read: 1."""
    fd, size = cold_fd
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
    os.pread(fd, size // 2, 0)
    assert 0.4 <= cached_share(fd, size) <= 0.6
    os.pread(fd, size, 0)
    assert cached_share(fd, size) == 1.0


def test_cached_share_of_nothing_is_zero(tmp_path: Path) -> None:
    """An empty file (nothing to map) has no cached share, and no error."""
    (tmp_path / "empty").touch()
    fd = os.open(tmp_path / "empty", os.O_RDONLY)
    try:
        assert cached_share(fd, 0) == 0.0
    finally:
        os.close(fd)


@needs_direct_io
def test_a_cold_file_is_switched_to_direct_reads(cold_fd: tuple[int, int]) -> None:
    """A file the cache does not hold gets O_DIRECT; one it holds stays buffered."""
    fd, size = cold_fd
    assert read_direct_unless_cached(fd, size)
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
    os.pread(fd, size, 0)
    assert not read_direct_unless_cached(fd, size)
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT


def _state(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    sizes = [1 << 20, 12345, 3 << 20, 0, 700_001, 2 << 20, 4097, 5 << 20]
    return {f"t{i}": torch.randint(0, 255, (sizes[i % len(sizes)],), dtype=torch.uint8,
                                   generator=gen) for i in range(n)}  # fmt: skip


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "cached"])
def test_default_restore_is_exact_cold_or_cached(tmp_path: Path, cached: bool) -> None:
    """load_into's default reads a cold shard (O_DIRECT) and a cached one (page cache) bit-exact
    into its targets, through an arena that wraps (small chunks, several readers)."""
    state = _state(16)
    path = tmp_path / "s.shard"
    write_shard(path, state, job="j", step=1)
    _drop_cache(path)
    if cached:
        path.read_bytes()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    loaded = load_into(str(path), into, queue_depth=3, chunk_bytes=1 << 20)
    for k, v in state.items():
        assert torch.equal(into[k], v), k
    assert loaded.in_place == len(state)


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "cached"])
def test_corrupt_tensor_in_the_middle_is_named_and_never_reaches_its_target(
    tmp_path: Path, cached: bool
) -> None:
    """A flipped byte deep inside a tensor in the middle of a cold (or cached) shard stops the
    default restore with IntegrityError naming that tensor; its target and every later one keep
    their bytes (earlier tensors, verified, may be in place)."""
    state = _state(16)
    path = tmp_path / "s.shard"
    write_shard(path, state, job="j", step=1)
    head = read_head(path)
    entry = next(e for e in head.header.tensors if e.path == ("t10",))
    blob = head.header.blobs[entry.blob]
    assert blob.nbytes > 1 << 20  # a blob read in several chunks: hashed as they arrive
    with open(path, "r+b") as f:
        f.seek(head.data_offset + blob.offset + blob.nbytes - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    _drop_cache(path)
    if cached:
        path.read_bytes()
    into = {k: torch.full_like(v, 7) for k, v in state.items()}
    with pytest.raises(IntegrityError) as err:
        load_into(str(path), into, queue_depth=4, chunk_bytes=1 << 20)
    assert err.value.path == str(path) and err.value.what == "tensor t10"
    for i in range(10, 16):
        assert torch.equal(into[f"t{i}"], torch.full_like(state[f"t{i}"], 7)), i


def test_shard_on_tmpfs_restores(tmp_path: Path) -> None:
    """On tmpfs (every page is in the cache; older kernels refuse O_DIRECT) the default read
    stays buffered and restores exactly."""
    state = _state(5)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        path = Path(shm) / "s.shard"
        write_shard(path, state, job="j", step=1)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert not read_direct_unless_cached(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        load_into(str(path), into)
    for k, v in state.items():
        assert torch.equal(into[k], v), k


def test_unmap_later_gives_the_buffer_back_unless_a_view_holds_it() -> None:
    """A buffer nothing views is closed by a background thread; one still viewed stays open,
    quietly (the GC unmaps it later)."""
    free, held = aligned_buffer(1 << 20), aligned_buffer(1 << 20)
    view = memoryview(held)
    unmap_later(free)
    unmap_later(held)
    deadline = time.monotonic() + 30
    while not free.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    _join_threads("tierpipe-unmap")
    assert free.closed and not held.closed
    view.release()
    held.close()


def _join_threads(prefix: str) -> None:
    for t in threading.enumerate():
        if t.name.startswith(prefix):
            t.join(timeout=30)


@pytest.mark.parametrize("cached", [False, True], ids=["cold", "cached"])
def test_a_failed_restore_leaves_no_reader_thread(tmp_path: Path, cached: bool) -> None:
    """A corrupt first blob of a shard larger than the arena stops the restore at once: the
    readers are joined before it raises, and the arena goes back."""
    state = {f"t{i}": torch.full((3 << 20,), i, dtype=torch.uint8) for i in range(40)}
    path = tmp_path / "s.shard"
    write_shard(path, state, job="j", step=1)
    head = read_head(path)
    with open(path, "r+b") as f:
        f.seek(head.data_offset + 100)
        f.write(b"\xff")
    _drop_cache(path)
    if cached:
        path.read_bytes()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(IntegrityError) as err:
        load_into(str(path), into, queue_depth=2, chunk_bytes=1 << 20)
    assert err.value.what == "tensor t0"
    assert [t.name for t in threading.enumerate() if t.name.startswith("tierpipe-read")] == []
    _join_threads("tierpipe-unmap")
    assert all(not t.any() for t in into.values())
