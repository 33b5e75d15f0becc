"""Small tensor helpers shared by the core modules."""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps every weight and sum of weights finite in float32


def indicator(compare, a: Tensor, b) -> Tensor:
    """Float 0/1 result of an elementwise comparison, e.g. ``indicator(torch.gt, ratio, upper)``.

    Written into a float tensor directly: on CPU, bool→float conversion costs ~5× the comparison.
    """
    return compare(a, b, out=torch.empty_like(a, dtype=torch.float32))
