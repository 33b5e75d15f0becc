"""Which correction the dumped tokens need: candidate configs run over the dump, and a stated recommendation.

Every candidate is a ``MisConfig`` (``use_tis`` on, but for the metrics-only baseline) run over each call of the
dump exactly as the plugin runs it in training: one call is one micro-batch (the batch normalisation is per
call), and the per-token numbers are those of ``compute_mis_weights`` (the evaluator runs its steps,
``pack_sequences`` then ``correction.correct`` (every stage), without splitting the result
into per-sequence lists; tests/test_advisor.py checks the numbers against ``compute_mis_weights``).

Per candidate, over the valid tokens (loss mask ≠ 0) of the whole dump, with w_t the final weight (after
bounding and the per-call normalisation; 0 on a rejected token; 1 on every valid token in metrics-only mode),
K the kept tokens (still in the modified mask) and N the valid tokens:

- ``kept_token_fraction``     = |K| / N;
- ``kept_sequence_fraction``  = sequences keeping ≥ 1 token / sequences with ≥ 1 valid token;
- ``ess``                     = (Σ_t w_t)² / (N · Σ_t w_t²)   (0 when Σ w² = 0; 1: uniform, nothing rejected);
- ``mean_final_weight``       = Σ_K w_t / |K|,  ``max_final_weight`` = max_K w_t;
- ``bounded_fraction``        = |{t ∈ K : bounded weight ≠ raw ratio}| / |K|  (the weight the bound changed:
                                truncated or clipped, or zeroed by IcePop; before the normalisation);
- ``signal_shift``            = Σ_t |A_t| · |w_t − 1| / Σ_t |A_t|  over valid tokens with an advantage A_t:
                                the |A|-weighted mean change of the per-token policy-gradient signal A_t·w_t
                                against the uncorrected A_t (w = 1, nothing rejected). It is ≥ 0, finite and
                                cannot blow up when mean A ≈ 0 (GRPO advantages average to 0): 0 = unchanged,
                                1 = as much as rejecting every token; 0 when every A_t = 0;
- ``signal_bias``             = Σ_t A_t · (w_t − 1) / Σ_t |A_t|, the signed net change, |bias| ≤ shift;
  both None when the dump holds no advantages (sequences without advantages are left out of both sums;
  NaN/inf advantages count as 0).

Every value is a float, or None where there is nothing to compute it on: never NaN or inf, so the results go
into report.json as they are.

The candidate grid (``candidate_grid``, ~30 configs): token / sequence / geometric levels; truncate, mask and
IcePop modes; the usual constant bounds (token [0.5, 2] and U = 2, sequence [0.5, 2] and U = 2, geometric
[0.999, 1.001] and [0.99, 1.01]); bounds from the dump's own quantiles q of ℓ = log π_old − log π_rollout
(ratio bound exp(q) inside [e^-20, e^20]; two-sided q0.01–q0.99 and q0.001–q0.999 at token level only, since
they are quantiles of token ratios,
truncation at q0.99 and q0.999 when exp(q) > 1: truncating at U ≤ 1 would bound the typical token); veto
variants (1e-4, 1e-6) of the main families; token truncation at U = 2 with a token mask in probability space
(binary TV p − q in [−0.2, 0.2], |p − q| ≤ 0.05, binary KL ≤ 0.01, and prime-rl's directional [−0.2, 0.2], which
reads the dump's advantages: a sequence without them counts as A = 0, never masked); every shipped preset
(``preset:<name>``, ``use_tis`` on unless the preset sets it, so ``preset:metrics_only`` is the uncorrected baseline).

The recommendation (``recommend``) follows stated rules, heuristics and not a guarantee:

1. no valid token, or a non-finite fraction above NONFINITE_LIMIT (0.5) → no recommendation: the log-probs
   are broken (whose, from the engine / trainer fractions);
2. only candidates that correct (``use_tis``) are considered; if the dump holds catastrophic tokens
   (ρ < 1e-4, ``catastrophic_fraction`` > 0), only those with a veto (``rs_veto_threshold``);
3. eligible: kept token fraction ≥ MIN_KEPT_TOKENS (0.95) and kept sequence fraction ≥ MIN_KEPT_SEQUENCES (0.9);
   none eligible → no recommendation (the mismatch is too large to correct: fix the engine);
4. if the engine agrees (k3 < AGREE_K3 = 1e-4, ratio tails outside [0.5, 2] below TAIL_LIMIT = 1e-3, no
   catastrophic token): the cheapest correction, an eligible plain token-level truncation (the one bounding
   fewest tokens, ``token_truncate_U2`` on a tie);
5. otherwise the highest ESS; candidates within ESS_TIE (0.005) of it tie, and the tie goes to the smaller
   bounded fraction, then the smaller signal shift.

Each reason states the numbers that decided it. ``write_config`` writes the chosen config as a YAML file for
``--custom-config-path``, with the reasons and the command line in a comment block.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import Tensor

from .. import correction
from ..inputs.advantages import needed as reads_advantages
from ..config import RATIO_MAX, RATIO_MIN, MisConfig, preset_files, yaml_value
from ..correction import staleness
from ..inputs import PackedInputs, pack_sequences
from ..tensors import PackedBatch, ops

if TYPE_CHECKING:
    from .reading import CallBatch

NONFINITE_LIMIT = 0.5  # above this fraction of valid tokens with NaN/inf log-probs: broken, no recommendation
MIN_KEPT_TOKENS = 0.95  # an eligible candidate keeps at least this fraction of the valid tokens
MIN_KEPT_SEQUENCES = 0.90  # ... and of the sequences
ESS_TIE = 0.005  # ESS within this of the best: a tie, decided by the bounded fraction, then the signal shift
AGREE_K3 = 1e-4  # token k3 below this (with small tails): the engine agrees with the trainer
TAIL_LIMIT = 1e-3  # fraction of token ratios outside [0.5, 2] still "small tails"
VETO_THRESHOLDS = (1e-4, 1e-6)
CORRECTION_FUNCTION = "miles_mis.compute_mis_weights_with_cp"

RESULT_KEYS = ("kept_token_fraction", "kept_sequence_fraction", "ess", "mean_final_weight", "max_final_weight",
               "bounded_fraction", "signal_shift", "signal_bias")

# (level, mode, (lower, upper)) constant candidates; lower None = truncate (no lower bound)
_CONSTANT = (("token", "truncate", (None, 2.0)), ("token", "mask", (0.5, 2.0)), ("token", "icepop", (0.5, 2.0)),
             ("sequence", "truncate", (None, 2.0)), ("sequence", "mask", (0.5, 2.0)),
             ("geometric", "mask", (0.999, 1.001)), ("geometric", "mask", (0.99, 1.01)))
_QUANTILE_PAIRS = (("0.01", "0.99"), ("0.001", "0.999"))  # two-sided bounds from the dump's quantiles of ℓ
_QUANTILE_UPPERS = ("0.99", "0.999")  # truncation bounds from the dump's upper quantiles of ℓ
_QUANTILE_FAMILIES = (("token", "mask"), ("token", "icepop"))  # token quantiles bound token ratios only
_VETO_BASES = ("token_truncate_U2", "token_mask_0.5_2", "token_icepop_0.5_2", "geometric_mask_0.999_1.001")
# token truncation at U = 2 plus a token mask in probability space (divergence.py): DPPO's binary TV as prime-rl
# writes it, a tighter |p − q|, and the binary KL
_PROBABILITY_MASKS = (("tv0.2", {"token_tv": [-0.2, 0.2]}), ("atv0.05", {"token_atv": 0.05}),
                      ("bkl0.01", {"token_bkl": 0.01}), ("dtv0.2", {"token_dtv": [-0.2, 0.2]}))


# ---------------------------------------------------------------------------------------------- the grid
def candidate_grid(statistics: dict | None = None) -> dict[str, MisConfig]:
    """Name -> config of every candidate (see the module docstring); the quantile candidates need
    ``statistics["quantiles"]`` (quantiles q of ℓ; a missing or None quantile skips its candidates)."""
    quantiles = (statistics or {}).get("quantiles") or {}
    grid: dict[str, MisConfig] = {}
    for level, mode, (lower, upper) in _CONSTANT:
        _add(grid, _name(level, mode, lower, upper), level, mode, lower, upper)
    for key in _QUANTILE_UPPERS:
        upper = _ratio_bound(quantiles.get(key))
        if upper is not None and upper > 1.0:
            _add(grid, f"token_truncate_q{key}", "token", "truncate", None, upper)
    for low_key, high_key in _QUANTILE_PAIRS:
        lower, upper = _ratio_bound(quantiles.get(low_key)), _ratio_bound(quantiles.get(high_key))
        if lower is not None and upper is not None and lower < upper:
            for level, mode in _QUANTILE_FAMILIES:
                _add(grid, f"{level}_{mode}_q{low_key}_{high_key}", level, mode, lower, upper)
    for base in _VETO_BASES:
        for veto in VETO_THRESHOLDS:
            if base in grid:
                _add_config(grid, f"{base}_veto{_short(veto)}",
                            lambda: dataclasses.replace(grid[base], rs_veto_threshold=veto))
    for suffix, options in _PROBABILITY_MASKS:
        if "token_truncate_U2" in grid:
            _add_config(grid, f"token_truncate_U2_{suffix}",
                        lambda: dataclasses.replace(grid["token_truncate_U2"], rs_divergence=options))
    for preset in preset_files():
        _add_config(grid, f"preset:{preset}", lambda: MisConfig.preset(preset, use_tis=True))
    return grid


def _ratio_bound(quantile: Any) -> float | None:
    """exp(q) inside [e^-20, e^20]; None for a missing or non-finite quantile."""
    if quantile is None or not isinstance(quantile, (int, float)) or not math.isfinite(quantile):
        return None
    return min(max(math.exp(max(min(float(quantile), 20.0), -20.0)), RATIO_MIN), RATIO_MAX)


def _add(grid: dict, name: str, level: str, mode: str, lower: float | None, upper: float) -> None:
    _add_config(grid, name, lambda: MisConfig(use_tis=True, tis_level=level, tis_mode=mode,
                                              tis_lower_bound=lower, tis_upper_bound=upper))


def _add_config(grid: dict, name: str, build) -> None:
    """Add ``build()`` under ``name``; a config MisConfig refuses (bounds out of range or in the wrong order)
    is skipped."""
    try:
        grid[name] = build()
    except ValueError:
        pass


def _name(level: str, mode: str, lower: float | None, upper: float) -> str:
    return f"{level}_{mode}_U{upper:g}" if lower is None else f"{level}_{mode}_{lower:g}_{upper:g}"


def _short(value: float) -> str:
    """1e-4 -> "1e-4" (no zero-padded exponent)."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# ---------------------------------------------------------------------------------------------- evaluation
