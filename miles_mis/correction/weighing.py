"""finalize's weights: the batch statistics of the kept weights, the batch normalisation and the final weights'
statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import MisConfig
from ..tensors import ops
from .measures import Reduce
from .seq_table import EMPTY_MAX_WEIGHT, NO_TOKEN
from .stage_values import Outcome, SeqWeights


NORMALIZE_MIN_MEAN = 1e-8  # batch normalisation is skipped when the mean weight is below this


@dataclass(frozen=True)
class KeptWeights:
    """Batch statistics of the kept weights before normalisation (0-d tensors)."""

    sum: Tensor  # Σ w over the kept tokens
    sum_sq: Tensor  # Σ w² over the kept tokens
    mean_parts: Tensor  # [numerator, denominator] of the normalisation mean μ
    max: Tensor  # largest kept weight, −1 when nothing is kept
    min: Tensor  # smallest kept weight, NO_TOKEN when nothing is kept


def sum_kept_weights(col: dict[str, Tensor], seq_keep: Tensor, n_pass: Tensor, seq: SeqWeights | None) -> KeptWeights:
    """Batch statistics of the kept weights before normalisation, from the per-sequence table:

    token level:         Σw = Σ_i keep_i Σ_t w_t,   Σw² likewise,   μ parts = [Σw, Σ_i n_pass_i]
    sequence/geometric:  Σw = Σ_i n_pass_i w_i,  Σw² = Σ_i n_pass_i w_i²,
                         μ parts = [Σ_{i: n_pass_i > 0} w_i, #{i: n_pass_i > 0}]

    and the largest/smallest kept weight (over the kept sequences' extremes).
    """
    if seq is None:
        sum_w = (col["sum_token_weight"] * seq_keep).sum()
        sum_w_sq = (col["sum_token_weight_sq"] * seq_keep).sum()
        mean_parts = torch.stack([sum_w, n_pass.sum()])  # over kept tokens
        max_w = _batch_extreme(col["max_token_weight"], seq_keep, "amax", EMPTY_MAX_WEIGHT)
        min_w = _batch_extreme(col["min_token_weight"], seq_keep, "amin", NO_TOKEN)
    else:
        trained_seq = n_pass > 0
        sum_w = (n_pass * seq.weight).sum()
        sum_w_sq = (n_pass * seq.weight.square()).sum()
        mean_parts = torch.stack([(seq.weight * trained_seq).sum(), trained_seq.sum()])  # over trained sequences
        max_w = _batch_extreme(seq.weight, trained_seq, "amax", EMPTY_MAX_WEIGHT)
        min_w = _batch_extreme(seq.weight, trained_seq, "amin", NO_TOKEN)
    return KeptWeights(sum_w, sum_w_sq, mean_parts, max_w, min_w)


def normalise(mean_parts: Tensor, config: MisConfig, normalizer_reduce: Reduce) -> Tensor:
    """The batch normalisation's divisor (``tis_batch_normalize``; with ``tis_batch_normalize_scope: dp`` over the
    DP group):

    μ = mean_parts[0] / max(mean_parts[1], 1),   factor = μ if μ > NORMALIZE_MIN_MEAN else 1   (1 when off)
    """
    numerator, denominator = normalizer_reduce(mean_parts).unbind(0)
    mean_w = numerator / denominator.clamp(min=1)
    if config.tis_batch_normalize:
        return torch.where(mean_w > NORMALIZE_MIN_MEAN, mean_w, 1.0)
    return torch.ones_like(mean_w)


def final_weight_statistics(kept: KeptWeights, factor: Tensor, n_valid: Tensor) -> dict[str, Tensor]:
    """Batch statistics of the final weights w̃ = w / factor (0 on every valid token not kept), N valid tokens:

    is_ratio_batch_{min,max}_final = min/max of w̃ over the kept tokens (0 when none)
    ess = (Σ w̃)² / (N Σ w̃²) = (Σw)² / (N Σw²)   (``ops.ess``; 0 when Σw² = 0)
    """
    smallest, largest = torch.where(kept.max >= 0, torch.stack([kept.min, kept.max]) / factor, 0.0).unbind(0)
    return {
        "batch_norm_factor": factor,
        "is_ratio_batch_min_final": smallest,
        "is_ratio_batch_max_final": largest,
        # ≤ 1 by Cauchy–Schwarz; the clamp only absorbs float64 rounding
        "ess": ops.ess(kept.sum, kept.sum_sq, n_valid, 0.0).clamp(max=1.0),
    }


def final_sequence_extremes(col: dict[str, Tensor], seq_keep: Tensor, n_pass: Tensor, seq: SeqWeights | None,
                            factor: Tensor) -> Outcome:
    """miles' per-sequence extremes of the final weight over the sequence's kept tokens K_i:

    is_ratio_{max,min}_final_i = max/min_{t ∈ K_i} w̃_t   (0 when K_i is empty)
    """
    if seq is None:
        has_kept = seq_keep & (col["max_token_weight"] >= 0)
        seq_max, seq_min = col["max_token_weight"], col["min_token_weight"]
    else:
        has_kept, seq_max, seq_min = n_pass > 0, seq.weight, seq.weight
    largest, smallest = torch.where(has_kept, torch.stack([seq_max, seq_min]) / factor, 0.0).unbind(0)
    return Outcome(seq={"is_ratio_max_final": largest, "is_ratio_min_final": smallest})


def _batch_extreme(values: Tensor, selected: Tensor, reduce: str, empty: float) -> Tensor:
    """Max/min of ``values`` over the selected sequences; ``empty`` when none is selected (or B = 0). ``empty`` is
    beyond every value's range (−1 below every weight, NO_TOKEN above), so it never wins against a selected one."""
    if values.numel() == 0:
        return values.new_full((), empty)
    masked = torch.where(selected, values, empty)
    return masked.amax() if reduce == "amax" else masked.amin()
