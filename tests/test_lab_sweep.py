"""benchmarks/lab_sweep.py's table: a cell's final reward over seeds, by hand; one run shows its mean alone."""

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("lab_sweep")


def _row(algorithm, final, first=0.1):
    return {"mechanism": "bf16 (dense)", "algorithm": algorithm, "final_reward": final, "first_reward": first,
            "exact_match": 0.5, "collapsed": False, "raw_k3": 1e-3, "min_raw_ess": 0.9, "mean_grad_norm": 0.2}


def test_the_final_reward_is_mean_and_sample_spread_and_one_run_its_mean_alone(sweep):
    rows = [_row("standard", 0.2), _row("standard", 0.5), _row("standard", 0.8), _row("bypass", 0.35)]
    lines = sweep.table(rows, ["standard", "bypass"]).splitlines()
    assert len(lines) == 4
    # (0.2, 0.5, 0.8): mean 0.5, sample sd 0.3; Δ vs first 10 = mean(0.1, 0.4, 0.7) = +0.400
    assert lines[2].startswith("| bf16 (dense) | standard | 3 | 0.500 ± 0.300 | +0.400 | 0.500 | 0/3 |")
    assert lines[3].startswith("| bf16 (dense) | bypass | 1 | 0.350 | +0.250 | 0.500 | 0/1 |")
    assert "nan" not in "\n".join(lines)
