"""benchmarks/lab_verdicts.py: every run of the sweep parses as the lab would run it (a bad key would stop the sweep
hours in), the run order leaves whole paired sets, and the tables compute the paired verdicts by hand."""

import importlib
import sys
from pathlib import Path

import pytest
import yaml

from conftest import load_benchmark

REPO = Path(__file__).resolve().parent.parent
ONE_STEP_OFF = "one-step-off, 2-digit addition"


@pytest.fixture(scope="module")
def verdicts():
    return load_benchmark("lab_verdicts")


def _part(name: str, module: str):
    """A module-scoped fixture ``name``: ``module`` as lab_verdicts imported it (load_benchmark put benchmarks/ on the
    path), the same object, so a monkeypatch on it reaches the CLI."""
    @pytest.fixture(scope="module", name=name)
    def part(verdicts):
        return importlib.import_module(module)
    return part


plan = _part("plan", "lab_verdicts_plan")
tables = _part("tables", "lab_verdicts_tables")
safe = _part("safe", "lab_safe_mismatch")
runs = _part("runs", "lab_runs")


@pytest.fixture(autouse=True)
def without_the_long_runs(monkeypatch):
    """These tests read the 40-step curve alone: the shipped long-horizon runs (test_lab_horizon's subject) stay out
    of the analyzer's sentence here."""
    from miles_mis.analyze import horizon

    monkeypatch.setattr(horizon, "load", lambda path=None: None)


def test_every_run_parses_with_its_config(plan, tmp_path):
    from miles_mis.lab.train import parse_args

    seen = set()
    for regime, seed, algorithm in plan.cells(plan.REGIMES):
        if (regime, algorithm) in seen:
            continue
        seen.add((regime, algorithm))
        config_path = tmp_path / f"{len(seen)}.yaml"
        config_path.write_text(yaml.safe_dump(plan.ALGORITHMS[algorithm][1]) or "{}\n")
        args = parse_args(plan.argv_of(regime, algorithm, seed, 40, config_path)
                          + ["--out-dir", str(tmp_path / "run")])
        assert args.model == "smollm2-135m" and args.steps == 40
        if "fp8" in regime:
            assert args.rollout_weight_quant == "fp8"
        if algorithm.endswith("wide_clip"):
            assert args.eps_clip == 0.5
    assert len(seen) == sum(len(spec[1]) for spec in plan.REGIMES.values())


def test_run_order_is_seed_by_seed(plan):
    order = list(plan.cells(["bf16 + fp8 weights"], seeds=2))
    algorithms = plan.REGIMES["bf16 + fp8 weights"][1]
    assert order[:len(algorithms)] == [("bf16 + fp8 weights", 0, a) for a in algorithms]
    assert order[len(algorithms)] == ("bf16 + fp8 weights", 1, "standard")
    assert len(list(plan.cells(plan.REGIMES))) == sum(s[2] * len(s[1]) for s in plan.REGIMES.values())
    # --algorithms keeps the order and the named algorithms with the references they pair with (standard, bypass),
    # only where a regime has them
    only = list(plan.cells(["bf16 + fp8 weights", "fp32"], seeds=2, only=("dppo_ppo", "seq_mis")))
    fp8 = ["standard", "bypass", "seq_mis", "dppo_ppo"]
    assert only == ([("bf16 + fp8 weights", 0, a) for a in fp8] + [("bf16 + fp8 weights", 1, a) for a in fp8]
                    + [("fp32", s, a) for s in range(2) for a in ("standard", "bypass")])


def _row(plan, algorithm, seed, rewards):
    series = {key: [0.0] * len(rewards) for key in plan.SERIES}
    return {"regime": "bf16", "algorithm": algorithm, "seed": seed, "steps": len(rewards), **series,
            "reward": rewards}


def test_regime_table_by_hand(plan, tables):
    # standard: 0.3 for 10 steps, then 0.6 (score 0.6); bypass 0.02/0.04/0.06 lower on seeds 0..2; seq_mis one seed only
    standard = [0.3] * 10 + [0.6] * 10
    rows = [_row(plan, "standard", s, standard) for s in range(3)]
    rows += [_row(plan, "bypass", s, [0.3] * 10 + [0.6 - d] * 10) for s, d in enumerate((0.02, 0.04, 0.06))]
    rows.append(_row(plan, "seq_mis", 0, standard))
    table, sentences = tables.regime_table(rows, "bf16")
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, standard, bypass (seq_mis has 1 seed: not shown)
    bypass = lines[3].split(" | ")
    # Δ = −0.04, sd 0.02, half-width 4.3027 · 0.02 / √3 = 0.0497: [−0.090, +0.010] includes 0
    assert bypass[4] == "-0.040 [-0.090, +0.010] (n=3)"
    # the 5-step mean (0.3·(5 − k) + x·k)/5 reaches 0.5 after k = 4, 4, 5 steps at x = 0.58, 0.56, 0.54: median step 14
    assert bypass[5] == "14 (3/3)"
    assert bypass[6] == "0 / 0"  # gains of 0.24..0.28: learned
    assert sentences[0] == "bypass vs standard: no resolvable difference at 3 seeds (-0.040 [-0.090, +0.010] (n=3))"
    assert "not yet paired on 2 seeds (not shown):" in sentences[-1] and "seq_mis" in sentences[-1]


def _regime_rows(plan, regime, k3, scores):
    """Rows of ``regime``: algorithm -> per-seed final reward (first 10 steps at 0.3, last 10 at the score)."""
    rows = []
    for algorithm, per_seed in scores.items():
        for seed, score in enumerate(per_seed):
            row = _row(plan, algorithm, seed, [0.3] * 10 + [score] * 10)
            row.update(regime=regime, raw_k3=[k3] * 20)
            rows.append(row)
    return rows


