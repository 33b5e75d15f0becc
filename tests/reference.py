"""A slow, readable per-sequence reference implementation, written straight from docs/math.md.

It loops over sequences and tokens in float64 and shares no code with miles_mis.correction, so the
fast path can be checked against it. Returns the same things as ``compute_mis_weights``:
(weights per sequence or None, masks per sequence (the input mask values, 0 on tokens not kept),
metrics name -> per-sequence lists).

Every formula is evaluated so that float64 gives it exactly: k3 = expm1(c) − ℓ and ρ² − 1 = expm1(2c) (no
cancellation when the engines nearly agree), χ²_seq = expm1(2·clamp(L)), and k1 ranges compared in log space
(a sequence's Σ k1 can pass ±709, where exp overflows).
"""

from __future__ import annotations

import math
import struct


CLAMP = 20.0
LOG_PROB_BOUND = 1e4
POSITION_BUCKETS = ((0, 1), (1, 16), (16, 128), (128, 1024), (1024, 8192), (8192, math.inf))


def _clamp(x: float) -> float:
    return min(max(x, -CLAMP), CLAMP)


def _exp(x: float) -> float:
    return math.exp(_clamp(x))


def _k3(ell: float, subtracted: float) -> float:
    """max(e^{clamp(ℓ)} − x − 1, 0) written as expm1(clamp(ℓ)) − x: exact in float64 for tiny log ratios, where
    e^c − c − 1 cancels. ``subtracted`` is ℓ itself (the mismatch k3: k3_kl, location, gate) or clamp(ℓ)
    (the divergence estimator); the two differ only for |ℓ| > 20."""
    return max(math.expm1(_clamp(ell)) - subtracted, 0.0)


def _chi2(ell: float) -> float:
    """ρ² − 1 = expm1(2·clamp(ℓ)), without the cancellation of ρ² − 1 near ρ = 1."""
    return math.expm1(2.0 * _clamp(ell))


def _bound(rho: float, mode: str, lower: float, upper: float) -> tuple[float, bool]:
    """(weight, rejected) for one ratio."""
    if mode == "truncate":
        return min(rho, upper), False
    if mode == "clip":
        return min(max(rho, lower), upper), False
    inside = lower <= rho <= upper
    if mode == "mask":
        return rho, not inside
    if mode == "icepop":
        return (rho if inside else 0.0), False
    raise AssertionError(mode)


def _fractions(prefix: str, mode: str, rho: float, lower: float, upper: float) -> dict[str, float]:
    if mode == "truncate":
        return {f"{prefix}truncate_fraction": float(rho > upper)}
    return {f"{prefix}{mode}_fraction_low": float(rho < lower), f"{prefix}{mode}_fraction_high": float(rho > upper)}


def _estimators(t) -> dict[str, float]:
    """Every estimator of a usable token: k1 of its log ratio, k2 and k3 of its clamped log ratio, and with p = π_train,
    q = π_rollout of the sampled token: tv = p − q, atv = |p − q|, bkl = KL(Bern(q) ‖ Bern(p)) (p = q = 1 if not
    usable)."""
    c = _clamp(t["ell"])
    p, q = math.exp(min(t["train"], 0.0)), math.exp(min(t["rollout"], 0.0))
    return {"k1": -t["ell"], "k2": c * c / 2, "k3": _k3(c, c), "tv": p - q, "atv": abs(p - q),
            "bkl": binary_kl(t["train"], t["rollout"])}


LOG_TINY = -745.0  # docs/math.md: log(1 − p) is held here where p = 1


def _log_one_minus(log_p: float) -> float:
    """log(1 − p) from log p, held at LOG_TINY where p = 1 (1 − p = −expm1(log p) is exact near p = 1)."""
    one_minus = -math.expm1(min(log_p, 0.0))
    return LOG_TINY if one_minus <= 0.0 else max(math.log(one_minus), LOG_TINY)


