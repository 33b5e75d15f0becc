"""Policy-loss dumps in miles' ``--dump-details DIR`` layout, written by ``miles-mis train``.

miles (``miles/backends/training_utils/debug_dump.py``, called from the policy loss) writes one file per
call of the policy loss per rank: ``DIR/policy_loss_debug/rank_<r>_call_<c>.pt``, a ``torch.save`` of::

    {"rank": int, "call": int,
     "samples": [{"index": int, "total_length": int, "response_length": int,
                  "train_log_probs": T, "old_log_probs": T, "advantages": T, "local_loss_mask": T,
                  "rollout_log_probs": T,        # only when the batch has rollout log-probs
                  "train_rollout_abs_diff": T,   # |train - rollout|, only when their shapes match
                  "version_lag": int},           # weight versions behind the trainer, when the batch has lags
                 ...],
     "ppo_kl": T, "pg_loss": T,                  # per token, this rank's tokens, before OPSM and TIS
     "finite": {"ppo_kl": bool, "pg_loss": bool, "train_log_probs": bool, "old_log_probs": bool,
                "advantages": bool}}

Every T is a detached float32 CPU tensor holding this rank's CP shard; ``response_length`` is the full
length. Only tensors, ints, bools, lists and dicts: the files load with ``torch.load(weights_only=True)``.
The lab writes the same keys with the same meaning (``old_log_probs`` is π_old as the loss uses it: the
rollout log-probs under ``--use-rollout-logprobs``, else the trainer's recomputation).

Unlike miles, the call counter ``c`` counts every policy-loss call of the run, written or not (so
``--dump-interval N`` leaves gaps), and it is kept in the lab's checkpoint so ``--resume`` continues it.
Nothing here draws random numbers or touches the graph: dumping does not change the trajectory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from .. import reference_host

SUBDIR = "policy_loss_debug"


def file_name(rank: int, call: int) -> str:
    return f"rank_{rank}_call_{call}.pt"


class PolicyLossDumper:
    """Counts the run's policy-loss calls and writes the selected ones.

    ``directory``: the ``--dump-details`` DIR (None: count only). ``interval``: write during the steps
    whose 1-based number (``step`` in metrics.jsonl) is a multiple of it. ``calls``: calls made before
    this process started (from the checkpoint under ``--resume``, else 0).
    """

    def __init__(self, directory: Path | str | None, rank: int, interval: int = 1, calls: int = 0,
                 resume: bool = False):
        if interval < 1:
            raise ValueError(f"--dump-interval must be >= 1, got {interval}")
        self.directory = None if directory is None else Path(directory) / SUBDIR
        self.rank, self.interval, self.calls = rank, interval, int(calls)
        if self.directory is not None and not resume and self.directory.is_dir():
            stale = sorted(self.directory.glob("rank_*_call_*.pt"))
            if stale:  # a fresh run would interleave its calls with the old run's: the analyzer can't tell
                raise ValueError(f"--dump-details: {self.directory} already holds {len(stale)} dump(s) "
                                 f"(e.g. {stale[0].name}) from another run; use an empty directory, delete "
                                 "them, or continue that run with --resume")

    def writes(self, step: int) -> bool:
        """Whether the calls of ``step`` (1-based) are written."""
        return self.directory is not None and step % self.interval == 0

    def call(self, step: int, write: Callable[[], dict[str, Any]]) -> Path | None:
        """Count one policy-loss call of ``step``; when selected, save ``write()`` under its name."""
        call, self.calls = self.calls, self.calls + 1
        if not self.writes(step):
            return None
        payload = {"rank": self.rank, "call": call, **write()}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / file_name(self.rank, call)
        torch.save(payload, path)
        return path


def _cpu(tensor: Tensor) -> Tensor:
    return tensor.detach().to(device="cpu", dtype=torch.float32).clone()


def _all_finite(values: Sequence[Tensor] | Tensor) -> bool:
    tensors = [values] if isinstance(values, Tensor) else list(values)
    return all(bool(torch.isfinite(t.detach()).all()) for t in tensors)


@torch.no_grad()
def policy_loss_record(args: argparse.Namespace, batch: Mapping[str, Any], log_probs: Sequence[Tensor],
                       local_loss_masks: Sequence[Tensor]) -> dict[str, Any]:
    """``samples``, ``ppo_kl``, ``pg_loss`` and ``finite`` of one host call (everything but rank and call).

    ``batch`` and ``log_probs`` are what :func:`miles_mis.reference_host.policy_loss` was given (log-probs and the
    per-token batch entries are this rank's shards, ``loss_masks`` full length); ``local_loss_masks``: this
    rank's shards of ``loss_masks``. ``ppo_kl`` and ``pg_loss`` are recomputed from detached copies as the
    host computes them before OPSM and the TIS/MIS function, which is where miles takes its dump.
    """
    current = [t.detach().float() for t in log_probs]
    rollout = batch.get("rollout_log_probs")
    rollout = None if rollout is None else [t.detach().float() for t in rollout]
    old = rollout if args.use_rollout_logprobs else [t.detach().float() for t in batch["log_probs"]]
    advantages = [t.detach().float() for t in batch["advantages"]]

    samples = []
    for index, train in enumerate(current):
        sample = {
            "index": index,
            "total_length": int(batch["total_lengths"][index]),
            "response_length": int(batch["response_lengths"][index]),
            "train_log_probs": _cpu(train),
            "old_log_probs": _cpu(old[index]),
            "advantages": _cpu(advantages[index]),
            "local_loss_mask": _cpu(local_loss_masks[index]),
        }
        if rollout is not None:
            sample["rollout_log_probs"] = _cpu(rollout[index])
            if train.shape == rollout[index].shape:
                sample["train_rollout_abs_diff"] = _cpu((train - rollout[index]).abs())
        if batch.get("version_lags") is not None:  # weight versions behind the trainer (not in miles' dumps)
            sample["version_lag"] = int(batch["version_lags"][index])
        samples.append(sample)

    cat = lambda values: torch.cat(values) if values else torch.zeros(0)  # noqa: E731
    active = cat([m.float() for m in local_loss_masks]) != 0
    zero = torch.zeros(())
    current_flat = cat(current)
    ppo_kl = torch.where(active, torch.nan_to_num(cat(old) - current_flat, nan=0.0, posinf=0.0, neginf=0.0), zero)
    adv = torch.where(active, torch.nan_to_num(cat(advantages), nan=0.0, posinf=0.0, neginf=0.0), zero)
    if args.loss_type == "ppo":
        eps_high = args.eps_clip if args.eps_clip_high is None else args.eps_clip_high
        pg_loss, _ = reference_host.ppo_clip_loss(ppo_kl, adv, args.eps_clip, eps_high, args.eps_clip_c)
    else:  # REINFORCE, as the host: no ratio; in bypass the detached π_θ/π_rollout weight in the TIS bounds
        pg_loss = -adv * torch.nan_to_num(current_flat, nan=0.0, posinf=0.0, neginf=0.0)
        if args.use_rollout_logprobs:
            pg_loss = pg_loss * reference_host.safe_ratio(current_flat - cat(rollout)).clamp(args.tis_clip_low,
                                                                                              args.tis_clip)

    return {
        "samples": samples,
        "ppo_kl": _cpu(ppo_kl),
        "pg_loss": _cpu(pg_loss),
        "finite": {
            "ppo_kl": _all_finite(ppo_kl),
            "pg_loss": _all_finite(pg_loss),
            "train_log_probs": _all_finite(current),
            "old_log_probs": _all_finite(old),
            "advantages": _all_finite(advantages),
        },
    }
