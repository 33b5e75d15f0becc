"""The call with its context-parallel and data-parallel peers: agree, bound, exchange the per-sequence table,
finalize.

``miles_mis.plugin`` prepares a rank's tokens and hands them here; this module decides, from the config, which
groups a call talks to (the CP group always, the DP group only for the batch quantities a config takes over it:
``DpScopes``) and in which order, so that an error on any rank reaches every rank of both groups
(docs/reliability.md). The collectives themselves are in ``miles_mis.distributed``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import core, distributed, gate, rejections
from .config import MisConfig
from .inputs import PackedInputs, host_setting


@dataclass
class PreparedCall:
    """What a rank computes before talking to its peers."""

    config: MisConfig
    packed: PackedInputs
    terms: core.TokenTerms  # with an adaptive token-level bound: not yet bounded (the bound needs every rank)
    text: str
    batch_values: Tensor  # this rank's batch sums (and bound histogram), combined over CP in the agreement header
    rejected: Tensor | None  # [N] (or [2, N]) 0/1 tokens removed at token level (core.token_rejections), under CP
    # with a config that can (else None)
    num_rejected: int = 0



def agree_with_cp_peers(cp: distributed.Group, dp: distributed.Group, local: PreparedCall | None,
                         error: Exception | None) -> tuple[list | None, Tensor]:
    """The agreement headers of the CP group (None at CP size 1) and the batch values combined over it.

    A local ``error`` travels in this rank's header (or is raised here at CP size 1); whatever is raised here
    is first announced to the DP peers waiting in their first DP exchange."""
    text = "" if local is None else local.text
    headers = None
    try:
        if cp.size > 1:
            headers = distributed.agree(cp, "cp", error=error,
                                        batch_size=-1 if local is None else local.packed.batch.num_seqs,
                                        width=-1 if local is None else core.num_columns(
                                            local.config, local.packed.batch.lags is not None),
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
    return headers, batch_values


def correct_with_peers(local: PreparedCall, cp: distributed.Group, dp: distributed.Group, headers: list | None,
                        batch_values: Tensor) -> tuple[core.Correction, "Rejected | None"]:
    """Bound, per-sequence table (exchanged over CP), finalize with the DP reductions the config asks for.
    Returns the correction and the tokens any CP rank rejected (None at CP size 1)."""
    config, packed, text = local.config, local.packed, local.text
    scopes = dp_scopes(config)
    dp_sum = (lambda values: distributed.dp_sum(values, dp, text)) if dp.size > 1 else None  # noqa: E731
    exchanged: list[Rejected] = []  # the table exchange's second result: the tokens any CP rank rejected

    def seq_table(stats: Tensor) -> Tensor:
        stats, rejected = _exchange_seq_table(local, stats, cp, dp, headers, scopes)
        exchanged.append(rejected)
        return stats

    reductions = core.Reductions(
        seq_table=seq_table if cp.size > 1 else core.LOCAL.seq_table,
        token_histogram=dp_sum if scopes.token_bound else None,
        seq_histogram=dp_sum if scopes.seq_bound else None,
        normalizer=dp_sum if scopes.normalize else None,
        gate=((lambda parts: distributed.dp_reduce(parts, dp, text, gate.PART_REDUCE))
              if dp.size > 1 and scopes.gate else None))
    correction = core.correct(packed.batch, config, reductions, terms=local.terms, batch_values=batch_values)
    log_warning(correction, cp)
    return correction, exchanged[0] if exchanged else None


@dataclass(frozen=True)
class Rejected:
    """The tokens any CP rank rejected at token level, as positions in the full masks; with a directional sequence
    option also those its gate removes when it fires on their sequence (decided after the exchange)."""

    positions: Tensor  # [M] int64
    gated_positions: Tensor | None = None  # [G] int64, the moving-out tokens
    gated_sequences: Tensor | None = None  # [G] int64, their sequences


def _exchange_seq_table(local: PreparedCall, stats: Tensor, cp: distributed.Group, dp: distributed.Group,
                        headers: list, scopes: DpScopes) -> tuple[Tensor, Rejected]:
    """The per-sequence table combined over the CP group, and the tokens rejected on any CP rank (exchanged with
    the table, encoded as the headers' token counts make cheapest)."""
    packed = local.packed
    planes = 1 if local.rejected is None else local.rejected.dim()
    encoding = rejections.Encoding.choose([h.tokens for h in headers], [h.rejected for h in headers], planes)
    try:
        stats, gathered = distributed.exchange_seq_stats(
            stats, packed.length_table, cp,
            rejections.encode(local.rejected, encoding) if local.rejected is not None else None,
            names=packed.length_names)
    except Exception as failure:  # noqa: BLE001
        if dp.size > 1 and scopes.in_finalize:  # the DP peers wait in finalize's exchange: tell them
            distributed.agree(dp, "dp", error=failure, config_text=local.text)
        raise
    stats = core.combine_seq_stats(stats, local.config)
    rank, index, plane = rejections.decode(gathered, encoding)
    positions, sequences = rejections.positions(rank, index, packed.length_table, cp.size)
    if planes == 1:
        return stats, Rejected(positions)
    gated = plane == 1
    return stats, Rejected(positions[~gated], positions[gated], sequences[gated])


# --------------------------------------------------------------------------- data-parallel scopes
@dataclass(frozen=True)
class DpScopes:
    """Which batch quantities are taken over the data-parallel group (each is one DP exchange per call)."""

    normalize: bool  # tis_batch_normalize_scope: dp
    gate: bool  # rs_batch_gate_scope: dp
    token_bound: bool  # tis_auto_scope: dp at token level (exchanged before the per-sequence table)
    seq_bound: bool  # tis_auto_scope: dp at sequence level (exchanged in finalize)

    @property
    def in_finalize(self) -> bool:
        """Some DP exchange happens after the per-sequence table's CP exchange."""
        return self.normalize or self.gate or self.seq_bound


def dp_scopes(config: MisConfig) -> DpScopes:
    auto_dp = config.use_tis and config.adaptive_bound and config.tis_auto_scope == "dp"
    return DpScopes(config.use_tis and config.tis_batch_normalize and config.tis_batch_normalize_scope == "dp",
                     config.use_tis and bool(config.rs_batch_gate) and config.rs_batch_gate_scope == "dp",
                     auto_dp and config.tis_level == "token", auto_dp and config.tis_level != "token")


def dp_group(config: MisConfig, parallel_state: Any) -> distributed.Group:
    scopes = dp_scopes(config)
    if scopes.token_bound or scopes.in_finalize:
        return distributed.resolve_dp_group(parallel_state)
    return distributed.SINGLE


def dp_group_of_raw_args(args: Any, parallel_state: Any) -> distributed.Group:
    """The DP group a rank whose config failed to build would have used, read from the raw attributes: such
    a rank must still join its DP peers' exchange (normalisation, batch gate or adaptive bound, with its error)
    so that they do not wait."""
    raw = lambda name: host_setting(args, name)  # noqa: E731
    use_tis = raw("use_tis") is True
    wants = use_tis and ((raw("tis_batch_normalize_scope") == "dp" and raw("tis_batch_normalize") is True)
                         or (raw("rs_batch_gate_scope") == "dp" and bool(raw("rs_batch_gate")))
                         or (raw("tis_auto_scope") == "dp" and raw("tis_upper_bound") == "auto"))
    try:
        return distributed.resolve_dp_group(parallel_state) if wants else distributed.SINGLE
    except Exception:  # noqa: BLE001 (no group to join: the error is raised locally below)
        return distributed.SINGLE


def log_warning(correction: core.Correction, cp: distributed.Group = distributed.SINGLE) -> None:
    """A warning the core raised (the batch gate fired), once per CP group, through the ``miles_mis`` logger."""
    if correction.message and cp.rank == 0:
        logging.getLogger("miles_mis").warning(correction.message)
