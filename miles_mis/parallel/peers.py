"""The call with its context-parallel and data-parallel peers: agree, bound, exchange the per-sequence table,
finalize.

``miles_mis.plugin`` prepares a rank's tokens and hands them here; this module decides, from the config, which
groups a call talks to (the CP group always, the DP group only for the batch quantities a config takes over it:
``DpScopes``) and in which order, so that an error on any rank reaches every rank of both groups
(docs/reliability.md). The collectives themselves are in ``miles_mis.parallel.distributed``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import correction
from . import distributed, rejection_wire
from ..correction import gate
from ..config import MisConfig, host_setting


class PeerReductions:
    """``correction.Reductions`` over this rank's CP group and, for the batch quantities the config takes over it
    (``DpScopes``), its DP group. ``packed``/``config``/``text`` are None on a rank that failed before it had them
    (it only takes part in ``fail``). ``packed``: the call's ``inputs.PackedInputs``."""

    def __init__(self, cp: distributed.Group, dp: distributed.Group, config: MisConfig | None,
                 packed: Any, text: str):
        self.cp, self.dp, self.config, self.packed, self.text = cp, dp, config, packed, text
        self.scopes = dp_scopes(config) if config is not None else DpScopes(False, False, False, False)
        self.exchanges_token_rejections = cp.size > 1

    # --------------------------------------------------------------- the agreement (the first exchange)
    def fail(self, error: BaseException) -> None:
        """This rank failed before the agreement: the CP peers learn it in the agreement, the DP peers in the first
        DP exchange they wait in; then raise (every rank raises together)."""
        self._agree(error, payload=(), num_rejected=0)
        raise error

    def batch_values(self, values: Tensor, rejected: Tensor | None,
                     schema: correction.TableSchema) -> tuple[Tensor, list | None]:
        """The batch-sum vector combined over the CP group, which travels in the agreement header with ``schema``'s
        fingerprint (the headers are the agreement)."""
        if self.cp.size == 1:
            return values, None
        headers = self._agree(None, payload=values.tolist(),
                              num_rejected=0 if rejected is None else int(rejected.sum()), schema=schema)
        return correction.combine_batch_values(
            torch.tensor([h.payload[:values.numel()] for h in headers], dtype=torch.float64)), headers

    def _agree(self, error: BaseException | None, payload, num_rejected: int,
               schema: correction.TableSchema | None = None) -> list | None:
        """The CP agreement (or, at CP size 1, ``error`` raised); whatever is raised here is first announced to the
        DP peers waiting in their first DP exchange."""
        packed = self.packed
        try:
            if self.cp.size > 1:
                batch = None if packed is None else packed.batch
                return distributed.agree(
                    self.cp, "cp", error=error, batch_size=-1 if batch is None else batch.num_seqs,
                    table_schema=-1 if schema is None else schema.fingerprint,
                    tokens=-1 if batch is None else batch.seq_index.numel(), rejected=num_rejected,
                    config_text=self.text, payload=payload)
            if error is not None:
                raise error
            return None
        except Exception as failure:  # noqa: BLE001
            if self.dp.size > 1:  # tell the data-parallel peers waiting in their first DP exchange, then raise
                distributed.agree(self.dp, "dp", error=failure, config_text=self.text)
            raise

    # --------------------------------------------------------------- the per-sequence table
    def seq_table(self, table: Tensor, schema: correction.TableSchema, rejected: Tensor | None,
                  headers: list | None) -> tuple[Tensor, "Rejected | None"]:
        """The per-sequence table combined over the CP group, and the tokens rejected on any CP rank (exchanged with
        the table, encoded as the headers' token counts make cheapest)."""
        if self.cp.size == 1:
            return table, None
        packed = self.packed
        planes = 1 if rejected is None else rejected.dim()
        encoding = rejection_wire.Encoding.choose([h.tokens for h in headers], [h.rejected for h in headers], planes)
        try:
            per_rank, gathered = distributed.exchange_seq_stats(
                table, packed.length_table, self.cp,
                rejection_wire.encode(rejected, encoding) if rejected is not None else None, names=packed.length_names)
        except Exception as failure:  # noqa: BLE001
            if self.dp.size > 1 and self.scopes.in_finalize:  # the DP peers wait in finalize's exchange: tell them
                distributed.agree(self.dp, "dp", error=failure, config_text=self.text)
            raise
        rank, index, plane = rejection_wire.decode(gathered, encoding)
        positions, sequences = rejection_wire.positions(rank, index, packed.length_table, self.cp.size)
        if planes == 1:
            return schema.combine(per_rank), Rejected(positions)
        gated = plane == 1
        return schema.combine(per_rank), Rejected(positions[~gated], positions[gated], sequences[gated])

    # --------------------------------------------------------------- the DP-scoped batch quantities
    def _dp_sum(self, values: Tensor, scoped: bool) -> Tensor:
        return distributed.dp_sum(values, self.dp, self.text) if scoped and self.dp.size > 1 else values

    def token_histogram(self, histogram: Tensor) -> Tensor:
        return self._dp_sum(histogram, self.scopes.token_bound)

    def seq_histogram(self, histogram: Tensor) -> Tensor:
        return self._dp_sum(histogram, self.scopes.seq_bound)

    def normalizer(self, mean_parts: Tensor) -> Tensor:
        return self._dp_sum(mean_parts, self.scopes.normalize)

    def gate(self, parts: Tensor) -> Tensor:
        if self.scopes.gate and self.dp.size > 1:
            return distributed.dp_reduce(parts, self.dp, self.text, gate.PART_REDUCE)
        return parts


@dataclass(frozen=True)
class Rejected:
    """The tokens any CP rank rejected at token level, as positions in the full masks; with a directional sequence
    option also those its gate removes when it fires on their sequence (decided after the exchange)."""

    positions: Tensor  # [M] int64
    gated_positions: Tensor | None = None  # [G] int64, the moving-out tokens
    gated_sequences: Tensor | None = None  # [G] int64, their sequences


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
    auto_dp = config.use_tis and config.upper_bound.adaptive and config.upper_bound.scope == "dp"
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


def log_warning(result: correction.Correction, cp: distributed.Group = distributed.SINGLE) -> None:
    """A warning the core raised (the batch gate fired), once per CP group, through the ``miles_mis`` logger."""
    if result.message and cp.rank == 0:
        logging.getLogger("miles_mis").warning(result.message)