def binary_kl(log_p: float, log_q: float) -> float:
    """KL(Bern(q) ‖ Bern(p)) as docs/math.md states it: q log(q/p) + (1 − q)(log(1 − q) − log(1 − p)), the second
    term 0 where q = 1, log(1 − ·) held at −745, clipped at 0."""
    log_p, log_q = min(log_p, 0.0), min(log_q, 0.0)
    q, one_minus_q = math.exp(log_q), -math.expm1(log_q)
    tail = one_minus_q * (_log_one_minus(log_q) - _log_one_minus(log_p)) if one_minus_q > 0 else 0.0
    return max(q * (log_q - log_p) + tail, 0.0)


DIRECTIONAL = {"dtv": "tv", "dbkl": "bkl", "datv": "atv"}  # a directional option -> the statistic it reads


def _moves_out(t) -> bool:
    """The token's update moves p_train further from p_rollout: A·ℓ > 0 (DPPO's and VACO's direction)."""
    return t["usable"] and t["adv"] * t["ell"] > 0


def _keeps(estimator: str, value: float, lower, upper) -> bool:
    estimator = DIRECTIONAL.get(estimator, estimator)
    if estimator == "k1":  # the ratio exp(-k1) must lie in [lower, upper]: compared in log space, since
        # a seq_sum k1 beyond ±709 would overflow exp (−log U ≤ k1 ≤ −log L)
        return -math.log(upper) <= value <= -math.log(lower)
    if estimator == "tv":  # p − q in [−α, β]
        return lower <= value <= upper
    return value <= upper


def divergence_reference(cfg, sequences, put):
    """Per-sequence loop over cfg.rs_divergence: (token rejected [[bool]], sequence rejected [bool], token rejected
    by a directional sequence option's gate [[bool]])."""
    token_rejected = [[False] * len(toks) for toks in sequences]
    gated_rejected = [[False] * len(toks) for toks in sequences]
    seq_rejected = [False] * len(sequences)
    any_token = [[False] * len(toks) for toks in sequences]
    for option, lower, upper in cfg.rs_divergence:
        aggregation, estimator = option.rsplit("_", 1)
        directional = estimator in DIRECTIONAL
        name = f"rs_{option}"
        values_per_seq = []
        for i, toks in enumerate(sequences):
            ks = [_estimators(t)[DIRECTIONAL.get(estimator, estimator)] if t["usable"] else 0.0 for t in toks]
            usable = [k for k, t in zip(ks, toks) if t["usable"]]
            if aggregation == "token":
                rejected = [t["usable"] and not _keeps(estimator, k, lower, upper)
                            and (not directional or _moves_out(t)) for k, t in zip(ks, toks)]
                put(f"{name}_mean", i, ks)
                put(f"{name}_masked_token_fraction", i, [float(r) for r in rejected])
                put(f"{name}_masked_seq_fraction", i, [float(any(rejected))] * len(toks))
                for t_index, r in enumerate(rejected):
                    token_rejected[i][t_index] |= r
                    any_token[i][t_index] |= r
                values_per_seq.append(usable)
            else:
                if aggregation == "seq_sum":
                    stat = sum(usable)
                elif aggregation == "seq_mean":
                    stat = sum(usable) / max(len(usable), 1)
                else:
                    stat = max(usable) if usable else 0.0
                rejected = bool(usable) and not _keeps(estimator, stat, lower, upper)
                put(f"{name}_mean", i, [stat] * len(toks))
                values_per_seq.append([stat] if usable else [])
                if directional:  # VACO: the gate removes the sequence's moving-out tokens only
                    removed = [rejected and _moves_out(t) for t in toks]
                    put(f"{name}_masked_token_fraction", i, [float(r) for r in removed])
                    put(f"{name}_masked_seq_fraction", i, [float(any(removed))] * len(toks))
                    for t_index, r in enumerate(removed):
                        gated_rejected[i][t_index] |= r
                        any_token[i][t_index] |= r
                    continue
                seq_rejected[i] |= rejected
                put(f"{name}_masked_token_fraction", i, [float(rejected)] * len(toks))
                put(f"{name}_masked_seq_fraction", i, [float(rejected)] * len(toks))
        flat = [v for vs in values_per_seq for v in vs]
        for i, toks in enumerate(sequences):
            put(f"{name}_max", i, [max(flat) if flat else 0.0] * len(toks))
            put(f"{name}_min", i, [min(flat) if flat else 0.0] * len(toks))
    for i, toks in enumerate(sequences):
        put("rs_divergence_masked_seq_fraction", i, [float(seq_rejected[i] or any(any_token[i]))] * len(toks))
        put("rs_divergence_masked_token_fraction", i,
            [float(seq_rejected[i] or any_token[i][t]) if toks[t]["usable"] or seq_rejected[i] else 0.0
             for t in range(len(toks))])
    return token_rejected, seq_rejected, gated_rejected


