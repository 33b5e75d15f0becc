"""Stage 3, finalize: sequence-level decisions, weights, normalisation and metrics, from the per-sequence table
combined over the CP group plus this rank's own tokens.

``finalize`` is straight-line: each stage is a function of the values the earlier ones returned, in the order of
docs/math.md. A stage that rejects sequences returns an ``Outcome`` (its rejections and its metrics); ``finalize``
ORs the rejections and gathers the metrics. Everything per sequence is broadcast to the tokens once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from . import adaptive, divergence, gate, mismatch_location, staleness, truncated_sampling
from ..tensors import ops
from ..config import MisConfig
from ..tensors.ops import LOG_RATIO_CLAMP
from ..tensors.packed_batch import PackedBatch
from .batch_values import HISTOGRAM_START
from .bounding import bound_fraction_metrics, bound_weights
from .seq_table import EMPTY_MAX_WEIGHT, NO_TOKEN, TableSchema, group_rollouts, per_sample, rollout_seq_metrics
from .token_terms import TokenTerms

NORMALIZE_MIN_MEAN = 1e-8  # batch normalisation is skipped when the mean weight is below this

Reduce = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Correction:
    weights: Tensor | None  # [N] final detached weights of the local tokens, 0 where rejected; None = metrics-only
    token_keep: Tensor  # [N] float 0/1: local token stays in the mask
    seq_keep: Tensor  # [B] bool: sequence not rejected by a sequence-level stage
    metrics: dict[str, Tensor]  # name (with mis_ prefix) -> [N] float32, aligned with the local tokens
    message: str | None = None  # a warning for the host's log (the batch gate fired), else None
    seq_gate: Tensor | None = None  # [B] bool: a directional sequence option fired (its moving-out tokens are out)
    exchanged: Any = None  # what the table exchange returned besides the table (the CP ranks' token rejections)


@dataclass(frozen=True)
class Outcome:
    """What a stage decides and measures: the sequences it rejects ([B] or 0-d bool; None: none) and its metrics
    ([N] per token, [B] per sequence, 0-d per batch)."""

    reject: Tensor | None = None
    token: dict[str, Tensor] = field(default_factory=dict)
    seq: dict[str, Tensor] = field(default_factory=dict)
    batch: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqWeights:
    """The sequence-level importance weights (``tis_level`` sequence or geometric)."""

    ratio: Tensor  # [B] r_i
    weight: Tensor | None  # [B] bounded w_i; None until the adaptive bound is chosen
    upper: float | Tensor | None  # the bound: a number, [B] per lag, or the adaptive one once chosen


@dataclass(frozen=True)
class KeptWeights:
    """Batch statistics of the kept weights before normalisation (0-d tensors)."""

    sum: Tensor  # Σ w over the kept tokens
    sum_sq: Tensor  # Σ w² over the kept tokens
    mean_parts: Tensor  # [numerator, denominator] of the normalisation mean μ
    max: Tensor  # largest kept weight, −1 when nothing is kept
    min: Tensor  # smallest kept weight, NO_TOKEN when nothing is kept


def finalize(batch: PackedBatch, terms: TokenTerms, table: Tensor, schema: TableSchema, config: MisConfig,
             batch_values: Tensor, token_bound: adaptive.Choice | None = None, *, gate_reduce: Reduce,
             seq_histogram_reduce: Reduce, normalizer_reduce: Reduce) -> Correction:
    """Sequence-level decisions, final weights and all metrics for this rank's tokens.

    ``table`` is the per-sequence table combined over the context-parallel group and ``batch_values`` the batch-sum
    vector combined over it, so every rank takes the same sequence-level decisions and the same batch-level
    normalisation. ``token_bound``: the adaptive token-level bound (``terms`` are bounded at it). The reduces combine
    the batch gate's parts, the adaptive sequence-level bound's histogram and the normalisation mean's parts over
    the DP group (the identity for a micro-batch scope).

    With split rollouts (``batch.rollouts``) every sequence-level stage sees each rollout whole
    (``group_rollouts``); the returned ``seq_keep``/``seq_gate`` are per sample again.
    """
    groups = batch.rollouts
    batch, table = group_rollouts(batch, table, schema)
    col = schema.columns(table)
    seq_metrics = mismatch_seq_metrics(col)
    if groups is not None:
        seq_metrics.update(rollout_seq_metrics(groups, table.device))
    token_metrics = {"nonfinite_token_fraction": terms.nonfinite}
    batch_metrics, gate_statistics = measure_batch(batch, col, batch_values, gate_reduce)
    if batch.lags is not None:  # the mean lag of the sequences
        batch_metrics["version_lag"] = torch.tensor(batch.lag_mean, device=table.device)
    if not config.use_tis:
        lag_metrics = measure_by_lag(batch, col)
        correction = metrics_only(batch, terms, token_metrics, seq_metrics, batch_metrics, lag_metrics)
        return _per_sample(correction, groups)

    gated, message = gate_batch(gate_statistics, config, table.device)
    tis, seq = bound_at_tis_level(batch, terms, col, config)
    verdict = reject_by_divergence(batch, terms, col, config)
    outcomes = [gated, tis, reject_outside_rs_bounds(terms, col, config), veto_catastrophic_sequences(terms, col, config),
                reject_stale_sequences(batch, col, config)]
    if verdict is not None:
        outcomes.append(Outcome(verdict.seq_reject, verdict.token_metrics, verdict.seq_metrics, verdict.batch_metrics))
    kept_columns = keep_staying_tokens(col, verdict)
    seq_keep, n_pass = keep_sequences(_any([o.reject for o in outcomes]), kept_columns)
    chosen, seq = apply_adaptive_bound(config, seq, token_bound, n_pass, seq_histogram_reduce, table.device)
    kept = sum_kept_weights(kept_columns, seq_keep, n_pass, seq)
    factor = normalise(kept.mean_parts, config, normalizer_reduce)
    lag_metrics = measure_by_lag(batch, kept_columns, config, seq_keep, n_pass, seq)
    for outcome in (*outcomes, chosen, final_sequence_extremes(kept_columns, seq_keep, n_pass, seq, factor)):
        token_metrics.update(outcome.token)
        seq_metrics.update(outcome.seq)
        batch_metrics.update(outcome.batch)
    batch_metrics.update(final_weight_statistics(kept, factor, col["n_valid"].sum()))
    tokens = broadcast_to_tokens(batch, terms, seq_metrics, seq_keep, seq, verdict, factor)
    token_metrics["is_ratio_mean_after_tis_rs"] = tokens.weight_before_normalisation
    token_metrics["is_ratio_mean_final"] = tokens.weight
    if tokens.divergence_masked is not None:  # tokens removed by any divergence option, token- or sequence-level
        token_metrics["rs_divergence_masked_token_fraction"] = tokens.divergence_masked
    # batch-level values: a fill per metric, cheaper than gathering them with the per-sequence table
    token_metrics.update(_expand(batch_metrics, tokens.weight.numel(), lag_metrics))
    correction = Correction(tokens.weight, tokens.keep, seq_keep, _metrics(token_metrics, tokens.seq_metrics),
                            message, None if verdict is None else verdict.gate)
    return _per_sample(correction, groups)


def _any(rejections: list[Tensor | None]) -> Tensor | None:
    """The OR of the stages' rejections (None when no stage rejects)."""
    out = None
    for reject in rejections:
        if reject is not None:
            out = reject if out is None else out | reject
    return out