_SUMS = ("valid", "kept", "bounded", "sequences", "kept_sequences", "sum_w", "sum_w_sq", "abs_adv", "shift",
         "bias", "adv_tokens")  # accumulated over calls in float64


@dataclass
class _Prepared:
    """One call's tokens, packed once for every candidate, and its sums that no candidate changes."""

    packed: PackedInputs  # the call's tokens, validated and packed as the plugin packs them
    advantages: Tensor  # [N] float32 A_t on valid tokens with an advantage, else 0 (NaN/inf advantages: 0)
    abs_advantages: Tensor  # [N] |A_t|
    sums: dict[str, float]  # valid, sequences, abs_adv, adv_tokens
    directional: PackedBatch  # the packed batch with the advantages' signs, for the directional candidates
    lags: Tensor | None = None  # [B] int64 each sequence's version lag, when the dump has every one of them
    lag_mean: float = 0.0  # their mean, as the plugin takes it from the host's list


class CandidateEvaluator:
    """Run every candidate over the dump one call at a time and accumulate the sums of its results.

    ``update`` takes a CallBatch of one or more calls and runs each call separately (one call = one
    micro-batch, as in training), so feeding the calls one by one or all at once gives the same results (up to
    float64 rounding). Splitting one call over several updates changes only the candidates whose weights depend
    on the micro-batch (``tis_batch_normalize``). Candidates with equal configs are computed once.
    """

    def __init__(self, candidates: dict[str, MisConfig]):
        self.candidates = dict(candidates)
        self._unique: dict[str, MisConfig] = {}  # config key -> config
        self._key_of: dict[str, str] = {}  # candidate name -> config key
        for name, config in self.candidates.items():
            key = repr(sorted(config.to_dict().items()))
            self._unique.setdefault(key, config)
            self._key_of[name] = key
        self._sums = {key: dict.fromkeys(_SUMS, 0.0) for key in self._unique}
        self._max = dict.fromkeys(self._unique, None)

    def update(self, batch: CallBatch) -> None:
        """Add the sequences of ``batch`` (a CallBatch), one call at a time."""
        for indices in _by_call(batch.calls):
            prepared = _prepare(batch, indices)
            for key, config in self._unique.items():
                sums, largest = _call_sums(prepared, config)
                for name, value in sums.items():
                    self._sums[key][name] += value
                if largest is not None:
                    self._max[key] = largest if self._max[key] is None else max(self._max[key], largest)

    def results(self) -> dict[str, dict]:
        """name -> {"config": config.to_dict(), and the RESULT_KEYS}: floats or None, JSON-able."""
        return {name: {"config": config.to_dict(), **_finish(self._sums[key], self._max[key])}
                for name, config in self.candidates.items() for key in (self._key_of[name],)}


