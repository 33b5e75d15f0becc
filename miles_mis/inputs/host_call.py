"""What a host passes to an entry point, read once into one typed value, ``HostCall``.

Every entry point of ``miles_mis.plugin`` hands its arguments here and gets back a ``HostCall``. The arguments are
the config (a Namespace, a mapping or a ``MisConfig``); the log-probs and masks, as miles' per-sequence lists (this
CP rank's shards: ``read_lists``) or as flat packed tensors with ``cu_seqlens`` (``read_flat``); and the optional
inputs, from the host's keyword arguments or, through ``batch_channel.BATCH_INPUTS``, from the batch a host adapter
read. This module:

1. receives what a host adapter sent (the host's own keyword arguments win) and builds the config;
2. picks the log-probs of the ratio's numerator (``numerator_log_probs``: π_old, or the current policy with
   ``tis_policy: current``; the one place that switch is made);
3. validates and packs the tokens (``packing``);
4. adds each optional input, read in its own module: advantages (``advantages``), lags (``versions``), sampling
   masks (``sampling_mask``) and split rollouts (``rollouts``);
5. under CP, appends the lags and rollout groups to the length table the ranks compare.

``HostCall.settings()`` is the text the CP and DP peers compare. Below this module nothing sees a Namespace, a list
or a keyword argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import MisConfig, host_setting
from ..correction import staleness
from ..parallel import distributed, peers
from ..tensors import backend
from ..tensors.packed_batch import PackedBatch
from . import advantages, rollouts, sampling_mask, versions
from .batch_channel import BATCH_INPUTS
from .packing import PackedInputs, check_pg_loss, long_tensor, pack_flat, pack_sequences, qkv_format_of


@dataclass(frozen=True)
class LogProbLists:
    """The hook's per-sequence arguments, as miles passes them (``train_log_probs`` and ``rollout_log_probs``: this
    CP rank's shards; ``loss_masks``: full responses; the lengths name the zigzag layout)."""

    train_log_probs: Sequence[Tensor]
    rollout_log_probs: Sequence[Tensor] | None
    loss_masks: Sequence[Tensor]
    total_lengths: Sequence[int] | None = None
    response_lengths: Sequence[int] | None = None
    max_seq_lens: Sequence[int] | None = None


@dataclass(frozen=True)
class HostCall:
    """One entry point call, read: what the core and the peers need, and nothing of the host's own types."""

    config: MisConfig
    inputs: PackedInputs  # this rank's validated tokens with the optional inputs, and the full masks' layout
    qkv_format: str  # "thd" or "bshd" (the packed entry point and whole sequences: "thd")
    numerator_is_current: bool  # the ratio's numerator is π_θ: the skip-forward mode or tis_policy: current

    @property
    def batch(self) -> PackedBatch:
        return self.inputs.batch

    def settings(self) -> str:
        """The call's effective settings (``config_text``), which every CP and DP peer must share."""
        batch = self.inputs.batch
        return config_text(self.config, self.qkv_format, batch.lags is not None, batch.mask_sizes is not None,
                           rollouts.form(batch.rollouts))


def read_lists(args: Any, lists: LogProbLists, kwargs: Mapping[str, Any], *, cp: distributed.Group = distributed.SINGLE,
               qkv_format: str | None = None, pg_loss: Tensor | None = None,
               single_process_entry: str | None = None) -> HostCall:
    """The call of a list entry point. ``pg_loss``, when given, is checked against the packed tokens;
    ``single_process_entry`` names an entry point without a data-parallel group, which refuses the dp scopes."""
    given = BATCH_INPUTS.received(kwargs)
    config = MisConfig.from_args(args)
    refuse_score_centering(config)
    if single_process_entry is not None:
        refuse_dp_scopes(config, single_process_entry)
    qkv_format = qkv_format or qkv_format_of(args)
    train_log_probs, train_name = numerator_log_probs(config, given, lists.train_log_probs)
    packed = pack_sequences(train_log_probs, lists.rollout_log_probs, lists.loss_masks,
                            total_lengths=lists.total_lengths, response_lengths=lists.response_lengths,
                            max_seq_lens=lists.max_seq_lens, cp=cp, qkv_format=qkv_format, train_name=train_name)
    packed = with_optional_inputs(packed, config, given, lambda: full_mask_sums(packed))
    if pg_loss is not None:
        check_pg_loss(pg_loss, packed.batch)
    return HostCall(config, packed, qkv_format, numerator_is_current(args, config))


