"""Rejection by divergence statistics: hand-computed cases per option, asymmetric k1 ranges, config
errors, presets, and the fast path against the per-sequence reference."""

import math

import pytest
import torch
from conftest import random_advantages, random_batch
from test_reference_equivalence import assert_matches_reference

from miles_mis import MisConfig, compute_mis_weights
from miles_mis.config import DIVERGENCE_OPTIONS

# Sequence A: ρ = 1, 3, 1/4 (ℓ = 0, log 3, −log 4); sequence B: ρ = 1.5, 0.8
LOG = [[0.0, math.log(3.0), math.log(0.25)], [math.log(1.5), math.log(0.8)]]


def run(divergence, **cfg):
    train = [torch.tensor(x) for x in LOG]
    return compute_mis_weights(MisConfig(use_tis=True, tis_upper_bound=10.0, rs_divergence=divergence, **cfg),
                               train_log_probs=train, rollout_log_probs=[torch.zeros(3), torch.zeros(2)],
                               loss_masks=[torch.ones(3), torch.ones(2)])


def kept(divergence):
    return [m.tolist() for m in run(divergence)[1]]


def k(estimator, ell):
    return {"k1": -ell, "k2": ell * ell / 2, "k3": math.exp(ell) - ell - 1}[estimator]


@pytest.mark.parametrize("option, threshold, expected", [
    ("token_k1", [0.5, 2.0], [[1, 0, 0], [1, 1]]),
    ("token_k1", [0.2, 2.0], [[1, 0, 1], [1, 1]]),
    ("token_k2", 0.5, [[1, 0, 0], [1, 1]]),        # k2 = 0, 0.60, 0.96 | 0.08, 0.02
    ("token_k2", 0.7, [[1, 1, 0], [1, 1]]),
    ("token_k3", 0.7, [[1, 0, 1], [1, 1]]),        # k3 = 0, 0.90, 0.64 | 0.09, 0.02
    ("seq_sum_k1", [0.7, 1.3], [[1, 1, 1], [1, 1]]),   # products 0.75, 1.2
    ("seq_sum_k1", [0.8, 1.3], [[0, 0, 0], [1, 1]]),
    ("seq_sum_k2", 1.0, [[0, 0, 0], [1, 1]]),      # Σ k2 = 1.56 | 0.11
    ("seq_sum_k3", 1.0, [[0, 0, 0], [1, 1]]),      # Σ k3 = 1.54 | 0.11
    ("seq_mean_k1", [0.9, 1.2], [[1, 1, 1], [1, 1]]),  # geometric means 0.909, 1.095
    ("seq_mean_k1", [0.95, 1.2], [[0, 0, 0], [1, 1]]),
    ("seq_mean_k2", 0.5, [[0, 0, 0], [1, 1]]),     # means 0.52 | 0.053
    ("seq_mean_k3", 0.5, [[0, 0, 0], [1, 1]]),     # means 0.513 | 0.055
    ("seq_max_k2", 0.9, [[0, 0, 0], [1, 1]]),      # max 0.96 | 0.08
    ("seq_max_k2", 1.0, [[1, 1, 1], [1, 1]]),
    ("seq_max_k3", 0.5, [[0, 0, 0], [1, 1]]),      # max 0.90 | 0.09
])
def test_each_option_by_hand(option, threshold, expected):
    assert kept({option: threshold}) == expected


def test_asymmetric_k1_keeps_exactly_the_ratios_inside():
    # [0.2, 2.0]: keeps 1 and 1/4, rejects 3 (verl's inverted bounds would keep 3 and reject 1/4)
    assert kept({"token_k1": [0.2, 2.0]})[0] == [1, 0, 1]
    # [0.5, 4.0]: keeps 1 and 3, rejects 1/4
    assert kept({"token_k1": "0.5_4.0"})[0] == [1, 1, 0]
    # sequence level: product 0.75 is inside [0.7, 0.8], 1.2 is not
    assert kept({"seq_sum_k1": "0.7_0.8"}) == [[1, 1, 1], [0, 0]]


