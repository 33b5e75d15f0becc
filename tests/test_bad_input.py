"""Bad input: clear errors, or a defined, counted behaviour; never NaN or inf."""

import math
import re

import pytest
import torch
from conftest import call_plugin as call

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed, compute_mis_weights_with_cp

FULL = MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True)
ALL_CONFIGS = [FULL] + [MisConfig(use_tis=True, tis_level=level, tis_mode=mode, use_rs=True, rs_level=level,
                                  rs_veto_threshold=1e-4, tis_batch_normalize=True, tis_upper_bound=2.0)
                        for level in ("token", "sequence", "geometric") for mode in ("truncate", "mask", "icepop")]


def assert_all_finite(loss, metrics):
    assert torch.isfinite(loss).all()
    for name, value in metrics.items():
        assert torch.isfinite(value).all(), name


def test_different_list_lengths():
    with pytest.raises(ValueError, match="train_log_probs has 2, rollout_log_probs has 1, loss_masks has 2"):
        compute_mis_weights(FULL, train_log_probs=[torch.zeros(2)] * 2, rollout_log_probs=[torch.zeros(2)],
                            loss_masks=[torch.ones(2)] * 2)


def test_shape_mismatch_names_sequence_and_shapes():
    with pytest.raises(ValueError, match=r"sequence 1: train_log_probs has shape \(3,\), rollout_log_probs has "
                                         r"shape \(4,\)"):
        compute_mis_weights(FULL, train_log_probs=[torch.zeros(2), torch.zeros(3)],
                            rollout_log_probs=[torch.zeros(2), torch.zeros(4)], loss_masks=[torch.ones(2)] * 2)


def test_response_length_mismatch():
    with pytest.raises(ValueError, match=r"sequence 0: response_lengths\[0\]=5"):
        compute_mis_weights_with_cp(FULL, pg_loss=torch.zeros(2), train_log_probs=[torch.zeros(2)],
                                    rollout_log_probs=[torch.zeros(2)], loss_masks=[torch.ones(2)],
                                    total_lengths=[9], response_lengths=[5])


def test_pg_loss_length_mismatch():
    with pytest.raises(ValueError, match=r"pg_loss has shape \(3,\).*expected shape \(2,\)"):
        compute_mis_weights_with_cp(FULL, pg_loss=torch.zeros(3), train_log_probs=[torch.zeros(2)],
                                    rollout_log_probs=[torch.zeros(2)], loss_masks=[torch.ones(2)])


def test_rollout_log_probs_none():
    with pytest.raises(ValueError, match="host must return rollout log-probs"):
        compute_mis_weights_with_cp(FULL, pg_loss=torch.zeros(2), train_log_probs=[torch.zeros(2)],
                                    rollout_log_probs=None, loss_masks=[torch.ones(2)])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["train", "rollout"])
def test_nonfinite_log_prob_rejects_the_sequence_and_is_counted(bad, where):
    train = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -0.2])]
    rollout = [t.clone() - 0.01 for t in train]
    (train if where == "train" else rollout)[0][1] = bad
    masks = [torch.ones(3), torch.ones(2)]
    for cfg in ALL_CONFIGS:
        pg = torch.tensor([1.0, float("nan"), 1.0, 2.0, 3.0], requires_grad=True)  # NaN from the NaN log-prob
        loss, out_masks, metrics = call(cfg, train, rollout, masks, pg_loss=pg)
        assert out_masks[0].tolist() == [0, 0, 0]
        assert loss[:3].tolist() == [0, 0, 0]
        assert_all_finite(loss, metrics)
        assert metrics["mis_nonfinite_token_fraction"].tolist() == [0, 1, 0, 0, 0]
        loss.sum().backward()


def test_nonfinite_on_masked_token_is_ignored():
    train = [torch.tensor([-1.0, float("nan")])]
    loss, masks, metrics = call(FULL, train, [torch.tensor([-1.0, -1.0])], [torch.tensor([1.0, 0.0])])
    assert masks[0].tolist() == [1, 0]
    assert metrics["mis_nonfinite_token_fraction"].tolist() == [0, 0]
    assert_all_finite(loss, metrics)


def test_metrics_only_with_nonfinite_is_finite_and_unchanged():
    train = [torch.tensor([-1.0, float("nan"), -3.0])]
    pg = torch.arange(3.0)
    loss, masks, metrics = call(MisConfig(use_tis=False), train, [torch.tensor([-1.0, -1.0, -2.0])],
                                [torch.ones(3)], pg_loss=pg)
    assert loss is pg and masks[0].tolist() == [1, 1, 1]
    assert_all_finite(loss, metrics)
    # statistics use the finite tokens only: mean l = ((-1+1) + (-3+2)) / 2 = -0.5
    assert metrics["mis_kl"].tolist() == [0.5] * 3


