"""The miles adapter: the entry points a miles host loads with ``--custom-tis-function-path``.

This is the only layer that sees argparse Namespaces and per-sequence lists; it validates them,
packs them into one ``PackedBatch`` and hands over to the pure core. The host contract is in
docs/contract.md (a copy of the shared contract).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from . import core, distributed
from .config import MisConfig


def compute_mis_weights_with_cp(
    args: Any,
    *,
    pg_loss: Tensor,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor] | None,
    loss_masks: Sequence[Tensor],
    total_lengths: Sequence[int] | None = None,
    response_lengths: Sequence[int] | None = None,
    parallel_state: Any = None,
    max_seq_lens: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """miles entry point: returns (pg_loss × local IS weights, full-length modified masks, ``mis_`` metrics).

    ``train_log_probs``/``rollout_log_probs`` are this CP rank's shards, ``loss_masks`` full length.
    Metrics are 1-D tensors aligned with the local ``pg_loss``. Unknown kwargs are ignored.
    """
    config = MisConfig.from_args(args)
    cp = distributed.resolve_cp_group(parallel_state)
    if cp.size > 1:
        raise NotImplementedError(
            f"context parallel size {cp.size} is not supported by this version of miles_mis "
            "(cp size 1 only); run with --context-parallel-size 1")
    return _apply(config, pg_loss, train_log_probs, rollout_log_probs, loss_masks, response_lengths, total_lengths)


def compute_mis_weights_fsdp(
    args: Any,
    *,
    pg_loss: Tensor,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor] | None,
    loss_masks: Sequence[Tensor],
    **kwargs: Any,
) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """Entry point for hosts without context parallelism (miles' FSDP backend): full sequences."""
    config = MisConfig.from_args(args)
    return _apply(config, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                  kwargs.get("response_lengths"), kwargs.get("total_lengths"))


def compute_mis_weights(
    args: Any,
    *,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor] | None,
    loss_masks: Sequence[Tensor],
) -> tuple[list[Tensor] | None, list[Tensor], dict[str, list[Tensor]]]:
    """Per-sequence API (as miles' ``compute_mis_weights``): full sequences in, per-sequence lists out.

    Returns (weights per sequence, or None in metrics-only mode; modified masks; metrics as
    name -> list of per-sequence tensors). ``args`` may be a Namespace or a ``MisConfig``.
    """
    config = MisConfig.from_args(args)
    batch, lengths = pack_full_sequences(train_log_probs, rollout_log_probs, loss_masks)
    correction = _correct(batch, config)
    split = lambda flat: list(flat.split_with_sizes(lengths))  # noqa: E731
    weights = None if correction.weights is None else split(correction.weights)
    masks = list(_output_masks(batch, correction).split_with_sizes(lengths))
    return weights, masks, {name: split(value) for name, value in correction.metrics.items()}


# --------------------------------------------------------------------------- internals
def _apply(config: MisConfig, pg_loss: Tensor, train_log_probs, rollout_log_probs, loss_masks,
           response_lengths, total_lengths) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    batch, lengths = pack_full_sequences(train_log_probs, rollout_log_probs, loss_masks,
                                         response_lengths=response_lengths, total_lengths=total_lengths)
    if pg_loss.dim() != 1 or pg_loss.numel() != batch.train_log_probs.numel():
        raise ValueError(f"pg_loss has shape {tuple(pg_loss.shape)} but the {len(lengths)} sequences hold "
                         f"{batch.train_log_probs.numel()} local tokens: expected shape "
                         f"({batch.train_log_probs.numel()},)")
    correction = _correct(batch, config)
    if correction.weights is not None:
        weighted = pg_loss * correction.weights.to(pg_loss.dtype)
        # where, not a bare product: a NaN pg_loss on a rejected token must not survive as NaN·0
        pg_loss = torch.where(correction.token_keep > 0, weighted, torch.zeros_like(weighted))
    masks = list(_output_masks(batch, correction).split_with_sizes(lengths))  # (torch.split is slow on lists)
    return pg_loss, masks, correction.metrics


