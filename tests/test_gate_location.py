"""The batch gate and the where-the-mismatch-lives metrics at cp = 1 (CP exactness: test_cp.py)."""

import logging
import math

import pytest
import torch
from conftest import call_plugin as call
from conftest import random_batch

from miles_mis import MisConfig, compute_mis_weights
from miles_mis.correction.mismatch_location import BUCKET_NAMES


def engine_batch(noise, seed=0, num=6, length=30, bias=0.0):
    gen = torch.Generator().manual_seed(seed)
    train = [-torch.rand(length, generator=gen) * 3 for _ in range(num)]
    rollout = [t + bias + noise * torch.randn(length, generator=gen) for t in train]
    return train, rollout, [torch.ones(length) for _ in range(num)]


# --------------------------------------------------------------------------- the gate
def test_a_catastrophic_batch_is_gated_whole(caplog):
    cfg = MisConfig(use_tis=True, rs_batch_gate={"k3": 0.05})
    train, rollout, masks = engine_batch(noise=1.0)  # k3 ~ 0.6: far above 0.05
    pg = torch.randn(180, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="miles_mis"):
        loss, out_masks, metrics = call(cfg, train, rollout, masks, pg_loss=pg)
    assert torch.equal(loss, torch.zeros(180)) and all(m.sum() == 0 for m in out_masks)
    assert metrics["mis_batch_gated"].tolist() == [1.0] * 180
    assert metrics["mis_is_ratio_mean_final"].abs().sum() == 0 and metrics["mis_batch_k3"][0] > 0.05
    loss.sum().backward()
    assert torch.equal(pg.grad, torch.zeros(180))  # no gradient from the batch
    assert any("micro-batch gated" in record.getMessage() and "k3 = " in record.getMessage()
               and "> 0.05" in record.getMessage() for record in caplog.records)


def test_a_healthy_batch_passes_the_gate_untouched(caplog):
    train, rollout, masks = engine_batch(noise=0.01)
    plain = call(MisConfig(use_tis=True), train, rollout, masks)
    with caplog.at_level(logging.WARNING, logger="miles_mis"):
        gated = call(MisConfig(use_tis=True, rs_batch_gate={"k3": 0.05, "kl": 0.05, "max_abs_log_ratio": 1.0}),
                     train, rollout, masks)
    assert torch.equal(plain[0], gated[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], gated[1]))
    assert gated[2]["mis_batch_gated"].tolist() == [0.0] * 180 and not caplog.records
    for name in plain[2]:
        assert torch.equal(plain[2][name], gated[2][name]), name


@pytest.mark.parametrize("statistic, threshold, gated", [("k3", 0.01, True), ("k3", 10.0, False),
                                                         ("kl", 0.01, True), ("kl", 1.0, False),
                                                         ("max_abs_log_ratio", 1.0, True),
                                                         ("max_abs_log_ratio", 20.0, False)])
def test_each_statistic_gates_by_its_own_value(statistic, threshold, gated):
    train, rollout, masks = engine_batch(noise=0.5, seed=2, bias=0.2)  # kl = mean(log rollout - log train) ~ 0.2
    _, out_masks, metrics = call(MisConfig(use_tis=True, rs_batch_gate={statistic: threshold}), train, rollout, masks)
    assert bool(metrics["mis_batch_gated"][0]) == gated
    assert (sum(float(m.sum()) for m in out_masks) == 0) == gated
    # the statistics by hand
    ell = torch.cat(train).double() - torch.cat(rollout).double()
    k3 = (ell.exp() - ell - 1).mean()
    assert metrics["mis_batch_k3"][0].item() == pytest.approx(float(k3), rel=1e-4)
    assert metrics["mis_batch_kl"][0].item() == pytest.approx(float(-ell.mean()), rel=1e-4, abs=1e-6)
    assert metrics["mis_batch_max_abs_log_ratio"][0].item() == pytest.approx(float(ell.abs().max()), rel=1e-5)


