"""The TIS upper bound U as one type, resolved once from the config (``MisConfig.upper_bound``).

``tis_upper_bound`` takes three shapes, and each answers the questions the correction asks of it:

    FixedBound      U                                     tis_upper_bound: 2.0
    PerLagBound     U_i = U_{min(λ_i, last)}              tis_upper_bound_by_lag: [U_0, U_1, ...]  (docs/staleness.md)
    AdaptiveBound   U = max{c_j : ESS(c_j) ≥ η}, per call  tis_upper_bound: auto  (miles_mis.correction.adaptive)

- ``for_tokens(lags, seq_index)``: the token weights' bound and its log-ratio threshold (``ops.log_bound``), a
  number or one value per token; the adaptive bound is not known yet (+inf: nothing is compared with it before it is
  chosen from every rank's ratios);
- ``for_sequences(lags, device, dtype)``: the sequence ratios' bound, a number or [B]; None when adaptive (chosen
  over the kept sequences, later in the call);
- ``lowest``: the smallest value it can take (whether a ratio of 1 can be outside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..tensors import ops
from .keys import AUTO


@dataclass(frozen=True)
class FixedBound:
    """One number for every token or sequence."""

    value: float
    adaptive = False
    needs_lags = False

    @property
    def lowest(self) -> float:
        return self.value

    def for_tokens(self, lags: Tensor | None, seq_index: Tensor) -> tuple[float, float]:
        return self.value, ops.log_bound(self.value)

    def for_sequences(self, lags: Tensor | None, device, dtype: torch.dtype) -> float:
        return self.value


@dataclass(frozen=True)
class PerLagBound:
    """``values[min(λ_i, last)]`` for sequence i, from its lag λ_i (non-increasing in the lag)."""

    values: tuple[float, ...]
    adaptive = False
    needs_lags = True

    @property
    def lowest(self) -> float:
        return min(self.values)

    def per_sequence(self, lags: Tensor, device, dtype: torch.dtype = torch.float32) -> Tensor:
        """[B] each sequence's bound, in the dtype of the ratios it bounds (float32 tokens, float64 sequence ratios:
        1.1 in float32 is 1.10000002)."""
        bounds = torch.tensor(self.values, dtype=dtype, device=device)
        return bounds.index_select(0, lags.to(device).clamp(max=bounds.numel() - 1))

    def for_tokens(self, lags: Tensor, seq_index: Tensor) -> tuple[Tensor, Tensor]:
        bounds = self.per_sequence(lags, seq_index.device)
        return bounds.index_select(0, seq_index), ops.log_bounds(bounds).index_select(0, seq_index)

    def for_sequences(self, lags: Tensor, device, dtype: torch.dtype) -> Tensor:
        return self.per_sequence(lags, device, dtype)


@dataclass(frozen=True)
class AdaptiveBound:
    """Chosen per call from the ratios (``miles_mis.correction.adaptive``): the largest of the candidates (geometric
    over ``search_range``) whose truncated weights keep the ESS ≥ ``target_ess``, over ``scope``."""

    search_range: tuple[float, float]
    target_ess: float
    scope: str  # "micro_batch" or "dp"
    adaptive = True
    needs_lags = False

    @property
    def lowest(self) -> float:
        return self.search_range[0]  # ≥ 1 (the config's check)

    def for_tokens(self, lags: Tensor | None, seq_index: Tensor) -> tuple[float, float]:
        return math.inf, math.inf

    def for_sequences(self, lags: Tensor | None, device, dtype: torch.dtype) -> None:
        return None


UpperBound = FixedBound | PerLagBound | AdaptiveBound


def resolve(tis_upper_bound, by_lag: tuple[float, ...] | None, search_range: tuple[float, float],
            target_ess: float, scope: str) -> UpperBound:
    """The bound's type from the validated keys (``tis_upper_bound``, ``tis_upper_bound_by_lag``,
    ``tis_auto_*``)."""
    if tis_upper_bound == AUTO:
        return AdaptiveBound(tuple(search_range), target_ess, scope)
    if by_lag is not None:
        return PerLagBound(tuple(by_lag))
    return FixedBound(tis_upper_bound)
