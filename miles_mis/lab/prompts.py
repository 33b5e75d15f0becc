"""The batch type every lab policy samples (miles_mis/lab/policy.py describes the interface)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Prompts:
    """One rollout batch's prompts: ``tokens`` ([N, P] or N 1-d tensors), ``problems`` (what rewards read)."""

    tokens: Tensor | list[Tensor]
    problems: list[Any]

    @property
    def lengths(self) -> list[int]:
        return [int(p.numel()) for p in self.tokens]
