"""The correction core: pure functions on packed (concatenated) per-sequence tensors.

One call runs four stages, each vectorised over the whole batch (no Python loop over sequences,
so the number of tensor operations does not grow with the batch size):

1. ``token_terms``      per-token quantities of this rank's tokens (log ratio, token-level decisions);
2. ``local_seq_stats``  per-sequence sums/extrema of those quantities, one [B, K] table;
3. (the caller combines the tables of the context-parallel ranks: see ``miles_mis.distributed``);
4. ``finalize``         sequence-level decisions, weights, normalisation and metrics, from the
                        combined table plus this rank's own tokens.

The packed tensors and their segment operations (sums, extremes, broadcast) are ``miles_mis.segments``.

Every formula is written once here and once in docs/math.md. Notation: ℓ_t = log π_train − log π_rollout
on a valid token, ρ = exp(clamp(ℓ, ±20)).

Masks and indicators are float 0/1 tensors, combined by multiplication: on CPU, bool tensors,
bool→float conversions and ``torch.where`` cost 5–20× a float multiply, and this code runs once
per micro-batch on ~10⁵–10⁶ tokens. Every value multiplied by a mask here is finite.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import adaptive, divergence, gate, location
from .config import MisConfig
from . import ops
from .ops import LOG_PROB_BOUND, LOG_RATIO_CLAMP, indicator
from .segments import PackedBatch

NORMALIZE_MIN_MEAN = 1e-8  # batch normalisation is skipped when the mean weight is below this
_NO_TOKEN = 3.0e38  # min-column value of a sequence without a passing token (weights are ≤ e^20)


# --------------------------------------------------------------------------- bounding (one place)
def bound_weights(ratio: Tensor, mode: str, lower: float, upper: float) -> tuple[Tensor, Tensor | None]:
    """Apply an IS mode to ratios ρ (per token or per sequence). Returns (weight, rejected 0/1 or None when
    the mode rejects nothing).

    truncate: w = min(ρ, U)                     rejected = ∅
    clip:     w = clamp(ρ, L, U)                rejected = ∅
    mask:     w = ρ                             rejected = {ρ ∉ [L, U]}
    icepop:   w = ρ·1[L ≤ ρ ≤ U]                rejected = ∅ (the mask is unchanged)
    """
    if mode == "truncate":
        return ratio.clamp(max=upper), None
    if mode == "clip":
        return ratio.clamp(lower, upper), None
    outside = indicator(torch.lt, ratio, lower).add_(indicator(torch.gt, ratio, upper))  # disjoint: 0/1
    if mode == "mask":
        return ratio, outside
    if mode == "icepop":
        return (1.0 - outside).mul_(ratio), None
    raise ValueError(f"tis_mode={mode!r} is invalid: allowed values are truncate, clip, mask, icepop")


def bound_fraction_metrics(prefix: str, mode: str, ratio: Tensor, lower: float, upper: float) -> dict[str, Tensor]:
    """Indicator metrics of a bounding stage: ``{prefix}truncate_fraction`` for truncate (ρ > U),
    ``{prefix}{mode}_fraction_low`` (ρ < L) and ``_high`` (ρ > U) for the other modes."""
    high = indicator(torch.gt, ratio, upper)
    if mode == "truncate":
        return {f"{prefix}truncate_fraction": high}
    return {f"{prefix}{mode}_fraction_low": indicator(torch.lt, ratio, lower), f"{prefix}{mode}_fraction_high": high}


# --------------------------------------------------------------------------- stage 1: tokens
@dataclass(frozen=True)
class TokenTerms:
    """Per-token quantities [N]; masks are float 0/1."""

    valid: Tensor  # loss_mask != 0
    usable: Tensor  # valid and both log-probs finite and inside (−LOG_PROB_BOUND, LOG_PROB_BOUND)
    train_log_probs: Tensor  # log π_train, 0 where not usable
    log_ratio: Tensor  # ℓ_t, 0 where not usable (so ρ_t = 1 there)
    token_ratio: Tensor  # ρ_t = exp(clamp(ℓ_t))
    k3: Tensor  # float64 ρ_t − ℓ_t − 1 = expm1(clamp(ℓ_t)) − ℓ_t, 0 where not usable (ops.k3)
    chi2: Tensor  # ρ_t² − 1 = expm1(2·clamp(ℓ_t)), 0 where not usable
    catastrophic: Tensor  # usable and ℓ_t < log(veto threshold)
    token_pass: Tensor  # usable and not rejected by a token-level stage
    token_weight: Tensor  # token-level TIS weight (only meaningful when tis_level == "token")
    estimators: dict  # k1/k2/k3 per token (only with rs_divergence)
    divergence_kept: dict  # token option -> 0/1 kept by that option

    def bounded(self, upper: Tensor) -> "TokenTerms":
        """These terms with the token weights truncated at ``upper`` (the adaptive bound, known only once the
        histogram of every rank's ratios has been combined)."""
        return dataclasses.replace(self, token_weight=self.token_ratio.clamp(max=upper))

    @property
    def nonfinite(self) -> Tensor:  # valid but a log-prob is NaN/±inf or a fill value (|log p| ≥ LOG_PROB_BOUND)
        return self.valid - self.usable


def token_terms(batch: PackedBatch, config: MisConfig) -> TokenTerms:
    valid = indicator(torch.ne, batch.loss_mask, 0)
    diff = batch.train_log_probs - batch.rollout_log_probs
    # usable: both |log p| < bound; NaN propagates through maximum and compares false, so NaN, ±inf and
    # fill values all fail this one test (in-place ops only touch temporaries made on the same line)
    largest = torch.maximum(batch.train_log_probs.abs(), batch.rollout_log_probs.abs())
    usable = indicator(torch.lt, largest, LOG_PROB_BOUND).mul_(valid)
    # where not usable the values are garbage (NaN·0 = NaN): zero them, so no metric sees their value
    log_ratio = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0).mul_(usable)
    train = torch.nan_to_num(batch.train_log_probs, nan=0.0, posinf=0.0, neginf=0.0).mul_(usable)
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_ratio = clamped.exp()
    # both 0 where not usable (ℓ = 0); expm1, not e^ℓ − 1: no cancellation when the engines nearly agree
    k3 = ops.k3(clamped, log_ratio)
    chi2 = torch.expm1(clamped.mul_(2.0))

    if config.rs_veto_threshold is not None:
        # compare the raw ℓ_t, not the clamped ratio: a threshold below e^-20 must still fire
        catastrophic = indicator(torch.lt, log_ratio, math.log(config.rs_veto_threshold)).mul_(usable)
    else:
        catastrophic = torch.zeros_like(usable)

    token_pass = usable
    token_weight = token_ratio
    if config.tis_level == "token" and not config.adaptive_bound:  # adaptive: bounded later (TokenTerms.bounded)
        token_weight, rejected = bound_weights(token_ratio, config.tis_mode, config.tis_lower_bound,
                                               config.tis_upper_bound)
        if rejected is not None:  # mask mode (the others reject nothing)
            token_pass = token_pass * (1.0 - rejected)
    if config.use_rs and config.rs_level == "token":
        token_pass = (indicator(torch.ge, token_ratio, config.rs_lower_bound)
                      .mul_(indicator(torch.le, token_ratio, config.rs_upper_bound)).mul_(token_pass))
    estimators, kept = {}, {}
    if config.rs_divergence:
        estimators = divergence.token_estimators(log_ratio)
        kept = divergence.token_decisions(config.rs_divergence, estimators)
        for keep in kept.values():
            token_pass = token_pass * keep
    return TokenTerms(valid, usable, train, log_ratio, token_ratio, k3, chi2, catastrophic, token_pass,
                      token_weight, estimators, kept)


