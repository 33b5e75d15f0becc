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


def by_id(name):
    return next(row for row in ROWS if row["id"] == name)


def test_the_score_centering_and_staleness_rows_as_their_sources_give_them():
    collapse = by_id("qwen36-35b-a3b-hetero-sc-alone-collapse")
    assert (collapse["outcome"], collapse["outcome_step"], collapse["mismatch_metric"], collapse["mismatch_value"],
            collapse["k3_equivalent"]) == ("collapsed", 33, "sc_tail_ratio", [1.2, 52.0], None)
    assert "step 40" in collapse["corrections"][1]["result"] and "0.36 -> 0.10" in collapse["corrections"][1]["result"]
    held = by_id("qwen36-35b-a3b-hetero-sc-mis-held")
    assert held["outcome"] == "stable" and held["corrections"][0]["result"].startswith("held")
    assert "[0.5, 5]" in held["corrections"][0]["name"]
    null = by_id("marin-9291-score-centering-null-replication")
    assert null["url"] == "marin-community/marin#9291" and null["k3_equivalent"] is None
    assert null["corrections"][0]["result"].startswith("no resolved effect (+28.5, -23.5, -5.5") and "mean -0.2" in \
        null["corrections"][0]["result"]
    stale = by_id("marin-8955-qwen3-0.6b-stale-ppo-vs-tis")
    assert stale["url"] == "marin-community/marin#8955" and stale["outcome"] == "degraded"
    results = {c["name"]: c["result"] for c in stale["corrections"]}
    assert results["none (plain PPO), cadence 1, age 1"].startswith("failed (2/128 completed answers, 98.44%")
    assert results["PPO + TIS, cadence 1, age 1"].startswith("held (98/128")
    for row in (collapse, held, null, stale):
        assert row["source_read"] is True and row["quote"] and row["note"]
    assert [r["id"] for r in published.with_topic("score_centering", ROWS)] == [collapse["id"], held["id"], null["id"]]
    assert published.with_topic("staleness", ROWS) == [stale]


def test_a_level_stated_in_another_metric_is_said_as_such_and_never_taken_for_k3():
    collapse = by_id("qwen36-35b-a3b-hetero-sc-alone-collapse")
    assert published.describe(collapse) == ("Qwen3.6-35B-A3B collapsed by step 33 at sc_tail_ratio 1.2–52, no k3 "
                                             "stated (Qwen3.6-35B-A3B mismatch study, 2026-10-04)")
    assert published.describe(by_id("marin-9291-score-centering-null-replication")) == (
        "Qwen3-0.6B stable over 40 steps at mean |log(trainer/behavior)| 0.015, no k3 stated (marin-community/marin "
        "PR #9291, 2026-09-20)")
    assert published.describe(by_id("qwen36-35b-a3b-hetero-sc-mis-held")).startswith(
        "Qwen3.6-35B-A3B stable over 223 steps at an unstated level")
    assert published.cite(collapse).startswith(published.describe(collapse) + ": score centering without an")
    # none of them enters the k3 comparison: no stated k3
    assert not [r for r in published.went_wrong_at_or_below(1.0, ROWS) if r.get("topics")]


def test_the_new_held_corrections_do_not_displace_the_cited_ones():
    names = [name for name, _ in published.held_corrections(ROWS)]
    assert names[:3] == ["token TIS [0.5, 1.5] + geometric MIS [0.99, 1.001] + batch norm (config 2)",
                         "sequence-level TIS, C=2",
                         "geometric sequence masking (SkyRL config defaults geo_mask_low 0.99 / geo_mask_high 1.01; "
                         "bounds used in the run not stated)"]
    assert "score centering + IcePop-style MIS weights [0.5, 5] (full vocabulary), run r02" in names
    assert "PPO + TIS, cadence 1, age 1" in names
    assert not any(name.startswith("score centering (top-k 32)") for name in names)  # the null is not "held"
