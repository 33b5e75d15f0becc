"""Rejection by divergence statistics (verl's k1/k2/k3 options), CP-aware like the rest of the core.

With ℓ_t the log ratio log(π_train/π_rollout) of a usable token (0 elsewhere) and c_t = clamp(ℓ_t, ±20):

    k1_t = −ℓ_t          k2_t = c_t² / 2          k3_t = e^{c_t} − c_t − 1 = expm1(c_t) − c_t

k1 is the log ratio itself, unclamped, so its sums are the sequence's log ratio Σ_t ℓ_t exactly as the IS weight and
``use_rs`` read it (docs/math.md#one-sequence-ratio): a token beyond ±20 moves a seq_sum or seq_mean k1 by its
whole ℓ_t, not by 20. k2 and k3 bound each token's contribution as verl does.

An option "<aggregation>_<k>" tests, per token (token) or per sequence (seq_sum: Σ_t k_t, seq_mean:
Σ_t k_t / n, seq_max: max_t k_t):

- k1 options keep exactly the ratios inside [L, U]: L ≤ exp(−aggregated k1) ≤ U (so L ≤ ρ_t ≤ U at token
  level, the product ratio for seq_sum, the geometric mean ratio for seq_mean). verl inverts asymmetric
  k1 bounds; this does not.
- k2 and k3 options keep aggregated k ≤ threshold.

And in probability space (DPPO, KPop), with p = π_train(t), q = π_rollout(t) of the sampled token, from the
usable log-probs (p = q = 1 elsewhere, where both are 0), in float64:

    tv_t  = p − q                         (a range [−α, β]: prime-rl's DPPO mask)
    atv_t = |p − q|                       (an upper bound: DPPO's binary total variation)
    bkl_t = KL(Bern(q) ‖ Bern(p)) = q log(q/p) + (1 − q) log((1 − q)/(1 − p))    (an upper bound: KPop)

p − q is q·expm1(ℓ) where |ℓ| ≤ 1 (no cancellation when the two nearly agree), 1 − p is −expm1(log p), and
log(1 − p) is log1mexp(log p) (``log1mexp``), so a token near p = 1 keeps its precision.

Directional options (DPPO's token rule, VACO's sequence rule) reject a token only when its update would move it
further out of the trust region. An update with advantage A_t raises p where A_t > 0 and lowers it where A_t < 0,
so with ℓ_t = log p − log q the token moves out when

    out_t = 1[A_t · ℓ_t > 0]        (0 where A_t = 0 or p = q; p − q, ℓ and any binary divergence share ℓ's sign)

    token_dtv [−α, β]:  reject_t = out_t ∧ (tv_t ∉ [−α, β])        (prime-rl's default: A > 0 ∧ tv > β, A < 0 ∧ tv < −α)
    token_dbkl δ:       reject_t = out_t ∧ (bkl_t > δ)
    seq_mean_datv δ:    gate_i = mean_t atv_t > δ,  reject_t = out_t ∧ gate_i     (VACO; seq_mean_dbkl with bkl)

A gated sequence keeps its other tokens: its kept-token columns (count, Σw, Σw², extremes) are those of the tokens
that stay, carried in the per-sequence table beside the others (``Layout``), so CP ranks need no extra collective.

All configured options are ANDed with every other stage. Token options act on tokens (locally);
sequence options reject whole sequences from per-sequence sums/maxima combined over the CP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..tensors import ops
from ..tensors.ops import LOG_RATIO_CLAMP, indicator

NO_VALUE = -3.0e38  # max-column value of a sequence without a usable token (−NO_VALUE: a min column's)


def split_option(option: str) -> tuple[str, str]:
    """"seq_mean_k3" -> ("seq_mean", "k3")."""
    aggregation, estimator = option.rsplit("_", 1)
    return aggregation, estimator


PROBABILITY_ESTIMATORS = ("tv", "atv", "bkl")
DIRECTIONAL = {"dtv": "tv", "dbkl": "bkl", "datv": "atv"}  # a directional option's estimator -> the statistic it reads
# the columns of a gated (directional sequence) option: moving-out tokens, and the kept tokens that stay
GATED_SUMS = ("n:out", "n_pass:in", "sum_w:in", "sum_w2:in")
GATED_MAXES = ("max_w:in",)
GATED_MINS = ("min_w:in",)
_LOG_TINY = -745.0  # below log of the smallest float64: log(1 − p) at p = 1 stays finite (a large bkl, not inf)


def token_estimators(log_ratio: Tensor, train_log_probs: Tensor | None = None,
                     rollout_log_probs: Tensor | None = None, needed: tuple[str, ...] = ("k1", "k2", "k3")
                     ) -> dict[str, Tensor]:
    """The ``needed`` estimators per token: k1 from ℓ, k2 and k3 from the clamped ℓ (0 where not usable, where every
    k is 0); k3 = expm1(c) − c in float64 (ops.k3: e^c − c − 1 cancels in float32 when the engines nearly agree); tv,
    atv, bkl from the usable log-probs (0 where not usable, where the core zeroes them: p = q = 1)."""
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    out = {}
    if "k1" in needed:
        out["k1"] = -log_ratio
    if "k2" in needed:
        out["k2"] = clamped.square().mul_(0.5)
    if "k3" in needed:
        out["k3"] = ops.k3(clamped, clamped)
    if any(name in needed for name in PROBABILITY_ESTIMATORS):
        out.update(probability_estimators(log_ratio, train_log_probs, rollout_log_probs, needed))
    return out


def log1mexp(log_p: Tensor) -> Tensor:
    """log(1 − e^x) for x ≤ 0, accurate everywhere: log(−expm1(x)) near 0, log1p(−e^x) below −log 2; −inf at
    x = 0 (callers hold it at ``_LOG_TINY``: a clamp of x before the log would give log(1e-300) ≈ −690.8 instead)."""
    near = log_p > -math.log(2.0)
    return torch.where(near, torch.log(-ops.expm1(log_p.clamp(max=0.0))),
                       torch.log1p(-torch.exp(log_p.clamp(max=-math.log(2.0)))))


def probability_estimators(log_ratio: Tensor, train_log_probs: Tensor, rollout_log_probs: Tensor,
                           needed: tuple[str, ...]) -> dict[str, Tensor]:
    """tv, atv, bkl (those ``needed``) per token, float64, from log p (train) and log q (rollout), both ≤ 0."""
    log_p = train_log_probs.double().clamp(max=0.0)
    log_q = rollout_log_probs.double().clamp(max=0.0)
    q = log_q.exp()
    ell = log_p - log_q
    # p − q without cancellation where they nearly agree; e^{log p} − e^{log q} is exact enough elsewhere
    delta = torch.where(ell.abs() <= 1.0, q * ops.expm1(ell.clamp(-1.0, 1.0)), log_p.exp() - q)
    out = {}
    if "tv" in needed:
        out["tv"] = delta
    if "atv" in needed:
        out["atv"] = delta.abs()
    if "bkl" in needed:
        one_minus_q = -ops.expm1(log_q)
        tail = one_minus_q * (log1mexp(log_q).clamp(min=_LOG_TINY) - log1mexp(log_p).clamp(min=_LOG_TINY))
        out["bkl"] = (torch.where(one_minus_q > 0, tail, 0.0) - q * ell).clamp_(min=0.0)  # q log(q/p) = −q ℓ
    return out


def statistic_of(estimator: str) -> str:
    """The per-token statistic an estimator reads: a directional one its undirected statistic (dtv -> tv)."""
    return DIRECTIONAL.get(estimator, estimator)


def needed_estimators(options) -> tuple[str, ...]:
    """The estimators the configured options read."""
    return tuple(dict.fromkeys(statistic_of(split_option(option)[1]) for option, _, _ in options))


def needs_advantages(options) -> bool:
    """Some option is directional: it reads the sign of the host's advantages."""
    return any(split_option(option)[1] in DIRECTIONAL for option, _, _ in options)


