"""analyze v2, reading and statistics: generated dumps in miles' layout with injected patterns the statistics
must find, CP shards (zigzag, cp 2) put back in response order, streaming == in memory."""

import json
import math

import pytest
import torch
from cp_harness import local_positions

from miles_mis.analyze.reading import DumpReader
from miles_mis.analyze.statistics import HISTOGRAM_EDGES, StatisticsAccumulator, compute


def make_run(seed=0, calls=6, num=8, length=48, noise=0.01, growth=1.0, first_token=None, low_prob=None,
             bad=None):
    """{call: [(old, rollout, mask, advantages)]}: pi_old in [-3, 0] ... with injected patterns:
    first_token: extra noise on each response's first token; low_prob: extra noise on tokens whose rollout
    probability is below 0.1; growth: noise multiplied by growth**call; bad: (call, index) with noise 1."""
    gen = torch.Generator().manual_seed(seed)
    run = {}
    for call in range(calls):
        samples = []
        for index in range(num):
            old = -torch.rand(length, generator=gen) * 4.0
            scale = torch.full((length,), noise * growth ** call)
            if first_token is not None:
                scale[0] = first_token
            if bad == (call, index):
                scale[:] = 1.0
            rollout = old + scale * torch.randn(length, generator=gen)
            if low_prob is not None:
                low = rollout.exp() < 0.1
                rollout = torch.where(low, old + low_prob * torch.randn(length, generator=gen), rollout)
            samples.append((old, rollout, torch.ones(length), torch.randn(length, generator=gen)))
        run[call] = samples
    return run


