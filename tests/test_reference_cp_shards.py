"""The reference host's own reading of Megatron's zigzag CP layout (miles_mis.reference_host.cp_shards): hand-worked
cases from Megatron's rule, its invariants, and agreement with the plugin's reading (miles_mis.parallel.cp_layout)
for every rank at CP 2, 3 and 4, exhaustively over small lengths and on random batches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis.parallel.cp_layout import zigzag_layout
from miles_mis.reference_host.cp_shards import chunk_length, chunks_of_rank, rank_shards, sequence_shard


def plugin_shards(totals, responses, rank, cp, fmt="thd", spans=None):
    """The plugin's reading, in the reference's shape: (local lengths, indices into the concatenated responses)."""
    layout = zigzag_layout(torch.tensor(totals, dtype=torch.long), torch.tensor(responses, dtype=torch.long), rank,
                           cp, fmt, None if spans is None else torch.tensor(spans, dtype=torch.long))
    starts = torch.tensor([0] + list(responses), dtype=torch.long).cumsum(0)[:-1]
    return layout.local_lengths.tolist(), layout.positions(starts).tolist()


# ---- Megatron's rule, worked by hand -----------------------------------------------------------------------------

def test_chunks_of_rank_zigzag():
    # 2C chunks, rank r keeps r and 2C-1-r: CP 2 -> (0, 3), (1, 2); CP 4 -> (0, 7) (1, 6) (2, 5) (3, 4)
    assert [chunks_of_rank(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunks_of_rank(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunks_of_rank(0, 1) == (0, 1)


def test_chunk_length_rounds_up():
    # ceil(S / 2C): 16 / 4 = 4; 17 / 8 -> 3 (padded to 24); 14 / 6 -> 3; 1 / 8 -> 1
    assert [chunk_length(16, 2), chunk_length(17, 4), chunk_length(14, 3), chunk_length(1, 4)] == [4, 3, 3, 1]


def test_hand_worked_thd_cp3():
    # total 14, response 9, prompt 5; c = ceil(14/6) = 3: chunks [0,3) [3,6) [6,9) [9,12) [12,15) [15,18).
    # The response's log-probs are at logit positions [4, 13), offset p - 4.
    # rank 0 (chunks 0, 5): nothing; rank 1 (chunks 1, 4): [4,6) -> 0, 1 then [12,13) -> 8;
    # rank 2 (chunks 2, 3): [6,9) -> 2, 3, 4 then [9,12) -> 5, 6, 7.
    assert [sequence_shard(14, 9, r, 3) for r in range(3)] == [[], [0, 1, 8], [2, 3, 4, 5, 6, 7]]


def test_hand_worked_padding_cp4():
    # total 17 (not a multiple of 8), response 16, prompt 1: c = ceil(17/8) = 3, the sequence padded to 24.
    # Log-probs at logit positions [0, 16), offset = p. Chunk k is [3k, 3k+3); rank r keeps chunks r and 7-r.
    # rank 0: [0,3) and chunk 7 [21,24) (all padding); rank 1: [3,6) and chunk 6 [18,21) (padding);
    # rank 2: [6,9) and chunk 5 [15,18) -> 15 only; rank 3: [9,12) and chunk 4 [12,15).
    assert [sequence_shard(17, 16, r, 4) for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8, 15], [9, 10, 11, 12, 13, 14]]


def test_hand_worked_bshd_chunks_follow_max_seq_len():
    # total 7, response 5, prompt 2: log-probs at logit positions [1, 6), offset p - 1.
    # thd: c = ceil(7/4) = 2, chunks [0,2) [2,4) [4,6) [6,8): rank 0 -> [1,2) = 0; rank 1 -> [2,4) [4,6) = 1..4.
    # bshd, max_seq_len 12: c = 3, chunks [0,3) [3,6) [6,9) [9,12): rank 0 -> [1,3) = 0, 1; rank 1 -> [3,6) = 2..4.
    assert [sequence_shard(7, 5, r, 2, "thd") for r in range(2)] == [[0], [1, 2, 3, 4]]
    assert [sequence_shard(7, 5, r, 2, "bshd", 12) for r in range(2)] == [[0, 1], [2, 3, 4]]
    # bshd with max_seq_len = total is thd
    assert [sequence_shard(7, 5, r, 2, "bshd", 7) for r in range(2)] == [[0], [1, 2, 3, 4]]


def test_hand_worked_short_responses():
    # response 1 of total 10 (prompt 9): its one log-prob is at logit position 8; c = ceil(10/4) = 3, so chunk 2
    # [6,9), held by rank 1 (chunks 1, 2)
    assert [sequence_shard(10, 1, r, 2) for r in range(2)] == [[], [0]]
    # at CP 3, c = ceil(10/6) = 2: position 8 is in chunk 4, held by rank 1 (chunks 1, 4)
    assert [sequence_shard(10, 1, r, 3) for r in range(3)] == [[], [0], []]
    # an empty response is held by nobody; CP 1 holds everything
    assert [sequence_shard(10, 0, r, 4) for r in range(4)] == [[], [], [], []]
    assert sequence_shard(10, 4, 0, 1) == [0, 1, 2, 3]


def test_hand_worked_batch_indices_run_through_the_concatenation():
    # sequence 0: total 10, response 1 (rank 1 holds offset 0); sequence 1: total 7, response 5 (rank 1 holds
    # offsets 1..4, see above), starting at index 1 of the concatenated responses -> indices 2..5
    assert rank_shards([10, 7], [1, 5], 1, 2) == ([1, 4], [0, 2, 3, 4, 5])
    assert rank_shards([10, 7], [1, 5], 0, 2) == ([0, 1], [1])
    assert rank_shards([10, 7], [1, 5], 0, 2, "bshd", [12, 12]) == ([0, 2], [1, 2])
    assert rank_shards([], [], 0, 2) == ([], [])


@pytest.mark.parametrize("call, message", [
    (lambda: sequence_shard(5, 5, 0, 2), "at least one prompt token"),
    (lambda: sequence_shard(5, -1, 0, 2), "response length >= 0"),
    (lambda: sequence_shard(5, 2, 0, 2, "sbhd"), "qkv_format='sbhd' is invalid: allowed values are thd, bshd"),
    (lambda: sequence_shard(5, 2, 0, 2, "bshd"), "max_seq_lens is required"),
    (lambda: sequence_shard(9, 2, 0, 2, "bshd", 8), "max_seq_len 8 is shorter than the sequence's total length 9"),
    (lambda: sequence_shard(5, 2, 2, 2), r"cp_rank=2 is invalid: allowed values are 0 \.\. 1"),
    (lambda: sequence_shard(5, 2, 0, 0), "cp_size=0 is invalid"),
    (lambda: rank_shards([5, 4], [2, 4], 0, 2), "^sequence 1: total length 4 with response length 4"),
    (lambda: rank_shards([5], [2], 0, 2, "bshd"), "max_seq_lens is required"),
    (lambda: rank_shards([], [], 0, 2, "xyz"), "^qkv_format='xyz' is invalid: allowed values are thd, bshd"),
    (lambda: rank_shards([], [], 3, 2), "^cp_rank=3 is invalid"),
    (lambda: rank_shards([5], [2, 1], 0, 2), "1 total lengths but 2 response lengths"),
])
def test_refuses_what_megatron_cannot_lay_out(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- invariants of the reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ranks_partition_every_response_and_follow_the_chunks(cp):
    """Every response offset is held by exactly one rank, and by the rank whose chunks hold its logit position."""
    for total in range(1, 4 * 2 * cp + 2):
        for response in range(total):
            for span in (total, total + 1, total + 2 * cp + 1):
                fmt = "thd" if span == total else "bshd"
                c = chunk_length(span, cp)
                owner = {}
                for rank in range(cp):
                    shard = sequence_shard(total, response, rank, cp, fmt, span)
                    assert shard == sorted(shard)  # chunk r comes before chunk 2C-1-r, and r < 2C-1-r
                    for offset in shard:
                        assert offset not in owner
                        owner[offset] = rank
                assert sorted(owner) == list(range(response))
                prompt = total - response
                for offset, rank in owner.items():
                    assert (prompt - 1 + offset) // c in chunks_of_rank(rank, cp)


# ---- agreement with the plugin's reading (parallel.cp_layout) --------------------------------------------------

@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_agrees_with_the_plugin_exhaustively(cp, fmt):
    """Every (total, response) with total up to 5·2C+1 and a prompt of at least one token, for every rank, with
    bshd spans from total to total + 2C + 1 (multiples of 2C and not); one batch per rank and span padding, so the
    indices into the concatenation are compared too."""
    pairs = [(t, r) for t in range(1, 5 * 2 * cp + 2) for r in range(t)]
    totals = [t for t, _ in pairs]
    responses = [r for _, r in pairs]
    paddings = range(2 * cp + 2) if fmt == "bshd" else [None]
    for padding in paddings:
        spans = None if padding is None else [t + padding for t in totals]
        for rank in range(cp):
            ours = rank_shards(totals, responses, rank, cp, fmt, spans)
            assert ours == plugin_shards(totals, responses, rank, cp, fmt, spans), (cp, fmt, padding, rank)


@settings(max_examples=300, deadline=None)
@given(cp=st.sampled_from([2, 3, 4]), fmt=st.sampled_from(["thd", "bshd"]),
       sequences=st.lists(st.tuples(st.integers(1, 300), st.sampled_from([0, 1, 2, None]), st.integers(0, 40),
                                    st.integers(0, 300)), max_size=8))
def test_agrees_with_the_plugin_on_random_batches(cp, fmt, sequences):
    """Batches of up to 8 sequences: prompts of 1..300 tokens, responses of 0, 1, 2 or up to 300 tokens, bshd spans
    up to 40 past the total."""
    totals, responses, spans = [], [], []
    for prompt, short, extra, long in sequences:
        response = long if short is None else short
        totals.append(prompt + response)
        responses.append(response)
        spans.append(prompt + response + extra)
    spans = spans if fmt == "bshd" else None
    held = []
    for rank in range(cp):
        ours = rank_shards(totals, responses, rank, cp, fmt, spans)
        assert ours == plugin_shards(totals, responses, rank, cp, fmt, spans)
        held += ours[1]
    assert sorted(held) == list(range(sum(responses)))
