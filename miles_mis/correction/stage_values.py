"""The values finalize's stages return to it: a stage's ``Outcome`` (the sequences it rejects and its metrics) and the
sequence-level importance weights (``SeqWeights``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class Outcome:
    """What a stage decides and measures: the sequences it rejects ([B] or 0-d bool; None: none) and its metrics
    ([N] per token, [B] per sequence, 0-d per batch)."""

    reject: Tensor | None = None
    token: dict[str, Tensor] = field(default_factory=dict)
    seq: dict[str, Tensor] = field(default_factory=dict)
    batch: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SeqWeights:
    """The sequence-level importance weights (``tis_level`` sequence or geometric)."""

    ratio: Tensor  # [B] r_i
    weight: Tensor | None  # [B] bounded w_i; None until the adaptive bound is chosen
    upper: float | Tensor | None  # the bound: a number, [B] per lag, or the adaptive one once chosen