def _output_masks(batch: core.PackedBatch, correction: core.Correction) -> Tensor:
    """Flat modified masks in the input masks' dtype; in metrics-only mode the input values unchanged
    (a new tensor: the concatenation made while packing)."""
    if correction.weights is None:
        return batch.loss_mask
    return correction.token_keep.to(batch.loss_mask.dtype)


def _correct(batch: core.PackedBatch, config: MisConfig) -> core.Correction:
    terms = core.token_terms(batch, config)
    stats = core.combine_seq_stats(distributed.all_gather_table(core.local_seq_stats(batch, terms),
                                                                distributed.SINGLE))
    return core.finalize(batch, terms, stats, config)


def pack_full_sequences(train_log_probs, rollout_log_probs, loss_masks, *, response_lengths=None,
                        total_lengths=None) -> tuple[core.PackedBatch, list[int]]:
    """Validate per-sequence lists of full (unsharded) responses and concatenate them."""
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs is None: the host must return rollout log-probs from the engine "
                         "(miles: the rollout must keep per-token log-probs) to measure or correct the mismatch")
    if train_log_probs is None:
        raise ValueError("train_log_probs is None: the host must pass the trainer's recomputed log-probs")
    counts = {"train_log_probs": len(train_log_probs), "rollout_log_probs": len(rollout_log_probs),
              "loss_masks": len(loss_masks)}
    for name, values in (("response_lengths", response_lengths), ("total_lengths", total_lengths)):
        if values is not None:
            counts[name] = len(values)
    if len(set(counts.values())) > 1:
        raise ValueError("inputs disagree on the number of sequences: "
                         + ", ".join(f"{name} has {n}" for name, n in counts.items()))
    # Cheap whole-list checks first (numel, not .shape, which is slow on views; 1-D is checked on the
    # concatenated result); the sequences are walked only to name the first bad one.
    lengths = [t.numel() for t in train_log_probs]
    flat = None
    if lengths == [t.numel() for t in rollout_log_probs] == [m.numel() for m in loss_masks]:
        try:
            flat = [torch.cat(list(seq)) if len(seq) else torch.zeros(0)
                    for seq in (train_log_probs, rollout_log_probs, loss_masks)]
        except RuntimeError:  # mixed dimensions
            flat = None
    if flat is None or any(f.ndim != 1 for f in flat):
        _raise_first_shape_error(train_log_probs, rollout_log_probs, loss_masks)
    if response_lengths is not None and list(map(int, response_lengths)) != lengths:
        i = next(i for i, (r, n) in enumerate(zip(response_lengths, lengths)) if int(r) != n)
        raise ValueError(f"sequence {i}: response_lengths[{i}]={int(response_lengths[i])} but its log-probs "
                         f"have shape ({lengths[i]},)")
    if total_lengths is not None and response_lengths is not None:
        short = [i for i, (t, r) in enumerate(zip(total_lengths, response_lengths)) if int(t) < int(r)]
        if short:
            i = short[0]
            raise ValueError(f"sequence {i}: total_lengths[{i}]={int(total_lengths[i])} is smaller than "
                             f"response_lengths[{i}]={int(response_lengths[i])}")
    train, rollout, masks = flat
    device = train.device
    batch = core.PackedBatch.from_flat(train, rollout.to(device), masks.to(device),  # nonzero = trained token
                                       torch.tensor(lengths, dtype=torch.long, device=device))
    return batch, lengths


def _raise_first_shape_error(train_log_probs, rollout_log_probs, loss_masks) -> None:
    for i, tensors in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
        shapes = [tuple(t.shape) for t in tensors]
        if len(shapes[0]) != 1 or len(set(shapes)) > 1:
            raise ValueError(f"sequence {i}: train_log_probs has shape {shapes[0]}, rollout_log_probs has "
                             f"shape {shapes[1]}, loss_masks has shape {shapes[2]}; all must be the same 1-D shape")
    raise ValueError("inputs are not lists of 1-D tensors")
