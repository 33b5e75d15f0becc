"""Packed per-sequence tensors: B sequences' tokens concatenated, and the segment operations on them.

``PackedBatch`` holds one rank's response tokens in batch order with what every stage needs to reduce over
sequences without a Python loop: per-sequence sums (one sparse CSR mat-vec per column), per-sequence
extremes, the broadcast of a per-sequence table back to the tokens, and sums by position bucket.

On CPU a call's cost is memory passes, serial kernels (scatter, cumsum, bincount) and the number of ops; the
choices below were timed side by side against their alternatives (2 threads, the shapes of bench_core.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .ops import constant, to_float32_log_probs
from .rollout_groups import RolloutGroups

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class PackedBatch:
    """This rank's response tokens of B sequences, concatenated in batch order.

    seq_lengths[i] tokens of sequence i are contiguous; ``loss_mask`` is the local part of the full
    loss masks (nonzero = trained token).
    """

    train_log_probs: Tensor  # [N] float32
    rollout_log_probs: Tensor  # [N] float32
    loss_mask: Tensor  # [N] any dtype, nonzero = valid
    seq_lengths: Tensor  # [B] int64, local tokens per sequence
    seq_index: Tensor  # [N] int64, sequence of each token
    segment_matrix: Tensor  # [B, N] float64 sparse CSR of ones: segment_matrix @ x = per-sequence sums of x
    # [N] int64 response positions of a CP layout; None = whole responses (cp = 1): positions are then
    # 0..L-1 in every sequence, computed only if read (``positions``), and a position bucket is a range of
    # each sequence's tokens, so per_bucket_sum needs no bucket index per token
    layout_positions: Tensor | None = None
    _row_offsets: Tensor | None = field(default=None, compare=False, repr=False)  # [B+1] int64 cumsum of lengths
    _columns: Tensor | None = field(default=None, compare=False, repr=False)  # segment_matrix's column indices
    _cache: dict = field(default_factory=dict, compare=False, repr=False)  # positions, per_bucket_sum's indices
    # [B] int64 weight versions each sequence is behind the trainer (miles_mis.correction.staleness); None = not given
    lags: Tensor | None = None
    lag_mean: float = 0.0  # their mean (read from the host's list, without a tensor op)
    # [N] float32 −1/0/1 the signs of the host's advantages (miles_mis.inputs.advantages), read by the directional
    # divergence options; None = not given or not needed
    advantage_signs: Tensor | None = None
    # [N] float64 the engine's kept-set size of each token (miles_mis.inputs.sampling_mask; 0 = not recorded);
    # None = not given
    mask_sizes: Tensor | None = None
    # the host's split rollouts: the core's sequence-level stages act on each rollout whole (``grouped``); None =
    # every sample is its own sequence
    rollouts: RolloutGroups | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lengths.numel()

    @property
    def whole_responses(self) -> bool:
        """Every sequence's tokens are its whole response, in order (cp = 1)."""
        return self.layout_positions is None

    @property
    def positions(self) -> Tensor:
        """[N] int64, each token's position in its response (0 = the first generated token)."""
        if self.layout_positions is not None:
            return self.layout_positions
        if "positions" not in self._cache:  # whole responses: built on first use (the core's stages need none)
            self._cache["positions"] = _positions(self.seq_lengths, self._row_offsets, self.seq_index.numel())
        return self._cache["positions"]

    @classmethod
    def from_flat(cls, train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
                  seq_lengths: Tensor, positions: Tensor | None = None) -> "PackedBatch":
        """``positions``: response positions of the tokens (under CP, from the zigzag layout); None = every
        sequence's tokens are its whole response, in order."""
        device = train_log_probs.device
        num_tokens = train_log_probs.numel()
        num_seqs = seq_lengths.numel()
        seq_lengths = seq_lengths.to(device=device, dtype=torch.long)
        # the repeats-only form: 5-15x faster than repeat_interleave(arange(B), lengths), which gathers
        seq_index = torch.repeat_interleave(seq_lengths, output_size=num_tokens)
        row_offsets = seq_lengths.new_zeros(num_seqs + 1)
        torch.cumsum(seq_lengths, 0, out=row_offsets[1:])
        # A CSR row per sequence: one sparse mat-vec sums a column over every sequence at once, several
        # times faster on CPU than segment_reduce, index_add_ or a float64 cumsum; int32 indices halve the
        # index traffic of int64 ones (2-3x faster mat-vec, same sums bit for bit).
        columns = torch.arange(num_tokens, dtype=torch.int32 if num_tokens <= _INT32_MAX else torch.long,
                               device=device)
        segment_matrix = _csr(row_offsets.to(columns.dtype), columns, num_seqs)
        if positions is not None:
            positions = positions.to(device=device, dtype=torch.long)
        return cls(to_float32_log_probs(train_log_probs), to_float32_log_probs(rollout_log_probs), loss_mask,
                   seq_lengths, seq_index, segment_matrix, positions, row_offsets, columns)

    def grouped(self, of_sample: Tensor, count: int) -> "PackedBatch":
        """The same tokens with the samples of each group (``of_sample`` [B] int64: each sample's group, 0..G-1) as
        one sequence: G rows, each token's row its group's; the tokens keep their order and their response
        positions (so position buckets stay per sample). A group's lag is its most stale sample's."""
        device = self.seq_index.device
        of_sample = of_sample.to(device)
        seq_index = of_sample.index_select(0, self.seq_index)
        seq_lengths = self.seq_lengths.new_zeros(count).index_add_(0, of_sample, self.seq_lengths)
        row_offsets = seq_lengths.new_zeros(count + 1)
        torch.cumsum(seq_lengths, 0, out=row_offsets[1:])
        # a row per group: its tokens' indices in order (a group's samples need not be adjacent in the batch)
        columns = torch.argsort(seq_index, stable=True).to(self._columns.dtype)
        segment_matrix = _csr(row_offsets.to(columns.dtype), columns, count)
        lags = None
        if self.lags is not None:
            lags = self.lags.new_zeros(count).scatter_reduce_(0, of_sample.to(self.lags.device), self.lags, "amax",
                                                              include_self=False)
        return dataclasses.replace(self, seq_lengths=seq_lengths, seq_index=seq_index, segment_matrix=segment_matrix,
                                   layout_positions=self.positions, _row_offsets=row_offsets, _columns=columns,
                                   _cache={}, lags=lags, rollouts=None)

    def per_seq_sum(self, values: Tensor) -> Tensor:
        """[N] -> [B] float64 sums over each sequence's tokens.

        Accumulated in float64: a float32 sum over a 100k-token response drifts by ~1e-4 relative (an ESS
        above 1, a normalised weight of 0.9997 where it is exactly 1), and differently under CP, where each
        rank sums its part."""
        if values.numel() == 0:
            return torch.zeros(self.num_seqs, dtype=torch.float64, device=values.device)
        return torch.mv(self.segment_matrix, values.double())  # not @: matmul adds a dispatch layer per call

    def per_seq_extreme(self, values: Tensor, reduce: str, empty: float) -> Tensor:
        """[N] -> [B] "amax"/"amin" over each sequence's tokens (``empty`` for a sequence with no token)."""
        out = values.new_full((self.num_seqs,), empty)
        return out.scatter_reduce_(0, self.seq_index, values, reduce)

    def broadcast(self, table: Tensor) -> Tensor:
        """[B, M] per-sequence values -> [N, M], each token getting its sequence's row."""
        return table.index_select(0, self.seq_index)

    def per_bucket_sum(self, values: Tensor, edges: Sequence[int]) -> Tensor:
        """[N] -> [K] float64 sums of ``values`` over the tokens whose position is in bucket k = [edges[k], edges[k+1])
        (the last one [edges[-1], ∞)); ``edges``: K increasing ints, edges[0] = 0."""
        edges = tuple(int(e) for e in edges)
        if not edges or edges[0] != 0 or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(f"position bucket edges {edges} must be increasing, starting at 0")
        values = values.double()
        if values.numel() == 0:
            return values.new_zeros(len(edges))
        index = self._cache.get(edges)
        if index is None:  # built once per batch: location sums two columns by the same buckets
            index = self._cache[edges] = (
                self._bucket_matrix(edges) if self.whole_responses
                else torch.bucketize(self.positions, constant(edges[1:], values.device), right=True))
        if not self.whole_responses:  # positions of a CP layout: a bucket per token, and a (serial) bincount
            return torch.bincount(index, weights=values, minlength=len(edges))
        # a row per (sequence, bucket), a range of the sequence's tokens: one parallel mat-vec instead of a
        # per-token bucket index and a serial bincount (4-7x less time on CPU)
        return torch.mv(index, values).view(self.num_seqs, len(edges)).sum(0)

    def _bucket_matrix(self, edges: tuple[int, ...]) -> Tensor:
        """[B·K, N] CSR of ones: row i·K + k holds sequence i's tokens at positions [edges[k], edges[k+1])."""
        offsets = self._row_offsets
        starts = torch.minimum(self.seq_lengths[:, None], constant(edges, offsets.device)).add_(offsets[:-1, None])
        rows = torch.cat([starts.view(-1), offsets[-1:]]).to(self._columns.dtype)
        # the same N ones as the segment matrix (read-only): one buffer fewer to fill
        return _csr(rows, self._columns, self.num_seqs * len(edges), self.segment_matrix.values())


