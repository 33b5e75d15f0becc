"""Stage 4, finalize: sequence-level decisions, weights, normalisation and metrics, from the per-sequence table
combined over the CP group plus this rank's own tokens.

``finalize`` is straight-line: each stage is a function of the values the earlier ones returned. In order: what the
table and the batch-sum vector measure (``measures``), the sequence decisions (``decisions``: the batch gate, the
bound at ``tis_level``, the divergence options, RS, the veto, the staleness gate; each returns an ``Outcome``, its
rejections and its metrics; ``finalize`` ORs the rejections and gathers the metrics), which tokens and sequences
stay and the adaptive sequence-level bound, the weights (``weighing``) and the metrics by lag. Everything per
sequence is broadcast to the tokens once, at the end. docs/math.md has a section per formula, in an order of its
own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import adaptive, divergence
from ..config import MisConfig
from ..tensors import ops
from ..tensors.packed_batch import PackedBatch
from .decisions import (apply_adaptive_bound, bound_at_tis_level, gate_batch,
                        keep_sequences, keep_staying_tokens, reject_by_divergence, reject_outside_rs_bounds,
                        reject_stale_sequences, veto_catastrophic_sequences)
from .measures import Reduce, measure_batch, measure_by_lag, mismatch_seq_metrics
from .seq_table import TableSchema, group_rollouts, per_sample, rollout_seq_metrics
from .stage_values import Outcome, SeqWeights
from .token_terms import TokenTerms
from .weighing import final_sequence_extremes, final_weight_statistics, normalise, sum_kept_weights


@dataclass(frozen=True)
class Correction:
    weights: Tensor | None  # [N] final detached weights of the local tokens, 0 where rejected; None = metrics-only
    token_keep: Tensor  # [N] float 0/1: local token stays in the mask
    seq_keep: Tensor  # [B] bool: sequence not rejected by a sequence-level stage
    metrics: dict[str, Tensor]  # name (with mis_ prefix) -> [N] float32, aligned with the local tokens
    message: str | None = None  # a warning for the host's log (the batch gate fired), else None
    seq_gate: Tensor | None = None  # [B] bool: a directional sequence option fired (its moving-out tokens are out)
    exchanged: Any = None  # what the table exchange returned besides the table (the CP ranks' token rejections)


def finalize(batch: PackedBatch, terms: TokenTerms, table: Tensor, schema: TableSchema, config: MisConfig,
             batch_values: Tensor, token_bound: adaptive.Choice | None = None, *, gate_reduce: Reduce,
             seq_histogram_reduce: Reduce, normalizer_reduce: Reduce) -> Correction:
    """Sequence-level decisions, final weights and all metrics for this rank's tokens.

    ``table`` is the per-sequence table combined over the context-parallel group and ``batch_values`` the batch-sum
    vector combined over it, so every rank takes the same sequence-level decisions and the same batch-level
    normalisation. ``token_bound``: the adaptive token-level bound (``terms`` are bounded at it). The reduces combine
    the batch gate's parts, the adaptive sequence-level bound's histogram and the normalisation mean's parts over
    the DP group (the identity for a micro-batch scope).

    With split rollouts (``batch.rollouts``) every sequence-level stage sees each rollout whole
    (``group_rollouts``); the returned ``seq_keep``/``seq_gate`` are per sample again.
    """
    groups = batch.rollouts
    batch, table = group_rollouts(batch, table, schema)
    col = schema.columns(table)
    seq_metrics = mismatch_seq_metrics(col)
    if groups is not None:
        seq_metrics.update(rollout_seq_metrics(groups, table.device))
    token_metrics = {"nonfinite_token_fraction": terms.nonfinite}
    batch_metrics, gate_statistics = measure_batch(batch, col, batch_values, gate_reduce)
    if batch.lags is not None:  # the mean lag of the sequences
        batch_metrics["version_lag"] = torch.tensor(batch.lag_mean, device=table.device)
    if not config.use_tis:
        lag_metrics = measure_by_lag(batch, col)
        correction = metrics_only(batch, terms, token_metrics, seq_metrics, batch_metrics, lag_metrics)
        return _per_sample(correction, groups)

    gated, message = gate_batch(gate_statistics, config, table.device)
    tis, seq = bound_at_tis_level(batch, terms, col, config)
    verdict = reject_by_divergence(batch, terms, col, config)
    outcomes = [gated, tis, reject_outside_rs_bounds(terms, col, config),
                veto_catastrophic_sequences(terms, col, config), reject_stale_sequences(batch, col, config)]
    if verdict is not None:
        outcomes.append(Outcome(verdict.seq_reject, verdict.token_metrics, verdict.seq_metrics, verdict.batch_metrics))
    kept_columns = keep_staying_tokens(col, verdict)
    seq_keep, n_pass = keep_sequences(_any([o.reject for o in outcomes]), kept_columns)
    chosen, seq = apply_adaptive_bound(config, seq, token_bound, n_pass, seq_histogram_reduce, table.device)
    kept = sum_kept_weights(kept_columns, seq_keep, n_pass, seq)
    factor = normalise(kept.mean_parts, config, normalizer_reduce)
    lag_metrics = measure_by_lag(batch, kept_columns, config, seq_keep, n_pass, seq)
    for outcome in (*outcomes, chosen, final_sequence_extremes(kept_columns, seq_keep, n_pass, seq, factor)):
        token_metrics.update(outcome.token)
        seq_metrics.update(outcome.seq)
        batch_metrics.update(outcome.batch)
    batch_metrics.update(final_weight_statistics(kept, factor, col["n_valid"].sum()))
    tokens = broadcast_to_tokens(batch, terms, seq_metrics, seq_keep, seq, verdict, factor)
    token_metrics["is_ratio_mean_after_tis_rs"] = tokens.weight_before_normalisation
    token_metrics["is_ratio_mean_final"] = tokens.weight
    if tokens.divergence_masked is not None:  # tokens removed by any divergence option, token- or sequence-level
        token_metrics["rs_divergence_masked_token_fraction"] = tokens.divergence_masked
    # batch-level values: a fill per metric, cheaper than gathering them with the per-sequence table
    token_metrics.update(_expand(batch_metrics, tokens.weight.numel(), lag_metrics))
    correction = Correction(tokens.weight, tokens.keep, seq_keep, _metrics(token_metrics, tokens.seq_metrics),
                            message, None if verdict is None else verdict.gate)
    return _per_sample(correction, groups)


def _any(rejections: list[Tensor | None]) -> Tensor | None:
    """The OR of the stages' rejections (None when no stage rejects)."""
    out = None
    for reject in rejections:
        if reject is not None:
            out = reject if out is None else out | reject
    return out


