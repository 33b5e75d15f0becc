"""Adaptive truncation: the least truncation that keeps the batch's effective sample size above a target.

With ``tis_upper_bound: auto`` the TIS weight is w = min(ρ, U) with U chosen afresh every call: the largest
candidate U in the search range [U_lo, U_hi] (``tis_auto_bounds``) whose truncated weights keep

    ESS(U) = (Σ_i n_i·min(ρ_i, U))² / (Σ_i n_i · Σ_i n_i·min(ρ_i, U)²)  ≥  target   (``tis_auto_target_ess``)

over the search population: at token level every token that passes the token-level stages (n_i = 1); at
sequence/geometric level every kept sequence's ratio, counted n_i times (its passing tokens: the token-weighted
ESS of ``mis_ess``). ESS(U) never increases with U (docs/math.md), so "the largest U" is well defined: U_hi
when U_hi meets the target, U_lo when even U_lo misses it (then ``mis_tis_auto_ess`` < target says so), and
U_hi when the population is empty.

The candidates are NUM_EDGES points spaced geometrically over [U_lo, U_hi]. A histogram of ρ with those
points as bin edges, holding per bin (Σ n_i, Σ n_i·ρ_i, Σ n_i·ρ_i²), gives ESS at every candidate exactly
(a ratio at or below the candidate keeps ρ, one above it becomes U), so the chosen U is the grid point at most
one step (a factor (U_hi/U_lo)^(1/(NUM_EDGES−1)): 4.6% for [1.2, 20]) below the continuous optimum. The
histogram is a fixed-size vector: added over CP ranks in the agreement header and, with
``tis_auto_scope: dp``, over the DP group, so every rank picks the same U whatever B is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..tensors import ops

NUM_EDGES = 64  # candidate bounds; the histogram has NUM_EDGES + 1 bins
HISTOGRAM_SIZE = 3 * (NUM_EDGES + 1)  # (weight, Σ n·ρ, Σ n·ρ²) per bin


def candidates(bounds: tuple[float, float], device=None) -> Tensor:
    """The NUM_EDGES candidate bounds, float32, geometric from U_lo to U_hi (both included exactly)."""
    lower, upper = bounds
    steps = torch.arange(NUM_EDGES, dtype=torch.float64) / (NUM_EDGES - 1)
    edges = lower * (upper / lower) ** steps
    edges[0], edges[-1] = lower, upper
    return edges.float().to(device)


def histogram(ratio: Tensor, count: Tensor, edges: Tensor, compared: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """float64 [HISTOGRAM_SIZE]: per bin the weight Σ n, Σ n·ρ and Σ n·ρ², laid out as three blocks.

    Bin 0 holds ρ ≤ edges[0], bin b holds edges[b−1] < ρ ≤ edges[b], bin NUM_EDGES holds ρ > edges[−1];
    ``count`` is n per entry (0/1 per token, or passing tokens per sequence). ``compared``: (values, edges) the bins
    are found by instead: the tokens' (ℓ, ln edges) (``ops.log_bounds``), the same bins on every backend.
    """
    bins = torch.bucketize(ratio, edges) if compared is None else torch.bucketize(*compared)
    count = count.double()
    weighted = count * ratio.double()
    parts = [torch.bincount(bins, weights=w, minlength=NUM_EDGES + 1) for w in (count, weighted, weighted * ratio)]
    return torch.cat(parts)


@dataclass(frozen=True)
class Choice:
    """The bound picked for one call (0-d tensors, identical on every rank of the scope)."""

    upper: Tensor  # U, float32: the value the weights are truncated at
    ess_before: Tensor  # ESS of the untruncated ratios over the search population
    ess_after: Tensor  # ESS(U) over the search population (< target only when U is the range's floor)


def choose(hist: Tensor, edges: Tensor, target: float) -> Choice:
    """The largest candidate U with ESS(U) ≥ target (the first candidate when none reaches it)."""
    count, first, second = hist.view(3, NUM_EDGES + 1)
    total = count.sum()
    below_first = first.cumsum(0)[:NUM_EDGES]  # ratios at or below candidate j keep ρ ...
    below_second = second.cumsum(0)[:NUM_EDGES]
    above = (total - count.cumsum(0)[:NUM_EDGES]).clamp(min=0.0)  # ... those above it become U_j
    bound = edges.double()
    ess = ops.ess(below_first + bound * above, below_second + bound.square() * above, total, 1.0)  # empty: 1
    meets = ess >= target
    index = (meets * torch.arange(NUM_EDGES, device=hist.device)).amax()  # 0 (the floor) when none meets it
    ess_before = ops.ess(first.sum(), second.sum(), total, 1.0)
    return Choice(edges[index], ess_before.float(), ess[index].float())
