"""Megatron's load-balanced ("zigzag") context-parallel layout of response log-probs.

With CP size C > 1 a sequence of length L (its total length for qkv format "thd", its
``max_seq_len`` for "bshd") is cut into 2C chunks of ``ceil(L / 2C)`` positions; rank r holds chunk r
and chunk 2C−1−r. The log-prob at position p scores token p+1, so the response occupies log-prob
positions [P−1, T−1), P the prompt length and T the total length. A rank's local response
log-probs are the parts of that range inside its two chunks, chunk r's part first; either part
may be empty.

Everything here is vectorised over the batch (tensors of B lengths), with no Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

QKV_FORMATS = ("thd", "bshd")


@dataclass(frozen=True)
class LocalLayout:
    """Which response positions of each sequence this rank holds.

    For each sequence two parts, as response-relative offsets: [start0, start0+len0) from chunk r,
    then [start1, start1+len1) from chunk 2C−1−r.
    """

    start0: Tensor  # [B] int64
    len0: Tensor  # [B]
    start1: Tensor  # [B]
    len1: Tensor  # [B]

    @property
    def local_lengths(self) -> Tensor:
        return self.len0 + self.len1

    def positions(self, response_offsets: Tensor) -> Tensor:
        """Indices, into the concatenation of the B full responses (sequence i starting at
        ``response_offsets[i]``), of this rank's local tokens in local order."""
        part_starts = torch.stack([response_offsets + self.start0, response_offsets + self.start1], 1).reshape(-1)
        part_lengths = torch.stack([self.len0, self.len1], 1).reshape(-1)
        return ranges(part_starts, part_lengths)


def ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenation of arange(starts[k], starts[k] + lengths[k]) over k, without a Python loop."""
    total = int(lengths.sum())
    part = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    part_begin = torch.cumsum(lengths, 0) - lengths  # where each part starts in the output
    return starts.index_select(0, part) + torch.arange(total, device=lengths.device) - part_begin.index_select(0, part)


def zigzag_layout(total_lengths: Tensor, response_lengths: Tensor, cp_rank: int, cp_size: int,
                  qkv_format: str = "thd", max_seq_lens: Tensor | None = None) -> LocalLayout:
    """The local response parts of rank ``cp_rank`` of ``cp_size`` for every sequence.

    chunk = ceil(L / 2C); chunk k covers positions [k·chunk, (k+1)·chunk); the response covers log-prob
    positions [P−1, T−1); part k = intersection, as offsets from P−1.
    """
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} is invalid: allowed values are {', '.join(QKV_FORMATS)}")
    total_lengths = total_lengths.long()
    response_lengths = response_lengths.long()
    if cp_size == 1:
        zeros = torch.zeros_like(response_lengths)
        return LocalLayout(zeros, response_lengths, zeros, zeros)
    if qkv_format == "bshd":
        if max_seq_lens is None:
            raise ValueError("max_seq_lens is required when qkv_format is 'bshd'")
        span = max_seq_lens.long()
    else:
        span = total_lengths
    chunk = (span + 2 * cp_size - 1) // (2 * cp_size)
    first = total_lengths - response_lengths - 1  # log-prob position of the first response token
    end = total_lengths - 1

    def part(chunk_index: int) -> tuple[Tensor, Tensor]:
        lo = torch.maximum(chunk * chunk_index, first)
        hi = torch.minimum(chunk * (chunk_index + 1), end)
        length = (hi - lo).clamp(min=0)
        return torch.where(length > 0, lo - first, torch.zeros_like(lo)), length

    start0, len0 = part(cp_rank)
    start1, len1 = part(2 * cp_size - 1 - cp_rank)
    return LocalLayout(start0, len0, start1, len1)


def logits_rows(total_lengths: Tensor, response_lengths: Tensor, cp_rank: int, cp_size: int,
                qkv_format: str = "thd", max_seq_lens: Tensor | None = None) -> Tensor:
    """The rows of this rank's logits (the host's [1, T, V] or [B, S, V], flattened to [rows, V]) that score its local
    response tokens, in ``zigzag_layout``'s local order (the order of the CP-sharded log-probs).

    Sample i's rows begin at base_i = Σ_{j<i} T_j (thd, C = 1), i·S (bshd, C = 1) or Σ_{j<i} 2·chunk_j (C > 1: a rank
    holds two chunks of ``chunk = ceil(L / 2C)`` rows of every sample, chunk r then chunk 2C−1−r). The log-prob at
    position p (scoring token p+1; the response's are P−1 … T−2) sits at row base_i + p (C = 1), base_i + p − r·chunk
    (chunk r) or base_i + chunk + p − (2C−1−r)·chunk (chunk 2C−1−r).
    """
    if qkv_format == "bshd" and max_seq_lens is None:
        raise ValueError("max_seq_lens is required when qkv_format is 'bshd'")
    layout = zigzag_layout(total_lengths, response_lengths, cp_rank, cp_size, qkv_format, max_seq_lens)
    total_lengths, response_lengths = total_lengths.long(), response_lengths.long()
    first = total_lengths - response_lengths - 1  # log-prob position of the first response token
    if cp_size == 1:
        spans = max_seq_lens.long() if qkv_format == "bshd" else total_lengths
        base = torch.cumsum(spans, 0) - spans
        start0, start1 = base + first, base  # the second part is empty
    else:
        span = max_seq_lens.long() if qkv_format == "bshd" else total_lengths
        chunk = (span + 2 * cp_size - 1) // (2 * cp_size)
        base = torch.cumsum(2 * chunk, 0) - 2 * chunk
        start0 = base + first + layout.start0 - cp_rank * chunk
        start1 = base + chunk + first + layout.start1 - (2 * cp_size - 1 - cp_rank) * chunk
    part_starts = torch.stack([start0, start1], 1).reshape(-1)
    part_lengths = torch.stack([layout.len0, layout.len1], 1).reshape(-1)
    return ranges(part_starts, part_lengths)
