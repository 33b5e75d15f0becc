"""All torch.distributed code of miles_mis lives here.

The context-parallel (CP) group comes from the host's ``parallel_state`` kwarg (``.cp.group``,
``.cp.rank``, ``.cp.size``); without it, from Megatron-core's ``parallel_state`` when that is
initialised; otherwise CP size is 1 and no collective is issued.

One call makes exactly one CP collective: an all-gather of a [rows, K] float64 table per rank
(``exchange_seq_stats``). Row 0 is a header (batch size, error flag); rows 1..B carry each sequence's
statistics and its lengths, so that ranks disagreeing on the batch are detected by the same
collective and every rank raises the same error instead of hanging. Rows are padded to a multiple
of ``ROW_BLOCK`` so that ranks which disagree on B by less than a block still exchange equal sizes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROW_BLOCK = 64  # rows are padded to a multiple of this
HEADER = ("batch_size", "error", "error_sequence")  # header row, first columns
LENGTH_COLUMNS = ("response_length", "total_length", "span")  # per-sequence columns appended to the stats


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    group: Any = None


SINGLE = Group()


def _group_info(info: Any, what: str) -> Group:
    size = int(getattr(info, "size", 1))
    rank = int(getattr(info, "rank", 0))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"parallel_state.{what} has rank={rank}, size={size}: need size >= 1 and 0 <= rank < size")
    return Group(rank, size, getattr(info, "group", None)) if size > 1 else SINGLE


def _megatron():
    # Only consult Megatron when the host already imported and initialised it: importing costs seconds.
    mpu = sys.modules.get("megatron.core.parallel_state")
    try:
        if mpu is not None and mpu.model_parallel_is_initialized():
            return mpu
    except (AssertionError, RuntimeError, AttributeError):
        pass
    return None


def resolve_cp_group(parallel_state: Any = None) -> Group:
    """The CP group of this call: from the host's kwarg, else Megatron-core, else size 1."""
    if parallel_state is not None:
        cp = getattr(parallel_state, "cp", None)
        if cp is None:
            raise ValueError("parallel_state has no 'cp' attribute: expected an object with "
                             "parallel_state.cp.rank, .cp.size and .cp.group")
        return _group_info(cp, "cp")
    mpu = _megatron()
    if mpu is None or mpu.get_context_parallel_world_size() <= 1:
        return SINGLE
    return Group(mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(),
                 mpu.get_context_parallel_group())


def resolve_dp_group(parallel_state: Any = None) -> Group:
    """The data-parallel group (without CP): ``effective_dp``/``intra_dp``/``dp`` of the host's
    parallel state, else Megatron-core's data-parallel group, else size 1."""
    if parallel_state is not None:
        for name in ("effective_dp", "intra_dp", "dp"):
            info = getattr(parallel_state, name, None)
            if info is not None:
                return _group_info(info, name)
    mpu = _megatron()
    if mpu is None:
        if parallel_state is not None:  # a distributed host whose DP group we cannot see: do not guess size 1
            raise ValueError("tis_batch_normalize_scope: dp needs the data-parallel group: parallel_state has no "
                             "effective_dp, intra_dp or dp attribute and Megatron-core is not initialised; use "
                             "tis_batch_normalize_scope: micro_batch, or pass the group")
        return SINGLE
    size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    if size <= 1:
        return SINGLE
    return Group(mpu.get_data_parallel_rank(with_context_parallel=False), size,
                 mpu.get_data_parallel_group(with_context_parallel=False))


def exchange_seq_stats(stats: Tensor, lengths: Tensor, cp: Group, local_error: Exception | None = None) -> Tensor:
    """All-gather every CP rank's per-sequence table: [B, K] stats + [B, 3] lengths -> [C, B, K].

    Raises ValueError on every rank when a rank reported ``local_error`` or when the ranks disagree
    on the batch size or on any sequence's lengths (the local rank re-raises its own error).
    """
    import torch.distributed as dist

    num_seqs, width = stats.shape[0], stats.shape[1] + lengths.shape[1]
    rows = ROW_BLOCK * ((num_seqs + 1 + ROW_BLOCK - 1) // ROW_BLOCK)
    table = torch.zeros((rows, max(width, len(HEADER))), dtype=torch.float64, device=stats.device)
    table[0, 0] = num_seqs
    if local_error is not None:
        table[0, 1] = 1.0
        table[0, 2] = getattr(local_error, "sequence_index", -1)
    else:
        table[1:num_seqs + 1, :stats.shape[1]] = stats
        table[1:num_seqs + 1, stats.shape[1]:width] = lengths
    gathered = table.new_empty((cp.size * table.shape[0], table.shape[1]))  # ranks concatenated along dim 0
    # all_gather_single is the new name (torch >= 2.13) of all_gather_into_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, table, group=cp.group)
    gathered = gathered.view(cp.size, *table.shape)

    failed = (gathered[:, 0, 1] > 0).nonzero().flatten().tolist()
    if failed:
        if local_error is not None:
            raise local_error
        details = ", ".join(f"rank {r} at sequence {int(gathered[r, 0, 2])}" for r in failed)
        raise ValueError(f"context-parallel rank(s) rejected their inputs ({details}); this rank (cp rank "
                         f"{cp.rank}) stops too so that no rank waits in a collective")
    sizes = gathered[:, 0, 0].long().tolist()
    if len(set(sizes)) > 1:
        raise ValueError("context-parallel ranks disagree on the number of sequences: "
                         + ", ".join(f"cp rank {r} has {b}" for r, b in enumerate(sizes)))
    seq_lengths = gathered[:, 1:num_seqs + 1, stats.shape[1]:width]
    differs = (seq_lengths != seq_lengths[:1]).any(dim=2).any(dim=0)
    if bool(differs.any()):
        i = int(differs.nonzero()[0])
        values = "; ".join(f"cp rank {r}: " + ", ".join(f"{name}={int(v)}" for name, v in
                                                        zip(LENGTH_COLUMNS, seq_lengths[r, i].tolist()))
                           for r in range(cp.size))
        raise ValueError(f"sequence {i}: context-parallel ranks disagree on its lengths ({values})")
    return gathered[:, 1:num_seqs + 1, :stats.shape[1]].to(stats.dtype)


def all_reduce_sum(values: Tensor, group: Group) -> Tensor:
    """Sum a small tensor over a group (used for data-parallel batch normalisation)."""
    if group.size == 1:
        return values
    import torch.distributed as dist

    out = values.detach().double().clone()
    dist.all_reduce(out, group=group.group)
    return out.to(values.dtype)
