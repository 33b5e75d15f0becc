"""The published production outcomes the analyzer weighs (miles_mis/analyze/published_outcomes.json) and the advice
built on them: every row names its source, and no sentence calls a level safe where a run went wrong at or below it."""

import math

import pytest

from miles_mis.analyze import published, safe_level

ROWS = published.load()


def test_every_shipped_row_names_its_source_and_a_known_outcome():
    assert len(ROWS) >= 6
    assert len({row["id"] for row in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row["source"] and row["url"] and isinstance(row["source_read"], bool), row["id"]
        assert row["outcome"] in published.OUTCOME_VALUES, row["id"]
        level = published.k3_range(row)
        if level is not None:
            assert 0 < level[0] <= level[1] and math.isfinite(level[1]), row["id"]
        assert all(correction["name"] and correction["result"] for correction in row["corrections"]), row["id"]


def row(name, outcome, k3=None, corrections=()):
    return {"id": name, "source": f"{name}: a study", "url": "x/y#1", "date": None, "model": name, "outcome": outcome,
            "k3_equivalent": k3, "mismatch_metric": "k3" if k3 is not None else None, "steps": 300,
            "outcome_step": 300 if outcome == "collapsed" else None,
            "corrections": [{"name": n, "result": r} for n, r in corrections]}


def test_collapses_at_or_below_a_level_by_hand():
    rows = [row("a", "collapsed", [1e-3, 1e-2]), row("b", "collapsed", 5e-4), row("c", "stable", 1e-5),
            row("d", "degraded", 1e-5), row("e", "collapsed")]
    assert [r["id"] for r in published.went_wrong_at_or_below(2e-3, rows)] == ["a", "b"]  # nearest level first
    assert [r["id"] for r in published.went_wrong_at_or_below(6e-4, rows)] == ["b"]
    assert published.went_wrong_at_or_below(1e-4, rows) == []
    assert [r["id"] for r in published.went_wrong_unstated(rows)] == ["e"]
    text = published.sentence(1e-4, rows)
    assert text.startswith("The lowest published level where a run went wrong is above this one: b collapsed by step "
                           "300 at k3 5.0e-04 (b).")
    assert "Others collapsed at levels their sources do not state: e collapsed by step 300" in text


def test_only_weight_corrections_that_held_are_advised():
    rows = [row("a", "collapsed", 1e-3, [("token TIS [0.5, 1.5] + geometric MIS", "held"),
                                         ("resume on other GPUs", "held"), ("token TIS C=2", "failed")]),
            row("b", "stable", 1e-3, [("token-level IS (TIS)", "held (no harm)")])]
    assert [name for name, _ in published.held_corrections(rows)] == ["token TIS [0.5, 1.5] + geometric MIS"]


@pytest.mark.parametrize("k3", [10 ** (e / 4) for e in range(-28, 1)])
def test_the_advice_never_calls_a_level_safe(k3):
    """At every level, against the shipped lab curve and the shipped outcomes: never "safe" or "not a need", and every
    shipped collapse at a stated level at or below the dump's k3 is named (the nearest three)."""
    text = safe_level.sentence(k3, safe_level.load(), ROWS)
    assert text is not None
    assert "Safe by" not in text and "not a need" not in text and " is safe" not in text
    for collapsed in published.went_wrong_at_or_below(k3, ROWS)[:3]:
        assert collapsed["model"].split(" (")[0] in text
    assert "Corrections that held in published runs" in text
