"""`tierpipe demo` (the README's first command): the whole story, end to end, on real servers."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _peer_tier_built() -> bool:
    """Whether this build has the peer transport (replicas to restore a replaced node from)."""
    try:
        return importlib.util.find_spec("tierpipe.peer.client") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow
def test_the_demo_tells_the_whole_story_under_a_cpu_hog(tmp_path: Path, cpu_hog: None) -> None:
    """With every core busy elsewhere (`cpu_hog`: a busy loop per core) and object storage
    throttled below the save rate: nothing waits for object storage, a node is lost at a step
    drawn at random (seeded, printed), the job restarts with a replacement, the survivor's rank
    restores from its NVMe and the replacement's from its partner (or whatever the tiers held),
    the steps lost are what the tiers' lags at the kill allowed at most, the steps trained twice
    have bit-identical losses, the final checkpoints reload bitwise, the table reports the costs,
    and `--plot` writes the timeline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERPIPE_")}
    env["TIERPIPE_DEMO_SEED"] = "22"
    png = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "demo", "--steps", "24", "--every", "4",
         "--data", str(tmp_path / "demo"), "--plot", str(png)],
        env=env,
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "the story held" in out.stdout, text
    assert "paused" not in text, text  # (nothing waits for object storage before the kill)
    throttle = re.search(r"uploads throttled to ([\d.]+) MiB/s per node; node-b lost at step "
                         r"(\d+) \(drawn at random: seed 22\)", out.stdout)  # fmt: skip
    assert throttle is not None and 0 < float(throttle.group(1)) < 8, text

    # What the tiers held at the kill, and what that allows the restart to lose.
    trained = int(re.search(r"!! node-b lost at step (\d+):", out.stdout).group(1))  # type: ignore[union-attr]
    newest = {}
    for tier, step, lag in re.findall(
        r"\n +(NVMe|peers|S3) +(\d+|-) +\((lag \d+ steps|nothing there)\)", out.stdout
    ):
        newest[tier] = None if step == "-" else int(step)
        if step != "-":
            assert 0 <= int(step) <= trained and lag == f"lag {trained - int(step)} steps", text
    assert set(newest) == {"NVMe", "peers", "S3"}, text
    off_node = [s for s in (newest["peers"], newest["S3"]) if s is not None]
    allowed = trained - max(off_node, default=0)
    lost = re.search(r"steps lost: (\d+) \(trained to step (\d+), resumed from step (\d+); the "
                     r"tiers' lags at the kill allowed at most (\d+)\)", out.stdout)  # fmt: skip
    assert lost is not None, text
    n_lost, trained_to, resumed, said_allowed = map(int, lost.groups())
    assert said_allowed == allowed and trained_to == trained, text
    assert n_lost == trained_to - resumed and 0 <= n_lost <= allowed, text

    restored = dict(re.findall(r"rank (\d) on node-\w: restored (?:step \d+ from (\w+)|nothing)",
                               out.stdout))  # fmt: skip
    assert set(restored) == {"0", "1"}, text
    assert restored["0"] in ("nvme", ""), text  # (the survivor: its own NVMe, or a fresh start)
    if _peer_tier_built() and (newest["peers"] or -1) > (newest["S3"] or -1):
        assert restored["1"] == "peer", text  # (the replacement: its partner's replica)
    else:
        assert restored["1"] in ("peer", "s3", ""), text
    twice = re.search(r"the (\d+) losses of the steps trained twice .* to the bit: True", text)
    assert twice is not None and int(twice.group(1)) > 0, text
    assert "reloads bitwise: True; it is in S3: True" in out.stdout, text
    for row in ("stall per save", "torch.save + fsync", "training-step overhead", "NVMe write",
                "S3 flush", "steps lost", "seconds to resume"):  # fmt: skip
        assert row in out.stdout, (row, text)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