def truncation_reference(usable: list, sizes: list | None = None) -> dict[str, float]:
    """The unreplayed-truncation detector (miles_mis/correction/truncated_sampling.py) over the usable tokens, written
    out; with ``sizes`` (each usable token's kept-set size, 0 = not recorded) the sampling-mask metrics too."""
    from miles_mis.correction import truncated_sampling

    ells = [t["ell"] for t in usable]
    nonzero = [e for e in ells if e != 0.0]
    n = len(ells)
    mean = sum(ells) / n if n else 0.0
    variance = max(sum(e * e for e in ells) / n - mean * mean, 0.0) if n else 0.0
    negative = sum(e < 0 for e in nonzero) / len(nonzero) if nonzero else 0.0
    standardized = mean / math.sqrt(variance) if variance > 0 else 0.0
    out = {"log_ratio_negative_fraction": negative, "log_ratio_standardized_mean": standardized,
           "log_ratio_mean": mean,
           "unreplayed_truncation": float(negative >= truncated_sampling.NEGATIVE_FRACTION
                                          and standardized <= -truncated_sampling.STANDARDIZED_MEAN
                                          and mean <= -truncated_sampling.MEAN_SHIFT
                                          and len(nonzero) >= truncated_sampling.MIN_TOKENS)}
    if sizes is not None:
        recorded = [s for s in sizes if s >= 1]
        out.update({"sampling_mask_size_mean": sum(recorded) / len(recorded) if recorded else 0.0,
                    "sampling_mask_size_min": float(min(recorded, default=0)),
                    "sampling_mask_singleton_fraction": sum(s == 1 for s in recorded) / len(recorded)
                    if recorded else 0.0,
                    "sampling_mask_unrecorded_fraction": (len(sizes) - len(recorded)) / n if n else 0.0})
    return out


def batch_level_reference(cfg, sequences, put) -> bool:
    """Where the mismatch lives (location.py) and the batch gate (gate.py), token by token; returns gated."""
    usable = [t for toks in sequences for t in toks if t["usable"]]
    k3 = lambda t: _k3(t["ell"], t["ell"])  # noqa: E731

    def mean_k3(tokens):
        return sum(k3(t) for t in tokens) / len(tokens) if tokens else 0.0

    low = [t for t in usable if t["rollout"] < math.log(cfg.metrics_low_prob_threshold)]
    values = {
        "k3_first_token": mean_k3([t for t in usable if t["position"] == 0]),
        "k3_low_rollout_prob": mean_k3(low),
        "low_rollout_prob_token_fraction": len(low) / len(usable) if usable else 0.0,
        "batch_k3": mean_k3(usable),
        "batch_kl": -sum(t["ell"] for t in usable) / len(usable) if usable else 0.0,
        "batch_max_abs_log_ratio": max((abs(t["ell"]) for t in usable), default=0.0),
    }
    for a, b in POSITION_BUCKETS:
        values[f"k3_position_{a}_{'inf' if b == math.inf else b}"] = mean_k3([t for t in usable
                                                                             if a <= t["position"] < b])
    values.update(truncation_reference(usable))
    exceeded = [name for name, threshold in cfg.rs_batch_gate if values[f"batch_{name}"] > threshold]
    gated = bool(exceeded) and cfg.use_tis
    if cfg.use_tis and cfg.rs_batch_gate:
        values["batch_gated"] = float(gated)
    for name, value in values.items():
        for i, toks in enumerate(sequences):
            put(name, i, [value] * len(toks))
    return gated


