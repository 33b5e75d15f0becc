"""The model-admission check: is the engine's mismatch on a new model small enough, step after step, to train on?

prime-rl's rule for admitting a model (docs/development.md at PrimeIntellect-ai/prime-rl 559b4477): a table of
the mean mismatch KL over 20 steps (its ``math`` environment, batch size 64), every entry below 0.015. The number
is its ``mismatch_kl/all/mean``: with ℓ_t = log π_train(y_t) − log π_engine(y_t) on every trained token of the
step, pooled over micro-batches and ranks,

    k3_step = (1/N) Σ_t (e^ℓ_t − 1 − ℓ_t)            (a token-weighted mean, every token weight 1)

(Schulman's k3 estimate of KL(π_engine ‖ π_train) on tokens the engine sampled). This module computes that per step
(``step_mismatch``), beside the sequence-mean k3 that miles' host reduction gives and the k1 estimate
mean(−ℓ); the drift over the steps (``drift``: the least-squares slope of k3_step against the step with its 95 %
t interval, and the last quarter's mean over the first's); and the verdict (``admit``): admitted when at least the
required number of steps (20) were measured and every step is finite and below the threshold. The rule itself
does not fix the learning rate; a check at learning rate 0 (the weights never move) measures the numerics alone,
with no policy lag, which is how the lab runs it.

A growing mismatch at learning rate 0 is the failure a short check can miss (open-instruct 1473: OLMo-3-7B's drift
kept growing with the weights frozen), so the verdict states the drift beside the threshold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import torch
from scipy import stats

from .reading import CallBatch
from .statistics import token_table

PRIME_RL_THRESHOLD = 0.015  # prime-rl docs/development.md, "Requirements for merging a new model"
PRIME_RL_STEPS = 20
MIN_DRIFT_STEPS = 3  # a slope and its interval need at least three points


@dataclass(frozen=True)
class StepMismatch:
    step: int
    sequences: int
    tokens: int  # usable trained tokens (finite on both sides)
    nonfinite_tokens: int  # trained tokens with a NaN/inf/fill log-prob on either side, left out of every mean
    k3: float | None  # token-weighted mean of e^ℓ − 1 − ℓ (prime-rl's mismatch_kl/all/mean); None without tokens
    k3_sequence_mean: float | None  # mean over sequences of each one's token mean (miles' sum_of_sample_mean)
    kl: float | None  # token-weighted mean of −ℓ = log π_engine − log π_train (k1)
    max_abs_log_ratio: float | None


def step_mismatch(step: int, batches: Iterable[CallBatch]) -> StepMismatch:
    """The mismatch of one step's batches: every trained token of every sequence, pooled (the analyzer's
    ``token_table``, so a usable token and its k3 term are the statistics' own)."""
    sequences = tokens = nonfinite = counted = 0
    k3_sum = k1_sum = sequence_means = max_abs = 0.0
    for batch in batches:
        sequences += len(batch.calls)
        if not batch.calls:
            continue
        table = token_table(batch)
        usable = table["usable"]
        per_sequence = torch.zeros(len(batch.calls), dtype=torch.float64)
        k3_per_sequence = per_sequence.index_add(0, table["seq"], table["k3"])
        usable_per_sequence = per_sequence.index_add(0, table["seq"], usable.double())
        held = usable_per_sequence > 0
        tokens += int(usable.sum())
        nonfinite += int((table["valid"] & ~usable).sum())
        k3_sum += float(table["k3"].sum())
        k1_sum += float(-table["ell"].sum())  # ℓ is 0 on tokens that are not usable
        sequence_means += float((k3_per_sequence[held] / usable_per_sequence[held]).sum())
        counted += int(held.sum())
        if usable.any():
            max_abs = max(max_abs, float(table["ell"][usable].abs().max()))
    return StepMismatch(step, sequences, tokens, nonfinite, k3_sum / tokens if tokens else None,
                        sequence_means / counted if counted else None, k1_sum / tokens if tokens else None,
                        max_abs if tokens else None)


