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


NEW_ROWS = ("nemo-rl-2269-nemotron-120b-sequence-sum-is-weight", "open-instruct-1473-olmo3-7b-lr0-drift",
            "prime-rl-3543-dsv4-flash-lr0-admission", "prime-rl-3543-dsv4-flash-vllm-weight-reload-bug",
            "verl-7242-deepseek-v4-veomni", "qwen36-35b-a3b-hetero-grpo-top-p-replay-collapse")


def test_every_topic_is_a_known_one_and_the_new_rows_carry_the_full_schema():
    for row in ROWS:
        assert set(row.get("topics") or ()) <= set(published.TOPICS), row["id"]
    fields = {"id", "source", "url", "date", "model", "params_b", "moe", "engine_setup", "mismatch_metric",
              "mismatch_value", "k3_equivalent", "k3_note", "response_length", "steps", "async_or_off_policy",
              "outcome", "outcome_step", "corrections", "quote", "source_read", "topics", "note"}
    for name in NEW_ROWS:
        row = by_id(name)
        assert set(row) == fields, (name, set(row) ^ fields)
        assert row["source_read"] is True and row["quote"] and row["note"] and row["k3_note"], name
        if row["outcome"] == "measured":  # a level with no training outcome has no step it went wrong at
            assert row["outcome_step"] is None, name
    with pytest.raises(ValueError, match="topic must be one of score_centering, staleness"):
        published.with_topic("lr_zero", ROWS)


def test_the_new_rows_as_their_sources_give_them():
    nemo = by_id("nemo-rl-2269-nemotron-120b-sequence-sum-is-weight")
    assert (nemo["url"], nemo["outcome"], nemo["outcome_step"], nemo["mismatch_metric"], nemo["mismatch_value"],
            nemo["k3_equivalent"], nemo["response_length"]) == (
        "NVIDIA-NeMo/RL#2269", "degraded", 1, "gen_kl_error", 0.0027, None, [8000, 10000])
    assert "0.0596" in nemo["corrections"][0]["result"] and "17x" in nemo["corrections"][0]["result"]
    assert "0.9999" in nemo["corrections"][1]["result"]
    assert round(1 / 0.0596, 1) == 16.8  # the source's "~17x"
    drift = by_id("open-instruct-1473-olmo3-7b-lr0-drift")
    assert (drift["outcome"], drift["outcome_step"], drift["mismatch_value"], drift["k3_equivalent"]) == (
        "collapsed", 550, None, None)
    assert "learning_rate=0" in drift["corrections"][1]["name"] and drift["corrections"][1]["result"].startswith(
        "failed")
    math_check = by_id("prime-rl-3543-dsv4-flash-lr0-admission")
    assert (math_check["outcome"], math_check["steps"], published.k3_range(math_check)) == (
        "measured", 20, (0.00025, 0.0011))
    bug = by_id("prime-rl-3543-dsv4-flash-vllm-weight-reload-bug")
    assert (bug["outcome"], published.k3_range(bug)) == ("improved", (0.024, 0.194))
    assert bug["corrections"][0]["result"] == "held (mismatch_kl 0.194 -> 0.024, max 0.490 -> 0.053)"
    verl = by_id("verl-7242-deepseek-v4-veomni")
    assert (verl["url"], verl["outcome"], published.k3_range(verl)) == (
        "verl-project/verl#7242", "measured", (0.005191931966692209, 0.005191931966692209))
    assert "rollout_probs_diff_max 0.611" in verl["k3_note"]
    top_p = by_id("qwen36-35b-a3b-hetero-grpo-top-p-replay-collapse")
    assert (top_p["outcome"], top_p["outcome_step"], top_p["k3_equivalent"]) == ("collapsed", 60, None)
    assert "21% at step 60 and 72% by step 69" in top_p["corrections"][0]["result"]
    assert top_p["url"] == by_id("qwen36-35b-a3b-hetero-sc-mis-held")["url"]  # the registry at commit 073b73ff
    # none of the new rows is a collapse at a stated k3: the k3 comparison's evidence is unchanged by them
    assert not [r for r in published.went_wrong_at_or_below(1.0, ROWS) if r["id"] in NEW_ROWS]
    assert published.describe(math_check) == ("DeepSeek-V4-Flash measured over 20 steps at k3 2.5e-04–1.1e-03 "
                                              "(PrimeIntellect-ai/prime-rl PR #3543, 2026-09-14)")
    assert published.describe(verl) == ("DeepSeek-V4 measured at rollout_corr/k3_kl 5.2e-03 (= k3) "
                                        "(verl-project/verl PR #7242, 2026-08-03)")
    assert published.describe(nemo) == ("Nemotron 3.5 Super VL 120B-A12B degraded by step 1 at gen_kl_error 0.0027, "
                                        "no k3 stated (NVIDIA-NeMo/RL PR #2269, 2026-09-21)")


