"""Packed per-sequence tensors: B sequences' tokens concatenated, and the segment operations on them.

``PackedBatch`` holds one rank's response tokens in batch order with what every stage needs to reduce over
sequences without a Python loop: per-sequence sums (one sparse CSR mat-vec per column), per-sequence
extremes, and the broadcast of a per-sequence table back to the tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor


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
    segment_matrix: Tensor  # [B, N] sparse CSR of ones: segment_matrix @ x = per-sequence sums of x
    positions: Tensor  # [N] int64, each token's position in its response (0 = the first generated token)

    @property
    def num_seqs(self) -> int:
        return self.seq_lengths.numel()

    @classmethod
    def from_flat(cls, train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
                  seq_lengths: Tensor, positions: Tensor | None = None) -> "PackedBatch":
        """``positions``: response positions of the tokens (under CP, from the zigzag layout); None = every
        sequence's tokens are its whole response, in order."""
        device = train_log_probs.device
        num_tokens = train_log_probs.numel()
        seq_lengths = seq_lengths.to(device=device, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(seq_lengths.numel(), device=device), seq_lengths,
                                            output_size=num_tokens)
        # A CSR row per sequence: one sparse mat-vec sums a column over every sequence at once,
        # several times faster on CPU than segment_reduce, index_add_ or a float64 cumsum.
        row_offsets = torch.zeros(seq_lengths.numel() + 1, dtype=torch.long, device=device)
        torch.cumsum(seq_lengths, 0, out=row_offsets[1:])
        with warnings.catch_warnings():  # "sparse CSR support is in beta": mat-vec is all we use
            warnings.simplefilter("ignore", UserWarning)
            segment_matrix = torch.sparse_csr_tensor(
                row_offsets, torch.arange(num_tokens, device=device), torch.ones(num_tokens, device=device),
                size=(seq_lengths.numel(), num_tokens), check_invariants=False)
        if positions is None:  # the token's index minus its sequence's first index
            positions = torch.arange(num_tokens, device=device).sub_(row_offsets.index_select(0, seq_index))
        return cls(train_log_probs.float(), rollout_log_probs.float(), loss_mask, seq_lengths, seq_index,
                   segment_matrix, positions.to(device=device, dtype=torch.long))

    def per_seq_sum(self, values: Tensor) -> Tensor:
        """[N] -> [B] sums over each sequence's tokens."""
        if values.numel() == 0:
            return values.new_zeros(self.num_seqs)
        return self.segment_matrix @ values

    def per_seq_extreme(self, values: Tensor, reduce: str, empty: float) -> Tensor:
        """[N] -> [B] "amax"/"amin" over each sequence's tokens (``empty`` for a sequence with no token)."""
        out = values.new_full((self.num_seqs,), empty)
        return out.scatter_reduce_(0, self.seq_index, values, reduce)

    def broadcast(self, table: Tensor) -> Tensor:
        """[B, M] per-sequence values -> [N, M], each token getting its sequence's row."""
        return table.index_select(0, self.seq_index)
