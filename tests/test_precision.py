"""Precision where it matters: k3 and χ² without cancellation when the engines nearly agree, float64 sums of the
per-sequence table (ESS never above 1, exact weights on long responses), fill values tested before rounding.

Every expected value is computed here in float64 from the float32 inputs the plugin sees (expm1 has no
cancellation), independently of the package."""

import math

import pytest
import torch
from conftest import on_device

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed

METRICS_ONLY = MisConfig(use_tis=False)


def exact_k3(log_ratios: torch.Tensor) -> torch.Tensor:
    c = log_ratios.double()
    return torch.expm1(c) - c


def run(config, log_ratios, rollout=None, masks=None):
    """One sequence per entry of ``log_ratios`` (float32), rollout log-probs 0 unless given."""
    train = [ell.float() if rollout is None else (r + ell).float() for ell, r in
             zip(log_ratios, rollout or [None] * len(log_ratios))]
    rollouts = [torch.zeros_like(t) for t in train] if rollout is None else [r.float() for r in rollout]
    masks = masks or [torch.ones_like(t) for t in train]
    return compute_mis_weights(config, train_log_probs=on_device(train), rollout_log_probs=on_device(rollouts),
                               loss_masks=on_device(masks))


def test_k3_of_four_tiny_log_ratios_is_not_zero():
    ell = torch.tensor([1e-4, -1e-4, 2e-4, -2e-4])
    _, _, metrics = run(METRICS_ONLY, [ell])
    want = float(exact_k3(ell.float()).mean())
    assert want == pytest.approx(1.25e-8, rel=1e-3)
    for name in ("mis_k3_kl", "mis_batch_k3", "mis_k3_first_token", "mis_k3_position_1_16"):
        if name == "mis_k3_first_token":  # the first token alone: ℓ = 1e-4
            assert float(metrics[name][0][0]) == pytest.approx(float(exact_k3(ell[:1].float())), rel=1e-6), name
        elif name == "mis_k3_position_1_16":  # tokens 1..3
            assert float(metrics[name][0][0]) == pytest.approx(float(exact_k3(ell[1:].float()).mean()), rel=1e-6)
        else:
            assert float(metrics[name][0][0]) == pytest.approx(want, rel=1e-6), name


def test_token_k3_option_does_not_reject_a_token_below_its_threshold():
    # k3 of ℓ = 0.00104523 is 5.46e-7; float32 e^ℓ − ℓ − 1 gave 5.96e-7 and rejected it at 5.77e-7
    ell = torch.tensor([0.00104523])
    assert float(exact_k3(ell.float())) == pytest.approx(5.46e-7, rel=1e-3)
    config = MisConfig(use_tis=True, rs_divergence={"token_k3": 5.77e-7})
    weights, masks, metrics = run(config, [ell])
    assert masks[0].tolist() == [1.0]
    assert float(metrics["mis_rs_token_k3_masked_token_fraction"][0][0]) == 0.0
    assert float(metrics["mis_rs_token_k3_mean"][0][0]) == pytest.approx(float(exact_k3(ell.float())), rel=1e-6)
    # and one just below the exact value is rejected
    _, masks, _ = run(MisConfig(use_tis=True, rs_divergence={"token_k3": 5.45e-7}), [ell])
    assert masks[0].tolist() == [0.0]


def test_seq_mean_k3_option_rejects_a_sequence_above_its_threshold():
    # 4 tokens of ℓ = −0.0107421875 and 10 of −0.009765625 (exact in float32): mean k3 = 5.03753e-05 > 5.0309e-05
    ell = torch.tensor([-0.0107421875] * 4 + [-0.009765625] * 10)
    statistic = float(exact_k3(ell).mean())
    assert statistic == pytest.approx(5.03753e-05, rel=1e-5)
    _, masks, metrics = run(MisConfig(use_tis=True, rs_divergence={"seq_mean_k3": 5.0309e-05}), [ell])
    assert masks[0].sum() == 0, "the sequence's mean k3 is above the threshold"
    assert float(metrics["mis_rs_seq_mean_k3_mean"][0][0]) == pytest.approx(statistic, rel=1e-6)
    _, masks, _ = run(MisConfig(use_tis=True, rs_divergence={"seq_mean_k3": 5.038e-05}), [ell])
    assert masks[0].sum() == 14


