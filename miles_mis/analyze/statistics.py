"""Where the mismatch lives: running statistics over a dump, one batch (call) at a time.

With ℓ_t = log π_old(t) − log π_rollout(t) on a usable token (valid, both log-probs inside (−10⁴, 10⁴) as
in the plugin), ρ_t = exp(clamp(ℓ_t, ±20)) and k3_t = max(ρ_t − ℓ_t − 1, 0) (docs/math.md), evaluated as
expm1(clamp(ℓ_t)) − ℓ_t in float64 (estimators.py: e^c − ℓ − 1 cancels when the engines nearly agree):

- whole dump: k1 = mean(−ℓ), k3 = mean(k3_t), χ² = mean(ρ² − 1) with ρ² − 1 = expm1(2·clamp(ℓ)), mean and
  max |ℓ|, tail fractions, non-finite fractions (engine, trainer), sequences whose product ratio leaves
  [0.5, 2] (|Σ ℓ| > log 2);
- by token position (the first response token alone, then [1, 2), [2, 4), … log2 buckets), by the rollout
  probability of the sampled token (fixed buckets), by response length (log2 buckets), and by call (training
  time) with a least-squares trend of the per-call k3;
- a fixed-bin histogram of ℓ (symmetric-log bins) and quantiles of ℓ read from it;
- the worst sequences (highest mean k3), with the per-token values of a window around each one's largest |ℓ|
  (``worst_sequences``: a bounded heap, for the HTML report's token strips);
- by version lag (0, 1, 2, ≥ 3 weight versions behind the trainer), when the dump records lags.

Every statistic is a sum, a count, a maximum or a top-k over tokens or sequences, kept in fixed-size float64
accumulators (per-call rows grow with the number of calls only), so ``update`` may be called with any
partition of the dump into batches and ``result`` is the same (up to float64 rounding).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from ..correction import truncated_sampling as _truncation
from ..correction.staleness import BUCKETS as LAG_BUCKETS
from ..correction.staleness import bucket_of
from ..tensors import ops
from ..tensors.ops import LOG_PROB_BOUND, LOG_RATIO_CLAMP
from .estimators import chi2_terms, k3_terms
from .reading import CallBatch
from .truncation import local_values, summary
from .worst_sequences import WORST, WorstSequences, token_window

POSITION_BUCKETS = 24  # bucket 0: the first token; bucket b ≥ 1: positions [2^(b-1), 2^b)
LENGTH_BUCKETS = 24  # bucket 0: empty responses; bucket b ≥ 1: lengths [2^(b-1), 2^b)
PROB_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99, 1.0)  # rollout probability of the sampled token
# |ℓ| bin edges of the histogram: 20 per decade from 1e-8 to 1e5 (|ℓ| < 2·10⁴ on usable tokens); the
# histogram is symmetric: [−1e-8, 1e-8] in the middle, then the mirrored magnitudes on either side
_MAGNITUDES = [10.0 ** (-8 + k / 20) for k in range(13 * 20 + 1)]
HISTOGRAM_EDGES = [-m for m in reversed(_MAGNITUDES)] + _MAGNITUDES
QUANTILES = ("0.001", "0.01", "0.05", "0.5", "0.95", "0.99", "0.999")
CATASTROPHIC = 1e-4  # ρ below this: a catastrophic token (the veto's usual threshold)

# token sums of the whole dump (float64 accumulators, by name)
_TOTALS = ("valid", "usable", "nonfinite", "nonfinite_engine", "nonfinite_trainer", "sum_k1", "sum_k3",
           "sum_chi2", "sum_abs", "above_2", "below_half", "catastrophic", "sequences", "sequences_usable",
           "sequences_outside", "sum_response_length", "identical")
# per-bucket sums: tokens, Σ k3, Σ k1, Σ |ℓ|
_BUCKET_SUMS = 4


class StatisticsAccumulator:
    """Feed CallBatches with ``update``; ``result()`` is the statistics dict (docs/analyze.md, report.json)."""

    def __init__(self, files: int = 0, warnings: list[str] | None = None):
        self.files = files
        self.warnings = list(warnings or [])
        self.totals = dict.fromkeys(_TOTALS, 0.0)
        self.max_abs = 0.0
        self.by_position = torch.zeros(POSITION_BUCKETS, _BUCKET_SUMS, dtype=torch.float64)
        self.by_prob = torch.zeros(len(PROB_EDGES) - 1, _BUCKET_SUMS, dtype=torch.float64)
        self.by_length = torch.zeros(LENGTH_BUCKETS, 4, dtype=torch.float64)  # sequences, tokens, Σ k3, outside
        self.histogram = torch.zeros(len(HISTOGRAM_EDGES) - 1, dtype=torch.float64)
        # call -> [sequences, valid, usable, nonfinite, Σ k3, Σ k1, max |ℓ|]
        self.by_call: dict[int, list[float]] = defaultdict(lambda: [0.0] * 7)
        # lag bucket (0, 1, 2, 3plus) -> [sequences, tokens, Σ k3, Σ k1, Σ |ℓ|], of the sequences whose lag is known
        self.by_lag = torch.zeros(len(LAG_BUCKETS), 5, dtype=torch.float64)
        self.worst = WorstSequences(WORST)
        self.truncation = torch.zeros(len(_truncation.NAMES), dtype=torch.float64)  # the detector's sums

    # ------------------------------------------------------------------ update
    def update(self, batch: CallBatch) -> None:
        if not batch.calls:
            return
        tokens = token_table(batch)
        self._whole(tokens, batch)
        self.truncation = _truncation_sums(self.truncation, local_values(tokens["ell"], tokens["usable"]))
        usable = tokens["usable"]
        k3, k1, abs_ell = tokens["k3"], -tokens["ell"], tokens["ell"].abs()
        known = usable & (tokens["positions"] >= 0)
        position_bucket = _log2_bucket(tokens["positions"], POSITION_BUCKETS)
        self.by_position += _bucket_sums(position_bucket[known], POSITION_BUCKETS,
                                         k3[known], k1[known], abs_ell[known])
        prob = tokens["rollout"].exp()
        prob_bucket = (torch.bucketize(prob, torch.tensor(PROB_EDGES[1:-1], dtype=torch.float64), right=True))
        self.by_prob += _bucket_sums(prob_bucket[usable], len(PROB_EDGES) - 1, k3[usable], k1[usable],
                                     abs_ell[usable])
        bins = torch.bucketize(tokens["ell"][usable], torch.tensor(HISTOGRAM_EDGES[1:-1], dtype=torch.float64))
        self.histogram += torch.bincount(bins, minlength=self.histogram.numel()).double()
        self._sequences(tokens, batch)

    def _whole(self, tokens: dict[str, Tensor], batch: CallBatch) -> None:
        t, usable, valid = self.totals, tokens["usable"], tokens["valid"]
        ell = tokens["ell"][usable]
        ratio = ell.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        t["valid"] += float(valid.sum())
        t["usable"] += float(usable.sum())
        t["nonfinite"] += float((valid & ~usable).sum())
        t["nonfinite_engine"] += float((valid & ~tokens["rollout_ok"]).sum())
        t["nonfinite_trainer"] += float((valid & ~tokens["old_ok"]).sum())
        t["sum_k1"] += float(-ell.sum())
        t["sum_k3"] += float(tokens["k3"][usable].sum())
        t["sum_chi2"] += float(chi2_terms(ell).sum())  # Σ (ρ² − 1): Σ ρ² then − 1 would cancel near ρ = 1
        t["sum_abs"] += float(ell.abs().sum())
        t["above_2"] += float((ratio > 2).sum())
        t["below_half"] += float((ratio < 0.5).sum())
        t["catastrophic"] += float((ratio < CATASTROPHIC).sum())
        t["identical"] += float((ell == 0).sum())  # bit for bit: bypass dumps the rollout log-probs as π_old
        t["sequences"] += len(batch.calls)
        t["sum_response_length"] += float(sum(batch.response_lengths))
        if ell.numel():
            self.max_abs = max(self.max_abs, float(ell.abs().max()))

    def _sequences(self, tokens: dict[str, Tensor], batch: CallBatch) -> None:
        """Per-sequence sums (one segment sum per column), then per-length buckets, per call, the worst."""
        num_seqs = len(batch.calls)
        seq, usable = tokens["seq"], tokens["usable"].double()
        ell, k3, abs_ell = tokens["ell"], tokens["k3"], tokens["ell"].abs()
        per_seq = torch.zeros(num_seqs, 5, dtype=torch.float64)
        per_seq.index_add_(0, seq, torch.stack([tokens["valid"].double(), usable, ell, k3, -ell], 1))
        n_valid, n_usable, sum_ell, sum_k3, sum_k1 = per_seq.unbind(1)
        max_abs = torch.zeros(num_seqs, dtype=torch.float64).scatter_reduce_(0, seq, abs_ell, "amax")
        # the worst token's position: the first token of the sequence reaching its max |ℓ|
        is_max = (abs_ell == max_abs.index_select(0, seq)) & tokens["usable"]
        token_index = torch.arange(seq.numel())
        first_max = torch.full((num_seqs,), seq.numel(), dtype=torch.long).scatter_reduce_(
            0, seq[is_max], token_index[is_max], "amin")
        has = n_usable > 0
        outside = has & (sum_ell.abs() > math.log(2))
        self.totals["sequences_usable"] += float(has.sum())
        self.totals["sequences_outside"] += float(outside.sum())

        lengths = torch.tensor(batch.response_lengths, dtype=torch.long)
        length_bucket = _log2_bucket(lengths, LENGTH_BUCKETS)
        self.by_length.index_add_(0, length_bucket, torch.stack(
            [torch.ones(num_seqs, dtype=torch.float64), n_usable, sum_k3, outside.double()], 1))

        known = torch.tensor([lag is not None for lag in batch.lags], dtype=torch.bool)
        if bool(known.any()):
            lags = torch.tensor([lag if lag is not None else 0 for lag in batch.lags], dtype=torch.long)
            sum_abs = torch.zeros(num_seqs, dtype=torch.float64).index_add_(0, seq, abs_ell)
            self.by_lag.index_add_(0, bucket_of(lags[known]), torch.stack(
                [torch.ones(num_seqs, dtype=torch.float64), n_usable, sum_k3, sum_k1, sum_abs], 1)[known])

        calls = torch.tensor(batch.calls, dtype=torch.long)
        nonfinite = n_valid - n_usable
        for call in sorted(set(batch.calls)):
            mine = calls == call
            row = self.by_call[call]
            row[0] += float(mine.sum())
            row[1] += float(n_valid[mine].sum())
            row[2] += float(n_usable[mine].sum())
            row[3] += float(nonfinite[mine].sum())
            row[4] += float(sum_k3[mine].sum())
            row[5] += float(sum_k1[mine].sum())
            row[6] = max(row[6], float(max_abs[mine].max()) if bool(mine.any()) else 0.0)

        mean_k3 = torch.where(has, sum_k3 / n_usable.clamp(min=1), torch.full_like(sum_k3, -1.0))
        top = torch.topk(mean_k3, min(WORST, num_seqs)).indices.tolist()
        positions = tokens["positions"]
        starts = torch.cumsum(torch.tensor([0] + [t.numel() for t in batch.old_log_probs]), 0).tolist()
        for i in top:
            call, index, k3_i = batch.calls[i], batch.indices[i], float(mean_k3[i])
            if not bool(has[i]) or not self.worst.would_keep(k3_i, call, index):
                continue
            worst_position = int(positions[first_max[i]]) if int(first_max[i]) < seq.numel() else -1
            window = token_window(batch.old_log_probs[i], batch.rollout_log_probs[i], batch.loss_masks[i],
                                  batch.positions[i], centre=int(first_max[i]) - starts[i])
            self.worst.offer({"call": call, "index": index, "length": batch.response_lengths[i], "k3": k3_i,
                              "max_abs_log_ratio": float(max_abs[i]), "worst_position": worst_position}, window)

    # ------------------------------------------------------------------ result
    def result(self) -> dict:
        t = self.totals
        usable, valid = t["usable"], t["valid"]
        mean = (lambda total: total / usable if usable else None)  # noqa: E731
        fraction = (lambda count: count / valid if valid else 0.0)  # noqa: E731
        by_call = self._by_call()
        by_lag = _lag_rows(self.by_lag)
        return {
            "files": self.files, "calls": len(self.by_call), "sequences": int(t["sequences"]), "tokens": int(valid),
            "usable_tokens": int(usable),
            "nonfinite_fraction": fraction(t["nonfinite"]),
            "nonfinite_engine_fraction": fraction(t["nonfinite_engine"]),
            "nonfinite_trainer_fraction": fraction(t["nonfinite_trainer"]),
            "k1": mean(t["sum_k1"]), "k3": mean(t["sum_k3"]),
            "chi2_token": mean(t["sum_chi2"]),
            "mean_abs_log_ratio": mean(t["sum_abs"]), "max_abs_log_ratio": self.max_abs if usable else None,
            "fraction_ratio_above_2": mean(t["above_2"]), "fraction_ratio_below_half": mean(t["below_half"]),
            "catastrophic_fraction": mean(t["catastrophic"]),
            "identical_fraction": mean(t["identical"]),
            "seq_product_outside_half_two_fraction": (t["sequences_outside"] / t["sequences_usable"]
                                                      if t["sequences_usable"] else None),
            "mean_response_length": t["sum_response_length"] / t["sequences"] if t["sequences"] else 0.0,
            "truncation": summary(self.truncation),
            "by_position": _position_rows(self.by_position),
            "by_rollout_prob": _prob_rows(self.by_prob),
            "by_length": _length_rows(self.by_length),
            "by_call": by_call,
            "by_lag": by_lag,
            "lag_attribution": lag_attribution(by_lag),
            "trend": _trend(by_call),
            "histogram": {"edges": list(HISTOGRAM_EDGES), "counts": [int(c) for c in self.histogram.tolist()]},
            "quantiles": _quantiles(self.histogram),
            "worst_sequences": self.worst.rows(),
            "token_strips": self.worst.strips(),
            "warnings": list(self.warnings),
        }

    def _by_call(self) -> list[dict]:
        rows = []
        for call in sorted(self.by_call):
            sequences, valid, usable, nonfinite, sum_k3, sum_k1, max_abs = self.by_call[call]
            rows.append({"call": call, "sequences": int(sequences), "tokens": int(valid),
                         "k3": sum_k3 / usable if usable else None, "k1": sum_k1 / usable if usable else None,
                         "max_abs_log_ratio": max_abs if usable else None,
                         "nonfinite_fraction": nonfinite / valid if valid else 0.0})
        return rows


# --------------------------------------------------------------------------- token terms of a batch
def _truncation_sums(total: Tensor, values: Tensor) -> Tensor:
    """Two batches' detector vectors combined (sums added, the maxima maxed), as CP ranks' are."""
    return _truncation.combine(torch.stack([total, values]))


def token_table(batch: CallBatch) -> dict[str, Tensor]:
    """The batch's tokens concatenated (float64), with the plugin's notion of a usable token: per token its sequence
    (``seq``), ``valid`` (loss mask ≠ 0), ``usable``, ℓ = old − rollout (``ell``, 0 where not usable) and its k3 term
    (``k3``, 0 where not usable), among others. A batch with no sequence has no table: callers skip it."""
    lengths = torch.tensor([t.numel() for t in batch.old_log_probs], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(batch.calls)), lengths)
    old = torch.cat(batch.old_log_probs).double()
    rollout = torch.cat(batch.rollout_log_probs).double()
    valid = torch.cat(batch.loss_masks) != 0
    old_ok, rollout_ok = old.abs() < LOG_PROB_BOUND, rollout.abs() < LOG_PROB_BOUND  # NaN compares False
    usable = ops.usable_tokens(old, rollout, valid.double()) > 0  # the plugin's one definition
    ell = torch.where(usable, old - rollout, torch.zeros_like(old))
    k3 = k3_terms(ell) * usable  # float64 expm1: exact when the engines nearly agree (estimators.py)
    return {"seq": seq, "valid": valid, "usable": usable, "old_ok": old_ok, "rollout_ok": rollout_ok,
            "ell": ell, "k3": k3, "rollout": torch.where(usable, rollout, torch.zeros_like(rollout)),
            "positions": torch.cat(batch.positions).long()}


def _log2_bucket(values: Tensor, buckets: int) -> Tensor:
    """0 for value 0 (the first token; an empty response); b ≥ 1 for values in [2^(b−1), 2^b); the last bucket
    takes everything beyond."""
    values = values.clamp(min=0)
    bucket = torch.where(values > 0, torch.floor(torch.log2(values.double().clamp(min=1))).long() + 1,
                         torch.zeros_like(values))
    return bucket.clamp(max=buckets - 1)


def _bucket_sums(bucket: Tensor, buckets: int, k3: Tensor, k1: Tensor, abs_ell: Tensor) -> Tensor:
    out = torch.zeros(buckets, _BUCKET_SUMS, dtype=torch.float64)
    return out.index_add_(0, bucket, torch.stack([torch.ones_like(k3), k3, k1, abs_ell], 1))


def _bucket_values(row: Tensor) -> dict:
    tokens, sum_k3, sum_k1, sum_abs = row.tolist()
    return {"tokens": int(tokens), "k3": sum_k3 / tokens if tokens else None, "k1": sum_k1 / tokens if tokens else None,
            "mean_abs_log_ratio": sum_abs / tokens if tokens else None}


def _position_rows(sums: Tensor) -> list[dict]:
    rows = []
    last = int(sums[:, 0].nonzero().max()) if bool((sums[:, 0] > 0).any()) else -1
    for b in range(last + 1):
        start, end = (0, 1) if b == 0 else (2 ** (b - 1), 2 ** b)
        label = "0 (first token)" if b == 0 else (f"[{start}, {end})" if b < POSITION_BUCKETS - 1 else f">= {start}")
        rows.append({"bucket": label, "start": start, "end": end if b < POSITION_BUCKETS - 1 else None,
                     **_bucket_values(sums[b])})
    return rows


def _prob_rows(sums: Tensor) -> list[dict]:
    return [{"bucket": f"[{low:g}, {high:g})" if high < 1 else f"[{low:g}, 1]", "low": low, "high": high,
             **{k: v for k, v in _bucket_values(sums[b]).items() if k != "k1"}}
            for b, (low, high) in enumerate(zip(PROB_EDGES[:-1], PROB_EDGES[1:]))]


def _lag_rows(sums: Tensor) -> list[dict]:
    """The lag buckets that hold a sequence (none when the dump has no lags)."""
    rows = []
    for b, name in enumerate(LAG_BUCKETS):
        sequences, tokens, sum_k3, sum_k1, sum_abs = sums[b].tolist()
        if sequences:
            rows.append({"bucket": "≥ 3" if name == "3plus" else name, "lag": b, "sequences": int(sequences),
                         "tokens": int(tokens), "k3": sum_k3 / tokens if tokens else None,
                         "k1": sum_k1 / tokens if tokens else None,
                         "mean_abs_log_ratio": sum_abs / tokens if tokens else None})
    return rows


def lag_attribution(rows: list[dict]) -> dict | None:
    """The mismatch split by lag, where the data allow it: samples at lag 0 carry no staleness, so their k3 is the
    engine's numerics; a stale bucket's excess over it is attributed to staleness (assuming the numerics do not
    depend on the lag). None without lags; ``numerics_k3`` None without lag-0 samples (nothing to separate by)."""
    if not rows:
        return None
    fresh = next((row for row in rows if row["lag"] == 0 and row["k3"] is not None), None)
    numerics = None if fresh is None else fresh["k3"]
    stale = []
    for row in rows:
        if row["lag"] == 0 or row["k3"] is None:
            continue
        excess = None if numerics is None else max(row["k3"] - numerics, 0.0)
        stale.append({"bucket": row["bucket"], "k3": row["k3"], "staleness_k3": excess,
                      "staleness_share": None if excess is None or row["k3"] <= 0 else excess / row["k3"]})
    return {"numerics_k3": numerics, "stale_buckets": stale}


def _length_rows(sums: Tensor) -> list[dict]:
    rows = []
    present = (sums[:, 0] > 0).nonzero().flatten().tolist()
    for b in present:
        low, high = (0, 1) if b == 0 else (2 ** (b - 1), 2 ** b)
        sequences, tokens, sum_k3, outside = sums[b].tolist()
        rows.append({"bucket": f"[{low}, {high})" if b < LENGTH_BUCKETS - 1 else f">= {low}", "low": low,
                     "high": high if b < LENGTH_BUCKETS - 1 else None, "sequences": int(sequences),
                     "tokens": int(tokens), "k3": sum_k3 / tokens if tokens else None,
                     "seq_product_outside_half_two_fraction": outside / sequences if sequences else None})
    return rows


def _trend(by_call: list[dict]) -> dict:
    """Least-squares slope of the per-call k3 over the call number, and the k3 of the later half of the calls
    (token-weighted) over the earlier half."""
    points = [(row["call"], row["k3"], row["tokens"]) for row in by_call if row["k3"] is not None]
    out = {"k3_slope_per_call": None, "k3_first_half": None, "k3_second_half": None, "growth": None}
    if len(points) >= 2:
        calls = torch.tensor([p[0] for p in points], dtype=torch.float64)
        values = torch.tensor([p[1] for p in points], dtype=torch.float64)
        centred = calls - calls.mean()
        denominator = float(centred.square().sum())
        out["k3_slope_per_call"] = float((centred * (values - values.mean())).sum()) / denominator \
            if denominator > 0 else None
        half = len(points) // 2
        first, second = points[:half], points[half:]
        weighted = (lambda part: sum(p[1] * p[2] for p in part) / sum(p[2] for p in part)  # noqa: E731
                    if sum(p[2] for p in part) else None)
        out["k3_first_half"], out["k3_second_half"] = weighted(first), weighted(second)
        if out["k3_first_half"] and out["k3_second_half"] is not None:
            out["growth"] = out["k3_second_half"] / out["k3_first_half"]
    return out


def _quantiles(histogram: Tensor) -> dict:
    """Quantiles of ℓ from the histogram, linear within a bin (bins are 12 % wide in |ℓ|): None if empty."""
    total = float(histogram.sum())
    if total == 0:
        return dict.fromkeys(QUANTILES)
    cumulative = torch.cumsum(histogram, 0)
    out = {}
    for name in QUANTILES:
        target = float(name) * total
        b = int(torch.searchsorted(cumulative, torch.tensor(target, dtype=torch.float64)))
        b = min(b, histogram.numel() - 1)
        before = float(cumulative[b - 1]) if b > 0 else 0.0
        inside = float(histogram[b])
        share = (target - before) / inside if inside else 0.0
        low, high = HISTOGRAM_EDGES[b], HISTOGRAM_EDGES[b + 1]
        out[name] = low + min(max(share, 0.0), 1.0) * (high - low)
    return out


def compute(batches) -> dict:
    """Statistics of an iterable of CallBatches (a DumpReader's ``batches()`` streams, ``[load_all()]`` does
    it in memory)."""
    accumulator = StatisticsAccumulator()
    for batch in batches:
        accumulator.update(batch)
    return accumulator.result()
