"""benchmarks/lab_gate_selection.py: the random gate's coin (the gate's granularity without its k3) and the rates it
takes from the real gate's run, by hand; one short run of each cell end to end."""

import sys

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def selection():
    return load_benchmark("lab_gate_selection")


def test_the_coin_rejects_a_stale_lag_whole_and_never_a_fresh_one(selection):
    lags = torch.tensor([0, 1, 2, 2, 3, 5, 1])
    generator = torch.Generator().manual_seed(0)
    # lag 2 always kept, lag ≥ 3 never: 3 and 5 (5 takes the last key's rate) are rejected, nothing at lag ≤ 1
    rejected = selection.random_stale_rejections(lags, 1, {2: 1.0, 3: 0.0}, generator)
    assert rejected.tolist() == [False, False, False, False, True, True, False]
    rejected = selection.random_stale_rejections(lags, 1, {2: 0.0, 3: 1.0}, generator)
    assert rejected.tolist() == [False, False, True, True, False, False, False]
    # at keep 0.3 over many micro-batches: both sequences of lag 2 share one coin, kept about 30 % of the time
    draws = torch.stack([selection.random_stale_rejections(lags, 1, {2: 0.3, 3: 0.3}, generator) for _ in range(4000)])
    assert torch.equal(draws[:, 2], draws[:, 3])
    assert abs((~draws[:, 2]).float().mean().item() - 0.3) < 0.03
    assert not draws[:, [0, 1, 6]].any()


def test_the_rates_are_the_gates_token_weighted_keep_shares(selection):
    row = {"rejected": {"0": 0.0, "1": 0.0, "2": 0.75, "3plus": 0.9}}
    assert selection.gate_keep_rates(row) == pytest.approx({2: 0.25, 3: 0.1})


def test_a_short_sweep_runs_every_cell_and_pairs_them(selection, tmp_path, monkeypatch, capsys):
    results = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["lab_gate_selection.py", "--seeds", "2", "--steps", "4", "--results",
                                      str(results), "--out-dir", str(tmp_path / "runs")])
    selection.main()
    rows = selection.read_results(results)
    assert sorted((r["algorithm"], r["seed"]) for r in rows) == sorted(
        (a, s) for a in selection.ORDER for s in range(2))
    gate = {r["seed"]: r for r in rows if r["algorithm"] == "lag_gate"}
    for row in rows:
        assert len(row["reward"]) == 4
        if row["algorithm"] == "random_gate":  # the coin's rates are the same seed's gate's
            assert row["keep"] == {str(k): v for k, v in selection.gate_keep_rates(gate[row["seed"]]).items()}
        if row["algorithm"] == "decoupled_tis":
            assert row["removed_token_fraction"] == 0.0
    out = capsys.readouterr().out
    assert "| random_gate | 2 |" in out and "| mixed lags 0..3, 4 steps |" in out
    selection.main()  # resumes: nothing left to run, the same table
    assert len(selection.read_results(results)) == 8


def test_a_one_seed_cell_shows_its_mean_alone_and_two_seeds_their_spread(selection):
    def row(algorithm, seed, reward):
        return {"algorithm": algorithm, "seed": seed, "steps": 10, "reward": [reward] * 10,
                "rejected": {"2": 0.5, "3plus": 1.0}, "removed_token_fraction": 0.25}
    rows = [row("lag_gate", 0, 0.4), row("lag_gate", 1, 0.6), row("fixed_drop", 0, 0.3)]
    lines = selection.table(rows).splitlines()
    # two seeds: mean 0.5, sample sd of (0.4, 0.6) = 0.1414; one seed: no spread to give, not "± 0.000"
    assert "| lag_gate | 2 | 0.500 ± 0.141 |" in lines[3]
    # seed 0 alone pairs fixed_drop with lag_gate: 0.3 − 0.4; kept shares 1 − 0.5 and 1 − 1.0
    assert lines[2] == "| fixed_drop | 1 | 0.300 | -0.100 (n=1) | — | 0.250 | 0.50, 0.00 |"
    assert "±" not in lines[2]
