"""The fast vectorised core equals the slow per-sequence reference on random batches, for every
combination of level x mode x RS x veto x batch-normalize."""

import itertools

import pytest
import torch
from conftest import random_batch
from reference import reference

from miles_mis import MisConfig, compute_mis_weights

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask", "icepop")

COMBOS = [
    dict(tis_level=tl, tis_mode=mode, use_rs=rs, rs_level=rl, rs_veto_threshold=veto, tis_batch_normalize=norm)
    for tl, mode, (rs, rl), veto, norm in itertools.product(
        LEVELS, MODES, [(False, "token"), (True, "token"), (True, "sequence"), (True, "geometric")],
        [None, 0.75], [False, True])
]


RATIO_BOUNDS = {"token": (0.8, 1.25), "sequence": (0.5, 2.0), "geometric": (0.93, 1.07)}


def _bounds(combo):
    """Bounds per level that make every stage bite partially on these batches."""
    tis_lower, tis_upper = RATIO_BOUNDS[combo["tis_level"]]
    rs_lower, rs_upper = RATIO_BOUNDS[combo["rs_level"]]
    return dict(tis_lower_bound=tis_lower, tis_upper_bound=tis_upper, rs_lower_bound=rs_lower,
                rs_upper_bound=rs_upper)


def assert_matches_reference(cfg, train, rollout, masks, lags=None, advantages=None):
    """``lags``: each sequence's version lag (passed as ``version_lags``), or None; ``advantages``: per sequence, or
    None."""
    extra = {} if lags is None else {"version_lags": lags}
    if advantages is not None:
        extra["advantages"] = advantages
    weights, out_masks, metrics = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout,
                                                      loss_masks=masks, **extra)
    ref_weights, ref_masks, ref_metrics = reference(cfg, train, rollout, masks, lags, advantages)
    for i, (m, rm) in enumerate(zip(out_masks, ref_masks)):
        assert m.tolist() == rm, f"mask of sequence {i}"
    if ref_weights is None:
        assert weights is None
    else:
        for i, (w, rw) in enumerate(zip(weights, ref_weights)):
            torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6,
                                       msg=lambda s: f"weights of sequence {i}: {s}")
    assert sorted(metrics) == sorted(ref_metrics)
    masks_bool = [m != 0 for m in masks]
    for name, per_seq in metrics.items():
        for i, (value, ref_value) in enumerate(zip(per_seq, ref_metrics[name])):
            # only valid tokens are read by the host's reducer
            got = value.double()[masks_bool[i]]
            want = torch.tensor(ref_value, dtype=torch.float64)[masks_bool[i]]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}[{i}]: {s}")


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_matches_reference(combo):
    cfg = MisConfig(use_tis=True, **combo, **_bounds(combo))
    for seed in range(3):
        assert_matches_reference(cfg, *random_batch(seed, noise=0.15, nonfinite=seed == 2))


@pytest.mark.parametrize("level", LEVELS)
def test_metrics_only_matches_reference(level):
    cfg = MisConfig(use_tis=False, tis_level=level, use_rs=True, rs_veto_threshold=1e-4)
    for seed in range(3):
        assert_matches_reference(cfg, *random_batch(seed, nonfinite=seed == 1))


def test_separate_rs_bounds_match_reference():
    cfg = MisConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.95, rs_upper_bound=1.02,
                    tis_mode="clip", tis_upper_bound=1.3, tis_batch_normalize=True, rs_veto_threshold=0.3)
    for seed in range(5):
        assert_matches_reference(cfg, *random_batch(seed))


def fractional(masks, seed):
    """The batch's 0/1 masks with their nonzero values replaced by 0.25, 0.5 or 1 (hosts may weight tokens)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.25, 0.5, 1.0])
    return [m * scale[torch.randint(0, 3, (m.numel(),), generator=gen)] for m in masks]


@pytest.mark.parametrize("cfg", [
    dict(use_tis=False),
    dict(use_tis=True),
    dict(use_tis=True, tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25, use_rs=True,
         rs_level="geometric", rs_lower_bound=0.93, rs_upper_bound=1.07, rs_veto_threshold=0.75,
         tis_batch_normalize=True),
    dict(use_tis=True, tis_level="sequence", tis_upper_bound="auto"),
    dict(use_tis=True, rs_divergence={"token_k3": 0.01, "seq_sum_k1": [0.5, 2.0]}, tis_batch_normalize=True),
], ids=["metrics-only", "default", "mask-rs-veto-norm", "auto-sequence", "divergence"])
def test_fractional_masks_match_reference(cfg):
    """Mask values other than 0/1 are kept on kept tokens (0.5 stays 0.5) and every statistic counts a valid
    token once, whatever its mask value (docs/math.md)."""
    config = MisConfig(**cfg)
    for seed in range(3):
        train, rollout, masks = random_batch(seed, noise=0.15, nonfinite=seed == 2)
        assert_matches_reference(config, train, rollout, fractional(masks, seed))
