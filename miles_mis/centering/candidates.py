"""The engine's top-K candidates of every response token, as a host passes them: read, validated, packed.

Score centering (docs/math.md) needs, at each position, the K candidates the engine recorded (its top-K ids under the
sampling distribution) and their rollout log-probs. The hosts carry them per sample over the whole response:

- ``rollout_topk_token_ids``: [response_length, K] integers, a row per response token, unused slots ``-1``;
- ``rollout_topk_log_probs``: [response_length, K] floats, the engine's log-prob of each id, unused slots ``-inf``.

A used slot has an id ≥ 0, no id twice in a row, and a finite log-prob; an unused slot has id ``-1`` (its log-prob is
``-inf``); a row's recorded mass Σ exp(log-prob) is at most 1 (up to ``MASS_TOLERANCE``: the engine's own rounding).
K is the same for every sample. Under context parallelism each rank takes its own rows (``local_positions``, the
indices of its tokens among the full responses, as the log-probs are sharded), so every rank reads what cp = 1 reads.

The cheap whole-batch checks run first, a fixed number of tensor operations whatever the batch size; the rows are
searched only after a check failed, to name the first bad sequence, token and slot (an ``InputError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ..inputs.packing import InputError

IDS_KWARG = "rollout_topk_token_ids"
LOG_PROBS_KWARG = "rollout_topk_log_probs"
UNUSED_ID = -1
MASS_TOLERANCE = 1.0e-3  # a row's recorded probabilities may sum a little above 1 in the engine's precision


@dataclass(frozen=True)
class Candidates:
    """The recorded candidates of the local tokens, flat: row t is token t of the packed batch."""

    ids: Tensor  # [N, K] int64, UNUSED_ID in unused slots
    log_probs: Tensor  # [N, K] float32, the engine's log-probs; -inf in unused slots

    @property
    def used(self) -> Tensor:
        """[N, K] bool: the slot holds a candidate."""
        return self.ids >= 0

    @property
    def width(self) -> int:
        """K, the slots per token."""
        return self.ids.shape[1]


def read_candidates(ids: Any, log_probs: Any, response_lengths: Sequence[int],
                    local_positions: Tensor | None = None) -> Candidates:
    """The candidates of the local tokens from the host's per-sample [response_length, K] tensors (or one flat
    [Σ response_lengths, K] tensor each), checked. ``local_positions``: this rank's tokens among the full responses
    (None: all of them, in order, as at cp = 1)."""
    lengths = [int(n) for n in response_lengths]
    if ids is None or log_probs is None:
        missing = IDS_KWARG if ids is None else LOG_PROBS_KWARG
        present = LOG_PROBS_KWARG if ids is None else IDS_KWARG
        raise InputError(f"{present} is given without {missing}: score centering reads both (the ids and the "
                         "engine's log-probs of the same candidates)")
    flat_ids = _concatenated(ids, IDS_KWARG, lengths, integer=True)
    flat_log_probs = _concatenated(log_probs, LOG_PROBS_KWARG, lengths, integer=False)
    if flat_ids.shape != flat_log_probs.shape:
        raise InputError(f"{IDS_KWARG} has {tuple(flat_ids.shape)[1]} slots per token but {LOG_PROBS_KWARG} has "
                         f"{tuple(flat_log_probs.shape)[1]}: the same K for both")
    flat_ids = flat_ids.long()
    flat_log_probs = flat_log_probs.float()
    _check_rows(flat_ids, flat_log_probs, lengths)
    if local_positions is not None:
        positions = local_positions.to(flat_ids.device)
        flat_ids, flat_log_probs = flat_ids.index_select(0, positions), flat_log_probs.index_select(0, positions)
    return Candidates(flat_ids, flat_log_probs)


def _concatenated(value: Any, name: str, lengths: list[int], integer: bool) -> Tensor:
    """[Σ lengths, K] from one flat tensor or a list of per-sample [length, K] tensors (the same K)."""
    kind = "integers" if integer else "floating point"
    if isinstance(value, Tensor):
        parts, flat = [value], True
    elif isinstance(value, (list, tuple)):
        if len(value) != len(lengths):
            raise InputError(f"{name} has {len(value)} sequences but the batch has {len(lengths)}")
        parts, flat = list(value), False
    else:
        raise InputError(f"{name} is a {type(value).__name__}: expected one [response_length, K] tensor per "
                         "sequence, or one flat [N, K] tensor")
    for i, part in enumerate(parts):
        where = name if flat else f"sequence {i}: {name}[{i}]"
        if not isinstance(part, Tensor):
            raise InputError(f"{where} is a {type(part).__name__}, not a tensor", -1 if flat else i)
        if part.is_complex() or part.dtype == torch.bool or part.is_floating_point() == integer:
            raise InputError(f"{where} has dtype {part.dtype}: expected {kind}", -1 if flat else i)
        expected = sum(lengths) if flat else lengths[i]
        if part.ndim != 2 or part.shape[0] != expected or part.shape[1] < 1:
            raise InputError(f"{where} has shape {tuple(part.shape)}: expected ({expected}, K) with K ≥ 1, a row "
                             "per token of the whole response", -1 if flat else i)
    widths = {part.shape[1] for part in parts}
    if len(widths) > 1:
        i = next(i for i, part in enumerate(parts) if part.shape[1] != parts[0].shape[1])
        raise InputError(f"sequence {i}: {name}[{i}] has {parts[i].shape[1]} slots per token but {name}[0] has "
                         f"{parts[0].shape[1]}: the same K for every sequence", i)
    if not parts:
        return torch.zeros((0, 1), dtype=torch.long if integer else torch.float32)
    return parts[0] if flat else torch.cat(parts)


def _check_rows(ids: Tensor, log_probs: Tensor, lengths: list[int]) -> None:
    """Every slot used or unused as a whole, no repeated id in a row, each row's mass ≤ 1 (+ tolerance)."""
    used = ids >= 0
    bad_slot = (ids < UNUSED_ID) | (used & ~torch.isfinite(log_probs)) | (~used & (log_probs != float("-inf")))
    ordered = ids.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    mass = torch.where(used, log_probs.double().exp(), 0.0).sum(dim=1)
    heavy = mass > 1.0 + MASS_TOLERANCE
    if not bool(bad_slot.any() | repeated.any() | heavy.any()):
        return
    token = int((bad_slot.any(1) | repeated.any(1) | heavy).nonzero()[0])
    i = int(torch.searchsorted(torch.tensor(lengths).cumsum(0), token, right=True))
    at = f"sequence {i}, response token {token - sum(lengths[:i])}"
    if bool(bad_slot[token].any()):
        slot = int(bad_slot[token].nonzero()[0])
        value, log_prob = int(ids[token, slot]), float(log_probs[token, slot])
        raise InputError(f"{at}, slot {slot}: id {value} with log-prob {log_prob}: a used slot has an id ≥ 0 and a "
                         f"finite log-prob, an unused one id {UNUSED_ID} and log-prob -inf", i)
    if bool(repeated[token].any()):
        value = int(ordered[token, 1:][repeated[token]][0])
        raise InputError(f"{at}: {IDS_KWARG} holds id {value} twice: each candidate once per token", i)
    raise InputError(f"{at}: the recorded candidates' probabilities sum to {float(mass[token]):.6g} > 1: "
                     f"{LOG_PROBS_KWARG} are not log-probs of one distribution", i)