def topic_row(name, topic, outcome="collapsed"):
    return {**row(name, outcome), "source": f"{name}/repo issue #1: a thread", "date": "2026-01-02",
            "topics": [topic], "quote": f"The {name} quote."}


def test_the_drift_rows_close_the_k3_sentence_and_only_they_do():
    rows = [row("a", "collapsed", 5e-4), topic_row("d", "lr0_drift")]
    text = published.sentence(1e-3, rows)
    drift = ("One reading is not a bound on later steps; the mismatch grew with the weights fixed: d collapsed by "
             "step 300 at an unstated level (d/repo issue #1, 2026-01-02): the d quote.")
    assert text.endswith(drift)
    assert published.drift_sentence(rows) == drift
    assert "weights fixed" not in published.sentence(1e-3, rows[:1]) and published.drift_sentence(rows[:1]) is None


@pytest.mark.parametrize("k3", [1e-6, 1e-3, 0.2])
def test_the_shipped_advice_cites_the_learning_rate_zero_drift_at_every_level(k3):
    """A dump's k3 is one reading: at any level the safety advice cites the run whose mismatch grew at lr 0."""
    text = safe_level.sentence(k3, safe_level.load(), ROWS)
    assert text is not None
    assert published.cite(by_id("open-instruct-1473-olmo3-7b-lr0-drift")).rstrip(".") in text


def test_a_dump_whose_product_ratios_leave_the_band_cites_the_sequence_weight_row():
    nemo = by_id("nemo-rl-2269-nemotron-120b-sequence-sum-is-weight")
    long_dump = {"seq_product_outside_half_two_fraction": 0.62, "mean_response_length": 9123.4}
    text = published.sequence_weight_sentence(long_dump, ROWS)
    assert text.startswith("62% of the sequences' product ratio ∏ρ = exp(Σ l) leaves [0.5, 2] here, mean response "
                           "9,123 tokens: a sequence-level weight on exp(Σ l) rescales whole sequences")
    assert text.endswith("Published: " + published.cite(nemo))
    at_threshold = {"seq_product_outside_half_two_fraction": published.PRODUCT_OUTSIDE_SHARE}
    assert published.sequence_weight_sentence(at_threshold, ROWS).startswith("50% of the sequences'")
    assert published.sequence_weight_sentence({"seq_product_outside_half_two_fraction": 0.49}, ROWS) is None
    assert published.sequence_weight_sentence({}, ROWS) is None  # no share in the dump: nothing claimed
    assert published.sequence_weight_sentence(long_dump, [r for r in ROWS if r is not nemo]) is None
    for bad in (float("nan"), 1.5, -0.1, "0.6", True):
        with pytest.raises(ValueError, match=r"seq_product_outside_half_two_fraction must be a number in \[0, 1\]"):
            published.sequence_weight_sentence({"seq_product_outside_half_two_fraction": bad}, ROWS)


def test_the_admission_sentence_cites_the_checks_then_the_drift_they_cannot_see():
    text = published.admission_sentence(ROWS)
    checks = [published.cite(by_id(name)).rstrip(".") for name in (
        "prime-rl-3543-dsv4-flash-lr0-admission", "prime-rl-3543-dsv4-flash-vllm-weight-reload-bug",
        "verl-7242-deepseek-v4-veomni")]
    assert text.startswith("Published new-model checks: " + "; ".join(checks) + ".")
    assert text.endswith("A short check can pass and the mismatch still grow later: "
                         + published.cite(by_id("open-instruct-1473-olmo3-7b-lr0-drift")))
    hand = [topic_row("c", "admission", "measured")]
    assert published.admission_sentence(hand) == ("Published new-model checks: c measured over 300 steps at an "
                                                  "unstated level (c/repo issue #1, 2026-01-02): the c quote.")
    assert published.admission_sentence([topic_row("d", "lr0_drift")]) is None