def test_safe_mismatch_curve_by_hand(plan, safe):
    rows = (_regime_rows(plan, "fp32", 1e-10, {"standard": [0.7, 0.72], "bypass": [0.71, 0.7],
                                                   "decoupled_tis": [0.7, 0.73]})
            + _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                           {"standard": [0.5, 0.55, 0.6], "bypass": [0.2, 0.25, 0.2],
                            "decoupled_tis": [0.8, 0.86, 0.9], "seq_mis": [0.5, 0.5, 0.5]})
            + _regime_rows(plan, "bf16", 1.3e-3, {"standard": [0.7, 0.75], "decoupled_tis": [0.74, 0.7]}))
    points = safe.curve(rows)
    assert [p["regime"] for p in points] == ["fp32", "bf16", "bf16 + fp8 weights"]  # by k3
    fp8 = points[2]
    assert fp8["k3"] == pytest.approx(4e-2)
    # over standard: decoupled_tis +0.3, +0.31, +0.3 (seq_mis −0.05): mean 0.3033, sd 0.00577, half 0.01434
    gap = fp8["gaps"]["standard"]
    assert gap["correction"] == "decoupled_tis" and gap["seeds"] == 3
    assert gap["mean"] == pytest.approx(0.30333, abs=1e-4) and gap["low"] == pytest.approx(0.28899, abs=1e-4)
    assert fp8["gaps"]["bypass"]["mean"] == pytest.approx(0.63667, abs=1e-4)
    assert "bypass" not in points[1]["gaps"]  # bf16 has no bypass runs
    level = safe.safe_level(points)
    # the gains left open: fp32 differences 0, +0.01 (mean +0.005, half-width t(1)·0.00707/√2 = 0.0635: high +0.0685);
    # bf16 +0.04, −0.05 (mean −0.005, half 12.706·0.0636/√2 = 0.5718: high +0.5668), the larger
    assert level["safe_below"] == {"k3": pytest.approx(1.3e-3), "regime": "bf16",
                                   "not_excluded": pytest.approx(0.5668, abs=1e-4), "seeds": 2}
    assert level["matters_at"]["regime"] == "bf16 + fp8 weights" and level["unresolved_above"] == []
    sentence = safe.level_sentence(level)
    assert sentence.startswith("standard: no resolved gain from a correction up to k3 = 1.30e-03 (bf16; a gain up to "
                               "+0.567 reward is not excluded at 2 seeds); the first "
                               "resolved gain at k3 = 4.00e-02 (bf16 + fp8 weights: decoupled_tis, +0.303 [+0.289, ")


def test_a_larger_mean_on_fewer_seeds_does_not_hide_a_resolved_gain(plan, safe):
    """The sweep's fp8 shape: decoupled TIS beats bypass on 4 seeds; batch_gate has the larger mean on 2 seeds with
    an interval 8 wide. The curve names the resolved one, and what stays open is the widest upper bound."""
    rows = _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                        {"standard": [0.5, 0.55, 0.6, 0.5], "bypass": [0.2, 0.25, 0.2, 0.2],
                         "decoupled_tis": [0.52, 0.56, 0.62, 0.5], "batch_gate": [0.9, 0.3]})
    (point,) = safe.curve(rows)
    # over bypass: decoupled_tis +0.32, +0.31, +0.42, +0.30: mean 0.3375, sd 0.05560, half 3.1824·0.05560/2 = 0.08848;
    # batch_gate +0.7, +0.05: mean 0.375, sd 0.45962, half 12.706·0.45962/√2 = 4.1295 (low −3.755, high +4.505)
    over_bypass = point["gaps"]["bypass"]
    assert over_bypass["correction"] == "decoupled_tis" and over_bypass["seeds"] == 4
    assert over_bypass["low"] == pytest.approx(0.24902, abs=1e-4) and over_bypass["mean"] == pytest.approx(0.3375)
    assert over_bypass["not_excluded"] == pytest.approx(4.5045, abs=1e-3) and over_bypass["not_excluded_seeds"] == 2
    assert safe.safe_level([point], "bypass")["matters_at"]["correction"] == "decoupled_tis"
    # over standard: decoupled_tis +0.02, +0.01, +0.02, 0: low 0.0125 − 3.1824·0.009574/2 = −0.00273, the largest low;
    # batch_gate +0.4, −0.25 leaves +0.075 + 4.1295 = +4.2045 open
    over_standard = point["gaps"]["standard"]
    assert over_standard["correction"] == "decoupled_tis" and over_standard["low"] == pytest.approx(-0.00273, abs=1e-4)
    level = safe.safe_level([point], "standard")
    assert level["matters_at"] is None
    assert level["safe_below"]["not_excluded"] == pytest.approx(4.2045, abs=1e-3) and level["safe_below"]["seeds"] == 2


def test_a_resolved_loss_is_not_a_gain(plan, safe):
    """The sweep's fp8 shape over standard: seq_mis is resolved below it on 4 seeds, decoupled TIS is level. Neither
    is a gain: the curve names decoupled TIS (the larger lower bound among the unresolved) and the level stays safe."""
    rows = _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                        {"standard": [0.5, 0.55, 0.6, 0.5], "seq_mis": [0.3, 0.4, 0.45, 0.35],
                         "decoupled_tis": [0.52, 0.5, 0.62, 0.5]})
    (point,) = safe.curve(rows)
    # seq_mis −0.2, −0.15, −0.15, −0.15: mean −0.1625, sd 0.025, half 3.1824·0.025/2 = 0.03978: [−0.2023, −0.1227],
    # resolved, but below 0; decoupled_tis +0.02, −0.05, +0.02, 0: mean −0.0025, sd 0.03304, low −0.0551
    over_standard = point["gaps"]["standard"]
    assert over_standard["correction"] == "decoupled_tis" and not over_standard["resolved"]
    assert over_standard["low"] == pytest.approx(-0.0551, abs=1e-4)
    level = safe.safe_level([point], "standard")
    assert level["matters_at"] is None and level["safe_below"]["regime"] == "bf16 + fp8 weights"
    # only seq_mis paired: still no gain, and the sentence does not call its loss one
    (point,) = safe.curve([r for r in rows if r["algorithm"] != "decoupled_tis"])
    assert point["gaps"]["standard"]["correction"] == "seq_mis" and not point["gaps"]["standard"]["resolved"]
    assert "in no regime measured" in safe.level_sentence(safe.safe_level([point], "standard"))


