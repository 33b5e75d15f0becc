"""The miles adapter: the entry points a miles host loads with ``--custom-tis-function-path``.

Each entry point takes what the host passes (a Namespace or ``MisConfig``, per-sequence lists or flat packed
tensors), has ``miles_mis.inputs.packing`` validate it and pack this rank's tokens into one ``PackedBatch``, runs the
pure core, and, under context parallelism, exchanges the per-sequence table over the CP group
(``miles_mis.parallel.peers`` orchestrates the call with its CP and DP peers, ``miles_mis.parallel.distributed`` holds the
collectives); below these modules nothing sees Namespaces or lists. Hosts that
already hold packed tokens (THD, padding removed) call ``compute_mis_weights_packed``, which takes the flat
tensors and ``cu_seqlens`` without lists. The host contract is in docs/contract.md; the CP layout in docs/cp.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .inputs import advantages, adapter_inputs, rollouts, sampling_mask, versions
from .tensors import backend
from . import correction
from .parallel import distributed, peers
from .correction import staleness
from .tensors.packed_batch import PackedBatch
from .config import MisConfig, host_setting
from .inputs.packing import PackedInputs, check_pg_loss, long_tensor, pack_flat, pack_sequences, qkv_format_of
# also importable from here: the contract's error type
from .inputs.packing import InputError  # noqa: F401


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
    Metrics are 1-D tensors aligned with the local ``pg_loss``. Optional kwargs (docs/contract.md): the current
    policy's log-probs ``cur_log_probs``/``current_log_probs`` (same layout as ``train_log_probs``; read with
    ``tis_policy: current``), each sequence's lag, ``version_lags`` or ``weight_versions`` with
    ``current_weight_version`` (docs/staleness.md), and ``advantages`` (per sequence in ``train_log_probs``' layout,
    or flat; read by the directional ``rs_divergence`` options), and the engine's sampling masks as the hosts carry
    them (``rollout_sampling_mask_offsets``, ``rollout_top_p_token_offsets`` or ``sampling_mask_sizes``, per sequence
    over the whole response; miles_mis.inputs.sampling_mask). Other unknown kwargs are ignored. Any failure on any CP rank
    (bad config, bad inputs) raises on every rank of the group (docs/reliability.md).
    """
    cp = distributed.resolve_cp_group(parallel_state)  # without it there is nobody to agree with
    return _run(args, cp, parallel_state, pg_loss,
                (train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, max_seq_lens),
                extra=kwargs)


def compute_mis_weights_fsdp(
    args: Any,
    *,
    pg_loss: Tensor,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor] | None,
    loss_masks: Sequence[Tensor],
    **kwargs: Any,
) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """Entry point for hosts without context parallelism (miles' FSDP backend): full sequences. The optional
    kwargs of ``compute_mis_weights_with_cp`` (current policy, lags, advantages) are read the same way."""
    return _run(args, distributed.SINGLE, kwargs.get("parallel_state"), pg_loss,
                (train_log_probs, rollout_log_probs, loss_masks, kwargs.get("total_lengths"),
                 kwargs.get("response_lengths"), None), qkv_format="thd", extra=kwargs)


def compute_mis_weights(
    args: Any,
    *,
    train_log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor] | None,
    loss_masks: Sequence[Tensor],
    **kwargs: Any,
) -> tuple[list[Tensor] | None, list[Tensor], dict[str, list[Tensor]]]:
    """Per-sequence API (as miles' ``compute_mis_weights``): full sequences in, per-sequence lists out.

    Returns (weights per sequence, or None in metrics-only mode; modified masks; metrics as
    name -> list of per-sequence tensors). ``args`` may be a Namespace or a ``MisConfig``. The optional kwargs of
    ``compute_mis_weights_with_cp`` (current policy, lags, advantages) are read the same way.
    """
    config = MisConfig.from_args(args)
    _refuse_dp_scopes(config, "compute_mis_weights")
    train_log_probs = _policy_log_probs(config, train_log_probs, kwargs)
    packed = _with_optional_inputs(pack_sequences(train_log_probs, rollout_log_probs, loss_masks,
                                                  train_name=_train_name(config)), config, kwargs)
    result = _correct_whole_sequences(packed.batch, config, args)
    split = lambda flat: list(flat.split_with_sizes(packed.response_lengths))  # noqa: E731
    weights = None if result.weights is None else split(result.weights)
    return weights, split(_full_masks(packed, result)), {k: split(v) for k, v in result.metrics.items()}