def gates_sequences(options) -> bool:
    """Some option is a directional sequence option (VACO): its gate rejects tokens of the sequences it fires on."""
    return any(split_option(option)[1] in DIRECTIONAL and not option.startswith("token_") for option, _, _ in options)


def moving_out(log_ratio: Tensor, advantage_signs: Tensor) -> Tensor:
    """0/1 per token: its update moves p_train further from p_rollout, sign(A_t)·ℓ_t > 0 (0 where not usable, where
    ℓ = 0: a non-finite advantage there gives NaN, which compares false)."""
    return indicator(torch.gt, advantage_signs * log_ratio, 0.0)


def within(statistic: Tensor, estimator: str, lower: float | None, upper: float) -> Tensor:
    """0/1: the option keeps this value (k1: a ratio range; tv: a range of p − q; the others: an upper bound)."""
    estimator = statistic_of(estimator)
    if estimator == "k1":  # ratio = exp(−k1) in [L, U]  <=>  −log U ≤ k1 ≤ −log L
        return indicator(torch.ge, statistic, -math.log(upper)).mul_(indicator(torch.le, statistic, -math.log(lower)))
    if estimator == "tv":  # p − q in [−α, β]
        return indicator(torch.ge, statistic, lower).mul_(indicator(torch.le, statistic, upper))
    return indicator(torch.le, statistic, upper)