def _by_call(calls: Iterable[int]) -> list[list[int]]:
    """Sequence positions grouped by call, calls in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for position, call in enumerate(calls):
        groups.setdefault(call, []).append(position)
    return list(groups.values())


def _prepare(batch: CallBatch, indices: list[int]) -> _Prepared:
    """Pack the sequences ``indices`` of ``batch`` (the plugin's validation and packing) and their advantages."""
    old = [batch.old_log_probs[i] for i in indices]
    packed = pack_sequences(old, [batch.rollout_log_probs[i] for i in indices],
                            [batch.loss_masks[i] for i in indices])
    advantages, present = [], []
    for i, log_probs in zip(indices, old):
        value = batch.advantages[i]
        if value is not None and value.numel() != log_probs.numel():
            raise ValueError(f"call {batch.calls[i]}, sample {batch.indices[i]}: advantages has {value.numel()} "
                             f"tokens but the log-probs have {log_probs.numel()}")
        advantages.append(torch.zeros(log_probs.numel()) if value is None else value.detach().reshape(-1).float().cpu())
        present.append(torch.full((log_probs.numel(),), float(value is not None)))
    device = packed.batch.train_log_probs.device
    valid = (packed.batch.loss_mask != 0).float()
    has = (torch.cat(present) if present else torch.zeros(0)).to(device) * valid
    flat = (torch.cat(advantages) if advantages else torch.zeros(0)).to(device)
    flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0).mul_(has)
    magnitude = flat.abs()
    sums = {"valid": float(valid.sum(dtype=torch.float64)),
            "sequences": float((packed.batch.per_seq_sum(valid) > 0).sum()),
            "abs_adv": float(magnitude.sum(dtype=torch.float64)), "adv_tokens": float(has.sum(dtype=torch.float64))}
    directional = dataclasses.replace(packed.batch, advantage_signs=flat.sign())
    lags = [batch.lags[i] for i in indices]
    if any(lag is None for lag in lags):
        return _Prepared(packed, flat, magnitude, sums, directional)
    return _Prepared(packed, flat, magnitude, sums, directional, torch.tensor(lags, dtype=torch.long, device=device),
                     sum(lags) / len(lags) if lags else 0.0)


