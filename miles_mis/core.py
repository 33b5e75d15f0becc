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
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from . import adaptive, backend, divergence, gate, location, staleness, truncation
from .config import MisConfig
from . import ops
from .ops import LOG_PROB_BOUND, LOG_RATIO_CLAMP, indicator
from .segments import PackedBatch

NORMALIZE_MIN_MEAN = 1e-8  # batch normalisation is skipped when the mean weight is below this
_BATCH_PARTS = len(location.NAMES) + len(truncation.NAMES)  # the batch vector before the adaptive bound's histogram
_NO_TOKEN = 3.0e38  # min-column value of a sequence without a passing token (weights are ≤ e^20)


# --------------------------------------------------------------------------- bounding (one place)
def bound_weights(ratio: Tensor, mode: str, lower: float, upper: float,
                  compared: tuple | None = None) -> tuple[Tensor, Tensor | None]:
    """Apply an IS mode to ratios ρ (per token or per sequence). Returns (weight, rejected 0/1 or None when
    the mode rejects nothing).

    truncate: w = min(ρ, U)                     rejected = ∅
    clip:     w = clamp(ρ, L, U)                rejected = ∅
    mask:     w = ρ                             rejected = {ρ ∉ [L, U]}
    icepop:   w = ρ·1[L ≤ ρ ≤ U]                rejected = ∅ (the mask is unchanged)

    ``compared``: (values, lower, upper) the decision ρ ∉ [L, U] is taken on instead of (ρ, L, U): at token level
    (ℓ, ln L, ln U) (``ops.log_bound``), so that it does not depend on a kernel's exp.
    """
    if mode == "truncate":
        return ratio.clamp(max=upper), None
    if mode == "clip":  # (a per-lag upper bound is a tensor; clamp takes two numbers or two tensors)
        return (ratio.clamp(lower, upper) if not isinstance(upper, Tensor)
                else ratio.clamp(min=lower).clamp_(max=upper)), None
    values, low, high = (ratio, lower, upper) if compared is None else compared
    outside = indicator(torch.lt, values, low).add_(indicator(torch.gt, values, high))  # disjoint: 0/1
    if mode == "mask":
        return ratio, outside
    if mode == "icepop":
        return (1.0 - outside).mul_(ratio), None
    raise ValueError(f"tis_mode={mode!r} is invalid: allowed values are truncate, clip, mask, icepop")


def bound_fraction_metrics(prefix: str, mode: str, ratio: Tensor, lower: float, upper: float) -> dict[str, Tensor]:
    """Indicator metrics of a bounding stage: ``{prefix}truncate_fraction`` for truncate (ρ > U),
    ``{prefix}{mode}_fraction_low`` (ρ < L) and ``_high`` (ρ > U) for the other modes. At token level ``ratio`` is
    ℓ and the bounds are ``ops.log_bound``'s: the tokens the token stages rejected, on every backend."""
    high = indicator(torch.gt, ratio, upper)
    if mode == "truncate":
        return {f"{prefix}truncate_fraction": high}
    return {f"{prefix}{mode}_fraction_low": indicator(torch.lt, ratio, lower), f"{prefix}{mode}_fraction_high": high}


# --------------------------------------------------------------------------- stage 1: tokens
class TokenBounds(NamedTuple):
    """The ratio bounds of the token stage and the log-ratio thresholds its decisions compare ℓ with
    (``ops.log_bound``), computed before the kernel (eagerly on either backend: the thresholds are then the same
    numbers whatever runs the kernel)."""

    upper: float | Tensor  # the token weights' upper bound (token_upper_bound)
    log_upper: float | Tensor
    log_lower: float  # ln tis_lower_bound (every mode but truncate; 0.0 when unused)
    rs_log_lower: float  # ln rs_lower_bound, ln rs_upper_bound (token RS; 0.0 when unused)
    rs_log_upper: float


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
    # the token weights' upper bound (a number, [N] per-lag bounds, or the adaptive 0-d one) and the log-ratio
    # thresholds of every token decision (ρ_t > U ⟺ ℓ_t > bounds.log_upper)
    bounds: TokenBounds
    moving_out: Tensor | None = None  # 0/1 A_t·ℓ_t > 0 (divergence.moving_out), with a directional option only

    def bounded(self, upper: Tensor) -> "TokenTerms":
        """These terms with the token weights truncated at ``upper`` (the adaptive bound, known only once the
        histogram of every rank's ratios has been combined)."""
        return dataclasses.replace(self, token_weight=self.token_ratio.clamp(max=upper),
                                   bounds=self.bounds._replace(upper=upper, log_upper=ops.log_bounds(upper)))

    @property
    def nonfinite(self) -> Tensor:  # valid but a log-prob is NaN/±inf or a fill value (|log p| ≥ LOG_PROB_BOUND)
        return self.valid - self.usable


def token_bounds(batch: PackedBatch, config: MisConfig) -> TokenBounds:
    upper, log_upper = token_upper_bound(batch, config)
    token_rs = config.use_rs and config.rs_level == "token"
    return TokenBounds(upper, log_upper,
                       ops.log_bound(config.tis_lower_bound) if config.tis_mode != "truncate" else 0.0,
                       ops.log_bound(config.rs_lower_bound) if token_rs else 0.0,
                       ops.log_bound(config.rs_upper_bound) if token_rs else 0.0)


def token_terms(batch: PackedBatch, config: MisConfig) -> TokenTerms:
    """Stage 1: every per-token quantity of this rank's tokens (``token_kernel``), on ``config.kernel_backend``."""
    return backend.call(token_kernel, config.kernel_backend, batch, config, token_bounds(batch, config))