@dataclass(frozen=True)
class Layout:
    """Which per-sequence columns the configured options need (named; the core's table schema reduces the
    ``sum_names`` by sum, the ``max_names`` by max and the ``min_names`` by min, across CP ranks)."""

    options: tuple[tuple[str, float | None, float], ...]
    sum_names: tuple[str, ...]
    max_names: tuple[str, ...]
    min_names: tuple[str, ...] = ()
    gated: bool = False  # a directional sequence option: the GATED_SUMS, GATED_MAXES, GATED_MINS columns are there

    @classmethod
    def of(cls, options) -> "Layout":
        sums, maxes, mins = [], [], []
        for option, _, _ in options:
            aggregation, estimator = split_option(option)
            statistic = statistic_of(estimator)
            if aggregation == "token":
                sums.append(f"rejected:{option}")
                maxes.append(f"max:{option}")
                mins.append(f"min:{option}")
            elif aggregation == "seq_max":
                maxes.append(f"max:{statistic}")
            else:
                sums.append(f"sum:{statistic}")
        if any(split_option(o)[0] == "token" for o, _, _ in options):
            sums.append("rejected:any_token_option")
        gated = gates_sequences(options)
        if gated:
            sums += GATED_SUMS
            maxes += GATED_MAXES
            mins += GATED_MINS
        unique = lambda names: tuple(dict.fromkeys(names))  # noqa: E731
        return cls(tuple(options), unique(sums), unique(maxes), unique(mins), gated)


def token_decisions(options, estimators: dict[str, Tensor], out: Tensor | None = None) -> dict[str, Tensor]:
    """0/1 'kept by this option' per token, for the token options; a directional one rejects only the tokens
    moving out (``out``, from ``moving_out``; None in metrics-only mode, where no decision is applied)."""
    kept = {}
    for option, lower, upper in options:
        aggregation, estimator = split_option(option)
        if aggregation != "token":
            continue
        keep = within(estimators[statistic_of(estimator)], estimator, lower, upper)
        kept[option] = 1.0 - (1.0 - keep).mul_(out) if estimator in DIRECTIONAL and out is not None else keep
    return kept