def reference(cfg, train_log_probs, rollout_log_probs, loss_masks, lags=None, advantages=None):
    """``lags``: each sequence's version lag, or None (docs/staleness.md: lag-bucket metrics, per-lag bounds, the
    staleness gate); ``advantages``: per sequence, each token's advantage (the directional options read them)."""
    sequences = []
    if advantages is None:
        advantages = [[0.0] * len(m) for m in loss_masks]
    for train_t, rollout_t, mask_t, adv_t in zip(train_log_probs, rollout_log_probs, loss_masks, advantages):
        train = [float(x) for x in train_t.double()]
        rollout = [float(x) for x in rollout_t.double()]
        mask = [float(m) for m in mask_t]
        valid = [m != 0.0 for m in mask]
        tokens = []
        for position, (a, b, v, m, adv) in enumerate(zip(train, rollout, valid, mask, [float(x) for x in adv_t])):
            finite = abs(a) < LOG_PROB_BOUND and abs(b) < LOG_PROB_BOUND  # False for NaN, ±inf, fill values
            usable = v and finite
            ell = (a - b) if usable else 0.0
            tokens.append(dict(valid=v, usable=usable, nonfinite=v and not finite, ell=ell, rho=_exp(ell),
                               train=a if usable else 0.0, rollout=b if usable else 0.0, position=position,
                               mask=m, adv=adv))
        sequences.append(tokens)

    metrics = {}

    def put(name, seq, values):
        metrics.setdefault(f"mis_{name}", [None] * len(sequences))[seq] = values

    # ---- mismatch metrics (per sequence over usable tokens, broadcast)
    for i, toks in enumerate(sequences):
        n = len(toks)
        usable = [t for t in toks if t["usable"]]
        count = max(len(usable), 1)
        mean_train = sum(t["train"] for t in usable) / count
        mean_rollout = sum(t["rollout"] for t in usable) / count
        diff = mean_rollout - mean_train
        sum_ell = sum(t["ell"] for t in usable)
        per_seq = {
            "training_log_ppl": -mean_train, "training_ppl": _exp(-mean_train),
            "rollout_log_ppl": -mean_rollout, "rollout_ppl": _exp(-mean_rollout),
            "kl": diff, "log_ppl_diff": diff, "log_ppl_abs_diff": abs(diff), "ppl_ratio": _exp(diff),
            "k3_kl": sum(_k3(t["ell"], t["ell"]) for t in usable) / count,
            "chi2_token": sum(_chi2(t["ell"]) for t in usable) / count,  # 0 without a usable token
            "chi2_seq": math.expm1(2 * _clamp(sum_ell)),  # (Π ρ)² − 1 = exp(2·clamp(L)) − 1
        }
        for name, value in per_seq.items():
            put(name, i, [value] * n)
        put("nonfinite_token_fraction", i, [float(t["nonfinite"]) for t in toks])

    gated = batch_level_reference(cfg, sequences, put)
    if lags is not None:  # a batch-level value: the mean lag over the sequences
        for i, toks in enumerate(sequences):
            put("version_lag", i, [sum(lags) / len(lags)] * len(toks))
    if not cfg.use_tis:  # the input mask values, unchanged
        masks = [[t["mask"] for t in toks] for toks in sequences]
        if lags is not None:
            lag_reference(sequences, lags, put)
        return None, masks, metrics
    stale = stale_reference(cfg, sequences, lags, put)

    # ---- weights, rejections
    none = [[False] * len(t) for t in sequences]
    div_token_rejected, div_seq_rejected, gated_rejected = (
        divergence_reference(cfg, sequences, put) if cfg.rs_divergence else (none, [False] * len(sequences), none))
    # after the adaptive token-level bound's population (a gate is a sequence decision): with the token rejections
    after_token = [[a or b for a, b in zip(x, y)] for x, y in zip(div_token_rejected, gated_rejected)]

    def level_ratio(level, tok, toks):
        if level == "token":
            return tok["rho"]
        usable = [t for t in toks if t["usable"]]
        sum_ell = sum(t["ell"] for t in usable)
        if level == "sequence":
            return _exp(sum_ell)
        return _exp(sum_ell / max(len(usable), 1))

    if cfg.tis_upper_bound != "auto":
        uppers = [cfg.tis_upper_bound] * len(sequences)
        if cfg.tis_upper_bound_by_lag is not None:
            by_lag = cfg.tis_upper_bound_by_lag
            uppers = [float(struct.unpack("f", struct.pack("f", by_lag[min(lag, len(by_lag) - 1)]))[0])
                      for lag in lags]  # float32, as the fast path holds them
        return _weigh(cfg, sequences, put, metrics, level_ratio, gated, after_token, div_seq_rejected,
                      uppers, stale, lags)
    # ---- the adaptive bound: chosen over the population, then the fixed-bound computation at it
    if cfg.tis_level == "token":  # every token passing the token-level stages (sequence rejections come later)
        population = []
        for i, toks in enumerate(sequences):
            for j, t in enumerate(toks):
                passes = t["usable"] and not div_token_rejected[i][j]
                if cfg.use_rs and cfg.rs_level == "token":
                    passes = passes and cfg.rs_lower_bound <= t["rho"] <= cfg.rs_upper_bound
                if passes:
                    population.append((t["rho"], 1))
    else:  # every kept sequence, counted once per kept token (truncation rejects nothing: any bound will do)
        _, first_masks, _ = _weigh(cfg, sequences, lambda *a: None, {}, level_ratio, gated, after_token,
                                   div_seq_rejected, [math.inf] * len(sequences), stale, None)
        kept_counts = [sum(m != 0.0 for m in mask) for mask in first_masks]
        population = [(level_ratio(cfg.tis_level, None, toks), kept)
                      for toks, kept in zip(sequences, kept_counts) if kept > 0]
    upper, ess_before, ess_after = auto_upper_bound(population, cfg.tis_auto_bounds, cfg.tis_auto_target_ess)
    for name, value in (("tis_upper_bound_effective", upper), ("ess_before_bound", ess_before),
                        ("ess_after_bound", ess_after)):
        for i, toks in enumerate(sequences):
            put(name, i, [value] * len(toks))
    return _weigh(cfg, sequences, put, metrics, level_ratio, gated, after_token, div_seq_rejected,
                  [upper] * len(sequences), stale, lags)