@pytest.mark.parametrize("cfg", ALL_CONFIGS)
def test_edge_batches_are_finite(cfg):
    cases = [
        ([torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0)]),  # zero-length response
        ([torch.tensor([-1.0])], [torch.tensor([-1.2])], [torch.zeros(1)]),  # empty mask
        ([torch.tensor([-1.0])], [torch.tensor([-1.2])], [torch.ones(1)]),  # one token
        ([torch.full((5,), -1000.0)], [torch.zeros(5)], [torch.ones(5)]),  # l = -1000: vetoed
        ([torch.zeros(5)], [torch.full((5,), -1000.0)], [torch.ones(5)]),  # l = +1000
        ([torch.tensor([0.0, -1000.0]), torch.zeros(0)], [torch.tensor([-1000.0, 0.0]), torch.zeros(0)],
         [torch.ones(2), torch.zeros(0)]),
    ]
    for train, rollout, masks in cases:
        loss, out_masks, metrics = call(cfg, train, rollout, masks)
        assert_all_finite(loss, metrics)
        for m, original in zip(out_masks, masks):
            assert ((m != 0) <= (original != 0)).all()


def test_all_rejected_batch_is_finite_and_zero():
    train = [torch.full((4,), -1000.0), torch.full((3,), -1000.0)]
    loss, masks, metrics = call(FULL, train, [torch.zeros(4), torch.zeros(3)], [torch.ones(4), torch.ones(3)])
    assert all(m.sum() == 0 for m in masks)
    assert loss.abs().sum() == 0
    assert metrics["mis_batch_norm_factor"].tolist() == [1.0] * 7
    assert metrics["mis_ess"].tolist() == [0.0] * 7
    assert metrics["mis_is_ratio_max_final"].tolist() == [0.0] * 7
    assert metrics["mis_is_ratio_batch_max_final"].tolist() == [0.0] * 7
    assert_all_finite(loss, metrics)