def test_an_empty_curve_says_so(plan, safe):
    for uncorrected in plan.UNCORRECTED:
        assert safe.level_sentence(safe.safe_level([], uncorrected)) == (f"{uncorrected}: no regime paired on "
                                                                                 "2 seeds yet")


def test_the_curve_file_is_what_the_analyzer_reads(plan, safe, tmp_path):
    from miles_mis.analyze import safe_level

    rows = (_regime_rows(plan, "bf16", 1.3e-3, {"standard": [0.7, 0.75], "decoupled_tis": [0.74, 0.7]})
            + _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                           {"standard": [0.5, 0.55, 0.6], "decoupled_tis": [0.8, 0.86, 0.9]}))
    path = tmp_path / "curve.json"
    safe.write_curve(safe.curve(rows), rows, path)
    curve = safe_level.load(path)
    assert curve["steps"] == 20 and curve["levels"]["standard"]["matters_at"]["correction"] == "decoupled_tis"
    assert safe_level.sentence(1e-3, curve).startswith("No resolved effect in the lab at this level: k3 = 1.00e-03 is "
                                                       "at or below 1.30e-03 (bf16)")
    assert "(a gain up to +0.567 reward is not excluded at 2 seeds)" in safe_level.sentence(1e-3, curve)
    assert safe_level.sentence(5e-2, curve).startswith("Above the lab's no-effect level: k3 = 5.00e-02 is at or above "
                                                       "4.00e-02 (bf16 + fp8 weights), where decoupled_tis beat "
                                                       "standard PPO by +0.303 reward [+0.289, +0.318] over 3 seeds")
    assert "Between the measured levels" in safe_level.sentence(1e-2, curve)
    assert safe_level.sentence(float("nan"), curve) is None and safe_level.sentence(1e-2, None) is None
    # nothing resolved anywhere: safe within the measured range, unmeasured above it
    flat = safe.curve(rows[:4])
    safe.write_curve(flat, rows[:4], path)
    assert safe_level.sentence(1e-3, safe_level.load(path)).startswith("No resolved effect in the lab at this level: "
                                                                       "k3 = 1.00e-03 is at")
    assert safe_level.sentence(1e-1, safe_level.load(path)).startswith("Not measured: k3 = 1.00e-01 is above every "
                                                                       "regime")
    assert "(the largest: 1.30e-03, bf16)" in safe_level.sentence(1e-1, safe_level.load(path))


def test_the_analyzer_names_bypass_where_bypass_lost(plan, safe, tmp_path):
    """Standard PPO safe at fp8 while a correction beat bypass there (what the sweep measured): a dump at that k3 is
    safe for standard PPO and told that bypass lost; one below it is not told about bypass."""
    from miles_mis.analyze import safe_level

    rows = (_regime_rows(plan, "bf16", 1.3e-3, {"standard": [0.7, 0.75], "bypass": [0.71, 0.74],
                                                    "decoupled_tis": [0.74, 0.7]})
            + _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                           {"standard": [0.5, 0.55, 0.6], "bypass": [0.2, 0.25, 0.2],
                            "decoupled_tis": [0.52, 0.53, 0.6]}))
    path = tmp_path / "curve.json"
    safe.write_curve(safe.curve(rows), rows, path)
    curve = safe_level.load(path)
    at_fp8 = safe_level.sentence(4e-2, curve, [])
    # over bypass at fp8: +0.32, +0.28, +0.4: mean 0.3333, sd 0.0611, half-width t(2) 4.303·0.0611/√3 = 0.1518
    assert at_fp8.startswith("No resolved effect in the lab at this level: k3 = 4.00e-02 is at or below 4.00e-02 "
                             "(bf16 + fp8 weights)")
    assert at_fp8.endswith("Not in bypass mode (--use-rollout-logprobs, the engine's log-probs as π_old): at k3 = "
                           "4.00e-02 (bf16 + fp8 weights) decoupled_tis beat bypass by +0.333 reward [+0.182, +0.485] "
                           "over 3 seeds; recompute π_old.")
    assert "bypass" not in safe_level.sentence(1e-3, curve)


def test_the_bypass_clause_cites_the_nearest_level_where_bypass_lost(plan, safe, tmp_path):
    """Bypass lost first at the async level (by +0.06) and by far more under fp8 weights: a dump at fp8's k3 is told
    the fp8 measurement, one between the two levels the async one, one below both nothing about bypass."""
    from miles_mis.analyze import safe_level

    rows = (_regime_rows(plan, "async lags 0..4", 3.4e-3,
                         {"standard": [0.66, 0.6, 0.7, 0.65], "bypass": [0.6, 0.55, 0.62, 0.6],
                          "decoupled_tis": [0.66, 0.61, 0.7, 0.64]})
            + _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                           {"standard": [0.5, 0.55, 0.6, 0.5], "bypass": [0.2, 0.25, 0.2, 0.2],
                            "decoupled_tis": [0.52, 0.56, 0.62, 0.5]}))
    path = tmp_path / "curve.json"
    safe.write_curve(safe.curve(rows), rows, path)
    curve = safe_level.load(path)
    assert curve["levels"]["bypass"]["matters_at"]["regime"] == "async lags 0..4"
    # over bypass, async: +0.06, +0.06, +0.08, +0.04: mean 0.06, sd 0.01633, half 3.1824·0.01633/2 = 0.02598;
    # fp8: +0.32, +0.31, +0.42, +0.30: mean 0.3375, sd 0.05560, half 0.08848
    assert safe_level.sentence(5e-2, curve, []).endswith(
        "at k3 = 4.00e-02 (bf16 + fp8 weights) decoupled_tis beat bypass by +0.338 reward [+0.249, +0.426] over 4 "
        "seeds; recompute π_old.")
    assert safe_level.sentence(1e-2, curve, []).endswith(
        "at k3 = 3.40e-03 (async lags 0..4) decoupled_tis beat bypass by +0.060 reward [+0.034, +0.086] over 4 seeds; "
        "recompute π_old.")
    assert "bypass mode" not in safe_level.sentence(1e-3, curve)