def _ess(population, upper) -> float:
    """Token-weighted ESS of min(ρ, U) over (ρ, count) pairs; 1 for an empty population."""
    total = sum(n for _, n in population)
    first = sum(n * min(rho, upper) for rho, n in population)
    second = sum(n * min(rho, upper) ** 2 for rho, n in population)
    return first ** 2 / (total * second) if total and second > 0 else 1.0


def auto_upper_bound(population, bounds, target) -> tuple[float, float, float]:
    """(U, ESS before, ESS at U): the largest of the 64 geometric candidates (rounded to float32, as the weights
    are) with ESS ≥ target, else the first; by direct evaluation at every candidate."""
    lower, upper = bounds
    candidates = [lower * (upper / lower) ** (j / 63) for j in range(64)]
    candidates[0], candidates[-1] = lower, upper
    candidates = [struct.unpack("f", struct.pack("f", c))[0] for c in candidates]
    chosen = candidates[0]
    for candidate in candidates:
        if _ess(population, candidate) >= target:
            chosen = candidate
    return chosen, _ess(population, math.inf), _ess(population, chosen)


def _weigh(cfg, sequences, put, metrics, level_ratio, gated, div_token_rejected, div_seq_rejected, tis_uppers,
           stale, lags):
    """The weights, masks and metrics of a call whose TIS upper bound of sequence i is ``tis_uppers[i]``;
    ``stale[i]``: the staleness gate rejects it; ``lags``: None, or the lags (for their metrics)."""
    weights, keeps, seq_weights, seq_trained, bounded = [], [], [], [], []
    for i, toks in enumerate(sequences):
        tis_upper = tis_uppers[i]
        seq_rejected = any(t["nonfinite"] for t in toks) or div_seq_rejected[i] or gated or stale[i]
        if cfg.rs_veto_threshold is not None:
            vetoed = any(t["usable"] and t["ell"] < math.log(cfg.rs_veto_threshold) for t in toks)
            seq_rejected = seq_rejected or vetoed
            put("rs_catastrophic_token_fraction", i,
                [float(t["usable"] and t["ell"] < math.log(cfg.rs_veto_threshold)) for t in toks])
            put("rs_catastrophic_seq_fraction", i, [float(vetoed)] * len(toks))

        w_list, keep_list, before, after = [], [], [], []
        fracs = {k: [] for k in _fractions("tis_", cfg.tis_mode, 1.0, 0.0, 2.0)}
        if cfg.use_rs:
            fracs.update({k: [] for k in _fractions("rs_", "mask", 1.0, 0.0, 2.0)})
        seq_level_ratio = {level: level_ratio(level, None, toks) for level in ("sequence", "geometric")}
        for t in toks:
            rho = t["rho"] if cfg.tis_level == "token" else seq_level_ratio[cfg.tis_level]
            w, rejected = _bound(rho, cfg.tis_mode, cfg.tis_lower_bound, tis_upper)
            keep = t["usable"] and not rejected
            for k, v in _fractions("tis_", cfg.tis_mode, rho, cfg.tis_lower_bound, tis_upper).items():
                fracs[k].append(v)
            if cfg.use_rs:
                rs_rho = t["rho"] if cfg.rs_level == "token" else seq_level_ratio[cfg.rs_level]
                keep = keep and cfg.rs_lower_bound <= rs_rho <= cfg.rs_upper_bound
                for k, v in _fractions("rs_", "mask", rs_rho, cfg.rs_lower_bound, cfg.rs_upper_bound).items():
                    fracs[k].append(v)
            keep = keep and not seq_rejected and not div_token_rejected[i][len(keep_list)]
            outside = rho > tis_upper or (cfg.tis_mode != "truncate" and rho < cfg.tis_lower_bound)
            # token level: usable tokens whose ratio left the bound; sequence level: every valid token
            bounded.append(outside and (t["usable"] if cfg.tis_level == "token" else t["valid"]))
            before.append(rho)
            after.append(w)
            w_list.append(w if keep else 0.0)
            keep_list.append(keep)
        put("tis_weight_before_bound", i, before)
        put("tis_weight_after_bound", i, after)
        for k, v in fracs.items():
            put(k, i, v)
        put("is_ratio_mean_after_tis_rs", i, list(w_list))
        weights.append(w_list)
        keeps.append(keep_list)
        if cfg.tis_level != "token":
            seq_weights.append(_bound(seq_level_ratio[cfg.tis_level], cfg.tis_mode, cfg.tis_lower_bound,
                                      tis_upper)[0])
            seq_trained.append(any(keep_list))

    # ---- batch normalisation over what is trained
    if cfg.tis_level == "token":
        kept = [w for ws, ks in zip(weights, keeps) for w, k in zip(ws, ks) if k]
    else:
        kept = [w for w, trained in zip(seq_weights, seq_trained) if trained]
    mean = sum(kept) / len(kept) if kept else 0.0
    factor = mean if (cfg.tis_batch_normalize and mean > 1e-8) else 1.0
    weights = [[w / factor for w in ws] for ws in weights]

    # ---- final statistics
    kept_final = [w for ws, ks in zip(weights, keeps) for w, k in zip(ws, ks) if k]
    n_valid = sum(t["valid"] for toks in sequences for t in toks)
    all_w = [w for ws in weights for w in ws]
    sum_w, sum_w2 = sum(all_w), sum(w * w for w in all_w)
    batch = {
        "batch_norm_factor": factor,
        "is_ratio_batch_min_final": min(kept_final) if kept_final else 0.0,
        "is_ratio_batch_max_final": max(kept_final) if kept_final else 0.0,
        "ess": sum_w ** 2 / (n_valid * sum_w2) if sum_w2 > 0 else 0.0,
    }
    for i, toks in enumerate(sequences):
        put("is_ratio_mean_final", i, list(weights[i]))
        kept_here = [w for w, k in zip(weights[i], keeps[i]) if k]  # miles: per-sequence extremes, 0 if none
        put("is_ratio_min_final", i, [min(kept_here) if kept_here else 0.0] * len(toks))
        put("is_ratio_max_final", i, [max(kept_here) if kept_here else 0.0] * len(toks))
        for name, value in batch.items():
            put(name, i, [value] * len(toks))
    # a kept token keeps its mask value (0.5 stays 0.5), every other token 0
    masks = [[t["mask"] if k else 0.0 for t, k in zip(toks, ks)] for toks, ks in zip(sequences, keeps)]
    if lags is not None:
        lag_reference(sequences, lags, put, weights, keeps, bounded)
    return weights, masks, metrics


