"""Stage 1, the tokens: every per-token quantity of this rank's tokens, one elementwise kernel.

Notation: ℓ_t = log π_train − log π_rollout on a usable token (``ops.usable_tokens``; 0 elsewhere),
ρ_t = exp(clamp(ℓ_t, ±20)).

Masks and indicators are float 0/1 tensors, combined by multiplication: on CPU, bool tensors, bool→float
conversions and ``torch.where`` cost 5–20× a float multiply, and this code runs once per micro-batch on ~10⁵–10⁶
tokens. Every value multiplied by a mask here is finite.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..tensors import backend, ops
from . import divergence, staleness
from ..config import MisConfig
from ..tensors.ops import LOG_RATIO_CLAMP, indicator
from ..tensors.packed_batch import PackedBatch
from .bounding import bound_weights


class TokenBounds(NamedTuple):
    """The ratio bounds of the token stage and the log-ratio thresholds its decisions compare ℓ with
    (``ops.log_bound``), computed before the kernel (eagerly on either backend: the thresholds are then the same
    numbers whatever runs the kernel)."""

    upper: float | Tensor  # the token weights' upper bound (``UpperBound.for_tokens``)
    log_upper: float | Tensor
    log_lower: float  # ln tis_lower_bound (every mode but truncate; 0.0 when unused)
    rs_log_lower: float  # ln rs_lower_bound, ln rs_upper_bound (token RS; 0.0 when unused)
    rs_log_upper: float


@dataclass(frozen=True)
class TokenTerms:
    """Per-token quantities [N]; masks are float 0/1."""

    valid: Tensor  # loss_mask != 0
    usable: Tensor  # valid and both log-probs usable (ops.usable_tokens)
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
    """The thresholds of the token stage: the upper bound's (``UpperBound.for_tokens``, only where token weights
    are bounded: the per-lag bounds read lags only then), ln L, and token RS's."""
    bound = config.upper_bound
    if config.use_tis and config.tis_level == "token":
        if bound.needs_lags:  # without lags: the one error naming the lag keys
            staleness.require_lags(config, batch.lags is not None)
        upper, log_upper = bound.for_tokens(batch.lags, batch.seq_index)
    else:  # unused: no token weight is bounded
        upper, log_upper = math.inf, math.inf
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
    usable = ops.usable_tokens(batch.train_log_probs, batch.rollout_log_probs, valid)
    # where not usable the values are garbage (NaN·0 = NaN): zero them, so no metric sees their value
    # (in-place ops only touch temporaries made on the same line)
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
    if config.tis_level == "token" and not config.upper_bound.adaptive:  # adaptive: bounded later (bounded)
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


def bounded_tokens(terms: TokenTerms, config: MisConfig) -> Tensor:
    """[N] float64 0/1: usable tokens whose ratio is outside the token bound (ρ > U for truncate; ρ ∉ [L, U] else);
    float64 already, as the per-sequence sum takes it (one pass fewer than a float32 indicator)."""
    ell = terms.log_ratio  # ρ > U ⟺ ℓ > ln U (ops.log_bound)
    outside = torch.gt(ell, terms.bounds.log_upper, out=torch.empty_like(ell, dtype=torch.float64))
    if config.tis_mode != "truncate":
        outside.add_(torch.lt(ell, terms.bounds.log_lower, out=torch.empty_like(outside)))
    # a token that is not usable has ρ = 1: outside the bound only when 1 is (a bound below 1, a lower one above)
    if config.upper_bound.lowest < 1.0 or (config.tis_mode != "truncate" and config.tis_lower_bound > 1.0):
        outside.mul_(terms.usable)
    return outside
