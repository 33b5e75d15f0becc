"""Helpers for the multi-process context-parallel tests (gloo on CPU, torch.multiprocessing spawn).

Everything a worker needs is deterministic from a seed, so each rank builds the same full batch,
computes the cp = 1 result itself, and checks its own shard against it. The host's CP-aware metric
mean is implemented here as the contract describes it.
"""

from __future__ import annotations

import math
import os
import random
import socket
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, *args, timeout: float = 240.0) -> None:
    """Run fn(rank, nprocs, port, *args) in nprocs processes; re-raise a worker's error; never hang. With
    MILES_MIS_BACKEND=compiled (the suite on the compiled backend) every worker compiles each config's kernels: the
    deadline is ten times longer."""
    if os.environ.get("MILES_MIS_BACKEND") == "compiled":
        timeout *= 10
    port = free_port()
    context = mp.start_processes(_entry, args=(fn, nprocs, port, args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"workers did not finish in {timeout} s (a collective hung?)")


def _entry(rank, fn, nprocs, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nprocs)
    try:
        fn(rank, nprocs, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def cp_state(rank: int, size: int, group=None):
    return SimpleNamespace(cp=SimpleNamespace(rank=rank, size=size, group=group))


def make_full_batch(seed: int, num_seqs: int = 9, max_response: int = 40, fmt: str = "thd"):
    """Full (unsharded) batch: responses of 0, 1 and random lengths, masks with zeros inside."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    responses = [0, 1] + [rng.randint(0, max_response) for _ in range(num_seqs - 2)]
    rng.shuffle(responses)
    totals = [r + rng.randint(1, 25) for r in responses]
    spans = [t + rng.randint(0, 17) for t in totals] if fmt == "bshd" else None
    train, rollout, masks = [], [], []
    for n in responses:
        t = -torch.rand(n, generator=gen) * 3.0
        train.append(t)
        rollout.append(t + 0.15 * torch.randn(n, generator=gen))
        m = (torch.rand(n, generator=gen) > 0.2).float()
        masks.append(m)
    pg_loss = torch.randn(sum(responses), generator=gen)
    return dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks, total_lengths=totals,
                response_lengths=responses, max_seq_lens=spans), pg_loss


def local_positions(total: int, response: int, rank: int, cp: int, span: int) -> list[int]:
    """Response-relative positions rank `rank` holds (the contract's layout, written out per sequence)."""
    chunk = -(-span // (2 * cp))
    first, end = total - response - 1, total - 1
    out = []
    for k in (rank, 2 * cp - 1 - rank):
        out += [p - first for p in range(max(k * chunk, first), min((k + 1) * chunk, end))]
    return out


def shard(full: dict, pg_loss: torch.Tensor, rank: int, cp: int, fmt: str):
    """This rank's kwargs (sharded log-probs, full masks) and the flat indices of its tokens."""
    # per-token lists in train_log_probs' (sharded) layout; loss_masks, sampling masks and the rest pass whole
    names = [name for name in ("train_log_probs", "rollout_log_probs", "advantages", "cur_log_probs")
             if isinstance(full.get(name), (list, tuple))]
    positions, offset, local = [], 0, {name: [] for name in names}
    for i, n in enumerate(full["response_lengths"]):
        span = full["max_seq_lens"][i] if fmt == "bshd" else full["total_lengths"][i]
        pos = local_positions(full["total_lengths"][i], n, rank, cp, span)
        index = torch.tensor(pos, dtype=torch.long)
        for name in names:
            local[name].append(full[name][i][index])
        positions += [offset + p for p in pos]
        offset += n
    positions = torch.tensor(positions, dtype=torch.long)
    return dict(full, **local), pg_loss[positions], positions


def host_mean(metric: torch.Tensor, loss_masks, response_lengths, positions=None, group=None) -> float:
    """The host's reducer: Σ over sequences of Σ_local x·m / n_full, summed over CP ranks, / B."""
    full_mask = torch.cat(loss_masks) if loss_masks else torch.zeros(0)
    seq_of = torch.repeat_interleave(torch.arange(len(response_lengths)), torch.tensor(response_lengths))
    local_mask = full_mask if positions is None else full_mask[positions]
    local_seq = seq_of if positions is None else seq_of[positions]
    counts = torch.zeros(len(response_lengths), dtype=torch.float64).index_add_(0, seq_of, full_mask.double())
    sums = torch.zeros(len(response_lengths), dtype=torch.float64).index_add_(
        0, local_seq, metric.double() * local_mask.double())
    total = (sums / counts.clamp(min=1)).sum()
    if positions is not None:  # a CP shard: sum the ranks' partial sums (group None = the default group)
        dist.all_reduce(total, group=group)
    return float(total) / max(len(response_lengths), 1)


def assert_close(name: str, got: float, want: float, tol: float = 1e-6) -> None:
    assert math.isfinite(got), f"{name}: {got}"
    assert abs(got - want) <= tol * max(1.0, abs(want)), f"{name}: cp gives {got!r}, cp=1 gives {want!r}"
