"""Truncated sampling, seen from the log ratios: a live detector of an unreplayed sampling mask, and the kept-set
sizes a host passes (miles_mis.inputs.sampling_mask).

When the engine samples with top-p/top-k/min-p and returns log-probs renormalised over the kept set S_t
(``processed`` log-probs), but the trainer's log-probs are over the whole vocabulary, every log ratio is shifted by
the log of the kept mass:

    ℓ_t = log π_train(y_t) − log π_rollout(y_t) + log Z_t,   Z_t = π_rollout(S_t) ≤ 1

so almost every token has ℓ_t < 0, and the mean of ℓ is far below 0 relative to its spread. Numerical mismatch
alone (bf16, fp8) makes ℓ symmetric around a mean of −KL, which is small against its spread (√(2·KL)). Over the
usable tokens of the micro-batch (n of them, m with ℓ_t ≠ 0):

    mis_log_ratio_negative_fraction   = #{ℓ_t < 0} / m
    mis_log_ratio_standardized_mean   = mean(ℓ) / std(ℓ)              (0 when std is 0)
    mis_log_ratio_mean                = mean(ℓ)
    mis_unreplayed_truncation         = 1[negative fraction ≥ NEGATIVE_FRACTION and
                                          standardized mean ≤ −STANDARDIZED_MEAN and
                                          mean(ℓ) ≤ −MEAN_SHIFT and m ≥ MIN_TOKENS]

The shift's size is part of the rule: an fp32 engine can be biased by ~10⁻⁵ per token, consistently enough for the
first two tests, but far below a kept mass that matters (top-p 0.9 shifts by ~10⁻²).

With the host's kept-set sizes s_t (0 = not recorded), over the usable tokens with s_t ≥ 1 (k of them):

    mis_sampling_mask_size_mean = Σ s_t / k   mis_sampling_mask_size_min = min s_t
    mis_sampling_mask_singleton_fraction = #{s_t = 1} / k   mis_sampling_mask_unrecorded_fraction = #{s_t = 0} / n

All are ratios of sums (and one minimum), so every CP rank's partial sums travel in the agreement header with the
rest of the batch vector (``combine``): CP-exact, no extra collective. Batch-level metrics (0 with no token).
The thresholds are measured on SmolLM2-135M (docs/lab/truncation.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

# untruncated SmolLM2 engines: 0.47-0.55 negative (fp32: 0.94, but a 1e-5 shift); top-k 50: 0.77
NEGATIVE_FRACTION = 0.7
STANDARDIZED_MEAN = 0.3  # untruncated engines: |mean/std| < 0.1
MEAN_SHIFT = 1e-3  # a mean log ratio above −0.001 (a kept mass above 0.999) is too small to matter
MIN_TOKENS = 64  # below this many nonzero ℓ the fractions are too noisy to raise an alarm

SUM_NAMES = ("negative_n", "nonzero_n", "usable_n", "sum_log_ratio", "sum_sq_log_ratio",
             "mask_n", "mask_size_sum", "mask_singleton_n", "mask_unrecorded_n")
MAX_NAMES = ("mask_negative_min_size",)  # max of −s_t: the smallest size, as a maximum
NAMES = SUM_NAMES + MAX_NAMES
INDEX = {name: i for i, name in enumerate(NAMES)}
_EMPTY = -3.0e38  # the maximum of no recorded size


def local_values(log_ratio: Tensor, usable: Tensor, mask_sizes: Tensor | None) -> Tensor:
    """This rank's float64 vector [len(NAMES)] of sums over its tokens (``log_ratio`` is 0 where not usable);
    the mask part is 0 (and the minimum empty) without sizes."""
    ell, usable = log_ratio.double(), usable.double()
    negative = torch.lt(ell, 0.0, out=torch.empty_like(ell))
    nonzero = torch.ne(ell, 0.0, out=torch.empty_like(ell))
    ratio_sums = torch.stack([negative.sum(), nonzero.sum(), usable.sum(), ell.sum(), torch.dot(ell, ell)])
    if mask_sizes is None:
        mask_part = ell.new_tensor((0.0, 0.0, 0.0, 0.0, _EMPTY))
    else:
        recorded = torch.gt(mask_sizes, 0.0, out=torch.empty_like(ell)).mul_(usable)
        singleton = torch.eq(mask_sizes, 1.0, out=torch.empty_like(ell)).mul_(usable)
        smallest = torch.where(recorded > 0, mask_sizes, float("inf"))
        lowest = smallest.min() if smallest.numel() else smallest.new_full((), float("inf"))
        mask_part = torch.stack([recorded.sum(), torch.dot(mask_sizes, recorded), singleton.sum(),
                                 usable.sum() - recorded.sum(),
                                 torch.where(torch.isfinite(lowest), -lowest, _EMPTY)])
    return torch.cat([ratio_sums, mask_part])


def combine(per_rank: Tensor) -> Tensor:
    """[C, len(NAMES)] -> [len(NAMES)]: sums added, maxima maxed (identical on every CP rank)."""
    return torch.cat([per_rank[:, :len(SUM_NAMES)].sum(0), per_rank[:, len(SUM_NAMES):].amax(0)])


def metrics(values: Tensor, with_sizes: bool) -> dict[str, Tensor]:
    """Batch-level metric values (0-d: float64, the alarm bool; the core casts every batch metric to float32 in one
    op) from the combined vector; the sampling-mask ones ``with_sizes``."""
    v = dict(zip(NAMES, values.unbind(0)))
    usable = v["usable_n"].clamp(min=1.0)
    mean = v["sum_log_ratio"] / usable
    std = (v["sum_sq_log_ratio"] / usable - mean * mean).clamp(min=0.0).sqrt()
    negative_fraction = v["negative_n"] / v["nonzero_n"].clamp(min=1.0)
    standardized = torch.where(std > 0, mean / std.clamp(min=1e-300), 0.0)
    alarm = (negative_fraction >= NEGATIVE_FRACTION) & (standardized <= -STANDARDIZED_MEAN) \
        & (mean <= -MEAN_SHIFT) & (v["nonzero_n"] >= MIN_TOKENS)
    out = {"log_ratio_negative_fraction": negative_fraction, "log_ratio_standardized_mean": standardized,
           "log_ratio_mean": mean, "unreplayed_truncation": alarm}
    if with_sizes:
        recorded = v["mask_n"].clamp(min=1.0)
        out.update({"sampling_mask_size_mean": v["mask_size_sum"] / recorded,
                    "sampling_mask_size_min": torch.where(v["mask_n"] > 0, -v["mask_negative_min_size"], 0.0),
                    "sampling_mask_singleton_fraction": v["mask_singleton_n"] / recorded,
                    "sampling_mask_unrecorded_fraction": v["mask_unrecorded_n"] / usable})
    return out
