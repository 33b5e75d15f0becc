"""The engine's sampling masks as a host passes them: how many tokens each sampled token's kept set held.

With top-p, top-k or min-p the engine samples from a truncated set S_t of the vocabulary (its *sampling mask*).
A host that replays it (slime's merged path, miles' sampling-mask PRs, prime-rl) carries per sample the kept ids in
CSR form, ``ids[offsets[t]:offsets[t + 1]]`` for response token t, so the offsets of a response hold
``response_length + 1`` entries. The plugin reads only the sizes |S_t| = offsets[t + 1] − offsets[t]: the
correction itself needs nothing from the mask (the replay happens in the host's log-probs), but the sizes say how
truncated the sampling was (``mis_sampling_mask_*``, miles_mis.correction.truncated_sampling).

Accepted, as optional keyword arguments of the list entry points (per sequence, the FULL response's offsets, as
the hosts store them; under CP each rank takes its own positions, so every rank reports what cp = 1 does):

- ``rollout_sampling_mask_offsets`` (miles' name) or ``rollout_top_p_token_offsets`` (slime's);

and, for a host holding the sizes themselves, ``sampling_mask_sizes``: per sequence, each response's sizes
(``response_length`` integers), or flat at the packed entry point. A size of 0 is an unrecorded mask (prime-rl's
convention for a position without replay): counted, left out of the size statistics. Every failure is an
``InputError`` naming the sequence, raised before any collective (the entry points carry it to their peers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .packing import InputError
from ..tensors.packed_batch import PackedBatch

OFFSET_KWARGS = ("rollout_sampling_mask_offsets", "rollout_top_p_token_offsets")  # miles', slime's
SIZES_KWARG = "sampling_mask_sizes"
KWARGS = (*OFFSET_KWARGS, SIZES_KWARG)
_SEE = "docs/contract.md#sampling-masks"


def given(kwargs: Mapping[str, Any]) -> bool:
    """The host passed sampling-mask sizes in one of the accepted forms."""
    return any(kwargs.get(name) is not None for name in KWARGS)


def with_sizes(batch: PackedBatch, kwargs: Mapping[str, Any], response_lengths: Sequence[int],
               local_positions: Tensor | None) -> PackedBatch:
    """``batch`` with ``mask_sizes`` ([N] float64, this rank's tokens) when the host passes sampling masks;
    unchanged otherwise. ``local_positions``: the local tokens' indices among the full responses (None at cp 1)."""
    names = [name for name in KWARGS if kwargs.get(name) is not None]
    if not names:
        return batch
    if len(names) > 1:
        raise InputError(f"{' and '.join(names)} are all given: they carry the same sampling masks; pass one ({_SEE})")
    name = names[0]
    full = full_sizes(kwargs[name], name, response_lengths)
    device = batch.seq_index.device
    full = full.to(device)
    local = full if local_positions is None else full.index_select(0, local_positions.to(device))
    return dataclasses.replace(batch, mask_sizes=local.double())


def full_sizes(value: Any, name: str, response_lengths: Sequence[int]) -> Tensor:
    """The kept-set sizes of every full response token, concatenated ([Σ response_lengths] int64), from the host's
    offsets (``name`` in OFFSET_KWARGS) or sizes, checked sequence by sequence."""
    lengths = list(response_lengths)
    if isinstance(value, Tensor) and name == SIZES_KWARG:  # flat sizes (the packed entry point)
        return _checked_sizes(value, name, lengths, flat=True)
    if isinstance(value, (str, bytes, Tensor)) or not isinstance(value, Sequence):
        raise InputError(f"{name} is a {type(value).__name__}: expected one entry per sequence ({_SEE})")
    if len(value) != len(lengths):
        raise InputError(f"{name} has {len(value)} sequences but the batch has {len(lengths)}")
    parts = []
    for i, (entry, n) in enumerate(zip(value, lengths)):
        if not isinstance(entry, Tensor):  # an empty list would become float32: a list of no ints is int64
            entry = torch.as_tensor(entry, dtype=torch.long) if _empty_sequence(entry) else torch.as_tensor(entry)
        if entry.is_floating_point() or entry.is_complex() or entry.dtype == torch.bool or entry.ndim != 1:
            raise InputError(f"sequence {i}: {name}[{i}] is a {entry.dtype} tensor of shape {tuple(entry.shape)}: "
                             "expected 1-D integers", i)
        if name == SIZES_KWARG:
            if entry.numel() != n:
                raise InputError(f"sequence {i}: {name}[{i}] has {entry.numel()} sizes but the response has {n} "
                                 "tokens: one per token of the whole response", i)
            parts.append(entry)
            continue
        if entry.numel() != n + 1:
            raise InputError(f"sequence {i}: {name}[{i}] has {entry.numel()} offsets but the response has {n} tokens: "
                             f"CSR offsets of the whole response hold response_length + 1 entries ({_SEE})", i)
        parts.append(entry[1:] - entry[:-1])
    sizes = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
    return _checked_sizes(sizes, name, lengths, flat=name != SIZES_KWARG)


def _empty_sequence(entry: Any) -> bool:
    """A Python sequence with no element (``[]``, ``()``): the spelling of an empty response's sizes."""
    return isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)) and len(entry) == 0


def _checked_sizes(sizes: Tensor, name: str, lengths: list[int], flat: bool) -> Tensor:
    """Sizes ≥ 0, one per response token; the first bad sequence named."""
    if sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool or sizes.ndim != 1:
        raise InputError(f"{name} is a {sizes.dtype} tensor of shape {tuple(sizes.shape)}: expected integers")
    if sizes.numel() != sum(lengths):
        if flat and name == SIZES_KWARG:
            raise InputError(f"{name} has {sizes.numel()} tokens but the responses have {sum(lengths)}")
        ends = torch.tensor(lengths).cumsum(0).tolist()
        i = next((i for i, n in enumerate(lengths) if ends[i] > sizes.numel()), len(lengths) - 1)
        raise InputError(f"sequence {i}: {name} gives {sizes.numel()} sizes for {sum(lengths)} response tokens: "
                         "one per token of the whole response", i)
    negative = (sizes < 0).nonzero()
    if negative.numel():
        token = int(negative[0])
        i = int(torch.searchsorted(torch.tensor(lengths).cumsum(0), token, right=True))
        what = "decrease" if name in OFFSET_KWARGS else "are negative"
        raise InputError(f"sequence {i}: {name}[{i}] {what} at response token {token - sum(lengths[:i])}: a kept "
                         "set holds >= 0 tokens (0 = not recorded)", i)
    return sizes.long()
