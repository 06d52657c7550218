"""Every multi-rank gloo group in the tests and the dev harness is torn down only after its ranks
meet at a barrier.

Without it one rank may destroy its group while a peer is still inside a collective (DCP's load
ends in one), and gloo aborts the peer with "terminate called without an active exception" after
the work under test has succeeded. The landing of issues 22/24 failed on that twice, in launchers
that lacked the barrier. A group of world size 1 has no peer and needs none.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How far above a `destroy_process_group()` its barrier (or world size 1) must be.
WINDOW = 8


def _teardowns() -> list[tuple[str, int, str]]:
    found = []
    for folder in (ROOT / "tests", ROOT / "pipeline" / "dev"):
        for path in sorted(folder.rglob("*.py")):
            if path.name == Path(__file__).name:
                continue
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if "destroy_process_group" in line:
                    above = "\n".join(lines[max(0, i - WINDOW) : i])
                    found.append((str(path.relative_to(ROOT)), i + 1, above))
    return found


def test_the_scan_sees_the_launchers() -> None:
    files = {name for name, _, _ in _teardowns()}
    assert {"tests/test_export.py", "tests/reshard_rank.py", "tests/test_restore_peer.py"} <= files


def test_every_group_meets_at_a_barrier_before_it_is_destroyed() -> None:
    bare = [
        f"{name}:{line}"
        for name, line, above in _teardowns()
        if "barrier()" not in above and "world_size=1" not in above
    ]
    assert bare == [], f"destroy_process_group() with no dist.barrier() before it: {bare}"
