"""PackedBatch's segment operations against a slow per-sequence Python reference: ragged lengths with empty
sequences, B = 0, N = 0, given positions (CP shards), non-finite values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis.tensors.packed_batch import PackedBatch

EMPTY_MAX, EMPTY_MIN = -1.0, 3.0e38
EDGES = (0, 1, 16, 128, 1024, 8192)  # miles_mis.correction.mismatch_location.POSITION_EDGES


def build(lengths, seed=0, positions=None):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    train = -torch.rand(n, generator=gen) * 3.0
    rollout = train + 0.1 * torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.2).float()
    return PackedBatch.from_flat(train, rollout, mask, torch.tensor(lengths, dtype=torch.long), positions=positions)


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def reference_sum(values, lengths):
    return [math.fsum(values[a:b].double().tolist()) for a, b in spans(lengths)]


def reference_extreme(values, lengths, reduce, empty):
    pick = max if reduce == "amax" else min
    out = []
    for a, b in spans(lengths):
        seq = values[a:b].tolist()
        if any(math.isnan(x) for x in seq):
            out.append(math.nan)
        else:
            out.append(pick([empty] + seq))  # the empty value takes part, as scatter_reduce's include_self
    return out


def reference_bucket_sum(values, positions, edges):
    out = [0.0] * len(edges)
    for value, position in zip(values.double().tolist(), positions.tolist()):
        out[max(k for k, edge in enumerate(edges) if position >= edge)] += value
    return out


def check_bucket_sums(batch, values):
    for edges in (EDGES, (0, 3), (0,), (0, 2, 5, 7)):
        got = batch.per_bucket_sum(values, edges)
        assert got.shape == (len(edges),) and got.dtype == torch.float64  # accumulated in float64
        want = torch.tensor(reference_bucket_sum(values, batch.positions, edges), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert got.tolist() == [0.0 if w == 0 else g for g, w in zip(got.tolist(), want.tolist())]  # empty: exact 0


def check_batch(batch, lengths, seed=0):
    n, b = sum(lengths), len(lengths)
    assert batch.num_seqs == b
    assert batch.seq_lengths.dtype == torch.long and batch.seq_lengths.tolist() == list(lengths)
    assert batch.seq_index.dtype == torch.long and batch.seq_index.shape == (n,)
    assert batch.seq_index.tolist() == [i for i, k in enumerate(lengths) for _ in range(k)]
    assert batch.positions.dtype == torch.long
    assert batch.positions.tolist() == [p for k in lengths for p in range(k)]
    gen = torch.Generator().manual_seed(seed + 1)
    values = torch.randn(n, generator=gen) * 10
    got = batch.per_seq_sum(values)
    assert got.shape == (b,) and got.dtype == torch.float64  # accumulated in float64
    torch.testing.assert_close(got, torch.tensor(reference_sum(values, lengths), dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    for reduce, empty in (("amax", EMPTY_MAX), ("amin", EMPTY_MIN), ("amax", -3.0e38)):
        got = batch.per_seq_extreme(values, reduce, empty)
        assert got.shape == (b,) and got.dtype == torch.float32
        want = torch.tensor(reference_extreme(values, lengths, reduce, empty), dtype=torch.float32)
        assert torch.equal(got, want), (reduce, got, want)
    table = torch.randn(b, 5, generator=gen)
    spread = batch.broadcast(table)
    assert spread.shape == (n, 5)
    want = torch.stack([table[i] for i, k in enumerate(lengths) for _ in range(k)]) if n else torch.zeros(0, 5)
    assert torch.equal(spread, want)
    check_bucket_sums(batch, values)


def test_hand_case_with_empty_sequences():
    lengths = [0, 3, 0, 0, 1, 4, 0]
    batch = build(lengths)
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert batch.seq_index.tolist() == [1, 1, 1, 4, 5, 5, 5, 5]
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 5.0, 0.5, 2.0])
    assert batch.per_seq_sum(values).tolist() == [0.0, 6.0, 0.0, 0.0, 10.0, 6.5, 0.0]
    assert batch.per_seq_extreme(values, "amax", -7.0).tolist() == [-7.0, 3.0, -7.0, -7.0, 10.0, 5.0, -7.0]
    assert batch.per_seq_extreme(values, "amin", 9.0).tolist() == [9.0, 1.0, 9.0, 9.0, 9.0, -1.0, 9.0]
    check_batch(batch, lengths)


def test_no_sequence_and_no_token():
    for lengths in ([], [0], [0, 0, 0]):
        check_batch(build(lengths), lengths)


def test_non_finite_values_propagate_as_scatter_reduce():
    lengths = [2, 3, 0, 2]
    batch = build(lengths)
    values = torch.tensor([1.0, float("nan"), 2.0, float("inf"), -1.0, float("-inf"), 4.0])
    out_max = batch.per_seq_extreme(values, "amax", -1.0)
    out_min = batch.per_seq_extreme(values, "amin", 3e38)
    assert math.isnan(out_max[0]) and math.isnan(out_min[0])
    assert out_max[1:].tolist() == [math.inf, -1.0, 4.0]
    assert torch.equal(out_min[1:], torch.tensor([-1.0, 3e38, -math.inf]))
    assert math.isnan(batch.per_seq_sum(values)[0]) and batch.per_seq_sum(values)[2] == 0.0


def test_given_positions_are_kept():
    lengths = [3, 0, 2]
    positions = torch.tensor([5, 6, 9, 0, 4])  # a CP shard: response positions from the zigzag layout
    batch = build(lengths, positions=positions)
    assert batch.positions.tolist() == positions.tolist() and batch.positions.dtype == torch.long
    check_bucket_sums(batch, torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0]))
    assert batch.per_bucket_sum(torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0]), (0, 1, 5, 9)).tolist() == [8.0, 16.0, 3.0,
                                                                                                      4.0]


def test_bucket_edges_are_checked():
    batch = build([2, 3])
    for edges in ((), (1, 4), (0, 4, 4), (0, 5, 2)):
        with pytest.raises(ValueError, match="increasing, starting at 0"):
            batch.per_bucket_sum(torch.ones(5), edges)


def test_int64_indices_beyond_int32(monkeypatch):
    from miles_mis.tensors import packed_batch

    monkeypatch.setattr(packed_batch, "_INT32_MAX", 6)  # as if N > 2^31 - 1: the CSR takes int64 indices
    lengths = [3, 0, 5, 1]
    batch = build(lengths)
    assert batch.segment_matrix.col_indices().dtype == torch.long
    check_batch(batch, lengths)


def test_long_and_short_sequences_together():
    lengths = [9000, 1, 0, 3, 70, 0, 1]  # a long one among short ones (no padded [B, max length] blow-up)
    check_batch(build(lengths, seed=3), lengths, seed=3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), max_size=30), st.integers(min_value=0, max_value=2**16))
def test_segment_ops_match_the_per_sequence_reference(lengths, seed):
    check_batch(build(lengths, seed), lengths, seed)


def test_sparse_beta_warning_never_reaches_the_user():
    """torch warns once per process that sparse CSR is beta: the first matrix built silences it, the later
    ones (built without the warnings context) must not bring it back. A fresh process, warnings as errors."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from miles_mis.tensors.packed_batch import PackedBatch\n"
            "for n in (3, 5):\n"
            "    b = PackedBatch.from_flat(torch.zeros(n), torch.zeros(n), torch.ones(n), torch.tensor([1, n - 1]))\n"
            "    assert b.per_seq_sum(torch.ones(n)).tolist() == [1.0, n - 1.0]\n"
            "    assert b.per_bucket_sum(torch.ones(n), (0, 1, 4)).tolist() == [2.0, min(n - 2, 3), max(n - 5, 0)]\n"
            "    assert b.positions.tolist() == [0] + list(range(n - 1))\n")
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
