"""Which rollout each sample of a call belongs to: the value a host's split rollouts become (``inputs.rollouts``
reads them; the sequence-level stages group by it)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class RolloutGroups:
    """Which rollout each sample of the call belongs to."""

    of_sample: Tensor  # [B] int64, the group of each sample, groups numbered in order of first appearance
    count: int  # G, the number of rollouts in the call
    size: Tensor  # [G] int64, samples of each rollout in the call
    incomplete: Tensor | None  # [G] bool, fewer trained tokens here than rollout_mask_sums says; None = not known
    ids_given: bool = True  # False: only rollout_mask_sums were given (each sample its own group)

    @property
    def trivial(self) -> bool:
        """Every sample is its own rollout: grouping changes nothing (the core skips it, so the result is the
        ungrouped one bit for bit)."""
        return self.count == self.of_sample.numel()