def test_statistics_are_logged_without_a_gate_and_in_metrics_only_mode():
    train, rollout, masks = engine_batch(noise=1.0)
    for cfg in (MisConfig(use_tis=True), MisConfig(use_tis=False, rs_batch_gate={"k3": 0.01})):
        loss, out_masks, metrics = call(cfg, train, rollout, masks)
        assert metrics["mis_batch_k3"][0] > 0.05 and "mis_batch_gated" not in metrics
        if not cfg.use_tis:  # metrics only: nothing is gated, masks and loss unchanged
            assert all(torch.equal(a, b) for a, b in zip(out_masks, masks)) and torch.equal(loss, torch.ones(180))


def test_gate_config_is_validated():
    with pytest.raises(ValueError, match=r"rs_batch_gate: unknown statistic 'max_abs_logratio' \(did you mean "
                                         r"'max_abs_log_ratio'\?\)"):
        MisConfig(rs_batch_gate={"max_abs_logratio": 0.1})
    with pytest.raises(ValueError, match=r"rs_batch_gate.k3=-1 is invalid: allowed values are finite positive"):
        MisConfig(rs_batch_gate={"k3": -1})
    with pytest.raises(ValueError, match=r"rs_batch_gate=\[0.1\] is invalid"):
        MisConfig(rs_batch_gate=[0.1])
    with pytest.raises(ValueError, match=r"rs_batch_gate_scope='node' is invalid"):
        MisConfig(rs_batch_gate_scope="node")
    config = MisConfig(rs_batch_gate={"max_abs_log_ratio": "1e1", "k3": 0.05})  # YAML 1.1 strings accepted
    assert config.rs_batch_gate == (("k3", 0.05), ("max_abs_log_ratio", 10.0))
    assert MisConfig.from_dict(config.to_dict()) == config and MisConfig(rs_batch_gate={}).rs_batch_gate == ()


# --------------------------------------------------------------------------- where the mismatch lives
def test_position_buckets_by_hand():
    # one 20-token sequence: l = 0.1 on position 0, 0.2 on positions 1..15, 0.3 on 16..19
    ell = torch.tensor([0.1] + [0.2] * 15 + [0.3] * 4)
    train = [-torch.ones(20) + ell]
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=[-torch.ones(20)],
                                        loss_masks=[torch.ones(20)])
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    expected = {"0_1": k3(0.1), "1_16": k3(0.2), "16_128": k3(0.3), "128_1024": 0.0, "1024_8192": 0.0,
                "8192_inf": 0.0}
    assert set(expected) == set(BUCKET_NAMES)
    for name, value in expected.items():
        assert metrics[f"mis_k3_position_{name}"][0][0].item() == pytest.approx(value, rel=1e-4, abs=1e-9), name
    assert metrics["mis_k3_first_token"][0][0].item() == pytest.approx(k3(0.1), rel=1e-4)


def test_masked_and_nonfinite_tokens_do_not_count():
    train = [torch.tensor([-1.0, float("nan"), -1.0 + 0.5, -2.0])]
    rollout = [torch.tensor([-1.0, -1.0, -1.0, -9.0])]  # the last token: p = e^-9 < 0.1, but masked
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=[torch.tensor([1.0, 1.0, 1.0, 0.0])])
    k3 = math.exp(0.5) - 0.5 - 1
    assert metrics["mis_k3_position_1_16"][0][0].item() == pytest.approx(k3, rel=1e-5)  # position 2 only
    assert metrics["mis_low_rollout_prob_token_fraction"][0][0].item() == 0.0
    assert metrics["mis_batch_k3"][0][0].item() == pytest.approx(k3 / 2, rel=1e-5)  # 2 usable tokens


def test_location_metrics_are_finite_and_bounded_on_random_batches():
    for seed in range(5):
        train, rollout, masks = random_batch(seed, nonfinite=True)
        _, _, metrics = compute_mis_weights(MisConfig(use_tis=True), train_log_probs=train,
                                            rollout_log_probs=rollout, loss_masks=masks)
        flat = {name: torch.cat(values) for name, values in metrics.items()}
        for name in ["mis_k3_first_token", "mis_k3_low_rollout_prob"] + [f"mis_k3_position_{b}" for b in BUCKET_NAMES]:
            assert torch.isfinite(flat[name]).all() and (flat[name] >= 0).all(), name
        assert ((flat["mis_low_rollout_prob_token_fraction"] >= 0) &
                (flat["mis_low_rollout_prob_token_fraction"] <= 1)).all()
