"""Paired measurement for the benchmarks: a candidate against its baseline on a noisy machine.

A ratio of two medians, each taken over its own reps, passes or fails a target by chance when
the machine's speed drifts between (and during) runs. Here A (the baseline) and B (the
candidate) run as interleaved pairs, A then B, then B then A, and so on (a linear drift costs
each the same on average), and what is reported is the median of the per-pair ratios B / A
(below 1: B is faster, for times) with a distribution-free 90 % interval of that median: the
order statistics [r(k), r(n+1-k)] with the largest k whose binomial coverage is still at least
90 % (the sign test's interval: it holds for any distribution of the ratios, at any number of
pairs; at 5-7 pairs it is their whole range). A bootstrap of the median, used before, covered
81-89 % in simulation at 5-30 pairs (its resampled medians take only the sample's middle
values), and two runs of the same commit gave intervals that did not overlap. A target is
judged against the interval, not the point: met, missed, or undecided when the interval
straddles it.

Pure: no torch, no I/O but the one progress line `record` logs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from bench.common import log

__all__ = [
    "MIN_PAIRS",
    "Better",
    "Paired",
    "Verdict",
    "alternate",
    "paired",
    "ratio_keys",
    "record",
    "run_pairs",
    "verdict",
]

Verdict = Literal["met", "missed", "undecided"]
#: Which side of the target is good: `lower` (a time ratio, `<= target`) or `higher` (a rate).
Better = Literal["lower", "higher"]

#: The interval's coverage (at least).
LEVEL = 0.90
#: The fewest pairs `record` gives a verdict on: below 5 even the range of the ratios covers
#: the median less than 90 % of the time (all of 2-4 pairs on one side of it happens by chance
#: 6-25 % of the time).
MIN_PAIRS = 5

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Paired:
    """The per-pair ratios B / A, their median, and a bootstrap interval of that median (None
    with fewer than 2 pairs: one pair says nothing about the spread)."""

    ratios: tuple[float, ...]
    median: float
    lo: float | None
    hi: float | None

    @property
    def n(self) -> int:
        return len(self.ratios)

    @property
    def half_width(self) -> float | None:
        """Half the interval's width relative to the median (0.02: ±2 %); None without one."""
        if self.lo is None or self.hi is None or self.median == 0:
            return None
        return (self.hi - self.lo) / 2 / abs(self.median)

    def map(self, fn: Callable[[float], float]) -> Paired:
        """The same figures through an increasing `fn` (e.g. a ratio as a percentage over 1);
        the median and the bounds of a bootstrap of medians carry over unchanged in order."""
        return Paired(
            tuple(fn(r) for r in self.ratios),
            fn(self.median),
            None if self.lo is None else fn(self.lo),
            None if self.hi is None else fn(self.hi),
        )


def alternate(items: Sequence[T], index: int) -> list[T]:
    """`items` as given for an even `index`, reversed for an odd one: A, B, then B, A."""
    return list(items) if index % 2 == 0 else list(reversed(items))