def rejects_tokens(config: MisConfig) -> bool:
    """The correction can reject single tokens (not only whole sequences): token-level mask mode, token-level
    RS, or a token divergence option. Only then do CP ranks exchange their token rejections."""
    return config.use_tis and ((config.tis_level == "token" and config.tis_mode == "mask")
                               or (config.use_rs and config.rs_level == "token")
                               or any(option.startswith("token_") for option, _, _ in config.rs_divergence))


def token_rejections(terms: TokenTerms) -> Tensor:
    """[N] float 0/1: usable tokens removed by a token-level stage (the rest of token_pass is ``usable``)."""
    return terms.usable - terms.token_pass


# --------------------------------------------------------------------------- stage 2: per-sequence table
# Columns of the per-sequence table; across CP ranks SUM columns are added, MAX maxed, MIN minned.
SUM_COLUMNS = ("n_valid", "n_usable", "sum_train_log_prob", "sum_log_ratio", "sum_k3", "sum_chi2",
               "n_catastrophic", "n_token_pass", "sum_token_weight", "sum_token_weight_sq")
MAX_COLUMNS = ("max_token_weight",)
MIN_COLUMNS = ("min_token_weight",)
COL = {name: i for i, name in enumerate(SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS)}
NUM_SUM_COLUMNS = len(SUM_COLUMNS)
NUM_COLUMNS = len(COL)


