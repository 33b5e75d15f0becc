"""The miles adapter: the entry points a miles host loads with ``--custom-tis-function-path``.

This is the only layer that sees argparse Namespaces and per-sequence lists; it validates them,
packs this rank's tokens into one ``PackedBatch``, runs the pure core, and exchanges the
per-sequence table over the context-parallel group (one collective, ``miles_mis.distributed``).
Hosts that already hold packed tokens (THD, padding removed) call ``compute_mis_weights_packed``,
which validates the flat tensors and ``cu_seqlens`` and builds the same ``PackedBatch`` without lists.
The host contract is in docs/contract.md; the CP layout in docs/cp.md.
"""

from __future__ import annotations

import array
import logging
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from . import core, distributed, gate, rejections
from .config import MisConfig
from .layout import QKV_FORMATS, zigzag_layout


class InputError(ValueError):
    """Invalid host input; ``sequence_index`` is the first bad sequence (-1 when not about one)."""

    def __init__(self, message: str, sequence_index: int = -1):
        super().__init__(message)
        self.sequence_index = sequence_index


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
    Metrics are 1-D tensors aligned with the local ``pg_loss``. Unknown kwargs are ignored. Any failure
    on any CP rank (bad config, bad inputs) raises on every rank of the group (docs/reliability.md).
    """
    cp = distributed.resolve_cp_group(parallel_state)  # without it there is nobody to agree with
    return _run(args, cp, parallel_state, pg_loss,
                (train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, max_seq_lens))


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
    return _run(args, distributed.SINGLE, kwargs.get("parallel_state"), pg_loss,
                (train_log_probs, rollout_log_probs, loss_masks, kwargs.get("total_lengths"),
                 kwargs.get("response_lengths"), None), qkv_format="thd")


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
    _refuse_dp_scopes(config, "compute_mis_weights")
    packed = pack_sequences(train_log_probs, rollout_log_probs, loss_masks)
    correction = _correct_whole_sequences(packed.batch, config)
    split = lambda flat: list(flat.split_with_sizes(packed.response_lengths))  # noqa: E731
    weights = None if correction.weights is None else split(correction.weights)
    return weights, split(_full_masks(packed, correction)), {k: split(v) for k, v in correction.metrics.items()}


def compute_mis_weights_packed(
    config: Any,
    *,
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """Packed API for hosts that already hold concatenated response tokens (Megatron THD, verl without padding).

    ``train_log_probs``, ``rollout_log_probs``, ``loss_mask``: flat [N] tensors, the B responses concatenated;
    ``cu_seqlens``: int64 [B+1] offsets (``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == N``):
    sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``. Whole sequences (context parallel size 1).
    Returns (weights [N], or None in metrics-only mode; the mask [N]: the input values and dtype with
    rejected tokens 0; metrics: name -> [N] float32), the same values as ``compute_mis_weights`` on the
    same sequences, concatenated. ``config`` may be a Namespace or a ``MisConfig``. Invalid inputs raise
    ``InputError`` (a ``ValueError``) naming what is wrong (docs/contract.md).
    """
    config = MisConfig.from_args(config)
    _refuse_dp_scopes(config, "compute_mis_weights_packed")
    batch = pack_flat(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    correction = _correct_whole_sequences(batch, config)
    if correction.weights is None:  # metrics-only: the input values unchanged, in a new tensor
        return None, batch.loss_mask.clone(), correction.metrics
    return correction.weights, _zero_rejected(batch.loss_mask, correction.token_keep), correction.metrics


def _refuse_dp_scopes(config: MisConfig, entry: str) -> None:
    """The single-process entry points have no data-parallel group: a dp scope would silently act per
    micro-batch, so it is an error naming the key."""
    scopes = _dp_scopes(config)
    keys = [key for key, used in (("tis_batch_normalize_scope", scopes.normalize),
                                  ("rs_batch_gate_scope", scopes.gate),
                                  ("tis_auto_scope", scopes.token_bound or scopes.seq_bound)) if used]
    if keys:
        raise ValueError(f"{', '.join(f'{key}: dp' for key in keys)} needs the data-parallel group, which {entry} "
                         "does not take (it runs on one process's micro-batch): use micro_batch, or "
                         "compute_mis_weights_with_cp with parallel_state")


def _correct_whole_sequences(batch: core.PackedBatch, config: MisConfig) -> core.Correction:
    """The core on whole sequences (context parallel size 1): the local table is the whole table."""
    terms = core.token_terms(batch, config)
    batch_values = core.local_batch_values(batch, terms, config)
    terms, bound = core.bound_token_terms(terms, batch_values, config)
    correction = core.finalize(batch, terms, core.local_seq_stats(batch, terms, config), config,
                               batch_values=batch_values, bound=bound)
    _log(correction)
    return correction


# --------------------------------------------------------------------------- the call
@dataclass(frozen=True)
class _DpScopes:
    """Which batch quantities are taken over the data-parallel group (each is one DP exchange per call)."""

    normalize: bool  # tis_batch_normalize_scope: dp
    gate: bool  # rs_batch_gate_scope: dp
    token_bound: bool  # tis_auto_scope: dp at token level (exchanged before the per-sequence table)
    seq_bound: bool  # tis_auto_scope: dp at sequence level (exchanged in finalize)

    @property
    def in_finalize(self) -> bool:
        """Some DP exchange happens after the per-sequence table's CP exchange."""
        return self.normalize or self.gate or self.seq_bound