LAG_BUCKETS = ("0", "1", "2", "3plus")


def stale_reference(cfg, sequences, lags, put) -> list[bool]:
    """The staleness gate per sequence: lag > rs_max_lag, and (with rs_max_lag_k3) that lag's k3, pooled over the
    usable tokens of every sequence with that lag, above the threshold."""
    if cfg.rs_max_lag is None:
        return [False] * len(sequences)
    pooled = {}
    for lag, toks in zip(lags, sequences):
        k3s = [_k3(t["ell"], t["ell"]) for t in toks if t["usable"]]
        total, count = pooled.get(lag, (0.0, 0))
        pooled[lag] = (total + sum(k3s), count + len(k3s))
    stale = []
    for i, (lag, toks) in enumerate(zip(lags, sequences)):
        total, count = pooled[lag]
        rejected = lag > cfg.rs_max_lag and (cfg.rs_max_lag_k3 is None or total / max(count, 1) > cfg.rs_max_lag_k3)
        stale.append(rejected)
        put("rs_stale_seq_fraction", i, [float(rejected)] * len(toks))
    return stale


def lag_reference(sequences, lags, put, weights=None, keeps=None, bounded=None) -> None:
    """The lag-bucket metrics, each a batch-level value: k3 over the bucket's usable tokens, its share of the valid
    tokens, and with weights the fraction bounded, the fraction rejected and the ESS of the bucket's weights."""
    flat_bounded = iter(bounded or [])
    per_bucket = {b: dict(valid=0, usable=0, k3=0.0, bounded=0, kept=0, w=0.0, w2=0.0) for b in LAG_BUCKETS}
    for i, (lag, toks) in enumerate(zip(lags, sequences)):
        bucket = per_bucket[LAG_BUCKETS[min(lag, 3)]]
        for j, t in enumerate(toks):
            bucket["valid"] += t["valid"]
            bucket["usable"] += t["usable"]
            bucket["k3"] += _k3(t["ell"], t["ell"]) if t["usable"] else 0.0
            if weights is not None:
                bucket["bounded"] += next(flat_bounded)
                bucket["kept"] += keeps[i][j]
                bucket["w"] += weights[i][j]
                bucket["w2"] += weights[i][j] ** 2
    total_valid = sum(b["valid"] for b in per_bucket.values())
    values = {}
    for name, b in per_bucket.items():
        values[f"lag_{name}_k3"] = b["k3"] / max(b["usable"], 1)
        values[f"lag_{name}_token_fraction"] = b["valid"] / max(total_valid, 1)
        if weights is not None:
            values[f"lag_{name}_bounded_fraction"] = b["bounded"] / max(b["valid"], 1)
            values[f"lag_{name}_rejected_fraction"] = 1.0 - b["kept"] / b["valid"] if b["valid"] else 0.0
            values[f"lag_{name}_ess"] = min(b["w"] ** 2 / (b["valid"] * b["w2"]), 1.0) if b["w2"] > 0 else 0.0
    for name, value in values.items():
        for i, toks in enumerate(sequences):
            put(name, i, [value] * len(toks))
