"""Per-token divergence terms, computed so that they stay exact when the two engines nearly agree.

With ℓ = log π_old − log π_rollout of a token (π_old: the trainer's recompute) and c = clamp(ℓ, ±20), so that
ρ = e^c ≤ e^20 (docs/math.md):

  k3     = max(e^c − ℓ − 1, 0) = max(expm1(c) − ℓ, 0)   (the k3 estimator of KL(π_rollout ‖ π_old))
  ρ² − 1 = e^{2c} − 1          = expm1(2c)              (the χ² term: χ² = mean of it)

Why expm1 and float64. When the engines nearly agree (a dense model, |ℓ| ~ 1e-4 and below) k3 ≈ ℓ²/2 is
smaller than the resolution of e^c near 1 (6e-8 in float32), so "e^c − ℓ − 1" cancels: in float32 the mean
k3 is off by −98 % at σ(ℓ) = 1e-4 and −28 % at 3e-4. expm1(c) = c + c²/2 + … keeps the relative precision of
its small result, so only the subtraction of ℓ cancels, and in float64 it leaves about 2·10⁻¹⁶/|ℓ| relative
error (a float32 expm1(c) − ℓ still loses ~1 % at ℓ = 1e-5). Likewise "ρ² − 1" as a square minus one cancels;
expm1(2c) does not. Callers sum these terms in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import LOG_RATIO_CLAMP, k3


def k3_terms(log_ratio: Tensor) -> Tensor:
    """k3_t = expm1(clamp(ℓ_t, ±20)) − ℓ_t per token, float64 (= max(ρ_t − ℓ_t − 1, 0); miles_mis.ops.k3, the
    plugin's own evaluation)."""
    ell = log_ratio.double()
    return k3(ell.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), ell)


def chi2_terms(log_ratio: Tensor) -> Tensor:
    """ρ_t² − 1 = expm1(2·clamp(ℓ_t, ±20)) per token, float64 (χ² = mean of it)."""
    return torch.expm1(2.0 * log_ratio.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