def gated_token_values(out: Tensor, token_pass: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """The per-token values of the GATED_SUMS, GATED_MAXES and GATED_MINS columns: the moving-out tokens, and the
    count, Σw, Σw² and extremes of the passing tokens that stay (``weight``: the token weight where passing, else
    0)."""
    staying = (1.0 - out).mul_(token_pass)
    leaving = 1.0 - staying  # not passing, or moving out: out of the staying extremes
    staying_weight = weight * staying
    return {"n:out": out, "n_pass:in": staying, "sum_w:in": staying_weight, "sum_w2:in": staying_weight.square(),
            "max_w:in": staying_weight - leaving,  # −1 where not staying, as the base max column
            "min_w:in": leaving.mul(3.0e38).add_(staying_weight)}  # 3e38 where not staying, as the base min column


def staying_columns(columns: dict[str, Tensor]) -> dict[str, Tensor]:
    """The base table's kept-token columns of a gated sequence, from its GATED columns (by the table's names)."""
    return {"n_token_pass": columns["n_pass:in"], "sum_token_weight": columns["sum_w:in"],
            "sum_token_weight_sq": columns["sum_w2:in"], "max_token_weight": columns["max_w:in"].clamp(min=-1.0),
            "min_token_weight": columns["min_w:in"]}


def local_columns(layout: Layout, usable: Tensor, estimators: dict[str, Tensor], kept: dict[str, Tensor],
                  per_seq_sum, per_seq_max, per_seq_min, gated: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """This rank's per-sequence columns [B] by name: the layout's sums, maxima and minima (``gated``: the values of
    ``gated_token_values``, with a directional sequence option)."""
    not_usable = (1.0 - usable).mul_(-NO_VALUE)  # pushes non-usable tokens to −3e38 in maxima, +3e38 in minima
    columns = {}
    for name in layout.sum_names:
        kind, what = name.split(":")
        if name in GATED_SUMS:  # (metrics-only: no gate acts, zeros hold the place)
            columns[name] = per_seq_sum(gated[name] if gated else torch.zeros_like(usable))
        elif what == "any_token_option":
            rejected_any = torch.zeros_like(usable)
            for keep in kept.values():
                rejected_any = torch.maximum(rejected_any, 1.0 - keep)
            columns[name] = per_seq_sum(rejected_any.mul_(usable))
        elif kind == "rejected":
            columns[name] = per_seq_sum((1.0 - kept[what]).mul_(usable))
        else:  # sum:k
            columns[name] = per_seq_sum(estimators[what] * usable)
    for names, reduce in ((layout.max_names, per_seq_max), (layout.min_names, per_seq_min)):
        for name in names:
            if name in GATED_MAXES or name in GATED_MINS:
                columns[name] = reduce(gated[name] if gated else torch.zeros_like(usable))
                continue
            _, what = name.split(":")
            value = estimators[statistic_of(split_option(what)[1]) if what.startswith("token") else what]
            columns[name] = reduce(value - not_usable if reduce is per_seq_max else value + not_usable)
    return columns


def sequence_statistic(option: str, columns: dict[str, Tensor], n_usable: Tensor) -> Tensor:
    """The per-sequence statistic [B] of a sequence option from the combined columns (by name)."""
    aggregation, estimator = split_option(option)
    estimator = statistic_of(estimator)
    if aggregation == "seq_max":
        return columns[f"max:{estimator}"].clamp(min=0.0)  # no usable token -> 0
    total = columns[f"sum:{estimator}"]
    return total if aggregation == "seq_sum" else total / n_usable.clamp(min=1.0)


def evaluate(layout: Layout, columns: dict[str, Tensor], n_usable: Tensor, token_values: dict[str, Tensor],
             token_kept: dict[str, Tensor], usable: Tensor, out: Tensor | None = None,
             seq_index: Tensor | None = None):
    """Sequence rejections, the directional sequence options' gate, and every option's metrics.

    Returns a ``Verdict`` (the batch metrics: each option's max and min). ``out``: the moving-out tokens and
    ``seq_index`` each token's sequence, with a directional sequence option. Metric names, for every option:
    rs_<option>_{mean,max,min,masked_token_fraction,masked_seq_fraction}, plus
    rs_divergence_masked_{token,seq}_fraction over all options together.
    """
    seq_reject = torch.zeros_like(n_usable, dtype=torch.bool)
    gate = None
    token_metrics: dict[str, Tensor] = {}
    seq_metrics: dict[str, Tensor] = {}
    batch_metrics: dict[str, Tensor] = {}  # 0-d: broadcast to the tokens as stride-0 views, not gathered per token
    nonempty = n_usable > 0
    moved = columns["n:out"] > 0 if layout.gated else None  # a gated sequence loses a token
    for option, lower, upper in layout.options:
        aggregation, estimator = split_option(option)
        prefix = f"rs_{option}"
        if aggregation == "token":
            token_metrics[f"{prefix}_mean"] = token_values[statistic_of(estimator)]
            token_metrics[f"{prefix}_masked_token_fraction"] = (1.0 - token_kept[option]).mul_(usable)
            seq_metrics[f"{prefix}_masked_seq_fraction"] = (columns[f"rejected:{option}"] > 0).float()
            high, low = columns[f"max:{option}"], columns[f"min:{option}"]
            batch_max, batch_min = _extremes(high, low, nonempty)
        else:
            statistic = sequence_statistic(option, columns, n_usable)
            rejected = (within(statistic, estimator, lower, upper) == 0) & nonempty
            seq_metrics[f"{prefix}_mean"] = statistic
            if estimator in DIRECTIONAL:  # the gate: only the sequence's moving-out tokens are rejected
                gate = rejected if gate is None else gate | rejected
                token_metrics[f"{prefix}_masked_token_fraction"] = rejected.float().index_select(0, seq_index) * out
                seq_metrics[f"{prefix}_masked_seq_fraction"] = (rejected & moved).float()
            else:
                seq_reject |= rejected
                seq_metrics[f"{prefix}_masked_token_fraction"] = rejected.float()  # the whole sequence's tokens
                seq_metrics[f"{prefix}_masked_seq_fraction"] = rejected.float()
            batch_max, batch_min = _extremes(statistic, statistic, nonempty)
        batch_metrics[f"{prefix}_max"], batch_metrics[f"{prefix}_min"] = batch_max, batch_min
    token_rejected = (columns["rejected:any_token_option"] > 0
                      if "rejected:any_token_option" in layout.sum_names else torch.zeros_like(seq_reject))
    any_token = None
    for keep in token_kept.values():
        any_token = (1.0 - keep) if any_token is None else torch.maximum(any_token, 1.0 - keep)
    any_token = any_token.mul(usable) if any_token is not None else torch.zeros_like(usable)
    if gate is not None:  # the gated sequences' moving-out tokens (usable: out is 0 elsewhere)
        any_token = torch.maximum(any_token, gate.float().index_select(0, seq_index) * out)
        token_rejected = token_rejected | (gate & moved)
    seq_metrics["rs_divergence_masked_seq_fraction"] = (seq_reject | token_rejected).float()
    return Verdict(seq_reject, gate, token_metrics, seq_metrics, batch_metrics, any_token)


@dataclass(frozen=True)
class Verdict:
    """What ``evaluate`` decides and measures."""

    seq_reject: Tensor  # [B] bool: rejected whole by a sequence option
    gate: Tensor | None  # [B] bool: a directional sequence option fired (None without one)
    token_metrics: dict[str, Tensor]  # [N]
    seq_metrics: dict[str, Tensor]  # [B]
    batch_metrics: dict[str, Tensor]  # 0-d
    rejected_tokens: Tensor  # [N] 0/1: usable tokens a token option or a fired gate removes


def _extremes(high: Tensor, low: Tensor, selected: Tensor) -> tuple[Tensor, Tensor]:
    """Batch max of ``high`` and min of ``low`` over the selected sequences (0 when none)."""
    top = torch.cat([high.new_full((1,), NO_VALUE), torch.where(selected, high, NO_VALUE)]).amax()
    bottom = torch.cat([low.new_full((1,), -NO_VALUE), torch.where(selected, low, -NO_VALUE)]).amin()
    empty = top <= NO_VALUE / 2
    return torch.where(empty, 0.0, top), torch.where(empty, 0.0, bottom)
