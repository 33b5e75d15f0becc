"""All torch.distributed code of miles_mis lives here.

The context-parallel (CP) group comes from the host's ``parallel_state`` kwarg (``.cp.group``,
``.cp.rank``, ``.cp.size``); without it, from Megatron-core's ``parallel_state`` when that is
initialised; otherwise CP size is 1 and no collective is issued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class CPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None


SINGLE = CPGroup()


def resolve_cp_group(parallel_state: Any = None) -> CPGroup:
    """The CP group of this call: from the host's kwarg, else Megatron-core, else size 1."""
    if parallel_state is not None:
        cp = getattr(parallel_state, "cp", None)
        if cp is None:
            raise ValueError("parallel_state has no 'cp' attribute: expected an object with "
                             "parallel_state.cp.rank, .cp.size and .cp.group")
        size = int(getattr(cp, "size", 1))
        rank = int(getattr(cp, "rank", 0))
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"parallel_state.cp has rank={rank}, size={size}: need size >= 1 and 0 <= rank < size")
        return CPGroup(rank, size, getattr(cp, "group", None)) if size > 1 else SINGLE
    return _megatron_cp_group()


def _megatron_cp_group() -> CPGroup:
    import sys

    # Only consult Megatron when the host already imported it: importing it here costs seconds.
    if "megatron.core.parallel_state" not in sys.modules:
        return SINGLE
    mpu = sys.modules["megatron.core.parallel_state"]
    try:
        if not mpu.model_parallel_is_initialized():
            return SINGLE
        size = mpu.get_context_parallel_world_size()
        if size <= 1:
            return SINGLE
        return CPGroup(mpu.get_context_parallel_rank(), size, mpu.get_context_parallel_group())
    except (AssertionError, RuntimeError, AttributeError):
        return SINGLE


def all_gather_table(table: Tensor, cp: CPGroup) -> Tensor:
    """[C, B, K] stack of every CP rank's [B, K] table: the one collective of a call (none at size 1)."""
    if cp.size == 1:
        return table.unsqueeze(0)
    import torch.distributed as dist

    out = table.new_empty((cp.size, *table.shape))
    dist.all_gather_into_tensor(out, table.contiguous(), group=cp.group)
    return out
