"""Stage 3, the per-sequence table: one [B, K] float64 row of sums and extremes per sequence, with a schema.

A ``TableSchema`` names every column and how two parts of one sequence combine (sum, max or min): the parts held
by two CP ranks (``combine``), or the samples of one split rollout (``group``). It is built once per call from the
config: the base columns, the divergence options' columns (``divergence.Layout``) and, with lags at token level,
``n_bounded``. Readers take columns by name (``TableSchema.columns``); the CP ranks compare the schema's
fingerprint in their agreement header.

Extreme columns are over passing tokens; a sequence without one holds the reduce op's empty value (``EMPTY``):
−1 for the base max (weights are ≥ 0), +3e38 for a min, −3e38 for the divergence maxima (their values can be
negative).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..tensors import backend, ops
from . import divergence
from ..config import MisConfig
from ..tensors.packed_batch import PackedBatch
from .token_terms import TokenTerms, bounded_tokens

NO_TOKEN = 3.0e38  # a min column's value for a sequence without a passing token (weights are ≤ e^20)
EMPTY_MAX_WEIGHT = -1.0  # the base max column's value for a sequence without a passing token

# the base columns: (name, reduce op)
BASE_COLUMNS = (("n_valid", "sum"), ("n_usable", "sum"), ("sum_train_log_prob", "sum"), ("sum_log_ratio", "sum"),
                ("sum_k3", "sum"), ("sum_chi2", "sum"), ("n_catastrophic", "sum"), ("n_token_pass", "sum"),
                ("sum_token_weight", "sum"), ("sum_token_weight_sq", "sum"), ("max_token_weight", "max"),
                ("min_token_weight", "min"))
REDUCES = ("sum", "max", "min")


@dataclass(frozen=True)
class TableSchema:
    """The per-sequence table's columns, in order, each with its reduce op ("sum", "max" or "min")."""

    names: tuple[str, ...]
    reduces: tuple[str, ...]

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(config: MisConfig, has_lags: bool = False) -> "TableSchema":
        """The schema of a call: the base columns, the divergence options' (their sums, maxima, minima), and with
        lags at token level ``n_bounded`` (the tokens whose ratio left the bound; the lag metrics need it per
        sequence, and only token-level bounds act on single tokens)."""
        columns = list(BASE_COLUMNS)
        if config.rs_divergence:
            layout = divergence.Layout.of(config.rs_divergence)
            columns += [(name, "sum") for name in layout.sum_names]
            columns += [(name, "max") for name in layout.max_names]
            columns += [(name, "min") for name in layout.min_names]
        if counts_bounded(config, has_lags):
            columns.append(("n_bounded", "sum"))
        names, reduces = zip(*columns)
        return TableSchema(names, reduces)

    @property
    def width(self) -> int:
        return len(self.names)

    @functools.cached_property
    def fingerprint(self) -> int:
        """A signed 64-bit digest of the columns and their ops: the CP ranks compare it in their agreement header
        (two ranks that would combine different columns stop before the exchange)."""
        text = ",".join(f"{name}:{reduce}" for name, reduce in zip(self.names, self.reduces))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)

    @functools.cached_property
    def _by_reduce(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(i for i, op in enumerate(self.reduces) if op == reduce) for reduce in REDUCES)

    def indices(self, device) -> tuple[Tensor, Tensor, Tensor]:
        """The (sum, max, min) column indices, shared int64 tensors on ``device`` (``ops.constant``: made once)."""
        return tuple(ops.constant(columns, device) for columns in self._by_reduce)

    def columns(self, table: Tensor) -> dict[str, Tensor]:
        """The table's columns [B] by name (one op)."""
        return dict(zip(self.names, table.unbind(1)))

    def stack(self, columns: dict[str, Tensor]) -> Tensor:
        """[B, K] from columns by name, in the schema's order (each must be there)."""
        return torch.stack([columns[name] for name in self.names], dim=1)

    def combine(self, per_rank: Tensor) -> Tensor:
        """[C, B, K] per-rank tables (C context-parallel ranks) -> [B, K], each column by its op."""
        sums, maxima, minima = self.indices(per_rank.device)
        out = per_rank.new_empty(per_rank.shape[1:])
        out[:, sums] = per_rank[..., sums].sum(0)
        out[:, maxima] = per_rank[..., maxima].amax(0)
        out[:, minima] = per_rank[..., minima].amin(0)
        return out

    def group(self, table: Tensor, of_sample: Tensor, count: int) -> Tensor:
        """[B, K] per-sample table -> [G, K] per-group table (``of_sample``: each sample's group): each column
        combined over a group's samples as over CP ranks, so a group's row is the table of its samples' tokens taken
        as one sequence."""
        sums, maxima, minima = self.indices(table.device)
        of_sample = of_sample.to(table.device)
        out = table.new_zeros(count, table.shape[1])
        out[:, sums] = out[:, sums].index_add(0, of_sample, table[:, sums])
        for columns, how in ((maxima, "amax"), (minima, "amin")):
            if columns.numel():
                part = table[:, columns]
                out[:, columns] = part.new_zeros(count, columns.numel()).scatter_reduce_(
                    0, of_sample[:, None].expand_as(part), part, how, include_self=False)
        return out


