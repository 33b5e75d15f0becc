"""The worst sequences of a dump, kept while the statistics stream: a bounded heap of the ``WORST`` sequences with the
highest mean k3 (k3 over their usable tokens), each with the per-token values of at most ``STRIP_TOKENS`` tokens
around its largest |Δ log p| (the HTML report's token strips, ``report.strips``).

Memory is bounded whatever the dump's size: at most ``WORST`` entries of at most ``STRIP_TOKENS`` tokens each; a
sequence enters when its mean k3 beats the heap's least-bad entry. Ties order as the rest of the report does: higher
k3 first, then the earlier call, then the lower index, so any partition of the dump into batches keeps the same set.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any

from torch import Tensor

from ..tensors import ops

WORST = 10  # the worst-sequences table and the strips: the same ten sequences, few enough to read one by one
# tokens per strip: one line of a page about 1000 px wide at 14 px a token; the window is centred on the sequence's
# largest |Δ log p| so the token that made it one of the worst is always on the page (report.json keeps the rest of
# the statistics; the per-token values of a whole long response would make the page large and slow)
STRIP_TOKENS = 64


def token_window(old: Tensor, rollout: Tensor, valid: Tensor, positions: Tensor, centre: int,
                 size: int = STRIP_TOKENS) -> dict[str, Any]:
    """The tokens [start, end) of one sequence (its held tokens in response order), at most ``size`` of them, with
    ``centre`` inside: start = clamp(centre − size // 2, 0, max(n − size, 0)), end = min(start + size, n).

    Returns start, end, held (n), peak (``centre``: the largest |Δ|'s index among the held tokens, since positions
    may be unknown, −1), and per token of the window: its response position (−1 where unknown), the
    engine's and the trainer's log-prob (None where NaN/inf: the statistics stay JSON), whether the loss mask keeps
    it (``valid``) and whether it is usable as the plugin defines it (``ops.usable_tokens``: valid, both log-probs
    finite and inside ±LOG_PROB_BOUND, so a fill value is not)."""
    held = int(old.numel())
    start = min(max(centre - size // 2, 0), max(held - size, 0))
    end = min(start + size, held)
    old, rollout = old[start:end].double(), rollout[start:end].double()
    kept = valid[start:end] != 0
    return {"start": start, "end": end, "held": held, "peak": int(centre),
            "positions": [int(p) for p in positions[start:end].tolist()],
            "rollout": [_finite_or_none(v) for v in rollout.tolist()],
            "old": [_finite_or_none(v) for v in old.tolist()],
            "valid": [bool(v) for v in kept.tolist()],
            "usable": [bool(v) for v in (ops.usable_tokens(old, rollout, kept.double()) > 0).tolist()]}


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class WorstSequences:
    """The ``limit`` sequences with the highest mean k3 seen so far, with their token windows (a min-heap keyed by
    (k3, −call, −index): its root is the entry the next worse sequence replaces)."""

    def __init__(self, limit: int = WORST):
        if limit < 1:
            raise ValueError(f"WorstSequences limit must be >= 1, got {limit}")
        self.limit = limit
        self._heap: list[tuple[tuple[float, int, int], int, dict, dict]] = []
        self._order = itertools.count()  # a unique tie-breaker: the dicts are never compared

    def would_keep(self, k3: float, call: int, index: int) -> bool:
        """Whether a sequence with this k3 enters the heap (so its window is worth building)."""
        return len(self._heap) < self.limit or (k3, -call, -index) > self._heap[0][0]

    def offer(self, row: dict, window: dict) -> None:
        """``row``: call, index, length, k3, max_abs_log_ratio, worst_position; ``window``: ``token_window``'s."""
        key = (float(row["k3"]), -int(row["call"]), -int(row["index"]))
        entry = (key, next(self._order), row, window)
        if len(self._heap) < self.limit:
            heapq.heappush(self._heap, entry)
        elif key > self._heap[0][0]:
            heapq.heapreplace(self._heap, entry)

    def _sorted(self) -> list[tuple[tuple[float, int, int], int, dict, dict]]:
        return sorted(self._heap, key=lambda entry: (-entry[0][0], -entry[0][1], -entry[0][2]))

    def rows(self) -> list[dict]:
        """The worst-sequences table: highest k3 first."""
        return [dict(row) for _, _, row, _ in self._sorted()]

    def strips(self) -> list[dict]:
        """The same sequences, each row with its token window (``token_window``'s keys added)."""
        return [{**row, **window} for _, _, row, window in self._sorted()]
