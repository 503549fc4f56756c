"""``data.num_workers: auto``: the guide's advice (more loader workers until the GPU stops
waiting) done by the machine. The loop measures the data-wait fraction of a few steps per
setting; this pure function says what to try next or where to stay."""

from __future__ import annotations

import os
from dataclasses import dataclass

TARGET_WAIT = 0.03  # under this share of step time spent waiting for data, the loader is fast enough
MIN_GAIN = 0.1  # a setting must cut the wait by this share of the best so far to count as better
# A setting is measured for at least this long (and a few steps): a window of 4 short steps (~0.1 s)
# on a busy machine measured the noise of a few late wake-ups, and kept no loader workers for data
# that needed them.
MIN_PROBE_S = 0.5


@dataclass(frozen=True)
class LoaderSetting:
    num_workers: int
    prefetch_factor: int


def ladder(cpus: int | None = None) -> tuple[LoaderSetting, ...]:
    """Settings in the order tried: more workers, then deeper prefetch, up to the machine's CPUs
    (at least 2: a loader that waits on storage gains from a second process even on one core)."""
    cap = max(2, cpus or os.cpu_count() or 1)
    steps = [(0, 2), (1, 2), (2, 2), (4, 2), (4, 4), (8, 4), (16, 4)]
    return tuple(LoaderSetting(w, p) for w, p in steps if w <= cap)


def next_setting(tried: list[tuple[LoaderSetting, float]], options: tuple[LoaderSetting, ...],
                 target: float = TARGET_WAIT, min_gain: float = MIN_GAIN) -> tuple[LoaderSetting, bool]:
    """Given the wait fractions measured so far (the last is the current setting; a setting may
    have several): the setting to use next and whether the search is over. A setting counts at its
    best measurement: a busy machine only ever adds wait. The search ends when the wait is under
    ``target``, at the top of the ladder, or when the current setting did not clearly beat the best
    before it twice: a single window that met a start-up or a burst of other work (in a full run,
    one worker measured 82.6% against none's 66.5% for data that one worker halves) is measured
    again before the cheaper setting is kept."""
    current = tried[-1][0]
    best: dict[LoaderSetting, float] = {}
    for setting, wait in tried:
        best[setting] = min(wait, best.get(setting, wait))
    if best[current] <= target:
        return current, True
    others = {s: w for s, w in best.items() if s != current}
    if others:
        before = min(others, key=others.get)
        if best[current] > others[before] * (1 - min_gain):
            if sum(s == current for s, _ in tried) < 2:
                return current, False  # measure it once more
            return before, True  # no real gain: the cheaper setting that did as well
    i = options.index(current) if current in options else len(options) - 1
    if i + 1 >= len(options):
        return min(best, key=best.get), True
    return options[i + 1], False
