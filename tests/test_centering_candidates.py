"""The engine's top-K candidates as a host passes them: packed in order, sharded like the log-probs, and every bad
input a one-line error naming the sequence, token and slot."""

import math

import pytest
import torch

from miles_mis.centering import Candidates, read_candidates
from miles_mis.inputs import InputError

NEG_INF = float("-inf")


def rows(*values):
    """[T, K] ids and log-probs from (id, probability) rows; None is an unused slot."""
    ids = [[UNUSED if slot is None else slot[0] for slot in row] for row in values]
    log_probs = [[NEG_INF if slot is None else math.log(slot[1]) for slot in row] for row in values]
    return torch.tensor(ids), torch.tensor(log_probs)


UNUSED = -1
A_IDS, A_LOG = rows([(5, 0.5), (2, 0.25), None], [(7, 0.9), None, None])  # sample 0: 2 tokens
B_IDS, B_LOG = rows([(1, 0.6), (3, 0.3), (4, 0.05)])  # sample 1: 1 token


def test_lists_are_packed_in_order_with_their_slots():
    out = read_candidates([A_IDS, B_IDS], [A_LOG, B_LOG], [2, 1])
    assert isinstance(out, Candidates) and out.width == 3
    assert out.ids.tolist() == [[5, 2, -1], [7, -1, -1], [1, 3, 4]]
    assert out.used.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert out.log_probs[0, :2].exp().tolist() == pytest.approx([0.5, 0.25])
    assert out.log_probs[1, 1].item() == NEG_INF


def test_a_flat_tensor_reads_as_the_list_does():
    listed = read_candidates([A_IDS, B_IDS], [A_LOG, B_LOG], [2, 1])
    flat = read_candidates(torch.cat([A_IDS, B_IDS]), torch.cat([A_LOG, B_LOG]), [2, 1])
    assert torch.equal(listed.ids, flat.ids) and torch.equal(listed.log_probs, flat.log_probs)


def test_a_rank_takes_its_own_rows():
    # local positions 2 and 0 of the full responses: sample 1's token, then sample 0's first
    out = read_candidates([A_IDS, B_IDS], [A_LOG, B_LOG], [2, 1], local_positions=torch.tensor([2, 0]))
    assert out.ids.tolist() == [[1, 3, 4], [5, 2, -1]]


def test_empty_responses_and_an_empty_batch():
    empty_ids, empty_log = torch.zeros((0, 3), dtype=torch.long), torch.zeros((0, 3))
    out = read_candidates([empty_ids, B_IDS], [empty_log, B_LOG], [0, 1])
    assert out.ids.tolist() == [[1, 3, 4]]
    assert read_candidates([], [], []).ids.numel() == 0


def bad(ids, log_probs, lengths=(2, 1)):
    with pytest.raises(InputError) as error:
        read_candidates(ids, log_probs, list(lengths))
    return str(error.value), error.value.sequence_index


def test_a_repeated_id_names_the_token():
    ids = B_IDS.clone()
    ids[0, 2] = 1
    message, index = bad([A_IDS, ids], [A_LOG, B_LOG])
    assert message.startswith("sequence 1, response token 0: rollout_topk_token_ids holds id 1 twice") and index == 1


@pytest.mark.parametrize("slot_id, log_prob, what", [
    (4, float("nan"), "id 4 with log-prob nan"),          # a used slot without a finite log-prob
    (4, NEG_INF, "id 4 with log-prob -inf"),
    (-1, -2.0, "id -1 with log-prob -2.0"),               # an unused slot with a value
    (-3, NEG_INF, "id -3 with log-prob -inf"),            # an id below the padding value
])
def test_a_bad_slot_names_sequence_token_and_slot(slot_id, log_prob, what):
    ids, log_probs = A_IDS.clone(), A_LOG.clone()
    ids[1, 1], log_probs[1, 1] = slot_id, log_prob
    message, index = bad([ids, B_IDS], [log_probs, B_LOG])
    assert message.startswith(f"sequence 0, response token 1, slot 1: {what}") and index == 0


def test_a_row_whose_mass_exceeds_one_is_refused():
    log_probs = B_LOG.clone()
    log_probs[0, 0] = math.log(0.7)  # 0.7 + 0.3 + 0.05 = 1.05
    message, index = bad([A_IDS, B_IDS], [A_LOG, log_probs])
    assert "sum to 1.05 > 1" in message and message.startswith("sequence 1, response token 0") and index == 1


def test_mass_within_the_engines_rounding_is_accepted():
    log_probs = B_LOG.clone()
    log_probs[0, 0] = math.log(0.6505)  # 1.0005 ≤ 1 + 1e-3
    assert read_candidates([A_IDS, B_IDS], [A_LOG, log_probs], [2, 1]).width == 3


@pytest.mark.parametrize("ids, log_probs, lengths, start", [
    ([A_IDS, B_IDS], None, (2, 1), "rollout_topk_token_ids is given without rollout_topk_log_probs"),
    ([A_IDS], [A_LOG], (2, 1), "rollout_topk_token_ids has 1 sequences but the batch has 2"),
    ([A_IDS, B_IDS], [A_LOG, B_LOG], (2, 2), "sequence 1: rollout_topk_token_ids[1] has shape (1, 3): expected (2, K)"),
    ([A_IDS.float(), B_IDS], [A_LOG, B_LOG], (2, 1), "sequence 0: rollout_topk_token_ids[0] has dtype torch.float32"),
    ([A_IDS, B_IDS], [A_LOG, B_LOG.long()], (2, 1), "sequence 1: rollout_topk_log_probs[1] has dtype torch.int64"),
    ([A_IDS, B_IDS[:, :2]], [A_LOG, B_LOG[:, :2]], (2, 1), "sequence 1: rollout_topk_token_ids[1] has 2 slots"),
    ([A_IDS, B_IDS], [A_LOG[:, :2], B_LOG[:, :2]], (2, 1), "rollout_topk_token_ids has 3 slots per token but"),
    ("ids", [A_LOG, B_LOG], (2, 1), "rollout_topk_token_ids is a str"),
])
def test_malformed_inputs_are_one_line_errors(ids, log_probs, lengths, start):
    message, _ = bad(ids, log_probs, lengths)
    assert message.startswith(start) and "\n" not in message