def _dp_scopes(config: MisConfig) -> _DpScopes:
    auto_dp = config.use_tis and config.adaptive_bound and config.tis_auto_scope == "dp"
    return _DpScopes(config.use_tis and config.tis_batch_normalize and config.tis_batch_normalize_scope == "dp",
                     config.use_tis and bool(config.rs_batch_gate) and config.rs_batch_gate_scope == "dp",
                     auto_dp and config.tis_level == "token", auto_dp and config.tis_level != "token")


def _dp_group(config: MisConfig, parallel_state: Any) -> distributed.Group:
    scopes = _dp_scopes(config)
    if scopes.token_bound or scopes.in_finalize:
        return distributed.resolve_dp_group(parallel_state)
    return distributed.SINGLE


def _log(correction: core.Correction, cp: distributed.Group = distributed.SINGLE) -> None:
    """A warning the core raised (the batch gate fired), once per CP group, through the ``miles_mis`` logger."""
    if correction.message and cp.rank == 0:
        logging.getLogger("miles_mis").warning(correction.message)


def _dp_group_of_raw_args(args: Any, parallel_state: Any) -> distributed.Group:
    """The DP group a rank whose config failed to build would have used, read from the raw attributes: such
    a rank must still join its DP peers' exchange (normalisation, batch gate or adaptive bound, with its error)
    so that they do not wait."""
    use_tis = _raw(args, "use_tis") is True
    wants = use_tis and ((_raw(args, "tis_batch_normalize_scope") == "dp" and _raw(args, "tis_batch_normalize") is True)
                         or (_raw(args, "rs_batch_gate_scope") == "dp" and bool(_raw(args, "rs_batch_gate")))
                         or (_raw(args, "tis_auto_scope") == "dp" and _raw(args, "tis_upper_bound") == "auto"))
    try:
        return distributed.resolve_dp_group(parallel_state) if wants else distributed.SINGLE
    except Exception:  # noqa: BLE001 (no group to join: the error is raised locally below)
        return distributed.SINGLE


def config_text(config: MisConfig, qkv_format: str) -> str:
    """The effective settings of a call as "key=value" lines: compared across ranks (fingerprint) and shown
    key by key when they differ."""
    values = dict(config.to_dict(), qkv_format=qkv_format)
    return "\n".join(f"{key}={values[key]!r}" for key in sorted(values))


def _raw(args: Any, name: str) -> Any:
    """A host setting as given: an attribute of a Namespace, or a key of a mapping used as the config."""
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def _qkv_format(args: Any) -> str:
    value = _raw(args, "qkv_format") or "thd"
    if value not in QKV_FORMATS:
        raise ValueError(f"qkv_format={value!r} is invalid: allowed values are {', '.join(QKV_FORMATS)}")
    return value