def test_options_are_anded_and_metrics_by_hand():
    _, masks, metrics = run({"token_k2": 0.7, "seq_max_k3": 0.5})
    assert [m.tolist() for m in masks] == [[0, 0, 0], [1, 1]]  # A: seq_max_k3 0.90 > 0.5
    assert metrics["mis_rs_token_k2_masked_token_fraction"][0].tolist() == [0, 0, 1]
    assert metrics["mis_rs_token_k2_masked_seq_fraction"][0].tolist() == [1, 1, 1]
    assert metrics["mis_rs_seq_max_k3_masked_seq_fraction"][1].tolist() == [0, 0]
    ks = [k("k2", x) for seq in LOG for x in seq]
    assert metrics["mis_rs_token_k2_max"][0][0].item() == pytest.approx(max(ks), rel=1e-5)
    assert metrics["mis_rs_token_k2_min"][0][0].item() == pytest.approx(0.0, abs=1e-7)
    assert metrics["mis_rs_token_k2_mean"][0].tolist() == pytest.approx([k("k2", x) for x in LOG[0]], rel=1e-5)
    maxima = [max(k("k3", x) for x in seq) for seq in LOG]
    assert metrics["mis_rs_seq_max_k3_mean"][1].tolist() == pytest.approx([maxima[1]] * 2, rel=1e-5)
    assert metrics["mis_rs_seq_max_k3_min"][0][0].item() == pytest.approx(min(maxima), rel=1e-5)
    assert metrics["mis_rs_divergence_masked_seq_fraction"][0].tolist() == [1, 1, 1]
    assert metrics["mis_rs_divergence_masked_token_fraction"][1].tolist() == [0, 0]


def test_k_statistics_use_the_clamped_log_ratio():
    train = [torch.tensor([-1000.0, 0.0])]
    _, masks, metrics = compute_mis_weights(MisConfig(use_tis=True, rs_divergence={"seq_sum_k2": 1e9}),
                                            train_log_probs=train, rollout_log_probs=[torch.zeros(2)],
                                            loss_masks=[torch.ones(2)])
    assert metrics["mis_rs_seq_sum_k2_mean"][0][0].item() == pytest.approx(200.0)  # 20²/2, not 1000²/2


@pytest.mark.parametrize("value, words", [
    ({"seq_mean_k4": 1.0}, ["seq_mean_k4", "did you mean 'seq_mean_k3'"]),
    ({"seq_max_k1": [0.5, 2]}, ["seq_max_k1", "allowed options"]),
    ({"token_k1": 0.5}, ["rs_divergence.token_k1", "L_U"]),
    ({"token_k1": "2.0_0.5"}, ["rs_divergence.token_k1", "lower < upper"]),
    ({"token_k1": "a_b"}, ["rs_divergence.token_k1 lower", "'a'"]),
    ({"seq_mean_k3": [0.1, 0.2]}, ["rs_divergence.seq_mean_k3", "one upper bound"]),
    ({"seq_mean_k3": -1}, ["rs_divergence.seq_mean_k3", "positive"]),
    ([1, 2], ["rs_divergence", "mapping"]),
])
def test_config_errors(value, words):
    with pytest.raises(ValueError) as info:
        MisConfig(rs_divergence=value)
    for word in words:
        assert word in str(info.value)


def test_yaml_spelling_and_icepop_string_bounds(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rs_divergence: {seq_mean_k1: [0.999, 1.001], seq_max_k3: '5e-1', token_k1: 0.5_2.0}\n"
                    "tis_mode: icepop\ntis_bounds: 0.5_2.0\n")
    cfg = MisConfig.from_yaml(path)
    assert cfg.rs_divergence == (("token_k1", 0.5, 2.0), ("seq_mean_k1", 0.999, 1.001), ("seq_max_k3", None, 0.5))
    assert (cfg.tis_lower_bound, cfg.tis_upper_bound) == (0.5, 2.0)
    assert MisConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="either tis_bounds or the two bounds"):
        MisConfig(tis_bounds="0.5_2", tis_lower_bound=0.4)


PRESETS = ("token_tis", "seq_tis", "token_icepop", "seq_is_rs", "geo_rs", "k3_rs", "metrics_only")


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_from_configs_and_match_the_files(name, repo_root):
    assert MisConfig.preset(name) == MisConfig.from_yaml(repo_root / "configs" / f"{name}.yaml")


