"""miles_mis.analyze.advisor: candidate grid, evaluation over the dump, recommendation rules, the YAML file."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, random_batch

from miles_mis import MisConfig, cli, compute_mis_weights
from miles_mis.analyze import advisor
from miles_mis.analyze.advisor import CandidateEvaluator, Recommendation, candidate_grid, recommend, write_config
from miles_mis.analyze.reading import CallBatch

QUANTILES = {"0.001": -0.5, "0.01": -0.2, "0.05": -0.1, "0.5": 0.0, "0.95": 0.1, "0.99": 0.2, "0.999": 0.5}


def call_batch(old, rollout, masks, advantages=None, call=0):
    n = len(old)
    return CallBatch(calls=[call] * n if isinstance(call, int) else list(call), indices=list(range(n)),
                     response_lengths=[t.numel() for t in old], old_log_probs=old, rollout_log_probs=rollout,
                     loss_masks=masks, advantages=advantages if advantages is not None else [None] * n,
                     positions=[torch.arange(t.numel()) for t in old], lags=[None] * n)


def evaluate(candidates, *batches):
    evaluator = CandidateEvaluator(candidates)
    for batch in batches:
        evaluator.update(batch)
    return evaluator.results()


def hand_batch():
    """Two sequences with ratios ρ = exp(log π_old − log π_rollout) = [3, 1, 0.8] and [1.5, 4 (masked)];
    advantages [1, −1, 2] and [−2, 5]."""
    rollout = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -0.7])]
    ratios = [torch.tensor([3.0, 1.0, 0.8]), torch.tensor([1.5, 4.0])]
    old = [r + q.log() for r, q in zip(rollout, ratios)]
    masks = [torch.ones(3), torch.tensor([1.0, 0.0])]
    advantages = [torch.tensor([1.0, -1.0, 2.0]), torch.tensor([-2.0, 5.0])]
    return call_batch(old, rollout, masks, advantages)


def token(mode, lower, upper, **extra):
    return MisConfig(use_tis=True, tis_level="token", tis_mode=mode, tis_lower_bound=lower, tis_upper_bound=upper,
                     **extra)


# ------------------------------------------------------------------------------------------- hand cases
def test_token_truncate_by_hand():
    """U = 2: w = [2, 1, 0.8, 1.5] on the 4 valid tokens; Σw = 5.3, Σw² = 7.89; ρ = 3 is the one bounded.
    signal: Σ|A||w−1| = 1·1 + 1·0 + 2·0.2 + 2·0.5 = 2.4 over Σ|A| = 6;
    Σ A(w−1) = 1 − 0.4 − 1 = −0.4."""
    row = evaluate({"t": token("truncate", None, 2.0)}, hand_batch())["t"]
    assert row["kept_token_fraction"] == 1.0 and row["kept_sequence_fraction"] == 1.0
    assert row["ess"] == pytest.approx(5.3 ** 2 / (4 * 7.89), rel=1e-5)
    assert row["mean_final_weight"] == pytest.approx(5.3 / 4, rel=1e-5)
    assert row["max_final_weight"] == pytest.approx(2.0)
    assert row["bounded_fraction"] == 0.25
    assert row["signal_shift"] == pytest.approx(2.4 / 6, rel=1e-5)
    assert row["signal_bias"] == pytest.approx(-0.4 / 6, rel=1e-4)
    assert row["config"] == token("truncate", None, 2.0).to_dict()


def test_token_mask_and_icepop_by_hand():
    """[0.5, 2]: ρ = 3 leaves the range. mask rejects it (kept 3/4, nothing bounded), IcePop keeps it with weight 0
    (kept 4/4, bounded 1/4); both have w = [0, 1, 0.8, 1.5]: Σw = 3.3, Σw² = 3.89."""
    results = evaluate({"mask": token("mask", 0.5, 2.0), "icepop": token("icepop", 0.5, 2.0)}, hand_batch())
    mask, icepop = results["mask"], results["icepop"]
    assert mask["kept_token_fraction"] == 0.75 and mask["kept_sequence_fraction"] == 1.0
    assert mask["bounded_fraction"] == 0.0
    assert mask["mean_final_weight"] == pytest.approx(3.3 / 3, rel=1e-5)
    assert icepop["kept_token_fraction"] == 1.0 and icepop["bounded_fraction"] == 0.25
    assert icepop["mean_final_weight"] == pytest.approx(3.3 / 4, rel=1e-5)
    for row in (mask, icepop):
        assert row["ess"] == pytest.approx(3.3 ** 2 / (4 * 3.89), rel=1e-5)
        assert row["max_final_weight"] == pytest.approx(1.5)
        # Σ|A||w−1| = 1·1 + 0 + 2·0.2 + 2·0.5 = 2.4 (the rejected token counts as w = 0)
        assert row["signal_shift"] == pytest.approx(2.4 / 6, rel=1e-5)


def test_everything_rejected_gives_zero_ess_and_none_means():
    """Geometric mask [0.999, 1.001]: both sequences leave it (mean ℓ = log(2.4)/3 and log 1.5)."""
    row = evaluate({"g": MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.999,
                                   tis_upper_bound=1.001)}, hand_batch())["g"]
    assert row["kept_token_fraction"] == 0.0 and row["kept_sequence_fraction"] == 0.0 and row["ess"] == 0.0
    assert row["mean_final_weight"] is None and row["max_final_weight"] is None and row["bounded_fraction"] is None
    assert row["signal_shift"] == pytest.approx(1.0)  # every token's signal removed: shift 1


def test_metrics_only_is_the_uncorrected_baseline_and_no_advantages_give_none():
    batch = hand_batch()
    no_advantages = call_batch(batch.old_log_probs, batch.rollout_log_probs, batch.loss_masks)
    row = evaluate({"m": MisConfig(use_tis=False)}, batch)["m"]
    assert (row["kept_token_fraction"], row["ess"], row["bounded_fraction"], row["signal_shift"]) == (1.0, 1.0, 0.0,
                                                                                                      0.0)
    row = evaluate({"t": token("truncate", None, 2.0)}, no_advantages)["t"]
    assert row["signal_shift"] is None and row["signal_bias"] is None and row["ess"] is not None


@pytest.mark.parametrize("config", [
    token("truncate", None, 2.0), token("icepop", 0.5, 2.0),
    MisConfig.preset("mis", use_tis=True), MisConfig.preset("geo_rs", use_tis=True),
    MisConfig.preset("seq_tis", use_tis=True), MisConfig.preset("metrics_only", use_tis=True),
    MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"token_tv": [-0.2, 0.2]}),
    MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"token_bkl": 0.01}),
    MisConfig(use_tis=True, tis_upper_bound=2.0, rs_divergence={"token_dtv": [-0.2, 0.2]}),
    # the adaptive bound: the evaluator runs the bound step too (core.correct), at token and sequence level
    MisConfig(use_tis=True, tis_upper_bound="auto"),
    MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto"),
], ids=["token-truncate", "token-icepop", "mis", "geo_rs", "seq_tis", "metrics_only", "binary-tv", "binary-kl",
        "dppo", "token-auto", "sequence-auto"])
def test_numbers_are_those_of_compute_mis_weights(config):
    """The evaluator runs the plugin's steps itself; the numbers must be the public API's (the directional
    candidate with the dump's advantages)."""
    old, rollout, masks = random_batch(3, num_seqs=16, noise=0.4 if config.tis_level == "token" else 0.002,
                                       nonfinite=True)
    gen = torch.Generator().manual_seed(3)
    advantages = [torch.randn(t.numel(), generator=gen) for t in old]
    [row] = evaluate({"c": config}, call_batch(old, rollout, masks, advantages)).values()
    weights, new_masks, metrics = compute_mis_weights(config, train_log_probs=old, rollout_log_probs=rollout,
                                                      loss_masks=masks, advantages=advantages)
    valid = torch.cat(masks) != 0
    kept = (torch.cat(new_masks) != 0) & valid
    w = torch.cat(weights).double() if weights is not None else valid.double()
    assert row["kept_token_fraction"] == pytest.approx(float(kept.sum() / valid.sum()))
    sum_sq = float(w.square().sum())
    ess = float(w.sum()) ** 2 / (float(valid.sum()) * sum_sq) if sum_sq else 0.0
    assert row["ess"] == pytest.approx(ess, rel=1e-6)  # float32 products, float64 sums
    if not kept.any():
        assert row["mean_final_weight"] is None and row["bounded_fraction"] is None
        return
    assert row["mean_final_weight"] == pytest.approx(float(w[kept].mean()), rel=1e-6)
    assert row["max_final_weight"] == pytest.approx(float(w[kept].max()))
    if weights is not None:
        changed = torch.cat(metrics["mis_tis_weight_after_bound"]) != torch.cat(metrics["mis_tis_weight_before_bound"])
        assert row["bounded_fraction"] == pytest.approx(float((changed & kept).sum() / kept.sum()))
    sequences = [bool((m != 0).any()) for m in masks]
    kept_sequences = [bool(((m != 0) & (n != 0)).any()) for m, n in zip(masks, new_masks)]
    assert row["kept_sequence_fraction"] == pytest.approx(sum(kept_sequences) / sum(sequences))


# ------------------------------------------------------------------------------------------- streaming
def three_calls():
    batches = []
    for call in range(3):
        old, rollout, masks = random_batch(10 + call, num_seqs=9, noise=0.3)
        gen = torch.Generator().manual_seed(call)
        advantages = [torch.randn(t.numel(), generator=gen) for t in old]
        batches.append(call_batch(old, rollout, masks, advantages, call=call))
    return batches


def assert_same_results(a, b, names):
    for name in names:
        for key in advisor.RESULT_KEYS:
            x, y = a[name][key], b[name][key]
            assert (x is None) == (y is None), (name, key)
            if x is not None:
                assert x == pytest.approx(y, rel=1e-9, abs=1e-12), (name, key)


def test_calls_streamed_one_by_one_equal_all_calls_in_one_update():
    """A CallBatch holding several calls is evaluated call by call: one update == one update per call, for every
    candidate, batch normalisation included."""
    grid = candidate_grid({"quantiles": QUANTILES})
    batches = three_calls()
    streamed = evaluate(grid, *batches)
    assert_same_results(streamed, evaluate(grid, CallBatch.join(batches)), grid)
    # and the calls may be interleaved inside the batch: grouped by call (each in its own order), not by position
    joined = CallBatch.join(batches)
    order = sorted(range(len(joined.calls)), key=lambda i: (i % 9, i))
    shuffled = CallBatch(**{name: [getattr(joined, name)[i] for i in order] for name in CallBatch.__dataclass_fields__})
    assert_same_results(streamed, evaluate(grid, shuffled), grid)


def test_splitting_a_call_changes_only_normalised_candidates():
    """One call fed in two halves: the same sums except through the per-micro-batch normalisation."""
    grid = candidate_grid({"quantiles": QUANTILES})
    batch = three_calls()[0]
    half = len(batch.calls) // 2
    first, second = (CallBatch(**{name: getattr(batch, name)[part] for name in CallBatch.__dataclass_fields__})
                     for part in (slice(None, half), slice(half, None)))
    whole, split = evaluate(grid, batch), evaluate(grid, first, second)
    plain = [name for name, config in grid.items() if not config.tis_batch_normalize]
    assert len(plain) < len(grid)
    assert_same_results(whole, split, plain)


def test_equal_configs_are_computed_once_and_reported_under_each_name():
    evaluator = CandidateEvaluator({"a": token("truncate", None, 2.0),
                                    "b": MisConfig.preset("token_tis", use_tis=True)})
    assert len(evaluator._unique) == 1
    evaluator.update(hand_batch())
    results = evaluator.results()
    assert results["a"] == results["b"]


# ------------------------------------------------------------------------------------------- the grid
def test_grid_from_quantiles():
    grid = candidate_grid({"quantiles": QUANTILES})
    assert 20 <= len(grid) <= 40
    assert all(config.use_tis for name, config in grid.items() if name != "preset:metrics_only")
    for name in ("token_truncate_U2", "token_mask_0.5_2", "token_icepop_0.5_2", "sequence_truncate_U2",
                 "geometric_mask_0.999_1.001", "token_truncate_U2_veto1e-4", "token_truncate_U2_veto1e-6",
                 "preset:mis", "preset:metrics_only", "preset:geo_rs"):
        assert name in grid, name
    assert grid["token_truncate_U2_veto1e-6"].rs_veto_threshold == 1e-6
    config = grid["token_mask_q0.01_0.99"]
    assert (config.tis_level, config.tis_mode) == ("token", "mask")
    assert (config.tis_lower_bound, config.tis_upper_bound) == (math.exp(-0.2), math.exp(0.2))
    assert grid["token_mask_q0.001_0.999"].tis_lower_bound == math.exp(-0.5)
    assert not any(name.startswith(("geometric", "sequence")) and "_q0" in name for name in grid)  # token quantiles
    assert grid["token_icepop_q0.001_0.999"].tis_upper_bound == math.exp(0.5)
    assert grid["token_truncate_q0.999"].tis_upper_bound == math.exp(0.5)
    assert grid["token_truncate_q0.99"].tis_upper_bound == math.exp(0.2)
    assert grid["preset:mis"] == MisConfig.preset("mis", use_tis=True)
    # token truncation with a token mask in probability space (DPPO's binary TV, |p − q|, the binary KL)
    assert grid["token_truncate_U2_tv0.2"].rs_divergence == (("token_tv", -0.2, 0.2),)
    assert grid["token_truncate_U2_atv0.05"].rs_divergence == (("token_atv", None, 0.05),)
    assert grid["token_truncate_U2_bkl0.01"].rs_divergence == (("token_bkl", None, 0.01),)
    assert grid["token_truncate_U2_bkl0.01"].tis_upper_bound == 2.0
    assert grid["token_truncate_U2_dtv0.2"].rs_divergence == (("token_dtv", -0.2, 0.2),)


def test_grid_skips_missing_and_invalid_quantiles():
    without = candidate_grid({})
    assert not any("_q0" in name for name in without) and "token_truncate_U2" in without
    assert set(candidate_grid({"quantiles": None})) == set(without)
    # missing pair member, q = NaN, an upper quantile ≤ 0 (truncating at U ≤ 1), an empty range
    grid = candidate_grid({"quantiles": dict(QUANTILES, **{"0.001": None, "0.999": float("nan"), "0.99": 0.0,
                                                           "0.01": 0.0})})
    assert not any("_q0" in name for name in grid)
    # beyond ±20: clipped into [e^-20, e^20], still a valid config
    grid = candidate_grid({"quantiles": dict(QUANTILES, **{"0.001": -50.0, "0.999": 50.0})})
    assert grid["token_mask_q0.001_0.999"].tis_lower_bound == pytest.approx(math.exp(-20))
    assert grid["token_truncate_q0.999"].tis_upper_bound == pytest.approx(math.exp(20))


# ------------------------------------------------------------------------------------------- recommendation
def statistics(**values):
    base = {"tokens": 1000, "sequences": 10, "calls": 1, "nonfinite_fraction": 0.0, "nonfinite_engine_fraction": 0.0,
            "nonfinite_trainer_fraction": 0.0, "k3": 1e-3, "fraction_ratio_above_2": 0.01,
            "fraction_ratio_below_half": 0.01, "catastrophic_fraction": 0.0, "max_abs_log_ratio": 2.0,
            "quantiles": QUANTILES}
    return dict(base, **values)


def row(config, tokens=1.0, sequences=1.0, ess=0.9, bounded=0.01, shift=0.1):
    return {"config": config.to_dict(), "kept_token_fraction": tokens, "kept_sequence_fraction": sequences, "ess": ess,
            "mean_final_weight": 1.0, "max_final_weight": 2.0, "bounded_fraction": bounded, "signal_shift": shift,
            "signal_bias": 0.0}


def assert_clean(recommendation):
    """Reasons exist and never print a NaN or inf number (the words "NaN/inf" are fine)."""
    assert recommendation.reasons
    for reason in recommendation.reasons:
        assert reason and not re.search(r"(?<![\w/])(nan|inf)(?![\w/])", reason), reason


def test_broken_log_probs_give_no_recommendation_and_say_whose():
    results = {"t": row(token("truncate", None, 2.0))}
    rec = recommend(statistics(nonfinite_fraction=0.7, nonfinite_engine_fraction=0.7), results)
    assert (rec.name, rec.config) == (None, None)
    assert "engine's log-probs are broken" in rec.reasons[0] and "70%" in rec.reasons[0]
    assert "trainer's" not in rec.reasons[0]
    assert_clean(rec)
    rec = recommend(statistics(nonfinite_fraction=0.6, nonfinite_trainer_fraction=0.6), results)
    assert rec.name is None and "trainer's log-probs are broken" in rec.reasons[0]
    rec = recommend(statistics(tokens=0), results)
    assert rec.name is None and "no valid token" in rec.reasons[0]


def test_highest_ess_among_eligible_then_ties():
    truncate, icepop, mask = token("truncate", None, 2.0), token("icepop", 0.5, 2.0), token("mask", 0.5, 2.0)
    results = {"a": row(truncate, ess=0.90), "b": row(icepop, ess=0.97), "c": row(mask, tokens=0.90, ess=0.99),
               "d": row(mask, sequences=0.85, ess=0.99), "m": row(MisConfig(use_tis=False), ess=1.0, bounded=0.0)}
    rec = recommend(statistics(), results)
    assert rec.name == "b" and rec.config == icepop  # c, d keep too little; m does not correct
    assert "ESS 0.9700" in rec.reasons[-1] and "next: a" in rec.reasons[-1]
    assert_clean(rec)
    # within 0.005 of the best ESS: the smaller bounded fraction, then the smaller signal shift
    results = {"a": row(truncate, ess=0.970, bounded=0.002), "b": row(icepop, ess=0.973, bounded=0.02),
               "c": row(mask, ess=0.969, bounded=0.002, shift=0.05)}
    rec = recommend(statistics(), results)
    assert rec.name == "c" and "within 0.005" in rec.reasons[-1]


def test_nothing_eligible_gives_no_recommendation():
    results = {"a": row(token("mask", 0.5, 2.0), tokens=0.8), "b": row(token("icepop", 0.5, 2.0), sequences=0.5)}
    rec = recommend(statistics(), results)
    assert rec.name is None and "too large" in rec.reasons[-1]
    assert_clean(rec)


def real_dump(noise, catastrophic=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = [-torch.rand(200, generator=gen) * 3 for _ in range(40)]
    rollout = [t - noise * torch.randn(200, generator=gen) for t in old]
    if catastrophic:
        rollout[5][7] = old[5][7] + 12.0  # ρ = e^-12 < 1e-4, one token in 8000
    advantages = [torch.randn(200, generator=gen) for _ in old]
    return call_batch(old, rollout, [torch.ones(200) for _ in old], advantages)


def dump_statistics(batch):
    from miles_mis.analyze.statistics import StatisticsAccumulator

    accumulator = StatisticsAccumulator()
    accumulator.update(batch)
    return accumulator.result()


def test_agreeing_engine_gets_the_cheap_token_truncation():
    batch = real_dump(noise=1e-3)
    stats = dump_statistics(batch)
    assert stats["k3"] < advisor.AGREE_K3
    grid = candidate_grid(stats)
    rec = recommend(stats, evaluate(grid, batch))
    assert rec.name == "token_truncate_U2" and rec.config == grid["token_truncate_U2"]
    assert "agrees" in rec.reasons[-1] and "k3" in rec.reasons[-1]
    assert_clean(rec)


def test_catastrophic_tokens_get_a_veto():
    batch = real_dump(noise=0.05, catastrophic=True)
    stats = dump_statistics(batch)
    assert stats["catastrophic_fraction"] > 0
    rec = recommend(stats, evaluate(candidate_grid(stats), batch))
    assert rec.config is not None and rec.config.rs_veto_threshold is not None and rec.config.use_tis
    assert "catastrophic" in rec.reasons[0]
    assert_clean(rec)


def test_moderate_mismatch_recommends_an_eligible_correction():
    batch = real_dump(noise=0.1)
    stats = dump_statistics(batch)
    results = evaluate(candidate_grid(stats), batch)
    rec = recommend(stats, results)
    assert rec.name is not None and rec.name != "preset:metrics_only"
    chosen = results[rec.name]
    assert chosen["kept_token_fraction"] >= 0.95 and chosen["kept_sequence_fraction"] >= 0.9
    eligible = [r["ess"] for r in results.values() if r["config"]["use_tis"] and advisor._eligible(r)]
    assert chosen["ess"] >= max(eligible) - advisor.ESS_TIE
    assert_clean(rec)


# ------------------------------------------------------------------------------------------- the YAML file
@pytest.mark.parametrize("name", ["preset:mis", "preset:geo_rs", "token_truncate_q0.999", "token_icepop_q0.01_0.99",
                                  "geometric_mask_0.999_1.001_veto1e-6", "preset:seq_is_rs"])
def test_write_config_round_trips_and_passes_check_config(tmp_path, name):
    config = candidate_grid({"quantiles": QUANTILES})[name]
    path = tmp_path / "recommended.yaml"
    rec = Recommendation(name, config, ["because ESS 0.9876 is the best", "and a second reason"])
    write_config(path, rec, statistics())
    text = path.read_text()
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not any(line.startswith("use_tis") for line in body)  # the host's --use-tis decides
    assert not re.search(r"(?<![\w.])\d+e[-+]?\d", "\n".join(body))  # YAML 1.1: 1e-4 would be a string
    assert "# - because ESS 0.9876 is the best" in text and "--custom-config-path" in text
    assert "--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp" in text
    loaded = MisConfig.from_yaml(path)
    assert loaded.use_tis is False
    assert advisor.config_keys(loaded) == advisor.config_keys(config)
    if name != "preset:seq_is_rs":  # (its tis lower bound 0.5 is unused by truncate and not written)
        assert MisConfig.from_dict(dict(loaded.to_dict(), use_tis=True)) == config
    assert cli.main(["check-config", str(path)]) == 0
    assert cli.main(["check-config", str(path), "--use-tis"]) == 0


def test_written_config_passes_check_config_as_a_command(tmp_path):
    stats = statistics()
    rec = Recommendation("preset:mis", MisConfig.preset("mis", use_tis=True), ["ESS 0.99, the best"])
    path = tmp_path / "recommended.yaml"
    write_config(path, rec, stats)
    done = subprocess.run([sys.executable, "-m", "miles_mis.cli", "check-config", str(path), "--use-tis"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "rs_veto_threshold: 0.0001" in done.stdout and "use_tis: true" in done.stdout


def test_write_config_refuses_no_recommendation(tmp_path):
    with pytest.raises(ValueError, match="no recommended config"):
        write_config(tmp_path / "x.yaml", Recommendation(None, None, ["broken"]))
    assert not (tmp_path / "x.yaml").exists()


def test_yaml_values_round_trip():
    """The one config writer (config.yaml_value): every value reads back as itself under YAML 1.1."""
    import yaml

    from miles_mis.config import yaml_value

    for value in (1e-4, 1e-6, 2.0, 0.5, math.exp(0.5), math.exp(20), math.exp(-20), 1e20, 123456789.0, 3, True, None,
                  [0.999, 1.001], (1e-6, 2.0), {"token_tv": [-0.2, 0.2], "seq_max_k3": 1e-06}, "truncate"):
        text = yaml_value(value)
        want = list(value) if isinstance(value, tuple) else value
        assert yaml.safe_load(f"x: {text}")["x"] == want, text


# ------------------------------------------------------------------------------------------- no NaN
def test_no_nan_with_nonfinite_log_probs_and_advantages():
    old, rollout, masks = random_batch(7, num_seqs=14, noise=3.0, nonfinite=True)
    old[5][:2] = float("-inf")
    rollout[6][:] = float("nan")
    masks[6][:] = 1.0
    advantages = [torch.randn(t.numel()) for t in old]
    advantages[0][:] = float("nan")
    advantages[7] = None
    batch = call_batch(old, rollout, masks, advantages)
    stats = dump_statistics(batch)
    results = evaluate(candidate_grid(stats), batch)
    text = json.dumps(results, allow_nan=False)  # raises on NaN/inf
    assert "NaN" not in text
    for result in results.values():
        assert all(result[key] is None or math.isfinite(result[key]) for key in advisor.RESULT_KEYS)
    assert_clean(recommend(stats, results))
    all_broken = call_batch([torch.full((4,), float("nan"))] * 3, [torch.zeros(4)] * 3, [torch.ones(4)] * 3)
    stats = dump_statistics(all_broken)
    results = evaluate(candidate_grid(stats), all_broken)
    json.dumps(results, allow_nan=False)
    rec = recommend(stats, results)
    assert rec.name is None and "trainer's log-probs are broken" in rec.reasons[0]
