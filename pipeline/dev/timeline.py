"""`tierpipe demo --plot`: the demo's events per tier over time, rendered to a PNG.

One row per tier (RAM staging, NVMe write, NVMe verify, S3 flush, evictions), a mark per shard
event at its time, coloured by node, and the story's moments (the node loss, the restart) as
vertical lines. Needs matplotlib (`pip install 'tierpipe[plot]'`).
"""

from __future__ import annotations

from pathlib import Path

from tierpipe.errors import ConfigError
from tierpipe.schemas import (
    Event,
    ShardEvicted,
    ShardFlushed,
    ShardStaged,
    ShardVerified,
    ShardWritten,
)

__all__ = ("render",)

_ROWS = ("RAM staged", "NVMe written", "NVMe verified", "S3 flushed", "evicted")


def _row(event: Event) -> str | None:
    match event:
        case ShardStaged():
            return _ROWS[0]
        case ShardWritten():
            return _ROWS[1]
        case ShardVerified():
            return _ROWS[2]
        case ShardFlushed():
            return _ROWS[3]
        case ShardEvicted():
            return _ROWS[4]
    return None


def render(events: list[Event], moments: list[tuple[float, str]], *, t0: float, path: Path) -> None:
    """Write the timeline of `events` to the PNG `path`: times relative to `t0`; `moments`
    are (seconds since `t0`, what happened).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # (no display needed)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'tierpipe[plot]'") from e
    points: dict[str, tuple[list[float], list[int]]] = {}
    for event in events:
        row = _row(event)
        if row is None:
            continue
        xs, ys = points.setdefault(event.node, ([], []))
        xs.append(event.ts - t0)
        ys.append(_ROWS.index(row))
    fig, ax = plt.subplots(figsize=(10, 3.6), dpi=110)
    for i, (node, (xs, ys)) in enumerate(sorted(points.items())):
        # Nodes side by side within a row, so their marks do not hide each other.
        offset = (i - (len(points) - 1) / 2) * 0.18
        ax.scatter(xs, [y + offset for y in ys], s=14, marker="|", linewidths=1.5, label=node)
    for i, (x, what) in enumerate(moments):
        ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(what, (x, -0.45 + 0.3 * (i % 2)), fontsize=8, ha="left", va="center",
                    xytext=(3, 0), textcoords="offset points", backgroundcolor="white")  # fmt: skip
    ax.set_yticks(range(len(_ROWS)), _ROWS)
    ax.set_ylim(-0.7, len(_ROWS) - 0.5)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the demo started")
    ax.set_title("tierpipe demo: shard events per tier (from the event stream)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
