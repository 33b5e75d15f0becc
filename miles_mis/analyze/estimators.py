"""Per-token divergence terms, computed so that they stay exact when the two engines nearly agree.

With ℓ = log π_old − log π_rollout of a token (π_old: the trainer's recompute) and c = clamp(ℓ, ±20), so that
ρ = e^c ≤ e^20 (docs/math.md):

  k3     = max(e^c − ℓ − 1, 0) = max(expm1(c) − ℓ, 0)   (the k3 estimator of KL(π_rollout ‖ π_old))
  ρ² − 1 = e^{2c} − 1          = expm1(2c)              (the χ² term: χ² = mean of it)

Both in float64 with expm1, as the plugin computes them (miles_mis.tensors.ops.k3 says why: e^c − ℓ − 1 and ρ² − 1
cancel when the engines nearly agree). Callers sum these terms in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..tensors.ops import LOG_RATIO_CLAMP, k3


def k3_terms(log_ratio: Tensor) -> Tensor:
    """k3_t = expm1(clamp(ℓ_t, ±20)) − ℓ_t per token, float64 (= max(ρ_t − ℓ_t − 1, 0); miles_mis.tensors.ops.k3, the
    plugin's own evaluation)."""
    ell = log_ratio.double()
    return k3(ell.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), ell)


def chi2_terms(log_ratio: Tensor) -> Tensor:
    """ρ_t² − 1 = expm1(2·clamp(ℓ_t, ±20)) per token, float64 (χ² = mean of it)."""
    return torch.expm1(2.0 * log_ratio.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
