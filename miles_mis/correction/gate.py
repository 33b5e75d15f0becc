"""A batch gate against catastrophic engine batches.

An engine bug or a bad kernel can make a whole micro-batch off-policy (k3 jumps by 10–100×); per-token and
per-sequence rules then still train on most of it. With ``rs_batch_gate: {k3: 0.05}`` (also ``kl``,
``max_abs_log_ratio``; several are ORed), when a statistic of the micro-batch exceeds its threshold, every
weight and mask of the micro-batch is 0 (no gradient from it), ``mis_batch_gated`` is 1 and a warning names
the statistic and its value. Over the usable tokens of every CP rank (and of every DP rank with
``rs_batch_gate_scope: dp``):

    k3                 = Σ_t k3_t / n            (k3_t = ρ_t − ℓ_t − 1 = expm1(clamp(ℓ_t)) − ℓ_t)
    kl                 = Σ_t (−ℓ_t) / n          (mean log π_rollout − log π_train)
    max_abs_log_ratio  = max_t |ℓ_t|

The statistics are reported every call as ``mis_batch_k3``, ``mis_batch_kl`` and
``mis_batch_max_abs_log_ratio``, gate or no gate, so a threshold can be picked from history.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import GATE_STATISTICS as STATISTICS

# STATISTICS (config.GATE_STATISTICS, what rs_batch_gate may name): the statistics the gate computes
__all__ = ["PARTS", "PART_REDUCE", "STATISTICS", "decide", "parts", "statistics"]

PARTS = ("sum_k3", "sum_neg_log_ratio", "n_usable", "max_abs_log_ratio")  # what the statistics are made of
PART_REDUCE = ("sum", "sum", "sum", "max")  # how each part combines over ranks


def parts(sum_k3: Tensor, sum_log_ratio: Tensor, n_usable: Tensor, max_abs_log_ratio: Tensor) -> Tensor:
    """The four numbers of this micro-batch (or rank), float64, in PARTS order."""
    return torch.stack([sum_k3, -sum_log_ratio, n_usable, max_abs_log_ratio]).double()


def statistics(values: Tensor) -> dict[str, Tensor]:
    """The gate's statistics (0-d float32) from PARTS values combined over the scope."""
    k3, kl, _, _ = (values / values[2].clamp(min=1.0)).float().unbind(0)  # (n/n and max/n: unused)
    return {"k3": k3, "kl": kl, "max_abs_log_ratio": values[3].float()}


def decide(stats: dict[str, Tensor], thresholds) -> tuple[bool, str | None]:
    """(gated, message): gated when any configured statistic exceeds its threshold."""
    exceeded = [(name, float(stats[name]), threshold) for name, threshold in thresholds
                if float(stats[name]) > threshold]
    if not exceeded:
        return False, None
    return True, ("miles_mis: micro-batch gated (every weight and mask 0): "
                  + ", ".join(f"{name} = {value:.4g} > {threshold:g}" for name, value, threshold in exceeded))
