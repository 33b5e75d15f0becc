"""What the analyze report's tables show, read by the Markdown report and the comparison of two dumps: the
whole-dump statistics in report order with what each one is (``STATISTICS``; ``COUNTS`` are sizes, not mismatch),
the bucket tables' headings, columns and notes (``BUCKETS``, ``BUCKET_NOTES``), and which keys and rows a table
takes (``scalar_keys``, ``filled_rows``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .figures import finite_number as _finite

# the whole-dump statistics, in report order, with what each one is
STATISTICS = {
    "files": "dump files read",
    "calls": "calls (dumped training steps)",
    "sequences": "sequences",
    "tokens": "valid tokens (loss mask != 0)",
    "usable_tokens": "valid tokens with finite log-probs on both sides",
    "nonfinite_fraction": "share of valid tokens with a NaN/inf log-prob",
    "nonfinite_engine_fraction": "… NaN/inf in the engine's (rollout) log-prob",
    "nonfinite_trainer_fraction": "… NaN/inf in the trainer's (pi_old) log-prob",
    "k1": "k1: mean of log π_rollout − log π_old",
    "k3": "token k3: mean of ρ − 1 − log ρ, ρ = π_old / π_rollout (estimates KL(π_rollout ‖ π_old))",
    "chi2_token": "token χ²: mean ρ² − 1",
    "mean_abs_log_ratio": "mean |Δ log p| = mean |log ρ|",
    "max_abs_log_ratio": "max |Δ log p|",
    "fraction_ratio_above_2": "share of tokens with ρ > 2",
    "fraction_ratio_below_half": "share of tokens with ρ < 0.5",
    "catastrophic_fraction": "share of tokens with ρ < 1e-4",
    "seq_product_outside_half_two_fraction": "share of sequences whose product ratio leaves [0.5, 2] "
                                             "(|Σ log ρ| > log 2)",
    "mean_response_length": "mean response length (tokens)",
}
COUNTS = frozenset({"files", "calls", "sequences", "tokens", "usable_tokens"})  # sizes, not mismatch

# bucket tables: key -> (heading, bucket column, count column, [(metric, column heading)])
BUCKETS = {
    "by_position": ("By token position", "position", "tokens",
                    [("k3", "k3"), ("k1", "k1"), ("mean_abs_log_ratio", "mean |Δ log p|")]),
    "by_rollout_prob": ("By rollout probability of the sampled token", "rollout probability", "tokens",
                        [("k3", "k3"), ("mean_abs_log_ratio", "mean |Δ log p|")]),
    "by_length": ("By response length", "response length", "sequences",
                  [("k3", "k3"), ("seq_product_outside_half_two_fraction", "sequences outside [0.5, 2]")]),
}
BUCKET_NOTES = {
    "by_position": "The first response token on its own, then log2-spaced position buckets [1, 2), [2, 4), …",
    "by_rollout_prob": "Tokens grouped by the engine's probability of the token it sampled (exp of its log-prob).",
    "by_length": "Sequences grouped by their full response length (log2 buckets); k3 is the mean over their tokens.",
}


def scalar_keys(*dicts: Mapping[str, Any]) -> list[str]:
    """Top-level keys whose value is a number or None: the known ones in report order, then any others."""
    keys = [key for key in STATISTICS if any(key in d for d in dicts)]
    for d in dicts:
        keys += [key for key, value in d.items() if key not in keys and _is_scalar(value)]
    return [key for key in keys if all(_is_scalar(d.get(key)) for d in dicts)]


def _is_scalar(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def filled_rows(rows: Sequence[Mapping], count: str) -> list[Mapping]:
    """The bucket rows with data: a count above 0 (None rows: none)."""
    return [row for row in rows or [] if (_finite(row.get(count)) or 0) > 0]
