"""`tierpipe demo` (the README's first command): the whole story, end to end, on real servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_demo_tells_the_whole_story_under_a_cpu_hog(tmp_path: Path, cpu_hog: None) -> None:
    """With every core busy elsewhere: a node is lost mid-run, the job restarts with a
    replacement, the survivor's rank restores from its NVMe and the replacement's from S3, the
    steps trained twice have bit-identical losses, the final checkpoints reload bitwise, the
    table reports the costs, and `--plot` writes the timeline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERPIPE_")}
    png = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "demo", "--steps", "24", "--every", "4",
         "--data", str(tmp_path / "demo"), "--plot", str(png)],
        env=env,
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "the story held" in out.stdout, text
    restored = dict(re.findall(r"rank (\d) on node-\w: restored step \d+ from (\w+)\n", out.stdout))
    assert restored == {"0": "nvme", "1": "s3"}, text
    twice = re.search(r"the (\d+) losses of the steps trained twice .* to the bit: True", text)
    assert twice is not None and int(twice.group(1)) > 0, text
    assert "reloads bitwise: True; it is in S3: True" in out.stdout, text
    for row in ("stall per save", "torch.save + fsync", "training-step overhead", "NVMe write",
                "S3 flush", "steps lost", "seconds to resume"):  # fmt: skip
        assert row in out.stdout, (row, text)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