def read_flat(args: Any, train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, cu_seqlens: Tensor,
              kwargs: Mapping[str, Any], single_process_entry: str = "compute_mis_weights_packed") -> HostCall:
    """The call of the packed entry point: flat [N] tensors and [B+1] offsets of whole sequences."""
    given = BATCH_INPUTS.received(kwargs)
    config = MisConfig.from_args(args)
    refuse_score_centering(config)
    refuse_dp_scopes(config, single_process_entry)
    train_log_probs, train_name = numerator_log_probs(config, given, train_log_probs, flat=True)
    batch = pack_flat(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, train_name=train_name)
    packed = PackedInputs(batch=batch, full_masks=batch.loss_mask, response_lengths=batch.seq_lengths.tolist(),
                          local_positions=None, length_table=None)
    packed = with_optional_inputs(packed, config, given, lambda: packed.batch.per_seq_sum(packed.batch.loss_mask))
    return HostCall(config, packed, "thd", numerator_is_current(args, config))


def numerator_log_probs(config: MisConfig, given: Mapping[str, Any], train_log_probs: Any,
                        flat: bool = False) -> tuple[Any, str]:
    """(the log-probs the ratio compares with π_rollout, what error messages call them): ``train_log_probs`` (π_old),
    or with ``tis_policy: current`` the host's current-policy log-probs (``cur_log_probs`` or
    ``current_log_probs``), detached; per sequence in ``train_log_probs``' layout, or flat (``flat``)."""
    if config.tis_policy != "current":
        return train_log_probs, "train_log_probs"
    current = versions.current_policy(given)
    if flat:
        versions.require_current(current, "current_log_probs")
        name = "current_log_probs" if given.get("current_log_probs") is not None else "cur_log_probs"
        return (current.detach() if isinstance(current, Tensor) else current), name
    versions.require_current(current)
    return versions.detached_list(current, train_log_probs), "cur_log_probs"


def with_optional_inputs(packed: PackedInputs, config: MisConfig, given: Mapping[str, Any],
                         full_mask_sums: Callable[[], Tensor]) -> PackedInputs:
    """``packed`` with what the host passed beyond the log-probs: the advantages' signs the config reads, each
    sequence's lag (an error when the config needs lags and none came: ``staleness.require_lags``), the sampling
    masks' sizes and the split rollouts (``full_mask_sums``: [B] each sample's mask sum over its whole response,
    computed only when rollouts are given). Under CP the lags and rollout groups join the length table the ranks
    compare, so the ranks must agree on them sequence by sequence."""
    batch = advantages.with_advantages(packed.batch, config, given)
    batch = with_lags(batch, config, given)
    batch = sampling_mask.with_sizes(batch, given, packed.response_lengths, packed.local_positions)
    if rollouts.given(given):
        batch = dataclasses.replace(batch, rollouts=rollouts.groups_of(given, full_mask_sums(), batch.seq_index.device))
    if batch.lags is None and batch.rollouts is None:
        return packed if batch is packed.batch else dataclasses.replace(packed, batch=batch)
    table, names = packed.length_table, packed.length_names
    if table is not None:
        groups = None if batch.rollouts is None else batch.rollouts.of_sample
        for name, column in (("version_lag", batch.lags), ("rollout_group", groups)):
            if column is not None:
                table = torch.cat([table, column.to(table.device, table.dtype)[:, None]], dim=1)
                names = (*names, name)
    return dataclasses.replace(packed, batch=batch, length_table=table, length_names=names)