def compute_mis_weights_packed(
    config: Any,
    *,
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    current_log_probs: Tensor | None = None,
    version_lags: Any = None,
    **kwargs: Any,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """Packed API for hosts that already hold concatenated response tokens (Megatron THD, verl without padding).

    ``train_log_probs``, ``rollout_log_probs``, ``loss_mask``: flat [N] tensors, the B responses concatenated;
    ``cu_seqlens``: int64 [B+1] offsets (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == N``):
    sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``. Whole sequences (context parallel size 1).
    Returns (weights [N], or None in metrics-only mode; the mask [N]: the input values and dtype with
    rejected tokens 0; metrics: name -> [N] float32), the same values as ``compute_mis_weights`` on the
    same sequences, concatenated. ``config`` may be a Namespace or a ``MisConfig``. Invalid inputs raise
    ``InputError`` (a ``ValueError``) naming what is wrong (docs/contract.md). ``current_log_probs`` (flat [N], also
    accepted as ``cur_log_probs``): the current policy, read with ``tis_policy: current``; ``version_lags`` (B
    integers, or ``weight_versions`` with ``current_weight_version``): each sequence's lag (docs/staleness.md);
    ``advantages`` (flat [N]): read by the directional ``rs_divergence`` options.
    """
    config_args, config = config, MisConfig.from_args(config)
    _refuse_dp_scopes(config, "compute_mis_weights_packed")
    given = dict(kwargs, current_log_probs=current_log_probs, version_lags=version_lags)
    train_name = "train_log_probs"
    if config.tis_policy == "current":
        current = versions.current_policy(given)
        versions.require_current(current, "current_log_probs")
        train_name = "current_log_probs" if current_log_probs is not None else "cur_log_probs"
        train_log_probs = current.detach() if isinstance(current, Tensor) else current
    batch = _batch_with_optional_inputs(pack_flat(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens,
                                                  train_name=train_name), config, given)
    batch = sampling_mask.with_sizes(batch, given, batch.seq_lengths.tolist(), None)
    batch = _with_rollouts(batch, given, lambda: batch.per_seq_sum(batch.loss_mask))
    result = _correct_whole_sequences(batch, config, config_args)
    if result.weights is None:  # metrics-only: the input values unchanged, in a new tensor
        return None, batch.loss_mask.clone(), result.metrics
    return result.weights, _zero_rejected(batch.loss_mask, result.token_keep), result.metrics


# --------------------------------------------------------------------------- the optional kwargs
def _train_name(config: MisConfig) -> str:
    """What the error messages call the log-probs in the ratio's numerator."""
    return "cur_log_probs" if config.tis_policy == "current" else "train_log_probs"


def _policy_log_probs(config: MisConfig, train_log_probs: Any, kwargs: dict) -> Any:
    """The per-sequence log-probs the ratio compares with π_rollout: ``train_log_probs`` (π_old), or with
    ``tis_policy: current`` the host's current-policy log-probs, detached (``miles_mis.inputs.versions``)."""
    if config.tis_policy != "current":
        return train_log_probs
    current = versions.current_policy(kwargs)
    versions.require_current(current)
    return versions.detached_list(current, train_log_probs)


def _with_optional_inputs(packed: PackedInputs, config: MisConfig, kwargs: dict) -> PackedInputs:
    """``packed`` with each sequence's lag (``miles_mis.inputs.versions``) when the host passes them: in the batch, and
    under CP in the length table the exchange compares (so the ranks' lags must agree, sequence by sequence); and
    with the advantages' signs when the config reads them (``miles_mis.inputs.advantages``)."""
    batch = sampling_mask.with_sizes(_batch_with_optional_inputs(packed.batch, config, kwargs), kwargs,
                                     packed.response_lengths, packed.local_positions)
    batch = _with_rollouts(batch, kwargs, lambda: _full_mask_sums(packed))
    if batch.lags is None and batch.rollouts is None:
        return packed if batch is packed.batch else dataclasses.replace(packed, batch=batch)
    table, names = packed.length_table, packed.length_names
    if table is not None:  # the ranks must agree on each sample's lag and rollout too
        groups = None if batch.rollouts is None else batch.rollouts.of_sample
        for name, column in (("version_lag", batch.lags), ("rollout_group", groups)):
            if column is not None:
                table = torch.cat([table, column.to(table.device, table.dtype)[:, None]], dim=1)
                names = (*names, name)
    return dataclasses.replace(packed, batch=batch, length_table=table, length_names=names)


def _full_mask_sums(packed: PackedInputs) -> Tensor:
    """[B] float64 each sample's mask sum over its WHOLE response (the same on every CP rank)."""
    lengths = long_tensor(packed.response_lengths, packed.full_masks.device)
    sample = torch.repeat_interleave(lengths, output_size=packed.full_masks.numel())
    return torch.zeros(lengths.numel(), dtype=torch.float64, device=lengths.device).index_add_(
        0, sample, packed.full_masks.double())


def _with_rollouts(batch: PackedBatch, kwargs: dict, full_mask_sums: Callable[[], Tensor]) -> PackedBatch:
    """``batch`` with the host's split rollouts (``miles_mis.inputs.rollouts``) when it passes ``rollout_ids``;
    ``full_mask_sums`` is computed only then."""
    if not rollouts.given(kwargs):
        return batch
    groups = rollouts.groups_of(kwargs, full_mask_sums(), batch.seq_index.device)
    return dataclasses.replace(batch, rollouts=groups)


def _batch_with_optional_inputs(batch: PackedBatch, config: MisConfig, kwargs: dict) -> PackedBatch:
    """``batch`` with the host's lags and their mean (``miles_mis.inputs.versions``; unchanged when it passes none, an error
    when the config needs them: ``staleness.require_lags``) and the advantages' signs the config reads
    (``miles_mis.inputs.advantages``)."""
    batch = advantages.with_advantages(batch, config, kwargs)
    values = versions.lag_list(kwargs, batch.num_seqs)
    staleness.require_lags(config, values is not None)
    if values is None:
        return batch
    lags = long_tensor(values, batch.seq_index.device)
    return dataclasses.replace(batch, lags=lags, lag_mean=sum(values) / len(values) if values else 0.0)


# --------------------------------------------------------------------------- whole sequences, one process
def _refuse_dp_scopes(config: MisConfig, entry: str) -> None:
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


def _correct_whole_sequences(batch: PackedBatch, config: MisConfig, args: Any = None) -> correction.Correction:
    """The core on whole sequences (context parallel size 1): the local table is the whole table."""
    result = correction.correct(batch, config)
    peers.log_warning(result)
    return with_policy_metric(result, args, config, batch.seq_index.numel())


# --------------------------------------------------------------------------- the call with CP and DP peers
def _run(args: Any, cp: distributed.Group, parallel_state: Any, pg_loss: Tensor, inputs: tuple,
         qkv_format: str | None = None, extra: dict | None = None):
    """Prepare locally, then the correction with the CP and DP peers (``peers.PeerReductions``).

    Any exception before the agreement is carried into its header instead of being raised alone, so every CP
    rank raises together; the DP peers are told in the first DP exchange they wait in (docs/reliability.md).
    """
    config = packed = None
    text = ""
    try:
        config, packed, text = _prepare(args, cp, pg_loss, inputs, qkv_format, extra or {})
        dp = peers.dp_group(config, parallel_state)
    except Exception as failure:  # noqa: BLE001 (raised on every peer by fail)
        # a rank without its config joins the DP group its raw settings name (its DP peers wait for it there)
        dp = distributed.SINGLE if config is not None else peers.dp_group_of_raw_args(args, parallel_state)
        peers.PeerReductions(cp, dp, config, None, text).fail(failure)
        raise
    result = correction.correct(packed.batch, config, peers.PeerReductions(cp, dp, config, packed, text))
    peers.log_warning(result, cp)
    result = with_policy_metric(result, args, config, packed.batch.seq_index.numel())
    if result.weights is not None:
        pg_loss = weigh_loss(pg_loss, result.weights, result.token_keep)
    masks = list(_full_masks(packed, result, result.exchanged).split_with_sizes(packed.response_lengths))
    return pg_loss, masks, result.metrics


def skips_old_policy_forward(args: Any) -> bool:
    """The host skipped the old-policy forward (miles' ``--skip-actor-forward-only``): its ``train_log_probs`` are
    then the training forward's own log-probs (π_θ, detached), not a separate π_old pass."""
    return bool(host_setting(args, "skip_actor_forward_only"))


def with_policy_metric(result: correction.Correction, args: Any, config: MisConfig,
                       num_tokens: int) -> correction.Correction:
    """``result`` with ``mis_numerator_is_current_policy`` (1 on every token) when the ratio's numerator is π_θ,
    not π_old: the skip-forward mode or ``tis_policy: current``. Then the measured mismatch is π_θ against
    π_rollout, staleness and (after the first minibatch) the update included
    (docs/hosts.md#skip-the-old-policy-forward)."""
    if not (skips_old_policy_forward(args) or config.tis_policy == "current"):
        return result
    ones = torch.ones((), dtype=torch.float32, device=result.token_keep.device).expand(num_tokens)
    metrics = dict(sorted({**result.metrics, "mis_numerator_is_current_policy": ones}.items()))
    return dataclasses.replace(result, metrics=metrics)


def _prepare(args: Any, cp: distributed.Group, pg_loss: Tensor, inputs: tuple, qkv_format: str | None,
             extra: dict) -> tuple[MisConfig, PackedInputs, str]:
    """The config, this rank's validated tokens and the call's settings text (``config_text``): everything before
    the first exchange. The inputs a host adapter provides (``miles_mis.inputs.adapter_inputs``) join ``extra`` here, inside
    the agreement."""
    extra = adapter_inputs.with_provided(extra)
    config = MisConfig.from_args(args)
    qkv_format = qkv_format or qkv_format_of(args)
    train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, max_seq_lens = inputs
    train_log_probs = _policy_log_probs(config, train_log_probs, extra)
    packed = pack_sequences(train_log_probs, rollout_log_probs, loss_masks, total_lengths=total_lengths,
                            response_lengths=response_lengths, max_seq_lens=max_seq_lens, cp=cp, qkv_format=qkv_format,
                            train_name=_train_name(config))
    packed = _with_optional_inputs(packed, config, extra)
    check_pg_loss(pg_loss, packed.batch)
    batch = packed.batch
    return config, packed, config_text(config, qkv_format, batch.lags is not None, batch.mask_sizes is not None,
                                       rollouts.form(batch.rollouts))


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


# --------------------------------------------------------------------------- outputs
def weigh_loss(pg_loss: Tensor, weights: Tensor, keep: Tensor) -> Tensor:
    """pg_loss × weights where ``keep`` is nonzero, exactly 0 elsewhere (where, not a bare product: a NaN
    pg_loss on a rejected token must not survive as NaN·0), in pg_loss's dtype.

    The product is taken in float32 at least and then cast: a float16 loss of 0.1 times a weight of 1.6e5
    (beyond float16's range) is 1.6e4, which float16 holds. A product beyond the dtype's range saturates at
    its largest finite value (only float16 has a range a weight ≤ e^20 can leave)."""
    compute = torch.promote_types(pg_loss.dtype, torch.float32)
    weighted = pg_loss.to(compute) * weights.to(compute)
    if compute != pg_loss.dtype:
        largest = torch.finfo(pg_loss.dtype).max
        weighted = weighted.clamp(-largest, largest).to(pg_loss.dtype)
    return torch.where(keep.to(weighted.device) > 0, weighted, torch.zeros_like(weighted))


def _full_masks(packed: PackedInputs, result: correction.Correction, rejected: peers.Rejected | None = None) -> Tensor:
    """Flat full-length modified masks: the input mask values (dtype too) with rejected tokens set to 0, so a
    kept token keeps its value (0.5 stays 0.5). Metrics-only: the input values unchanged (a new tensor).
    Under CP, identical on every rank and equal to cp = 1: the sequence-level decisions (identical on every
    rank) times the token-level rejections of every rank (``rejected``, exchanged with the table), and the
    moving-out tokens of the sequences a directional gate fired on."""
    masks = packed.full_masks
    if result.weights is None:
        return masks
    keep = result.token_keep
    if packed.local_positions is not None:
        keep = result.seq_keep.to(keep.dtype).repeat_interleave(
            long_tensor(packed.response_lengths, masks.device), output_size=masks.numel())
        positions = None if rejected is None else rejected.positions
        if rejected is not None and rejected.gated_positions is not None and result.seq_gate is not None:
            fired = result.seq_gate.to(rejected.gated_sequences.device)[rejected.gated_sequences]
            positions = torch.cat([positions, rejected.gated_positions[fired]])
        if positions is not None and positions.numel():
            keep = keep.index_fill_(0, positions.to(masks.device), 0.0)
    return _zero_rejected(masks, keep)


def _zero_rejected(masks: Tensor, keep: Tensor) -> Tensor:
    """The mask values (and dtype) where ``keep`` is 1, 0 where it is 0 (a new tensor)."""
    return masks * keep.to(masks.dtype)