@dataclass
class _Local:
    """What a rank computes before talking to its peers."""

    config: MisConfig
    packed: PackedInputs
    terms: core.TokenTerms  # with an adaptive token-level bound: not yet bounded (the bound needs every rank)
    text: str
    batch_values: Tensor  # this rank's batch sums (and bound histogram), combined over CP in the agreement header
    rejected: Tensor | None  # [N] 0/1 tokens removed at token level, under CP with a config that can (else None)
    num_rejected: int = 0


def _prepare(args: Any, cp: distributed.Group, pg_loss: Tensor, inputs: tuple, qkv_format: str | None) -> _Local:
    config = MisConfig.from_args(args)
    qkv_format = qkv_format or _qkv_format(args)
    train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, max_seq_lens = inputs
    packed = pack_sequences(train_log_probs, rollout_log_probs, loss_masks, total_lengths=total_lengths,
                            response_lengths=response_lengths, max_seq_lens=max_seq_lens, cp=cp, qkv_format=qkv_format)
    num_tokens = packed.batch.train_log_probs.numel()
    problem = _tensor_problem(pg_loss, packed.batch.train_log_probs.device, "loss")
    if problem is None and pg_loss.numel() != num_tokens:
        problem = (f"has shape {tuple(pg_loss.shape)} but the {packed.batch.num_seqs} sequences hold {num_tokens} "
                   f"local tokens: expected shape ({num_tokens},)")
    if problem is not None:
        problem = problem.replace("sequence 0 is on", "the log-probs are on")
        raise InputError(f"pg_loss {problem}")
    terms = core.token_terms(packed.batch, config)
    rejected = core.token_rejections(terms) if cp.size > 1 and core.rejects_tokens(config) else None
    return _Local(config, packed, terms, config_text(config, qkv_format),
                  core.local_batch_values(packed.batch, terms, config), rejected,
                  0 if rejected is None else int(rejected.sum()))


def _run(args: Any, cp: distributed.Group, parallel_state: Any, pg_loss: Tensor, inputs: tuple,
         qkv_format: str | None = None):
    """Prepare locally, agree with the CP peers, [pick the adaptive bound], exchange the per-sequence table,
    finalize.

    Any exception before the agreement is carried into its header instead of being raised alone, so every CP
    rank raises together; the DP peers are told in the first DP exchange they wait in (docs/reliability.md).
    """
    local = error = None
    dp = distributed.SINGLE
    try:
        local = _prepare(args, cp, pg_loss, inputs, qkv_format)
        dp = _dp_group(local.config, parallel_state)
    except Exception as failure:  # noqa: BLE001 (re-raised below, after the peers have been told)
        error = failure
        if local is None:
            dp = _dp_group_of_raw_args(args, parallel_state)
    text = "" if local is None else local.text
    try:
        if cp.size > 1:
            headers = distributed.agree(cp, "cp", error=error,
                                        batch_size=-1 if local is None else local.packed.batch.num_seqs,
                                        width=-1 if local is None else core.num_columns(local.config),
                                        tokens=-1 if local is None else local.packed.batch.seq_index.numel(),
                                        rejected=0 if local is None else local.num_rejected,
                                        config_text=text,
                                        payload=() if local is None else local.batch_values.tolist())
            size = local.batch_values.numel()
            batch_values = core.combine_batch_values(
                torch.tensor([h.payload[:size] for h in headers], dtype=torch.float64))
        elif error is not None:
            raise error
        else:
            batch_values = local.batch_values
    except Exception as failure:  # noqa: BLE001
        if dp.size > 1:  # tell the data-parallel peers waiting in their first DP exchange, then raise
            distributed.agree(dp, "dp", error=failure, config_text=text)
        raise

    config, packed = local.config, local.packed
    scopes = _dp_scopes(config)
    dp_sum = (lambda values: distributed.dp_sum(values, dp, text)) if dp.size > 1 else None  # noqa: E731
    terms, bound = core.bound_token_terms(local.terms, batch_values.to(local.terms.token_ratio.device), config,
                                          reduce_histogram=dp_sum if scopes.token_bound else None)
    stats = core.local_seq_stats(packed.batch, terms, config)
    rejected_positions = None
    if cp.size > 1:
        encoding = rejections.Encoding.choose([h.tokens for h in headers], [h.rejected for h in headers])
        try:
            stats, gathered = distributed.exchange_seq_stats(
                stats, packed.length_table, cp,
                rejections.encode(local.rejected, encoding) if local.rejected is not None else None)
        except Exception as failure:  # noqa: BLE001
            if dp.size > 1 and scopes.in_finalize:  # the DP peers wait in finalize's exchange: tell them
                distributed.agree(dp, "dp", error=failure, config_text=text)
            raise
        stats = core.combine_seq_stats(stats, config)
        rejected_positions = rejections.positions(*rejections.decode(gathered, encoding), packed.length_table,
                                                  cp.size)
    reduce_gate = ((lambda parts: distributed.dp_reduce(parts, dp, text, gate.PART_REDUCE))
                   if dp.size > 1 and scopes.gate else None)
    correction = core.finalize(packed.batch, terms, stats, config,
                               reduce_normalizer=dp_sum if scopes.normalize else None,
                               batch_values=batch_values.to(stats.device), reduce_gate=reduce_gate, bound=bound,
                               reduce_histogram=dp_sum if scopes.seq_bound else None)
    _log(correction, cp)
    if correction.weights is not None:
        pg_loss = weigh_loss(pg_loss, correction.weights, correction.token_keep)
    masks = list(_full_masks(packed, correction, rejected_positions).split_with_sizes(packed.response_lengths))
    return pg_loss, masks, correction.metrics


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