def num_columns(config: MisConfig) -> int:
    """Width of the per-sequence table: the base columns plus what the divergence options need."""
    return NUM_COLUMNS + divergence.Layout.of(config.rs_divergence).width


def local_seq_stats(batch: PackedBatch, terms: TokenTerms, config: MisConfig | None = None) -> Tensor:
    """[B, num_columns(config)] float64 table of this rank's per-sequence statistics (sums accumulated in
    float64, PackedBatch.per_seq_sum).

    k3_t = exp(clamp(ℓ_t)) − ℓ_t − 1 (exact for ℓ_t ≤ 20, finite beyond), χ²_t = ρ_t² − 1. The extreme
    columns are over passing tokens: −1 (max) and 3e38 (min) for a sequence without one here (weights are in
    [0, e^20]).
    Derived, not summed: n_nonfinite = n_valid − n_usable, Σ log π_rollout = Σ log π_train − Σ ℓ.
    """
    weight = terms.token_weight * terms.token_pass
    values = {
        "n_valid": terms.valid, "n_usable": terms.usable,
        "sum_train_log_prob": terms.train_log_probs, "sum_log_ratio": terms.log_ratio,
        "sum_k3": terms.k3,
        "sum_chi2": terms.chi2,
        "n_catastrophic": terms.catastrophic, "n_token_pass": terms.token_pass,
        "sum_token_weight": weight, "sum_token_weight_sq": weight * terms.token_weight,
    }
    # one sparse mat-vec per column: no [N, K] buffer is materialised (memory traffic dominates on CPU)
    columns = [batch.per_seq_sum(values[name]) for name in SUM_COLUMNS]
    not_passing = 1.0 - terms.token_pass
    columns.append(batch.per_seq_extreme(weight - not_passing, "amax", -1.0).double())
    columns.append(batch.per_seq_extreme(not_passing.mul_(_NO_TOKEN).add_(weight), "amin", _NO_TOKEN).double())
    table = torch.stack(columns, dim=1)
    if config is not None and config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        extra = divergence.local_columns(layout, terms.usable, terms.estimators, terms.divergence_kept,
                                         batch.per_seq_sum,
                                         lambda v: batch.per_seq_extreme(v, "amax", divergence.NO_VALUE).double())
        table = torch.cat([table, extra], dim=1)
    return table


def combine_seq_stats(per_rank: Tensor, config: MisConfig | None = None) -> Tensor:
    """Reduce a [C, B, K] stack of per-rank tables (C context-parallel ranks) into one [B, K] table."""
    sums = per_rank[..., :NUM_SUM_COLUMNS].sum(0)
    maxima = per_rank[..., NUM_SUM_COLUMNS:NUM_SUM_COLUMNS + len(MAX_COLUMNS)].amax(0)
    minima = per_rank[..., NUM_SUM_COLUMNS + len(MAX_COLUMNS):NUM_COLUMNS].amin(0)
    parts = [sums, maxima, minima]
    if config is not None and config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        extra = per_rank[..., NUM_COLUMNS:]
        parts += [extra[..., :len(layout.sum_names)].sum(0), extra[..., len(layout.sum_names):].amax(0)]
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------- stage 4: decisions, weights, metrics
@dataclass(frozen=True)
class Correction:
    weights: Tensor | None  # [N] final detached weights of the local tokens, 0 where rejected; None = metrics-only
    token_keep: Tensor  # [N] float 0/1: local token stays in the mask
    seq_keep: Tensor  # [B] bool: sequence not rejected by a sequence-level stage
    metrics: dict[str, Tensor]  # name (with mis_ prefix) -> [N] float32, aligned with the local tokens
    message: str | None = None  # a warning for the host's log (the batch gate fired), else None


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / denominator.clamp(min=1.0)


