"""benchmarks/lab_horizon.py and miles_mis.analyze.horizon: the long runs' figures by hand (windows, falling back,
drift, paired differences at step 40 and at the end), the file the analyzer reads, and its sentence."""

import math

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def lab_horizon():
    return load_benchmark("lab_horizon")


def _row(algorithm, seed, rewards, k3=None, grad=None, regime="bf16"):
    steps = len(rewards)
    return {"regime": regime, "algorithm": algorithm, "seed": seed, "steps": steps, "machine": "test machine",
            "reward": list(rewards), "raw_k3": list(k3 or [1e-3] * steps), "grad_norm": list(grad or [1.0] * steps),
            "response_length": [10.0] * steps}


def test_run_summary_by_hand(lab_horizon):
    # reward 0.5 for 40 steps, then 1.0 for 210, then 0.85 for the last 50: at 40 it is 0.5, the best 10-step mean
    # after 40 is 1.0, the last 50 are 0.85: 0.15 below it, a fall back (>= 0.1)
    rewards = [0.5] * 40 + [1.0] * 210 + [0.85] * 50
    # a 10-step spike of 8e-3 at steps 246-255, half of it inside the last 50 (steps 251-300)
    k3 = [2e-3] * 40 + [1e-3] * 205 + [8e-3] * 10 + [1e-3] * 45
    summary = lab_horizon.run_summary(_row("standard", 0, rewards, k3=k3))
    assert summary["reward_at_40"] == 0.5 and summary["reward_last_50"] == pytest.approx(0.85)
    assert summary["fell_back"] is True
    assert summary["raw_k3_first_40"] == pytest.approx(2e-3) and summary["raw_k3_last_50"] == pytest.approx(
        (5 * 8e-3 + 45 * 1e-3) / 50)
    assert summary["raw_k3_peak_ratio"] == pytest.approx(8e-3 / 2e-3)
    assert summary["grad_norm_peak_ratio"] == pytest.approx(1.0)
    # 0.09 below the peak is not a fall back; a run that stays at its ceiling is not either
    assert not lab_horizon.fell_back([0.5] * 40 + [1.0] * 210 + [0.91] * 50)
    assert not lab_horizon.fell_back([0.5] * 40 + [0.97] * 260)
    # the peak only counts windows ending after step 40: an early high is not a fall back
    assert not lab_horizon.fell_back([1.0] * 40 + [0.6] * 260)


def test_paired_differences_at_40_and_at_the_end_by_hand(lab_horizon):
    rows = []
    for seed, (standard_end, tis_end, tis_40) in enumerate([(0.9, 0.95, 0.6), (0.8, 0.9, 0.5), (0.85, 0.85, 0.55)]):
        rows.append(_row("standard", seed, [0.5] * 40 + [standard_end] * 260))
        # the same first step: a seed's algorithms share their first rollout, and rows pair by it
        rows.append(_row("decoupled_tis", seed, [0.5] + [tis_40] * 39 + [tis_end] * 260))
    (point,) = lab_horizon.horizon(rows)
    (pair,) = point["paired"]
    assert (pair["a"], pair["b"]) == ("decoupled_tis", "standard")
    # at 40: d = 0.1, 0.0, 0.05 -> mean 0.05, sd 0.05, half = t(0.975, 2) * 0.05 / sqrt(3) = 4.302653 * 0.0288675
    half = 4.302652729911275 * 0.05 / math.sqrt(3)
    assert pair["at_40"]["mean"] == pytest.approx(0.05) and pair["at_40"]["high"] == pytest.approx(0.05 + half)
    # at the end: d = 0.05, 0.1, 0.0 -> the same mean and interval
    assert pair["at_end"]["mean"] == pytest.approx(0.05) and pair["at_end"]["low"] == pytest.approx(0.05 - half)
    assert pair["at_end"]["seeds"] == 3 and point["k3"] == pytest.approx(1e-3) and point["steps"] == 300
    assert point["algorithms"]["standard"]["runs"] == 3 and point["algorithms"]["standard"]["fell_back"] == 0
    table = lab_horizon.regime_table(point)
    assert "| decoupled_tis − standard | +0.050 [" in table and "(n=3)" in table
    assert "| standard | 3 | 0.500 | 0.850 | 0 of 3 |" in table


