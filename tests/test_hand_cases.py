"""Small cases computed by hand, one per mode and level, plus veto, RS and batch normalisation.

Sequence A: rollout log-probs 0, train log-probs log(1), log(3), log(1/4)  -> rho = 1, 3, 0.25
Sequence B: rollout log-probs 0, train log-probs log(1.5), log(0.8)         -> rho = 1.5, 0.8
"""

import math

import pytest
import torch

from miles_mis import MisConfig, compute_mis_weights


def batch():
    train = [torch.tensor([0.0, math.log(3.0), math.log(0.25)]), torch.tensor([math.log(1.5), math.log(0.8)])]
    rollout = [torch.zeros(3), torch.zeros(2)]
    masks = [torch.ones(3), torch.ones(2)]
    return dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


def run(**cfg):
    return compute_mis_weights(MisConfig(use_tis=True, **cfg), **batch())


def values(tensors):
    return [[round(float(x), 5) for x in t] for t in tensors]


@pytest.mark.parametrize("mode, weights, masks", [
    ("truncate", [[1, 2, 0.25], [1.5, 0.8]], [[1, 1, 1], [1, 1]]),
    ("clip", [[1, 2, 0.5], [1.5, 0.8]], [[1, 1, 1], [1, 1]]),
    ("mask", [[1, 0, 0], [1.5, 0.8]], [[1, 0, 0], [1, 1]]),  # rejected tokens get weight 0
    ("icepop", [[1, 0, 0], [1.5, 0.8]], [[1, 1, 1], [1, 1]]),  # zero weight, mask unchanged
])
def test_token_level_modes(mode, weights, masks):
    w, m, metrics = run(tis_mode=mode, tis_lower_bound=0.5, tis_upper_bound=2.0)
    assert values(w) == weights
    assert values(m) == masks
    assert values(metrics["mis_tis_weight_before_bound"]) == [[1, 3, 0.25], [1.5, 0.8]]


def test_token_level_fraction_metrics():
    _, _, metrics = run(tis_mode="clip", tis_lower_bound=0.5, tis_upper_bound=2.0)
    assert values(metrics["mis_tis_clip_fraction_high"]) == [[0, 1, 0], [0, 0]]
    assert values(metrics["mis_tis_clip_fraction_low"]) == [[0, 0, 1], [0, 0]]
    _, _, metrics = run(tis_mode="truncate", tis_upper_bound=2.0)
    assert values(metrics["mis_tis_truncate_fraction"]) == [[0, 1, 0], [0, 0]]
    assert "mis_tis_clip_fraction_low" not in metrics


def test_sequence_level():
    # A: product 1*3*0.25 = 0.75; B: 1.5*0.8 = 1.2
    w, m, metrics = run(tis_level="sequence", tis_mode="truncate", tis_upper_bound=1.0)
    assert values(w) == [[0.75] * 3, [1.0] * 2]
    assert values(metrics["mis_tis_weight_before_bound"]) == [[0.75] * 3, [1.2] * 2]
    assert values(metrics["mis_tis_truncate_fraction"]) == [[0] * 3, [1] * 2]
    w, m, _ = run(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=2.0)
    assert values(m) == [[0] * 3, [1] * 2]
    assert values(w) == [[0] * 3, [1.2] * 2]


def test_geometric_level():
    # A: 0.75 ** (1/3) = 0.90856; B: 1.2 ** (1/2) = 1.09545
    w, _, _ = run(tis_level="geometric", tis_mode="clip", tis_lower_bound=0.95, tis_upper_bound=1.05)
    assert values(w) == [[0.95] * 3, [1.05] * 2]
    w, _, _ = run(tis_level="geometric", tis_mode="truncate", tis_upper_bound=2.0)
    assert values(w) == [[round(0.75 ** (1 / 3), 5)] * 3, [round(1.2 ** 0.5, 5)] * 2]
    w, m, _ = run(tis_level="geometric", tis_mode="icepop", tis_lower_bound=0.95, tis_upper_bound=1.2)
    assert values(w) == [[0] * 3, [round(1.2 ** 0.5, 5)] * 2]
    assert values(m) == [[1] * 3, [1] * 2]


def test_rejection_sampling_levels():
    _, m, metrics = run(use_rs=True, rs_level="token", rs_lower_bound=0.5, rs_upper_bound=2.0)
    assert values(m) == [[1, 0, 0], [1, 1]]
    assert values(metrics["mis_rs_mask_fraction_high"]) == [[0, 1, 0], [0, 0]]
    assert values(metrics["mis_rs_mask_fraction_low"]) == [[0, 0, 1], [0, 0]]
    _, m, metrics = run(use_rs=True, rs_level="sequence", rs_lower_bound=0.8, rs_upper_bound=1.25)
    assert values(m) == [[0] * 3, [1] * 2]
    assert values(metrics["mis_rs_mask_fraction_low"]) == [[1] * 3, [0] * 2]
    _, m, _ = run(use_rs=True, rs_level="geometric", rs_lower_bound=0.95, rs_upper_bound=1.2)
    assert values(m) == [[0] * 3, [1] * 2]


