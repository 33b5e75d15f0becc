"""The asynchronous lab: per-sample weight versions, the decomposition of the mismatch into staleness and numerics,
lags and the current policy handed to the plugin, dumps and the analyzer by lag, reproducible and resumable."""

import json

import pytest

from miles_mis.lab import schedule
from miles_mis.lab.train import parse_args, train

PLUGIN = "miles_mis.compute_mis_weights_with_cp"
SMALL = ["--quiet", "--prompts-per-step", "4", "--sft-steps", "10", "--save-interval", "0"]


def run(tmp_path, name, *flags, steps=6):
    args = parse_args([*SMALL, "--steps", str(steps), "--out-dir", str(tmp_path / name), *flags])
    return train(args)


def test_group_versions_of_the_two_schedules():
    assert schedule.group_versions(5, 6, 2, 1, 0) == [5] * 6  # synchronous
    assert schedule.group_versions(5, 6, 2, 4, 0) == [4] * 6  # synced at step 4
    assert schedule.group_versions(8, 8, 2, 4, 0) == [8] * 8  # a sync step
    # groups of 2 at lags 0, 1, 2, 0, ... (never before version 0)
    assert schedule.group_versions(5, 8, 2, 1, 2) == [5, 5, 4, 4, 3, 3, 5, 5]
    assert schedule.group_versions(1, 6, 2, 1, 2) == [1, 1, 0, 0, 0, 0]
    # one-step-off: the whole batch one version behind (version 0 at the first step)
    assert schedule.group_versions(5, 4, 2, 1, 0, rollout_lag=1) == [4] * 4
    assert schedule.group_versions(0, 4, 2, 1, 0, rollout_lag=1) == [0] * 4
    assert schedule.group_versions(5, 4, 2, 1, 0, rollout_lag=3) == [2] * 4


def test_a_one_step_off_run_trains_on_batches_one_version_old(tmp_path):
    """--rollout-lag 1: from the second step every sample is one version behind; the first step's has no older
    version (lag 0). The staleness part is then nonzero, and a synchronous fp32 run's is exactly zero."""
    history = run(tmp_path, "lag1", "--rollout-lag", "1", "--rollout-dtype", "fp32", "--lr", "3e-3", steps=4)
    assert [row["mean_lag"] for row in history] == [0.0, 1.0, 1.0, 1.0]
    assert history[0]["stale_k3"] == 0.0 and all(row["stale_k3"] > 0 for row in history[1:])
    assert all(row["lag_1_token_fraction"] == 1.0 for row in history[1:])


def test_the_decomposition_is_exact_where_staleness_is_zero_by_construction(tmp_path):
    """Synchronous (K = 1) with an fp32 engine: π_trainer(v) is π_old, so the staleness part is exactly 0 and the
    numerics part is the whole (near-zero) mismatch."""
    history = run(tmp_path, "sync", "--rollout-dtype", "fp32")
    for row in history:
        assert row["stale_k3"] == 0.0 and row["cross_k3"] == 0.0 and row["mean_lag"] == 0.0
        assert row["numerics_k3"] == pytest.approx(row["raw_k3"], rel=1e-9, abs=1e-15)
        assert row["numerics_k3"] < 1e-9  # the fp32 engine nearly agrees with the trainer
        assert row["lag_0_token_fraction"] == 1.0


def test_the_parts_add_up_and_staleness_grows_with_the_lag(tmp_path):
    """--rollout-staleness 3 at a high learning rate: raw k3 = staleness + numerics + interaction at every step;
    0 staleness at the sync steps (lag 0), more at lag 2 than at lag 1."""
    history = run(tmp_path, "stale", "--rollout-staleness", "3", "--lr", "3e-3", steps=9)
    for row in history:
        total = row["stale_k3"] + row["numerics_k3"] + row["cross_k3"]
        assert total == pytest.approx(row["raw_k3"], rel=1e-6, abs=1e-12)
    lags = [row["mean_lag"] for row in history]
    assert lags == [0.0, 1.0, 2.0] * 3
    for row in history[::3]:
        assert row["stale_k3"] == 0.0
    assert all(history[i + 2]["stale_k3"] > history[i + 1]["stale_k3"] > 0 for i in (3, 6))
    assert all(row["stale_k3"] > 10 * row["numerics_k3"] for row in history if row["mean_lag"] == 2.0)