def test_a_correction_that_lost_higher_up_is_not_advised_there(plan, safe, tmp_path):
    """The sweep's shape: seq_mis beats standard PPO at the async level (4 seeds) and loses to it under fp8 weights.
    A dump at fp8's k3 is above the lab's no-effect level, but the advice comes from the nearest measured level below
    it: no correction won there and seq_mis lost, so it is not advised; a dump between the two levels is told seq_mis
    won."""
    from miles_mis.analyze import safe_level

    rows = (_regime_rows(plan, "async lags 0..4", 3.4e-3,
                         {"standard": [0.66, 0.6, 0.7, 0.65], "seq_mis": [0.72, 0.62, 0.76, 0.69]})
            + _regime_rows(plan, "bf16 + fp8 weights", 4e-2,
                           {"standard": [0.5, 0.55, 0.6, 0.5], "seq_mis": [0.3, 0.4, 0.45, 0.35]}))
    path = tmp_path / "curve.json"
    points = safe.curve(rows)
    safe.write_curve(points, rows, path)
    # async: +0.06, +0.02, +0.06, +0.04: mean 0.045, sd 0.01915, half 3.1824·0.01915/2 = 0.03047: [+0.0145, +0.0755]
    # fp8: −0.2, −0.15, −0.15, −0.15: mean −0.1625, half 0.03978: [−0.2023, −0.1227], a resolved loss
    assert points[1]["gaps"]["standard"]["losses"] == [{"correction": "seq_mis", "mean": pytest.approx(-0.1625),
                                                        "low": pytest.approx(-0.2023, abs=1e-4),
                                                        "high": pytest.approx(-0.1227, abs=1e-4), "seeds": 4}]
    assert points[0]["gaps"]["standard"]["losses"] == []
    curve = safe_level.load(path)
    between = safe_level.sentence(1e-2, curve, [])
    assert between.startswith("Above the lab's no-effect level: k3 = 1.00e-02 is at or above 3.40e-03 "
                              "(async lags 0..4), where seq_mis beat standard PPO by +0.045 reward [+0.015, +0.075] "
                              "over 4 seeds")
    assert between.endswith("Correct: seq_mis won there.")
    at_fp8 = safe_level.sentence(5e-2, curve, [])
    assert "Correct:" not in at_fp8
    assert at_fp8.endswith("Nearer this k3, at 4.00e-02 (bf16 + fp8 weights), no correction beat standard PPO "
                           "resolvably, and seq_mis lost to it by -0.163 reward [-0.202, -0.123] over 4 seeds: do not "
                           "use it at this mismatch. Keep π_old recomputed (standard PPO, not bypass) and watch the "
                           "reward.")


