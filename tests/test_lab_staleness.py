"""The lab's verdicts at a version lag: benchmarks/lab_staleness_evidence.py builds them from paired rows (by hand
here), the shipped file is what the committed rows give, and the report cites them after the published runs with
stale rollouts, as measured."""

import json

import pytest

from conftest import committed_lab_cells, load_benchmark
from miles_mis.analyze import lab_staleness, published
from miles_mis.analyze.report import markdown as report_markdown


@pytest.fixture(scope="module")
def evidence():
    return load_benchmark("lab_staleness_evidence")


def _row(last10, first10=0.3):
    return {"reward": [first10] * 10 + [last10] * 10, "raw_k3": [2e-3] * 20}


def test_the_schedule_is_read_from_the_engine_flags(evidence):
    assert evidence.schedule(["--rollout-dtype", "bf16", "--async-max-lag", "4"]) == (
        "every batch mixes lags 0 to 4", 4)
    assert evidence.schedule(["--rollout-lag", "1", "--num-digits", "2"]) == ("every sample 1 version old", 1)
    assert evidence.schedule(["--rollout-lag", "3"]) == ("every sample 3 versions old", 3)
    assert evidence.schedule(["--rollout-staleness", "4"]) == ("the engine syncs every 4 steps (lags 0 to 3)", 3)
    assert evidence.schedule(["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"]) is None


def test_a_stale_entry_by_hand_counts_collapses_and_pairs_every_algorithm(evidence):
    """bypass on seeds 0, 1: last 10 at 0.2 (first 10 at 0.3: −0.1, collapsed) against standard's 0.5 → Δ −0.3 on
    both seeds, sd 0 → [−0.3, −0.3]; fixed_drop on one seed is left out (no pair of 2)."""
    cells = {"standard": {0: _row(0.5), 1: _row(0.5)}, "bypass": {0: _row(0.2), 1: _row(0.2)},
             "fixed_drop": {0: _row(0.9)}}
    entry = evidence.stale_entry(cells, 40, ["--async-max-lag", "2"])
    assert (entry["schedule"], entry["max_lag"], entry["steps"]) == ("every batch mixes lags 0 to 2", 2, 40)
    assert entry["baseline_seeds"] == [0, 1] and entry["baseline_collapsed"] == 0
    assert entry["baseline_raw_k3"] == pytest.approx(2e-3)
    (cell,) = entry["cells"]
    assert (cell["algorithm"], cell["label"], cell["seeds"], cell["collapsed"], cell["higher_on"]) == (
        "bypass", "bypass", [0, 1], 2, 0)
    assert (cell["delta"], cell["low"], cell["high"]) == pytest.approx((-0.3, -0.3, -0.3))
    assert evidence.stale_entry(cells, 40, ["--rollout-dtype", "bf16"]) is None  # synchronous: no entry


EVIDENCE = {"model": "M", "engine": "E", "regimes": {
    "lags 0..2": {"schedule": "every batch mixes lags 0 to 2", "max_lag": 2, "steps": 40, "baseline_raw_k3": 2.2e-3,
                  "baseline_seeds": [0, 1, 2], "baseline_collapsed": 1, "cells": [
                      {"label": "bypass", "seeds": [0, 1, 2], "delta": -0.1, "low": -0.15, "high": -0.05,
                       "higher_on": 0, "collapsed": 2},
                      {"label": "TIS", "seeds": [0, 1], "delta": 0.02, "low": -0.01, "high": 0.05, "higher_on": 2,
                       "collapsed": 0}]},
    "one step": {"schedule": "every sample 1 version old", "max_lag": 1, "steps": 200, "baseline_raw_k3": None,
                 "baseline_seeds": [0, 1], "baseline_collapsed": 0, "cells": [
                     {"label": "SC", "seeds": [0, 1], "delta": 0.0, "low": -0.2, "high": 0.2, "higher_on": 1,
                      "collapsed": 0}]}}}


def test_the_sentence_by_hand():
    """Runs: 3 standard + 3 bypass + 2 TIS = 8, collapsed 1 + 2 + 0 = 3; the paired seeds 2–3 where cells differ."""
    assert lab_staleness.sentence(EVIDENCE) == (
        "The lab's paired runs at a version lag (M on E: a 135M model with short answers, 40 to 200 steps, lags up "
        "to 2; the published runs weigh more). “lags 0..2” (every batch mixes lags 0 to 2; 40 steps, 2–3 paired "
        "seeds, standard PPO's raw k3 2.2e-03): 3 of 8 runs collapsed; against standard PPO's last-10-step reward, "
        "resolved: bypass below it −0.100 [−0.150, −0.050] (higher on 0 of 3 seeds); not resolved (the interval "
        "includes 0): TIS +0.020 [−0.010, +0.050]. “one step” (every sample 1 version old; 200 steps, 2 paired "
        "seeds): 0 of 4 runs collapsed; against standard PPO's last-10-step reward, not resolved (the interval "
        "includes 0): SC +0.000 [−0.200, +0.200].")
    assert lab_staleness.sentence({}) is None and lab_staleness.sentence({"regimes": {}}) is None
    assert "safe" not in lab_staleness.sentence()


def test_the_shipped_file_is_what_the_committed_rows_give(evidence):
    """Nothing in lab_staleness.json is typed by hand: each entry is stale_entry over the paired rows of its results
    file (the one-step-off regime's own, the 40-step async regimes' lab_verdicts.jsonl)."""
    plan = load_benchmark("lab_verdicts_plan")
    shipped = lab_staleness.load()
    assert shipped is not None and set(shipped["regimes"]) == {
        regime for regime, (flags, *_) in plan.REGIMES.items() if evidence.schedule(flags)}
    for regime, entry in shipped["regimes"].items():
        steps = entry["steps"]
        cells = committed_lab_cells(regime, steps)
        want = evidence.stale_entry(cells, steps, plan.REGIMES[regime][0])
        assert json.loads(json.dumps(want)) == entry, regime


STALE = {"by_lag": [{"bucket": "0", "k3": 1e-4}, {"bucket": "1", "k3": 1e-3}],
         "lag_attribution": {"stale_buckets": [{"bucket": "1", "k3": 1e-3, "staleness_share": 0.9}]}}


def test_the_report_cites_whichever_of_the_two_it_has(monkeypatch):
    monkeypatch.setattr(published, "load", lambda path=None: [])
    assert report_markdown.staleness_evidence(STALE) == lab_staleness.sentence()  # no published rows: the lab alone
    monkeypatch.setattr(lab_staleness, "load", lambda path=None: None)
    assert report_markdown.staleness_evidence(STALE) is None  # neither
    fresh = {"by_lag": STALE["by_lag"][:1], "lag_attribution": {"stale_buckets": []}}
    monkeypatch.undo()
    assert report_markdown.staleness_evidence(fresh) is None  # lag 0 only: nothing stale to cite for
