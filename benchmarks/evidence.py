"""Verdicts from RL runs: paired differences over seeds with a t interval, time to a reward level, outcomes.

Runs are paired by seed: the same seed gives every algorithm the same prompts and the same first rollout, so the
difference of two algorithms' scores on one seed removes the seed's own luck. Over n seeds with differences d_s,

    d̄ = mean(d_s),   half-width = t_{0.975, n−1} · sd(d_s) / √n,   interval = [d̄ − half, d̄ + half]

and a verdict is stated only when the interval excludes 0 over at least 3 seeds (``verdict``): at 2 seeds the
interval has one degree of freedom, and with rewards in steps (a last-10 mean of 32 binary rewards moves by 1/320)
two seeds can give the same difference, a sample sd of 0 and an interval of width 0 around a chance value. The t
quantile is SciPy's (``t_quantile``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from scipy import stats

TAIL = 10  # the score of a run: its last-TAIL-step mean reward
COLLAPSE_GAIN = -0.05  # a run collapsed when its last-10 reward ends 0.05 or more below its first-10 reward
STALL_GAIN = 0.1  # a run stalled when it gained less than this (reward is a fraction in [0, 1])
MIN_VERDICT_SEEDS = 3  # fewer paired seeds never make a verdict (see the module docstring)
LEVEL_WINDOW = 5  # the time to a reward level: the first step whose trailing 5-step mean reaches it


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom (SciPy's)."""
    return float(stats.t.cdf(t, df))


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t (0.5 < p < 1), SciPy's ``t.ppf``."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    return float(stats.t.ppf(p, df))


@dataclass(frozen=True)
class Paired:
    """The paired difference a − b over the seeds both have."""

    seeds: tuple[int, ...]
    mean: float
    half_width: float  # of the 95 % t interval; nan with fewer than 2 seeds
    favour_a: int  # seeds where a scored higher than b

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def resolved(self) -> bool:
        """The 95 % interval excludes 0 over at least ``MIN_VERDICT_SEEDS`` seeds."""
        return self.n >= MIN_VERDICT_SEEDS and self.excludes_zero

    @property
    def excludes_zero(self) -> bool:
        """The 95 % interval excludes 0 (never with fewer than 2 seeds, where it has no width)."""
        return self.n >= 2 and (self.low > 0.0 or self.high < 0.0)

    def interval(self, digits: int = 3) -> str:
        if self.n == 0:
            return "—"
        if self.n == 1:
            return f"{self.mean:+.{digits}f} (n=1)"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}] (n={self.n})"


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> Paired:
    """a − b paired by seed (the keys), over the seeds in both, with the 95 % t interval of the mean."""
    seeds = tuple(sorted(set(a) & set(b)))
    diffs = [a[s] - b[s] for s in seeds]
    favour = sum(d > 0 for d in diffs)
    if len(diffs) < 2:
        return Paired(seeds, diffs[0] if diffs else math.nan, math.nan, favour)
    half = t_quantile(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Paired(seeds, statistics.mean(diffs), half, favour)


def verdict(name: str, baseline: str, diff: Paired) -> str:
    """One sentence: which is better and by how much where the interval excludes 0, else no resolvable difference."""
    if not diff.resolved:
        few = (f"; the interval excludes 0, but a verdict needs {MIN_VERDICT_SEEDS} seeds" if diff.excludes_zero
               else "")
        return f"{name} vs {baseline}: no resolvable difference at {diff.n} seeds ({diff.interval()}{few})"
    word = "above" if diff.mean > 0 else "below"
    return f"{name} ends {word} {baseline}: {diff.interval()}, {diff.favour_a} of {diff.n} seeds higher"


def last_mean(series: Sequence[float], tail: int = TAIL) -> float:
    """Mean of the last ``tail`` values (all of them when there are fewer)."""
    return statistics.mean(series[-tail:])


def first_mean(series: Sequence[float], head: int = TAIL) -> float:
    return statistics.mean(series[:head])


def recorded_mean(values) -> float:
    """Mean of the values a run recorded (None and NaN left out: a figure a run has no value for); NaN if none. An
    inf stays in, so a run that blew up shows as inf rather than as a finite mean of its other steps."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def formatted(value: float, spec: str) -> str:
    """``value`` formatted by ``spec`` (inf as inf), or — where the runs do not record it (REINFORCE has no clip
    range: None or NaN)."""
    return "—" if value is None or math.isnan(value) else format(value, spec)


def mean_and_spread(values: Sequence[float]) -> str:
    """'mean ± sd' over runs to 3 decimals; the mean alone for one run (no spread to give)."""
    values = list(values)
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread}"


def steps_to_level(series: Sequence[float], level: float, window: int = LEVEL_WINDOW) -> int | None:
    """The first step (1-based) whose trailing ``window``-step mean reaches ``level``; None when none does."""
    for end in range(window, len(series) + 1):
        if statistics.mean(series[end - window:end]) >= level:
            return end
    return None


def outcome(series: Sequence[float]) -> str:
    """collapsed (the last-10 reward at least 0.05 below the first 10: a flat run's noise is not a collapse), stalled
    (gain < STALL_GAIN) or learned."""
    gain = last_mean(series) - first_mean(series)
    if gain < COLLAPSE_GAIN:
        return "collapsed"
    return "stalled" if gain < STALL_GAIN else "learned"