def write_run(directory, run, cp=1, total_extra=5):
    """miles' files: rank_<r>_call_<c>.pt with this rank's zigzag (thd) shard of every sequence."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    for call, samples in run.items():
        for rank in range(cp):
            rows = []
            for index, (old, rollout, mask, adv) in enumerate(samples):
                n = old.numel()
                total = n + total_extra
                pos = torch.tensor(local_positions(total, n, rank, cp, total) if cp > 1 else list(range(n)),
                                   dtype=torch.long)
                rows.append({"index": index, "total_length": total, "response_length": n,
                             "train_log_probs": old[pos].clone(), "old_log_probs": old[pos],
                             "rollout_log_probs": rollout[pos], "advantages": adv[pos], "local_loss_mask": mask[pos]})
            torch.save({"rank": rank, "call": call, "samples": rows, "ppo_kl": torch.zeros(1),
                        "pg_loss": torch.zeros(1), "finite": {}}, out / f"rank_{rank}_call_{call}.pt")
    return directory


def stats_of(directory, **kwargs):
    return compute(DumpReader(directory, **kwargs).batches())


def test_cp2_shards_are_put_back_in_response_order(tmp_path):
    run = make_run(calls=2, num=3, length=37)
    write_run(tmp_path / "cp1", run, cp=1)
    write_run(tmp_path / "cp2", run, cp=2)
    one = DumpReader(tmp_path / "cp1").load_all()
    two = DumpReader(tmp_path / "cp2").load_all()
    assert two.calls == one.calls == [0, 0, 0, 1, 1, 1]
    for name in ("old_log_probs", "rollout_log_probs", "loss_masks", "advantages", "positions"):
        for a, b in zip(getattr(one, name), getattr(two, name)):
            assert torch.equal(a, b), name
    assert two.positions[0].tolist() == list(range(37))
    assert stats_of(tmp_path / "cp1") == stats_of(tmp_path / "cp2")


def test_streaming_equals_in_memory(tmp_path):
    write_run(tmp_path, make_run(calls=5, growth=1.5, bad=(3, 2)), cp=2)
    reader = DumpReader(tmp_path)
    streamed, in_memory = compute(reader.batches()), compute([reader.load_all()])
    assert streamed.keys() == in_memory.keys()
    for key in streamed:
        assert json.dumps(streamed[key], sort_keys=True) == json.dumps(in_memory[key], sort_keys=True) or \
            _close(streamed[key], in_memory[key]), key


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    return a == b


def test_first_token_spike_is_found(tmp_path):
    write_run(tmp_path, make_run(calls=2, first_token=0.3))
    by_position = stats_of(tmp_path)["by_position"]
    first, rest = by_position[0], by_position[1:]
    assert first["bucket"] == "0 (first token)" and first["tokens"] == 16
    assert all(first["k3"] > 50 * row["k3"] for row in rest)
    assert [row["bucket"] for row in rest[:3]] == ["[1, 2)", "[2, 4)", "[4, 8)"]
    assert sum(row["tokens"] for row in by_position) == 2 * 8 * 48


def test_low_probability_bucket_is_found(tmp_path):
    write_run(tmp_path, make_run(calls=2, low_prob=0.2))
    rows = {row["bucket"]: row for row in stats_of(tmp_path)["by_rollout_prob"]}
    low = [row for row in rows.values() if row["high"] <= 0.1 and row["tokens"]]
    high = [row for row in rows.values() if row["low"] >= 0.5 and row["tokens"]]
    assert low and high
    assert min(row["k3"] for row in low) > 10 * max(row["k3"] for row in high)


def test_growth_over_calls_is_a_trend(tmp_path):
    write_run(tmp_path, make_run(calls=8, growth=1.5))
    stats = stats_of(tmp_path)
    k3 = [row["k3"] for row in stats["by_call"]]
    assert [row["call"] for row in stats["by_call"]] == list(range(8)) and k3 == sorted(k3)
    trend = stats["trend"]
    assert trend["k3_slope_per_call"] > 0 and trend["growth"] > 10  # noise x 1.5^4 in the later half: k3 x ~26


def test_flat_mismatch_has_no_growth(tmp_path):
    write_run(tmp_path, make_run(calls=8, growth=1.0))
    assert 0.7 < stats_of(tmp_path)["trend"]["growth"] < 1.4


def test_one_bad_sequence_is_the_worst(tmp_path):
    write_run(tmp_path, make_run(calls=4, bad=(2, 5)), cp=2)
    worst = stats_of(tmp_path)["worst_sequences"]
    assert (worst[0]["call"], worst[0]["index"], worst[0]["length"]) == (2, 5, 48)
    assert worst[0]["k3"] > 100 * worst[1]["k3"] and 0 <= worst[0]["worst_position"] < 48


def test_hand_computed_whole_dump_values(tmp_path):
    # one sequence, three tokens: l = 0, log 3, -log 4; a masked fourth token with a NaN log-prob
    old = torch.tensor([-1.0, -1.0 + math.log(3), -1.0 - math.log(4), float("nan")])
    rollout = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    run = {0: [(old, rollout, torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4))]}
    write_run(tmp_path, run)
    stats = stats_of(tmp_path)
    ells = [0.0, math.log(3), -math.log(4)]
    k3 = [math.exp(x) - x - 1 for x in ells]
    assert stats["tokens"] == 3 and stats["usable_tokens"] == 3 and stats["nonfinite_fraction"] == 0.0
    assert stats["k1"] == pytest.approx(-sum(ells) / 3, rel=1e-6)
    assert stats["k3"] == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert stats["chi2_token"] == pytest.approx((1 + 9 + 1 / 16) / 3 - 1, rel=1e-6)
    assert stats["fraction_ratio_above_2"] == pytest.approx(1 / 3)
    assert stats["fraction_ratio_below_half"] == pytest.approx(1 / 3)
    assert stats["max_abs_log_ratio"] == pytest.approx(math.log(4), rel=1e-6)
    assert stats["seq_product_outside_half_two_fraction"] == 0.0  # |log 3 - log 4| < log 2
    assert stats["by_position"][0]["k3"] == pytest.approx(0.0, abs=1e-12)
    assert sum(stats["histogram"]["counts"]) == 3 and len(stats["histogram"]["counts"]) == len(HISTOGRAM_EDGES) - 1


def test_nonfinite_and_fill_values_are_counted_per_side(tmp_path):
    old = -torch.rand(10)
    rollout = old - 0.01
    rollout[2], old[5] = -3.0e38, float("nan")
    write_run(tmp_path, {0: [(old, rollout, torch.ones(10), torch.zeros(10))]})
    stats = stats_of(tmp_path)
    assert stats["nonfinite_fraction"] == 0.2 and stats["nonfinite_engine_fraction"] == 0.1
    assert stats["nonfinite_trainer_fraction"] == 0.1 and stats["usable_tokens"] == 8
    assert stats["max_abs_log_ratio"] == pytest.approx(0.01, rel=1e-4)
    json.dumps(stats, allow_nan=False)


def test_quantiles_come_from_the_histogram(tmp_path):
    gen = torch.Generator().manual_seed(3)
    ell = torch.randn(20000, generator=gen) * 0.05
    old = -torch.rand(20000, generator=gen)
    write_run(tmp_path, {0: [(old, old - ell, torch.ones(20000), torch.zeros(20000))]})
    quantiles = stats_of(tmp_path)["quantiles"]
    for name, value in quantiles.items():
        exact = float(torch.quantile(ell.double(), float(name)))
        assert value == pytest.approx(exact, rel=0.15, abs=2e-4), name


def test_partitions_into_batches_do_not_matter():
    from miles_mis.analyze.reading import CallBatch

    def batch(calls, seed):
        gen = torch.Generator().manual_seed(seed)
        olds = [-torch.rand(n, generator=gen) for n in (5, 0, 9)]
        return CallBatch(calls=calls, indices=[0, 1, 2], response_lengths=[5, 0, 9], old_log_probs=olds,
                         rollout_log_probs=[o - 0.1 * torch.randn(o.shape, generator=gen) for o in olds],
                         loss_masks=[torch.ones(o.numel()) for o in olds], advantages=[None] * 3,
                         positions=[torch.arange(o.numel()) for o in olds], lags=[None] * 3)

    a, b = batch([0, 0, 0], 1), batch([1, 1, 1], 2)
    split, whole = StatisticsAccumulator(), StatisticsAccumulator()
    split.update(a)
    split.update(b)
    whole.update(CallBatch.join([a, b]))
    assert _close(split.result(), whole.result())


def test_progress_bar_over_files_on_a_terminal_only(tmp_path, monkeypatch):
    import io
    import sys

    write_run(tmp_path, make_run(calls=3, num=2, length=8), cp=2)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        list(DumpReader(tmp_path, progress=True).batches())
        text = stream.getvalue()
        assert ("reading dumps [" in text and "6/6 files" in text) == shown and (text == "") != shown