def test_preset_contents_and_unknown_name():
    assert MisConfig.preset("geo_rs").rs_divergence == (("seq_mean_k1", 0.999, 1.001),)
    assert MisConfig.preset("k3_rs").rs_divergence == (("seq_mean_k3", None, 0.01),)
    assert MisConfig.preset("seq_is_rs").tis_level == "sequence"
    assert MisConfig.preset("token_icepop").tis_mode == "icepop"
    with pytest.raises(ValueError, match="unknown preset 'geo'.*geo_rs.*token_tis"):
        MisConfig.preset("geo")


def _threshold(option):
    """A threshold that makes the option bite on part of these batches."""
    if option.endswith("k1"):
        return [0.8, 1.25] if option.startswith("token") else [0.6, 1.6] if "sum" in option else [0.95, 1.05]
    if option.endswith(("_tv", "_dtv")):  # p − q in [−α, β]
        return [-0.05, 0.04] if option.startswith("token") else [-0.01, 0.01]
    return 0.02 if option.startswith("token") or "mean" in option else 0.1


DIVERGENCE_CONFIGS = [{option: _threshold(option)} for option in DIVERGENCE_OPTIONS]
DIVERGENCE_CONFIGS += [{"token_k3": 0.02, "seq_mean_k1": [0.95, 1.05], "seq_max_k2": 0.05},
                       # directional with the others: DPPO's token rule beside VACO's gate and a sequence rejection
                       {"token_dtv": [-0.05, 0.04], "seq_mean_datv": 0.01, "seq_mean_dbkl": 0.002, "seq_max_k3": 0.05}]


