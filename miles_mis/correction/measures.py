"""What finalize measures from the combined per-sequence table and the batch-sum vector: the per-sequence mismatch
metrics, where the mismatch lives and the batch gate's statistics, and the metrics by lag bucket."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import gate, mismatch_location, staleness, truncated_sampling
from ..config import MisConfig
from ..tensors.ops import LOG_RATIO_CLAMP
from ..tensors.packed_batch import PackedBatch
from .batch_values import HISTOGRAM_START
from .stage_values import SeqWeights

Reduce = Callable[[Tensor], Tensor]  # a reduction over the DP group (the identity for a micro-batch scope)


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / denominator.clamp(min=1.0)


def clamped_exp(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def mismatch_seq_metrics(col: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-sequence mismatch metrics [B] from the combined table's columns, over the usable tokens of each
    sequence (the means in one division, the exponentials in one exp: ops per call, not per sequence)."""
    means = torch.stack([col["sum_train_log_prob"], col["sum_log_ratio"], col["sum_k3"], col["sum_chi2"]])
    mean_train, mean_log_ratio, k3_kl, chi2_token = safe_divide(means, col["n_usable"]).unbind(0)
    mean_rollout = mean_train - mean_log_ratio
    log_ppl_diff = -mean_log_ratio  # = mean log π_rollout − mean log π_train
    training_log_ppl, rollout_log_ppl = -mean_train, -mean_rollout
    training_ppl, rollout_ppl, ppl_ratio = clamped_exp(
        torch.stack([training_log_ppl, rollout_log_ppl, log_ppl_diff])).unbind(0)
    return {
        "training_log_ppl": training_log_ppl,
        "training_ppl": training_ppl,
        "rollout_log_ppl": rollout_log_ppl,
        "rollout_ppl": rollout_ppl,
        "kl": log_ppl_diff,
        "k3_kl": k3_kl,
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": log_ppl_diff.abs(),
        "ppl_ratio": ppl_ratio,
        "chi2_token": chi2_token,  # Σ(ρ² − 1)/n: 0 when n = 0
        "chi2_seq": torch.expm1(2.0 * col["sum_log_ratio"].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
    }


def level_log_ratio(col: dict[str, Tensor], level: str) -> Tensor:
    """Per-sequence log ratio [B] of a sequence level: Σ_t ℓ_t (sequence) or mean_t ℓ_t (geometric)."""
    total = col["sum_log_ratio"]
    if level == "sequence":
        return total
    if level == "geometric":
        return safe_divide(total, col["n_usable"])
    raise ValueError(f"level={level!r} has no per-sequence ratio: allowed values are sequence, geometric")


def measure_batch(batch: PackedBatch, col: dict[str, Tensor], batch_values: Tensor,
                  gate_reduce: Reduce) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Where the mismatch lives (``mismatch_location.metrics``, ``truncated_sampling.metrics``) and the batch gate's
    statistics, every call (batch metrics, gate statistics):

    k3 = Σ_t k3_t / n,   kl = Σ_t (−ℓ_t) / n,   max_abs_log_ratio = max_t |ℓ_t|

    over the usable tokens of the micro-batch (n of them; with ``rs_batch_gate_scope: dp``, of the DP group too).
    """
    metrics = mismatch_location.metrics(batch_values)
    metrics.update(truncated_sampling.metrics(batch_values[len(mismatch_location.NAMES):HISTOGRAM_START],
                                              batch.mask_sizes is not None))
    gate_parts = gate_reduce(gate.parts(col["sum_k3"].sum(), col["sum_log_ratio"].sum(), col["n_usable"].sum(),
                                        batch_values[mismatch_location.INDEX["max_abs_log_ratio"]]))
    statistics = gate.statistics(gate_parts)
    metrics.update({f"batch_{name}": value for name, value in statistics.items()})
    return metrics, statistics


def measure_by_lag(batch: PackedBatch, col: dict[str, Tensor], config: MisConfig | None = None,
                   seq_keep: Tensor | None = None, n_pass: Tensor | None = None,
                   seq: SeqWeights | None = None) -> tuple[tuple[str, ...], Tensor] | None:
    """With lags: the metrics by lag bucket (``staleness.bucket_metrics``, as (names, values)); the weight ones
    (``n_pass`` given: use_tis) from the kept weights before normalisation (the ESS is scale-free):

    token level:         Σw_i = keep_i Σ_t w_t,  n_bounded_i from the table
    sequence/geometric:  Σw_i = n_pass_i w_i,    n_bounded_i = n_valid_i · 1[r_i outside the bound]
    """
    lags = batch.lags
    if lags is None:
        return None
    if n_pass is None:  # metrics-only
        return staleness.bucket_metrics(lags, col["n_valid"], col["n_usable"], col["sum_k3"])
    if seq is None:
        sum_w = torch.where(seq_keep, col["sum_token_weight"], 0.0)
        sum_w_sq = torch.where(seq_keep, col["sum_token_weight_sq"], 0.0)
        n_bounded = col["n_bounded"]
    else:
        sum_w, sum_w_sq = n_pass * seq.weight, n_pass * seq.weight.square()
        outside = seq.ratio > seq.upper
        if config.tis_mode != "truncate":
            outside = outside | (seq.ratio < config.tis_lower_bound)
        n_bounded = col["n_valid"] * outside
    return staleness.bucket_metrics(lags, col["n_valid"], col["n_usable"], col["sum_k3"], n_bounded, n_pass, sum_w,
                                    sum_w_sq)
