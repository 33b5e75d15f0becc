"""miles_mis.lab.batch_variance.compare_generations: identical responses and the common-prefix log-prob difference,
by hand."""

import pytest
import torch

from miles_mis.lab.batch_variance import compare_generations as compare


def test_common_prefix_by_hand():
    t = lambda *v: torch.tensor(v)  # noqa: E731
    f = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    reference = ([t(1, 2, 3), t(4, 5), t(7, 8, 9)], [f(-1.0, -2.0, -3.0), f(-0.5, -0.5), f(-1.0, -1.0, -1.0)])
    # response 0 identical (log-probs off by 0.25 on its last token); 1 differs at its 2nd token; 2 is one token
    # shorter but agrees on the two it has (not identical: the lengths differ)
    other = ([t(1, 2, 3), t(4, 6), t(7, 8)], [f(-1.0, -2.0, -3.25), f(-0.75, -9.0), f(-1.0, -1.0)])
    row = compare(reference, other)
    assert row["identical_responses"] == 1
    assert row["prefix_tokens"] == 3 + 1 + 2
    assert row["max_abs"] == pytest.approx(0.25)
    assert row["mean_abs"] == pytest.approx((0.25 + 0.25) / 6)
    # k3 of the differences d = reference − other: mean of e^d − d − 1 over the 6 prefix tokens (4 zeros, two of +0.25)
    expected = 2 * (torch.expm1(torch.tensor(0.25, dtype=torch.float64)) - 0.25) / 6
    assert row["k3"] == pytest.approx(float(expected), rel=1e-9)
    nothing = compare(([t(1)], [f(-1.0)]), ([t(2)], [f(-1.0)]))
    assert nothing == {"identical_responses": 0, "prefix_tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "k3": 0.0}


class _Engine:
    """generate_arriving that records each call and answers token = seed, log-prob = −seed."""

    def __init__(self):
        self.calls = []

    def generate_arriving(self, prompts, seeds, max_new_tokens, arrivals):
        self.calls.append((len(prompts), list(arrivals)))
        return [torch.tensor([s]) for s in seeds], [torch.tensor([-float(s)]) for s in seeds]


def test_decode_in_batches_keeps_order_and_seeds():
    from miles_mis.lab.batch_variance import decode_in_batches

    engine = _Engine()
    tokens, log_probs = decode_in_batches(engine, [torch.tensor([0])] * 5, [10, 11, 12, 13, 14], 4, 2)
    assert [int(t) for t in tokens] == [10, 11, 12, 13, 14] and [float(lp) for lp in log_probs] == [-10, -11, -12, -13,
                                                                                                      -14]
    assert engine.calls == [(2, [0, 0]), (2, [0, 0]), (1, [0])]