def _call_sums(prepared: _Prepared, config: MisConfig) -> tuple[dict[str, float], float | None]:
    """The sums of one call under one config, and the largest final weight over its kept tokens (None: none).

    As ``compute_mis_weights``: the core's pipeline (``correction.correct``) on the packed call, every stage the plugin
    runs (an adaptive bound included). Elementwise in float32, sums accumulated in float64.
    """
    batch = prepared.directional if reads_advantages(config) else prepared.packed.batch
    if staleness.lag_keys_in_use(config):  # a lag-keyed config: the dump's lags, as a host passes them
        staleness.require_lags(config, prepared.lags is not None)
        batch = dataclasses.replace(batch, lags=prepared.lags, lag_mean=prepared.lag_mean)
    result = correction.correct(batch, config)
    keep = result.token_keep  # float 0/1, only on valid tokens (all valid ones in metrics-only mode)
    # 0 where rejected; metrics-only: the valid tokens' 0/1, which token_keep is then
    weight = result.token_keep if result.weights is None else result.weights
    n_kept = float(keep.sum(dtype=torch.float64))
    sums = dict(prepared.sums, kept=n_kept, bounded=0.0,
                kept_sequences=float((batch.per_seq_sum(keep.float()) > 0).sum()),
                sum_w=float(weight.sum(dtype=torch.float64)), sum_w_sq=float(weight.square().sum(dtype=torch.float64)))
    before = result.metrics.get("mis_tis_weight_before_bound")
    if result.weights is not None and before is not None:
        changed = result.metrics["mis_tis_weight_after_bound"] != before
        sums["bounded"] = float(changed.float().mul_(keep).sum(dtype=torch.float64))
    if prepared.sums["adv_tokens"] > 0:
        change = weight - 1.0
        sums["bias"] = float(torch.mul(prepared.advantages, change).sum(dtype=torch.float64))
        sums["shift"] = float(change.abs_().mul_(prepared.abs_advantages).sum(dtype=torch.float64))
    largest = float(weight.max()) if n_kept > 0 else None  # w ≥ 0 and 0 off the kept tokens
    return sums, largest