def test_veto_independent_of_rs():
    # rho = 0.25 < 0.3 in A: the whole of A is rejected, even with use_rs false (miles needs use_rs)
    w, m, metrics = run(rs_veto_threshold=0.3)
    assert values(m) == [[0] * 3, [1] * 2]
    assert values(w) == [[0] * 3, [1.5, 0.8]]
    assert values(metrics["mis_rs_catastrophic_token_fraction"]) == [[0, 0, 1], [0, 0]]
    assert values(metrics["mis_rs_catastrophic_seq_fraction"]) == [[1] * 3, [0] * 2]


def test_veto_threshold_below_clamp():
    # l = -1000 is clamped to -20 for weights, but the veto reads the raw log ratio
    train = [torch.tensor([-1000.0, 0.0]), torch.tensor([0.0])]
    w, m, _ = compute_mis_weights(MisConfig(use_tis=True, rs_veto_threshold=1e-12), train_log_probs=train,
                                  rollout_log_probs=[torch.zeros(2), torch.zeros(1)],
                                  loss_masks=[torch.ones(2), torch.ones(1)])
    assert values(m) == [[0, 0], [1]]


def test_batch_normalize_token_level():
    # truncate at 2: kept weights 1, 2, 0.25, 1.5, 0.8 -> mean 5.55 / 5 = 1.11
    w, _, metrics = run(tis_mode="truncate", tis_upper_bound=2.0, tis_batch_normalize=True)
    assert values(w) == [[round(x / 1.11, 5) for x in (1, 2, 0.25)], [round(x / 1.11, 5) for x in (1.5, 0.8)]]
    assert values(metrics["mis_batch_norm_factor"]) == [[1.11] * 3, [1.11] * 2]
    # mask mode: rejected tokens do not enter the mean (miles averages them in): kept 1, 1.5, 0.8 -> 3.3/3
    w, _, _ = run(tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0, tis_batch_normalize=True)
    assert values(w) == [[round(1 / 1.1, 5), 0, 0], [round(1.5 / 1.1, 5), round(0.8 / 1.1, 5)]]


def test_batch_normalize_sequence_level_counts_sequences_not_tokens():
    # weights 0.75 (3 tokens) and 1.2 (2 tokens): mean over sequences = 0.975, over tokens would be 0.93
    w, _, _ = run(tis_level="sequence", tis_mode="truncate", tis_upper_bound=5.0, tis_batch_normalize=True)
    assert values(w) == [[round(0.75 / 0.975, 5)] * 3, [round(1.2 / 0.975, 5)] * 2]
    # geometric level works (miles raises) and an empty or rejected sequence does not enter the mean
    b = batch()
    b["train_log_probs"].append(torch.zeros(0))
    b["rollout_log_probs"].append(torch.zeros(0))
    b["loss_masks"].append(torch.zeros(0))
    w, _, metrics = compute_mis_weights(
        MisConfig(use_tis=True, tis_level="geometric", tis_batch_normalize=True, rs_veto_threshold=0.3), **b)
    # A is vetoed: only B (1.2 ** 0.5) is trained -> its weight becomes exactly 1
    assert values(w) == [[0] * 3, [1.0] * 2, []]
    assert values(metrics["mis_batch_norm_factor"])[1] == [round(1.2 ** 0.5, 5)] * 2


def test_final_statistics_and_ess():
    # truncate at 2, no normalisation: final weights 1, 2, 0.25, 1.5, 0.8 over 5 valid tokens
    _, _, metrics = run(tis_mode="truncate", tis_upper_bound=2.0)
    # miles' meaning: each sequence's own extremes (seq 0: 1, 2, 0.25; seq 1: 1.5, 0.8); batch extremes apart
    assert values(metrics["mis_is_ratio_max_final"]) == [[2.0] * 3, [1.5] * 2]
    assert values(metrics["mis_is_ratio_min_final"]) == [[0.25] * 3, [0.8] * 2]
    assert values(metrics["mis_is_ratio_batch_max_final"]) == [[2.0] * 3, [2.0] * 2]
    assert values(metrics["mis_is_ratio_batch_min_final"]) == [[0.25] * 3, [0.25] * 2]
    ws = [1, 2, 0.25, 1.5, 0.8]
    ess = sum(ws) ** 2 / (5 * sum(x * x for x in ws))
    assert values(metrics["mis_ess"]) == [[round(ess, 5)] * 3, [round(ess, 5)] * 2]
    assert values(metrics["mis_is_ratio_mean_final"]) == [[1, 2, 0.25], [1.5, 0.8]]