def test_a_seed_split_across_machines_runs_again_whole(plan, runs, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lab_runs import append_result, one_machine_per_seed

    results = tmp_path / "rows.jsonl"
    algorithms = plan.REGIMES["fp32"][1]  # standard, bypass, decoupled_tis
    for algorithm in algorithms:  # seed 0 whole on machine A
        append_result(results, {"regime": "fp32", "seed": 0, "algorithm": algorithm, "steps": 40, "machine": "A"})
    append_result(results, {"regime": "fp32", "seed": 1, "algorithm": "standard", "steps": 40, "machine": "A"})
    append_result(results, {"regime": "fp32", "seed": 1, "algorithm": "bypass", "steps": 40, "machine": "B"})
    # on B: seed 1 again but for bypass (done there); seed 0 is whole on A
    assert plan.todo(["fp32"], 2, 40, results, here="B") == [("fp32", 1, "standard"), ("fp32", 1, "decoupled_tis")]
    # on a third machine: seed 1 whole
    assert plan.todo(["fp32"], 2, 40, results, here="C") == [("fp32", 1, a) for a in algorithms]
    rows = runs.read_results(results)
    chosen = one_machine_per_seed(rows, plan.SEED, plan.CELL)
    assert sorted((r["seed"], r["machine"]) for r in chosen) == [(0, "A"), (0, "A"), (0, "A"), (1, "A")]


def test_a_new_algorithm_runs_on_seeds_whose_group_holds_others(plan, tmp_path):
    """Asking for one algorithm a seed's group lacks runs it, though the group holds as many rows as asked for."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lab_runs import append_result

    results = tmp_path / "rows.jsonl"
    first = {"reward": [0.25], "raw_k3": [4e-2]}
    for algorithm in ("standard", "bypass", "decoupled_tis"):
        append_result(results, {"regime": "bf16 + fp8 weights", "seed": 0, "algorithm": algorithm, "steps": 40,
                                "machine": "A", **first})
    assert plan.todo(["bf16 + fp8 weights"], 1, 40, results, here="B", only=["bypass_wide_clip"]) == [
        ("bf16 + fp8 weights", 0, "bypass_wide_clip")]
    # B's kernels give another first rollout: the references it pairs with run there too
    append_result(results, {"regime": "bf16 + fp8 weights", "seed": 0, "algorithm": "bypass_wide_clip", "steps": 40,
                            "machine": "B", "reward": [0.5], "raw_k3": [4e-2]})
    assert plan.todo(["bf16 + fp8 weights"], 1, 40, results, here="B", only=["bypass_wide_clip"]) == [
        ("bf16 + fp8 weights", 0, "standard"), ("bf16 + fp8 weights", 0, "bypass")]


def test_a_seed_continues_where_its_first_rollout_is_reproduced(plan, runs, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lab_runs import append_result, one_machine_per_seed

    results = tmp_path / "rows.jsonl"
    same, other = {"reward": [0.25, 0.5], "raw_k3": [1.25e-3, 1e-3]}, {"reward": [0.25, 0.5], "raw_k3": [1.5e-3, 1e-3]}
    append_result(results, {"regime": "fp32", "seed": 0, "algorithm": "standard", "steps": 40, "machine": "A", **same})
    # a machine with no row of seed 0 assumes it reproduces A's first rollout: standard is not run again
    assert plan.todo(["fp32"], 1, 40, results, here="C") == [("fp32", 0, "bypass"), ("fp32", 0, "decoupled_tis")]
    append_result(results, {"regime": "fp32", "seed": 0, "algorithm": "bypass", "steps": 40, "machine": "C", **same})
    assert plan.todo(["fp32"], 1, 40, results, here="C") == [("fp32", 0, "decoupled_tis")]
    # D's kernels give another first rollout: once its first run shows it, the seed runs whole there
    append_result(results, {"regime": "fp32", "seed": 0, "algorithm": "bypass", "steps": 40, "machine": "D", **other})
    assert plan.todo(["fp32"], 1, 40, results, here="D") == [("fp32", 0, "standard"), ("fp32", 0, "decoupled_tis")]
    assert plan.todo(["fp32"], 1, 40, results, here="C") == [("fp32", 0, "decoupled_tis")]
    append_result(results, {"regime": "fp32", "seed": 0, "algorithm": "decoupled_tis", "steps": 40, "machine": "C",
                            **same})
    assert plan.todo(["fp32"], 1, 40, results, here="D") == []  # A and C hold seed 0 whole
    rows = runs.read_results(results)
    chosen = one_machine_per_seed(rows, plan.SEED, plan.CELL, runs.first_rollout)
    assert sorted((r["algorithm"], r["machine"]) for r in chosen) == [("bypass", "C"), ("decoupled_tis", "C"),
                                                                       ("standard", "A")]
    assert plan.mixed_first_rollouts(rows) == []
    append_result(results, {"regime": "fp32", "seed": 0, "algorithm": "standard", "steps": 40, "machine": "C", **other})
    assert plan.mixed_first_rollouts(runs.read_results(results)) == ["fp32 seed 0 on C: 2 first rollouts"]


def test_mechanism_lines_by_hand(plan, tables):
    rows = []
    for seed in range(2):
        for algorithm, score, removed, positive in (("lag_gate", 0.5, 0.1, 0.05), ("fixed_drop", 0.6, 0.2, 0.05)):
            row = _row(plan, algorithm, seed, [0.3] * 10 + [score + 0.01 * seed] * 10)
            # per step: |A| mass 1.0, the removed part of it, removed tokens 0.1 of which `positive` have A > 0
            row.update(regime="async lags 0..2", abs_advantage=[1.0] * 20, removed_abs_advantage=[removed] * 20,
                       removed_token_fraction=[0.1] * 20, removed_positive_advantage=[positive] * 20,
                       mis_rs_stale_seq_fraction=[removed] * 20)
            rows.append(row)
    lines = tables.mechanism_lines(rows)
    assert len(lines) == 1
    line = lines[0]
    # the same −0.1 on both seeds: a zero-width interval, no verdict at 2 seeds
    assert line.startswith("- async lags 0..2, the lag gate against the fixed drop: lag_gate vs fixed_drop: no "
                           "resolvable difference at 2 seeds (-0.100 [-0.100, -0.100] (n=2); the interval excludes 0, "
                           "but a verdict needs 3 seeds)")
    assert "lag_gate removes 10.0 % of the |A| mass, 50 % of its removed tokens with A > 0, 10.0 % of sequences" in line
    assert "fixed_drop removes 20.0 % of the |A| mass" in line


def test_the_clip_mechanism_line_reads_the_clip_share_and_the_response_lengths_by_hand(plan, tables):
    rows = []
    for seed in range(2):
        # bypass: 20 steps, the last 12 at the 24-token cap; the wide clip: 20 and 22 tokens, never at the cap
        bypass = _row(plan, "bypass", seed, [0.3] * 10 + [0.2] * 10)
        bypass.update(regime="bf16 + fp8 weights", first_minibatch_ppo_ratio_outside_clip=[0.3] * 20,
                      response_length=[16.0] * 8 + [24.0] * 12)
        wide = _row(plan, "bypass_wide_clip", seed, [0.3] * 10 + [0.4 + 0.1 * seed] * 10)
        wide.update(regime="bf16 + fp8 weights", first_minibatch_ppo_ratio_outside_clip=[0.05] * 20,
                    response_length=[16.0] * 10 + [20.0 + 2 * seed] * 10)
        rows += [bypass, wide]
    line, = tables.mechanism_lines(rows)
    assert line.startswith("- bf16 + fp8 weights, bypass: does the clip range explain its failure?: bypass_wide_clip "
                           "vs bypass: no resolvable difference at 2 seeds (+0.250")
    assert ("bypass_wide_clip: 5.0 % of tokens outside the clip range at the first minibatch, responses 21.0 tokens "
            "over the last 10 steps, all at the 24-token cap on 0 of 40 steps") in line
    assert ("bypass: 30.0 % of tokens outside the clip range at the first minibatch, responses 24.0 tokens over the "
            "last 10 steps, all at the 24-token cap on 24 of 40 steps") in line


def test_the_dppo_lines_read_what_the_mask_removes_and_the_response_lengths_by_hand(plan, tables):
    rows = []
    for seed in range(2):
        # per step |A| mass 2.0; dppo_ppo removes 0.05 of it, its removed tokens (0.01) half with A > 0; responses
        # 18 tokens then the cap on its last 5 steps; decoupled TIS and prime_rl remove nothing / 0.02, never at the cap
        for algorithm, score, removed, positive, lengths in (
                ("decoupled_tis", 0.5, 0.0, 0.0, [16.0] * 20),
                ("dppo_ppo", 0.4, 0.05, 0.005, [18.0] * 15 + [24.0] * 5),
                ("prime_rl", 0.45, 0.02, 0.0, [17.0] * 20)):
            row = _row(plan, algorithm, seed, [0.3] * 10 + [score + 0.02 * seed] * 10)
            row.update(regime="bf16 + fp8 weights", abs_advantage=[2.0] * 20, removed_abs_advantage=[removed] * 20,
                       removed_token_fraction=[0.01 if removed else 0.0] * 20,
                       removed_positive_advantage=[positive] * 20, response_length=lengths,
                       mis_rs_stale_seq_fraction=[None] * 20)  # a synchronous run records no stale share
            rows.append(row)
    # a seed only decoupled TIS has is left out of both reads: its responses at the cap would show otherwise
    unpaired = _row(plan, "decoupled_tis", 2, [0.3] * 20)
    unpaired.update(regime="bf16 + fp8 weights", response_length=[24.0] * 20)
    against_tis, against_reinforce = tables.mechanism_lines(rows + [unpaired])
    assert against_tis.startswith("- bf16 + fp8 weights, DPPO's mask inside decoupled PPO: does it cost reward?: "
                                  "dppo_ppo vs decoupled_tis: no resolvable difference at 2 seeds (-0.100 [-0.100, "
                                  "-0.100] (n=2); the interval excludes 0, but a verdict needs 3 seeds)")
    assert ("dppo_ppo removes 2.5 % of the |A| mass, 50 % of its removed tokens with A > 0, responses 21.0 tokens "
            "over the last 10 steps, all at the 24-token cap on 10 of 40 steps") in against_tis
    assert ("decoupled_tis removes 0.0 % of the |A| mass, — % of its removed tokens with A > 0, responses 16.0 tokens "
            "over the last 10 steps, all at the 24-token cap on 0 of 40 steps") in against_tis
    assert against_reinforce.startswith("- bf16 + fp8 weights, DPPO's mask: inside decoupled PPO against its "
                                        "REINFORCE form: dppo_ppo vs prime_rl: no resolvable difference at 2 seeds "
                                        "(-0.050 [-0.050, -0.050] (n=2)")
    assert "prime_rl removes 1.0 % of the |A| mass, 0 % of its removed tokens with A > 0" in against_reinforce


def test_budget_takes_the_quietest_runs_pace(plan):
    rows = [{"regime": "fp32", "seconds": [100.0, 10.0, 12.0, 14.0]},  # median of steps 2.. : 12 s
            {"regime": "fp32", "seconds": [100.0, 20.0, None, 20.0]}]  # 20 s (work beside it)
    assert plan.seconds_per_step(rows, "fp32") == 12.0
    assert plan.seconds_per_step(rows, "fp16") == plan.REGIMES["fp16"][3]  # nothing measured: the assumed pace
    left = [("fp32", 1, "standard"), ("fp32", 1, "bypass"), ("fp16", 0, "standard")]
    # (40·12 + 60) · 2 + (40·22 + 60) = 2020 s = 0.56 h
    assert plan.budget_line(["fp32", "fp16"], left, 40, rows) == (
        "about 0.6 CPU hours left (fp32: 2 at 12.0 s/step, fp16: 1 at 22.0 s/step)")
    assert plan.budget_line(["fp32", "fp16"], [], 40, rows) == "every planned run is in"


def test_budget_counts_a_checkpointed_run_from_its_checkpoint(plan, tmp_path):
    """A run with a checkpoint in its folder resumes there: its metrics.jsonl's steps, down to a multiple of the save
    interval (10), are not counted again; a folder without a checkpoint, or with fewer steps than one interval, is."""
    left = [("fp32", 0, "standard"), ("fp32", 0, "bypass"), ("fp32", 1, "standard")]
    for (regime, seed, algorithm), lines, checkpoint in zip(left, (27, 35, 9), (True, False, True)):
        folder = plan.run_dir(tmp_path, regime, algorithm, seed)
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("{}\n" * lines)
        if checkpoint:
            (folder / "checkpoint.pt").write_bytes(b"")
    saved = plan.saved_steps(tmp_path, left)
    assert saved == {("fp32", 0, "standard"): 20}
    rows = [{"regime": "fp32", "seconds": [100.0, 10.0, 10.0]}]
    # (40 − 20)·10 + 60 + 2·(40·10 + 60) = 1180 s = 0.33 h
    assert plan.budget_line(["fp32"], left, 40, rows, saved) == (
        "about 0.3 CPU hours left (fp32: 3 at 10.0 s/step; checkpointed: standard seed 0 at step 20)")


def test_the_steps_pick_the_regimes_and_their_files(verdicts, plan, tmp_path, monkeypatch, capsys):
    """--steps 200 alone plans the regime of that length, in its own results file and runs' folder; any other number
    plans every regime without a length of its own, in the sweep's; --regimes and --results still choose."""
    assert plan.planned_regimes(200) == [ONE_STEP_OFF]
    assert plan.planned_regimes(40) == plan.planned_regimes(300) == [r for r in plan.REGIMES if r != ONE_STEP_OFF]
    assert plan.files_of([ONE_STEP_OFF]) == "lab_one_step_off"
    assert plan.files_of(["bf16"]) == plan.files_of(["bf16", ONE_STEP_OFF]) == "lab_verdicts"
    monkeypatch.setattr(verdicts, "RESULTS", tmp_path / "lab_verdicts.jsonl")
    (tmp_path / "lab_one_step_off.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)  # the runs' folders (runs/...) are read for checkpoints: none here
    monkeypatch.setattr(sys, "argv", ["lab_verdicts.py", "budget", "--steps", "200"])
    verdicts.main()
    # 4 algorithms x 3 seeds, none run: 12 x (200 x 6 s + 60 s) = 4.2 h
    assert capsys.readouterr().out == ("12 runs to do; about 4.2 CPU hours left (one-step-off, 2-digit addition: 12 at "
                                       "6.0 s/step)\n")
    monkeypatch.setattr(sys, "argv", ["lab_verdicts.py", "budget", "--steps", "40", "--regimes", "fp32"])
    verdicts.main()
    # 2 seeds x 3 algorithms, none in the sweep's (empty) file: 6 x (40 x 5 s + 60 s) = 0.43 h
    assert capsys.readouterr().out == "6 runs to do; about 0.4 CPU hours left (fp32: 6 at 5.0 s/step)\n"


def test_printing_the_tables_writes_no_file(verdicts, plan, tables, tmp_path, monkeypatch, capsys):
    """`run` and `tables` print the tables of whatever rows --results names (the long-horizon runs among them): the
    analyzer's curve and the verdict figures are written only with --docs, so printing another study's rows cannot
    overwrite the 40-step curve the analyzer ships."""
    import json

    rows = _regime_rows(plan, "bf16", 1.3e-3, {"standard": [0.7, 0.75], "decoupled_tis": [0.74, 0.7],
                                                   "bypass": [0.7, 0.7]})
    for row in rows:
        row["first_rollout"] = "same"
    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    curve_file, figures = tmp_path / "curve.json", tmp_path / "figures"
    shipped = verdicts.CURVE_FILE.read_bytes()
    written_to, write_curve = [], tables.write_curve
    monkeypatch.setattr(verdicts, "CURVE_FILE", curve_file)
    monkeypatch.setattr(verdicts, "FIGURES", figures)
    monkeypatch.setattr(tables, "write_curve", lambda *a, **k: written_to.append(a))  # records, writes nothing
    monkeypatch.setattr(sys, "argv", ["lab_verdicts.py", "tables", "--results", str(results), "--steps", "20"])
    verdicts.main()
    printed = capsys.readouterr().out
    assert written_to == [] and not curve_file.exists() and not figures.exists()
    assert (REPO / "miles_mis" / "analyze" / "safe_mismatch.json").read_bytes() == shipped
    assert "### bf16" in printed and "figure:" not in printed  # no figure named: those on disk are another run's
    # the same rows with a curve file named: it is written, with the paired bf16 point the print showed
    monkeypatch.setattr(tables, "write_curve", write_curve)
    tables.sections(rows, None, curve_file)
    written = json.loads(curve_file.read_text())
    assert written["steps"] == 20 and [p["regime"] for p in written["points"]] == ["bf16"]


def test_centering_lines_by_hand(plan, tables):
    """The score-centering cells' signals, first 10 steps -> last 10 (means over runs) and the largest step value;
    standard PPO beside them; no line for a cell without runs."""
    rows = []
    for seed, tail_end in ((0, 3.0), (1, 5.0)):
        row = _row(plan, "sc", seed, [0.3] * 20)
        row.update(regime="bf16 + fp8 weights", mis_sc_tail_ratio=[1.0] * 10 + [tail_end] * 10,
                   grad_norm=[0.5] * 10 + [1.5] * 10, response_length=[10.0] * 20, truncated_fraction=[0.0] * 20)
        rows.append(row)
        standard = _row(plan, "standard", seed, [0.3] * 20)
        standard.update(regime="bf16 + fp8 weights", grad_norm=[0.2] * 20, response_length=[12.0] * 20,
                        truncated_fraction=[0.25] * 20, mis_sc_tail_ratio=[None] * 20)  # as a run records: none
        rows.append(standard)
    lines = tables.centering_lines(rows)
    assert lines == [
        "- bf16 + fp8 weights, standard (2 runs): grad norm 0.2 → 0.2 (largest step 0.2), response length 12.0 → 12.0 "
        "(largest step 12.0), truncated share 0.25 → 0.25 (largest step 0.25)",
        "- bf16 + fp8 weights, sc (2 runs): tail ratio 1 → 4 (largest step 5), grad norm 0.5 → 1.5 (largest step 1.5), "
        "response length 10.0 → 10.0 (largest step 10.0), truncated share 0.00 → 0.00 (largest step 0.00)"]
    assert tables.centering_lines([r for r in rows if r["algorithm"] == "standard"]) == []



def _long_rows(plan):
    """Two seeds of standard and sc_mis, 120 steps: standard saturates after 50 steps, sc_mis climbs on."""
    rows = []
    for seed, offset in ((0, 0.0), (1, 0.1)):
        standard = _row(plan, "standard", seed, [0.1 + offset] * 50 + [0.3 + offset] * 70)
        sc_mis = _row(plan, "sc_mis", seed, [0.1 + offset] * 50 + [0.3 + offset] * 50 + [0.5 + offset] * 20)
        for row in (standard, sc_mis):
            row.update(regime=ONE_STEP_OFF, steps=200, first_rollout="same", machine="AMD EPYC, 2 cores, boot aaaa",
                       grad_norm=[0.5] * 110 + [2.0] * 10, response_length=[20.0] * 120,
                       truncated_fraction=[0.5] * 10 + [0.0] * 110)
        standard["mis_sc_tail_ratio"], sc_mis["mis_sc_tail_ratio"] = [None] * 120, [1.0] * 120  # as runs record
        rows += [standard, sc_mis]
    return rows


def test_window_table_by_hand(plan, tables):
    """Per algorithm the mean reward of each 50-step window over its runs, ± their sd: standard's (0.1, 0.2) in the
    first window is 0.150 ± 0.071; the last window is 20 steps long (101–120)."""
    table = tables.window_table(_long_rows(plan), ONE_STEP_OFF)
    assert table.splitlines() == [
        "| algorithm | runs | steps 1–50 | steps 51–100 | steps 101–120 |", "|---|---|---|---|---|",
        "| standard | 2 | 0.150 ± 0.071 | 0.350 ± 0.071 | 0.350 ± 0.071 |",
        "| sc_mis | 2 | 0.150 ± 0.071 | 0.350 ± 0.071 | 0.550 ± 0.071 |"]


def test_a_long_regime_lists_every_algorithms_signals_and_stays_out_of_the_centering_lines(plan, tables):
    rows = _long_rows(plan)
    assert tables.centering_lines(rows) == []  # the 40-step regimes' lines only
    assert tables.long_regime_lines(rows, ONE_STEP_OFF) == [
        f"- {ONE_STEP_OFF}, standard (2 runs): grad norm 0.5 → 2 (largest step 2), response length 20.0 → 20.0 "
        "(largest step 20.0), truncated share 0.50 → 0.00 (largest step 0.50)",
        f"- {ONE_STEP_OFF}, sc_mis (2 runs): tail ratio 1 → 1 (largest step 1), grad norm 0.5 → 2 (largest step 2), "
        "response length 20.0 → 20.0 (largest step 20.0), truncated share 0.50 → 0.00 (largest step 0.50)"]


def test_a_long_regimes_rows_print_its_sections_alone(plan, tables):
    """Printing the one-step-off rows gives that regime's table, windows and signals, not the 40-step regimes as
    "(no runs yet)" nor the sweep's mechanisms and curve; the 40-step rows never show a long regime without runs."""
    printed = tables.printed_tables(_long_rows(plan))
    assert [line for line in printed.splitlines() if line.startswith("### ")] == [
        f"### {ONE_STEP_OFF}", f"### {ONE_STEP_OFF}: mean reward by 50-step window",
        f"### {ONE_STEP_OFF}: signals, first 10 steps → last 10"]
    titles = [title for title, _, _ in tables.sections(_regime_rows(plan, "bf16", 1.3e-3, {"standard": [0.7, 0.75]}),
                                                       None)]
    assert ONE_STEP_OFF not in titles and "bf16 + fp8 weights" in titles and "Mechanisms" in titles


def test_a_long_regimes_docs_fill_its_own_part_and_leave_the_sweep_and_the_curve(verdicts, plan, tables, tmp_path,
                                                                                  monkeypatch):
    """`tables --steps 200 --results <its file> --docs PAGE` writes between the regime's markers only: the 40-step
    tables, the safe-mismatch table and the analyzer's curve (another study's rows) stay as they were."""
    import json

    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in _long_rows(plan)))
    page = tmp_path / "verdicts.md"
    untouched = ("<!-- lab_verdicts:verdicts -->\n40-step tables\n<!-- /lab_verdicts:verdicts -->\n"
                 "<!-- lab_verdicts:safe -->\nsafe table\n<!-- /lab_verdicts:safe -->\n")
    page.write_text(untouched + "<!-- lab_verdicts:one-step-off_2-digit_addition -->\nold\n"
                    "<!-- /lab_verdicts:one-step-off_2-digit_addition -->\n")
    written_to, centering = [], tmp_path / "lab_score_centering.json"
    centering.write_bytes(verdicts.CENTERING_FILE.read_bytes())
    monkeypatch.setattr(tables, "write_curve", lambda *a, **k: written_to.append(a))
    monkeypatch.setattr(verdicts, "CENTERING_FILE", centering)
    staleness = tmp_path / "lab_staleness.json"
    staleness.write_bytes(verdicts.STALENESS_FILE.read_bytes())
    monkeypatch.setattr(verdicts, "STALENESS_FILE", staleness)
    monkeypatch.setattr(sys, "argv", ["lab_verdicts.py", "tables", "--steps", "200", "--results", str(results),
                                      "--docs", str(page), "--no-figures"])
    verdicts.main()
    text = page.read_text()
    assert written_to == [] and text.startswith(untouched)
    part = text[len(untouched):]
    assert "old" not in part and "4 runs of 200 steps" in part
    assert f"**{ONE_STEP_OFF}: mean reward by 50-step window**" in part and "| sc_mis | 2 | 0.150 ± 0.071" in part
    assert f"- {ONE_STEP_OFF}, sc_mis (2 runs): tail ratio 1 → 1" in part
    # bypass and decoupled TIS on seeds 0 and 1, the four on seed 2: this regime's runs, not the 40-step sweep's
    budget = "`budget` says 8 runs, about 0.1 CPU hours left (one-step-off, 2-digit addition: 8 at"
    assert budget in " ".join(part.split())
    # the analyzer's score-centering evidence gains this regime's sc_mis cell and keeps the 40-step regime's
    regimes = json.loads(centering.read_text())["regimes"]
    assert regimes["bf16 + fp8 weights"] == json.loads(verdicts.CENTERING_FILE.read_text())["regimes"][
        "bf16 + fp8 weights"]
    (cell,) = regimes[ONE_STEP_OFF]["cells"]
    assert cell["algorithm"] == "sc_mis" and cell["seeds"] == [0, 1] and cell["delta"] == pytest.approx(0.2)
    # and the staleness evidence this regime's entry (every algorithm against standard, its schedule from the flags),
    # the 40-step async regimes' entries kept
    stale = json.loads(staleness.read_text())["regimes"]
    assert stale["async lags 0..2"] == json.loads(verdicts.STALENESS_FILE.read_text())["regimes"]["async lags 0..2"]
    entry = stale[ONE_STEP_OFF]
    assert (entry["schedule"], entry["max_lag"], entry["steps"], entry["baseline_collapsed"]) == (
        "every sample 1 version old", 1, 200, 0)
    (cell,) = entry["cells"]  # seeds 0 and 1: last 10 steps 0.5 against 0.3, 0.6 against 0.4
    assert (cell["algorithm"], cell["seeds"], cell["collapsed"]) == ("sc_mis", [0, 1], 0)
    assert (cell["delta"], cell["low"], cell["high"]) == pytest.approx((0.2, 0.2, 0.2))
