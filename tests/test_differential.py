"""Randomized differential test: random configs x random batches x CP sizes 1, 2, 3, comparing EVERYTHING.

Every case is a valid random ``MisConfig`` (every key drawn, redrawn until ``MisConfig`` accepts it) and a random
micro-batch (0..12 sequences; responses of 0, 1 and up to ~200 tokens; thd and bshd; masks with interior zeros,
fractional values, all-zero masks, several dtypes; NaN / ±inf / fill values in the log-probs, on trained and
untrained tokens; float32/float64 log-probs; a float32/float64/bfloat16/float16 pg_loss; a log-ratio noise scale
from 1e-4 to 1, with heavy-tailed outliers, so that decisions vary). Seeded: every process rebuilds the same cases
from their index; MILES_MIS_DIFFERENTIAL_SEED and MILES_MIS_DIFFERENTIAL_CASES change them for a longer soak run.

- cp = 1 (in every process, for every case): ``compute_mis_weights_with_cp`` is the reference. For a share of
  the cases (case index mod CP size = rank, so that the processes split this work) ``compute_mis_weights_fsdp``,
  ``compute_mis_weights`` (per-sequence lists) and ``compute_mis_weights_packed`` (the config given as a
  Namespace, a ``MisConfig`` or a mapping, in turn) must return the same weights, masks and metrics bit for bit,
  and the reference host the same loss, gradients and metrics through the list and the packed entry points;
  nothing the reference returns is NaN/inf.
- cp = 2 and 3 (one spawn per size): on EVERY rank, the returned pg_loss and its gradient at the rank's
  positions, the WHOLE returned masks (every position, not only the rank's own: a host reducer may divide by
  the returned mask's sum), every metric (same names, local length, values at the rank's positions), and the
  reference host's loss (summed over ranks), gradients and metrics, for the default reducer denominator and for
  ``loss_denominator = "returned-mask"`` when the host has that option.

A rank does not stop at its first mismatch (its peers would wait in the next collective): it records every
mismatch and the worst deviation, and rank 0 raises once with every rank's findings.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE
import torch.distributed as dist
from cp_harness import cp_state, local_positions, shard, spawn

from miles_mis import (MisConfig, compute_mis_weights, compute_mis_weights_fsdp, compute_mis_weights_packed,
                       compute_mis_weights_with_cp, reference_host)
from miles_mis.config import DIVERGENCE_OPTIONS, LEVELS, TIS_MODES
from miles_mis.correction.gate import STATISTICS

# the environment may override both for a longer soak run (the default is sized for ~1 minute on 2 cores)
SEED = int(os.environ.get("MILES_MIS_DIFFERENTIAL_SEED", 20_261_130))
CASES_PER_SIZE = int(os.environ.get("MILES_MIS_DIFFERENTIAL_CASES", 64))  # per CP size, different cases each
RTOL, ATOL = 1e-5, 1e-6  # pg_loss, its gradient and the metrics under CP vs cp = 1
HOST_RTOL = 1e-5  # host loss and metrics: |cp - cp1| <= HOST_RTOL * max(1, |cp1|); gradients: rtol, atol 1e-7
LIST = "miles_mis.compute_mis_weights_with_cp"
PACKED = "miles_mis.compute_mis_weights_packed"
NONFINITE = (float("nan"), float("inf"), float("-inf"), 1e4, -1e4, 2e4, -2e4)  # rejected with their sequence
EXTREME = (-9999.5, -60.0)  # valid log-probs (|log p| < 1e4): a log ratio far beyond the ±20 clamp
EXTREME_FLOAT64 = (-9999.99999999,)  # valid in float64, though float32 rounds it to the fill value -1e4
# Thresholds are drawn either in absolute ranges or relative to the batch's log-ratio noise scale sigma (so that
# each stage rejects some tokens or sequences and keeps others, rather than all or nothing; stages are ANDed).
# Log-widths of the [lower, upper] ratio bounds per level: lower = e^-a, upper = e^b, a and b log-uniform in:
LOG_WIDTH = {"token": (1e-3, 1.0), "sequence": (1e-2, 4.0), "geometric": (1e-4, 0.3)}
K_THRESHOLD = {"token": (1e-7, 0.5), "seq_sum": (1e-5, 30.0), "seq_mean": (1e-7, 0.5), "seq_max": (1e-6, 3.0)}
GATE_THRESHOLD = {"k3": (1e-5, 30.0), "kl": (1e-4, 3.0), "max_abs_log_ratio": (0.1, 60.0)}
PROBABILITY_THRESHOLD = {"tv": (1e-4, 0.5), "dtv": (1e-4, 0.5), "atv": (1e-4, 0.5), "datv": (1e-4, 0.5),
                         "bkl": (1e-6, 1.0), "dbkl": (1e-6, 1.0)}
CERTAIN = (0.0, -0.0, -1e-300, -1e-30)  # log-probs at or next to p = 1, where log(1 − p) is held at −745
TYPICAL_LENGTH = 30  # for the relative draws: |log ratio| at sequence level ~ sigma sqrt(L), geometric sigma / sqrt(L)


# --------------------------------------------------------------------------- random configs
def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return float(f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.6g}")


def _level_scale(sigma: float, level: str) -> float:
    return {"token": sigma, "sequence": sigma * math.sqrt(TYPICAL_LENGTH),
            "geometric": sigma / math.sqrt(TYPICAL_LENGTH)}[level]


def _relative(rng: random.Random, sigma: float | None) -> bool:
    return sigma is not None and rng.random() < 0.6


def _bounds(rng: random.Random, level: str, sigma: float | None = None) -> tuple[float, float]:
    if _relative(rng, sigma):
        scale = _level_scale(sigma, level)
        width = lambda: min(max(scale * _log_uniform(rng, 0.5, 8.0), 1e-6), 5.0)  # noqa: E731
    else:
        width = lambda: _log_uniform(rng, *LOG_WIDTH[level])  # noqa: E731
    return float(f"{math.exp(-width()):.6g}"), float(f"{math.exp(width()):.6g}")


def _k_threshold(rng: random.Random, aggregation: str, sigma: float | None) -> float:
    if _relative(rng, sigma):  # k2, k3 ~ l^2 / 2 per token
        typical = {"token": 0.5, "seq_sum": 0.5 * TYPICAL_LENGTH, "seq_mean": 0.5, "seq_max": 3.0}[aggregation]
        return max(float(f"{typical * sigma ** 2 * _log_uniform(rng, 0.3, 30.0):.6g}"), 1e-12)
    return _log_uniform(rng, *K_THRESHOLD[aggregation])


def _range_value(rng: random.Random, bounds: tuple[float, float]):
    return f"{bounds[0]}_{bounds[1]}" if rng.random() < 0.3 else list(bounds)  # verl's "L_U" spelling too


def _draw_config_values(rng: random.Random, sigma: float | None) -> dict:
    # token-level rejection (token mask mode, token RS, token divergence options) weighted up: under CP it is
    # what a rank cannot decide for another rank's positions alone
    v: dict = {"use_tis": rng.random() < 0.85, "use_rs": rng.random() < 0.55,
               "tis_level": rng.choices(LEVELS, [4, 3, 3])[0], "rs_level": rng.choices(LEVELS, [4, 3, 3])[0],
               "tis_mode": rng.choices(TIS_MODES, [3, 2, 3, 2])[0],
               "tis_batch_normalize": rng.random() < 0.5}
    if rng.random() < 0.15:  # the adaptive bound (truncate only; with use_rs the rs bounds must be explicit)
        v["tis_mode"] = "truncate" if rng.random() < 0.9 else v["tis_mode"]
        v["tis_upper_bound"] = "auto"
        v["tis_auto_target_ess"] = rng.choice([round(rng.uniform(0.3, 1.0), 4), 0.999, 1.0])
        if rng.random() < 0.7:
            low = rng.choice([1.0, round(rng.uniform(1.0, 1.5), 4)])
            high = round(min(low + _log_uniform(rng, 0.01, 19.0), 20.0), 4)
            v["tis_auto_bounds"] = _range_value(rng, (low, high))
        if rng.random() < 0.3:
            v["tis_lower_bound"] = _bounds(rng, v["tis_level"], sigma)[0]
    else:
        lower, upper = _bounds(rng, v["tis_level"], sigma)
        if v["tis_mode"] == "truncate" and rng.random() < 0.1:
            upper = round(rng.uniform(0.5, 1.0), 4)  # truncate has no lower bound: U <= 1 is valid
        style = rng.random()
        if style < 0.15:
            v["tis_bounds"] = _range_value(rng, (lower, upper))
        elif style < 0.3:
            v["tis_upper_bound"] = upper  # lower defaults to 1 / upper
        elif style < 0.95:
            v["tis_lower_bound"], v["tis_upper_bound"] = lower, upper
        # else: the defaults
    if rng.random() < 0.65 or (v.get("tis_upper_bound") == "auto" and v["use_rs"] and rng.random() < 0.9):
        v["rs_lower_bound"], v["rs_upper_bound"] = _bounds(rng, v["rs_level"], sigma)
    if rng.random() < 0.5:
        v["rs_veto_threshold"] = (min(max(float(f"{math.exp(-sigma * _log_uniform(rng, 2.0, 10.0)):.6g}"), 1e-4), 0.3)
                                  if _relative(rng, sigma) else _log_uniform(rng, 1e-4, 0.3))
    if rng.random() < 0.35:
        divergence = {}
        for option in rng.sample(DIVERGENCE_OPTIONS, rng.choice([1, 1, 2, 3])):
            aggregation, estimator = option.rsplit("_", 1)
            if estimator in PROBABILITY_THRESHOLD:  # probability space: a range for tv, an upper bound otherwise
                low, high = PROBABILITY_THRESHOLD[estimator]
                divergence[option] = ([-_log_uniform(rng, low, high), _log_uniform(rng, low, high)]
                                      if estimator in ("tv", "dtv") else _log_uniform(rng, low, high))
            elif estimator == "k1":
                level = {"token": "token", "seq_sum": "sequence", "seq_mean": "geometric"}[aggregation]
                divergence[option] = _range_value(rng, _bounds(rng, level, sigma))
            else:
                divergence[option] = _k_threshold(rng, aggregation, sigma)
        v["rs_divergence"] = divergence
    if rng.random() < 0.5:
        v["metrics_low_prob_threshold"] = round(rng.uniform(0.005, 0.99), 4)
    if rng.random() < 0.2:  # the ratio against π_θ: the list entries get cur_log_probs, the packed current_log_probs
        v["tis_policy"] = "current"
    if rng.random() < 0.15:  # lag-aware bounds and the staleness gate (make_case then always passes lags)
        if rng.random() < 0.5:
            v["tis_upper_bound_by_lag"] = sorted((round(rng.uniform(1.01, 3.0), 3) for _ in range(rng.randint(1, 3))),
                                                 reverse=True)
        else:
            v["rs_max_lag"] = rng.randint(0, 3)
            if rng.random() < 0.5:
                v["rs_max_lag_k3"] = _log_uniform(rng, 1e-6, 1e-1)
    # The *_scope keys stay at micro_batch (their default): "dp" needs a data-parallel group, which neither the
    # single-process entry points nor these CP-only gloo groups have (a dp scope is refused or needs parallel_state.dp).
    return v


def draw_config(rng: random.Random, sigma: float | None = None) -> MisConfig:
    """A random valid config over every key, drawn until MisConfig accepts it; ``sigma``: the batch's log-ratio
    noise scale, which some thresholds are drawn relative to."""
    for _ in range(10_000):
        try:
            return MisConfig(**_draw_config_values(rng, sigma))
        except ValueError:
            continue
    raise RuntimeError("no valid config drawn")


# --------------------------------------------------------------------------- random batches
def _response_length(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.12:
        return 0
    if kind < 0.24:
        return 1
    if kind < 0.45:
        return rng.randint(2, 8)
    if kind < 0.82:
        return rng.randint(9, 60)
    return rng.randint(100, 200)


def _mask(rng: random.Random, gen: torch.Generator, n: int, kind: str) -> torch.Tensor:
    if kind == "zeros" or n == 0:
        return torch.zeros(n)
    if kind == "turns":  # multi-turn: trained model turns, untrained tool outputs in between
        values, on = [], rng.random() < 0.7
        while len(values) < n:
            values += [1.0 if on else 0.0] * rng.randint(1, 20 if on else 12)
            on = not on
        return torch.tensor(values[:n])
    mask = (torch.rand(n, generator=gen) > rng.choice([0.0, 0.1, 0.3, 0.7])).float()
    if kind == "fractional":
        mask = mask * torch.tensor([0.5, 1.0, 2.0, 0.25])[torch.randint(0, 4, (n,), generator=gen)]
    return mask


def draw_batch(rng: random.Random, gen: torch.Generator, fmt: str, sigma: float):
    """(full kwargs of compute_mis_weights_with_cp, pg_loss, host extras, a description of the noise)."""
    num_seqs = rng.randint(0, 12)
    responses = [_response_length(rng) for _ in range(num_seqs)]
    totals = [n + rng.choice([1, rng.randint(1, 8), rng.randint(9, 40)]) for n in responses]
    spans = None
    if fmt == "bshd":
        if rng.random() < 0.6 and totals:  # one padded length for the micro-batch, as a real bshd batch
            spans = [max(totals) + rng.randint(0, 20)] * num_seqs
        else:
            spans = [t + rng.randint(0, 17) for t in totals]
    bias = rng.gauss(0.0, sigma) if rng.random() < 0.5 else 0.0
    spikes = rng.choice([0.0, 0.0, 0.02, 0.1])
    spike_scale = sigma * rng.choice([10.0, 100.0]) + rng.choice([0.0, 0.1, 1.0, 3.0])
    mask_kinds = ["ones", "holes", "turns", "zeros", "fractional"]
    mask_weights = [2, 4, 4, 1, 2]
    dtype = rng.choices([torch.float32, torch.float64, torch.int64, torch.bool], [6, 1, 1, 1])[0]
    train, rollout, masks, clean = [], [], [], []
    for n in responses:
        t = -torch.rand(n, generator=gen) * rng.uniform(0.05, 6.0)
        seq_bias = bias + (rng.gauss(0.0, sigma) if rng.random() < 0.5 else 0.0)
        r = t + sigma * torch.randn(n, generator=gen) + seq_bias
        if n and spikes:  # heavy tails: a few tokens far more off than the rest (token-level rejections, vetoes)
            hit = torch.rand(n, generator=gen) < spikes
            r = torch.where(hit, r + spike_scale * torch.randn(n, generator=gen), r)
        if n and rng.random() < 0.03:  # a far-off token: |log ratio| beyond the ±20 clamp or near it
            r[rng.randrange(n)] += rng.choice([-1, 1]) * rng.uniform(5.0, 40.0)
        kind = rng.choices(mask_kinds, mask_weights)[0]
        m = _mask(rng, gen, n, kind)
        if dtype == torch.bool:
            m = m != 0
        elif dtype == torch.int64:
            m = m.ceil().long()
        else:
            m = m.to(dtype)
        train.append(t)
        rollout.append(r)
        masks.append(m)
        clean.append(t.clone())
    if rng.random() < 0.15:  # float64 log-probs (converted to float32 by the plugin)
        train, rollout = [t.double() for t in train], [r.double() for r in rollout]
    # NaN / ±inf / fill values (SGLang null, engine fill) and extreme valid values, on trained and untrained tokens
    nonempty = [i for i, n in enumerate(responses) if n]
    if nonempty and rng.random() < 0.35:
        for _ in range(rng.randint(1, 3)):
            i = rng.choice(nonempty)
            p = rng.randrange(responses[i])
            target = train if rng.random() < 0.5 else rollout
            target[i][p] = rng.choice(NONFINITE + EXTREME + (EXTREME_FLOAT64 if target[i].dtype == torch.float64
                                                              else ()))
            if rng.random() < 0.5:  # the token trained, or not
                masks[i][p] = 0 if dtype != torch.bool else False
            elif dtype != torch.bool and masks[i][p] == 0:
                masks[i][p] = 1
            elif dtype == torch.bool:
                masks[i][p] = True
    if nonempty and rng.random() < 0.3:  # p = 1 (or next to it) in the trainer's or the engine's log-probs
        for _ in range(rng.randint(1, 4)):
            i = rng.choice(nonempty)
            target = train if rng.random() < 0.5 else rollout
            target[i][rng.randrange(responses[i])] = rng.choice(CERTAIN)
    num_tokens = sum(responses)
    pg_dtype = rng.choices([torch.float32, torch.float64, torch.bfloat16, torch.float16], [6, 1, 1, 1])[0]
    pg_loss = (torch.randn(num_tokens, generator=gen) * rng.choice([0.1, 1.0, 10.0])).to(pg_dtype)
    full = dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks, total_lengths=totals,
                response_lengths=responses, max_seq_lens=spans)
    extras = dict(cotangent=torch.randn(num_tokens, generator=gen).to(pg_dtype),  # d(objective)/d(returned pg_loss)
                  current=[c + 0.05 * torch.randn(c.shape, generator=gen) for c in clean],  # π_θ, always finite
                  advantages=[torch.randn(n, generator=gen) * 0.3 + rng.gauss(0.0, 1.0) for n in responses])
    full["advantages"] = extras["advantages"]  # every entry point gets them (the directional options read them)
    return full, pg_loss, extras, (f"sigma={sigma:.3g}, bias={bias:.3g}, spikes={spikes}x{spike_scale:.3g}, mask "
                                   f"{dtype}, log-probs {train[0].dtype if train else None}, pg_loss {pg_dtype}")


def draw_lags(rng: random.Random, num_seqs: int, needed: bool) -> tuple[dict, str | None]:
    """Each sequence's lag as a host passes it (none, ``version_lags``, or miles' multi-turn ``weight_versions``
    with "default" entries and the trainer's version), and the error every entry point must raise for an invalid
    draw (a call newer than the trainer's version, also where the sample's other calls are older), else None."""
    kind = rng.random()
    if not needed and kind < 0.6:
        return {}, None
    lags = [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(num_seqs)]
    if kind < 0.75:
        return {"version_lags": lags}, None
    current = rng.randint(6, 40)
    versions = []
    for lag in lags:  # the oldest call is lag versions behind; later turns are newer, some "default"
        calls = [current - lag] + [rng.randint(current - lag, current) for _ in range(rng.randint(0, 3))]
        calls = [rng.choice([str(v), v, float(v)]) if rng.random() < 0.9 else "default" for v in calls]
        calls.insert(rng.randrange(len(calls) + 1), str(current - lag))  # at least one numeric oldest call
        versions.append(calls if rng.random() < 0.8 or len(calls) > 1 else calls[0])
    error = None
    if num_seqs and rng.random() < 0.15:  # one turn of one sample from weights the trainer has not made yet
        i = rng.randrange(num_seqs)
        versions[i] = [*(versions[i] if isinstance(versions[i], list) else [versions[i]]), str(current + 1)]
        error = rf"sequence {i}: weight_versions\[{i}\]=.* is newer than current_weight_version"
    return {"weight_versions": versions, "current_weight_version": rng.choice([current, str(current)])}, error


def make_case(index: int) -> SimpleNamespace:
    rng = random.Random(SEED + 7919 * index)
    gen = torch.Generator().manual_seed(SEED + index)
    sigma = _log_uniform(rng, 1e-4, 1.0)  # the batch's log-ratio noise scale
    config = draw_config(rng, sigma)
    gate = rng.sample(STATISTICS, rng.randint(1, 3)) if rng.random() < 0.25 else None
    fmt = rng.choice(["thd", "bshd"])
    full, pg_loss, extras, noise = draw_batch(rng, gen, fmt, sigma)
    needs_lags = config.tis_upper_bound_by_lag is not None or config.rs_max_lag is not None
    lag_kwargs, error = draw_lags(rng, len(full["response_lengths"]), needs_lags)
    full.update(lag_kwargs)
    if config.tis_policy == "current":  # the host's π_θ (the host passes the same with --pass-current-log-probs)
        full["cur_log_probs"] = [c.detach().clone() for c in extras["current"]]
        nonempty = [i for i, n in enumerate(full["response_lengths"]) if n]
        if error is None and nonempty and rng.random() < 0.1:  # one token short: each entry point names its input
            i = rng.choice(nonempty)
            full["cur_log_probs"][i] = full["cur_log_probs"][i][1:]
            error = {"list": rf"sequence {i}: cur_log_probs\[{i}\] has", "packed": r"^current_log_probs has \d+ tokens"}
    if isinstance(error, str):  # a lag error: every entry point and the host raise it
        error = {"list": error, "packed": error, "host": error}
    if gate:  # rs_batch_gate thresholds around this batch's own statistics, so that the gate fires about half the time
        _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=full["train_log_probs"],
                                            rollout_log_probs=full["rollout_log_probs"], loss_masks=full["loss_masks"])
        thresholds = {}
        for name in gate:
            value = float(torch.cat(metrics[f"mis_batch_{name}"])[0]) if sum(full["response_lengths"]) else 0.0
            thresholds[name] = (float(f"{value * _log_uniform(rng, 0.5, 5.0):.6g}") if value > 0
                                else _log_uniform(rng, *GATE_THRESHOLD[name]))
        config = MisConfig(**dict(config.to_dict(), rs_batch_gate=thresholds))
    return SimpleNamespace(index=index, config=config, fmt=fmt, full=full, pg_loss=pg_loss, extras=extras,
                           noise=noise, args=SimpleNamespace(**config.to_dict(), qkv_format=fmt), error=error)


def optional_kwargs(case, flat: bool = False) -> dict:
    """The optional kwargs of the case (lags, the current policy, the advantages) for the list entry points, or
    (``flat``) for the packed one: the per-token lists concatenated, ``cur_log_probs`` as ``current_log_probs``."""
    full = case.full
    out = {key: full[key] for key in ("version_lags", "weight_versions", "current_weight_version", "advantages",
                                      "cur_log_probs") if key in full}
    if flat:
        joined = lambda values: torch.cat(values) if values else torch.zeros(0)  # noqa: E731
        out["advantages"] = joined(out["advantages"])
        if "cur_log_probs" in out:
            out["current_log_probs"] = joined(out.pop("cur_log_probs"))
    return out


def case_indices(size: int) -> range:
    start = (size - 2) * CASES_PER_SIZE
    return range(start, start + CASES_PER_SIZE)


# --------------------------------------------------------------------------- findings
class Findings:
    """Every mismatch of a run, grouped by kind, and the largest relative deviation of a toleranced value."""

    def __init__(self, where: str):
        self.where = where
        self.by_kind: dict[str, list[str]] = {}
        self.worst = (0.0, "none")

    def add(self, case, kind: str, detail: str) -> None:
        self.by_kind.setdefault(kind, []).append(
            f"case {case.index} [{self.where}, {case.fmt}, B={len(case.full['response_lengths'])}, {case.noise}] "
            f"config={case.config.to_dict()}: {detail}")

    def check(self, case, kind: str, ok: bool, detail) -> bool:
        if not ok:
            self.add(case, kind, detail() if callable(detail) else detail)
        return ok

    def close(self, case, kind: str, name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL,
              atol: float = ATOL, index_label=None) -> bool:
        """Elementwise |got - want| <= atol + rtol |want| (equal non-finite values match), tracking the worst."""
        if got.shape != want.shape:
            self.add(case, kind, f"{name}: shape {tuple(got.shape)} vs cp=1 {tuple(want.shape)}")
            return False
        if got.numel() == 0:
            return True
        g, w = got.detach().double(), want.detach().double()
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        excess = ((g - w).abs() / (atol + rtol * w.abs())).nan_to_num(nan=math.inf, posinf=math.inf)
        excess = torch.where(same, torch.zeros_like(excess), excess)
        k = int(excess.argmax())
        value = float(excess[k])
        label = index_label(k) if index_label else f"index {k}"
        if value > self.worst[0]:
            self.worst = (value, f"{name} at {label} in case {case.index} [{self.where}]: got {float(g[k])!r}, cp=1 "
                                 f"{float(w[k])!r} (|diff| = {abs(float(g[k]) - float(w[k])):.3g}, "
                                 f"{value:.3g} x the tolerance)")
        if value > 1.0:
            bad = int((excess > 1.0).sum())
            self.add(case, kind, f"{name}: {bad} of {g.numel()} values differ; worst at {label}: got {float(g[k])!r}, "
                                 f"cp=1 {float(w[k])!r} (|diff| = {abs(float(g[k]) - float(w[k])):.3g}, rtol {rtol}, "
                                 f"atol {atol})")
            return False
        return True

    def close_scalar(self, case, kind: str, name: str, got: float, want: float, rtol: float = HOST_RTOL) -> bool:
        """|got - want| <= rtol max(1, |want|) (the host's sums over ranks), tracking the worst."""
        excess = abs(got - want) / (rtol * max(1.0, abs(want))) if got != want else 0.0
        excess = math.inf if math.isnan(excess) else excess
        if excess > self.worst[0]:
            self.worst = (excess, f"{name} in case {case.index} [{self.where}]: got {got!r}, cp=1 {want!r} "
                                  f"({excess:.3g} x the tolerance)")
        return self.check(case, kind, excess <= 1.0, lambda: f"{name}: summed over the ranks {got!r}, cp=1 {want!r} "
                                                            f"(|diff| = {abs(got - want):.3g}, tolerance {rtol} x "
                                                            f"max(1, |cp=1|))")

    def summary(self, examples: int = 2) -> str:
        lines = []
        for kind, items in sorted(self.by_kind.items()):
            lines.append(f"- {kind}: {len(items)} mismatch(es), e.g.")
            lines += [f"    {item}" for item in items[:examples]]
        return "\n".join(lines)


def documented_product(pg_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """pg_loss x weights as docs/contract.md states it, 0 where the weight is 0."""
    compute = torch.promote_types(pg_loss.dtype, torch.float32)
    product = pg_loss.to(compute) * weights.to(compute)
    if compute != pg_loss.dtype:
        largest = torch.finfo(pg_loss.dtype).max
        product = product.clamp(-largest, largest).to(pg_loss.dtype)
    return torch.where(weights != 0, product, torch.zeros_like(product))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values (NaN matches NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return False


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    diff = (a != b) if a.dtype == b.dtype else (a.double() != b.double())
    if a.is_floating_point():
        diff = diff & ~(torch.isnan(a) & torch.isnan(b))
    nz = diff.nonzero()
    return int(nz[0]) if nz.numel() else -1


def flat_label(case, positions: torch.Tensor | None = None):
    """index in a local (or full, positions None) flat tensor -> 'sequence i, position p'."""
    offsets = [0]
    for n in case.full["response_lengths"]:
        offsets.append(offsets[-1] + n)

    def label(k: int) -> str:
        flat = int(positions[k]) if positions is not None else k
        i = max(j for j in range(len(offsets) - 1) if offsets[j] <= flat) if len(offsets) > 1 else 0
        return f"sequence {i}, response position {flat - offsets[i]} (local index {k})"
    return label


# --------------------------------------------------------------------------- calls
def plugin(case, ps, kwargs=None, pg_loss=None, cotangent=None):
    """compute_mis_weights_with_cp with a pg_loss leaf; returns (pg_loss out, grad of the leaf, masks, metrics)."""
    leaf = (case.pg_loss if pg_loss is None else pg_loss).detach().clone().requires_grad_()
    out, masks, metrics = compute_mis_weights_with_cp(case.args, pg_loss=leaf, parallel_state=ps,
                                                      **(case.full if kwargs is None else kwargs))
    cot = case.extras["cotangent"] if cotangent is None else cotangent
    if out.requires_grad:
        out.backward(cot)
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return out.detach(), grad, masks, metrics


def host_argv(path: str, fmt: str) -> list[str]:
    return ["--use-tis", "--custom-tis-function-path", path, "--qkv-format", fmt]


_BASE_ARGS: dict = {}


def host_args(case, path: str, denominator: str | None):
    key = (path, case.fmt)
    if key not in _BASE_ARGS:
        _BASE_ARGS[key] = reference_host.parse_args(host_argv(path, case.fmt))
    args = copy.copy(_BASE_ARGS[key])
    for name, value in case.config.to_dict().items():  # the YAML keys, as miles sets them on args
        setattr(args, name, value)
    if denominator is not None:
        args.loss_denominator = denominator
    args.pass_current_log_probs = case.config.tis_policy == "current"
    return args


def run_host(case, args, ps, owned=None):
    """reference_host.policy_loss on the full batch (owned None) or this rank's shards: (loss, metrics, flat grads)."""
    full, extras = case.full, case.extras
    pick = (lambda i, t: t) if owned is None else (lambda i, t: t[owned[i]])  # noqa: E731
    current = [pick(i, c).clone().requires_grad_() for i, c in enumerate(extras["current"])]
    batch = dict(loss_masks=full["loss_masks"], response_lengths=full["response_lengths"],
                 total_lengths=full["total_lengths"], max_seq_lens=full["max_seq_lens"],
                 advantages=[pick(i, a) for i, a in enumerate(extras["advantages"])],
                 log_probs=[pick(i, t) for i, t in enumerate(full["train_log_probs"])],
                 rollout_log_probs=[pick(i, t) for i, t in enumerate(full["rollout_log_probs"])],
                 **{key: full[key] for key in ("version_lags", "weight_versions", "current_weight_version")
                    if key in full})
    loss, metrics = reference_host.policy_loss(args, batch, current, parallel_state=ps)
    if loss.requires_grad:
        loss.backward()
    grads = [c.grad if c.grad is not None else torch.zeros_like(c) for c in current]
    flat = torch.cat(grads) if grads else torch.zeros(0)
    return loss.detach().double(), {k: torch.as_tensor(v).detach().double() for k, v in metrics.items()}, flat


def denominators() -> list[str | None]:
    """The host's loss denominators: the input masks' counts (default) and the returned masks' sums."""
    return [None, "returned-mask"]



def compare_masks_exact(case, findings: Findings, kind: str, masks, ref_masks) -> None:
    if not findings.check(case, kind, len(masks) == len(ref_masks), f"{len(masks)} masks vs {len(ref_masks)}"):
        return
    for i, (m, r) in enumerate(zip(masks, ref_masks)):
        if not same_bits(m, r):
            p = first_difference(m, r) if m.shape == r.shape else -1
            findings.add(case, kind, f"sequence {i}: dtype {m.dtype} vs cp=1 {r.dtype}, shape {tuple(m.shape)} vs "
                                     f"{tuple(r.shape)}, first difference at position {p}"
                                     + (f": {m[p].item()!r} vs cp=1 {r[p].item()!r}" if p >= 0 else ""))
            return


def compare_metrics_exact(case, findings: Findings, kind: str, metrics, ref_metrics) -> None:
    if not findings.check(case, kind + " names", sorted(metrics) == sorted(ref_metrics),
                          lambda: f"only here {sorted(set(metrics) - set(ref_metrics))}, only in cp=1 "
                                  f"{sorted(set(ref_metrics) - set(metrics))}"):
        return
    for name in sorted(metrics):
        got, want = metrics[name], ref_metrics[name]
        if not same_bits(got, want):
            p = first_difference(got, want) if got.shape == want.shape else -1
            findings.add(case, f"{kind} {name}", f"{name}: dtype {got.dtype}/{want.dtype}, shape {tuple(got.shape)}/"
                                                 f"{tuple(want.shape)}" + (f", at {flat_label(case)(p)}: "
                                                                           f"{got[p].item()!r} vs {want[p].item()!r}"
                                                                           if p >= 0 else ""))


# --------------------------------------------------------------------------- cp = 1: the entry points agree
def cp1_reference(case):
    """The cp = 1 results every comparison is against: the plugin's (pg_loss out, gradient, masks, metrics) and
    the reference host's (loss, metrics, gradients) per reducer denominator."""
    ps = cp_state(0, 1)
    return plugin(case, ps), {d: run_host(case, host_args(case, LIST, d), ps) for d in denominators()}


def _cp1(what: str) -> str:
    """The finding kind of a cp = 1 check."""
    return f"cp=1 {what}"


def check_entry_points(case, findings: Findings, reference) -> None:
    """At cp = 1: the other entry points (and the host through the packed one) return the reference bit for bit."""
    _check_reference_outputs(case, findings, reference)
    _check_documented_statistics(case, findings, reference)
    _check_fsdp(case, findings, reference)
    weights = _check_weights(case, findings, reference)
    _check_list_and_packed(case, findings, reference, weights)
    _check_host_list_vs_packed(case, findings, reference)


def _check_reference_outputs(case, findings: Findings, reference) -> None:
    full = case.full
    (ref_out, _, ref_masks, ref_metrics), _ = reference
    names = sorted(ref_metrics)
    lengths = full["response_lengths"]
    n = sum(lengths)

    # nothing the reference returns is NaN/inf (README: "nothing turns into NaN"), masks and metrics detached
    for name in names:
        value = ref_metrics[name]
        findings.check(case, _cp1("metric shape"), value.shape == (n,) and value.dtype == torch.float32,
                       lambda: f"{name}: shape {tuple(value.shape)}, dtype {value.dtype}, expected ({n},) float32")
        findings.check(case, _cp1("non-finite metric"), bool(torch.isfinite(value).all()),
                       lambda: f"{name} = {value[~torch.isfinite(value)][:3].tolist()} at "
                               f"{flat_label(case)(int((~torch.isfinite(value)).nonzero()[0]))}")
        findings.check(case, _cp1("metric has autograd graph"), not value.requires_grad, name)
    findings.check(case, _cp1("non-finite pg_loss"), bool(torch.isfinite(ref_out).all()),
                   lambda: f"{ref_out[~torch.isfinite(ref_out)][:3].tolist()}")
    findings.check(case, _cp1("mask list"), len(ref_masks) == len(lengths)
                   and all(m.shape == (k,) and m.dtype == full["loss_masks"][0].dtype and not m.requires_grad
                           for m, k in zip(ref_masks, lengths)),
                   lambda: f"{[(tuple(m.shape), m.dtype, m.requires_grad) for m in ref_masks]}")


def _check_documented_statistics(case, findings: Findings, reference) -> None:
    """Each token-level probability-space option's per-token statistic (``mis_rs_<option>_mean``) equals the
    formula of docs/math.md (tests/reference.py, log(1 − p) held at −745 where p = 1), from the float32 log-probs the
    plugin reads (the numerator: π_θ with ``tis_policy: current``); 0 on tokens that are not usable."""
    from reference import binary_kl

    options = [o for o, _, _ in (case.config.rs_divergence or ()) if o.startswith("token_")
               and o.rsplit("_", 1)[1] in PROBABILITY_THRESHOLD]
    if not options or not case.config.use_tis:
        return
    (_, _, _, ref_metrics), _ = reference
    full = case.full
    numerator = full["cur_log_probs"] if case.config.tis_policy == "current" else full["train_log_probs"]
    flat = lambda values: torch.cat([v.float().double() for v in values]).tolist() if values else []  # noqa: E731
    masks = torch.cat([m.double() for m in full["loss_masks"]]).tolist() if full["loss_masks"] else []
    for option in options:
        statistic = {"dtv": "tv", "dbkl": "bkl"}.get(option.rsplit("_", 1)[1], option.rsplit("_", 1)[1])
        want = []
        for lp, lq, m in zip(flat(numerator), flat(full["rollout_log_probs"]), masks):
            usable = m != 0 and abs(lp) < 1e4 and abs(lq) < 1e4  # NaN compares false
            p, q = (math.exp(min(lp, 0.0)), math.exp(min(lq, 0.0))) if usable else (1.0, 1.0)
            value = {"tv": p - q, "atv": abs(p - q), "bkl": binary_kl(lp, lq) if usable else 0.0}[statistic]
            want.append(value)
        findings.close(case, _cp1("documented statistic"), f"mis_rs_{option}_mean",
                       ref_metrics[f"mis_rs_{option}_mean"], torch.tensor(want, dtype=torch.float64).float(),
                       rtol=1e-5, atol=1e-9, index_label=flat_label(case))


def _check_fsdp(case, findings: Findings, reference) -> None:
    full = case.full
    (ref_out, ref_grad, ref_masks, ref_metrics), _ = reference
    lengths = full["response_lengths"]

    # compute_mis_weights_fsdp: same pg_loss, gradient, masks, metrics
    leaf = case.pg_loss.detach().clone().requires_grad_()
    out, masks, metrics = compute_mis_weights_fsdp(
        case.args, pg_loss=leaf, train_log_probs=full["train_log_probs"], rollout_log_probs=full["rollout_log_probs"],
        loss_masks=full["loss_masks"], total_lengths=full["total_lengths"], response_lengths=lengths,
        **optional_kwargs(case))
    if out.requires_grad:
        out.backward(case.extras["cotangent"])
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    findings.check(case, _cp1("fsdp pg_loss"), same_bits(out.detach(), ref_out),
                   lambda: f"at {flat_label(case)(first_difference(out.detach(), ref_out))}")
    findings.check(case, _cp1("fsdp pg_loss grad"), same_bits(grad, ref_grad),
                   lambda: f"at {flat_label(case)(first_difference(grad, ref_grad))}")
    compare_masks_exact(case, findings, _cp1("fsdp masks"), masks, ref_masks)
    compare_metrics_exact(case, findings, _cp1("fsdp metrics"), metrics, ref_metrics)


def _check_weights(case, findings: Findings, reference):
    """The weights with_cp returns on a pg_loss of ones (None in metrics-only mode), checked against the
    documented product."""
    full = case.full
    ps = cp_state(0, 1)
    (ref_out, _, _, _), _ = reference
    lengths = full["response_lengths"]
    n = sum(lengths)
    use_tis = case.config.use_tis
    weights = None
    # the weights themselves: with_cp on a float32 pg_loss of ones returns them (0 on rejected tokens), and
    # with_cp(pg_loss) is pg_loss x weights as docs/contract.md words it (the product in float32, or float64 for a
    # float64 loss, cast back to pg_loss's dtype, saturating at its largest finite value)
    if use_tis:
        weights = compute_mis_weights_with_cp(case.args, pg_loss=torch.ones(n), parallel_state=ps, **full)[0]
        want = documented_product(case.pg_loss, weights)
        findings.check(case, _cp1("pg_loss x weights"), same_bits(want, ref_out),
                       lambda: f"at {flat_label(case)(first_difference(want, ref_out))}: with_cp(pg_loss) gives "
                               f"{ref_out[first_difference(want, ref_out)].item()!r}, pg_loss "
                               f"{case.pg_loss[first_difference(want, ref_out)].item()!r} x weight "
                               f"{weights[first_difference(want, ref_out)].item()!r} = "
                               f"{want[first_difference(want, ref_out)].item()!r}")
    return weights


def _check_list_and_packed(case, findings: Findings, reference, weights) -> None:
    full = case.full
    (_, _, ref_masks, ref_metrics), _ = reference
    names = sorted(ref_metrics)
    lengths = full["response_lengths"]
    use_tis = case.config.use_tis

    # the config as each kind of args the contract allows: a host Namespace, a MisConfig, a mapping of keys
    forms = (case.args, case.config, case.config.to_dict())

    # compute_mis_weights: per-sequence lists
    w_list, m_list, metric_lists = compute_mis_weights(forms[case.index % 3], train_log_probs=full["train_log_probs"],
                                                       rollout_log_probs=full["rollout_log_probs"],
                                                       loss_masks=full["loss_masks"], **optional_kwargs(case))
    if use_tis:
        if findings.check(case, _cp1("list weights"), w_list is not None and len(w_list) == len(lengths)
                          and all(w.shape == (k,) for w, k in zip(w_list, lengths)),
                          lambda: f"weights {None if w_list is None else [tuple(w.shape) for w in w_list]}"):
            flat = torch.cat(w_list) if w_list else torch.zeros(0)
            findings.check(case, _cp1("list weights"), same_bits(flat, weights),
                           lambda: f"at {flat_label(case)(first_difference(flat, weights))}: "
                                   f"{flat[first_difference(flat, weights)].item()!r} vs with_cp "
                                   f"{weights[first_difference(flat, weights)].item()!r}")
    else:
        findings.check(case, _cp1("list weights"), w_list is None, "metrics-only mode returned weights")
    compare_masks_exact(case, findings, _cp1("list masks"), m_list, ref_masks)
    if findings.check(case, _cp1("list metric names"), sorted(metric_lists) == names,
                      lambda: f"{sorted(set(metric_lists) ^ set(names))}"):
        joined = {}
        for name, parts in metric_lists.items():
            findings.check(case, _cp1("list metric lengths"), [p.numel() for p in parts] == list(lengths),
                           lambda: f"{name}: {[p.numel() for p in parts]} vs {lengths}")
            joined[name] = torch.cat(parts) if parts else torch.zeros(0)
        compare_metrics_exact(case, findings, _cp1("list metrics"), joined, ref_metrics)

    # compute_mis_weights_packed: flat tensors + int64 cu_seqlens
    cat = lambda values, dtype=torch.float32: torch.cat(values) if values else torch.zeros(0, dtype=dtype)  # noqa
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    mask_dtype = full["loss_masks"][0].dtype if lengths else torch.float32
    w_packed, m_packed, metrics_packed = compute_mis_weights_packed(
        forms[(case.index + 1) % 3], train_log_probs=cat(full["train_log_probs"]),
        rollout_log_probs=cat(full["rollout_log_probs"]), loss_mask=cat(full["loss_masks"], mask_dtype),
        cu_seqlens=cu_seqlens, **optional_kwargs(case, flat=True))
    if use_tis:
        findings.check(case, _cp1("packed weights"), w_packed is not None and same_bits(w_packed, weights),
                       lambda: "None" if w_packed is None
                       else f"at {flat_label(case)(first_difference(w_packed, weights))}")
    else:
        findings.check(case, _cp1("packed weights"), w_packed is None, "metrics-only mode returned weights")
    ref_flat = cat(ref_masks, mask_dtype)
    findings.check(case, _cp1("packed mask"), same_bits(m_packed, ref_flat),
                   lambda: f"dtype {m_packed.dtype} vs {ref_flat.dtype}; at "
                           f"{flat_label(case)(first_difference(m_packed, ref_flat))}")
    compare_metrics_exact(case, findings, _cp1("packed metrics"), metrics_packed, ref_metrics)


def _check_host_list_vs_packed(case, findings: Findings, reference) -> None:
    ps = cp_state(0, 1)
    (_, _, _, _), ref_hosts = reference

    # the reference host, list vs packed entry point (same loss, gradients, metrics)
    for denominator in denominators():
        tag = f"[loss_denominator={denominator or 'default'}]"
        loss_l, metrics_l, grads_l = ref_hosts[denominator]
        loss_p, metrics_p, grads_p = run_host(case, host_args(case, PACKED, denominator), ps)
        findings.check(case, _cp1(f"host loss list vs packed {tag}"), same_bits(loss_l, loss_p),
                       lambda: f"{float(loss_l)!r} vs {float(loss_p)!r}")
        findings.check(case, _cp1(f"host loss finite {tag}"), bool(torch.isfinite(loss_l)), f"{float(loss_l)!r}")
        findings.check(case, _cp1(f"host grads list vs packed {tag}"), same_bits(grads_l, grads_p),
                       lambda: f"at {flat_label(case)(first_difference(grads_l, grads_p))}")
        if findings.check(case, _cp1(f"host metric names list vs packed {tag}"), sorted(metrics_l) == sorted(metrics_p),
                          lambda: f"{sorted(set(metrics_l) ^ set(metrics_p))}"):
            for name in metrics_l:
                findings.check(case, _cp1(f"host metric {name} list vs packed {tag}"),
                               same_bits(metrics_l[name], metrics_p[name]),
                               lambda: f"{float(metrics_l[name])!r} vs {float(metrics_p[name])!r}")


def raises(findings: Findings, case, kind: str, pattern: str, call) -> None:
    """``call()`` raises a ValueError whose message matches ``pattern`` (an invalid input drawn on purpose)."""
    import re

    try:
        call()
    except ValueError as error:
        message = str(error)  # the except variable is unbound after the block, where the lambda may run
        findings.check(case, kind, re.search(pattern, message) is not None,
                       lambda: f"raised {message[:300]!r}, expected a match of {pattern!r}")
        return
    except Exception as error:  # noqa: BLE001
        findings.add(case, kind, f"raised {type(error).__name__}: {error}, expected a ValueError ({pattern!r})")
        return
    findings.add(case, kind, f"returned; expected a ValueError matching {pattern!r}")


def check_expected_error(case, findings: Findings, rank: int, size: int) -> None:
    """An invalid draw: on this CP rank (with_cp on its shards, and the host when the error is the host's too) and,
    for this rank's share of the cases, every cp = 1 entry point raise the error naming what is wrong."""
    full, error = case.full, case.error
    kwargs, local_pg, _ = shard(full, case.pg_loss, rank, size, case.fmt)
    raises(findings, case, "invalid input accepted under CP", error["list"],
           lambda: compute_mis_weights_with_cp(case.args, pg_loss=local_pg, parallel_state=cp_state(rank, size),
                                               **kwargs))
    if "host" in error:
        spans = full["max_seq_lens"] if case.fmt == "bshd" else full["total_lengths"]
        owned = [torch.tensor(local_positions(full["total_lengths"][i], n, rank, size, spans[i]), dtype=torch.long)
                 for i, n in enumerate(full["response_lengths"])]
        raises(findings, case, "invalid input accepted by the host under CP", error["host"],
               lambda: run_host(case, host_args(case, LIST, None), cp_state(rank, size), owned))
    if case.index % size != rank:
        return
    lists = dict(train_log_probs=full["train_log_probs"], rollout_log_probs=full["rollout_log_probs"],
                 loss_masks=full["loss_masks"])
    raises(findings, case, _cp1("invalid input accepted by fsdp"), error["list"],
           lambda: compute_mis_weights_fsdp(case.args, pg_loss=case.pg_loss, total_lengths=full["total_lengths"],
                                            response_lengths=full["response_lengths"], **lists,
                                            **optional_kwargs(case)))
    raises(findings, case, _cp1("invalid input accepted by the list entry"), error["list"],
           lambda: compute_mis_weights(case.config, **lists, **optional_kwargs(case)))
    cat = lambda values: torch.cat(values) if values else torch.zeros(0)  # noqa: E731
    mask_dtype = full["loss_masks"][0].dtype if full["loss_masks"] else torch.float32
    raises(findings, case, _cp1("invalid input accepted by the packed entry"), error["packed"],
           lambda: compute_mis_weights_packed(
               case.config, train_log_probs=cat(full["train_log_probs"]),
               rollout_log_probs=cat(full["rollout_log_probs"]),
               loss_mask=torch.cat(full["loss_masks"]) if full["loss_masks"] else torch.zeros(0, dtype=mask_dtype),
               cu_seqlens=torch.tensor([0, *full["response_lengths"]], dtype=torch.int64).cumsum(0),
               **optional_kwargs(case, flat=True)))


# --------------------------------------------------------------------------- cp = 2, 3: every rank equals cp = 1
def check_cp_case(case, rank: int, size: int, findings: Findings, reference) -> None:
    """On this rank of a CP group of ``size``: everything returned equals the cp = 1 ``reference``."""
    full = case.full
    lengths = full["response_lengths"]
    (ref_out, ref_grad, ref_masks, ref_metrics), ref_hosts = reference
    kwargs, local_pg, positions = shard(full, case.pg_loss, rank, size, case.fmt)
    label = flat_label(case, positions)
    out, grad, masks, metrics = plugin(case, cp_state(rank, size), kwargs=kwargs, pg_loss=local_pg,
                                       cotangent=case.extras["cotangent"][positions])

    # pg_loss and its gradient at this rank's positions
    findings.close(case, "pg_loss", "pg_loss", out, ref_out[positions], index_label=label)
    findings.close(case, "pg_loss grad", "d pg_loss", grad, ref_grad[positions], index_label=label)

    # the WHOLE returned masks: every position of every sequence equals cp = 1, with the input dtype
    if findings.check(case, "whole mask", len(masks) == len(ref_masks), f"{len(masks)} masks vs {len(ref_masks)}"):
        owned = set(positions.tolist())
        offset = 0
        for i, (m, r) in enumerate(zip(masks, ref_masks)):
            if not same_bits(m, r):
                p = first_difference(m, r) if m.shape == r.shape else -1
                whose = "owned by" if offset + p in owned else "NOT owned by"
                diff = "" if p < 0 else (
                    f", first difference at response position {p} ({whose} this rank; {int((m != r).sum())} "
                    f"positions differ): got {m[p].item()!r}, cp=1 {r[p].item()!r}, input mask "
                    f"{full['loss_masks'][i][p].item()!r}")
                findings.add(case, "whole mask", f"sequence {i} (response {lengths[i]}, total "
                                                 f"{full['total_lengths'][i]}): dtype {m.dtype} vs cp=1 {r.dtype}, "
                                                 f"shape {tuple(m.shape)} vs {tuple(r.shape)}{diff}")
                break
            if m.requires_grad:
                findings.add(case, "whole mask", f"sequence {i}: the mask has an autograd graph")
            offset += lengths[i]

    # every metric: same names, local length, values at this rank's positions
    if findings.check(case, "metric names", sorted(metrics) == sorted(ref_metrics),
                      lambda: f"only here {sorted(set(metrics) - set(ref_metrics))}, only at cp=1 "
                              f"{sorted(set(ref_metrics) - set(metrics))}"):
        for name in sorted(metrics):
            value = metrics[name]
            if findings.check(case, "metric shape", value.ndim == 1 and value.numel() == positions.numel()
                              and value.dtype == torch.float32 and not value.requires_grad,
                              lambda: f"{name}: shape {tuple(value.shape)}, dtype {value.dtype}, expected "
                                      f"({positions.numel()},) float32 without graph"):
                findings.close(case, f"metric {name}", name, value, ref_metrics[name][positions], index_label=label)

    # the reference host: loss summed over the ranks, gradients at this rank's positions, metrics summed
    spans = full["max_seq_lens"] if case.fmt == "bshd" else full["total_lengths"]
    owned = [torch.tensor(local_positions(full["total_lengths"][i], n, rank, size, spans[i]), dtype=torch.long)
             for i, n in enumerate(lengths)]
    for denominator in denominators():
        tag = f"[loss_denominator={denominator or 'default'}]"
        ref_loss, ref_host_metrics, ref_grads = ref_hosts[denominator]
        loss, host_metrics, grads = run_host(case, host_args(case, LIST, denominator), cp_state(rank, size), owned)
        names = sorted(ref_host_metrics)  # the same list on every rank: the all-reduce below has one size
        missing = [name for name in names if name not in host_metrics]
        findings.check(case, f"host metric names {tag}", not missing and len(host_metrics) == len(names),
                       lambda: f"only here {sorted(set(host_metrics) - set(names))}, only at cp=1 {missing}")
        per_batch = {"opsm_fraction"}  # a per-batch fraction, identical on every rank (not a partial sum)
        values = torch.stack([loss.reshape(())] + [
            host_metrics[name].reshape(()) if name in host_metrics else torch.tensor(math.nan, dtype=torch.float64)
            for name in names])
        summed = values.clone()
        dist.all_reduce(summed)
        findings.close_scalar(case, f"host loss {tag}", f"host loss {tag}", float(summed[0]), float(ref_loss))
        findings.close(case, f"host grad {tag}", f"d loss / d log_probs {tag}", grads, ref_grads[positions],
                       rtol=RTOL, atol=1e-7, index_label=label)
        for k, name in enumerate(names, start=1):
            got = float(values[k]) if name in per_batch else float(summed[k])
            findings.close_scalar(case, f"host metric {name} {tag}", f"host metric {name} {tag}", got,
                                  float(ref_host_metrics[name]))


def cp_worker(rank: int, size: int) -> None:
    logging.getLogger("miles_mis").addHandler(logging.NullHandler())  # the batch gate's warnings: not on stderr
    findings = Findings(f"cp size {size}, rank {rank}")
    for index in case_indices(size):
        case = SimpleNamespace(index=index, fmt="?", full={"response_lengths": []}, noise="?",
                               config=MisConfig())  # for a failure of make_case itself
        reference = None
        try:
            case = make_case(index)  # deterministic: every rank builds (or fails to build) the same case
            if case.error is not None:
                check_expected_error(case, findings, rank, size)
                continue
            reference = cp1_reference(case)
            if index % size == rank:  # the cp = 1 comparisons of the entry points: each rank takes a share
                check_entry_points(case, findings, reference)
        except Exception as error:  # noqa: BLE001 (valid configs and inputs must not raise)
            findings.add(case, "cp=1 raised", f"{type(error).__name__}: {error}")
        try:
            if reference is not None:
                check_cp_case(case, rank, size, findings, reference)
        except Exception as error:  # noqa: BLE001 (the plugin raises on every rank together: keep going)
            findings.add(case, "raised", f"{type(error).__name__}: {error}")
    everyone = [None] * size
    dist.all_gather_object(everyone, (findings.by_kind, findings.worst))
    if rank == 0:
        kinds: dict[str, list[str]] = {}
        for by_kind, _ in everyone:
            for kind, items in by_kind.items():
                kinds.setdefault(kind, []).extend(items)
        worst = max((w for _, w in everyone), key=lambda w: w[0])
        if kinds:
            merged = Findings("")
            merged.by_kind = kinds
            raise AssertionError(f"cp size {size} differs from cp = 1 ({len(kinds)} kinds; largest toleranced "
                                 f"deviation seen: {worst[1]}):\n{merged.summary()}")


DEVICE_CASES = 16  # cases of the in-process check below


def _on_device(case):
    """``case`` with its tensors on the test device (DEVICE, ``pytest --device``)."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(DEVICE)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [t.to(DEVICE) for t in value]
        return value
    return SimpleNamespace(**dict(vars(case), pg_loss=case.pg_loss.to(DEVICE),
                                  full={k: move(v) for k, v in case.full.items()},
                                  extras={k: move(v) for k, v in case.extras.items()}))


def test_cp1_entry_points_agree_on_the_test_device():
    """At cp = 1 in this process, on the test device (``--device``: benchmarks/gpu_check.sh runs it on CUDA; on the
    CPU the CP workers check these cases too): every entry point, and the host through the list and the packed one,
    returns the reference call's outputs bit for bit."""
    logging.getLogger("miles_mis").addHandler(logging.NullHandler())
    findings = Findings(f"cp 1 on {DEVICE}")
    for index in range(DEVICE_CASES):
        case = _on_device(make_case(index))
        if case.error is None:
            check_entry_points(case, findings, cp1_reference(case))
    assert not findings.by_kind, findings.summary()


@pytest.mark.parametrize("size", [2, 3])
def test_every_cp_rank_returns_the_cp1_result(size):
    spawn(cp_worker, size, timeout=120.0 + 5.0 * CASES_PER_SIZE)