@pytest.mark.parametrize("sigma", [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2, 1e-1, 1.0])
def test_k3_and_chi2_match_exact_float64_at_every_scale(sigma):
    gen = torch.Generator().manual_seed(int(-math.log10(sigma) * 10))
    rollout = -torch.rand(4000, generator=gen) * 2.0 - 0.1
    train = rollout + (sigma * torch.randn(4000, generator=gen, dtype=torch.float64)).float()
    c = train.double() - rollout.double()  # the float32 log ratio the plugin sees, exactly
    k3 = exact_k3(c)
    config = MisConfig(use_tis=True, rs_divergence={"token_k3": 1e30, "seq_mean_k3": 1e30, "seq_sum_k3": 1e30})
    _, _, metrics = compute_mis_weights(config, train_log_probs=[train], rollout_log_probs=[rollout],
                                        loss_masks=[torch.ones(4000)])
    first = lambda name: float(metrics[name][0][0])  # noqa: E731
    for name, want in (("mis_k3_kl", k3.mean()), ("mis_batch_k3", k3.mean()), ("mis_rs_seq_mean_k3_mean", k3.mean()),
                       ("mis_rs_seq_sum_k3_mean", k3.sum()), ("mis_k3_position_1024_8192", k3[1024:].mean())):
        assert first(name) == pytest.approx(float(want), rel=1e-3), (name, sigma)
    per_token = metrics["mis_rs_token_k3_mean"][0].double()
    assert float(((per_token - k3).abs() / k3.clamp(min=1e-300)).max()) <= 1e-3
    chi2_token = float(torch.expm1(2 * c).mean())  # mean ρ² − 1, near 0: an absolute bound relative to its scale
    assert abs(first("mis_chi2_token") - chi2_token) <= 1e-3 * max(abs(chi2_token), float((2 * c).abs().mean()) * 1e-3)
    chi2_seq = float(torch.expm1(2 * c.sum().clamp(-20, 20)))
    assert first("mis_chi2_seq") == pytest.approx(chi2_seq, rel=1e-5, abs=1e-12)


def test_ess_of_equal_weights_is_exactly_one():
    ell = torch.full((5,), -0.009765625)
    _, _, metrics = run(MisConfig(use_tis=True), [ell])
    assert float(metrics["mis_ess"][0][0]) == 1.0


def test_a_100k_token_response_of_equal_ratios_has_weight_and_ess_exactly_one():
    ell = torch.full((100_000,), -0.009765625)
    config = MisConfig(use_tis=True, tis_mode="icepop", tis_lower_bound=0.5, tis_upper_bound=2.0,
                       tis_batch_normalize=True)
    weights, _, metrics = run(config, [ell])
    assert bool((weights[0] == 1.0).all()), weights[0].unique()
    assert float(metrics["mis_ess"][0][0]) == 1.0


@pytest.mark.parametrize("seed", range(20))
def test_ess_never_exceeds_one(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 3000, (1,), generator=gen))
    value = float(torch.randn(1, generator=gen) * 0.01)
    ell = torch.full((n,), value) + (torch.randn(n, generator=gen) * 1e-7 if seed % 2 else 0.0)
    for mode in ("truncate", "icepop", "clip"):
        _, _, metrics = run(MisConfig(use_tis=True, tis_mode=mode, tis_batch_normalize=bool(seed % 3)), [ell])
        assert 0.0 <= float(metrics["mis_ess"][0][0]) <= 1.0


def test_float64_log_prob_just_inside_the_fill_bound_is_a_log_prob():
    # −9999.99999999 rounds to −1e4 in float32 (a fill value), but it is inside the bound: usable
    train = torch.tensor([-9999.99999999, -1.0, -2.0], dtype=torch.float64)
    rollout = torch.tensor([-9999.9999, -1.0, -2.0], dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 3])
    _, mask, metrics = compute_mis_weights_packed(MisConfig(use_tis=True), train_log_probs=train,
                                                  rollout_log_probs=rollout, loss_mask=torch.ones(3),
                                                  cu_seqlens=cu_seqlens)
    assert metrics["mis_nonfinite_token_fraction"].tolist() == [0.0, 0.0, 0.0]
    assert mask.tolist() == [1.0, 1.0, 1.0]
    # at and beyond the bound it is a fill value, as before
    for fill in (-1e4, -10000.00000001):
        _, mask, metrics = compute_mis_weights_packed(MisConfig(use_tis=True),
                                                      train_log_probs=torch.tensor([fill, -1.0], dtype=torch.float64),
                                                      rollout_log_probs=torch.tensor([-1.0, -1.0], dtype=torch.float64),
                                                      loss_mask=torch.ones(2), cu_seqlens=torch.tensor([0, 2]))
        assert metrics["mis_nonfinite_token_fraction"].tolist() == [1.0, 0.0] and mask.tolist() == [0.0, 0.0]