def with_lags(batch: PackedBatch, config: MisConfig, given: Mapping[str, Any]) -> PackedBatch:
    """``batch`` with each sequence's lag and their mean (``versions.lag_list``); unchanged without lags."""
    values = versions.lag_list(given, batch.num_seqs)
    staleness.require_lags(config, values is not None)
    if values is None:
        return batch
    lags = long_tensor(values, batch.seq_index.device)
    return dataclasses.replace(batch, lags=lags, lag_mean=sum(values) / len(values) if values else 0.0)


def full_mask_sums(packed: PackedInputs) -> Tensor:
    """[B] float64 each sample's mask sum over its WHOLE response (the same on every CP rank)."""
    lengths = long_tensor(packed.response_lengths, packed.full_masks.device)
    sample = torch.repeat_interleave(lengths, output_size=packed.full_masks.numel())
    return torch.zeros(lengths.numel(), dtype=torch.float64, device=lengths.device).index_add_(
        0, sample, packed.full_masks.double())


def refuse_score_centering(config: MisConfig) -> None:
    """Score centering needs the logits, which the hook never receives: it runs in the custom-loss adapters."""
    if config.score_centering:
        raise ValueError("score_centering: true runs in the custom-loss adapters, which receive the logits "
                         "(--loss-type custom_loss --custom-loss-function-path "
                         "miles_mis.hosts.miles_loss.policy_loss or miles_mis.hosts.slime_loss.policy_loss); "
                         "the --custom-tis-function-path hook cannot run it")


def refuse_dp_scopes(config: MisConfig, entry: str) -> None:
    """The single-process entry points have no data-parallel group: a dp scope would silently act per
    micro-batch, so it is an error naming the key."""
    scopes = peers.dp_scopes(config)
    keys = [key for key, used in (("tis_batch_normalize_scope", scopes.normalize),
                                  ("rs_batch_gate_scope", scopes.gate),
                                  ("tis_auto_scope", scopes.token_bound or scopes.seq_bound)) if used]
    if keys:
        raise ValueError(f"{', '.join(f'{key}: dp' for key in keys)} needs the data-parallel group, which {entry} "
                         "does not take (it runs on one process's micro-batch): use micro_batch, or "
                         "compute_mis_weights_with_cp with parallel_state")


def numerator_is_current(args: Any, config: MisConfig) -> bool:
    """The ratio's numerator is π_θ, not π_old: the host skipped the old-policy forward (miles'
    ``--skip-actor-forward-only``: its ``train_log_probs`` are the training forward's own, detached) or the config
    reads the current policy (``tis_policy: current``)."""
    return bool(host_setting(args, "skip_actor_forward_only")) or config.tis_policy == "current"


def config_text(config: MisConfig, qkv_format: str, has_lags: bool = False, has_mask_sizes: bool = False,
                rollout_inputs: str = "none") -> str:
    """The effective settings of a call as "key=value" lines: compared across ranks (fingerprint) and shown
    key by key when they differ. Whether the host passed lags and split-rollout inputs (they change the table's
    width) and sampling masks (they add metrics) is part of it: every rank of a group must agree on them, and so on
    the kernel backend each rank actually runs (``backend.effective``: eager where a compiler is missing).
    ``rollout_inputs``: ``rollouts.form`` ("ids", "mask_sums" or "none")."""
    values = dict(config.to_dict(), kernel_backend=backend.effective(config.kernel_backend), qkv_format=qkv_format,
                  version_lags="given" if has_lags else "none",
                  sampling_masks="given" if has_mask_sizes else "none", rollout_inputs=rollout_inputs)
    return "\n".join(f"{key}={values[key]!r}" for key in sorted(values))