@pytest.mark.parametrize("divergence", DIVERGENCE_CONFIGS, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("level", ["token", "geometric"])
def test_fast_path_matches_reference(divergence, level):
    cfg = MisConfig(use_tis=True, tis_level=level, tis_mode="truncate", tis_upper_bound=1.5, use_rs=True,
                    rs_level="token", rs_lower_bound=0.7, rs_upper_bound=1.4, rs_veto_threshold=0.6,
                    tis_batch_normalize=True, rs_divergence=divergence)
    for seed in range(3):
        train, rollout, masks = random_batch(seed, noise=0.15, nonfinite=seed == 2)
        assert_matches_reference(cfg, train, rollout, masks, advantages=random_advantages(masks, seed))


def test_preset_use_tis_and_exclusive_bounds_spelling(tmp_path):
    assert MisConfig.preset("token_tis").use_tis is False  # left to the host flag, like the file
    assert MisConfig.preset("token_tis", use_tis=True).use_tis is True
    assert MisConfig.preset("metrics_only", use_tis=True).use_tis is False  # the preset sets it itself
    path = tmp_path / "c.yaml"
    path.write_text("tis_bounds: [0.5, 4]\ntis_upper_bound: 2.0\n")
    with pytest.raises(ValueError, match="either tis_bounds or the two bounds"):
        MisConfig.from_yaml(path)


# --------------------------------------------------------------------------- in probability space (DPPO, KPop)
PROBABILITY_OPTIONS = [
    {"token_tv": [-0.05, 0.04]}, {"seq_mean_tv": [-0.01, 0.01]}, {"token_atv": 0.05}, {"seq_mean_atv": 0.02},
    {"seq_max_atv": 0.1}, {"token_bkl": 0.01}, {"seq_sum_bkl": 0.05}, {"seq_mean_bkl": 0.005}, {"seq_max_bkl": 0.02},
    {"token_atv": 0.05, "seq_mean_k1": [0.97, 1.03], "seq_max_bkl": 0.05},
]


@pytest.mark.parametrize("options", PROBABILITY_OPTIONS, ids=lambda o: "+".join(o))
def test_probability_space_options_match_the_reference(options):
    from test_reference_equivalence import assert_matches_reference

    for seed in range(3):
        train, rollout, masks = random_batch(seed, noise=0.3, nonfinite=seed == 2)
        assert_matches_reference(MisConfig(use_tis=True, rs_divergence=options), train, rollout, masks)


def test_binary_tv_and_kl_hand_case_where_a_ratio_mask_disagrees():
    """p = 1e-3 against q = 1e-4 is a ratio of 10 but moves 9e-4 of probability; 0.99 against 0.60 is a ratio of
    1.65 but moves 0.39. A ratio mask [0.5, 2] rejects the first and keeps the second; |p − q| ≤ 0.1 the reverse."""
    train = [torch.tensor([math.log(1e-3), math.log(0.99)])]
    rollout = [torch.tensor([math.log(1e-4), math.log(0.60)])]
    masks = [torch.ones(2)]
    ratio = MisConfig(use_tis=True, rs_divergence={"token_k1": [0.5, 2.0]})
    tv = MisConfig(use_tis=True, rs_divergence={"token_atv": 0.1})
    assert compute_mis_weights(ratio, train_log_probs=train, rollout_log_probs=rollout,
                               loss_masks=masks)[1][0].tolist() == [0.0, 1.0]
    _, kept, metrics = compute_mis_weights(tv, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert kept[0].tolist() == [1.0, 0.0]
    assert metrics["mis_rs_token_atv_mean"][0].tolist() == pytest.approx([9e-4, 0.39], rel=1e-5)
    bkl = MisConfig(use_tis=True, rs_divergence={"token_bkl": 0.01})
    _, kept, metrics = compute_mis_weights(bkl, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    q_log = lambda p, q: q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # noqa: E731
    assert metrics["mis_rs_token_bkl_mean"][0].tolist() == pytest.approx([q_log(1e-3, 1e-4), q_log(0.99, 0.6)],
                                                                         rel=1e-5)
    assert kept[0].tolist() == [1.0, 0.0]


def test_probability_estimators_are_precise_near_one_and_never_nan():
    from miles_mis.correction.divergence import probability_estimators

    log_p = torch.tensor([-1e-12, 0.0, 0.0, -1e-3, math.log(1e-30)], dtype=torch.float64)
    log_q = torch.tensor([-2e-12, 0.0, -0.1, -1e-3, math.log(2e-30)], dtype=torch.float64)
    values = probability_estimators(log_p - log_q, log_p, log_q, ("tv", "atv", "bkl"))
    assert all(bool(torch.isfinite(v).all()) for v in values.values())
    assert values["tv"][0].item() == pytest.approx(1e-12, rel=1e-6)  # no cancellation in p − q
    assert values["bkl"][1].item() == 0.0 and values["bkl"][3].item() == 0.0  # p = q
    assert values["bkl"][2].item() > 10  # p = 1 > q: KL is infinite, reported large and finite
    # exactly the documented value (docs/math.md): log(1 − p) held at −745, so bkl = q·log(q/p) + (1 − q)(log(1 − q)
    # + 745) at p = 1, q = e^−0.1 (a clamp of log p before the log would give log(1e-300) ≈ −690.8 instead)
    q_2 = math.exp(-0.1)
    assert values["bkl"][2].item() == pytest.approx(q_2 * -0.1 + (1 - q_2) * (math.log(1 - q_2) + 745.0), rel=1e-12)
    # KL(Bern(q) ‖ Bern(p)) ≈ (p − q)² / (2 q (1 − q)) for p ≈ q: here with q = 1 − 2e-12 the formula's 1 − q
    # comes from expm1, not from 1 − q in float64
    q, p = 1 - 2e-12, 1 - 1e-12
    assert values["bkl"][0].item() == pytest.approx((p - q) ** 2 / (2 * q * (1 - q)), rel=1e-3)


@pytest.mark.parametrize("options, message", [
    ({"token_tv": 0.2}, "a tv option takes the range"),
    ({"token_tv": [0.1, 0.2]}, "a tv option takes the range"),
    ({"token_tv": [-1.5, 0.2]}, "a tv option takes the range"),
    ({"token_atv": 1.0}, "|p_train − p_rollout| is at most 1"),
    ({"token_bkl": [0.1, 0.2]}, "take one upper bound"),
    ({"seq_sum_tv": [-0.1, 0.1]}, "unknown option 'seq_sum_tv'"),
    # the directional ones, as their undirected statistics
    ({"token_dtv": 0.2}, "a tv option takes the range"),
    ({"seq_mean_datv": 1.5}, "|p_train − p_rollout| is at most 1"),
    ({"token_dbkl": [0.1, 0.2]}, "take one upper bound"),
    ({"seq_max_datv": 0.1}, r"unknown option 'seq_max_datv' \(did you mean 'seq_max_atv'\?\)"),
])
def test_probability_space_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        MisConfig(rs_divergence=options)
