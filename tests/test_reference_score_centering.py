"""The reference host's score-centering loss (miles_mis.reference_host.score_centering), an oracle of miles'
``--loss-type score_centering``: hand-worked cases for none, tis and mis (V = 4, K = 2); the q-weighted expectation
of a constant advantage's gradient is zero with every token a candidate; thd and bshd agree; unused slots and
masked tokens add nothing; the sampled token outside and inside H; support mode, the regularisers, the temperature,
the padded vocabulary, NaN and the refused settings."""

import math
from types import SimpleNamespace

import pytest
import torch

from miles_mis.reference_host import score_centering_loss
from miles_mis.reference_host.score_centering import MODES, low_var_kl, score_token

F64 = torch.float64
NEG_INF = -math.inf


def make_args(mode="none", **overrides):
    values = dict(score_centering_is=mode, score_centering_tis_clip=2.0, score_centering_mis_low=0.5,
                  score_centering_mis_high=5.0, rollout_temperature=1.0, qkv_format="thd", entropy_coef=0.0,
                  use_kl_loss=False)
    values.update(overrides)
    return SimpleNamespace(**values)


def reducer(batch):
    """miles' sum_of_sample_mean at CP 1 (context_parallel.py): the sum over samples of sum(x m) / max(sum(m), 1)."""
    masks = [torch.as_tensor(m, dtype=F64) for m in batch["loss_masks"]]
    lengths = [int(n) for n in batch["response_lengths"]]

    def reduce(x):
        return sum((xi * m).sum() / m.sum().clamp_min(1.0) for xi, m in zip(x.split(lengths), masks))
    return reduce


def run(args, batch, logits):
    return score_centering_loss(args, batch, logits, reducer(batch))


# ---- the hand-worked case ---------------------------------------------------------------------------------------
# V = 4, K = 2, one sample: prompt [3, 1], response [y]; the logit row 1 scores y (rows 0 and 2 score nothing).
# Row 1 = log(0.4, 0.3, 0.2, 0.1), T = 1: p = (0.4, 0.3, 0.2, 0.1). H = {0, 1} with q_0 = 0.5, q_1 = 0.1;
# y = 2 (not a candidate) with q_y = 0.3; A = 2.
# P = 0.7, Q = 0.6, rho = (1 - 0.6) / (1 - 0.7) = 4/3.
# The gradient on row 1: d loss / dz_v = -A (w (d_vy - p_v) - sum_H c_h (d_vh - p_v)) = -A (w d_vy - c_v - (w - C) p_v)
# with C = sum_H c_h.

P = (0.4, 0.3, 0.2, 0.1)


def hand_batch(sampled=2, rollout_q=0.3):
    return {"unconcat_tokens": [torch.tensor([3, 1, sampled])], "total_lengths": [3], "response_lengths": [1],
            "loss_masks": [torch.tensor([1.0])], "advantages": [torch.tensor([2.0], dtype=F64)],
            "rollout_log_probs": [torch.tensor([math.log(rollout_q)], dtype=F64)],
            "rollout_topk_token_ids": [torch.tensor([[0, 1]])],
            "rollout_topk_log_probs": [torch.tensor([[math.log(0.5), math.log(0.1)]], dtype=F64)]}


def hand_logits():
    rows = torch.tensor([[0.3, -1.0, 2.0, 0.5], [math.log(x) for x in P], [1.0, 1.0, -2.0, 0.0]], dtype=F64)
    return rows.unsqueeze(0).requires_grad_()


