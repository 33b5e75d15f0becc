"""Host-side reduction of the per-token ``mis_`` metrics and a plain-text table, for ``miles-mis plugin-demo``, the
tests and examples/call_like_a_host.py.

``reduce_metrics`` is the contract's reducer: for each sequence, the masked mean of the metric over
its (original) loss-mask tokens, then the mean over sequences (empty sequences count as 0, as
miles' ``sum_of_sample_mean`` does). With ``per_token=True`` it is the masked mean over all tokens.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor


def reduce_metrics(metrics: Mapping[str, Tensor], loss_masks: Sequence[Tensor], *,
                   per_token: bool = False) -> dict[str, float]:
    """The reference host's reducer (``reference_host.Reducer``) divided by the sequence (token) count: a mean."""
    from ..reference_host import Reducer

    lengths = [int(m.numel()) for m in loss_masks]
    if not lengths:
        return {name: 0.0 for name in metrics}
    counts = torch.stack([m.float().sum() for m in loss_masks])
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    reduce = Reducer(loss_masks, counts, seq_index, None, per_token)
    divisor = float(counts.sum().clamp(min=1)) if per_token else float(len(lengths))
    return {name: float(reduce(value.detach().float().cpu())) / divisor for name, value in metrics.items()}


def format_table(rows: Sequence[str], columns: Mapping[str, Mapping[str, float]]) -> str:
    """A fixed-width table: one row per metric, one column per run; '-' where a run has no value."""
    names = list(columns)
    width = max([len(r) for r in rows] + [6])
    col = max([len(n) for n in names] + [10])
    lines = [f"{'metric':<{width}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    lines.append("-" * len(lines[0]))
    for row in rows:
        cells = []
        for n in names:
            value = columns[n].get(row)
            cells.append(f"{'-':>{col}}" if value is None else f"{value:>{col}.4g}")
        lines.append(f"{row:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
