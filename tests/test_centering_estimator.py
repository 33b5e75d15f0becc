"""The score-centered loss against a dense oracle over a small vocabulary, a slow per-token reference, and hand cases.

The oracle: one position with trainer distribution p = softmax(θ) and engine distribution q over V tokens. The
expected gradient of a constant advantage, Σ_y q_y ∇_θ loss(y), is 0 when H is the whole vocabulary, and also for
K < V when the engine's tail is exactly ρ·p (the model the estimator assumes), for every weighting.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis.centering.estimator import TAIL_FLOOR, Weighting, centered_loss

WEIGHTINGS = [Weighting("none"), Weighting("tis", tis_clip=1.5), Weighting("mis", mis_low=0.5, mis_high=1.6)]
NEG_INF = float("-inf")


def expected_gradient(theta, rollout_log_probs, head, weighting):
    """Σ_y q_y ∇_θ loss(y | H) with A = 1: one row per possible sampled token y, the same candidates H in each."""
    theta = theta.detach().clone().requires_grad_(True)
    vocab = theta.numel()
    train_log_probs = torch.log_softmax(theta, 0)
    rows = vocab
    candidate_ids = torch.tensor(head).expand(rows, -1)
    out = centered_loss(train_log_probs, rollout_log_probs, train_log_probs[candidate_ids],
                        rollout_log_probs[candidate_ids], torch.ones_like(candidate_ids, dtype=torch.bool),
                        torch.ones(rows, dtype=theta.dtype), torch.ones(rows), weighting)
    (rollout_log_probs.exp() * out.token_loss).sum().backward()
    return theta.grad, out


@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: w.mode)
@pytest.mark.parametrize("seed", range(5))
def test_with_the_whole_vocabulary_a_constant_advantage_pushes_nothing(weighting, seed):
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(7, generator=generator, dtype=torch.float64)
    rollout_log_probs = torch.log_softmax(theta + 0.3 * torch.randn(7, generator=generator, dtype=torch.float64), 0)
    gradient, out = expected_gradient(theta, rollout_log_probs, list(range(7)), weighting)
    assert gradient.abs().max() < 1e-12
    assert out.tail_ratio.tolist() == [1.0] * 7  # both tails at the floor


def exact_tail_engine(train_log_probs, head, head_rollout_probs):
    """q with the given probabilities on H and ρ·p on the tail (ρ making q sum to 1)."""
    p = train_log_probs.exp()
    tail = torch.ones_like(p, dtype=torch.bool)
    tail[head] = False
    rho = (1.0 - head_rollout_probs.sum()) / p[tail].sum()
    q = torch.where(tail, rho * p, 0.0)
    q[head] = head_rollout_probs
    return q.log(), float(rho)


@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: w.mode)
@pytest.mark.parametrize("seed", range(5))
def test_a_partial_head_centers_exactly_under_the_tail_model(weighting, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    theta = torch.randn(9, generator=generator, dtype=torch.float64)
    head = [0, 3, 4]
    head_rollout = torch.softmax(torch.randn(4, generator=generator, dtype=torch.float64), 0)[:3] * 0.8
    rollout_log_probs, rho = exact_tail_engine(torch.log_softmax(theta, 0), head, head_rollout)
    gradient, out = expected_gradient(theta, rollout_log_probs, head, weighting)
    assert gradient.abs().max() < 1e-12
    assert out.tail_ratio[0].item() == pytest.approx(rho, rel=1e-12)


def test_without_centering_a_partial_head_would_push():
    # the same setting with the correction dropped (only the sampled term): the expected gradient is not 0
    generator = torch.Generator().manual_seed(7)
    theta = torch.randn(9, generator=generator, dtype=torch.float64)
    rollout_log_probs, _ = exact_tail_engine(torch.log_softmax(theta, 0), [0, 3, 4],
                                             torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64))
    theta = theta.requires_grad_(True)
    log_p = torch.log_softmax(theta, 0)
    (-(rollout_log_probs.exp() * log_p).sum()).backward()  # none: w = 1, E_q[∇log p]
    assert theta.grad.abs().max() > 1e-3


def reference(train, rollout, train_cand, rollout_cand, used, adv, mask, weighting):
    """Slow per-token reference written from the formula (Python floats, one token and one slot at a time)."""
    def f(r):
        if weighting.mode == "none":
            return 1.0
        if weighting.mode == "tis":
            return min(r, weighting.tis_clip)
        return r if weighting.mis_low <= r <= weighting.mis_high else 0.0

    losses, grads_sampled, grads_candidates = [], [], []
    for t in range(len(train)):
        if mask[t] == 0:
            losses.append(0.0)
            grads_sampled.append(0.0)
            grads_candidates.append([0.0] * len(used[t]))
            continue
        slots = [k for k in range(len(used[t])) if used[t][k]]
        p = {k: math.exp(train_cand[t][k]) for k in slots}
        q = {k: math.exp(rollout_cand[t][k]) for k in slots}
        rho = max(1 - sum(q.values()), TAIL_FLOOR) / max(1 - sum(p.values()), TAIL_FLOOR)
        alpha = rho * f(1 / rho)
        c = {k: q[k] * f(p[k] / q[k]) - alpha * p[k] for k in slots}
        w = f(math.exp(train[t] - rollout[t]))
        losses.append(-adv[t] * (w * train[t] - sum(c[k] * train_cand[t][k] for k in slots)))
        grads_sampled.append(-adv[t] * w)
        grads_candidates.append([adv[t] * c[k] if k in c else 0.0 for k in range(len(used[t]))])
    return losses, grads_sampled, grads_candidates


@st.composite
def batches(draw):
    tokens, slots = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    vocab = slots + 3
    rows = []
    for _ in range(tokens):
        p = torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 2, 0)
        q = torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 2, 0)
        ids = torch.randperm(vocab, generator=generator)[:slots]
        used = torch.rand(slots, generator=generator) < 0.8
        sampled = int(torch.randint(vocab, (1,), generator=generator))  # may lie outside H
        rows.append((p[sampled].log(), q[sampled].log(), p[ids].log(), torch.where(used, q[ids].log(), NEG_INF),
                     used))
    adv = torch.randn(tokens, generator=generator, dtype=torch.float64)
    mask = (torch.rand(tokens, generator=generator) < 0.8).double()
    stack = lambda i: torch.stack([row[i] for row in rows])  # noqa: E731
    return stack(0), stack(1), stack(2), stack(3), stack(4), adv, mask


@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: w.mode)
@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_the_loss_and_its_gradients_equal_the_per_token_reference(weighting, batch):
    train, rollout, train_cand, rollout_cand, used, adv, mask = batch
    train, train_cand = train.clone().requires_grad_(True), train_cand.clone().requires_grad_(True)
    out = centered_loss(train, rollout, train_cand, rollout_cand, used, adv, mask, weighting)
    out.token_loss.sum().backward()
    losses, grad_sampled, grad_candidates = reference(
        train.tolist(), rollout.tolist(), train_cand.tolist(), rollout_cand.tolist(), used.tolist(), adv.tolist(),
        mask.tolist(), weighting)
    assert out.token_loss.tolist() == pytest.approx(losses, rel=1e-12, abs=1e-12)
    assert train.grad.tolist() == pytest.approx(grad_sampled, rel=1e-12, abs=1e-12)
    for got, want in zip(train_cand.grad.tolist(), grad_candidates):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(train_cand.grad).all()


def test_a_hand_case_with_tis():
    # p_y = 0.5, q_y = 0.2: w = min(2.5, 2) = 2. H = {a, b}: p = 0.5, 0.2; q = 0.2, 0.4.
    # P = 0.7, Q = 0.6, ρ = 0.4/0.3 = 4/3, α = min(2·4/3, 1) = 1;
    # c_a = min(0.5, 0.4) − 0.5 = −0.1, c_b = min(0.2, 0.8) − 0.2 = 0
    log = lambda values: torch.tensor(values, dtype=torch.float64).log()  # noqa: E731
    out = centered_loss(log([0.5]), log([0.2]), log([[0.5, 0.2]]), log([[0.2, 0.4]]), torch.tensor([[True, True]]),
                        torch.tensor([1.0], dtype=torch.float64), torch.ones(1), Weighting("tis", tis_clip=2.0))
    assert out.tail_ratio.item() == pytest.approx(4 / 3)
    assert out.importance_weight.item() == pytest.approx(2.0)
    assert out.correction.item() == pytest.approx(-0.1 * math.log(0.5))
    assert out.token_loss.item() == pytest.approx(-(2.0 * math.log(0.5) + 0.1 * math.log(0.5)))
    assert (out.train_head_mass.item(), out.rollout_head_mass.item()) == pytest.approx((0.7, 0.6))


def test_a_head_holding_all_the_mass_keeps_every_value_finite():
    # P = 1 − 1e-12 on one candidate: the trainer's tail is floored at ε, ρ = (1 − Q)/ε
    train_cand = torch.tensor([[math.log1p(-1e-12)]], dtype=torch.float64, requires_grad=True)
    out = centered_loss(torch.tensor([-1e-12], dtype=torch.float64), torch.tensor([math.log(0.9)], dtype=torch.float64),
                        train_cand, torch.tensor([[math.log(0.9)]], dtype=torch.float64), torch.tensor([[True]]),
                        torch.tensor([1.0], dtype=torch.float64), torch.ones(1), Weighting("none"))
    out.token_loss.sum().backward()
    assert out.tail_ratio.item() == pytest.approx(0.1 / TAIL_FLOOR, rel=1e-6)
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(train_cand.grad).all()


def test_untrained_tokens_and_unused_slots_contribute_nothing():
    train_cand = torch.tensor([[-1.0, NEG_INF], [-0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    out = centered_loss(torch.tensor([-1.0, -0.5], dtype=torch.float64),
                        torch.tensor([-1.2, -0.4], dtype=torch.float64),
                        train_cand, torch.tensor([[-1.1, NEG_INF], [-0.6, -1.5]], dtype=torch.float64),
                        torch.tensor([[True, False], [True, True]]), torch.tensor([1.0, 3.0], dtype=torch.float64),
                        torch.tensor([1.0, 0.0]), Weighting("mis"))
    out.token_loss.sum().backward()
    assert out.token_loss[1].item() == 0.0 and out.tail_ratio[1].item() == 0.0
    assert train_cand.grad[0, 1].item() == 0.0 and train_cand.grad[1].tolist() == [0.0, 0.0]
    assert torch.isfinite(train_cand.grad).all()


@pytest.mark.parametrize("keys, start", [
    ({"mode": "clip"}, "score_centering_is='clip' is invalid: allowed values are none, tis, mis"),
    ({"mode": "tis", "tis_clip": 0.0}, "score_centering_tis_clip=0.0 is invalid"),
    ({"mode": "mis", "mis_low": 2.0, "mis_high": 1.0}, "score_centering_mis_low=2.0, score_centering_mis_high=1.0"),
    ({"mode": "mis", "mis_high": float("inf")}, "score_centering_mis_low=0.5, score_centering_mis_high=inf"),
])
def test_bad_weightings_are_one_line_errors(keys, start):
    with pytest.raises(ValueError) as error:
        Weighting(**keys)
    assert str(error.value).startswith(start)


def test_the_mis_tail_band_includes_its_edges_as_miles_compares_them():
    """ρ = 1.25 = 1/lo exactly (p = 0.5, q = 0.375, lo = 0.8): α = 1, as miles' ρ-space test gives; a test in log
    space rounds log 1.25 and -log 0.8 apart and dropped it (α = 0, loss 0)."""
    log = lambda x: torch.tensor([[math.log(x)]], dtype=torch.float64)  # noqa: E731
    out = centered_loss(log(0.5)[0], log(0.375)[0], log(0.5), log(0.375), torch.tensor([[True]]),
                        torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]),
                        Weighting("mis", mis_low=0.8, mis_high=1.25))
    assert float(out.tail_ratio[0]) == 1.25
    assert float(out.token_loss[0]) == pytest.approx(-0.5 * math.log(0.5), rel=1e-15)