def _per_sample(correction: Correction, groups) -> Correction:
    """A grouped call's decisions per sample again (``seq_table.per_sample``)."""
    if groups is None or groups.trivial:
        return correction
    seq_keep, seq_gate = per_sample(correction.seq_keep, correction.seq_gate, groups)
    return dataclasses.replace(correction, seq_keep=seq_keep, seq_gate=seq_gate)


def metrics_only(batch: PackedBatch, terms: TokenTerms, token_metrics: dict, seq_metrics: dict, batch_metrics: dict,
                 lag_metrics) -> Correction:
    """``use_tis`` off: the mismatch metrics, no weights, the valid tokens kept and every sequence kept."""
    token_metrics.update(_expand(batch_metrics, batch.seq_index.numel(), lag_metrics))
    per_token, _ = _broadcast(batch, seq_metrics, {})
    return Correction(None, terms.valid, torch.ones(batch.num_seqs, dtype=torch.bool, device=terms.valid.device),
                      _metrics(token_metrics, per_token))


# --------------------------------------------------------------------------- to the tokens
@dataclass(frozen=True)
class TokenResult:
    keep: Tensor  # [N] float 0/1
    weight_before_normalisation: Tensor  # [N] w_t · keep_t
    weight: Tensor  # [N] final, detached
    seq_metrics: dict[str, Tensor]  # the per-sequence metrics, per token
    divergence_masked: Tensor | None  # [N] removed by any divergence option (None without one)


