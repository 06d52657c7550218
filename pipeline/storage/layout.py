"""Where a shard's data region lands in memory as it is read: the plans of the read engine.

A `ReadPlan` is a list of reads (a contiguous file range into contiguous memory, each naming
the pieces of blobs it holds) in file order. Memory that is reused while the reads go on is a
ring: positions in it are virtual, growing by laps, so a read may start once the consumer is done
with everything up to `vend - ring_bytes` (one number, see `reader._Readers`).

- `scratch_plan` (verify): the data region in chunks through a ring of scratch memory, each blob
  hashed in passing and never whole in memory.
- `arena_plan` (restore): a blob that only passes through (copied out once verified) lands whole
  in a ring arena, every other blob in one buffer for them all, which the caller keeps.

Either plan maps at most two buffers, whatever the tensor count: a mapping per blob would run
into the kernel's cap on mappings per process (`vm.max_map_count`, 65,530 by default) at a few
ten thousand tensors, and then into threads that cannot start (their stacks are mappings too).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

from tierpipe.storage.aligned import aligned_buffer, round_up
from tierpipe.storage.shard import Head

__all__ = ("ARENA_MIN_BYTES", "Read", "ReadPlan", "arena_plan", "scratch_plan")

#: The smallest restore arena (see `arena_plan`).
ARENA_MIN_BYTES = 64 << 20


@dataclass(slots=True)
class Read:
    """One read of a contiguous file range into contiguous memory."""

    file_offset: int
    buffer: mmap.mmap  # the ring, or the buffer of the blobs the caller keeps
    buffer_offset: int
    length: int  # a multiple of 4 KiB
    needed: int  # bytes that must arrive (the rest is padding, or past the end of the file)
    vend: int  # virtual ring position its memory ends at (0: not in the ring)
    pieces: list[tuple[int, int, int]]  # (blob, offset in buffer, bytes), in file order
    #: Virtual ring position below which the ring is free once this read was consumed (its
    #: pieces hashed, the blobs they complete handed on); 0: frees nothing.
    frees: int = 0


@dataclass(slots=True)
class ReadPlan:
    reads: list[Read]
    #: The reused memory (None: none).
    ring: mmap.mmap | None
    ring_bytes: int
    #: Per blob: (buffer, offset) where it lies whole once read (None: hashed in passing).
    places: list[tuple[mmap.mmap, int] | None]
    sizes: list[int]

    def view(self, i: int) -> memoryview:
        """Blob `i`'s bytes (where the plan puts it whole)."""
        place = self.places[i]
        if place is None or not self.sizes[i]:
            if self.sizes[i]:
                raise ValueError(f"blob {i} is never whole in memory in this plan")
            return memoryview(b"")
        buffer, at = place
        return memoryview(buffer)[at : at + self.sizes[i]]


def scratch_plan(head: Head, ring: mmap.mmap, chunk: int) -> ReadPlan:
    """The data region read in `chunk`s through `ring` (a multiple of `chunk` bytes), every blob
    hashed in passing: a verify."""
    blobs = head.header.blobs
    reads: list[Read] = []
    first = 0  # the first blob not wholly before the chunk
    for k, start in enumerate(range(head.data_offset, head.file_nbytes, chunk)):
        n = min(chunk, head.file_nbytes - start)
        lo_chunk = start - head.data_offset
        hi_chunk = lo_chunk + n
        at = k * chunk % len(ring)
        pieces = []
        i = first
        while i < len(blobs):
            b = blobs[i]
            lo, hi = max(b.offset, lo_chunk), min(b.offset + b.nbytes, hi_chunk)
            if hi > lo:
                pieces.append((i, at + lo - lo_chunk, hi - lo))
            if b.offset + b.nbytes > hi_chunk:
                break
            i += 1
        first = i
        vend = k * chunk + round_up(n)
        reads.append(Read(start, ring, at, round_up(n), n, vend, pieces, frees=vend))
    return ReadPlan(reads, ring, len(ring), [None] * len(blobs), [b.nbytes for b in blobs])


