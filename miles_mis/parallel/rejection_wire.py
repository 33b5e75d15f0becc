"""Token-level rejections across context-parallel ranks, so that every rank returns the same full masks.

A token rejected at token level (token-level mask mode, token RS, a token divergence option) is known only to
the rank that holds it, but every rank returns the FULL response masks, and a host reducer may divide each
sequence by the sum of the whole returned mask (miles' ``get_sum_of_sample_mean`` without
``rollout_mask_sums``): the masks must be identical on every rank, equal to cp = 1. So each rank sends its
rejections in the per-sequence table's collective (no extra collective), in the cheaper of two encodings,
which every rank picks alike from the counts in the agreement headers (N_r local tokens, R_r rejected):

    bits     one bit per local token:        ⌈max_r N_r / 8⌉ bytes per rank
    indices  int32 local index per rejection: 4 · max_r R_r bytes per rank

(padded to whole float64 words), nothing when no rank rejected a token. Every rank decodes the same gathered
bytes into the same full-mask positions (``positions``): (rank r, local index j) → the zigzag layout of rank r.

With a directional sequence option a second plane travels too: the tokens its gate removes if it fires (known only
after the table is combined), P = 2 bit planes, or index p·max_r N_r + j; R_r counts both planes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cp_layout import zigzag_layout

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Encoding:
    """How this call's rejections travel, identical on every rank (from the headers' counts)."""

    kind: str  # "none", "bits" or "indices"
    size: int  # bytes per rank, a multiple of 8
    planes: int = 1  # sets of flagged tokens (1, or 2 with a directional sequence option)
    stride: int = 0  # max_r N_r: bytes of a bit plane ×8, the index offset of a plane

    @classmethod
    def choose(cls, tokens: list[int], rejected: list[int], planes: int = 1) -> "Encoding":
        """The cheaper encoding for ranks with ``tokens[r]`` local tokens of which ``rejected[r]`` are flagged (over
        ``planes`` planes)."""
        if max(rejected, default=0) == 0:
            return cls("none", 0, planes)
        stride = -(-max(tokens) // 8) * 8
        bits, indices = _words(planes * stride // 8), _words(4 * max(rejected))
        return cls("indices", indices, planes, stride) if indices < bits else cls("bits", bits, planes, stride)


def _words(size: int) -> int:
    return -(-size // 8) * 8


def encode(rejected: Tensor, encoding: Encoding) -> Tensor:
    """uint8 [encoding.size]: this rank's rejections ([N] 0/1, or [P, N] for P planes; local token order) in
    ``encoding``."""
    device = rejected.device
    rejected = rejected.view(encoding.planes, -1)
    out = torch.zeros(encoding.size, dtype=torch.uint8, device=device)
    if encoding.kind == "bits":
        flags = torch.zeros(encoding.size * 8, dtype=torch.uint8, device=device)
        planes = flags[:encoding.planes * encoding.stride].view(encoding.planes, encoding.stride)
        planes[:, :rejected.shape[1]] = rejected.to(torch.uint8)
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
        out = flags.view(-1, 8).mul_(weights).sum(1, dtype=torch.uint8)  # bit k of byte i = flag 8i + k
    elif encoding.kind == "indices":
        plane, index = rejected.nonzero().unbind(1)
        index = (index + plane * encoding.stride).to(torch.int32)
        padded = torch.full((encoding.size // 4,), -1, dtype=torch.int32, device=device)
        padded[:index.numel()] = index
        out = padded.view(torch.uint8)
    return out


def decode(gathered: Tensor, encoding: Encoding) -> tuple[Tensor, Tensor, Tensor]:
    """(rank, local index, plane) int64 [M] of every flagged token of every rank, from the gathered [C, size]
    bytes."""
    if encoding.kind == "bits":
        shifts = torch.arange(8, dtype=torch.uint8, device=gathered.device)
        flags = gathered[:, :, None].bitwise_right_shift(shifts).bitwise_and_(1).view(gathered.shape[0], -1)
        flags = flags[:, :encoding.planes * encoding.stride].view(gathered.shape[0], encoding.planes, encoding.stride)
        rank, plane, index = flags.nonzero().unbind(1)
        return rank, index, plane
    if encoding.kind == "indices":
        index = gathered.contiguous().view(torch.int32).long()
        rank, column = (index >= 0).nonzero().unbind(1)
        flat = index[rank, column]
        if encoding.planes == 1:
            return rank, flat, torch.zeros_like(flat)
        return rank, flat % encoding.stride, flat // encoding.stride
    empty = torch.zeros(0, dtype=torch.long, device=gathered.device)
    return empty, empty, empty


def positions(rank: Tensor, index: Tensor, length_table: Tensor, cp_size: int) -> tuple[Tensor, Tensor]:
    """Positions in the concatenated full masks of the tokens (rank r, local index j), and their sequences.

    ``length_table``: [B, 3] response, total and span lengths (the span is what the layout cuts into 2C chunks:
    the total length for thd, max_seq_len for bshd). Rank r's local tokens are, sequence by sequence, its two
    zigzag parts (miles_mis.parallel.cp_layout); a global local index g = (tokens of ranks < r) + j locates its (rank,
    sequence) row by one search over the running token count of all ranks' rows.
    """
    if rank.numel() == 0:
        return rank, rank
    table = length_table.long().to(rank.device)
    responses, totals, spans = table[:, :3].unbind(1)  # (a fourth column, the lags, may follow)
    ranks = torch.arange(cp_size, device=rank.device)[:, None]
    layout = zigzag_layout(totals, responses, ranks, cp_size, "bshd", spans)  # [C, B] fields: every rank at once
    lengths = (layout.len0 + layout.len1).view(-1)  # rows (rank, sequence), rank-major: local order of each rank
    ends = lengths.cumsum(0)
    num_seqs = responses.numel()
    rank_start = torch.cat([ends.new_zeros(1), ends[num_seqs - 1::num_seqs]])[:-1]  # tokens before rank r
    token = rank_start[rank] + index
    row = torch.searchsorted(ends, token, right=True)
    offset = token - (ends[row] - lengths[row])  # index inside the row's two parts
    len0 = layout.len0.reshape(-1)[row]
    in_response = torch.where(offset < len0, layout.start0.reshape(-1)[row] + offset,
                              layout.start1.reshape(-1)[row] + offset - len0)
    response_starts = responses.cumsum(0) - responses
    sequence = row % num_seqs
    return response_starts[sequence] + in_response, sequence