def test_a_regime_needs_standard_on_two_seeds_at_the_full_length(lab_horizon):
    one = [_row("standard", 0, [0.5] * 300), _row("decoupled_tis", 0, [0.5] * 300)]
    assert lab_horizon.horizon(one) == []
    short = one + [_row("standard", 1, [0.5] * 40)]  # a 40-step row is not a long run
    assert lab_horizon.horizon(short) == []
    assert "no regime" in lab_horizon.tables(short, None)


def _points(lab_horizon, tmp_path, fell: bool):
    rows = []
    for seed in range(3):
        end = 0.6 if fell and seed < 2 else 0.97
        rows.append(_row("standard", seed, [0.5] * 40 + [0.97] * 210 + [end] * 50, k3=[1.3e-3] * 300))
        rows.append(_row("decoupled_tis", seed, [0.5] * 40 + [0.97] * 260, k3=[1.3e-3] * 300))
    path = tmp_path / "long_horizon.json"
    lab_horizon.write_json(lab_horizon.horizon(rows), path)
    return path


def test_the_analyzer_reads_a_null_as_a_null_at_that_horizon(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon, safe_level

    data = horizon.load(_points(lab_horizon, tmp_path, fell=False))
    text = horizon.sentence(1e-3, data)
    assert text.startswith("At 300 steps no run fell back: on SmolLM2-135M-Instruct")
    assert "at k3 = 1.30e-03 over steps 1–40 and 1.30e-03 over the last 50 (bf16)" in text
    assert text.endswith("still a 135M model with short responses.")  # k3 held: no "shrank"
    assert "none of 6 runs (standard PPO 3, decoupled token TIS 3) ended 0.1 reward or more below their best" in text
    assert "decoupled token TIS − standard PPO over the last 50 steps +0.000" in text
    assert "still a 135M model" in text and "safe" not in text
    # above every long run: said, not stretched
    assert horizon.sentence(1e-2, data).startswith("Nothing in the lab ran long at this mismatch: its 300-step runs "
                                                   "sat lower, at k3 = 1.30e-03 (bf16")
    assert horizon.sentence(float("nan"), data) is None and horizon.sentence(1e-3, None) is None
    # in the analyzer's sentence, after the lab's 40-step reading, and out of it with long_runs=None
    curve = {"model": "M", "engine": "E", "steps": 40, "docs": "d", "points": [],
             "levels": {"standard": {"safe_below": {"k3": 2e-3, "regime": "bf16", "not_excluded": 0.1, "seeds": 3},
                                     "matters_at": None}, "bypass": {}}}
    full = safe_level.sentence(1e-3, curve, [], data)
    assert full.startswith("No resolved effect in the lab at this level") and text in full
    assert full.index(text) > full.index("40 steps, too short")
    assert text not in safe_level.sentence(1e-3, curve, [], None)


def test_a_long_run_that_fell_back_is_the_headline(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon

    data = horizon.load(_points(lab_horizon, tmp_path, fell=True))
    assert data["points"][0]["algorithms"]["standard"]["fell_back"] == 2
    text = horizon.sentence(1e-3, data)
    assert text.startswith("At 300 steps the lab's runs fell back at this level:")
    assert "below their best after step 40 (standard PPO 2 of 3)" in text and "Correct," in text


def test_a_null_at_a_shrinking_mismatch_says_so(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon

    data = horizon.load(_points(lab_horizon, tmp_path, fell=False))
    data["points"][0]["k3_last_50"] = data["points"][0]["k3"] / 10  # as the lab's bf16 runs: k3 falls 10x
    assert horizon.sentence(1e-3, data).endswith("still a 135M model with short responses, at a mismatch that shrank "
                                                 "as it trained.")


def test_long_runs_that_repeat_their_40_step_run_are_counted(lab_horizon):
    long = [_row("standard", 0, [0.5] * 40 + [0.9] * 260), _row("bypass", 0, [0.5] * 40 + [0.9] * 260),
            _row("standard", 1, [0.5] * 300)]
    short = [_row("standard", 0, [0.5] * 40), _row("bypass", 0, [0.5] * 39 + [0.6]), _row("standard", 2, [0.5] * 40)]
    assert lab_horizon.reproduced(long, short) == (1, 2)  # seed 1 has no 40-step run; bypass differs at step 40
    short[0]["raw_k3"][5] = 2e-3  # the k3 must repeat too
    assert lab_horizon.reproduced(long, short) == (0, 2)