def test_long_sequence_16k_is_finite():
    gen = torch.Generator().manual_seed(0)
    train = [-torch.rand(16384, generator=gen) * 2]
    rollout = [train[0] + 0.5 * torch.randn(16384, generator=gen)]  # sum of l ~ N(0, 64): saturates the clamp
    for level in ("token", "sequence", "geometric"):
        cfg = MisConfig(use_tis=True, tis_level=level, tis_batch_normalize=True, tis_upper_bound=1e8)
        loss, masks, metrics = call(cfg, train, rollout, [torch.ones(16384)])
        assert_all_finite(loss, metrics)
        # chi2_seq saturates at exp(+-40) - 1 instead of overflowing
        assert metrics["mis_chi2_seq"][0].item() in (pytest.approx(math.exp(40.0) - 1, rel=1e-5),
                                                     pytest.approx(math.exp(-40.0) - 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    train = [torch.tensor([-1.0, -2.0, -0.5]).to(dtype)]
    rollout = [torch.tensor([-1.1, -1.9, -0.5]).to(dtype)]
    pg = torch.ones(3, dtype=dtype, requires_grad=True)
    loss, masks, metrics = call(MisConfig(use_tis=True), train, rollout, [torch.ones(3, dtype=dtype)], pg_loss=pg)
    assert loss.dtype == dtype and masks[0].dtype == dtype
    assert metrics["mis_kl"].dtype == torch.float32
    expected = torch.exp(train[0].float() - rollout[0].float())
    torch.testing.assert_close(metrics["mis_tis_weight_before_bound"], expected)


def test_inputs_are_not_modified_and_outputs_are_new():
    train = [torch.tensor([0.0, -3.0])]
    rollout = [torch.tensor([0.0, 0.0])]
    masks = [torch.ones(2)]
    snapshot = [t.clone() for t in train + rollout + masks]
    loss, out_masks, _ = call(MisConfig(use_tis=True, tis_mode="mask"), train, rollout, masks)
    for before, after in zip(snapshot, train + rollout + masks):
        assert torch.equal(before, after)
    assert out_masks[0].tolist() == [1, 0]
    assert out_masks[0].data_ptr() != masks[0].data_ptr()


def test_weights_are_detached_and_gradient_flows_through_pg_loss():
    train = [torch.tensor([-1.0, -0.5], requires_grad=True)]
    rollout = [torch.tensor([-1.5, -0.5])]
    pg = torch.tensor([2.0, 3.0], requires_grad=True)
    loss, _, metrics = call(MisConfig(use_tis=True, tis_upper_bound=10.0), train, rollout, [torch.ones(2)], pg)
    loss.sum().backward()
    assert train[0].grad is None
    torch.testing.assert_close(pg.grad, torch.tensor([math.exp(0.5), 1.0]))
    assert not any(v.requires_grad for v in metrics.values())


def test_empty_batch():
    loss, masks, metrics = compute_mis_weights_with_cp(FULL, pg_loss=torch.zeros(0), train_log_probs=[],
                                                       rollout_log_probs=[], loss_masks=[], total_lengths=[],
                                                       response_lengths=[])
    assert loss.numel() == 0 and masks == []
    assert all(v.numel() == 0 for v in metrics.values())


def test_prompt_must_have_a_token():
    with pytest.raises(ValueError, match=r"sequence 0: total_lengths\[0\]=2 must exceed response_lengths\[0\]=2"):
        compute_mis_weights_with_cp(FULL, pg_loss=torch.zeros(2), train_log_probs=[torch.zeros(2)],
                                    rollout_log_probs=[torch.zeros(2)], loss_masks=[torch.ones(2)],
                                    total_lengths=[2], response_lengths=[2])


def test_huge_finite_fill_values_stay_finite():
    train = [torch.tensor([-3.0e38, -1.0, -0.5]), torch.tensor([-1.0])]
    rollout = [torch.tensor([-1.0, -3.0e38, -0.5]), torch.tensor([-1.0])]
    for cfg in ALL_CONFIGS + [MisConfig(use_tis=False)]:
        loss, masks, metrics = call(cfg, train, rollout, [torch.ones(3), torch.ones(1)])
        assert_all_finite(loss, metrics)


def test_float16_loss_is_weighted_in_float32_then_cast():
    # weight e^12 ≈ 1.6e5 is beyond float16, the product 0.1 × 1.6e5 ≈ 1.6e4 is not: it must come out finite
    config = MisConfig(use_tis=True, tis_upper_bound=1e6)
    ell = 12.0
    loss, _, _ = call(config, train=[torch.tensor([ell, 0.0])], rollout=[torch.zeros(2)], masks=[torch.ones(2)],
                      pg_loss=torch.tensor([0.1, 0.1], dtype=torch.float16))
    assert loss.dtype == torch.float16 and bool(torch.isfinite(loss).all())
    want = torch.tensor(0.1, dtype=torch.float16).float() * math.exp(ell)
    assert float(loss[0]) == pytest.approx(float(want), rel=1e-3)
    # a product beyond float16's range saturates at its largest finite value instead of inf
    loss, _, _ = call(config, train=[torch.tensor([ell, 0.0])], rollout=[torch.zeros(2)], masks=[torch.ones(2)],
                      pg_loss=torch.tensor([1.0, -1.0], dtype=torch.float16))
    assert float(loss[0]) == torch.finfo(torch.float16).max and float(loss[1]) == -1.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_or_bool_log_probs_are_refused(dtype):
    good = torch.tensor([-1.0, -2.0])
    bad = torch.tensor([1, 0], dtype=dtype)
    for train, rollout, which in (([bad, bad], [good, good], "train_log_probs[0]"),
                                  ([good, good], [good, bad], "rollout_log_probs[1]")):  # a mixed list too
        with pytest.raises(ValueError, match=rf"sequence \d: {re.escape(which)} has dtype {dtype}: log-probs are "
                                             "floating point"):
            compute_mis_weights(FULL, train_log_probs=train, rollout_log_probs=rollout, loss_masks=[torch.ones(2)] * 2)
    with pytest.raises(ValueError, match=rf"rollout_log_probs has dtype {dtype}: log-probs are floating point"):
        compute_mis_weights_packed(FULL, train_log_probs=good, rollout_log_probs=bad, loss_mask=torch.ones(2),
                                   cu_seqlens=torch.tensor([0, 2]))


def test_complex_loss_says_the_loss_is_real():
    with pytest.raises(ValueError, match=r"pg_loss has dtype torch.complex64: the loss is real"):
        call(FULL, train=[torch.zeros(2)], rollout=[torch.zeros(2)], masks=[torch.ones(2)],
             pg_loss=torch.zeros(2, dtype=torch.complex64))