def test_mixed_lag_batches_pass_lags_and_the_current_policy_to_the_plugin(tmp_path):
    """--async-max-lag 2: every batch holds lags 0, 1, 2 (groups of 8, 4 prompts: lags 0, 1, 2, 0); the plugin
    gets the lags (its lag metrics) and, with tis_policy: current, the current policy's log-probs."""
    config = tmp_path / "mis.yaml"
    config.write_text("tis_policy: current\ntis_upper_bound_by_lag: [2.0, 1.5, 1.2]\n")
    history = run(tmp_path, "mixed", "--async-max-lag", "2", "--use-tis", "--loss-type", "reinforce",
                  "--pass-current-log-probs", "--custom-tis-function-path", PLUGIN, "--custom-config-path",
                  str(config))
    for step, row in enumerate(history):
        if step >= 2:  # from step 2 on, every lag is available
            assert row["mean_lag"] == pytest.approx((0 + 1 + 2 + 0) / 4)
            assert row["lag_0_token_fraction"] > 0 and row["lag_2_token_fraction"] > 0
        assert row["lag_0_stale_k3"] == 0.0  # the lag-0 samples: π_trainer(v) = π_old
        assert row["lag_3plus_token_fraction"] == 0.0
        assert "mis_lag_1_k3" in row and "mis_version_lag" in row
    assert history[-1]["lag_2_stale_k3"] > 0


def test_an_async_run_is_reproducible_and_resumes_exactly(tmp_path):
    flags = ["--async-max-lag", "2", "--lr", "3e-3"]
    first = run(tmp_path, "a", *flags)
    second = run(tmp_path, "b", *flags)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(first) == strip(second)
    # 3 steps, a checkpoint (with the snapshots of the versions in use), then 3 more from it
    args = parse_args([*SMALL, "--steps", "3", "--out-dir", str(tmp_path / "c"), "--save-interval", "3", *flags])
    train(args)
    args = parse_args([*SMALL, "--steps", "6", "--out-dir", str(tmp_path / "c"), "--save-interval", "3", "--resume",
                       *flags])
    assert strip(train(args)) == strip(first)


def test_dumps_carry_the_lag_and_the_analyzer_reports_by_lag(tmp_path):
    from miles_mis.analyze.command import analyze
    from miles_mis.analyze.report.markdown import render_markdown

    dumps = tmp_path / "dumps"
    run(tmp_path, "dumped", "--async-max-lag", "2", "--lr", "3e-3", "--get-mismatch-metrics",
        "--custom-tis-function-path", PLUGIN, "--dump-details", str(dumps), steps=5)
    analysis = analyze(dumps)
    rows = {row["bucket"]: row for row in analysis.statistics["by_lag"]}
    assert set(rows) == {"0", "1", "2"}
    assert sum(row["sequences"] for row in rows.values()) == analysis.statistics["sequences"]
    attribution = analysis.statistics["lag_attribution"]
    assert attribution["numerics_k3"] == pytest.approx(rows["0"]["k3"])
    shares = {row["bucket"]: row["staleness_share"] for row in attribution["stale_buckets"]}
    assert shares["2"] > 0.9  # at lr 3e-3 the stale samples' mismatch is nearly all staleness
    text = render_markdown(analysis.statistics, None, None, title="t", figures=[])
    assert "### By version lag" in text and "is staleness: fix the schedule" in text
    json.dumps(analysis.statistics)  # the report.json content stays serialisable


@pytest.mark.parametrize("flags, message", [
    (["--async-max-lag", "2", "--rollout-staleness", "2"], "not both schedules at once"),
    (["--async-max-lag", "-1"], "allowed values are --async-max-lag >= 0"),
    (["--async-max-lag", "1", "--moe-experts", "4"],
     "--async-max-lag and --rollout-lag are not available with --moe-experts"),
    (["--rollout-lag", "1", "--moe-experts", "4"], "--async-max-lag and --rollout-lag are not available"),
    (["--rollout-lag", "-1"], "--rollout-lag -1: allowed values are >= 0"),
    (["--rollout-lag", "1", "--async-max-lag", "1"], "not with --async-max-lag or --rollout-staleness > 1"),
    (["--rollout-lag", "1", "--rollout-staleness", "2"], "not with --async-max-lag or --rollout-staleness > 1"),
])
def test_refusals(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*SMALL, *flags])


def test_a_stale_run_will_not_resume_from_a_checkpoint_without_snapshots(tmp_path):
    import torch

    args = parse_args([*SMALL, "--steps", "2", "--out-dir", str(tmp_path / "d"), "--save-interval", "2",
                       "--rollout-staleness", "4"])
    train(args)
    path = tmp_path / "d" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    del state["snapshots"]  # as a checkpoint written before the lab kept them
    torch.save(state, path)
    args = parse_args([*SMALL, "--steps", "4", "--out-dir", str(tmp_path / "d"), "--resume",
                       "--rollout-staleness", "4"])
    with pytest.raises(ValueError, match="holds no weight snapshots"):
        train(args)
