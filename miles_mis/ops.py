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


_CONSTANTS: dict = {}


def constant(values: tuple[int, ...], device) -> Tensor:
    """A small constant int64 tensor (bucket edges, an index), made once per (values, device) and shared:
    read it, never write into it. Building it from a Python tuple each call costs more than the op using it."""
    key = (values, str(device))
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.tensor(values, dtype=torch.long, device=device)
    return tensor