def test_mismatch_metrics_by_hand():
    _, _, metrics = compute_mis_weights(MisConfig(use_tis=False), **batch())
    lr_a = [0.0, math.log(3.0), math.log(0.25)]  # l = train - rollout
    mean_a = sum(lr_a) / 3
    expect = {
        "mis_training_log_ppl": -mean_a, "mis_training_ppl": math.exp(-mean_a),
        "mis_rollout_log_ppl": 0.0, "mis_rollout_ppl": 1.0,
        "mis_kl": -mean_a, "mis_log_ppl_diff": -mean_a, "mis_log_ppl_abs_diff": abs(mean_a),
        "mis_ppl_ratio": math.exp(-mean_a),
        "mis_k3_kl": sum(math.exp(x) - x - 1 for x in lr_a) / 3,
        "mis_chi2_token": (1 + 9 + 1 / 16) / 3 - 1,
        "mis_chi2_seq": 0.75 ** 2 - 1,
        "mis_nonfinite_token_fraction": 0.0,
    }
    # batch-level: where the mismatch lives and the gate's statistics, over all 5 tokens (B: l = log 1.5, log 0.8)
    lr_b = [math.log(1.5), math.log(0.8)]
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    batch_level = {
        "mis_k3_first_token": (k3(lr_a[0]) + k3(lr_b[0])) / 2, "mis_k3_position_0_1": (k3(lr_a[0]) + k3(lr_b[0])) / 2,
        "mis_k3_position_1_16": (k3(lr_a[1]) + k3(lr_a[2]) + k3(lr_b[1])) / 3,
        "mis_k3_position_16_128": 0.0, "mis_k3_position_128_1024": 0.0, "mis_k3_position_1024_8192": 0.0,
        "mis_k3_position_8192_inf": 0.0,
        "mis_k3_low_rollout_prob": 0.0, "mis_low_rollout_prob_token_fraction": 0.0,  # every rollout p is 1
        "mis_batch_k3": sum(k3(x) for x in lr_a + lr_b) / 5, "mis_batch_kl": -sum(lr_a + lr_b) / 5,
        "mis_batch_max_abs_log_ratio": math.log(4.0),
    }
    # the truncation detector: 2 of the 4 nonzero l are negative; mean / std over the 5 usable tokens; too few
    # tokens for an alarm
    ells = lr_a + lr_b
    mean = sum(ells) / 5
    batch_level.update({"mis_log_ratio_negative_fraction": 0.5,
                        "mis_log_ratio_standardized_mean": mean / math.sqrt(sum(x * x for x in ells) / 5 - mean ** 2),
                        "mis_log_ratio_mean": mean, "mis_unreplayed_truncation": 0.0})
    assert sorted(metrics) == sorted(list(expect) + list(batch_level))
    for name, value in expect.items():
        assert values(metrics[name])[0] == [round(value, 5)] * 3, name
    for name, value in batch_level.items():
        assert values(metrics[name]) == [[round(value, 5)] * 3, [round(value, 5)] * 2], name


def test_low_rollout_probability_metrics_by_hand():
    # rollout p = e^-3 ~ 0.05 < 0.1 on two of the four tokens
    train = [torch.tensor([-3.5, -0.1, -2.0, -0.2])]
    rollout = [torch.tensor([-3.0, -0.1, -3.0, -0.3])]
    _, _, metrics = compute_mis_weights(MisConfig(use_tis=False), train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=[torch.ones(4)])
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    assert values(metrics["mis_k3_low_rollout_prob"])[0][0] == round((k3(-0.5) + k3(1.0)) / 2, 5)
    assert values(metrics["mis_low_rollout_prob_token_fraction"])[0][0] == 0.5
    _, _, strict = compute_mis_weights(MisConfig(use_tis=False, metrics_low_prob_threshold=0.01),
                                       train_log_probs=train, rollout_log_probs=rollout, loss_masks=[torch.ones(4)])
    assert values(strict["mis_low_rollout_prob_token_fraction"])[0][0] == 0.0


def test_metrics_only_leaves_masks_and_has_no_weights():
    w, m, metrics = compute_mis_weights(MisConfig(use_tis=False, use_rs=True, rs_veto_threshold=0.3), **batch())
    assert w is None
    assert values(m) == [[1, 1, 1], [1, 1]]
    assert not any(name.startswith(("mis_tis", "mis_rs", "mis_is_")) for name in metrics)