@dataclass(frozen=True)
class PackedInputs:
    batch: core.PackedBatch  # this rank's tokens
    full_masks: Tensor  # [Σ response_lengths] the input masks concatenated (input dtype)
    response_lengths: list[int]
    local_positions: Tensor | None  # indices of the local tokens in full_masks; None = all, in order (cp 1)
    length_table: Tensor | None  # [B, 3] response, total, span lengths, exchanged to check CP agreement


def _full_masks(packed: PackedInputs, correction: core.Correction, rejected_positions: Tensor | None = None) -> Tensor:
    """Flat full-length modified masks: the input mask values (dtype too) with rejected tokens set to 0, so a
    kept token keeps its value (0.5 stays 0.5). Metrics-only: the input values unchanged (a new tensor).
    Under CP, identical on every rank and equal to cp = 1: the sequence-level decisions (identical on every
    rank) times the token-level rejections of every rank (``rejected_positions``, exchanged with the table)."""
    masks = packed.full_masks
    if correction.weights is None:
        return masks
    keep = correction.token_keep
    if packed.local_positions is not None:
        keep = correction.seq_keep.to(keep.dtype).repeat_interleave(
            _long_tensor(packed.response_lengths, masks.device), output_size=masks.numel())
        if rejected_positions is not None and rejected_positions.numel():
            keep = keep.index_fill_(0, rejected_positions.to(masks.device), 0.0)
    return _zero_rejected(masks, keep)


def _zero_rejected(masks: Tensor, keep: Tensor) -> Tensor:
    """The mask values (and dtype) where ``keep`` is 1, 0 where it is 0 (a new tensor)."""
    return masks * keep.to(masks.dtype)