def _finish(sums: dict[str, float], largest: float | None) -> dict[str, float | None]:
    """Ratios of the accumulated sums (module docstring); None where the denominator is empty."""
    valid, kept = sums["valid"], sums["kept"]
    ess = None if valid <= 0 else float(ops.ess(*torch.tensor([sums["sum_w"], sums["sum_w_sq"], valid],
                                                               dtype=torch.float64), 0.0))
    if sums["adv_tokens"] == 0:  # no valid token with an advantage
        shift = bias = None
    elif sums["abs_adv"] > 0:
        shift, bias = _ratio(sums["shift"], sums["abs_adv"]), _ratio(sums["bias"], sums["abs_adv"])
    else:  # every advantage is 0: the signal is 0 with or without the correction
        shift = bias = 0.0
    return {
        "kept_token_fraction": _ratio(kept, valid),
        "kept_sequence_fraction": _ratio(sums["kept_sequences"], sums["sequences"]),
        "ess": ess,
        "mean_final_weight": _ratio(sums["sum_w"], kept),
        "max_final_weight": _finite(largest),
        "bounded_fraction": _ratio(sums["bounded"], kept),
        "signal_shift": shift,
        "signal_bias": bias,
    }


def _ratio(numerator: float, denominator: float) -> float | None:
    return _finite(numerator / denominator) if denominator > 0 else None


