"""Bounding a ratio by an IS mode (one place for tokens and sequences), and the fractions it reports."""

from __future__ import annotations

import torch
from torch import Tensor

from ..tensors.ops import indicator


def bound_weights(ratio: Tensor, mode: str, lower: float, upper: float | Tensor,
                  compared: tuple | None = None) -> tuple[Tensor, Tensor | None]:
    """Apply an IS mode to ratios ρ (per token or per sequence). Returns (weight, rejected 0/1 or None when
    the mode rejects nothing).

    truncate: w = min(ρ, U)                     rejected = ∅
    clip:     w = clamp(ρ, L, U)                rejected = ∅
    mask:     w = ρ                             rejected = {ρ ∉ [L, U]}
    icepop:   w = ρ·1[L ≤ ρ ≤ U]                rejected = ∅ (the mask is unchanged)

    ``compared``: (values, lower, upper) the decision ρ ∉ [L, U] is taken on instead of (ρ, L, U): at token level
    (ℓ, ln L, ln U) (``ops.log_bound``), so that it does not depend on a kernel's exp.
    """
    if mode == "truncate":
        return ratio.clamp(max=upper), None
    if mode == "clip":  # (a per-lag upper bound is a tensor; clamp takes two numbers or two tensors)
        return (ratio.clamp(lower, upper) if not isinstance(upper, Tensor)
                else ratio.clamp(min=lower).clamp_(max=upper)), None
    values, low, high = (ratio, lower, upper) if compared is None else compared
    outside = indicator(torch.lt, values, low).add_(indicator(torch.gt, values, high))  # disjoint: 0/1
    if mode == "mask":
        return ratio, outside
    if mode == "icepop":
        return (1.0 - outside).mul_(ratio), None
    raise ValueError(f"tis_mode={mode!r} is invalid: allowed values are truncate, clip, mask, icepop")


def bound_fraction_metrics(prefix: str, mode: str, ratio: Tensor, lower: float, upper) -> dict[str, Tensor]:
    """Indicator metrics of a bounding stage: ``{prefix}truncate_fraction`` for truncate (ρ > U),
    ``{prefix}{mode}_fraction_low`` (ρ < L) and ``_high`` (ρ > U) for the other modes. At token level ``ratio`` is
    ℓ and the bounds are ``ops.log_bound``'s: the tokens the token stages rejected, on every backend."""
    high = indicator(torch.gt, ratio, upper)
    if mode == "truncate":
        return {f"{prefix}truncate_fraction": high}
    return {f"{prefix}{mode}_fraction_low": indicator(torch.lt, ratio, lower), f"{prefix}{mode}_fraction_high": high}
