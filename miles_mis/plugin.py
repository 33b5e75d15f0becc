"""The entry points a host loads: ``--custom-tis-function-path miles_mis.compute_mis_weights_with_cp`` (miles, slime),
``compute_mis_weights_fsdp``, the per-sequence ``compute_mis_weights`` and the packed ``compute_mis_weights_packed``.

Each entry point has ``miles_mis.inputs.host_call`` read what the host passed (the config, the lists or flat tensors,
the optional inputs, from the hook or from a host adapter) into one ``HostCall``, runs the core's pipeline
(``correction.correct``) on it, under context parallelism with its CP and DP peers (``miles_mis.parallel.peers``; the
collectives are in ``miles_mis.parallel.distributed``), and shapes the result as the host expects: the weighted
loss, the full-length masks, the metrics. The host contract is in docs/contract.md; the CP layout in docs/cp.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import Tensor

from . import correction
from .parallel import distributed, peers
from .inputs import host_call
from .inputs.host_call import HostCall, LogProbLists
from .inputs.packing import InputError, PackedInputs, long_tensor

# the entry points, and the contract's error type (docs/contract.md)
__all__ = ["InputError", "compute_mis_weights", "compute_mis_weights_fsdp", "compute_mis_weights_packed",
           "compute_mis_weights_with_cp"]


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
    them (``rollout_sampling_mask_offsets``, ``rollout_top_p_token_offsets`` or ``sampling_mask_sizes``, per
    sequence over the whole response; miles_mis.inputs.sampling_mask). Other unknown kwargs are ignored. Any
    failure on any CP rank (bad config, bad inputs) raises on every rank of the group (docs/reliability.md).
    """
    cp = distributed.resolve_cp_group(parallel_state)  # without it there is nobody to agree with
    lists = LogProbLists(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, max_seq_lens)
    return _run(args, cp, parallel_state, pg_loss, lists, kwargs)


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
    lists = LogProbLists(train_log_probs, rollout_log_probs, loss_masks, kwargs.get("total_lengths"),
                         kwargs.get("response_lengths"))
    return _run(args, distributed.SINGLE, kwargs.get("parallel_state"), pg_loss, lists, kwargs, qkv_format="thd")


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
    call = host_call.read_lists(args, LogProbLists(train_log_probs, rollout_log_probs, loss_masks), kwargs,
                                qkv_format="thd", single_process_entry="compute_mis_weights")
    result = _correct_whole_sequences(call)
    split = lambda flat: list(flat.split_with_sizes(call.inputs.response_lengths))  # noqa: E731
    weights = None if result.weights is None else split(result.weights)
    return weights, split(_full_masks(call.inputs, result)), {k: split(v) for k, v in result.metrics.items()}


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
    call = host_call.read_flat(config, train_log_probs, rollout_log_probs, loss_mask, cu_seqlens,
                               dict(kwargs, current_log_probs=current_log_probs, version_lags=version_lags))
    result = _correct_whole_sequences(call)
    loss_mask = call.batch.loss_mask
    if result.weights is None:  # metrics-only: the input values unchanged, in a new tensor
        return None, loss_mask.clone(), result.metrics
    return result.weights, _zero_rejected(loss_mask, result.token_keep), result.metrics


# --------------------------------------------------------------------------- whole sequences, one process
def _correct_whole_sequences(call: HostCall) -> correction.Correction:
    """The core on whole sequences (context parallel size 1): the local table is the whole table."""
    result = correction.correct(call.batch, call.config)
    peers.log_warning(result)
    return with_policy_metric(result, call)


# --------------------------------------------------------------------------- the call with CP and DP peers
def _run(args: Any, cp: distributed.Group, parallel_state: Any, pg_loss: Tensor, lists: LogProbLists,
         kwargs: dict, qkv_format: str | None = None):
    """Read the call locally, then the correction with the CP and DP peers (``peers.PeerReductions``).

    Any exception before the agreement is carried into its header instead of being raised alone, so every CP
    rank raises together; the DP peers are told in the first DP exchange they wait in (docs/reliability.md).
    """
    call, settings = None, ""
    try:
        call = host_call.read_lists(args, lists, kwargs, cp=cp, qkv_format=qkv_format, pg_loss=pg_loss)
        settings = call.settings()
        dp = peers.dp_group(call.config, parallel_state)
    except Exception as failure:  # noqa: BLE001 (raised on every peer by fail)
        # a rank without its config joins the DP group its raw settings name (its DP peers wait for it there)
        dp = distributed.SINGLE if call is not None else peers.dp_group_of_raw_args(args, parallel_state)
        peers.PeerReductions(cp, dp, None if call is None else call.config, None, settings).fail(failure)
        raise
    packed = call.inputs
    result = correction.correct(packed.batch, call.config, peers.PeerReductions(cp, dp, call.config, packed, settings))
    peers.log_warning(result, cp)
    result = with_policy_metric(result, call)
    if result.weights is not None:
        pg_loss = weigh_loss(pg_loss, result.weights, result.token_keep)
    masks = list(_full_masks(packed, result, result.exchanged).split_with_sizes(packed.response_lengths))
    return pg_loss, masks, result.metrics


def with_policy_metric(result: correction.Correction, call: HostCall) -> correction.Correction:
    """``result`` with ``mis_numerator_is_current_policy`` (1 on every token) when the ratio's numerator is π_θ,
    not π_old: the skip-forward mode or ``tis_policy: current``. Then the measured mismatch is π_θ against
    π_rollout, staleness and (after the first minibatch) the update included
    (docs/hosts.md#skip-the-old-policy-forward)."""
    if not call.numerator_is_current:
        return result
    ones = torch.ones((), dtype=torch.float32, device=result.token_keep.device).expand(call.batch.seq_index.numel())
    metrics = dict(sorted({**result.metrics, "mis_numerator_is_current_policy": ones}.items()))
    return dataclasses.replace(result, metrics=metrics)


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