# --------------------------------------------------------------------------- validation and packing
def pack_sequences(train_log_probs, rollout_log_probs, loss_masks, *, total_lengths=None, response_lengths=None,
                   max_seq_lens=None, cp: distributed.Group = distributed.SINGLE,
                   qkv_format: str = "thd") -> PackedInputs:
    """Validate the host's per-sequence lists and concatenate this rank's tokens.

    At CP size 1 the log-probs are whole responses; at CP size C > 1 they are this rank's zigzag
    shards, whose lengths must match the layout computed from total/response lengths.
    """
    if rollout_log_probs is None:
        raise InputError("rollout_log_probs is None: the host must return rollout log-probs from the engine "
                         "(miles: the rollout must keep per-token log-probs) to measure or correct the mismatch")
    if train_log_probs is None:
        raise InputError("train_log_probs is None: the host must pass the trainer's recomputed log-probs")
    for name, values in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                         ("loss_masks", loss_masks)):
        if not isinstance(values, (list, tuple)):
            raise InputError(f"{name} is a {type(values).__name__}: expected a list of B 1-D tensors, one per sequence")
    counts = {"train_log_probs": len(train_log_probs), "rollout_log_probs": len(rollout_log_probs),
              "loss_masks": len(loss_masks)}
    for name, values in (("response_lengths", response_lengths), ("total_lengths", total_lengths),
                         ("max_seq_lens", max_seq_lens)):
        if values is not None:
            counts[name] = len(values)
    if len(set(counts.values())) > 1:
        raise InputError("inputs disagree on the number of sequences: "
                         + ", ".join(f"{name} has {n}" for name, n in counts.items()))
    if cp.size > 1 and (total_lengths is None or response_lengths is None):
        raise InputError("total_lengths and response_lengths are required with context parallel size > 1")

    # Cheap whole-list checks first (numel, not .shape, which is slow on views; 1-D is checked on the
    # concatenated result); the sequences are walked only to name the first bad one.
    lists = (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
             ("loss_masks", loss_masks))
    try:  # map over the unbound method: ~25% faster than a comprehension at B in the thousands
        local_lengths = list(map(Tensor.numel, train_log_probs))
        full_lengths = list(map(Tensor.numel, loss_masks))
    except (AttributeError, TypeError):  # not a tensor: name the first one
        _raise_first_bad(lists)
    response_lengths = _int_list("response_lengths", response_lengths)
    total_lengths = _int_list("total_lengths", total_lengths)
    if response_lengths is not None and response_lengths != full_lengths:
        i = next(i for i, (r, n) in enumerate(zip(response_lengths, full_lengths)) if r != n)
        raise InputError(f"sequence {i}: response_lengths[{i}]={response_lengths[i]} but loss_masks[{i}] has "
                         f"{full_lengths[i]} elements (loss masks are full response length)", i)
    if (total_lengths is not None and response_lengths is not None
            and any(map(operator.le, total_lengths, response_lengths))):  # the fast test; then the exact one
        short = [i for i, (t, r) in enumerate(zip(total_lengths, response_lengths)) if t <= r and r]
        if short:
            i = short[0]
            raise InputError(f"sequence {i}: total_lengths[{i}]={total_lengths[i]} must exceed "
                             f"response_lengths[{i}]={response_lengths[i]} (the prompt has at least 1 token)", i)

    layout = positions = length_table = None
    if cp.size > 1:
        spans = None
        if qkv_format == "bshd":
            if max_seq_lens is None:
                raise InputError("max_seq_lens is required when qkv_format is 'bshd'")
            spans = torch.tensor(_int_list("max_seq_lens", max_seq_lens), dtype=torch.long)
            too_long = (spans < torch.tensor(total_lengths)).nonzero()
            if too_long.numel():
                i = int(too_long[0])
                raise InputError(f"sequence {i}: max_seq_lens[{i}]={int(max_seq_lens[i])} is smaller than "
                                 f"total_lengths[{i}]={int(total_lengths[i])}", i)
        totals = torch.tensor(total_lengths, dtype=torch.long)
        responses = torch.tensor(full_lengths, dtype=torch.long)
        layout = zigzag_layout(totals, responses, cp.rank, cp.size, qkv_format, spans)
        expected = layout.local_lengths.tolist()
        if local_lengths != expected:
            i = next(i for i, (n, e) in enumerate(zip(local_lengths, expected)) if n != e)
            raise InputError(f"sequence {i}: train_log_probs has {local_lengths[i]} tokens on cp rank {cp.rank} of "
                             f"{cp.size}, but the zigzag layout ({qkv_format}, total_length={int(totals[i])}, "
                             f"response_length={full_lengths[i]}) gives this rank {expected[i]}", i)
        length_table = torch.stack([responses, totals, totals if spans is None else spans], 1).double()
    elif local_lengths != full_lengths:
        i = next(i for i, (n, e) in enumerate(zip(local_lengths, full_lengths)) if n != e)
        _raise_shape_error(i, train_log_probs, rollout_log_probs, loss_masks)

    flat = None
    try:
        if local_lengths == list(map(Tensor.numel, rollout_log_probs)):
            flat = [torch.cat(list(seq)).detach() if len(seq) else torch.zeros(0) for _, seq in lists]
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # mixed dims/devices, odd tensors
        flat = None
    if flat is None or not all(_plain_1d(f) for f in flat):
        _raise_first_bad(lists)
        bad = next((i for i, (a, b) in enumerate(zip(train_log_probs, rollout_log_probs)) if a.shape != b.shape),
                   None)
        if bad is None:
            raise InputError("the per-sequence tensors could not be joined (" + ", ".join(
                f"{name}: {f.dtype} {f.layout} on {f.device}" for (name, _), f in zip(lists, flat or ())) + ")")
        _raise_shape_error(bad, train_log_probs, rollout_log_probs, loss_masks)
    for _, seq in lists[:2]:  # torch.cat promotes an integer sequence among floats: test each dtype
        if not all(dtype.is_floating_point for dtype in set(map(_DTYPE, seq))):
            _raise_first_bad(lists)
    train, rollout, full_masks = flat
    device = train.device
    full_masks = full_masks.to(device)
    if (full_masks.is_floating_point() and bool(_may_hold_nonfinite(full_masks))
            and not bool(torch.isfinite(full_masks).all())):
        i = next(i for i, m in enumerate(loss_masks) if not bool(torch.isfinite(m).all()))
        raise InputError(f"sequence {i}: loss_masks[{i}] holds a non-finite value: masks are finite weights "
                         "(nonzero = trained token)", i)
    if layout is None:
        local_mask = full_masks
    else:
        response_offsets = torch.cumsum(torch.tensor([0] + full_lengths[:-1], dtype=torch.long), 0)
        positions = layout.positions(response_offsets).to(device)
        local_mask = full_masks.index_select(0, positions)
    seq_lengths = _long_tensor(local_lengths, device)
    response_positions = None
    if positions is not None:  # each local token's position in its response: its index minus its response's start
        local_seq = torch.repeat_interleave(seq_lengths, output_size=positions.numel())  # sequence of each token
        response_positions = positions - response_offsets.to(device).index_select(0, local_seq)
    batch = core.PackedBatch.from_flat(train, rollout.to(device), local_mask, seq_lengths,
                                       positions=response_positions)
    return PackedInputs(batch, full_masks, full_lengths, positions, length_table)