def check_hand(args, expected_loss, expected, grad_row):
    logits = hand_logits()
    loss, log = run(args, hand_batch(), logits)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    for name, value in expected.items():
        assert log[name].item() == pytest.approx(value, abs=1e-12), name
    assert log["pg_loss"].item() == log["loss"].item() == pytest.approx(expected_loss, abs=1e-12)
    assert log["sc_train_head_mass"].item() == pytest.approx(0.7, abs=1e-12)
    assert log["sc_rollout_head_mass"].item() == pytest.approx(0.6, abs=1e-12)
    assert log["sc_tail_ratio"].item() == pytest.approx(4 / 3, abs=1e-12)
    # |log p_y - log q_y| = log(0.3 / 0.2); low_var_kl with r = p_y / q_y = 2/3: r - 1 - log r
    assert log["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(1.5), abs=1e-12)
    assert log["train_rollout_kl"].item() == pytest.approx(2 / 3 - 1 - math.log(2 / 3), abs=1e-12)
    assert list(log) == ["sc_correction", "sc_train_head_mass", "sc_rollout_head_mass", "sc_tail_ratio",
                         "sc_importance_weight", "loss", "pg_loss", "train_rollout_logprob_abs_diff",
                         "train_rollout_kl"]
    torch.testing.assert_close(logits.grad[0, 1], torch.tensor(grad_row, dtype=F64), rtol=0, atol=1e-12)
    assert not logits.grad[0, 0].any() and not logits.grad[0, 2].any()  # rows that score no response token


def test_hand_worked_none():
    # f = 1: alpha = rho = 4/3; c_0 = 0.5 - 4/3 * 0.4 = -1/30, c_1 = 0.1 - 4/3 * 0.3 = -0.3 (C = -1/3); w = 1.
    # correction = -1/30 log 0.4 - 0.3 log 0.3; loss = -2 (log 0.2 - correction)
    correction = -math.log(0.4) / 30 - 0.3 * math.log(0.3)
    # w - C = 4/3: v0: -2 (1/30 - 4/3 * 0.4) = 1; v1: -2 (0.3 - 0.4) = 0.2; v2: -2 (1 - 4/15) = -22/15;
    # v3: -2 (-4/3 * 0.1) = 4/15
    check_hand(make_args("none"), -2 * (math.log(0.2) - correction),
               {"sc_correction": correction, "sc_importance_weight": 1.0}, [1.0, 0.2, -22 / 15, 4 / 15])


def test_hand_worked_tis():
    # f(r) = min(r, 2): alpha = 4/3 * min(3/4, 2) = 1; c_0 = 0.5 * min(0.8, 2) - 0.4 = 0;
    # c_1 = 0.1 * min(3, 2) - 0.3 = -0.1 (clipped; C = -0.1); w = min(0.2 / 0.3, 2) = 2/3.
    # loss = -2 (2/3 log 0.2 + 0.1 log 0.3)
    # w - C = 23/30: v0: -2 (-23/30 * 0.4) = 46/75; v1: -2 (0.1 - 23/30 * 0.3) = 0.26;
    # v2: -2 (2/3 - 23/30 * 0.2) = -77/75; v3: -2 (-23/30 * 0.1) = 23/150
    check_hand(make_args("tis", score_centering_tis_clip=2.0),
               -2 * (2 / 3 * math.log(0.2) + 0.1 * math.log(0.3)),
               {"sc_correction": -0.1 * math.log(0.3), "sc_importance_weight": 2 / 3},
               [46 / 75, 0.26, -77 / 75, 23 / 150])


def test_hand_worked_mis():
    # f(r) = r on [0.5, 2.5], else 0: alpha = 4/3 * f(3/4) = 1; c_0 = 0.5 * f(0.8) - 0.4 = 0;
    # c_1 = 0.1 * f(3) - 0.3 = -0.3 (3 > 2.5 is masked; C = -0.3); w = f(2/3) = 2/3.
    # loss = -2 (2/3 log 0.2 + 0.3 log 0.3)
    # w - C = 29/30: v0: -2 (-29/30 * 0.4) = 58/75; v1: -2 (0.3 - 29/30 * 0.3) = -0.02;
    # v2: -2 (2/3 - 29/30 * 0.2) = -71/75; v3: -2 (-29/30 * 0.1) = 29/150
    check_hand(make_args("mis", score_centering_mis_low=0.5, score_centering_mis_high=2.5),
               -2 * (2 / 3 * math.log(0.2) + 0.3 * math.log(0.3)),
               {"sc_correction": -0.3 * math.log(0.3), "sc_importance_weight": 2 / 3},
               [58 / 75, -0.02, -71 / 75, 29 / 150])


def test_hand_worked_mis_masks_the_sampled_weight():
    # low = 0.7: w = f(2/3) = 0, so the sampled term drops out; 1/rho = 3/4 is inside, alpha = 1; c_0 = 0.4 - 0.4 = 0;
    # c_1 = -0.3. loss = -2 (0 + 0.3 log 0.3); w - C = 0.3: v0: -2 (-0.3 * 0.4) = 0.24; v1: -2 (0.3 - 0.09) = -0.42;
    # v2: -2 (-0.3 * 0.2) = 0.12; v3: -2 (-0.3 * 0.1) = 0.06
    check_hand(make_args("mis", score_centering_mis_low=0.7, score_centering_mis_high=2.5),
               -2 * 0.3 * math.log(0.3), {"sc_correction": -0.3 * math.log(0.3), "sc_importance_weight": 0.0},
               [0.24, -0.42, 0.12, 0.06])


def test_sampled_token_inside_h_is_scored_twice():
    # y = 0 is also a candidate (q_y = q_0 = 0.5): its log p appears in the sampled term and in H.
    # none: c = (-1/30, -0.3) as above; loss = -2 (log 0.4 + 1/30 log 0.4 + 0.3 log 0.3)
    loss, log = run(make_args("none"), hand_batch(sampled=0, rollout_q=0.5), hand_logits())
    assert loss.item() == pytest.approx(-2 * (math.log(0.4) * 31 / 30 + 0.3 * math.log(0.3)), abs=1e-12)
    assert log["sc_rollout_head_mass"].item() == pytest.approx(0.6, abs=1e-12)


def test_a_zero_rollout_probability_candidate_keeps_its_tail_term():
    # q_1 = 0 (log q = -inf): q_1 f(p_1 / q_1) = 0 in every mode, c_1 = -alpha p_1. Q = 0.5, rho = 0.5 / 0.3 = 5/3.
    batch = hand_batch()
    batch["rollout_topk_log_probs"] = [torch.tensor([[math.log(0.5), NEG_INF]], dtype=F64)]
    for mode, alpha, c0 in [("none", 5 / 3, 0.5 - 5 / 3 * 0.4), ("tis", 1.0, 0.0)]:
        _, log = run(make_args(mode), batch, hand_logits())
        assert log["sc_tail_ratio"].item() == pytest.approx(5 / 3, abs=1e-12)
        expected = c0 * math.log(0.4) - alpha * 0.3 * math.log(0.3)
        assert log["sc_correction"].item() == pytest.approx(expected, abs=1e-12), mode


# ---- the q-weighted expectation of a constant advantage's gradient ----------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_constant_advantage_gradient_has_zero_q_expectation(mode):
    """K = V (H is the whole vocabulary), q = p * perturbation renormalised: sum_y q_y grad loss(y) = 0."""
    gen = torch.Generator().manual_seed(11)
    vocab, temperature, advantage = 7, 0.7, 1.3
    base = torch.randn(vocab, generator=gen, dtype=F64) * 1.5
    p = torch.softmax(base / temperature, 0)
    q = p * torch.exp(torch.randn(vocab, generator=gen, dtype=F64))
    q = q / q.sum()
    ratio = p / q
    args = make_args(mode, rollout_temperature=temperature, score_centering_tis_clip=1.5,
                     score_centering_mis_low=0.8, score_centering_mis_high=1.5)
    assert (ratio > 1.5).any() and (ratio < 0.8).any() and ((ratio >= 0.8) & (ratio <= 1.5)).any()

    expected_grad = torch.zeros(vocab, dtype=F64)
    for y in range(vocab):
        logits = torch.stack([base, torch.zeros(vocab, dtype=F64)]).unsqueeze(0).requires_grad_()
        batch = {"unconcat_tokens": [torch.tensor([0, y])], "total_lengths": [2], "response_lengths": [1],
                 "loss_masks": [torch.tensor([1.0])], "advantages": [torch.tensor([advantage], dtype=F64)],
                 "rollout_log_probs": [q[y].log().reshape(1)],
                 "rollout_topk_token_ids": [torch.arange(vocab).reshape(1, vocab)],
                 "rollout_topk_log_probs": [q.log().reshape(1, vocab)]}
        loss, _ = run(args, batch, logits)
        loss.backward()
        expected_grad += q[y] * logits.grad[0, 0]
    torch.testing.assert_close(expected_grad, torch.zeros(vocab, dtype=F64), rtol=0, atol=1e-13)

    # the test can fail: without the centering term the same expectation is far from zero
    f = {"none": torch.ones_like(ratio), "tis": ratio.clamp(max=1.5),
         "mis": torch.where((ratio >= 0.8) & (ratio <= 1.5), ratio, torch.zeros_like(ratio))}[mode]
    uncentered = -advantage * (q * f - (q * f).sum() * p) / temperature  # sum_y q_y grad(-A f_y log p_y)
    assert uncentered.abs().max() > 1e-2


# ---- layouts, padding slots and masks ---------------------------------------------------------------------------

def random_batch(seed, totals, responses, vocab, width, masks=None, advantages=None):
    """A batch as miles hands it: sampled tokens drawn from a random q, K candidates (the top of q, some slots
    unused), and thd logits [1, sum totals, V]."""
    gen = torch.Generator().manual_seed(seed)
    batch = {key: [] for key in ("unconcat_tokens", "loss_masks", "advantages", "rollout_log_probs",
                                 "rollout_topk_token_ids", "rollout_topk_log_probs")}
    batch["total_lengths"], batch["response_lengths"] = list(totals), list(responses)
    for i, (total, response) in enumerate(zip(totals, responses)):
        prompt = torch.randint(0, vocab, (total - response,), generator=gen)
        sampled, rollout, ids, head = [], [], [], []
        for _ in range(response):
            q = torch.softmax(torch.randn(vocab, generator=gen, dtype=F64) * 2.0, 0)
            y = int(torch.multinomial(q, 1, generator=gen))
            used = int(torch.randint(1, width + 1, (1,), generator=gen))
            top = q.argsort(descending=True)[:used]
            sampled.append(y)
            rollout.append(math.log(q[y]))
            ids.append(top.tolist() + [-1] * (width - used))
            head.append(q[top].log().tolist() + [NEG_INF] * (width - used))
        batch["unconcat_tokens"].append(torch.cat([prompt, torch.tensor(sampled, dtype=torch.long)]))
        batch["rollout_log_probs"].append(torch.tensor(rollout, dtype=F64))
        batch["rollout_topk_token_ids"].append(torch.tensor(ids, dtype=torch.long).reshape(response, width))
        batch["rollout_topk_log_probs"].append(torch.tensor(head, dtype=F64).reshape(response, width))
        batch["loss_masks"].append(torch.tensor(masks[i] if masks else [1.0] * response))
        batch["advantages"].append(torch.tensor(advantages[i], dtype=F64) if advantages
                                   else torch.randn(response, generator=gen, dtype=F64))
    logits = torch.randn(1, sum(totals), vocab, generator=gen, dtype=F64)
    return batch, logits


TOTALS, RESPONSES = [5, 3, 6], [3, 1, 4]
MASKS = [[1.0, 0.0, 1.0], [1.0], [1.0, 1.0, 0.0, 1.0]]
ADVANTAGES = [[0.7, -1.2, 0.0], [-0.4], [1.1, 0.9, 0.3, -2.0]]


def assert_same(first, second, names=None):
    (loss_a, log_a), (loss_b, log_b) = first, second
    assert names is not None or list(log_a) == list(log_b)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-12)
    for name in names or log_a:
        torch.testing.assert_close(log_a[name], log_b[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_thd_and_bshd_give_the_same_loss(mode):
    batch, thd = random_batch(3, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    args = make_args(mode, score_centering_mis_low=0.3, score_centering_mis_high=3.0, rollout_temperature=0.9)
    thd.requires_grad_()
    first = run(args, batch, thd)
    first[0].backward()

    seq = 7
    padded = torch.randn(3, seq, 6, generator=torch.Generator().manual_seed(4), dtype=F64)
    start = 0
    for i, total in enumerate(TOTALS):
        padded[i, :total] = thd.detach()[0, start:start + total]
        start += total
    bshd_batch = dict(batch, max_seq_lens=[seq] * 3)
    for shape in [(3, seq, 6), (1, 3 * seq, 6)]:
        bshd = padded.reshape(shape).clone().requires_grad_()
        second = run(make_args(mode, score_centering_mis_low=0.3, score_centering_mis_high=3.0,
                               rollout_temperature=0.9, qkv_format="bshd"), bshd_batch, bshd)
        assert_same(first, second)
        second[0].backward()
        grad = bshd.grad.reshape(3, seq, 6)
        start = 0
        for i, total in enumerate(TOTALS):
            torch.testing.assert_close(grad[i, :total], thd.grad[0, start:start + total], rtol=0, atol=1e-12)
            assert not grad[i, total:].any()
            start += total


@pytest.mark.parametrize("mode", MODES)
def test_unused_slots_add_nothing(mode):
    batch, logits = random_batch(5, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    args = make_args(mode, score_centering_mis_low=0.3, score_centering_mis_high=3.0)
    first = run(args, batch, logits)
    wider = dict(batch)
    # two more slots: id -1 with log q = -inf, and id -1 with a finite log q (an unused slot is ignored, whatever it
    # holds)
    wider["rollout_topk_token_ids"] = [torch.cat([ids, torch.full((len(ids), 2), -1)], 1)
                                       for ids in batch["rollout_topk_token_ids"]]
    wider["rollout_topk_log_probs"] = [torch.cat([lq, torch.tensor([[NEG_INF, -0.1]] * len(lq), dtype=F64)], 1)
                                       for lq in batch["rollout_topk_log_probs"]]
    assert_same(first, run(args, wider, logits))


@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_add_nothing(mode):
    batch, logits = random_batch(6, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    args = make_args(mode, score_centering_mis_low=0.3, score_centering_mis_high=3.0)
    logits.requires_grad_()
    first = run(args, batch, logits)
    first[0].backward()
    # sample 0's token 1 and sample 2's token 2 are masked: rows start + prompt - 1 + j = 0 + 1 + 1 = 2, 8 + 1 + 2 = 11
    assert not logits.grad[0, 2].any() and not logits.grad[0, 11].any()
    # rows that score a prompt token, or nothing (each sample's last row), get nothing either
    for row in (0, 4, 5, 7, 8, 13):
        assert not logits.grad[0, row].any(), row

    changed = {key: [v.clone() for v in value] if isinstance(value, list) and torch.is_tensor(value[0]) else value
               for key, value in batch.items()}
    for i, j in [(0, 1), (2, 2)]:
        changed["advantages"][i][j] = 5.0
        changed["rollout_log_probs"][i][j] = -0.01
        changed["rollout_topk_token_ids"][i][j] = torch.tensor([5, 4, 3])
        changed["rollout_topk_log_probs"][i][j] = torch.tensor([-0.2, -0.3, -0.4], dtype=F64)
    other = logits.detach().clone()
    other[0, 2] += torch.tensor([3.0, -2.0, 1.0, 0.5, 0.0, 4.0], dtype=F64)
    other[0, 11] -= 2.5
    assert_same(first, run(args, changed, other))


def test_compact_support_form_reads_the_same_candidates():
    batch, logits = random_batch(8, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    compact = {key: value for key, value in batch.items() if key != "rollout_topk_token_ids"}
    compact["rollout_topk_lengths"], compact["rollout_sampling_mask_offsets"] = [], []
    compact["rollout_sampling_mask_ids"] = []
    for ids in batch["rollout_topk_token_ids"]:
        lengths = (ids >= 0).sum(1)
        compact["rollout_topk_lengths"].append(lengths)
        compact["rollout_sampling_mask_offsets"].append(torch.cat([torch.zeros(1, dtype=torch.long),
                                                                   lengths.cumsum(0)[:-1]]))
        compact["rollout_sampling_mask_ids"].append(ids[ids >= 0])
    assert_same(run(make_args("tis"), batch, logits), run(make_args("tis"), compact, logits))


# ---- temperature, vocabulary ------------------------------------------------------------------------------------

def test_temperature_divides_the_logits():
    batch, logits = random_batch(9, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    hot = logits.clone().requires_grad_()
    cold = (logits / 0.6).clone().requires_grad_()
    first = run(make_args("mis", rollout_temperature=0.6, score_centering_mis_low=0.3), batch, hot)
    second = run(make_args("mis", rollout_temperature=1.0, score_centering_mis_low=0.3), batch, cold)
    assert_same(first, second)
    first[0].backward()
    second[0].backward()
    torch.testing.assert_close(hot.grad, cold.grad / 0.6, rtol=0, atol=1e-12)


def test_padded_vocabulary_columns_are_not_scored():
    batch, logits = random_batch(10, TOTALS, RESPONSES, vocab=4, width=2, masks=MASKS, advantages=ADVANTAGES)
    padded = torch.cat([logits, torch.full((1, logits.shape[1], 2), 9.0, dtype=F64)], -1)
    assert_same(run(make_args("tis"), batch, logits), run(make_args("tis", vocab_size=4), batch, padded))
    batch["rollout_topk_token_ids"][0][0, 0] = 4
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        run(make_args("tis", vocab_size=4), batch, padded)


# ---- support mode ------------------------------------------------------------------------------------------------

def support_batch():
    """Every token's support (its candidates) holds its sampled token; q sums to 1 on it."""
    batch, logits = random_batch(12, TOTALS, RESPONSES, vocab=6, width=4, masks=MASKS, advantages=ADVANTAGES)
    for i in range(len(TOTALS)):
        ids, head = batch["rollout_topk_token_ids"][i], batch["rollout_topk_log_probs"][i]
        for j in range(len(ids)):
            y = int(batch["unconcat_tokens"][i][-len(ids) + j])
            if y not in ids[j].tolist():
                ids[j, -1] = y
            used = ids[j] >= 0
            head[j] = torch.where(used, torch.randn(4, dtype=F64, generator=torch.Generator().manual_seed(i * 9 + j)),
                                  torch.tensor(NEG_INF, dtype=F64))
            head[j] = torch.where(used, head[j] - torch.logsumexp(head[j], 0), head[j])
            batch["rollout_log_probs"][i][j] = head[j][ids[j].tolist().index(y)]
    return batch, logits


@pytest.mark.parametrize("mode", MODES)
def test_support_mode_renormalises_over_the_candidates(mode):
    """Support mode equals the full-vocabulary loss on logits that are -inf off each token's support."""
    batch, logits = support_batch()
    args = dict(score_centering_mis_low=0.3, score_centering_mis_high=3.0, rollout_temperature=0.8)
    support_logits = logits.clone().requires_grad_()
    first = run(make_args(mode, use_sampling_support_replay=True, **args), batch, support_logits)
    first[0].backward()

    keep = torch.zeros_like(logits, dtype=torch.bool)
    start = 0
    for i, (total, response) in enumerate(zip(TOTALS, RESPONSES)):
        for j in range(response):
            row = start + total - response - 1 + j
            ids = batch["rollout_topk_token_ids"][i][j]
            keep[0, row, ids[ids >= 0]] = True
        start += total
    leaf = logits.clone().requires_grad_()
    second = run(make_args(mode, **args), batch, torch.where(keep, leaf, torch.tensor(NEG_INF, dtype=F64)))
    assert_same(first, second)
    second[0].backward()
    torch.testing.assert_close(support_logits.grad, leaf.grad, rtol=0, atol=1e-12)
    assert abs(first[1]["sc_train_head_mass"].item() - first[1]["sc_rollout_head_mass"].item()) < 1e-12


def test_support_mode_with_reference_kl_gives_the_same_policy_loss():
    batch, logits = support_batch()
    batch["ref_log_probs"] = [r - 0.1 for r in batch["rollout_log_probs"]]
    only = logits.clone().requires_grad_()
    first = run(make_args("tis", use_sampling_support_replay=True), batch, only)
    kl = logits.clone().requires_grad_()
    second = run(make_args("tis", use_sampling_support_replay=True, use_kl_loss=True, kl_loss_coef=0.0,
                           kl_loss_type="k1"), batch, kl)
    assert_same(first, second, names=list(first[1]))
    assert list(second[1])[:2] == ["kl_loss", "kl_invalid_fraction"]
    first[0].backward()
    second[0].backward()
    torch.testing.assert_close(only.grad, kl.grad, rtol=0, atol=1e-12)


def test_support_mode_scores_a_sampled_token_outside_the_support_as_miles_does():
    # z = (0, 0, 2, 0), support {0, 1}, y = 2: log p_y = 2 - log(e^0 + e^0) = 2 - log 2 > 0 (miles has no check)
    z = torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=F64)
    scores = score_token(z, 2, [0, 1], support="only", with_entropy=True)
    assert scores.log_p_sampled.item() == pytest.approx(2 - math.log(2), abs=1e-15)
    assert scores.entropy.item() == pytest.approx(math.log(2), abs=1e-15)
    # no recorded support: every score 0 and no gradient
    leaf = z.clone().requires_grad_()
    empty = score_token(leaf, 2, [-1, -1], support="only", with_entropy=False)
    empty.log_p_sampled.backward()
    assert empty.log_p_sampled.item() == 0.0 and not leaf.grad.any()


# ---- regularisers -----------------------------------------------------------------------------------------------

def response_log_probs(batch, logits, temperature):
    """[N] full-vocabulary log p_y and entropy of every response token, by torch's log_softmax."""
    log_p, entropy = [], []
    start = 0
    for i, (total, response) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        rows = torch.log_softmax(logits[0, start + total - response - 1:start + total - 1] / temperature, -1)
        tokens = batch["unconcat_tokens"][i][-response:]
        log_p.append(rows.gather(1, tokens.reshape(-1, 1)).squeeze(1))
        entropy.append(-(rows.exp() * rows).sum(-1))
        start += total
    return torch.cat(log_p), torch.cat(entropy)


def test_entropy_bonus():
    batch, logits = random_batch(13, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    loss, log = run(make_args("none", entropy_coef=0.05, rollout_temperature=0.9), batch, logits)
    _, entropy = response_log_probs(batch, logits, 0.9)
    expected = reducer(batch)(entropy)
    assert log["entropy_loss"].item() == pytest.approx(expected.item(), abs=1e-12)
    assert loss.item() == pytest.approx(log["pg_loss"].item() - 0.05 * expected.item(), abs=1e-12)
    assert list(log)[0] == "entropy_loss"
    _, observed = run(make_args("none", observe_training_entropy=True, rollout_temperature=0.9), batch, logits)
    assert observed["loss"].item() == observed["pg_loss"].item()
    assert observed["entropy_loss"].item() == pytest.approx(expected.item(), abs=1e-12)


def test_reference_kl():
    batch, logits = random_batch(14, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    log_p, _ = response_log_probs(batch, logits, 1.0)
    ref = log_p.detach() + torch.linspace(-0.5, 0.5, len(log_p), dtype=F64)
    ref[3] = log_p[3].detach() + 41.0  # |actor - ref| > 40: left out and counted (token 3 is trained)
    batch["ref_log_probs"] = list(ref.split(RESPONSES))
    args = make_args("none", use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="low_var_kl")
    loss, log = run(args, batch, logits)
    mask = torch.cat([torch.tensor(m, dtype=torch.bool) for m in MASKS])
    valid = mask.clone()
    valid[3] = False
    lr = (ref - log_p.detach()).clamp(-20, 20)
    kl = torch.where(valid, lr.exp() - 1 - lr, torch.zeros_like(lr))
    reduce = reducer(batch)
    assert log["kl_loss"].item() == pytest.approx(reduce(kl).item(), abs=1e-12)
    assert log["kl_invalid_fraction"].item() == pytest.approx(reduce((mask & ~valid).double()).item(), abs=1e-12)
    assert loss.item() == pytest.approx(log["pg_loss"].item() + 0.2 * reduce(kl).item(), abs=1e-12)
    assert low_var_kl(0.0, 30.0) == 10.0  # the log-ratio is clamped to 20, the value to 10


# ---- NaN and refused settings -----------------------------------------------------------------------------------

def test_nan_rollout_log_prob():
    batch, logits = random_batch(15, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    batch["rollout_log_probs"][0][2] = math.nan  # trained, A = 0: the log-ratio counts as 0, w = f(1)
    _, log = run(make_args("tis"), batch, logits)
    assert math.isfinite(log["loss"].item())
    batch["rollout_log_probs"][0][0] = math.nan  # trained, A = 0.7
    with pytest.raises(ValueError, match="NaN"):
        run(make_args("tis"), batch, logits)
    assert math.isfinite(run(make_args("none"), batch, logits)[0].item())  # none never reads the ratio


def test_refused_settings():
    batch, logits = hand_batch(), hand_logits()
    with pytest.raises(NotImplementedError, match="true_on_policy_mode"):
        run(make_args("none", true_on_policy_mode=True), batch, logits)
    with pytest.raises(ValueError, match="Unknown"):
        run(make_args("ppo"), batch, logits)
    with pytest.raises(ValueError, match="TIS clip"):
        run(make_args("tis", score_centering_tis_clip=0.0), batch, logits)
    with pytest.raises(ValueError, match="MIS bounds"):
        run(make_args("mis", score_centering_mis_low=2.0, score_centering_mis_high=1.0), batch, logits)
    with pytest.raises(ValueError, match="thd or bshd"):
        run(make_args("none", qkv_format="sbhd"), batch, logits)


def test_per_token_values_of_untrained_and_zero_advantage_tokens():
    """Through an identity reducer: an untrained token has A = 0, log q_y = 0 and no candidates (P = Q = 0, rho = 1,
    w = f(p_y / 1)); a trained token with A = 0 keeps its candidates; both have loss 0."""
    batch, logits = random_batch(16, TOTALS, RESPONSES, vocab=6, width=3, masks=MASKS, advantages=ADVANTAGES)
    loss, log = score_centering_loss(make_args("tis"), batch, logits, lambda x: x)
    log_p, _ = response_log_probs(batch, logits, 1.0)
    untrained, zero_advantage = 1, 2  # sample 0's tokens 1 (mask 0) and 2 (mask 1, A = 0)
    assert loss[untrained].item() == 0.0 and loss[zero_advantage].item() == 0.0
    assert log["sc_train_head_mass"][untrained].item() == log["sc_rollout_head_mass"][untrained].item() == 0.0
    assert log["sc_tail_ratio"][untrained].item() == 1.0 and log["sc_correction"][untrained].item() == 0.0
    assert log["sc_importance_weight"][untrained].item() == pytest.approx(log_p[untrained].exp().item(), abs=1e-14)
    assert log["train_rollout_logprob_abs_diff"][untrained].item() == 0.0
    q_mass = batch["rollout_topk_log_probs"][0][zero_advantage].exp().sum().item()
    assert log["sc_rollout_head_mass"][zero_advantage].item() == pytest.approx(q_mass, abs=1e-14)
    assert log["sc_train_head_mass"][zero_advantage].item() > 0