def _finite(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------- recommendation
@dataclass(frozen=True)
class Recommendation:
    """The chosen candidate (None, None when nothing can be recommended) and the reasons, in plain words."""

    name: str | None
    config: MisConfig | None
    reasons: list[str]


def recommend(statistics: dict, results: dict) -> Recommendation:
    """Apply the stated rules of the module docstring to the dump's statistics and the candidates' results."""
    reasons: list[str] = []
    tokens = statistics.get("tokens") or 0
    if tokens <= 0:
        return Recommendation(None, None, ["the dump holds no valid token (every loss mask is 0): nothing to judge"])
    nonfinite = statistics.get("nonfinite_fraction") or 0.0
    if nonfinite > NONFINITE_LIMIT:
        return Recommendation(None, None, [_broken_reason(statistics)])
    if nonfinite > 0:
        reasons.append(f"{_pct(nonfinite)} of the valid tokens have NaN/inf log-probs ({_whose(statistics)}): "
                       "every candidate rejects their sequences, but the log-probs should be fixed at the source "
                       "(SGLang serialises NaN as null, miles #2662)")

    pool = {name: row for name, row in results.items() if row["config"].get("use_tis")}
    catastrophic = statistics.get("catastrophic_fraction") or 0.0
    if catastrophic > 0:
        pool = {name: row for name, row in pool.items() if row["config"].get("rs_veto_threshold") is not None}
        reasons.append(f"{_pct(catastrophic)} of the usable tokens are catastrophic (ratio below 1e-4, the "
                       f"engine gave them far more probability than the trainer): only the {len(pool)} candidates "
                       "with a veto (rs_veto_threshold), which reject such sequences whole, are considered")
    eligible = {name: row for name, row in pool.items() if _eligible(row)}
    if not eligible:
        return Recommendation(None, None, reasons + [_none_eligible_reason(pool)])

    agreeing = _agreeing_engine(statistics)
    if agreeing is not None:
        name = _cheapest_truncate(eligible)
        if name is not None:
            reasons.append(f"{agreeing} the engine agrees with the trainer, so the cheapest correction is enough: "
                           f"{name} ({_numbers(eligible[name])})")
            return _chosen(name, eligible[name], reasons)

    name, reason = _best_by_ess(eligible)
    reasons.append(reason)
    return _chosen(name, eligible[name], reasons)


def _eligible(row: dict) -> bool:
    tokens, sequences = row.get("kept_token_fraction"), row.get("kept_sequence_fraction")
    return (row.get("ess") is not None and tokens is not None and tokens >= MIN_KEPT_TOKENS
            and sequences is not None and sequences >= MIN_KEPT_SEQUENCES)


def _agreeing_engine(statistics: dict) -> str | None:
    """The numbers that show the engine agrees (k3 < AGREE_K3, tails < TAIL_LIMIT, no catastrophic token), or None."""
    k3 = statistics.get("k3")
    tails = (statistics.get("fraction_ratio_above_2") or 0.0) + (statistics.get("fraction_ratio_below_half") or 0.0)
    if k3 is None or k3 >= AGREE_K3 or tails >= TAIL_LIMIT or (statistics.get("catastrophic_fraction") or 0.0) > 0:
        return None
    if statistics.get("identical_fraction") == 1.0:  # bypass dumps the rollout log-probs as π_old: k3 = 0 by design
        return ("π_old equals the rollout log-probs bit for bit on every token: either a bypass-mode dump "
                "(--use-rollout-logprobs), which hides the mismatch and makes this advice unfounded, or trainer and "
                "engine are bit-identical, and then")
    return (f"token k3 = {_num(k3)} is below {_num(AGREE_K3)} and only {_pct(tails)} of the token ratios leave "
            f"[0.5, 2] (limit {_pct(TAIL_LIMIT)}):")


def _cheapest_truncate(eligible: dict) -> str | None:
    """The eligible plain token-level truncation (no rejection, veto, divergence test nor normalisation) that
    bounds the fewest tokens; token_truncate_U2 on a tie."""
    plain = [name for name, row in eligible.items()
             if _is_plain_token_truncate(row["config"]) and row.get("bounded_fraction") is not None]
    if not plain:
        return None
    return min(plain, key=lambda name: (eligible[name]["bounded_fraction"], name != "token_truncate_U2", name))


def _is_plain_token_truncate(config: dict) -> bool:
    return (config.get("tis_level") == "token" and config.get("tis_mode") == "truncate" and not config.get("use_rs")
            and config.get("rs_veto_threshold") is None and not config.get("rs_divergence")
            and not config.get("tis_batch_normalize"))


def _best_by_ess(eligible: dict) -> tuple[str, str]:
    """Highest ESS; within ESS_TIE of it, the smaller bounded fraction, then the smaller signal shift."""
    best = max(row["ess"] for row in eligible.values())
    tied = [name for name, row in eligible.items() if row["ess"] >= best - ESS_TIE]
    chosen = min(tied, key=lambda name: (_or(eligible[name].get("bounded_fraction"), 1.0),
                                         abs(_or(eligible[name].get("signal_shift"), 0.0)), -eligible[name]["ess"],
                                         name))
    row = eligible[chosen]
    reason = (f"{chosen} is chosen among the {len(eligible)} candidates that keep at least {_pct(MIN_KEPT_TOKENS)} "
              f"of the tokens and {_pct(MIN_KEPT_SEQUENCES)} of the sequences: {_numbers(row)}")
    others = sorted((name for name in eligible if name != chosen), key=lambda name: -eligible[name]["ess"])
    if len(tied) > 1:
        rivals = [name for name in tied if name != chosen]
        reason += (f"; {len(tied)} candidates are within {_num(ESS_TIE)} of the best ESS {_fixed(best)}, and it bounds "
                   f"the fewest tokens, then moves the gradient signal least (next: "
                   + ", ".join(f"{name} bounded {_pct(eligible[name].get('bounded_fraction'))}, signal shift "
                               f"{_num(eligible[name].get('signal_shift'))}" for name in rivals[:3]) + ")")
    elif others:
        reason += (f"; it has the highest ESS (next: {others[0]} with ESS {_fixed(eligible[others[0]]['ess'])}, more "
                   f"than {_num(ESS_TIE)} below)")
    return chosen, reason


def _none_eligible_reason(pool: dict) -> str:
    if not pool:
        return "no candidate applies (none corrects with a veto): nothing to recommend"
    best = max(pool, key=lambda name: (_or(pool[name].get("kept_token_fraction"), -1.0),
                                       _or(pool[name].get("kept_sequence_fraction"), -1.0)))
    return (f"no candidate keeps at least {_pct(MIN_KEPT_TOKENS)} of the tokens and {_pct(MIN_KEPT_SEQUENCES)} of the "
            f"sequences (the best, {best}, keeps {_pct(pool[best].get('kept_token_fraction'))} of the tokens and "
            f"{_pct(pool[best].get('kept_sequence_fraction'))} of the sequences): the mismatch is too large to "
            "correct by reweighting; fix the engine (precision, kernels, weight sync) first")


def _broken_reason(statistics: dict) -> str:
    return (f"{_whose(statistics)} log-probs are broken: {_pct(statistics.get('nonfinite_fraction'))} of the valid "
            f"tokens are NaN/inf (engine {_pct(statistics.get('nonfinite_engine_fraction'))}, trainer "
            f"{_pct(statistics.get('nonfinite_trainer_fraction'))}; the limit is {_pct(NONFINITE_LIMIT)}). No "
            "correction can be judged on the rest: fix the log-probs first (SGLang serialises NaN as null, "
            "miles #2662)")


def _whose(statistics: dict) -> str:
    parts = [who for who, key in (("the engine's", "nonfinite_engine_fraction"),
                                  ("the trainer's", "nonfinite_trainer_fraction"))
             if (statistics.get(key) or 0.0) > 0]
    return " and ".join(parts) if parts else "the"


def _chosen(name: str, row: dict, reasons: list[str]) -> Recommendation:
    return Recommendation(name, MisConfig.from_dict(row["config"], source=f"candidate {name}"), reasons)


def _numbers(row: dict) -> str:
    return (f"kept tokens {_pct(row.get('kept_token_fraction'))}, kept sequences "
            f"{_pct(row.get('kept_sequence_fraction'))}, ESS {_fixed(row.get('ess'))}, bounded weights "
            f"{_pct(row.get('bounded_fraction'))}, mean / max final weight {_num(row.get('mean_final_weight'))} / "
            f"{_num(row.get('max_final_weight'))}, signal shift {_num(row.get('signal_shift'))}")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _num(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4g}"


def _fixed(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _pct(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{100 * value:.3g}%" if value == 0 or abs(value) >= 1e-5 else f"{100 * value:.1e}%"


# ---------------------------------------------------------------------------------------------- the YAML file
def write_config(path: str | Path, recommendation: Recommendation, statistics: dict | None = None) -> None:
    """Write the recommended config as a ``--custom-config-path`` YAML file: a comment block (why, how to use it)
    and the keys that make it explicit (``use_tis`` is left to the host's --use-tis flag). The file is read back
    and checked to give the same config. Raises ValueError when there is no recommendation."""
    config = recommendation.config
    if config is None:
        raise ValueError("no recommended config to write: " + " ".join(recommendation.reasons))
    path = Path(path)
    lines = _header(path, recommendation, statistics) + [f"{key}: {yaml_value(value)}" if not isinstance(value, dict)
                                                         else f"{key}:\n" + "\n".join(
                                                             f"  {option}: {yaml_value(threshold)}"
                                                             for option, threshold in value.items())
                                                         for key, value in config_keys(config).items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    loaded = config_keys(MisConfig.from_yaml(path))
    if loaded != config_keys(config):
        raise RuntimeError(f"{path}: the written file reads back as {loaded}, not {config_keys(config)}")


def config_keys(config: MisConfig) -> dict[str, Any]:
    """The keys that make ``config`` explicit: level, mode and bounds always, the rest where they act or differ
    from the defaults (use_tis never: the host's flag decides). Two configs with equal keys correct alike."""
    keys: dict[str, Any] = {"tis_level": config.tis_level, "tis_mode": config.tis_mode}
    if config.tis_mode != "truncate" or config.tis_lower_bound != 1.0 / config.tis_upper_bound:
        keys["tis_lower_bound"] = config.tis_lower_bound
    keys["tis_upper_bound"] = config.tis_upper_bound
    if config.use_rs:
        keys.update(use_rs=True, rs_level=config.rs_level)
    if config.use_rs or (config.rs_lower_bound, config.rs_upper_bound) != (config.tis_lower_bound,
                                                                           config.tis_upper_bound):
        keys.update(rs_lower_bound=config.rs_lower_bound, rs_upper_bound=config.rs_upper_bound)
    if config.rs_veto_threshold is not None:
        keys["rs_veto_threshold"] = config.rs_veto_threshold
    if config.tis_batch_normalize:
        keys["tis_batch_normalize"] = True
        if config.tis_batch_normalize_scope != "micro_batch":
            keys["tis_batch_normalize_scope"] = config.tis_batch_normalize_scope
    if config.rs_divergence:
        keys["rs_divergence"] = config.to_dict()["rs_divergence"]
    return keys


def _header(path: Path, recommendation: Recommendation, statistics: dict | None) -> list[str]:
    text = [f"miles-mis analyze: the recommended correction, {recommendation.name}.", "", "Why:"]
    text += [f"- {reason}" for reason in recommendation.reasons]
    if statistics:
        text += ["", f"The dump: {statistics.get('tokens', 0)} valid tokens in {statistics.get('sequences', 0)} "
                     f"sequences over {statistics.get('calls', 0)} calls; token k3 {_num(statistics.get('k3'))}, "
                     f"max |log ratio| {_num(statistics.get('max_abs_log_ratio'))}, non-finite "
                     f"{_pct(statistics.get('nonfinite_fraction'))}, catastrophic "
                     f"{_pct(statistics.get('catastrophic_fraction'))}."]
    text += ["", "Use it with the host's flags (use_tis is not in this file: the host's --use-tis decides; "
                 f"miles-mis check-config {path} --use-tis shows the effective config):"]
    lines = []
    for line in text:
        wrapped = textwrap.wrap(line, 110, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
        lines += [f"# {part}".rstrip() for part in wrapped] or ["#"]
    return lines + [f"#   --use-tis --custom-tis-function-path {CORRECTION_FUNCTION} --custom-config-path {path}", ""]