def _per_sample(correction: Correction, groups) -> Correction:
    """A grouped call's decisions per sample again (``seq_table.per_sample``)."""
    if groups is None or groups.trivial:
        return correction
    seq_keep, seq_gate = per_sample(correction.seq_keep, correction.seq_gate, groups)
    return Correction(correction.weights, correction.token_keep, seq_keep, correction.metrics, correction.message,
                      seq_gate, correction.exchanged)


# --------------------------------------------------------------------------- measuring
def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / denominator.clamp(min=1.0)


def _clamped_exp(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def mismatch_seq_metrics(col: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-sequence mismatch metrics [B] from the combined table's columns, over the usable tokens of each
    sequence (the means in one division, the exponentials in one exp: ops per call, not per sequence)."""
    means = torch.stack([col["sum_train_log_prob"], col["sum_log_ratio"], col["sum_k3"], col["sum_chi2"]])
    mean_train, mean_log_ratio, k3_kl, chi2_token = _safe_divide(means, col["n_usable"]).unbind(0)
    mean_rollout = mean_train - mean_log_ratio
    log_ppl_diff = -mean_log_ratio  # = mean log π_rollout − mean log π_train
    training_log_ppl, rollout_log_ppl = -mean_train, -mean_rollout
    training_ppl, rollout_ppl, ppl_ratio = _clamped_exp(
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
        return _safe_divide(total, col["n_usable"])
    raise ValueError(f"level={level!r} has no per-sequence ratio: allowed values are sequence, geometric")


def measure_batch(batch: PackedBatch, col: dict[str, Tensor], batch_values: Tensor,
                  gate_reduce: Reduce) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Where the mismatch lives (``mismatch_location.metrics``, ``truncated_sampling.metrics``) and the batch gate's statistics, every
    call (batch metrics, gate statistics):

    k3 = Σ_t k3_t / n,   kl = Σ_t (−ℓ_t) / n,   max_abs_log_ratio = max_t |ℓ_t|

    over the usable tokens of the micro-batch (n of them; with ``rs_batch_gate_scope: dp``, of the DP group too).
    """
    metrics = mismatch_location.metrics(batch_values)
    metrics.update(truncated_sampling.metrics(batch_values[len(mismatch_location.NAMES):HISTOGRAM_START], batch.mask_sizes is not None))
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


def metrics_only(batch: PackedBatch, terms: TokenTerms, token_metrics: dict, seq_metrics: dict, batch_metrics: dict,
                 lag_metrics) -> Correction:
    """``use_tis`` off: the mismatch metrics, no weights, the valid tokens kept and every sequence kept."""
    token_metrics.update(_expand(batch_metrics, batch.seq_index.numel(), lag_metrics))
    per_token, _ = _broadcast(batch, seq_metrics, {})
    return Correction(None, terms.valid, torch.ones(batch.num_seqs, dtype=torch.bool, device=terms.valid.device),
                      _metrics(token_metrics, per_token))


# --------------------------------------------------------------------------- deciding
def gate_batch(statistics: dict[str, Tensor], config: MisConfig, device) -> tuple[Outcome, str | None]:
    """The batch gate (``rs_batch_gate``): a catastrophic micro-batch has every sequence rejected,

    gated = any_s (statistic_s > threshold_s),   reject_i |= gated   for every sequence i

    so every weight is 0 (and the normalisation skipped, as for an empty batch).
    """
    if not config.rs_batch_gate:
        return Outcome(), None
    gated, message = gate.decide(statistics, config.rs_batch_gate)
    return Outcome(torch.tensor(gated, device=device),
                   batch={"batch_gated": torch.tensor(float(gated), device=device)}), message


def bound_at_tis_level(batch: PackedBatch, terms: TokenTerms, col: dict[str, Tensor],
                       config: MisConfig) -> tuple[Outcome, SeqWeights | None]:
    """Importance weights before and after bounding at ``tis_level`` (``bound_weights``):

    token:               w_t = bound(ρ_t)                       (already in ``terms.token_weight``)
    sequence/geometric:  w_i = bound(r_i),  r_i = exp(clamp(level_log_ratio_i)),
                         reject_i |= r_i ∉ [L, U]               (mask mode)

    An adaptive sequence-level bound waits for the sequence decisions (``apply_adaptive_bound``): it is chosen
    over the kept sequences, and truncation rejects nothing.
    """
    if config.tis_level == "token":
        if config.upper_bound.adaptive and not isinstance(terms.bounds.upper, Tensor):
            raise ValueError("tis_upper_bound: auto at token level: the terms must be bounded at the chosen bound "
                             "(bound_token_terms)")
        token = {"tis_weight_before_bound": terms.token_ratio, "tis_weight_after_bound": terms.token_weight,
                 **bound_fraction_metrics("tis_", config.tis_mode, terms.log_ratio, terms.bounds.log_lower,
                                          terms.bounds.log_upper)}
        return Outcome(token=token), None
    ratio = _clamped_exp(level_log_ratio(col, config.tis_level))
    upper = config.upper_bound.for_sequences(batch.lags, ratio.device, ratio.dtype)
    if upper is None:  # adaptive: chosen later
        return Outcome(seq={"tis_weight_before_bound": ratio}), SeqWeights(ratio, None, None)
    weight, rejected, metrics = bound_seq_ratio(ratio, config, upper)
    return (Outcome(None if rejected is None else rejected > 0, seq={"tis_weight_before_bound": ratio, **metrics}),
            SeqWeights(ratio, weight, upper))


def bound_seq_ratio(ratio: Tensor, config: MisConfig, upper) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """(per-sequence weights, rejections or None, their metrics) of the sequence-level ratios bounded at ``upper``
    (``bound_weights``)."""
    weight, rejected = bound_weights(ratio, config.tis_mode, config.tis_lower_bound, upper)
    metrics = bound_fraction_metrics("tis_", config.tis_mode, ratio, config.tis_lower_bound, upper)
    metrics["tis_weight_after_bound"] = weight
    return weight, rejected, metrics


def reject_outside_rs_bounds(terms: TokenTerms, col: dict[str, Tensor], config: MisConfig) -> Outcome:
    """Rejection sampling (``use_rs``) at ``rs_level``, with r the level ratio:

    reject_i |= r_i < L_rs or r_i > U_rs      (sequence/geometric level)

    At token level the rejections are already in ``terms.token_pass``; only their fractions are reported.
    """
    if not config.use_rs:
        return Outcome()
    if config.rs_level == "token":
        bounds = terms.bounds
        return Outcome(token=bound_fraction_metrics("rs_", "mask", terms.log_ratio, bounds.rs_log_lower,
                                                    bounds.rs_log_upper))
    rs_ratio = _clamped_exp(level_log_ratio(col, config.rs_level))
    return Outcome((rs_ratio < config.rs_lower_bound) | (rs_ratio > config.rs_upper_bound),
                   seq=bound_fraction_metrics("rs_", "mask", rs_ratio, config.rs_lower_bound, config.rs_upper_bound))


def veto_catastrophic_sequences(terms: TokenTerms, col: dict[str, Tensor], config: MisConfig) -> Outcome:
    """The veto (whenever ``rs_veto_threshold`` = C is set, with or without ``use_rs``):

    reject_i |= any_t (ℓ_t < log C)      over the usable tokens of sequence i (``terms.catastrophic``)
    """
    if config.rs_veto_threshold is None:
        return Outcome()
    vetoed = col["n_catastrophic"] > 0
    return Outcome(vetoed, token={"rs_catastrophic_token_fraction": terms.catastrophic},
                   seq={"rs_catastrophic_seq_fraction": vetoed.float()})


def reject_stale_sequences(batch: PackedBatch, col: dict[str, Tensor], config: MisConfig) -> Outcome:
    """The staleness gate (``rs_max_lag`` = L, ``rs_max_lag_k3`` = κ; ``staleness.stale_rejections``):

    reject_i |= λ_i > L ∧ (κ unset ∨ k3(λ_i) > κ)     k3(λ): pooled over the micro-batch's sequences of lag λ
    """
    if config.rs_max_lag is None:
        return Outcome()
    stale = staleness.stale_rejections(config, staleness.lags_for(config, batch.lags), col["sum_k3"],
                                       col["n_usable"])
    return Outcome(stale, seq={"rs_stale_seq_fraction": stale.float()})


def reject_by_divergence(batch: PackedBatch, terms: TokenTerms, col: dict[str, Tensor],
                         config: MisConfig) -> divergence.Verdict | None:
    """Rejection by divergence statistics (``rs_divergence``, ``divergence.evaluate``):

    reject_i |= the sequence option's aggregated k_i is outside its bounds   (for every sequence option)

    Token options are already in ``terms.token_pass``; their metrics come with the verdict.
    """
    if not config.rs_divergence:
        return None
    return divergence.evaluate(divergence.Layout.of(config.rs_divergence), col, col["n_usable"], terms.estimators,
                               terms.divergence_kept, terms.usable, terms.moving_out, batch.seq_index)


def keep_staying_tokens(col: dict[str, Tensor], verdict: divergence.Verdict | None) -> dict[str, Tensor]:
    """The table's columns with a fired directional sequence option's (VACO's gate) kept-token columns replaced by
    those of the tokens that stay (``divergence.staying_columns``); its moving-out tokens are rejected:

    gate_i:  n_pass_i, Σ_t w_t, Σ_t w_t², max/min_t w_t   over  {t passing the token stages : ¬out_t}
    """
    if verdict is None or verdict.gate is None:
        return col
    staying = divergence.staying_columns(col)
    return {**col, **{name: torch.where(verdict.gate, value, col[name]) for name, value in staying.items()}}


def keep_sequences(reject: Tensor | None, col: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The sequence decisions, with a non-finite log-prob rejecting its sequence whole (keep [B] bool, n_pass [B]):

    keep_i = ¬reject_i ∧ (n_valid_i = n_usable_i),   n_pass_i = keep_i · (tokens of i passing the token stages)
    """
    nonfinite = col["n_valid"] > col["n_usable"]
    seq_keep = ~(nonfinite if reject is None else reject | nonfinite)
    return seq_keep, col["n_token_pass"] * seq_keep


def apply_adaptive_bound(config: MisConfig, seq: SeqWeights | None, token_bound: adaptive.Choice | None,
                         n_pass: Tensor, histogram_reduce: Reduce, device) -> tuple[Outcome, SeqWeights | None]:
    """The adaptive bound (``tis_upper_bound: auto``, ``miles_mis.correction.adaptive``). At sequence/geometric level it is
    chosen here, over the kept sequences, each counted n_pass_i times:

    U = max{c_j : ESS(c_j) ≥ η},   w_i = min(r_i, U)

    At either level its bound and ESS before/after are reported.
    """
    bound = config.upper_bound
    if not bound.adaptive:
        return Outcome(), seq
    choice, metrics = token_bound, {}
    if seq is not None:
        edges = adaptive.candidates(bound.search_range, device)
        hist = histogram_reduce(adaptive.histogram(seq.ratio, n_pass, edges))
        choice = adaptive.choose(hist, edges.to(hist.device), bound.target_ess)
        upper = choice.upper.to(device)
        weight, _, metrics = bound_seq_ratio(seq.ratio, config, upper)
        seq = SeqWeights(seq.ratio, weight, upper)
    return Outcome(seq=metrics, batch={"tis_upper_bound_effective": choice.upper, "ess_before_bound":
                                       choice.ess_before, "ess_after_bound": choice.ess_after}), seq


# --------------------------------------------------------------------------- weighing
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


@dataclass(frozen=True)
class TokenResult:
    keep: Tensor  # [N] float 0/1
    weight_before_normalisation: Tensor  # [N] w_t · keep_t
    weight: Tensor  # [N] final, detached
    seq_metrics: dict[str, Tensor]  # the per-sequence metrics, per token
    divergence_masked: Tensor | None  # [N] removed by any divergence option (None without one)


def broadcast_to_tokens(batch: PackedBatch, terms: TokenTerms, seq_metrics: dict[str, Tensor], seq_keep: Tensor,
                        seq: SeqWeights | None, verdict: divergence.Verdict | None, factor: Tensor) -> TokenResult:
    """One broadcast of the per-sequence values to the tokens, then the tokens' mask and final weights:

    keep_t = token_pass_t · keep_{i(t)} · (1 − gate_{i(t)} · out_t),   w̃_t = keep_t · w_t / factor
    (w_t = w_{i(t)} at sequence level)
    """
    decisions = {"keep": seq_keep.float()}
    if seq is not None:
        decisions["weight"] = seq.weight
    if verdict is not None:
        decisions["divergence_reject"] = verdict.seq_reject.float()
        if verdict.gate is not None:
            decisions["gate"] = verdict.gate.float()
    per_token, decided = _broadcast(batch, seq_metrics, decisions)
    keep = terms.token_pass * decided["keep"]
    if "gate" in decided:  # keep_t ·= 1 − gate_i(t) · out_t
        keep = keep * (1.0 - decided["gate"] * terms.moving_out)
    masked = None if verdict is None else torch.maximum(verdict.rejected_tokens, decided["divergence_reject"])
    weight = (terms.token_weight if seq is None else decided["weight"]) * keep
    return TokenResult(keep, weight, (weight / factor).detach(), per_token, masked)


# --------------------------------------------------------------------------- to the tokens
def _expand(values: dict[str, Tensor], num_tokens: int,
            vector: tuple[tuple[str, ...], Tensor] | None = None) -> dict[str, Tensor]:
    """Batch-level values -> one [N] tensor each: a broadcast view (stride 0) of the 0-d value, not N copies.
    Materialising them cost a 4·M·N-byte table per call (~5 MB at 80k tokens, 1.2 ms of first-touch page
    faults, a third of a default call); a reduction or product by the host reads a view like any tensor.
    Writing into one in place is refused by torch (docs/contract.md): copy it first. ``vector``: more values
    already in one 1-D tensor (names, values), e.g. the lag-bucket metrics: joined without a 0-d tensor each."""
    names = list(values)
    if not names and vector is None:
        return {}
    # one stack and one unbind for all of them (a reshape, cast and expand each cost ~3 ops per value)
    parts = [torch.stack([value if value.dim() == 0 else value.reshape(()) for value in values.values()]).float()]
    if vector is not None:
        names += vector[0]
        parts.append(vector[1].float())
    column = torch.cat(parts) if len(parts) > 1 else parts[0]
    return dict(zip(names, column[:, None].expand(-1, num_tokens).unbind(0)))


def _batch_extreme(values: Tensor, selected: Tensor, reduce: str, empty: float) -> Tensor:
    """Max/min of ``values`` over the selected sequences; ``empty`` when none is selected (or B = 0). ``empty`` is
    beyond every value's range (−1 below every weight, NO_TOKEN above), so it never wins against a selected one."""
    if values.numel() == 0:
        return values.new_full((), empty)
    masked = torch.where(selected, values, empty)
    return masked.amax() if reduce == "amax" else masked.amin()


def _broadcast(batch: PackedBatch, metrics: dict[str, Tensor],
               decisions: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The per-sequence ``metrics`` and ``decisions`` [B] to the tokens [N] (float32), in one gather."""
    names = (*metrics, *decisions)
    # one stack (float64 where any column is: a float32 or 0/1 value round-trips exactly) and one cast
    table = torch.stack([*metrics.values(), *decisions.values()], dim=1).float()
    per_token = dict(zip(names, batch.broadcast(table).unbind(1)))
    return {name: per_token[name] for name in metrics}, {name: per_token[name] for name in decisions}


def _metrics(token_metrics: dict[str, Tensor], seq_metrics_per_token: dict[str, Tensor]) -> dict[str, Tensor]:
    """All metrics, ``mis_``-prefixed, detached float32 [N] tensors, sorted by name."""
    out = {f"mis_{name}": _detached(value if value.dtype == torch.float32 else value.float())
           for name, value in token_metrics.items()}
    out.update({f"mis_{name}": _detached(value) for name, value in seq_metrics_per_token.items()})
    return dict(sorted(out.items()))


def _detached(value: Tensor) -> Tensor:
    """``value`` without autograd history; no op when it has none (~40 metrics a call, one op each)."""
    return value.detach() if value.requires_grad else value