def counts_bounded(config: MisConfig, has_lags: bool) -> bool:
    """The table carries n_bounded: with lags, at token level (a sequence-level bound's decision is per sequence)."""
    return has_lags and config.use_tis and config.tis_level == "token"


def base_token_values(terms: TokenTerms) -> tuple[Tensor, ...]:
    """The [N] values the base columns reduce: the sum columns' summands in float64 (in BASE_COLUMNS' order), the
    kept weight w_t·pass_t (float32), and the inputs of the max and min columns (w_t over passing tokens,
    EMPTY_MAX_WEIGHT / NO_TOKEN elsewhere): one fused pass on the compiled backend."""
    weight = terms.token_weight * terms.token_pass
    summands = (terms.valid, terms.usable, terms.train_log_probs, terms.log_ratio, terms.k3, terms.chi2,
                terms.catastrophic, terms.token_pass, weight, weight * terms.token_weight)
    not_passing = 1.0 - terms.token_pass
    return (*(value.double() for value in summands), weight, weight - not_passing, not_passing * NO_TOKEN + weight)


def local_table(batch: PackedBatch, terms: TokenTerms, config: MisConfig, schema: TableSchema) -> Tensor:
    """[B, schema.width] float64 table of this rank's per-sequence statistics (sums accumulated in float64,
    PackedBatch.per_seq_sum).

    k3_t = exp(clamp(ℓ_t)) − ℓ_t − 1 (exact for ℓ_t ≤ 20, finite beyond), χ²_t = ρ_t² − 1.
    Derived, not stored: n_nonfinite = n_valid − n_usable, Σ log π_rollout = Σ log π_train − Σ ℓ.
    """
    *sums, weight, max_input, min_input = backend.call(base_token_values, config.kernel_backend, terms)
    # one sparse mat-vec per column (the same reduction on either backend): no [N, K] buffer is materialised
    # (memory traffic dominates on CPU)
    columns = {name: batch.per_seq_sum(value) for (name, _), value in zip(BASE_COLUMNS, sums)}
    columns["max_token_weight"] = batch.per_seq_extreme(max_input, "amax", EMPTY_MAX_WEIGHT).double()
    columns["min_token_weight"] = batch.per_seq_extreme(min_input, "amin", NO_TOKEN).double()
    if "n_bounded" in schema.names:
        columns["n_bounded"] = batch.per_seq_sum(bounded_tokens(terms, config))
    if config.rs_divergence:
        layout = divergence.Layout.of(config.rs_divergence)
        gated = (divergence.gated_token_values(terms.moving_out, terms.token_pass, weight)
                 if layout.gated and terms.moving_out is not None else None)
        columns.update(divergence.local_columns(
            layout, terms.usable, terms.estimators, terms.divergence_kept, batch.per_seq_sum,
            lambda v: batch.per_seq_extreme(v, "amax", divergence.NO_VALUE).double(),
            lambda v: batch.per_seq_extreme(v, "amin", -divergence.NO_VALUE).double(), gated))
    return schema.stack(columns)


# --------------------------------------------------------------------------- split rollouts
def group_rollouts(batch: PackedBatch, table: Tensor, schema: TableSchema) -> tuple[PackedBatch, Tensor]:
    """With the host's split rollouts (``batch.rollouts``, miles_mis.inputs.rollouts): the batch and the combined table
    with each rollout's samples as one sequence; unchanged without them, or when every sample is its own rollout."""
    groups = batch.rollouts
    if groups is None or groups.trivial:
        return batch, table
    return batch.grouped(groups.of_sample, groups.count), schema.group(table, groups.of_sample, groups.count)


def rollout_seq_metrics(groups, device) -> dict[str, Tensor]:
    """Per rollout: ``rollout_split_fraction`` (with ids: 1 for a rollout of several samples in the call) and, when
    the host passes ``rollout_mask_sums``, ``rollout_incomplete_fraction`` (1 for a rollout with trained tokens
    outside the call: its sequence-level stages saw a part of it). Per-sequence values, broadcast to the tokens (the
    hosts' reducer makes them shares of samples, or with ``rollout_mask_sums`` denominators token-weighted shares of
    rollouts)."""
    out = {"rollout_split_fraction": (groups.size > 1).float().to(device)} if groups.ids_given else {}
    if groups.incomplete is not None:
        out["rollout_incomplete_fraction"] = groups.incomplete.float().to(device)
    if groups.trivial:  # not grouped: the rows are the samples, numbered as the groups (first appearance)
        out = {name: value.index_select(0, groups.of_sample.to(device)) for name, value in out.items()}
    return out


def per_sample(seq_keep: Tensor, seq_gate: Tensor | None, groups) -> tuple[Tensor, Tensor | None]:
    """A grouped call's sequence decisions per sample again: each sample takes its rollout's."""
    if groups is None or groups.trivial:
        return seq_keep, seq_gate
    index = groups.of_sample.to(seq_keep.device)
    return seq_keep.index_select(0, index), None if seq_gate is None else seq_gate.index_select(0, index)
