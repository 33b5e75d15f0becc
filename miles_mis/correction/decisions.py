"""finalize's sequence-level decisions, in the order finalize gathers their outcomes (the batch gate, the bound at
``tis_level``, RS, the veto, the staleness gate, the divergence options), then which tokens and sequences stay and
the adaptive sequence-level bound: each stage returns an ``Outcome`` (the sequences it rejects and its metrics), and
the sequence-level importance weights are a value (``SeqWeights``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import adaptive, divergence, gate, staleness
from ..config import MisConfig
from ..tensors.packed_batch import PackedBatch
from .bounding import bound_fraction_metrics, bound_weights
from .measures import Reduce, clamped_exp, level_log_ratio
from .stage_values import Outcome, SeqWeights
from .token_terms import TokenTerms


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
    ratio = clamped_exp(level_log_ratio(col, config.tis_level))
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
    rs_ratio = clamped_exp(level_log_ratio(col, config.rs_level))
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
    """The adaptive bound (``tis_upper_bound: auto``, ``miles_mis.correction.adaptive``). At sequence/geometric level it
    is chosen here, over the kept sequences, each counted n_pass_i times:

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
