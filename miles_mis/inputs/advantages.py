"""The host's advantages, validated: what the directional trust regions read (``rs_divergence``'s dtv, dbkl and
datv options, miles_mis.correction.divergence).

A host passes them as the ``advantages`` keyword argument (slime PR 1912 passes ``torch.cat(batch["advantages"])``),
in one of two layouts:

- a list of B 1-D tensors in ``train_log_probs``' layout (this rank's CP shard of each response);
- one flat 1-D tensor of this rank's N tokens, the sequences concatenated in batch order.

Only their sign is read, A_t·ℓ_t > 0, on valid tokens; a non-finite advantage on a valid token is an error naming its
sequence (the direction of its update is unknown). They are read only when an option needs them and ``use_tis`` is
on: a metrics-only run or a config without a directional option ignores them, so one YAML serves both modes.
Every failure is an ``InputError`` raised before any collective (the entry points carry it to their peers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import Tensor

from ..correction import divergence
from ..config import MisConfig
from .packing import InputError
from ..tensors.packed_batch import PackedBatch

_SEE = "docs/contract.md#advantages"


def needed(config: MisConfig) -> bool:
    """The call reads advantages: a directional ``rs_divergence`` option with ``use_tis`` on."""
    return config.use_tis and divergence.needs_advantages(config.rs_divergence)


def with_advantages(batch: PackedBatch, config: MisConfig, kwargs: Mapping[str, Any]) -> PackedBatch:
    """``batch`` with the signs of the host's advantages ([N] float32 −1/0/1, local token order: a sign, not the value,
    so that no advantage underflows to 0 in float32) when the config reads them; unchanged otherwise. Without them,
    an error naming the options that need them."""
    if not needed(config):
        return batch
    value = kwargs.get("advantages")
    if value is None:
        options = ", ".join(option for option, _, _ in config.rs_divergence
                            if divergence.split_option(option)[1] in divergence.DIRECTIONAL)
        raise InputError(f"rs_divergence option {options} masks a token by the sign of its advantage, but the host "
                         f"passed no advantages (pass advantages=, per sequence or flat; {_SEE})")
    flat = _flat(value, batch)
    _check_finite(flat, batch)
    return dataclasses.replace(batch, advantage_signs=flat.sign().to(torch.float32))


def _flat(value: Any, batch: PackedBatch) -> Tensor:
    """The advantages as one [N] tensor on the batch's device, checked against its local lengths."""
    num_tokens = batch.seq_index.numel()
    if isinstance(value, Tensor):
        if value.ndim != 1 or value.numel() != num_tokens:
            raise InputError(f"advantages is a tensor of shape {tuple(value.shape)}: expected this rank's {num_tokens} "
                             "tokens flat, or a list of B 1-D tensors in train_log_probs' layout")
        flat = value
    elif isinstance(value, (list, tuple)):
        if len(value) != batch.num_seqs:
            raise InputError(f"advantages has {len(value)} sequences but the batch has {batch.num_seqs}")
        expected = batch.seq_lengths.tolist()
        for i, (entry, n) in enumerate(zip(value, expected)):
            if not isinstance(entry, Tensor) or entry.ndim != 1 or entry.numel() != n:
                shape = tuple(entry.shape) if isinstance(entry, Tensor) else type(entry).__name__
                raise InputError(f"sequence {i}: advantages[{i}] is {shape} but train_log_probs[{i}] has {n} tokens: "
                                 "the advantages have train_log_probs' layout (this rank's CP shard)", i)
        flat = torch.cat(list(value)) if value else torch.zeros(0)
    else:
        raise InputError(f"advantages is a {type(value).__name__}: expected a list of B 1-D tensors or one flat "
                         "tensor of this rank's tokens")
    if flat.dtype == torch.bool or flat.is_complex():
        raise InputError(f"advantages is a {flat.dtype} tensor: expected real numbers")
    return flat.detach().to(batch.seq_index.device)


def _check_finite(flat: Tensor, batch: PackedBatch) -> None:
    """Every valid token's advantage is finite (its sign is the direction of its update); the first bad sequence is
    named."""
    bad = ~torch.isfinite(flat) & (batch.loss_mask.to(flat.device) != 0)
    if bool(bad.any()):
        token = int(bad.nonzero()[0])
        i = int(batch.seq_index[token])
        raise InputError(f"sequence {i}: advantages[{i}] holds a non-finite value on a valid token: the directional "
                         "rs_divergence options read its sign (the direction of the token's update)", i)