def token_kernel(batch: PackedBatch, config: MisConfig, bounds: TokenBounds) -> TokenTerms:
    """``token_terms``' body: elementwise passes over the tokens, which the compiled backend fuses."""
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
    chi2 = ops.expm1(clamped.mul_(2.0))

    if config.rs_veto_threshold is not None:
        # compare the raw ℓ_t, not the clamped ratio: a threshold below e^-20 must still fire
        catastrophic = indicator(torch.lt, log_ratio, math.log(config.rs_veto_threshold)).mul_(usable)
    else:
        catastrophic = torch.zeros_like(usable)

    token_pass = usable
    token_weight = token_ratio
    if config.tis_level == "token" and not config.adaptive_bound:  # adaptive: bounded later (TokenTerms.bounded)
        # decisions on ℓ against ln L, ln U (ops.log_bound): the same on every backend, whatever its exp
        token_weight, rejected = bound_weights(token_ratio, config.tis_mode, config.tis_lower_bound, bounds.upper,
                                               (log_ratio, bounds.log_lower, bounds.log_upper))
        if rejected is not None:  # mask mode (the others reject nothing)
            token_pass = token_pass * (1.0 - rejected)
    if config.use_rs and config.rs_level == "token":  # L_rs ≤ ρ ≤ U_rs, in log space
        token_pass = (indicator(torch.ge, log_ratio, bounds.rs_log_lower)
                      .mul_(indicator(torch.le, log_ratio, bounds.rs_log_upper)).mul_(token_pass))
    estimators, kept, out = {}, {}, None
    if config.rs_divergence:
        needed = divergence.needed_estimators(config.rs_divergence)
        rollout = None  # the usable rollout log-probs (0 elsewhere), only for the options in probability space
        if any(name in divergence.PROBABILITY_ESTIMATORS for name in needed):
            rollout = torch.nan_to_num(batch.rollout_log_probs, nan=0.0, posinf=0.0, neginf=0.0).mul_(usable)
        estimators = divergence.token_estimators(log_ratio, train, rollout, needed)
        if config.use_tis and divergence.needs_advantages(config.rs_divergence):
            if batch.advantage_signs is None:  # the entry points refuse it earlier, naming the option (advantages.py)
                raise ValueError("a directional rs_divergence option needs the batch's advantages")
            out = divergence.moving_out(log_ratio, batch.advantage_signs)
        kept = divergence.token_decisions(config.rs_divergence, estimators, out)
        for keep in kept.values():
            token_pass = token_pass * keep
    return TokenTerms(valid, usable, train, log_ratio, token_ratio, k3, chi2, catastrophic, token_pass,
                      token_weight, estimators, kept, bounds, out)


def token_upper_bound(batch: PackedBatch, config: MisConfig) -> tuple[float | Tensor, float | Tensor]:
    """The token weights' fixed upper bound and its ``ops.log_bound``: ``tis_upper_bound``, or with
    ``tis_upper_bound_by_lag`` each token's sequence's per-lag bound ([N], ``staleness.seq_upper_bounds``)."""
    if config.adaptive_bound:  # chosen later (bound_token_terms); nothing is compared with it before
        return config.tis_upper_bound, math.inf
    if config.tis_upper_bound_by_lag is None or config.tis_level != "token" or not config.use_tis:
        return config.tis_upper_bound, ops.log_bound(config.tis_upper_bound)
    lags = staleness.lags_for(config, batch.lags)
    bounds = staleness.seq_upper_bounds(config, lags, batch.seq_index.device)
    return (bounds.index_select(0, batch.seq_index), ops.log_bounds(bounds).index_select(0, batch.seq_index))


def rejects_tokens(config: MisConfig) -> bool:
    """The correction can reject single tokens (not only whole sequences): token-level mask mode, token-level
    RS, or a token divergence option. Only then do CP ranks exchange their token rejections."""
    return config.use_tis and ((config.tis_level == "token" and config.tis_mode == "mask")
                               or (config.use_rs and config.rs_level == "token")
                               or any(option.startswith("token_") for option, _, _ in config.rs_divergence)
                               or divergence.gates_sequences(config.rs_divergence))


def token_rejections(terms: TokenTerms, config: MisConfig) -> Tensor:
    """[N] float 0/1: usable tokens removed by a token-level stage (the rest of token_pass is ``usable``); with a
    directional sequence option [2, N]: those, and the passing tokens a fired gate would remove (``moving_out``)."""
    rejected = terms.usable - terms.token_pass
    if config.use_tis and divergence.gates_sequences(config.rs_divergence):
        return torch.stack([rejected, terms.moving_out * terms.token_pass])
    return rejected


# --------------------------------------------------------------------------- stage 2: per-sequence table
# Columns of the per-sequence table; across CP ranks SUM columns are added, MAX maxed, MIN minned.
SUM_COLUMNS = ("n_valid", "n_usable", "sum_train_log_prob", "sum_log_ratio", "sum_k3", "sum_chi2",
               "n_catastrophic", "n_token_pass", "sum_token_weight", "sum_token_weight_sq")
MAX_COLUMNS = ("max_token_weight",)
MIN_COLUMNS = ("min_token_weight",)
COL = {name: i for i, name in enumerate(SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS)}
NUM_SUM_COLUMNS = len(SUM_COLUMNS)
NUM_COLUMNS = len(COL)


def num_columns(config: MisConfig, has_lags: bool = False) -> int:
    """Width of the per-sequence table: the base columns, what the divergence options need, and with lags at token
    level the count of tokens whose ratio left the bound (``n_bounded``, summed over CP ranks)."""
    return NUM_COLUMNS + divergence.Layout.of(config.rs_divergence).width + int(_counts_bounded(config, has_lags))


def _counts_bounded(config: MisConfig, has_lags: bool) -> bool:
    """The table carries n_bounded: the lag metrics need it per sequence, and only token-level bounds act on single
    tokens (a sequence-level bound's decision is per sequence, in finalize)."""
    return has_lags and config.use_tis and config.tis_level == "token"


def bounded_tokens(terms: TokenTerms, config: MisConfig) -> Tensor:
    """[N] float64 0/1: usable tokens whose ratio is outside the token bound (ρ > U for truncate; ρ ∉ [L, U] else);
    float64 already, as the per-sequence sum takes it (one pass fewer than a float32 indicator)."""
    ell = terms.log_ratio  # ρ > U ⟺ ℓ > ln U (ops.log_bound)
    outside = torch.gt(ell, terms.bounds.log_upper, out=torch.empty_like(ell, dtype=torch.float64))
    if config.tis_mode != "truncate":
        outside.add_(torch.lt(ell, terms.bounds.log_lower, out=torch.empty_like(outside)))
    # a token that is not usable has ρ = 1: outside the bound only when 1 is (a bound below 1, a lower one above)
    lowest = min(config.tis_upper_bound_by_lag or (config.tis_upper_bound,)) if not config.adaptive_bound else 1.0
    if lowest < 1.0 or (config.tis_mode != "truncate" and config.tis_lower_bound > 1.0):
        outside.mul_(terms.usable)
    return outside