def pack_flat(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens) -> core.PackedBatch:
    """Validate the packed path's flat [N] tensors and [B+1] offsets; the ``PackedBatch`` they describe.

    A fixed number of tensor operations whatever B (no loop over sequences); the values of ``cu_seqlens``
    and the finiteness of the mask are checked together, with one device-to-host read. Only a failing
    check does more work, to name the first bad sequence or token.
    """
    if rollout_log_probs is None:
        raise InputError("rollout_log_probs is None: the host must return rollout log-probs from the engine "
                         "(miles: the rollout must keep per-token log-probs) to measure or correct the mismatch")
    if train_log_probs is None:
        raise InputError("train_log_probs is None: the host must pass the trainer's recomputed log-probs")
    flat = (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
            ("loss_mask", loss_mask), ("cu_seqlens", cu_seqlens))
    device = train_log_probs.device if isinstance(train_log_probs, Tensor) and not train_log_probs.is_meta else None
    for name, value in flat:
        if isinstance(value, (list, tuple)):
            raise InputError(f"{name} is a {type(value).__name__}: the packed entry point takes one flat tensor "
                             "(per-sequence lists: compute_mis_weights)")
        if name == "cu_seqlens" and isinstance(value, Tensor) and value.dtype != torch.int64:
            raise InputError(f"cu_seqlens has dtype {value.dtype}: expected torch.int64 offsets (cu_seqlens.long())")
        shape = ("a 1-D [B+1] tensor of offsets" if name == "cu_seqlens"
                 else "a flat 1-D [N] tensor (the B responses concatenated)")
        kind = {"loss_mask": "masks", "cu_seqlens": "offsets"}.get(name, "log-probs")
        problem = _tensor_problem(value, device, kind, device_of="train_log_probs",
                                  one_device="all inputs on one device", shape=shape)
        if problem:
            raise InputError(f"{name} {problem}")
    num_tokens = train_log_probs.numel()
    if rollout_log_probs.numel() != num_tokens or loss_mask.numel() != num_tokens:
        raise InputError(f"train_log_probs has {num_tokens} tokens, rollout_log_probs has "
                         f"{rollout_log_probs.numel()}, loss_mask has {loss_mask.numel()}: the flat tensors "
                         "must have equal lengths")
    if cu_seqlens.numel() == 0:
        raise InputError("cu_seqlens is empty: expected B+1 offsets, [0] for no sequence")

    seq_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    suspect = cu_seqlens[0].ne(0).logical_or_(cu_seqlens[-1].ne(num_tokens)).logical_or_((seq_lengths < 0).any())
    if loss_mask.is_floating_point():
        suspect = suspect | _may_hold_nonfinite(loss_mask)
    if bool(suspect):  # the one read of a value; the exact checks below run only when something is off
        _check_packed_exactly(cu_seqlens, seq_lengths, loss_mask, num_tokens)
    return core.PackedBatch.from_flat(train_log_probs.detach(), rollout_log_probs.detach(), loss_mask.detach(),
                                      seq_lengths)


