"""The correction core: pure functions on packed (concatenated) per-sequence tensors.

One call runs four stages, each vectorised over the whole batch (no Python loop over sequences,
so the number of tensor operations does not grow with the batch size):

1. ``token_terms``      per-token quantities of this rank's tokens (log ratio, token-level decisions);
2. ``local_seq_stats``  per-sequence sums/maxima of those quantities, one [B, K] table;
3. (the caller combines the tables of the context-parallel ranks: see ``miles_mis.distributed``);
4. ``finalize``         sequence-level decisions, weights, normalisation and metrics, from the
                        combined table plus this rank's own tokens.

Every formula is written once here and once in docs/math.md. Notation: ℓ_t = log π_train − log π_rollout
on a valid token, ρ = exp(clamp(ℓ, ±20)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import MisConfig

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps every weight and sum of weights finite in float32
NORMALIZE_MIN_MEAN = 1e-8  # batch normalisation is skipped when the mean weight is below this


@dataclass(frozen=True)
class PackedBatch:
    """This rank's response tokens of B sequences, concatenated in batch order.

    seq_lengths[i] tokens of sequence i are contiguous; ``loss_mask`` is the local part of the full
    loss masks (True = trained token).
    """

    train_log_probs: Tensor  # [N] float32
    rollout_log_probs: Tensor  # [N] float32
    loss_mask: Tensor  # [N] bool
    seq_lengths: Tensor  # [B] int64, local tokens per sequence
    seq_index: Tensor  # [N] int64, sequence of each token
    segment_matrix: Tensor  # [B, N] sparse CSR of ones: segment_matrix @ x = per-sequence sums of x

    @property
    def num_seqs(self) -> int:
        return self.seq_lengths.numel()

    @classmethod
    def from_flat(cls, train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
                  seq_lengths: Tensor) -> "PackedBatch":
        device = train_log_probs.device
        num_tokens = train_log_probs.numel()
        seq_lengths = seq_lengths.to(device=device, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(seq_lengths.numel(), device=device), seq_lengths,
                                            output_size=num_tokens)
        # A CSR row per sequence: one sparse matmul sums all statistic columns of every sequence at once,
        # several times faster on CPU than segment_reduce, index_add_ or a float64 cumsum.
        row_offsets = torch.zeros(seq_lengths.numel() + 1, dtype=torch.long, device=device)
        torch.cumsum(seq_lengths, 0, out=row_offsets[1:])
        segment_matrix = torch.sparse_csr_tensor(
            row_offsets, torch.arange(num_tokens, device=device), torch.ones(num_tokens, device=device),
            size=(seq_lengths.numel(), num_tokens), check_invariants=False)
        return cls(train_log_probs.float(), rollout_log_probs.float(), loss_mask.bool(), seq_lengths, seq_index,
                   segment_matrix)

    def per_seq_sum(self, values: Tensor) -> Tensor:
        """[N] -> [B] sums over each sequence's tokens."""
        if values.numel() == 0:
            return values.new_zeros(self.num_seqs)
        return self.segment_matrix @ values

    def per_seq_max(self, values: Tensor) -> Tensor:
        """[N] -> [B] maximum over each sequence's tokens (−inf for a sequence with no token)."""
        out = values.new_full((self.num_seqs,), float("-inf"))
        return out.scatter_reduce_(0, self.seq_index, values, "amax")

    def broadcast(self, table: Tensor) -> Tensor:
        """[B, M] per-sequence values -> [N, M], each token getting its sequence's row."""
        return table.repeat_interleave(self.seq_lengths, dim=0, output_size=self.seq_index.numel())