_csr_warned = False  # torch warns once per process that sparse CSR is beta: silenced on the first build only


def _csr(row_offsets: Tensor, columns: Tensor, num_rows: int, ones: Tensor | None = None) -> Tensor:
    """[num_rows, N] sparse CSR of ones; ``columns`` = arange(N): each row a range of the tokens."""
    global _csr_warned
    if ones is None:  # float64: the per-sequence sums accumulate in float64 (PackedBatch.per_seq_sum)
        ones = torch.ones(columns.numel(), dtype=torch.float64, device=columns.device)
    with contextlib.nullcontext() if _csr_warned else warnings.catch_warnings():
        if not _csr_warned:  # "sparse CSR support is in beta": mat-vec is all we use
            warnings.simplefilter("ignore", UserWarning)
        matrix = torch.sparse_csr_tensor(row_offsets, columns, ones, size=(num_rows, columns.numel()),
                                         check_invariants=False)
    _csr_warned = True
    return matrix


def _positions(seq_lengths: Tensor, row_offsets: Tensor, num_tokens: int) -> Tensor:
    """[N] each token's index in its sequence, as a running count that drops by a sequence's length where the
    next one starts: one cumsum, 2-5x cheaper than subtracting each token's sequence start (a gather)."""
    steps = torch.ones(num_tokens + 1, dtype=torch.long, device=seq_lengths.device)
    steps[:1].zero_()
    # sequence i ends at row_offsets[i + 1] (N for the last ones: the extra slot); empty ones add 0
    steps.index_add_(0, row_offsets[1:], seq_lengths, alpha=-1)
    return steps[:num_tokens].cumsum(0)
