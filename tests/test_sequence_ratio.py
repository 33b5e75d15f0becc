"""One sequence ratio: every spelling of a sequence- or geometric-level ratio test reads the same Σ_t ℓ_t, unclamped
per token (docs/math.md#one-sequence-ratio).

The reproducer: one sequence, mask all 1, rollout log-probs [−30, −1, −1, −1], trainer [−5, −10, −10, −3.5], so
ℓ = [25, −9, −9, −2.5]. The product ratio is e^{Σℓ} = e^{4.5} ≈ 90.0 and the geometric mean e^{1.125} ≈ 3.08. A
per-token clamp to ±20 would make them e^{−0.5} ≈ 0.61 and e^{−0.125} ≈ 0.88 instead, inside a [0.5, 2] band.
"""

import math

import pytest
import torch

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed

ROLLOUT = [-30.0, -1.0, -1.0, -1.0]
TRAIN = [-5.0, -10.0, -10.0, -3.5]
LOG_RATIO_SUM = 4.5  # 25 − 9 − 9 − 2.5: by hand
BAND = [0.5, 2.0]  # rejects e^{4.5} and e^{1.125}; a per-token clamp would keep both (0.61, 0.88)
WIDE = [0.7, 100.0]  # keeps e^{4.5} ≈ 90; a per-token clamp would reject it (e^{−0.5} ≈ 0.61 < 0.7)


def band_keys(band):
    return {"tis_lower_bound": band[0], "tis_upper_bound": band[1]}


def spellings(band, level="sequence"):
    """Every way the config can test a sequence's ratio at ``level`` (sequence: the product, geometric: the mean)
    against ``band``: (name, MisConfig keys)."""
    low, high = band
    option = {"sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}[level]
    unbounded = {"tis_upper_bound": 1.0e6}  # the IS weight leaves the decision to the stage under test
    return [
        (f"tis_mode: mask, {level}", dict(tis_level=level, tis_mode="mask", **band_keys(band))),
        (f"use_rs, {level}", dict(use_rs=True, rs_level=level, rs_lower_bound=low, rs_upper_bound=high, **unbounded)),
        (f"rs_divergence {option}", dict(rs_divergence={option: [low, high]}, **unbounded)),
    ]


def kept_mask(config: MisConfig) -> list[float]:
    _, masks, _ = compute_mis_weights(config, train_log_probs=[torch.tensor(TRAIN)],
                                      rollout_log_probs=[torch.tensor(ROLLOUT)], loss_masks=[torch.ones(4)])
    return masks[0].tolist()


def test_the_reproducer_by_hand():
    ell = [t - r for t, r in zip(TRAIN, ROLLOUT)]
    assert ell == [25.0, -9.0, -9.0, -2.5]
    assert sum(ell) == LOG_RATIO_SUM
    clamped = sum(min(max(x, -20.0), 20.0) for x in ell)
    assert clamped == -0.5  # the per-token clamped sum: inside BAND, below WIDE's lower end
    assert BAND[0] <= math.exp(clamped) <= BAND[1] and math.exp(clamped) < WIDE[0]
    assert BAND[0] <= math.exp(clamped / 4) <= BAND[1] and math.exp(clamped / 4) > WIDE[0]


@pytest.mark.parametrize("name, keys", spellings(BAND) + spellings(BAND, "geometric"))
def test_every_spelling_rejects_the_reproducer_in_a_band_that_excludes_its_ratio(name, keys):
    assert kept_mask(MisConfig(use_tis=True, **keys)) == [0.0] * 4, name


@pytest.mark.parametrize("name, keys", spellings(WIDE))
def test_every_sequence_spelling_keeps_it_where_the_band_holds_the_product(name, keys):
    # e^{4.5} ≈ 90 lies in [0.7, 100]; the per-token clamped product 0.61 would not
    assert kept_mask(MisConfig(use_tis=True, **keys)) == [1.0] * 4, name


@pytest.mark.parametrize("name, keys", spellings([1.5, 100.0], "geometric"))
def test_every_geometric_spelling_keeps_it_where_the_band_holds_the_mean(name, keys):
    # e^{1.125} ≈ 3.08 lies in [1.5, 100]; the per-token clamped mean 0.88 would not
    assert kept_mask(MisConfig(use_tis=True, **keys)) == [1.0] * 4, name


@pytest.mark.parametrize("preset", ["seq_mis", "seq_is_rs"])
def test_both_sequence_presets_reject_it(preset):
    assert kept_mask(MisConfig.preset(preset, use_tis=True)) == [0.0] * 4


def test_seq_is_rs_weight_where_kept_is_the_truncated_product():
    # the preset's IS weight: min(e^{Σℓ}, 2) = 2 (e^{4.5} ≈ 90 truncated), its band widened to keep the sequence
    config = MisConfig(**{**MisConfig.preset("seq_is_rs", use_tis=True).to_dict(),
                          "rs_divergence": {"seq_sum_k1": WIDE}})
    weights, masks, _ = compute_mis_weights(config, train_log_probs=[torch.tensor(TRAIN)],
                                            rollout_log_probs=[torch.tensor(ROLLOUT)], loss_masks=[torch.ones(4)])
    assert masks[0].tolist() == [1.0] * 4
    assert weights[0].tolist() == [2.0] * 4


def test_the_k1_statistic_reported_is_the_unclamped_sum_and_mean():
    config = MisConfig(use_tis=True, tis_upper_bound=1.0e6,
                       rs_divergence={"seq_sum_k1": WIDE, "seq_mean_k1": [0.01, 100.0], "token_k1": [1e-8, 1e8]})
    _, _, metrics = compute_mis_weights(config, train_log_probs=[torch.tensor(TRAIN)],
                                        rollout_log_probs=[torch.tensor(ROLLOUT)], loss_masks=[torch.ones(4)])
    assert metrics["mis_rs_seq_sum_k1_mean"][0].tolist() == [-LOG_RATIO_SUM] * 4
    assert metrics["mis_rs_seq_mean_k1_mean"][0].tolist() == [-LOG_RATIO_SUM / 4] * 4
    assert metrics["mis_rs_token_k1_mean"][0].tolist() == [-25.0, 9.0, 9.0, 2.5]


@pytest.mark.parametrize("name, keys", spellings(BAND) + spellings(BAND, "geometric"))
def test_the_packed_entry_point_gives_the_same_answer(name, keys):
    config = MisConfig(use_tis=True, **keys)
    _, mask, _ = compute_mis_weights_packed(config, train_log_probs=torch.tensor(TRAIN),
                                            rollout_log_probs=torch.tensor(ROLLOUT), loss_mask=torch.ones(4),
                                            cu_seqlens=torch.tensor([0, 4]))
    assert mask.tolist() == kept_mask(config) == [0.0] * 4, name