def seq_table_values(terms: TokenTerms) -> tuple[Tensor, ...]:
    """The [N] values ``local_seq_stats`` reduces: the SUM_COLUMNS' summands in float64 (in that order), the kept
    weight w_t·pass_t (float32), and the inputs of the max and min columns (w_t over passing tokens, −1 / 3e38
    elsewhere): one fused pass on the compiled backend."""
    weight = terms.token_weight * terms.token_pass
    summands = (terms.valid, terms.usable, terms.train_log_probs, terms.log_ratio, terms.k3, terms.chi2,
                terms.catastrophic, terms.token_pass, weight, weight * terms.token_weight)
    not_passing = 1.0 - terms.token_pass
    return (*(value.double() for value in summands), weight, weight - not_passing, not_passing * _NO_TOKEN + weight)


def local_seq_stats(batch: PackedBatch, terms: TokenTerms, config: MisConfig | None = None) -> Tensor:
    """[B, num_columns(config)] float64 table of this rank's per-sequence statistics (sums accumulated in
    float64, PackedBatch.per_seq_sum).

    k3_t = exp(clamp(ℓ_t)) − ℓ_t − 1 (exact for ℓ_t ≤ 20, finite beyond), χ²_t = ρ_t² − 1. The extreme
    columns are over passing tokens: −1 (max) and 3e38 (min) for a sequence without one here (weights are in
    [0, e^20]).
    Derived, not summed: n_nonfinite = n_valid − n_usable, Σ log π_rollout = Σ log π_train − Σ ℓ.
    """
    *values, weight, max_input, min_input = backend.call(seq_table_values, config.kernel_backend if config else
                                                         "eager", terms)
    # one sparse mat-vec per column (the same reduction on either backend): no [N, K] buffer is materialised
    # (memory traffic dominates on CPU)
    columns = [batch.per_seq_sum(value) for value in values]
    columns.append(batch.per_seq_extreme(max_input, "amax", -1.0).double())
    columns.append(batch.per_seq_extreme(min_input, "amin", _NO_TOKEN).double())
    bounded = (batch.per_seq_sum(bounded_tokens(terms, config))
               if config is not None and _counts_bounded(config, batch.lags is not None) else None)
    if config is not None and config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        gated = (divergence.gated_token_values(terms.moving_out, terms.token_pass, weight)
                 if layout.gated and terms.moving_out is not None else None)
        extra = divergence.local_columns(layout, terms.usable, terms.estimators, terms.divergence_kept,
                                         batch.per_seq_sum,
                                         lambda v: batch.per_seq_extreme(v, "amax", divergence.NO_VALUE).double(),
                                         gated)
        columns += list(extra.unbind(1))
    if bounded is not None:  # the last column (finalize reads it there)
        columns.append(bounded)
    return torch.stack(columns, dim=1)


def combine_seq_stats(per_rank: Tensor, config: MisConfig | None = None) -> Tensor:
    """Reduce a [C, B, K] stack of per-rank tables (C context-parallel ranks) into one [B, K] table, each column by
    its ``column_reductions`` op."""
    sums, maxima, minima = (columns.to(per_rank.device)
                            for columns in column_reductions(config, per_rank.shape[-1]))
    out = per_rank.new_empty(per_rank.shape[1:])
    out[:, sums] = per_rank[..., sums].sum(0)
    out[:, maxima] = per_rank[..., maxima].amax(0)
    out[:, minima] = per_rank[..., minima].amin(0)
    return out