def _may_hold_nonfinite(mask: Tensor) -> Tensor:
    """0-d bool: True if a value of a floating-point mask may be NaN/±inf (the sum is; an overflowing sum of
    finite values also is, so True must be confirmed by ``torch.isfinite``). A sum reads the mask once and
    writes nothing: 10-20x cheaper than ``torch.isfinite(mask).all()`` on CPU."""
    return ~torch.isfinite(mask.sum(dtype=torch.float64 if mask.dtype == torch.float64 else torch.float32))


def _check_packed_exactly(cu_seqlens: Tensor, seq_lengths: Tensor, loss_mask: Tensor, num_tokens: int) -> None:
    """Name the first failing check of ``pack_flat`` (called only when the cheap combined check is suspect)."""
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0:
        raise InputError(f"cu_seqlens[0]={first}: the offsets start at 0")
    decreasing = (seq_lengths < 0).nonzero()
    if decreasing.numel():
        i = int(decreasing[0])
        raise InputError(f"sequence {i}: cu_seqlens decreases from cu_seqlens[{i}]={int(cu_seqlens[i])} to "
                         f"cu_seqlens[{i + 1}]={int(cu_seqlens[i + 1])}: the offsets must be non-decreasing", i)
    if last != num_tokens:
        raise InputError(f"cu_seqlens[-1]={last} but the flat tensors hold {num_tokens} tokens: the last offset "
                         "is the number of tokens N")
    nonfinite = (~torch.isfinite(loss_mask)).nonzero()
    if nonfinite.numel():
        token = int(nonfinite[0])
        i = int(torch.searchsorted(cu_seqlens, nonfinite[0], right=True)) - 1
        raise InputError(f"sequence {i}: loss_mask[{token}]={loss_mask[token].item()} is not finite: masks are "
                         "finite weights (nonzero = trained token)", i)
    # else: finite mask values whose sum overflowed (|values| near the float32 limit): nothing is wrong


def _long_tensor(values: list[int], device) -> Tensor:
    """An int64 tensor of Python ints, through an array buffer: 3-4x faster than torch.tensor(list) at B in
    the thousands (it reads each element as a Python object)."""
    if not values:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)