# --------------------------------------------------------------------------- bounding (one place)
def bound_weights(ratio: Tensor, mode: str, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    """Apply an IS mode to ratios ρ (per token or per sequence). Returns (weight, rejected).

    truncate: w = min(ρ, U)                     rejected = ∅
    clip:     w = clamp(ρ, L, U)                rejected = ∅
    mask:     w = ρ                             rejected = {ρ ∉ [L, U]}
    icepop:   w = ρ·1[L ≤ ρ ≤ U]                rejected = ∅ (the mask is unchanged)
    """
    outside = (ratio < lower) | (ratio > upper)
    if mode == "truncate":
        return ratio.clamp(max=upper), torch.zeros_like(outside)
    if mode == "clip":
        return ratio.clamp(lower, upper), torch.zeros_like(outside)
    if mode == "mask":
        return ratio, outside
    if mode == "icepop":
        return torch.where(outside, torch.zeros_like(ratio), ratio), torch.zeros_like(outside)
    raise ValueError(f"tis_mode={mode!r} is invalid: allowed values are truncate, clip, mask, icepop")


def bound_fraction_metrics(prefix: str, mode: str, ratio: Tensor, lower: float, upper: float) -> dict[str, Tensor]:
    """Indicator metrics of a bounding stage: ``{prefix}truncate_fraction`` for truncate (ρ > U),
    ``{prefix}{mode}_fraction_low`` (ρ < L) and ``_high`` (ρ > U) for the other modes."""
    high = (ratio > upper).float()
    if mode == "truncate":
        return {f"{prefix}truncate_fraction": high}
    return {f"{prefix}{mode}_fraction_low": (ratio < lower).float(), f"{prefix}{mode}_fraction_high": high}


# --------------------------------------------------------------------------- stage 1: tokens
@dataclass(frozen=True)
class TokenTerms:
    valid: Tensor  # [N] bool: loss_mask
    usable: Tensor  # [N] bool: valid and both log-probs finite
    nonfinite: Tensor  # [N] bool: valid and a log-prob is NaN/±inf
    train_log_probs: Tensor  # [N] 0 where not usable
    log_ratio: Tensor  # [N] ℓ_t, 0 where not usable
    token_ratio: Tensor  # [N] ρ_t = exp(clamp(ℓ_t))
    catastrophic: Tensor  # [N] bool: usable and ρ_t < veto threshold
    token_pass: Tensor  # [N] bool: usable and not rejected by a token-level stage
    token_weight: Tensor  # [N] token-level TIS weight (only meaningful when tis_level == "token")


def token_terms(batch: PackedBatch, config: MisConfig) -> TokenTerms:
    valid = batch.loss_mask
    finite = torch.isfinite(batch.train_log_probs) & torch.isfinite(batch.rollout_log_probs)
    usable = valid & finite
    zero = torch.zeros((), device=valid.device)
    train = torch.where(usable, batch.train_log_probs, zero)
    log_ratio = torch.where(usable, batch.train_log_probs - batch.rollout_log_probs, zero)
    token_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()

    if config.rs_veto_threshold is not None:
        # compare the raw ℓ_t, not the clamped ratio: a threshold below e^-20 must still fire
        catastrophic = usable & (log_ratio < math.log(config.rs_veto_threshold))
    else:
        catastrophic = torch.zeros_like(usable)

    token_pass = usable
    token_weight = token_ratio
    if config.tis_level == "token":
        token_weight, rejected = bound_weights(token_ratio, config.tis_mode, config.tis_lower_bound,
                                               config.tis_upper_bound)
        token_pass = token_pass & ~rejected
    if config.use_rs and config.rs_level == "token":
        token_pass = token_pass & (token_ratio >= config.rs_lower_bound) & (token_ratio <= config.rs_upper_bound)
    return TokenTerms(valid, usable, valid & ~finite, train, log_ratio, token_ratio, catastrophic,
                      token_pass, token_weight)


# --------------------------------------------------------------------------- stage 2: per-sequence table
# Columns of the per-sequence table. SUM columns are added across CP ranks, MAX columns maxed.
SUM_COLUMNS = ("n_valid", "n_usable", "sum_train_log_prob", "sum_log_ratio", "sum_k3", "sum_ratio_sq",
               "n_catastrophic", "n_token_pass", "sum_token_weight", "sum_token_weight_sq")
MAX_COLUMNS = ("max_token_weight", "max_neg_token_weight")
COL = {name: i for i, name in enumerate(SUM_COLUMNS + MAX_COLUMNS)}
NUM_SUM_COLUMNS = len(SUM_COLUMNS)


def local_seq_stats(batch: PackedBatch, terms: TokenTerms) -> Tensor:
    """[B, len(SUM_COLUMNS) + len(MAX_COLUMNS)] float32 table of this rank's per-sequence statistics.

    k3_t = exp(clamp(ℓ_t)) − ℓ_t − 1 (exact for ℓ_t ≤ 20, finite beyond); max columns are −inf for a
    sequence with no passing token here.
    """
    weight = torch.where(terms.token_pass, terms.token_weight, 0.0)
    # Derived, not summed: n_nonfinite = n_valid − n_usable, Σ log π_rollout = Σ log π_train − Σ ℓ.
    # ℓ = 0 (so ρ = 1 and k3 = 0) on tokens that are not usable.
    values = {
        "n_valid": terms.valid, "n_usable": terms.usable,
        "sum_train_log_prob": terms.train_log_probs, "sum_log_ratio": terms.log_ratio,
        "sum_k3": terms.token_ratio - terms.log_ratio - 1.0,
        "sum_ratio_sq": torch.where(terms.usable, terms.token_ratio.square(), 0.0),
        "n_catastrophic": terms.catastrophic, "n_token_pass": terms.token_pass,
        "sum_token_weight": weight, "sum_token_weight_sq": weight * terms.token_weight,
    }
    # one sparse mat-vec per column: no [N, K] buffer is materialised (memory traffic dominates on CPU)
    sums = torch.stack([batch.per_seq_sum(values[name].float()) for name in SUM_COLUMNS], dim=1)
    maxima = torch.stack([batch.per_seq_max(torch.where(terms.token_pass, terms.token_weight, float("-inf"))),
                          batch.per_seq_max(torch.where(terms.token_pass, -terms.token_weight, float("-inf")))], 1)
    return torch.cat([sums, maxima], dim=1)


def combine_seq_stats(per_rank: Tensor) -> Tensor:
    """Reduce a [C, B, K] stack of per-rank tables (C context-parallel ranks) into one [B, K] table."""
    return torch.cat([per_rank[..., :NUM_SUM_COLUMNS].sum(0), per_rank[..., NUM_SUM_COLUMNS:].amax(0)], dim=1)


# --------------------------------------------------------------------------- stage 4: decisions, weights, metrics
@dataclass(frozen=True)
class Correction:
    weights: Tensor | None  # [N] final detached weights of the local tokens, 0 where rejected; None = metrics-only
    token_keep: Tensor  # [N] bool: local token stays in the mask
    seq_keep: Tensor  # [B] bool: sequence not rejected by a sequence-level stage
    metrics: dict[str, Tensor]  # name (with mis_ prefix) -> [N] float32, aligned with the local tokens


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / denominator.clamp(min=1.0)


def mismatch_seq_metrics(stats: Tensor) -> dict[str, Tensor]:
    """Per-sequence mismatch metrics [B] from the combined table, over the usable tokens of each sequence."""
    n_usable = stats[:, COL["n_usable"]]
    mean_train = _safe_divide(stats[:, COL["sum_train_log_prob"]], n_usable)
    mean_rollout = mean_train - _safe_divide(stats[:, COL["sum_log_ratio"]], n_usable)
    log_ppl_diff = -_safe_divide(stats[:, COL["sum_log_ratio"]], n_usable)  # = mean_rollout − mean_train
    sum_log_ratio = stats[:, COL["sum_log_ratio"]].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    clamped_exp = lambda x: x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # noqa: E731
    return {
        "training_log_ppl": -mean_train,
        "training_ppl": clamped_exp(-mean_train),
        "rollout_log_ppl": -mean_rollout,
        "rollout_ppl": clamped_exp(-mean_rollout),
        "kl": log_ppl_diff,
        "k3_kl": _safe_divide(stats[:, COL["sum_k3"]], n_usable),
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": log_ppl_diff.abs(),
        "ppl_ratio": clamped_exp(log_ppl_diff),
        "chi2_token": torch.where(n_usable > 0, _safe_divide(stats[:, COL["sum_ratio_sq"]], n_usable) - 1.0,
                                  torch.zeros_like(n_usable)),
        "chi2_seq": (2.0 * sum_log_ratio).exp() - 1.0,
    }


def level_log_ratio(stats: Tensor, level: str) -> Tensor:
    """Per-sequence log ratio [B] of a sequence level: Σ_t ℓ_t (sequence) or mean_t ℓ_t (geometric)."""
    total = stats[:, COL["sum_log_ratio"]]
    if level == "sequence":
        return total
    if level == "geometric":
        return _safe_divide(total, stats[:, COL["n_usable"]])
    raise ValueError(f"level={level!r} has no per-sequence ratio: allowed values are sequence, geometric")


def finalize(batch: PackedBatch, terms: TokenTerms, stats: Tensor, config: MisConfig) -> Correction:
    """Sequence-level decisions, final weights and all metrics for this rank's tokens.

    ``stats`` is the per-sequence table combined over the context-parallel group, so every rank
    takes the same sequence-level decisions and the same batch-level normalisation. Everything
    per-sequence or per-batch is gathered in one [B, M] table and broadcast to the tokens once.
    """
    seq_values = mismatch_seq_metrics(stats)
    token_metrics: dict[str, Tensor] = {"nonfinite_token_fraction": terms.nonfinite.float()}
    if not config.use_tis:
        per_token = _broadcast(batch, seq_values)
        return Correction(None, terms.valid.clone(), torch.ones_like(stats[:, 0], dtype=torch.bool),
                          _metrics(token_metrics, per_token))

    no_seq = torch.zeros_like(stats[:, 0], dtype=torch.bool)
    # -- importance weights before/after bounding, at tis_level
    if config.tis_level == "token":
        token_metrics["tis_weight_before_bound"] = terms.token_ratio
        token_metrics.update(bound_fraction_metrics("tis_", config.tis_mode, terms.token_ratio,
                                                    config.tis_lower_bound, config.tis_upper_bound))
        token_metrics["tis_weight_after_bound"] = terms.token_weight
        seq_weight, seq_reject = None, no_seq
    else:
        seq_ratio = level_log_ratio(stats, config.tis_level).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        seq_weight, seq_reject = bound_weights(seq_ratio, config.tis_mode, config.tis_lower_bound,
                                               config.tis_upper_bound)
        seq_values["tis_weight_before_bound"] = seq_ratio
        seq_values.update(bound_fraction_metrics("tis_", config.tis_mode, seq_ratio,
                                                 config.tis_lower_bound, config.tis_upper_bound))
        seq_values["tis_weight_after_bound"] = seq_weight

    # -- rejection sampling at rs_level (token level already folded into terms.token_pass)
    if config.use_rs:
        if config.rs_level == "token":
            token_metrics.update(bound_fraction_metrics("rs_", "mask", terms.token_ratio,
                                                        config.rs_lower_bound, config.rs_upper_bound))
        else:
            rs_ratio = level_log_ratio(stats, config.rs_level).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            seq_values.update(bound_fraction_metrics("rs_", "mask", rs_ratio,
                                                     config.rs_lower_bound, config.rs_upper_bound))
            seq_reject = seq_reject | (rs_ratio < config.rs_lower_bound) | (rs_ratio > config.rs_upper_bound)

    # -- veto (applied whenever a threshold is set) and non-finite log-probs: reject the sequence whole
    if config.rs_veto_threshold is not None:
        vetoed = stats[:, COL["n_catastrophic"]] > 0
        token_metrics["rs_catastrophic_token_fraction"] = terms.catastrophic.float()
        seq_values["rs_catastrophic_seq_fraction"] = vetoed.float()
        seq_reject = seq_reject | vetoed
    seq_keep = ~(seq_reject | (stats[:, COL["n_valid"]] > stats[:, COL["n_usable"]]))  # non-finite

    # -- batch statistics of the kept weights (before normalisation), from the per-sequence table
    n_pass = stats[:, COL["n_token_pass"]] * seq_keep
    if seq_weight is None:
        sum_w = (stats[:, COL["sum_token_weight"]] * seq_keep).sum()
        sum_w_sq = (stats[:, COL["sum_token_weight_sq"]] * seq_keep).sum()
        mean_w = sum_w / n_pass.sum().clamp(min=1)  # over kept tokens
        max_w = torch.where(seq_keep, stats[:, COL["max_token_weight"]], float("-inf")).amax()
        min_w = -torch.where(seq_keep, stats[:, COL["max_neg_token_weight"]], float("-inf")).amax()
    else:
        trained_seq = n_pass > 0
        sum_w = (n_pass * seq_weight).sum()
        sum_w_sq = (n_pass * seq_weight.square()).sum()
        mean_w = (seq_weight * trained_seq).sum() / trained_seq.sum().clamp(min=1)  # over trained sequences
        max_w = torch.where(trained_seq, seq_weight, float("-inf")).amax()
        min_w = -torch.where(trained_seq, -seq_weight, float("-inf")).amax()
    if config.tis_batch_normalize:
        factor = torch.where(mean_w > NORMALIZE_MIN_MEAN, mean_w, torch.ones_like(mean_w))
    else:
        factor = torch.ones_like(mean_w)
    any_kept = torch.isfinite(max_w)
    n_valid = stats[:, COL["n_valid"]].sum()
    batch_values = {
        "batch_norm_factor": factor,
        "is_ratio_min_final": torch.where(any_kept, min_w / factor, torch.zeros_like(factor)),
        "is_ratio_max_final": torch.where(any_kept, max_w / factor, torch.zeros_like(factor)),
        "ess": torch.where(sum_w_sq > 0, sum_w.square() / (n_valid * sum_w_sq).clamp(min=1e-30),
                           torch.zeros_like(sum_w)),
    }

    # -- one broadcast to the tokens, then the token-level weights
    seq_values[_KEEP] = seq_keep.float()
    if seq_weight is not None:
        seq_values[_WEIGHT] = seq_weight
    per_token = _broadcast(batch, seq_values)
    token_keep = terms.token_pass & (per_token.pop(_KEEP) > 0)
    weight = terms.token_weight if seq_weight is None else per_token.pop(_WEIGHT)
    weight = torch.where(token_keep, weight, 0.0)
    token_metrics["is_ratio_mean_after_tis_rs"] = weight
    weight = (weight / factor).detach()
    token_metrics["is_ratio_mean_final"] = weight
    # batch-level values: a fill per metric, cheaper than gathering them with the per-sequence table
    num_tokens = weight.numel()
    token_metrics.update({name: value.expand(num_tokens).contiguous() for name, value in batch_values.items()})
    return Correction(weight, token_keep, seq_keep, _metrics(token_metrics, per_token))


_KEEP, _WEIGHT = "_seq_keep", "_seq_weight"  # internal columns of the broadcast table


def _broadcast(batch: PackedBatch, seq_values: dict[str, Tensor]) -> dict[str, Tensor]:
    table = torch.stack([v.float() for v in seq_values.values()], dim=1)
    return dict(zip(seq_values, batch.broadcast(table).unbind(1)))


def _metrics(token_metrics: dict[str, Tensor], seq_metrics_per_token: dict[str, Tensor]) -> dict[str, Tensor]:
    """All metrics, ``mis_``-prefixed, detached float32 [N] tensors, sorted by name."""
    out = {f"mis_{name}": value.float().detach() for name, value in token_metrics.items()}
    out.update({f"mis_{name}": value.detach() for name, value in seq_metrics_per_token.items()})
    return dict(sorted(out.items()))
