"""The correction of one call: the one function that knows the stage order (``correct``), and the collectives it
needs as a value (``Reductions``).

    token_terms -> local_batch_values --(batch_values: CP agreement)--> bound_token_terms
                -> local_table --(seq_table: CP exchange)--> finalize

Every caller (the plugin's entry points, the CP/DP peers, the analyzer's evaluator) goes through ``correct``; a
caller cannot skip a stage, only say how values are combined with other processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torch import Tensor

from ..config import MisConfig
from ..tensors.packed_batch import PackedBatch
from .batch_values import bound_token_terms, local_batch_values
from .finalize import Correction, finalize
from .seq_table import TableSchema, local_table
from .token_terms import rejects_tokens, token_rejections, token_terms


class Reductions(Protocol):
    """How one call combines its values with other processes (``LOCAL``: one process, nothing to combine; the
    context- and data-parallel implementation is ``miles_mis.parallel.peers.PeerReductions``).

    The first exchange is ``batch_values``: under CP it is the agreement (config, shapes, errors) and returns an
    opaque value the table exchange needs; an error before it reaches every peer through ``fail``."""

    exchanges_token_rejections: bool  # the table exchange carries each rank's token rejections (CP > 1)

    def fail(self, error: BaseException) -> None:
        """Tell the peers this process failed before the first exchange, then raise ``error``."""

    def batch_values(self, values: Tensor, rejected: Tensor | None, schema: TableSchema) -> tuple[Tensor, Any]:
        """(the batch-sum vector combined over the CP group, the agreement; the ranks compare ``schema`` in it)."""

    def token_histogram(self, histogram: Tensor) -> Tensor:
        """The adaptive token-level bound's histogram, over its scope."""

    def seq_table(self, table: Tensor, schema: TableSchema, rejected: Tensor | None,
                  agreement: Any) -> tuple[Tensor, Any]:
        """(the per-sequence table combined over the CP group by ``schema``, what else the exchange returned)."""

    def seq_histogram(self, histogram: Tensor) -> Tensor:
        """The adaptive sequence-level bound's histogram, over its scope."""

    def normalizer(self, mean_parts: Tensor) -> Tensor:
        """The batch normalisation mean's [numerator, denominator], over its scope."""

    def gate(self, parts: Tensor) -> Tensor:
        """The batch gate's parts (``gate.PARTS``), over its scope."""


class LocalReductions:
    """One process holding whole sequences: every reduction is the identity."""

    exchanges_token_rejections = False

    def fail(self, error: BaseException) -> None:
        raise error

    def batch_values(self, values: Tensor, rejected: Tensor | None, schema: TableSchema) -> tuple[Tensor, Any]:
        return values, None

    def seq_table(self, table: Tensor, schema: TableSchema, rejected: Tensor | None,
                  agreement: Any) -> tuple[Tensor, Any]:
        return table, None

    def token_histogram(self, histogram: Tensor) -> Tensor:
        return histogram

    seq_histogram = normalizer = gate = token_histogram


LOCAL = LocalReductions()


def correct(batch: PackedBatch, config: MisConfig, reductions: Reductions = LOCAL) -> Correction:
    """The correction of one call, every stage in order. An error before the first exchange reaches every peer
    (``Reductions.fail``); the exchanges themselves fail together (docs/reliability.md)."""
    schema = TableSchema.of(config, batch.lags is not None)
    try:
        terms = token_terms(batch, config)
        values = local_batch_values(batch, terms, config)
        rejected = (token_rejections(terms, config)
                    if reductions.exchanges_token_rejections and rejects_tokens(config) else None)
    except Exception as failure:  # noqa: BLE001 (raised on every peer by fail)
        reductions.fail(failure)
        raise
    batch_values, agreement = reductions.batch_values(values, rejected, schema)
    terms, token_bound = bound_token_terms(terms, batch_values.to(terms.token_ratio.device), config,
                                           reductions.token_histogram)
    table, exchanged = reductions.seq_table(local_table(batch, terms, config, schema), schema, rejected, agreement)
    correction = finalize(batch, terms, table, schema, config, batch_values.to(table.device), token_bound,
                          gate_reduce=reductions.gate, seq_histogram_reduce=reductions.seq_histogram,
                          normalizer_reduce=reductions.normalizer)
    return correction if exchanged is None else dataclasses.replace(correction, exchanged=exchanged)
