"""Split rollouts: several samples of one rollout, grouped by the host's ``rollout_ids``.

miles' compact and subagent rollouts turn one rollout into several samples that share a ``rollout_id`` (and whose
``rollout_mask_sums`` each hold the trained-token count of the whole rollout). A sequence-level stage computed per
sample would see a fragment: its sequence ratio exp(Σ_t ℓ_t) over a part of the rollout's tokens. With
``rollout_ids`` the core treats the samples sharing an id as ONE sequence for every sequence-level stage (sequence
and geometric IS/RS, the ``seq_*`` divergence options, the veto, the staleness gate, the per-sequence metrics):

    S_g = ∪_{i : id_i = g} tokens of sample i,   r_g = exp(Σ_{t ∈ S_g} ℓ_t)   (sequence level)

Token-level stages are unchanged. A group's lag is its most stale sample's. Under CP every rank holds a shard of
every sample, so the groups are the same on every rank and the result equals cp = 1.

A rollout whose samples are not all in this call (another micro-batch or DP rank) cannot be seen whole. When the
host passes ``rollout_mask_sums`` (the rollout's trained-token count, per sample) the call compares it with the
trained tokens its samples hold here: a group holding fewer is *incomplete*; its sequence-level stages act on the part
present, and ``mis_rollout_incomplete_fraction`` counts its samples (docs/hosts.md). Given ``rollout_mask_sums``
without ids, each sample is checked alone: a fragment of a larger rollout is counted the same way. Every failure is an
``InputError`` naming the sequence, raised before any collective.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from ..tensors.rollout_groups import RolloutGroups
from .packing import InputError

KWARG = "rollout_ids"
MASK_SUMS_KWARG = "rollout_mask_sums"
_SEE = "docs/hosts.md#split-rollouts"


def given(kwargs: Mapping[str, Any]) -> bool:
    """The host passed ``rollout_ids`` or ``rollout_mask_sums``."""
    return kwargs.get(KWARG) is not None or kwargs.get(MASK_SUMS_KWARG) is not None


def form(groups: RolloutGroups | None) -> str:
    """Which split-rollout inputs a call was given: "ids", "mask_sums" (the counts alone) or "none" (the CP ranks of
    a call must agree on it: it changes the exchanged table's width and the metrics)."""
    if groups is None:
        return "none"
    return "ids" if groups.ids_given else "mask_sums"


def groups_of(kwargs: Mapping[str, Any], full_mask_sums: Tensor, device: Any = "cpu") -> RolloutGroups | None:
    """The call's rollout groups from ``rollout_ids`` (None when the host passes neither input). ``full_mask_sums``:
    [B] each sample's trained-token count over its WHOLE response (the same on every CP rank), compared with
    ``rollout_mask_sums`` when given. With ``rollout_mask_sums`` alone (miles' and slime's loss batches hold them, not
    the ids) each sample is its own group, and one holding fewer trained tokens than its rollout is incomplete: a
    fragment, whose sequence-level stages see part of the rollout."""
    ids = kwargs.get(KWARG)
    if ids is None and kwargs.get(MASK_SUMS_KWARG) is None:
        return None
    num_seqs = full_mask_sums.numel()
    of_sample = group_index(ids, num_seqs) if ids is not None else torch.arange(num_seqs)
    count = int(of_sample.max()) + 1 if num_seqs else 0
    size = torch.bincount(of_sample, minlength=count)
    sums = kwargs.get(MASK_SUMS_KWARG)
    incomplete = None
    if sums is not None:
        per_group = _rollout_counts(_mask_sums(sums, num_seqs), of_sample, count)
        here = torch.zeros(count, dtype=torch.float64).index_add_(0, of_sample, full_mask_sums.double().cpu())
        _check_not_more_than_expected(here, per_group, of_sample)
        # a relative slack: mask sums of float masks (0.5, 2.0) are sums of floats, not counts
        incomplete = here < per_group * (1.0 - 1e-6) - 1e-6
        incomplete = incomplete.to(device)
    return RolloutGroups(of_sample.to(device), count, size.to(device), incomplete, ids is not None)


def group_index(ids: Any, num_seqs: int) -> Tensor:
    """[B] int64: each sample's group, numbered by first appearance (ids [7, 3, 7] -> [0, 1, 0]). ``ids``: B integers
    (a list, a tuple or an integer tensor) or B strings."""
    if _is_array(ids):  # a numpy array (miles stores the ids with an int64 array codec)
        ids = torch.as_tensor(ids)
    if isinstance(ids, Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.ndim != 1:
            raise InputError(f"{KWARG} is a {ids.dtype} tensor of shape {tuple(ids.shape)}: expected B integer ids, "
                             f"one per sequence ({_SEE})")
        values = ids.detach().cpu().long()
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InputError(f"{KWARG} is a {type(ids).__name__}: expected B ids (integers or strings), one per sequence "
                         f"({_SEE})")
    else:
        values = _id_values(list(ids))
    if values.numel() != num_seqs:
        raise InputError(f"{KWARG} has {values.numel()} entries but the batch has {num_seqs} sequences: one id per "
                         f"sequence ({_SEE})")
    if num_seqs == 0:
        return torch.zeros(0, dtype=torch.long)
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((unique.numel(),), num_seqs, dtype=torch.long).scatter_reduce_(
        0, inverse, torch.arange(num_seqs), "amin")
    order = torch.empty_like(first)
    order[first.argsort()] = torch.arange(unique.numel())
    return order[inverse]


def _id_values(ids: list) -> Tensor:
    """Integer ids (Python or numpy) as an int64 tensor; string ids by first appearance; anything else named."""
    kinds = set(map(type, ids))
    if kinds <= {int}:
        return torch.tensor(ids, dtype=torch.long)
    if all(isinstance(value, numbers.Integral) and not isinstance(value, bool) for value in ids):
        return torch.tensor([int(value) for value in ids], dtype=torch.long)
    if kinds <= {str}:
        index: dict[str, int] = {}
        return torch.tensor([index.setdefault(value, len(index)) for value in ids], dtype=torch.long)
    for i, value in enumerate(ids):
        if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point() \
                and value.dtype != torch.bool:
            ids[i] = value = int(value.item())
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
            raise InputError(f"sequence {i}: {KWARG}[{i}]={value!r} is invalid: allowed values are integers or "
                             f"strings (the id of the rollout the sample belongs to; {_SEE})", i)
    if {type(value) for value in ids} - {int}:
        raise InputError(f"{KWARG} mixes integers and strings: use one kind of id ({_SEE})")
    return torch.tensor(ids, dtype=torch.long)


def _is_array(value: Any) -> bool:
    """A numpy array (or another array type torch reads), not a tensor, list or string."""
    return (hasattr(value, "__array__") and hasattr(value, "dtype") and not isinstance(value, (Tensor, list, tuple))
            and getattr(value, "ndim", 0) >= 1)


def _mask_sums(values: Any, num_seqs: int) -> Tensor:
    """``rollout_mask_sums`` as [B] float64 (a list of numbers or 0-d tensors, a tensor or a numpy array), finite and
    ≥ 0. A list of 0-d tensors (miles' micro-batch holds them on the GPU) is stacked first: one device read, not one
    per sample."""
    if _is_array(values):
        values = torch.as_tensor(values)
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, Tensor) and v.numel() == 1 for v in values):
        values = torch.stack([v.detach().reshape(()).to(values[0].device) for v in values])
    if isinstance(values, Tensor):
        if values.is_complex() or values.dtype == torch.bool or values.ndim != 1:
            raise InputError(f"{MASK_SUMS_KWARG} is a {values.dtype} tensor of shape {tuple(values.shape)}: expected B "
                             "numbers, one per sequence")
        sums = values.detach().cpu().double()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InputError(f"{MASK_SUMS_KWARG} is a {type(values).__name__}: expected B numbers, one per sequence")
    else:
        sums = torch.zeros(len(values), dtype=torch.float64)
        for i, value in enumerate(values):
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InputError(f"sequence {i}: {MASK_SUMS_KWARG}[{i}]={value!r} is invalid: a trained-token count "
                                 "(a number >= 0)", i)
            sums[i] = float(value)
    if sums.numel() != num_seqs:
        raise InputError(f"{MASK_SUMS_KWARG} has {sums.numel()} entries but the batch has {num_seqs} sequences: one "
                         "per sequence")
    bad = (~torch.isfinite(sums) | (sums < 0)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise InputError(f"sequence {i}: {MASK_SUMS_KWARG}[{i}]={float(sums[i])!r} is invalid: a trained-token "
                         "count is finite and >= 0", i)
    return sums


def _rollout_counts(sums: Tensor, of_sample: Tensor, count: int) -> Tensor:
    """[G] each rollout's trained-token count, after checking that its samples carry the same one (the count of the
    whole rollout)."""
    if not sums.numel():
        return sums
    first = torch.full((count,), sums.numel(), dtype=torch.long).scatter_reduce_(
        0, of_sample, torch.arange(sums.numel()), "amin")  # each rollout's first sample
    per_group = sums[first]
    expected = per_group[of_sample]
    differs = (sums != expected).nonzero()
    if differs.numel():
        i = int(differs[0])
        first_sample = int(first[of_sample[i]])
        raise InputError(f"sequence {i}: {MASK_SUMS_KWARG}[{i}]={float(sums[i])!r} differs from the first sample of "
                         f"its rollout (sequence {first_sample}: {float(expected[i])!r}): every sample of a rollout "
                         f"carries the whole rollout's count ({_SEE})", i)
    return per_group


def _check_not_more_than_expected(here: Tensor, expected: Tensor, of_sample: Tensor) -> None:
    """A rollout cannot hold more trained tokens in one call than its whole count."""
    over = (here > expected * (1.0 + 1e-6) + 1e-6).nonzero()
    if over.numel():
        group = int(over[0])
        i = int((of_sample == group).nonzero()[0])
        raise InputError(f"sequence {i}: its rollout's samples hold {float(here[group]):g} trained tokens in this call "
                         f"but {MASK_SUMS_KWARG}[{i}]={float(expected[group]):g}: the count of the whole rollout "
                         f"cannot be smaller ({_SEE})", i)