def column_reductions(config: MisConfig | None, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The per-sequence table's columns by how two parts of one sequence combine: (sum, max, min) column indices.
    The base columns (SUM/MAX/MIN_COLUMNS), the divergence options' sums then maxima, then n_bounded (a sum)."""
    sums = list(range(NUM_SUM_COLUMNS))
    maxima = list(range(NUM_SUM_COLUMNS, NUM_SUM_COLUMNS + len(MAX_COLUMNS)))
    minima = list(range(NUM_SUM_COLUMNS + len(MAX_COLUMNS), NUM_COLUMNS))
    end = NUM_COLUMNS
    if config is not None and config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        middle = end + len(layout.sum_names)
        sums += range(end, middle)
        maxima += range(middle, end + layout.width)
        end += layout.width
    sums += range(end, width)
    return tuple(torch.tensor(columns, dtype=torch.long) for columns in (sums, maxima, minima))


def group_seq_stats(stats: Tensor, of_sample: Tensor, count: int, config: MisConfig | None = None) -> Tensor:
    """[B, K] per-sample table -> [G, K] per-group table (``of_sample``: each sample's group): each column combined
    over a group's samples as over CP ranks (``column_reductions``), so a group's row is the table of its samples'
    tokens taken as one sequence."""
    sums, maxima, minima = (columns.to(stats.device) for columns in column_reductions(config, stats.shape[1]))
    of_sample = of_sample.to(stats.device)
    out = stats.new_zeros(count, stats.shape[1])
    out[:, sums] = out[:, sums].index_add(0, of_sample, stats[:, sums])
    for columns, how in ((maxima, "amax"), (minima, "amin")):
        if columns.numel():
            part = stats[:, columns]
            out[:, columns] = part.new_zeros(count, columns.numel()).scatter_reduce_(
                0, of_sample[:, None].expand_as(part), part, how, include_self=False)
    return out


def group_rollouts(batch: PackedBatch, stats: Tensor, config: MisConfig) -> tuple[PackedBatch, Tensor]:
    """With the host's split rollouts (``batch.rollouts``, miles_mis.rollouts): the batch and the combined table with
    each rollout's samples as one sequence; unchanged without them, or when every sample is its own rollout."""
    groups = batch.rollouts
    if groups is None or groups.trivial:
        return batch, stats
    return (batch.grouped(groups.of_sample, groups.count),
            group_seq_stats(stats, groups.of_sample, groups.count, config))


def rollout_seq_metrics(groups, device) -> dict[str, Tensor]:
    """Per rollout: ``rollout_split_fraction`` (with ids: 1 for a rollout of several samples in the call) and, when
    the host passes ``rollout_mask_sums``, ``rollout_incomplete_fraction`` (1 for a rollout with trained tokens
    outside the call: its sequence-level stages saw a part of it). Per-sequence values, broadcast to the tokens (the
    hosts' reducer makes them shares of samples, or with ``rollout_mask_sums`` denominators token-weighted shares of
    rollouts)."""
    out = {"rollout_split_fraction": (groups.size > 1).float().to(device)} if groups.ids_given else {}
    if groups.incomplete is not None:
        out["rollout_incomplete_fraction"] = groups.incomplete.float().to(device)
    if groups.trivial:  # not grouped: the rows are the samples, numbered as the groups (first appearance)
        out = {name: value.index_select(0, groups.of_sample.to(device)) for name, value in out.items()}
    return out


def _per_sample(correction: "Correction", groups) -> "Correction":
    """A grouped call's decisions per sample again: each sample takes its rollout's."""
    if groups is None or groups.trivial:
        return correction
    index = groups.of_sample.to(correction.seq_keep.device)
    return dataclasses.replace(
        correction, seq_keep=correction.seq_keep.index_select(0, index),
        seq_gate=None if correction.seq_gate is None else correction.seq_gate.index_select(0, index))


# --------------------------------------------------------------------------- stage 4: decisions, weights, metrics
@dataclass(frozen=True)
class Correction:
    weights: Tensor | None  # [N] final detached weights of the local tokens, 0 where rejected; None = metrics-only
    token_keep: Tensor  # [N] float 0/1: local token stays in the mask
    seq_keep: Tensor  # [B] bool: sequence not rejected by a sequence-level stage
    metrics: dict[str, Tensor]  # name (with mis_ prefix) -> [N] float32, aligned with the local tokens
    message: str | None = None  # a warning for the host's log (the batch gate fired), else None
    seq_gate: Tensor | None = None  # [B] bool: a directional sequence option fired (its moving-out tokens are out)


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
    """This rank's fixed-size float64 vector of batch sums: miles_mis.location.NAMES, miles_mis.truncation.NAMES,
    then, with an adaptive
    token-level bound, the histogram of the passing tokens' ratios (miles_mis.adaptive). Combined over CP ranks
    with ``combine_batch_values`` (it travels in the agreement header)."""
    k3, usable, low_and_max, truncation_values = backend.call(
        batch_value_kernel, config.kernel_backend, terms.k3, terms.usable, terms.log_ratio, batch.rollout_log_probs,
        config.metrics_low_prob_threshold, batch.mask_sizes)
    values = torch.cat([location.local_values(k3, usable, low_and_max,
                                              lambda v: batch.per_bucket_sum(v, location.POSITION_EDGES)),
                        truncation_values])
    if adaptive_token_level(config):
        edges = adaptive.candidates(config.tis_auto_bounds, terms.token_ratio.device)
        values = torch.cat([values, adaptive.histogram(terms.token_ratio, terms.token_pass, edges,
                                                       (terms.log_ratio, ops.log_bounds(edges)))])
    return values


def batch_value_kernel(k3: Tensor, usable: Tensor, log_ratio: Tensor, rollout_log_probs: Tensor,
                       low_prob_threshold: float, mask_sizes: Tensor | None) -> tuple[Tensor, ...]:
    """The per-token passes of ``local_batch_values``: ``location.token_values`` and ``truncation.local_values``,
    one fused kernel on the compiled backend (the position-bucket sums, sparse mat-vecs, stay outside it)."""
    return (*location.token_values(k3, usable, log_ratio, rollout_log_probs, low_prob_threshold),
            truncation.local_values(log_ratio, usable, mask_sizes))


def combine_batch_values(per_rank: Tensor) -> Tensor:
    """[C, M] -> [M]: the location and truncation parts combined by their ``combine``, a histogram after them
    added."""
    size, end = len(location.NAMES), _BATCH_PARTS
    return torch.cat([location.combine(per_rank[:, :size]), truncation.combine(per_rank[:, size:end]),
                      per_rank[:, end:].sum(0)])


def bound_token_terms(terms: TokenTerms, batch_values: Tensor, config: MisConfig,
                      reduce_histogram: Callable[[Tensor], Tensor] | None = None
                      ) -> tuple[TokenTerms, adaptive.Choice | None]:
    """With an adaptive token-level bound: pick U from the histogram in the (CP-combined) ``batch_values``,
    summed over the DP group by ``reduce_histogram`` (``tis_auto_scope: dp``), and truncate the token weights
    at it. Otherwise the terms unchanged and None."""
    if not adaptive_token_level(config):
        return terms, None
    hist = batch_values[_BATCH_PARTS:]
    if reduce_histogram is not None:
        hist = reduce_histogram(hist)
    choice = adaptive.choose(hist, adaptive.candidates(config.tis_auto_bounds, hist.device),
                             config.tis_auto_target_ess)
    return terms.bounded(choice.upper.to(terms.token_ratio.device)), choice


@dataclass(frozen=True)
class KeptWeights:
    """Batch statistics of the kept weights before normalisation (0-d tensors)."""

    sum: Tensor  # Σ w over the kept tokens
    sum_sq: Tensor  # Σ w² over the kept tokens
    mean_parts: Tensor  # [numerator, denominator] of the normalisation mean μ
    max: Tensor  # largest kept weight, −1 when nothing is kept
    min: Tensor  # smallest kept weight, _NO_TOKEN when nothing is kept


@dataclass
class FinalizeState:
    """What the stages of one ``finalize`` call read and fill in. [B] tensors are per sequence, [N] per local
    token; the per-sequence values are broadcast to the tokens once, by the last stage."""

    batch: PackedBatch
    terms: TokenTerms
    stats: Tensor  # [B, K] per-sequence table combined over the CP group
    config: MisConfig
    col: dict[str, Tensor]  # the table's base columns by name (table_columns)
    seq_values: dict[str, Tensor]  # [B] per-sequence metrics (and the internal _KEEP/_WEIGHT columns)
    token_metrics: dict[str, Tensor]  # [N] per-token metrics
    bound: adaptive.Choice | None  # the adaptive bound: given at token level, chosen at sequence level
    reduce_normalizer: Callable[[Tensor], Tensor] | None  # over the DP group: the normalisation mean's parts
    reduce_gate: Callable[[Tensor], Tensor] | None  # over the DP group: the batch gate's parts
    reduce_histogram: Callable[[Tensor], Tensor] | None  # over the DP group: the sequence-level bound's histogram
    batch_metrics: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # 0-d batch-level metrics
    gate_statistics: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # gate.STATISTICS -> 0-d
    message: str | None = None  # the batch gate's warning
    seq_reject: Tensor | None = None  # [B] bool: rejected by a sequence-level stage so far
    seq_gate: Tensor | None = None  # [B] bool: a directional sequence option fired (None without one)
    seq_ratio: Tensor | None = None  # [B] r_i at a sequence/geometric tis_level (None at token level)
    seq_weight: Tensor | None = None  # [B] bounded w_i at a sequence/geometric tis_level (None at token level)
    seq_upper: float | Tensor | None = None  # the fixed sequence-level upper bound (a number, or [B] per lag)
    seq_keep: Tensor | None = None  # [B] bool: no sequence-level stage rejected it, every valid token usable
    n_pass: Tensor | None = None  # [B] kept tokens per sequence (0 for a rejected sequence)
    kept: KeptWeights | None = None
    factor: Tensor | None = None  # the batch normalisation's divisor
    weight_statistics: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # 0-d, of the final weights
    batch_vector: tuple[tuple[str, ...], Tensor] | None = None  # more batch-level values, as (names, 1-D values)

    @classmethod
    def start(cls, batch: PackedBatch, terms: TokenTerms, stats: Tensor, config: MisConfig,
              bound: adaptive.Choice | None, reduce_normalizer, reduce_gate, reduce_histogram) -> "FinalizeState":
        """The state before any stage: the mismatch metrics of every sequence and the non-finite tokens."""
        col = table_columns(stats)
        return cls(batch, terms, stats, config, col, mismatch_seq_metrics(col),
                   {"nonfinite_token_fraction": terms.nonfinite}, bound, reduce_normalizer, reduce_gate,
                   reduce_histogram)


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

    With split rollouts (``batch.rollouts``) every sequence-level stage sees each rollout whole
    (``group_rollouts``); the returned ``seq_keep``/``seq_gate`` are per sample again.

    The stages run in the order of docs/math.md, each reading and filling in one ``FinalizeState``.
    """
    if batch_values is None:
        batch_values = local_batch_values(batch, terms, config)
    groups = batch.rollouts
    batch, stats = group_rollouts(batch, stats, config)
    state = FinalizeState.start(batch, terms, stats, config, bound, reduce_normalizer, reduce_gate,
                                reduce_histogram)
    if groups is not None:
        state.seq_values.update(rollout_seq_metrics(groups, stats.device))
    return _per_sample(_finalize_stages(state, batch_values), groups)


def _finalize_stages(state: "FinalizeState", batch_values: Tensor) -> Correction:
    """``finalize``'s stages, in order."""
    config, batch, stats = state.config, state.batch, state.stats
    measure_batch(state, batch_values)
    if not config.use_tis:
        return metrics_only(state)
    state.seq_reject = torch.zeros(batch.num_seqs, dtype=torch.bool, device=stats.device)  # none rejected yet
    gate_batch(state)
    bound_at_tis_level(state)
    reject_outside_rs_bounds(state)
    veto_catastrophic_sequences(state)
    reject_stale_sequences(state)
    reject_by_divergence(state)
    reject_moving_out_tokens(state)
    keep_sequences(state)
    apply_adaptive_bound(state)
    sum_kept_weights(state)
    normalise(state)
    final_weight_statistics(state)
    final_sequence_extremes(state)
    measure_by_lag(state)
    return broadcast_to_tokens(state)


# --------------------------------------------------------------------------- the pipeline
def _same(values: Tensor) -> Tensor:
    return values


@dataclass(frozen=True)
class Reductions:
    """What the pipeline combines with other processes, as functions of this process's values. ``LOCAL`` (every
    field at its default) is one process holding whole sequences: nothing to combine. The context- and
    data-parallel implementation is ``miles_mis.peers``' (its collectives in ``miles_mis.distributed``)."""

    batch_values: Callable[[Tensor], Tensor] = _same  # the batch-sum vector over the CP group
    seq_table: Callable[[Tensor], Tensor] = _same  # the per-sequence table over the CP group
    token_histogram: Callable[[Tensor], Tensor] | None = None  # adaptive token-level bound, over the DP group
    seq_histogram: Callable[[Tensor], Tensor] | None = None  # adaptive sequence-level bound, over the DP group
    normalizer: Callable[[Tensor], Tensor] | None = None  # batch normalisation's mean parts, over the DP group
    gate: Callable[[Tensor], Tensor] | None = None  # the batch gate's parts, over the DP group


LOCAL = Reductions()


def correct(batch: PackedBatch, config: MisConfig, reductions: Reductions = LOCAL, terms: TokenTerms | None = None,
            batch_values: Tensor | None = None) -> Correction:
    """The correction of one call, every stage in order (the one place that knows it):

    token_terms -> local_batch_values (combined) -> bound_token_terms -> local_seq_stats (combined) -> finalize

    ``terms``: this process's token terms when already computed (a caller that needs them before its first
    exchange); ``batch_values``: the batch-sum vector when already combined (the CP agreement carries it)."""
    terms = token_terms(batch, config) if terms is None else terms
    if batch_values is None:
        batch_values = reductions.batch_values(local_batch_values(batch, terms, config))
    terms, bound = bound_token_terms(terms, batch_values.to(terms.token_ratio.device), config,
                                     reduce_histogram=reductions.token_histogram)
    stats = reductions.seq_table(local_seq_stats(batch, terms, config))
    return finalize(batch, terms, stats, config, reduce_normalizer=reductions.normalizer,
                    batch_values=batch_values.to(stats.device), reduce_gate=reductions.gate, bound=bound,
                    reduce_histogram=reductions.seq_histogram)


def measure_batch(state: FinalizeState, batch_values: Tensor) -> None:
    """Where the mismatch lives (``location.metrics``) and the batch gate's statistics, every call:

    k3 = Σ_t k3_t / n,   kl = Σ_t (−ℓ_t) / n,   max_abs_log_ratio = max_t |ℓ_t|

    over the usable tokens of the micro-batch (n of them; with ``reduce_gate``, of the DP group too).
    """
    col = state.col
    state.batch_metrics = location.metrics(batch_values)
    state.batch_metrics.update(truncation.metrics(batch_values[len(location.NAMES):_BATCH_PARTS],
                                                  state.batch.mask_sizes is not None))
    gate_parts = gate.parts(col["sum_k3"].sum(), col["sum_log_ratio"].sum(),
                            col["n_usable"].sum(), batch_values[location.INDEX["max_abs_log_ratio"]])
    if state.reduce_gate is not None:
        gate_parts = state.reduce_gate(gate_parts)
    state.gate_statistics = gate.statistics(gate_parts)
    state.batch_metrics.update({f"batch_{name}": value for name, value in state.gate_statistics.items()})


def metrics_only(state: FinalizeState) -> Correction:
    """``use_tis`` off: the mismatch metrics, no weights, the valid tokens kept and every sequence kept."""
    batch = state.batch
    measure_by_lag(state)
    state.token_metrics.update(_expand(state.batch_metrics, batch.seq_index.numel(), state.batch_vector))
    return Correction(None, state.terms.valid,
                      torch.ones(batch.num_seqs, dtype=torch.bool, device=state.stats.device),
                      _metrics(state.token_metrics, _broadcast(batch, state.seq_values)))


def gate_batch(state: FinalizeState) -> None:
    """The batch gate (``rs_batch_gate``): a catastrophic micro-batch has every sequence rejected,

    gated = any_s (statistic_s > threshold_s),   reject_i |= gated   for every sequence i

    so every weight is 0 (and the normalisation skipped, as for an empty batch).
    """
    if state.config.rs_batch_gate:
        gated, state.message = gate.decide(state.gate_statistics, state.config.rs_batch_gate)
        state.batch_metrics["batch_gated"] = torch.tensor(float(gated), device=state.stats.device)
        state.seq_reject = state.seq_reject | gated


def bound_at_tis_level(state: FinalizeState) -> None:
    """Importance weights before and after bounding at ``tis_level`` (``bound_weights``):

    token:               w_t = bound(ρ_t)                       (already in ``terms.token_weight``)
    sequence/geometric:  w_i = bound(r_i),  r_i = exp(clamp(level_log_ratio_i)),
                         reject_i |= r_i ∉ [L, U]               (mask mode)

    An adaptive sequence-level bound waits for the sequence decisions (``apply_adaptive_bound``): it is chosen
    over the kept sequences, and truncation rejects nothing.
    """
    config, terms = state.config, state.terms
    if config.tis_level == "token":
        if config.adaptive_bound and state.bound is None:
            raise ValueError("tis_upper_bound: auto at token level: pass the bound bound_token_terms chose")
        state.token_metrics["tis_weight_before_bound"] = terms.token_ratio
        state.token_metrics.update(bound_fraction_metrics("tis_", config.tis_mode, terms.log_ratio,
                                                          terms.bounds.log_lower, terms.bounds.log_upper))
        state.token_metrics["tis_weight_after_bound"] = terms.token_weight
        return
    state.seq_ratio = _clamped_exp(level_log_ratio(state.stats, config.tis_level))
    state.seq_values["tis_weight_before_bound"] = state.seq_ratio
    if not config.adaptive_bound:
        state.seq_upper = config.tis_upper_bound
        if config.tis_upper_bound_by_lag is not None:
            state.seq_upper = staleness.seq_upper_bounds(config, staleness.lags_for(config, state.batch.lags),
                                                         state.stats.device, state.seq_ratio.dtype)
        state.seq_weight, rejected = _bound_seq_ratio(state.seq_values, state.seq_ratio, config, state.seq_upper)
        if rejected is not None:  # mask mode (the others reject nothing)
            state.seq_reject = state.seq_reject | (rejected > 0)


def reject_outside_rs_bounds(state: FinalizeState) -> None:
    """Rejection sampling (``use_rs``) at ``rs_level``, with r the level ratio:

    reject_i |= r_i < L_rs or r_i > U_rs      (sequence/geometric level)

    At token level the rejections are already in ``terms.token_pass``; only their fractions are reported.
    """
    config = state.config
    if not config.use_rs:
        return
    if config.rs_level == "token":
        bounds = state.terms.bounds
        state.token_metrics.update(bound_fraction_metrics("rs_", "mask", state.terms.log_ratio, bounds.rs_log_lower,
                                                          bounds.rs_log_upper))
        return
    rs_ratio = _clamped_exp(level_log_ratio(state.stats, config.rs_level))
    state.seq_values.update(bound_fraction_metrics("rs_", "mask", rs_ratio,
                                                   config.rs_lower_bound, config.rs_upper_bound))
    state.seq_reject = state.seq_reject | (rs_ratio < config.rs_lower_bound) | (rs_ratio > config.rs_upper_bound)


def veto_catastrophic_sequences(state: FinalizeState) -> None:
    """The veto (whenever ``rs_veto_threshold`` = C is set, with or without ``use_rs``):

    reject_i |= any_t (ℓ_t < log C)      over the usable tokens of sequence i (``terms.catastrophic``)
    """
    if state.config.rs_veto_threshold is None:
        return
    vetoed = state.col["n_catastrophic"] > 0
    state.token_metrics["rs_catastrophic_token_fraction"] = state.terms.catastrophic
    state.seq_values["rs_catastrophic_seq_fraction"] = vetoed.float()
    state.seq_reject = state.seq_reject | vetoed


def reject_stale_sequences(state: FinalizeState) -> None:
    """The staleness gate (``rs_max_lag`` = L, ``rs_max_lag_k3`` = κ; ``staleness.stale_rejections``):

    reject_i |= λ_i > L ∧ (κ unset ∨ k3(λ_i) > κ)     k3(λ): pooled over the micro-batch's sequences of lag λ
    """
    if state.config.rs_max_lag is None:
        return
    stale = staleness.stale_rejections(state.config, staleness.lags_for(state.config, state.batch.lags),
                                       state.col["sum_k3"], state.col["n_usable"])
    state.seq_values["rs_stale_seq_fraction"] = stale.float()
    state.seq_reject = state.seq_reject | stale


def measure_by_lag(state: FinalizeState) -> None:
    """With lags: the metrics by lag bucket (``staleness.bucket_metrics``) and each sequence's lag
    (``mis_version_lag``); the weight ones from the kept weights before normalisation (the ESS is scale-free):

    token level:         Σw_i = keep_i Σ_t w_t,  n_bounded_i from the table
    sequence/geometric:  Σw_i = n_pass_i w_i,    n_bounded_i = n_valid_i · 1[r_i outside the bound]
    """
    lags = state.batch.lags
    if lags is None:
        return
    col = state.col
    # the mean lag of the sequences (the host's mean over sequences of it is the mean lag of the whole batch)
    state.batch_metrics["version_lag"] = torch.tensor(state.batch.lag_mean, device=state.stats.device)
    if state.n_pass is None:  # metrics-only
        state.batch_vector = staleness.bucket_metrics(lags, col["n_valid"], col["n_usable"], col["sum_k3"])
        return
    if state.seq_weight is None:
        sum_w = torch.where(state.seq_keep, col["sum_token_weight"], 0.0)
        sum_w_sq = torch.where(state.seq_keep, col["sum_token_weight_sq"], 0.0)
        n_bounded = state.stats[:, -1]  # the table's last column (num_columns)
    else:
        sum_w, sum_w_sq = state.n_pass * state.seq_weight, state.n_pass * state.seq_weight.square()
        upper = state.bound.upper if state.seq_upper is None else state.seq_upper
        outside = state.seq_ratio > upper
        if state.config.tis_mode != "truncate":
            outside = outside | (state.seq_ratio < state.config.tis_lower_bound)
        n_bounded = col["n_valid"] * outside
    state.batch_vector = staleness.bucket_metrics(lags, col["n_valid"], col["n_usable"], col["sum_k3"], n_bounded,
                                                  state.n_pass, sum_w, sum_w_sq)


def reject_by_divergence(state: FinalizeState) -> None:
    """Rejection by divergence statistics (``rs_divergence``, ``divergence.evaluate``):

    reject_i |= the sequence option's aggregated k_i is outside its bounds   (for every sequence option)

    Token options are already in ``terms.token_pass``; their metrics are added here.
    """
    if not state.config.rs_divergence:
        return
    terms = state.terms
    layout = divergence.Layout.of(state.config.rs_divergence)
    div_reject, state.seq_gate, div_token, div_seq, div_batch = divergence.evaluate(
        layout, state.stats[:, NUM_COLUMNS:], state.col["n_usable"], terms.estimators,
        terms.divergence_kept, terms.usable, terms.moving_out, state.batch.seq_index)
    state.seq_reject = state.seq_reject | div_reject
    state.token_metrics.update(div_token)
    state.seq_values.update(div_seq)
    state.batch_metrics.update(div_batch)


def reject_moving_out_tokens(state: FinalizeState) -> None:
    """A fired directional sequence option (VACO, ``divergence.evaluate``'s gate) rejects the sequence's moving-out
    tokens; its kept-token columns become those of the tokens that stay (``divergence.staying_columns``):

    gate_i:  n_pass_i, Σ_t w_t, Σ_t w_t², max/min_t w_t   over  {t passing the token stages : ¬out_t}
    """
    if state.seq_gate is None:
        return
    layout = divergence.Layout.of(state.config.rs_divergence)
    staying = divergence.staying_columns(layout, state.stats[:, NUM_COLUMNS:])
    for name, value in staying.items():
        state.col[name] = torch.where(state.seq_gate, value, state.col[name])


def keep_sequences(state: FinalizeState) -> None:
    """The sequence decisions, with a non-finite log-prob rejecting its sequence whole:

    keep_i = ¬reject_i ∧ (n_valid_i = n_usable_i),   n_pass_i = keep_i · (tokens of i passing the token stages)
    """
    col = state.col
    state.seq_keep = ~(state.seq_reject | (col["n_valid"] > col["n_usable"]))
    state.n_pass = col["n_token_pass"] * state.seq_keep


def apply_adaptive_bound(state: FinalizeState) -> None:
    """The adaptive bound (``tis_upper_bound: auto``, ``miles_mis.adaptive``). At sequence/geometric level it is
    chosen here, over the kept sequences, each counted n_pass_i times:

    U = max{c_j : ESS(c_j) ≥ η},   w_i = min(r_i, U)

    At either level its bound and ESS before/after are reported.
    """
    if not state.config.adaptive_bound:
        return
    config, stats = state.config, state.stats
    if state.seq_ratio is not None:
        edges = adaptive.candidates(config.tis_auto_bounds, stats.device)
        hist = adaptive.histogram(state.seq_ratio, state.n_pass, edges)
        if state.reduce_histogram is not None:
            hist = state.reduce_histogram(hist)
        state.bound = adaptive.choose(hist, edges.to(hist.device), config.tis_auto_target_ess)
        state.seq_weight, _ = _bound_seq_ratio(state.seq_values, state.seq_ratio, config,
                                               state.bound.upper.to(stats.device))
    bound = state.bound
    state.batch_metrics.update(tis_upper_bound_effective=bound.upper, ess_before_bound=bound.ess_before,
                               ess_after_bound=bound.ess_after)


def sum_kept_weights(state: FinalizeState) -> None:
    """Batch statistics of the kept weights before normalisation, from the per-sequence table:

    token level:         Σw = Σ_i keep_i Σ_t w_t,   Σw² likewise,   μ parts = [Σw, Σ_i n_pass_i]
    sequence/geometric:  Σw = Σ_i n_pass_i w_i,  Σw² = Σ_i n_pass_i w_i²,
                         μ parts = [Σ_{i: n_pass_i > 0} w_i, #{i: n_pass_i > 0}]

    and the largest/smallest kept weight (over the kept sequences' extremes).
    """
    col, seq_keep, n_pass, seq_weight = state.col, state.seq_keep, state.n_pass, state.seq_weight
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
    state.kept = KeptWeights(sum_w, sum_w_sq, mean_parts, max_w, min_w)


def normalise(state: FinalizeState) -> None:
    """The batch normalisation's divisor (``tis_batch_normalize``; with ``reduce_normalizer``, over the DP group):

    μ = mean_parts[0] / max(mean_parts[1], 1),   factor = μ if μ > NORMALIZE_MIN_MEAN else 1   (1 when off)
    """
    mean_parts = state.kept.mean_parts
    if state.reduce_normalizer is not None:
        mean_parts = state.reduce_normalizer(mean_parts)
    mean_w = mean_parts[0] / mean_parts[1].clamp(min=1)
    if state.config.tis_batch_normalize:
        state.factor = torch.where(mean_w > NORMALIZE_MIN_MEAN, mean_w, torch.ones_like(mean_w))
    else:
        state.factor = torch.ones_like(mean_w)


def final_weight_statistics(state: FinalizeState) -> None:
    """Batch statistics of the final weights w̃ = w / factor (0 on every valid token not kept), N valid tokens:

    is_ratio_batch_{min,max}_final = min/max of w̃ over the kept tokens (0 when none)
    ess = (Σ w̃)² / (N Σ w̃²) = (Σw)² / (N Σw²),  clamped at 1 (0 when Σw² = 0)
    """
    kept, factor = state.kept, state.factor
    any_kept = kept.max >= 0
    n_valid = state.col["n_valid"].sum()
    state.weight_statistics = {
        "batch_norm_factor": factor,
        "is_ratio_batch_min_final": torch.where(any_kept, kept.min / factor, torch.zeros_like(factor)),
        "is_ratio_batch_max_final": torch.where(any_kept, kept.max / factor, torch.zeros_like(factor)),
        # ≤ 1 by Cauchy–Schwarz; the clamp only absorbs float64 rounding
        "ess": torch.where(kept.sum_sq > 0, kept.sum.square() / (n_valid * kept.sum_sq).clamp(min=1e-30),
                           torch.zeros_like(kept.sum)).clamp(max=1.0),
    }


def final_sequence_extremes(state: FinalizeState) -> None:
    """miles' per-sequence extremes of the final weight over the sequence's kept tokens K_i:

    is_ratio_{max,min}_final_i = max/min_{t ∈ K_i} w̃_t   (0 when K_i is empty)
    """
    if state.seq_weight is None:
        col = state.col
        has_kept = state.seq_keep & (col["max_token_weight"] >= 0)
        seq_max, seq_min = col["max_token_weight"], col["min_token_weight"]
    else:
        has_kept, seq_max, seq_min = state.n_pass > 0, state.seq_weight, state.seq_weight
    state.seq_values["is_ratio_max_final"] = torch.where(has_kept, seq_max / state.factor, 0.0)
    state.seq_values["is_ratio_min_final"] = torch.where(has_kept, seq_min / state.factor, 0.0)


def broadcast_to_tokens(state: FinalizeState) -> Correction:
    """One broadcast of the per-sequence values to the tokens, then the tokens' mask and final weights:

    keep_t = token_pass_t · keep_{i(t)},   w̃_t = keep_t · w_t / factor   (w_t = w_{i(t)} at sequence level)
    """
    terms, token_metrics, seq_values = state.terms, state.token_metrics, state.seq_values
    seq_values[_KEEP] = state.seq_keep.float()
    if state.seq_weight is not None:
        seq_values[_WEIGHT] = state.seq_weight
    if state.seq_gate is not None:
        seq_values[_GATE] = state.seq_gate.float()
    per_token = _broadcast(state.batch, seq_values)
    token_keep = terms.token_pass * per_token.pop(_KEEP)
    if state.seq_gate is not None:  # keep_t ·= 1 − gate_i(t) · out_t
        token_keep = token_keep * (1.0 - per_token.pop(_GATE) * terms.moving_out)
    if state.config.rs_divergence:  # tokens removed by any divergence option, token- or sequence-level
        token_metrics["rs_divergence_masked_token_fraction"] = torch.maximum(
            token_metrics.pop("_divergence_token_rejected"), per_token.pop("_divergence_seq_reject"))
    weight = (terms.token_weight if state.seq_weight is None else per_token.pop(_WEIGHT)) * token_keep
    token_metrics["is_ratio_mean_after_tis_rs"] = weight
    weight = (weight / state.factor).detach()
    token_metrics["is_ratio_mean_final"] = weight
    # batch-level values: a fill per metric, cheaper than gathering them with the per-sequence table
    token_metrics.update(_expand({**state.weight_statistics, **state.batch_metrics}, weight.numel(),
                                 state.batch_vector))
    return Correction(weight, token_keep, state.seq_keep, _metrics(token_metrics, per_token), state.message,
                      state.seq_gate)


def _bound_seq_ratio(seq_values: dict[str, Tensor], seq_ratio: Tensor, config: MisConfig,
                     upper) -> tuple[Tensor, Tensor | None]:
    """(per-sequence weights, rejections or None) of the sequence-level ratios bounded at ``upper``
    (``bound_weights``); their metrics go into ``seq_values``."""
    seq_weight, rejected = bound_weights(seq_ratio, config.tis_mode, config.tis_lower_bound, upper)
    seq_values.update(bound_fraction_metrics("tis_", config.tis_mode, seq_ratio, config.tis_lower_bound, upper))
    seq_values["tis_weight_after_bound"] = seq_weight
    return seq_weight, rejected


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
    """Max/min of ``values`` over the selected sequences; ``empty`` when none is selected (or B = 0)."""
    padded = torch.cat([values.new_full((1,), empty), torch.where(selected, values, empty)])
    return padded.amax() if reduce == "amax" else padded.amin()


_KEEP, _WEIGHT, _GATE = "_seq_keep", "_seq_weight", "_seq_gate"  # internal columns of the broadcast table


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
