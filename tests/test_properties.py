"""Hypothesis properties: bounds hold, masks only shrink, everything stays finite."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis import MisConfig, compute_mis_weights

log_prob = st.one_of(st.floats(-30.0, 0.0, width=32), st.sampled_from([-1000.0, 0.0, -1e-6]))
odd_value = st.sampled_from([float("nan"), float("inf"), float("-inf")])


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 6))
    train, rollout, masks = [], [], []
    for _ in range(num_seqs):
        n = draw(st.integers(0, 12))
        t = draw(st.lists(st.one_of(log_prob, odd_value) if draw(st.booleans()) else log_prob,
                          min_size=n, max_size=n))
        r = draw(st.lists(log_prob, min_size=n, max_size=n))
        m = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
        train.append(torch.tensor(t, dtype=torch.float32))
        rollout.append(torch.tensor(r, dtype=torch.float32))
        masks.append(torch.tensor(m, dtype=torch.float32))
    return train, rollout, masks


configs = st.builds(
    MisConfig, use_tis=st.just(True), use_rs=st.booleans(),
    tis_level=st.sampled_from(["token", "sequence", "geometric"]),
    rs_level=st.sampled_from(["token", "sequence", "geometric"]),
    tis_mode=st.sampled_from(["truncate", "clip", "mask", "icepop"]),
    tis_lower_bound=st.floats(0.05, 0.95), tis_upper_bound=st.floats(1.05, 20.0),
    rs_veto_threshold=st.one_of(st.none(), st.floats(1e-8, 0.5)), tis_batch_normalize=st.just(False))


@settings(max_examples=300, deadline=None)
@given(configs, batches())
def test_weights_within_bounds_masks_shrink_and_finite(cfg, batch):
    train, rollout, masks = batch
    weights, out_masks, metrics = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout,
                                                      loss_masks=masks)
    for w, m, original in zip(weights, out_masks, masks):
        assert torch.isfinite(w).all()
        assert ((m != 0) <= (original != 0)).all(), "returned masks must be a subset of the input masks"
        kept = w[m != 0]
        assert (w[m == 0] == 0).all(), "rejected and padding tokens carry weight 0"
        if cfg.tis_mode == "truncate":
            assert (kept <= cfg.tis_upper_bound * (1 + 1e-6)).all()
        if cfg.tis_mode == "clip":
            assert (kept >= cfg.tis_lower_bound * (1 - 1e-6)).all() and (kept <= cfg.tis_upper_bound * (1 + 1e-6)).all()
        if cfg.tis_mode == "mask":
            assert ((kept >= cfg.tis_lower_bound * (1 - 1e-6)) & (kept <= cfg.tis_upper_bound * (1 + 1e-6))).all()
    for name, values in metrics.items():
        for v in values:
            assert torch.isfinite(v).all(), name


@settings(max_examples=200, deadline=None)
@given(configs, batches())
def test_batch_normalized_weights_have_mean_one_over_what_is_trained(cfg, batch):
    cfg = MisConfig(**{**cfg.to_dict(), "tis_batch_normalize": True})
    train, rollout, masks = batch
    weights, out_masks, metrics = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout,
                                                      loss_masks=masks)
    if cfg.tis_level == "token":
        kept = torch.cat([w[m != 0] for w, m in zip(weights, out_masks)])
    else:  # one weight per trained sequence
        kept = torch.stack([w[m != 0][0] for w, m in zip(weights, out_masks) if (m != 0).any()]) \
            if any((m != 0).any() for m in out_masks) else torch.zeros(0)
    factor = torch.cat(metrics["mis_batch_norm_factor"])
    if kept.numel() and factor.numel() and float(factor[0]) != 1.0:
        assert abs(kept.double().mean().item() - 1.0) < 1e-4
    for w in weights:
        assert torch.isfinite(w).all()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_metrics_only_returns_masks_unchanged(batch):
    train, rollout, masks = batch
    weights, out_masks, metrics = compute_mis_weights(MisConfig(use_tis=False), train_log_probs=train,
                                                      rollout_log_probs=rollout, loss_masks=masks)
    assert weights is None
    for m, original in zip(out_masks, masks):
        assert torch.equal(m, original)
    for name, values in metrics.items():
        for v in values:
            assert torch.isfinite(v).all(), name