def paired(a: Sequence[float], b: Sequence[float], *, level: float = LEVEL) -> Paired:
    """The median of the per-pair ratios `b[i] / a[i]` and an interval of it that covers the
    true median at least `level` of the time (`order_interval`; below 5 pairs, the range).

    Raises:
        ValueError: no pairs, `a` and `b` of different lengths, or a baseline time <= 0.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need as many baselines as candidates, at least one ({len(a)}, {len(b)})")
    if min(a) <= 0:
        raise ValueError(f"baseline times must be > 0 (got {min(a)!r})")
    ratios = np.asarray(b, dtype=float) / np.asarray(a, dtype=float)
    middle = float(np.median(ratios))
    if len(ratios) < 2:
        return Paired(tuple(ratios.tolist()), middle, None, None)
    k = order_interval(len(ratios), level)
    ordered = np.sort(ratios)
    lo, hi = float(ordered[k - 1]), float(ordered[len(ratios) - k])
    return Paired(tuple(ratios.tolist()), middle, lo, hi)


def order_interval(n: int, level: float = LEVEL) -> int:
    """The largest k such that [r(k), r(n+1-k)] (1-based order statistics of `n` samples)
    holds their distribution's median with probability >= `level`: 1 - 2 P(Bin(n, 1/2) < k).
    1 (the range) when even that falls short (n <= 4 at 90 %)."""
    below, k = 1 / 2**n, 1  # P(Bin(n, 1/2) < k)
    while k < (n + 1) // 2:
        below += math.comb(n, k) / 2**n  # (now P(Bin(n, 1/2) < k + 1))
        if 1 - 2 * below < level:
            break
        k += 1
    return k


def run_pairs(
    a: Callable[[], float],
    b: Callable[[], float],
    *,
    pairs: int,
    max_pairs: int | None = None,
    budget_s: float = math.inf,
    half_width: float | None = None,
    on_pair: Callable[[int, float, float], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Run `a` and `b` (each returns the seconds it measured) as interleaved pairs: A, B for
    pair 0, B, A for pair 1, and so on. At least `pairs` pairs; then, with `half_width`, more
    until the interval's relative half-width is at most that, `max_pairs` are done or
    `budget_s` seconds have passed since the first pair began. `on_pair(i, a_s, b_s)` sees each.

    Returns:
        The times of A and of B, pair by pair.
    """
    limit = max(pairs, max_pairs or pairs)
    fns = {"a": a, "b": b}
    times: dict[str, list[float]] = {"a": [], "b": []}
    t0 = time.monotonic()
    for index in range(limit):
        for name in alternate(("a", "b"), index):
            times[name].append(fns[name]())
        if on_pair is not None:
            on_pair(index, times["a"][-1], times["b"][-1])
        if index + 1 < pairs:
            continue
        if half_width is None or time.monotonic() - t0 >= budget_s:
            break
        hw = paired(times["a"], times["b"]).half_width
        if hw is not None and hw <= half_width:
            break
    return times["a"], times["b"]


def verdict(lo: float, hi: float, target: float, better: Better = "lower") -> Verdict:
    """`met` when the whole interval [lo, hi] is on the good side of `target` (or on it),
    `missed` when the whole interval is on the bad side, `undecided` when it straddles it."""
    if lo > hi:
        raise ValueError(f"interval bounds out of order ({lo!r} > {hi!r})")
    good, bad = (hi <= target, lo > target) if better == "lower" else (lo >= target, hi < target)
    return "met" if good else "missed" if bad else "undecided"


def ratio_keys(key: str, pairs: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """`key`, `key_lo`, `key_hi`: the median of the per-pair ratios b / a of `pairs` (a, b)
    and its interval (`paired`); all None without pairs (the bounds None with one)."""
    if not pairs:
        return {key: None, f"{key}_lo": None, f"{key}_hi": None}
    p = paired([a for a, _ in pairs], [b for _, b in pairs])
    return {key: p.median, f"{key}_lo": p.lo, f"{key}_hi": p.hi}


def record(
    result: dict[str, Any],
    key: str,
    p: Paired,
    target: float | None = None,
    better: Better = "lower",
) -> None:
    """Add `key` (the median ratio), `key_lo`, `key_hi` and, given a target, `key_verdict` to
    `result`, and log one line for the target (fewer than `MIN_PAIRS` pairs: undecided)."""
    result[key] = p.median
    result[f"{key}_lo"], result[f"{key}_hi"] = p.lo, p.hi
    spread = "no interval" if p.lo is None else f"90 % interval {p.lo:.3f}-{p.hi:.3f}"
    if target is None:
        log(f"{key} = {p.median:.3f} ({spread}, {p.n} pairs)")
        return
    v: Verdict = "undecided"
    if p.n >= MIN_PAIRS and p.lo is not None and p.hi is not None:
        v = verdict(p.lo, p.hi, target, better)
    result[f"{key}_verdict"] = v
    if p.n < MIN_PAIRS:
        spread += f"; fewer than {MIN_PAIRS} pairs: no verdict"
    sign = "<=" if better == "lower" else ">="
    log(f"{key} = {p.median:.3f} ({spread}, {p.n} pairs): {v} against the target "
        f"{sign} {target:g}")  # fmt: skip
