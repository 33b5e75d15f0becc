"""The zigzag CP layout against hand-worked cases and a per-sequence reference written from the contract."""

import random

import pytest
import torch

from cp_harness import local_positions as reference_positions

from miles_mis.parallel.cp_layout import ranges, zigzag_layout


def layout_positions(totals, responses, rank, cp, fmt="thd", spans=None):
    layout = zigzag_layout(torch.tensor(totals), torch.tensor(responses), rank, cp, fmt,
                           None if spans is None else torch.tensor(spans))
    offsets = torch.cumsum(torch.tensor([0] + list(responses[:-1])), 0)
    return layout.local_lengths.tolist(), layout.positions(offsets).tolist()


def test_hand_worked_thd_cp2():
    # total 10, response 4 (prompt 6): chunk = ceil(10/4) = 3; chunks [0,3) [3,6) [6,9) [9,12).
    # Response log-prob positions are [5, 9). Rank 0 holds chunks 0 and 3: nothing of the response.
    # Rank 1 holds chunks 1 and 2: [5,6) then [6,9) -> response offsets 0 | 1, 2, 3.
    assert layout_positions([10], [4], 0, 2) == ([0], [])
    assert layout_positions([10], [4], 1, 2) == ([4], [0, 1, 2, 3])


def test_hand_worked_prompt_boundary_inside_a_chunk_cp2():
    # total 16, response 12 (prompt 4): chunk 4; chunks [0,4) [4,8) [8,12) [12,16); response positions [3, 15).
    # Rank 0: chunk 0 -> [3,4) = offset 0; chunk 3 -> [12,15) = offsets 9..11.
    # Rank 1: chunk 1 -> [4,8) = offsets 1..4; chunk 2 -> [8,12) = offsets 5..8.
    assert layout_positions([16], [12], 0, 2) == ([4], [0, 9, 10, 11])
    assert layout_positions([16], [12], 1, 2) == ([8], [1, 2, 3, 4, 5, 6, 7, 8])


def test_hand_worked_bshd_uses_max_seq_len():
    # total 10, response 4 -> positions [5, 9); max_seq_len 16 with cp 2: chunk 4, chunks [0,4) [4,8) [8,12) [12,16)
    # Rank 0 (chunks 0, 3): nothing. Rank 1 (chunks 1, 2): [5,8) -> 0..2, [8,9) -> 3.
    assert layout_positions([10], [4], 0, 2, "bshd", [16]) == ([0], [])
    assert layout_positions([10], [4], 1, 2, "bshd", [16]) == ([4], [0, 1, 2, 3])


def test_multiple_sequences_offset_into_the_concatenation():
    # sequence 0 as above (4 tokens, all on rank 1), sequence 1: total 6, response 2 -> positions [3,5);
    # chunk ceil(6/4) = 2: chunks [0,2) [2,4) [4,6) [6,8); rank 1 holds [2,4) -> [3,4) and [4,6) -> [4,5).
    lengths, positions = layout_positions([10, 6], [4, 2], 1, 2)
    assert lengths == [4, 2] and positions == [0, 1, 2, 3, 4, 5]
    lengths, positions = layout_positions([10, 6], [4, 2], 0, 2)
    assert lengths == [0, 0] and positions == []


def test_zero_length_response_and_cp1():
    assert layout_positions([5, 7], [0, 3], 0, 1) == ([0, 3], [0, 1, 2])
    for rank in range(3):
        assert layout_positions([5], [0], rank, 3)[0] == [0]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_matches_reference_and_partitions_every_response(cp, fmt):
    rng = random.Random(cp)
    for _ in range(20):
        num = rng.randint(1, 6)
        responses = [rng.choice([0, 1, 2, rng.randint(0, 60)]) for _ in range(num)]
        totals = [r + rng.randint(1, 40) for r in responses]
        spans = [t + rng.randint(0, 30) for t in totals]
        owned = [[] for _ in range(num)]
        for rank in range(cp):
            lengths, positions = layout_positions(totals, responses, rank, cp, fmt, spans if fmt == "bshd" else None)
            expected = []
            offset = 0
            for i in range(num):
                ref = reference_positions(totals[i], responses[i], rank, cp, spans[i] if fmt == "bshd" else totals[i])
                assert lengths[i] == len(ref)
                expected += [offset + p for p in ref]
                owned[i] += ref
                offset += responses[i]
            assert positions == expected
        for i in range(num):  # every response position is held by exactly one rank
            assert sorted(owned[i]) == list(range(responses[i]))


def test_ranges():
    assert ranges(torch.tensor([5, 0, 2]), torch.tensor([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]
    assert ranges(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)).tolist() == []


def test_bshd_without_max_seq_lens_and_bad_format():
    with pytest.raises(ValueError, match="max_seq_lens is required"):
        zigzag_layout(torch.tensor([4]), torch.tensor([2]), 0, 2, "bshd")
    with pytest.raises(ValueError, match="qkv_format='sbhd'.*thd, bshd"):
        zigzag_layout(torch.tensor([4]), torch.tensor([2]), 0, 2, "sbhd")