def _clamped_exp(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def table_columns(stats: Tensor) -> dict[str, Tensor]:
    """The per-sequence table's base columns by name, in one op (a select per use: ~20 ops)."""
    return dict(zip(COL, stats.unbind(1)))


def mismatch_seq_metrics(col: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-sequence mismatch metrics [B] from the combined table's columns (``table_columns``), over the
    usable tokens of each sequence."""
    n_usable = col["n_usable"]
    mean_train = _safe_divide(col["sum_train_log_prob"], n_usable)
    mean_log_ratio = _safe_divide(col["sum_log_ratio"], n_usable)
    mean_rollout = mean_train - mean_log_ratio
    log_ppl_diff = -mean_log_ratio  # = mean log π_rollout − mean log π_train
    return {
        "training_log_ppl": -mean_train,
        "training_ppl": _clamped_exp(-mean_train),
        "rollout_log_ppl": -mean_rollout,
        "rollout_ppl": _clamped_exp(-mean_rollout),
        "kl": log_ppl_diff,
        "k3_kl": _safe_divide(col["sum_k3"], n_usable),
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": log_ppl_diff.abs(),
        "ppl_ratio": _clamped_exp(log_ppl_diff),
        "chi2_token": _safe_divide(col["sum_chi2"], n_usable),  # Σ(ρ² − 1)/n: 0 when n = 0
        "chi2_seq": torch.expm1(2.0 * col["sum_log_ratio"].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
    }


def level_log_ratio(stats: Tensor, level: str) -> Tensor:
    """Per-sequence log ratio [B] of a sequence level: Σ_t ℓ_t (sequence) or mean_t ℓ_t (geometric)."""
    total = stats[:, COL["sum_log_ratio"]]
    if level == "sequence":
        return total
    if level == "geometric":
        return _safe_divide(total, stats[:, COL["n_usable"]])
    raise ValueError(f"level={level!r} has no per-sequence ratio: allowed values are sequence, geometric")


def adaptive_token_level(config: MisConfig) -> bool:
    """The token weights' bound is chosen per call from every rank's ratios (before the per-sequence table)."""
    return config.use_tis and config.adaptive_bound and config.tis_level == "token"


def local_batch_values(batch: PackedBatch, terms: TokenTerms, config: MisConfig) -> Tensor:
    """This rank's fixed-size float64 vector of batch sums: miles_mis.location.NAMES, then, with an adaptive
    token-level bound, the histogram of the passing tokens' ratios (miles_mis.adaptive). Combined over CP ranks
    with ``combine_batch_values`` (it travels in the agreement header)."""
    values = location.local_values(terms.k3, terms.usable, terms.log_ratio, batch.rollout_log_probs,
                                   config.metrics_low_prob_threshold,
                                   lambda v: batch.per_bucket_sum(v, location.POSITION_EDGES))
    if adaptive_token_level(config):
        edges = adaptive.candidates(config.tis_auto_bounds, terms.token_ratio.device)
        values = torch.cat([values, adaptive.histogram(terms.token_ratio, terms.token_pass, edges)])
    return values


def combine_batch_values(per_rank: Tensor) -> Tensor:
    """[C, M] -> [M]: the location part combined by ``location.combine``, a histogram after it added."""
    size = len(location.NAMES)
    return torch.cat([location.combine(per_rank[:, :size]), per_rank[:, size:].sum(0)])


def bound_token_terms(terms: TokenTerms, batch_values: Tensor, config: MisConfig,
                      reduce_histogram: Callable[[Tensor], Tensor] | None = None
                      ) -> tuple[TokenTerms, adaptive.Choice | None]:
    """With an adaptive token-level bound: pick U from the histogram in the (CP-combined) ``batch_values``,
    summed over the DP group by ``reduce_histogram`` (``tis_auto_scope: dp``), and truncate the token weights
    at it. Otherwise the terms unchanged and None."""
    if not adaptive_token_level(config):
        return terms, None
    hist = batch_values[len(location.NAMES):]
    if reduce_histogram is not None:
        hist = reduce_histogram(hist)
    choice = adaptive.choose(hist, adaptive.candidates(config.tis_auto_bounds, hist.device),
                             config.tis_auto_target_ess)
    return terms.bounded(choice.upper.to(terms.token_ratio.device)), choice


def finalize(batch: PackedBatch, terms: TokenTerms, stats: Tensor, config: MisConfig,
             reduce_normalizer: Callable[[Tensor], Tensor] | None = None, batch_values: Tensor | None = None,
             reduce_gate: Callable[[Tensor], Tensor] | None = None, bound: adaptive.Choice | None = None,
             reduce_histogram: Callable[[Tensor], Tensor] | None = None) -> Correction:
    """Sequence-level decisions, final weights and all metrics for this rank's tokens.

    ``stats`` is the per-sequence table combined over the context-parallel group, so every rank
    takes the same sequence-level decisions and the same batch-level normalisation. Everything
    per-sequence is gathered in one [B, M] table and broadcast to the tokens once.
    ``batch_values``: the batch-sum vector combined over the CP group (None: this rank's own, cp = 1).
    ``reduce_normalizer`` sums the [numerator, denominator] of the normalisation mean over the
    data-parallel group (``tis_batch_normalize_scope: dp``); None keeps it per micro-batch.
    ``reduce_gate`` combines the batch gate's parts over the DP group (``rs_batch_gate_scope: dp``).
    ``bound``: the adaptive token-level bound ``bound_token_terms`` picked (``terms`` are bounded at it);
    ``reduce_histogram`` sums the adaptive sequence-level bound's histogram over the DP group
    (``tis_auto_scope: dp``).
    """
    col = table_columns(stats)
    seq_values = mismatch_seq_metrics(col)
    token_metrics: dict[str, Tensor] = {"nonfinite_token_fraction": terms.nonfinite}
    if batch_values is None:
        batch_values = local_batch_values(batch, terms, config)
    # -- where the mismatch lives, and the batch gate's statistics: every call, correction or not
    batch_metrics = location.metrics(batch_values)
    gate_parts = gate.parts(col["sum_k3"].sum(), col["sum_log_ratio"].sum(),
                            col["n_usable"].sum(), batch_values[location.INDEX["max_abs_log_ratio"]])
    if reduce_gate is not None:
        gate_parts = reduce_gate(gate_parts)
    gate_statistics = gate.statistics(gate_parts)
    batch_metrics.update({f"batch_{name}": value for name, value in gate_statistics.items()})
    if not config.use_tis:
        token_metrics.update(_expand(batch_metrics, batch.seq_index.numel()))
        return Correction(None, terms.valid, torch.ones(batch.num_seqs, dtype=torch.bool, device=stats.device),
                          _metrics(token_metrics, _broadcast(batch, seq_values)))

    seq_reject = torch.zeros(batch.num_seqs, dtype=torch.bool, device=stats.device)
    message = None
    if config.rs_batch_gate:  # a catastrophic batch: every sequence rejected, every weight 0
        gated, message = gate.decide(gate_statistics, config.rs_batch_gate)
        batch_metrics["batch_gated"] = torch.tensor(float(gated), device=stats.device)
        seq_reject = seq_reject | gated
    # -- importance weights before/after bounding, at tis_level (an adaptive sequence-level bound waits for
    # the sequence decisions: it is chosen over the kept sequences, and truncation rejects nothing)
    seq_weight = seq_ratio = None
    if config.tis_level == "token":
        if config.adaptive_bound and bound is None:
            raise ValueError("tis_upper_bound: auto at token level: pass the bound bound_token_terms chose")
        upper = bound.upper if config.adaptive_bound else config.tis_upper_bound
        token_metrics["tis_weight_before_bound"] = terms.token_ratio
        token_metrics.update(bound_fraction_metrics("tis_", config.tis_mode, terms.token_ratio,
                                                    config.tis_lower_bound, upper))
        token_metrics["tis_weight_after_bound"] = terms.token_weight
    else:
        seq_ratio = _clamped_exp(level_log_ratio(stats, config.tis_level))
        seq_values["tis_weight_before_bound"] = seq_ratio
        if not config.adaptive_bound:
            seq_weight, rejected = _bound_seq_ratio(seq_values, seq_ratio, config, config.tis_upper_bound)
            if rejected is not None:  # mask mode (the others reject nothing)
                seq_reject = seq_reject | (rejected > 0)

    # -- rejection sampling at rs_level (token level already folded into terms.token_pass)
    if config.use_rs:
        if config.rs_level == "token":
            token_metrics.update(bound_fraction_metrics("rs_", "mask", terms.token_ratio,
                                                        config.rs_lower_bound, config.rs_upper_bound))
        else:
            rs_ratio = _clamped_exp(level_log_ratio(stats, config.rs_level))
            seq_values.update(bound_fraction_metrics("rs_", "mask", rs_ratio,
                                                     config.rs_lower_bound, config.rs_upper_bound))
            seq_reject = seq_reject | (rs_ratio < config.rs_lower_bound) | (rs_ratio > config.rs_upper_bound)

    # -- veto (applied whenever a threshold is set) and non-finite log-probs: reject the sequence whole
    if config.rs_veto_threshold is not None:
        vetoed = col["n_catastrophic"] > 0
        token_metrics["rs_catastrophic_token_fraction"] = terms.catastrophic
        seq_values["rs_catastrophic_seq_fraction"] = vetoed.float()
        seq_reject = seq_reject | vetoed
    # -- divergence rejection (token options already folded into terms.token_pass)
    if config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        div_reject, div_token, div_seq = divergence.evaluate(
            layout, stats[:, NUM_COLUMNS:], col["n_usable"], terms.estimators,
            terms.divergence_kept, terms.usable)
        seq_reject = seq_reject | div_reject
        token_metrics.update(div_token)
        seq_values.update(div_seq)
    seq_keep = ~(seq_reject | (col["n_valid"] > col["n_usable"]))
    n_pass = col["n_token_pass"] * seq_keep

    # -- the adaptive bound: at sequence level chosen here, over the kept sequences (each counted n_pass times)
    if config.adaptive_bound:
        if seq_ratio is not None:
            edges = adaptive.candidates(config.tis_auto_bounds, stats.device)
            hist = adaptive.histogram(seq_ratio, n_pass, edges)
            if reduce_histogram is not None:
                hist = reduce_histogram(hist)
            bound = adaptive.choose(hist, edges.to(hist.device), config.tis_auto_target_ess)
            seq_weight, _ = _bound_seq_ratio(seq_values, seq_ratio, config, bound.upper.to(stats.device))
        batch_metrics.update(tis_upper_bound_effective=bound.upper, ess_before_bound=bound.ess_before,
                             ess_after_bound=bound.ess_after)

    # -- batch statistics of the kept weights (before normalisation), from the per-sequence table
    if seq_weight is None:
        sum_w = (col["sum_token_weight"] * seq_keep).sum()
        sum_w_sq = (col["sum_token_weight_sq"] * seq_keep).sum()
        mean_parts = torch.stack([sum_w, n_pass.sum()])  # over kept tokens
        max_w = _batch_extreme(col["max_token_weight"], seq_keep, "amax", -1.0)
        min_w = _batch_extreme(col["min_token_weight"], seq_keep, "amin", _NO_TOKEN)
    else:
        trained_seq = n_pass > 0
        sum_w = (n_pass * seq_weight).sum()
        sum_w_sq = (n_pass * seq_weight.square()).sum()
        mean_parts = torch.stack([(seq_weight * trained_seq).sum(), trained_seq.sum()])  # over trained sequences
        max_w = _batch_extreme(seq_weight, trained_seq, "amax", -1.0)
        min_w = _batch_extreme(seq_weight, trained_seq, "amin", _NO_TOKEN)
    if reduce_normalizer is not None:
        mean_parts = reduce_normalizer(mean_parts)
    mean_w = mean_parts[0] / mean_parts[1].clamp(min=1)
    if config.tis_batch_normalize:
        factor = torch.where(mean_w > NORMALIZE_MIN_MEAN, mean_w, torch.ones_like(mean_w))
    else:
        factor = torch.ones_like(mean_w)
    any_kept = max_w >= 0
    n_valid = col["n_valid"].sum()
    norm_values = {
        "batch_norm_factor": factor,
        "is_ratio_batch_min_final": torch.where(any_kept, min_w / factor, torch.zeros_like(factor)),
        "is_ratio_batch_max_final": torch.where(any_kept, max_w / factor, torch.zeros_like(factor)),
        # ≤ 1 by Cauchy–Schwarz; the clamp only absorbs float64 rounding
        "ess": torch.where(sum_w_sq > 0, sum_w.square() / (n_valid * sum_w_sq).clamp(min=1e-30),
                           torch.zeros_like(sum_w)).clamp(max=1.0),
    }

    # -- miles' per-sequence extremes of the final weight over the sequence's kept tokens (0 without one)
    if seq_weight is None:
        has_kept = seq_keep & (col["max_token_weight"] >= 0)
        seq_max, seq_min = col["max_token_weight"], col["min_token_weight"]
    else:
        has_kept, seq_max, seq_min = n_pass > 0, seq_weight, seq_weight
    seq_values["is_ratio_max_final"] = torch.where(has_kept, seq_max / factor, 0.0)
    seq_values["is_ratio_min_final"] = torch.where(has_kept, seq_min / factor, 0.0)

    # -- one broadcast to the tokens, then the token-level weights
    seq_values[_KEEP] = seq_keep.float()
    if seq_weight is not None:
        seq_values[_WEIGHT] = seq_weight
    per_token = _broadcast(batch, seq_values)
    token_keep = terms.token_pass * per_token.pop(_KEEP)
    if config.rs_divergence:  # tokens removed by any divergence option, token- or sequence-level
        token_metrics["rs_divergence_masked_token_fraction"] = torch.maximum(
            token_metrics.pop("_divergence_token_rejected"), per_token.pop("_divergence_seq_reject"))
    weight = (terms.token_weight if seq_weight is None else per_token.pop(_WEIGHT)) * token_keep
    token_metrics["is_ratio_mean_after_tis_rs"] = weight
    weight = (weight / factor).detach()
    token_metrics["is_ratio_mean_final"] = weight
    # batch-level values: a fill per metric, cheaper than gathering them with the per-sequence table
    token_metrics.update(_expand({**norm_values, **batch_metrics}, weight.numel()))
    return Correction(weight, token_keep, seq_keep, _metrics(token_metrics, per_token), message)


def _bound_seq_ratio(seq_values: dict[str, Tensor], seq_ratio: Tensor, config: MisConfig,
                     upper) -> tuple[Tensor, Tensor | None]:
    """(per-sequence weights, rejections or None) of the sequence-level ratios bounded at ``upper``
    (``bound_weights``); their metrics go into ``seq_values``."""
    seq_weight, rejected = bound_weights(seq_ratio, config.tis_mode, config.tis_lower_bound, upper)
    seq_values.update(bound_fraction_metrics("tis_", config.tis_mode, seq_ratio, config.tis_lower_bound, upper))
    seq_values["tis_weight_after_bound"] = seq_weight
    return seq_weight, rejected


def _expand(values: dict[str, Tensor], num_tokens: int) -> dict[str, Tensor]:
    """Batch-level values -> one [N] tensor each: a broadcast view (stride 0) of the 0-d value, not N copies.
    Materialising them cost a 4·M·N-byte table per call (~5 MB at 80k tokens, 1.2 ms of first-touch page
    faults, a third of a default call); a reduction or product by the host reads a view like any tensor.
    Writing into one in place is refused by torch (docs/contract.md): copy it first."""
    if not values:
        return {}
    # one stack and one unbind for all of them (a reshape, cast and expand each cost ~3 ops per value)
    column = torch.stack([value.reshape(()) for value in values.values()]).float()
    return dict(zip(values, column[:, None].expand(-1, num_tokens).unbind(0)))


def _batch_extreme(values: Tensor, selected: Tensor, reduce: str, empty: float) -> Tensor:
    """Max/min of ``values`` over the selected sequences; ``empty`` when none is selected (or B = 0)."""
    padded = torch.cat([values.new_full((1,), empty), torch.where(selected, values, empty)])
    return padded.amax() if reduce == "amax" else padded.amin()


_KEEP, _WEIGHT = "_seq_keep", "_seq_weight"  # internal columns of the broadcast table


def _broadcast(batch: PackedBatch, seq_values: dict[str, Tensor]) -> dict[str, Tensor]:
    table = torch.stack([v.float() for v in seq_values.values()], dim=1)
    return dict(zip(seq_values, batch.broadcast(table).unbind(1)))


def _metrics(token_metrics: dict[str, Tensor], seq_metrics_per_token: dict[str, Tensor]) -> dict[str, Tensor]:
    """All metrics, ``mis_``-prefixed, detached float32 [N] tensors, sorted by name."""
    out = {f"mis_{name}": _detached(value if value.dtype == torch.float32 else value.float())
           for name, value in token_metrics.items()}
    out.update({f"mis_{name}": _detached(value) for name, value in seq_metrics_per_token.items()})
    return dict(sorted(out.items()))


def _detached(value: Tensor) -> Tensor:
    """``value`` without autograd history; no op when it has none (~40 metrics a call, one op each)."""
    return value.detach() if value.requires_grad else value