def broadcast_to_tokens(batch: PackedBatch, terms: TokenTerms, seq_metrics: dict[str, Tensor], seq_keep: Tensor,
                        seq: SeqWeights | None, verdict: divergence.Verdict | None, factor: Tensor) -> TokenResult:
    """One broadcast of the per-sequence values to the tokens, then the tokens' mask and final weights:

    keep_t = token_pass_t · keep_{i(t)} · (1 − gate_{i(t)} · out_t),   w̃_t = keep_t · w_t / factor
    (w_t = w_{i(t)} at sequence level)
    """
    decisions = {"keep": seq_keep.float()}
    if seq is not None:
        decisions["weight"] = seq.weight
    if verdict is not None:
        decisions["divergence_reject"] = verdict.seq_reject.float()
        if verdict.gate is not None:
            decisions["gate"] = verdict.gate.float()
    per_token, decided = _broadcast(batch, seq_metrics, decisions)
    keep = terms.token_pass * decided["keep"]
    if "gate" in decided:  # keep_t ·= 1 − gate_i(t) · out_t
        keep = keep * (1.0 - decided["gate"] * terms.moving_out)
    masked = None if verdict is None else torch.maximum(verdict.rejected_tokens, decided["divergence_reject"])
    weight = (terms.token_weight if seq is None else decided["weight"]) * keep
    return TokenResult(keep, weight, (weight / factor).detach(), per_token, masked)


def _expand(values: dict[str, Tensor], num_tokens: int,
            vector: tuple[tuple[str, ...], Tensor] | None = None) -> dict[str, Tensor]:
    """Batch-level values -> one [N] tensor each: a broadcast view (stride 0) of the 0-d value, not N copies.
    Materialising them cost a 4·M·N-byte table per call (~5 MB at 80k tokens, 1.2 ms of first-touch page
    faults, a third of a default call); a reduction or product by the host reads a view like any tensor.
    Writing into one in place is refused by torch (docs/contract.md): copy it first. ``vector``: more values
    already in one 1-D tensor (names, values), e.g. the lag-bucket metrics: joined without a 0-d tensor each."""
    names = list(values)
    if not names and vector is None:
        return {}
    # one stack and one unbind for all of them (a reshape, cast and expand each cost ~3 ops per value)
    parts = [torch.stack([value if value.dim() == 0 else value.reshape(()) for value in values.values()]).float()]
    if vector is not None:
        names += vector[0]
        parts.append(vector[1].float())
    column = torch.cat(parts) if len(parts) > 1 else parts[0]
    return dict(zip(names, column[:, None].expand(-1, num_tokens).unbind(0)))


def _broadcast(batch: PackedBatch, metrics: dict[str, Tensor],
               decisions: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The per-sequence ``metrics`` and ``decisions`` [B] to the tokens [N] (float32), in one gather."""
    names = (*metrics, *decisions)
    # one stack (float64 where any column is: a float32 or 0/1 value round-trips exactly) and one cast
    table = torch.stack([*metrics.values(), *decisions.values()], dim=1).float()
    per_token = dict(zip(names, batch.broadcast(table).unbind(1)))
    return {name: per_token[name] for name in metrics}, {name: per_token[name] for name in decisions}


def _metrics(token_metrics: dict[str, Tensor], seq_metrics_per_token: dict[str, Tensor]) -> dict[str, Tensor]:
    """All metrics, ``mis_``-prefixed, detached float32 [N] tensors, sorted by name."""
    out = {f"mis_{name}": ops.without_history(value if value.dtype == torch.float32 else value.float())
           for name, value in token_metrics.items()}
    out.update({f"mis_{name}": ops.without_history(value) for name, value in seq_metrics_per_token.items()})
    return dict(sorted(out.items()))