def arena_plan(head: Head, passing: Sequence[bool], depth: int, chunk: int) -> ReadPlan:
    """Where every blob lands for a restore, and the reads that put it there.

    Blobs that only pass through are staged in an arena: a ring of reusable memory, placed in
    file order, each blob contiguous and only overwritten once it was handed on (copied out).
    It is sized to hold the largest such blob plus two queue depths of reads, so copies overlap
    reads; a restore into preallocated targets touches fresh memory only for the arena, which
    matters as much as the disk when page faults cost ~0.5 s/GiB (virtual machines). The other
    blobs, which the caller keeps, lie in one buffer for them all in file order, each at a
    4 KiB-aligned offset (O_DIRECT reads land in it): the tensors made from them are views that
    keep it alive together. Reads are coalesced across adjacent blobs up to `chunk` bytes.
    """
    blobs = head.header.blobs
    sizes = [round_up(b.nbytes) for b in blobs]
    largest = max((n for n, a in zip(sizes, passing, strict=True) if a), default=0)
    total = sum(n for n, a in zip(sizes, passing, strict=True) if a)
    arena_bytes = min(total, max(ARENA_MIN_BYTES, largest + 2 * depth * chunk))
    arena = aligned_buffer(arena_bytes) if arena_bytes else None
    kept_bytes = sum(n for n, a in zip(sizes, passing, strict=True) if not a)
    kept = aligned_buffer(kept_bytes) if kept_bytes else None
    kept_at = 0  # where the next kept blob goes in `kept`
    plan = ReadPlan([], arena, arena_bytes, [None] * len(blobs), [b.nbytes for b in blobs])
    #: Per passing blob: the virtual position up to which the arena is free once it was handed
    #: on (its end, or past the padding to the next lap when the next one wraps).
    frees = [0] * len(blobs)
    completes: dict[int, int] = {}  # passing blob -> the read that completes it
    cursor, last = 0, -1  # virtual arena position, the last passing blob
    for i, b in enumerate(blobs):
        if not b.nbytes:
            continue
        if passing[i]:
            assert arena is not None
            if cursor % arena_bytes + sizes[i] > arena_bytes:
                cursor += arena_bytes - cursor % arena_bytes  # next lap
                if last >= 0:
                    frees[last] = cursor
            vstart, cursor = cursor, cursor + sizes[i]
            last = i
            buffer, at = arena, vstart % arena_bytes
            frees[i] = cursor
        else:
            assert kept is not None
            vstart, buffer, at = -1, kept, kept_at
            kept_at += sizes[i]
        plan.places[i] = (buffer, at)
        for off in range(0, b.nbytes, chunk):
            n = min(chunk, b.nbytes - off)
            _add(
                plan.reads,
                Read(
                    file_offset=head.data_offset + b.offset + off,
                    buffer=buffer,
                    buffer_offset=at + off,
                    length=round_up(n),
                    needed=n,
                    vend=vstart + off + round_up(n) if vstart >= 0 else 0,
                    pieces=[(i, at + off, n)],
                ),
                chunk,
            )
        if passing[i]:
            completes[i] = len(plan.reads) - 1
    for i, k in completes.items():  # free once the read that completes the blob was consumed
        plan.reads[k].frees = max(plan.reads[k].frees, frees[i])
    return plan


def _add(reads: list[Read], r: Read, chunk: int) -> None:
    """Append `r`, or extend the last read with it where both are contiguous."""
    last = reads[-1] if reads else None
    if (
        last is not None
        and last.buffer is r.buffer
        and last.buffer_offset + last.length == r.buffer_offset
        and last.file_offset + last.length == r.file_offset
        and last.length + r.length <= chunk
    ):
        last.needed = last.length + r.needed
        last.length += r.length
        last.vend = r.vend
        last.pieces += r.pieces
    else:
        reads.append(r)
