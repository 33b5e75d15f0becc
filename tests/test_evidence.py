"""benchmarks/evidence.py: the t quantile against published table values, paired differences by hand."""

import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import evidence  # noqa: E402

# t_{0.975, df}, from any statistics table (5 significant digits)
T_TABLE = {1: 12.706, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 19: 2.0930, 30: 2.0423}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_table(df):
    assert evidence.t_quantile(0.975, df) == pytest.approx(T_TABLE[df], abs=6e-4)


def test_t_quantile_matches_the_exact_value_at_4_degrees_of_freedom():
    # t_{0.975, 4} = 2.776445105197794358...: at 4 degrees of freedom the quantile has a closed form, 2 √(q − 1) with
    # q = cos(arccos(√a) / 3) / √a, a = 4p(1 − p) (evaluated to 40 digits)
    assert evidence.t_quantile(0.975, 4) == pytest.approx(2.7764451051977943, rel=1e-12)


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 7, 40):
        for p in (0.6, 0.9, 0.975, 0.995):
            assert evidence.t_quantile(p, df) == pytest.approx(float(stats.t.ppf(p, df)), rel=1e-9)


def test_t_cdf_is_a_cdf():
    assert evidence.t_cdf(0.0, 3) == pytest.approx(0.5)
    # df 1 is the Cauchy distribution: P(T <= 1) = 3/4
    assert evidence.t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    assert evidence.t_cdf(-1.0, 1) == pytest.approx(0.25, abs=1e-12)


def test_t_quantile_refuses_bad_input():
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        evidence.t_quantile(0.3, 4)
    with pytest.raises(ValueError, match="df >= 1"):
        evidence.t_quantile(0.975, 0)


def test_paired_difference_by_hand():
    # differences 0.2, 0.25, 0.3 on seeds 0..2 (seed 3 only in a: not paired)
    a = {0: 0.7, 1: 0.75, 2: 0.8, 3: 0.9}
    b = {0: 0.5, 1: 0.5, 2: 0.5}
    diff = evidence.paired_difference(a, b)
    assert diff.seeds == (0, 1, 2) and diff.favour_a == 3
    assert diff.mean == pytest.approx(0.25)
    # sd = 0.05, t_{0.975,2} = 4.3027: half-width 0.05 * 4.3027 / sqrt(3) = 0.1242, interval [0.126, 0.374]
    assert diff.half_width == pytest.approx(0.05 * 4.302653 / math.sqrt(3), rel=1e-5)
    assert diff.resolved and diff.low == pytest.approx(0.1258, abs=1e-4)
    assert evidence.verdict("x", "standard", diff) == ("x ends above standard: +0.250 [+0.126, +0.374] (n=3), "
                                                       "3 of 3 seeds higher")
    wide = evidence.paired_difference({0: 0.6, 1: 0.7, 2: 0.8}, b)  # 0.2 ± 0.248: includes 0
    assert not wide.resolved


def test_unresolved_and_single_seed():
    diff = evidence.paired_difference({0: 0.5, 1: 0.7}, {0: 0.6, 1: 0.6})
    assert diff.mean == pytest.approx(0.0, abs=1e-12) and not diff.resolved
    assert "no resolvable difference at 2 seeds" in evidence.verdict("x", "standard", diff)
    # two seeds with the same difference (rewards move in steps): sd 0, an interval of width 0 that excludes 0, and
    # still no verdict; a third seed with the same difference makes one
    same = evidence.paired_difference({0: 0.6, 1: 0.7}, {0: 0.50625, 1: 0.60625})
    assert same.half_width == pytest.approx(0.0, abs=1e-12) and same.excludes_zero and not same.resolved
    assert evidence.verdict("x", "y", same) == ("x vs y: no resolvable difference at 2 seeds (+0.094 [+0.094, +0.094] "
                                                "(n=2); the interval excludes 0, but a verdict needs 3 seeds)")
    assert evidence.paired_difference({0: 0.6, 1: 0.7, 2: 0.5}, {0: 0.50625, 1: 0.60625, 2: 0.40625}).resolved
    one = evidence.paired_difference({0: 0.9}, {0: 0.1})
    assert one.n == 1 and math.isnan(one.half_width) and not one.resolved
    assert one.interval() == "+0.800 (n=1)"
    assert evidence.paired_difference({}, {0: 1.0}).interval() == "—"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=2, max_size=8), st.floats(-1, 1))
def test_interval_is_centred_and_shifts_with_a_constant(values, shift):
    a = {i: v for i, v in enumerate(values)}
    b = {i: 0.0 for i in a}
    base = evidence.paired_difference(a, b)
    moved = evidence.paired_difference({i: v + shift for i, v in a.items()}, b)
    assert moved.mean == pytest.approx(base.mean + shift, abs=1e-9)
    assert moved.half_width == pytest.approx(base.half_width, abs=1e-9)
    assert base.low <= base.mean <= base.high


def test_steps_to_level_and_outcomes():
    series = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    # trailing 5-step means: 0.3 (step 5), 0.4 (6), 0.5 (7)
    assert evidence.steps_to_level(series, 0.4) == 6
    assert evidence.steps_to_level(series, 0.45) == 7
    assert evidence.steps_to_level(series, 0.9) is None
    rising = [0.3] * 10 + [0.6] * 10
    assert evidence.outcome(rising) == "learned"
    assert evidence.outcome([0.3] * 10 + [0.35] * 10) == "stalled"
    assert evidence.outcome([0.3] * 10 + [0.2] * 10) == "collapsed"
    assert evidence.outcome([0.3] * 10 + [0.27] * 10) == "stalled"  # a 0.03 dip is noise, not a collapse