def _int_list(name: str, values) -> list[int] | None:
    """Host lengths as a list of Python ints (they may arrive as a list, a tuple or an integer tensor)."""
    if values is None:
        return None
    if isinstance(values, Tensor):
        if values.is_floating_point() or values.is_complex() or values.ndim != 1:
            raise InputError(f"{name} is a {values.dtype} tensor of shape {tuple(values.shape)}: expected B integers")
        return values.tolist()
    values = list(values)
    if set(map(type, values)) <= {int}:
        return values
    for i, v in enumerate(values):  # the slow path names the first bad entry
        is_integer = isinstance(v, numbers.Integral) or (isinstance(v, Tensor) and v.numel() == 1
                                                         and not v.is_floating_point())
        if isinstance(v, bool) or not is_integer:
            raise InputError(f"sequence {i}: {name}[{i}]={v!r} is not an integer", i)
    return [int(v) for v in values]


def _plain_1d(tensor: Tensor) -> bool:
    return (not tensor.is_nested and tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_meta and tensor.ndim == 1
            and not tensor.is_complex())


_DTYPE = operator.attrgetter("dtype")
_REAL = {"log-probs": "log-probs are real", "masks": "masks are real", "loss": "the loss is real",
         "offsets": "offsets are integers"}


def _tensor_problem(value: Any, device: Any, kind: str, device_of: str = "sequence 0",
                    one_device: str = "every sequence on one device", shape: str = "a 1-D tensor") -> str | None:
    """What is wrong with one per-sequence entry (or one flat tensor of the packed path, or pg_loss), or None.
    ``kind``: "log-probs", "masks", "loss" or "offsets" (what the messages call it)."""
    if not isinstance(value, Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.is_nested:
        return "is a nested tensor: plain 1-D tensors only"
    if value.layout != torch.strided:
        return f"is a {str(value.layout).replace('torch.', '')} tensor: dense tensors only"
    if value.is_quantized:
        return f"is a quantized tensor ({value.dtype}): dense float tensors only"
    if value.is_meta:
        return "is on the meta device (it has no values)"
    if device is not None and value.device != device:
        return f"is on {value.device} but {device_of} is on {device}: {one_device}"
    if value.is_complex():
        return f"has dtype {value.dtype}: {_REAL[kind]}"
    if kind == "log-probs" and not value.is_floating_point():
        return f"has dtype {value.dtype}: log-probs are floating point (a {value.dtype} tensor is not a log-prob)"
    if kind == "loss" and not value.is_floating_point():
        return f"has dtype {value.dtype}: the loss is floating point (the weights would be cast to it)"
    if value.ndim != 1:
        return f"has shape {tuple(value.shape)}: expected {shape}"
    return None


def _raise_first_bad(lists) -> None:
    """Raise an InputError naming the first sequence whose entry is not a plain 1-D tensor (no-op if none)."""
    first_device = {}
    for name, seq in lists:
        head = seq[0] if len(seq) else None
        first_device[name] = head.device if isinstance(head, Tensor) and not head.is_meta else None
    for i in range(max(len(seq) for _, seq in lists)):
        for name, seq in lists:
            problem = _tensor_problem(seq[i], first_device[name], "masks" if name == "loss_masks" else "log-probs")
            if problem:
                raise InputError(f"sequence {i}: {name}[{i}] {problem}", i)


def _raise_shape_error(i: int, train_log_probs, rollout_log_probs, loss_masks) -> None:
    _raise_first_bad((("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                      ("loss_masks", loss_masks)))
    shapes = [tuple(seq[i].shape) for seq in (train_log_probs, rollout_log_probs, loss_masks)]
    raise InputError(f"sequence {i}: train_log_probs has shape {shapes[0]}, rollout_log_probs has shape "
                     f"{shapes[1]}, loss_masks has shape {shapes[2]}; the log-probs must be 1-D of equal length, "
                     "and at context parallel size 1 as long as the mask", i)