@dataclass(frozen=True)
class Drift:
    slope: float  # k3 per step, least squares
    slope_low: float  # its 95 % t interval (n − 2 degrees of freedom)
    slope_high: float
    first_quarter_k3: float  # mean k3 of the first ⌈n/4⌉ steps
    last_quarter_k3: float
    growing: bool  # the interval lies above 0


def drift(k3_by_step: Sequence[tuple[int, float]]) -> Drift | None:
    """The trend of k3 over the steps; None with fewer than MIN_DRIFT_STEPS steps or when every step is the same
    step number.

    slope = Σ (s − s̄)(k − k̄) / Σ (s − s̄)²,  se = sqrt(Σ residual² / (n − 2) / Σ (s − s̄)²),
    interval = slope ± t_{0.975, n−2} · se."""
    if len(k3_by_step) < MIN_DRIFT_STEPS:
        return None
    steps = torch.tensor([float(s) for s, _ in k3_by_step], dtype=torch.float64)
    k3 = torch.tensor([float(k) for _, k in k3_by_step], dtype=torch.float64)
    spread = float(((steps - steps.mean()) ** 2).sum())
    if spread == 0:
        return None
    slope = float(((steps - steps.mean()) * (k3 - k3.mean())).sum()) / spread
    residuals = k3 - (k3.mean() + slope * (steps - steps.mean()))
    n = len(k3_by_step)
    standard_error = math.sqrt(float((residuals ** 2).sum()) / (n - 2) / spread)
    half = float(stats.t.ppf(0.975, n - 2)) * standard_error
    quarter = max(1, math.ceil(n / 4))
    order = torch.argsort(steps)
    return Drift(slope, slope - half, slope + half, float(k3[order[:quarter]].mean()),
                 float(k3[order[-quarter:]].mean()), slope - half > 0)


@dataclass(frozen=True)
class Admission:
    threshold: float
    required_steps: int
    steps: list[StepMismatch]
    above: list[int]  # the steps at or above the threshold
    empty: list[int]  # the steps without a usable token (no verdict on them)
    nonfinite: list[int]  # the steps with a NaN/inf log-prob on a trained token (prime-rl's mean would be NaN)
    drift: Drift | None
    admitted: bool  # at least required_steps steps, every one measured, finite and below the threshold

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "required_steps": self.required_steps, "admitted": self.admitted,
                "above": self.above, "empty": self.empty, "nonfinite": self.nonfinite,
                "drift": None if self.drift is None else asdict(self.drift),
                "steps": [asdict(step) for step in self.steps]}


def admit(steps: Sequence[StepMismatch], threshold: float = PRIME_RL_THRESHOLD,
          required_steps: int = PRIME_RL_STEPS) -> Admission:
    """Admitted when there are at least ``required_steps`` steps and every one has usable tokens, no NaN/inf log-prob
    on a trained token (prime-rl's token mean would be NaN there, which fails its bar) and k3 < threshold."""
    if isinstance(threshold, bool) or not (isinstance(threshold, (int, float)) and 0 < threshold < math.inf):
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    if isinstance(required_steps, bool) or not isinstance(required_steps, int) or required_steps < 1:
        raise ValueError(f"required steps must be an integer >= 1, got {required_steps!r}")
    if not steps:
        raise ValueError("no step to judge: the dumps hold no call")
    above = [s.step for s in steps if s.k3 is not None and s.k3 >= threshold]
    empty = [s.step for s in steps if s.k3 is None]
    nonfinite = [s.step for s in steps if s.nonfinite_tokens]
    measured = [(s.step, s.k3) for s in steps if s.k3 is not None]
    admitted = not above and not empty and not nonfinite and len(steps) >= required_steps
    return Admission(float(threshold), required_steps, list(steps), above, empty, nonfinite, drift(measured),
                     admitted)


def steps_of_calls(call_steps: Mapping[int, int]) -> dict[int, list[int]]:
    """step -> its calls, in call order."""
    out: dict[int, list[int]] = {}
    for call in sorted(call_steps):
        out.setdefault(call_steps[call], []).append(call)
    return out
