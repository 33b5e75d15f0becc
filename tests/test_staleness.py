"""Staleness in the plugin: the current policy in the weights (tis_policy: current), per-sequence lags (their
validation, the lag-bucket metrics, per-lag bounds, the staleness gate), against hand formulas, the slow reference,
and the cp = 1 result at cp 2 and 3 on real gloo groups; errors raised on every rank together."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_batch
from cp_harness import cp_state, make_full_batch, shard, spawn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp import check_case

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed, compute_mis_weights_with_cp
from miles_mis.correction import staleness
from miles_mis.inputs import versions
from miles_mis.inputs.packing import InputError


def call(config, train, rollout, masks, pg_loss=None, **kwargs):
    """compute_mis_weights_with_cp at cp 1, as a host calls it (prompts of 3 tokens)."""
    lengths = [t.numel() for t in train]
    pg_loss = torch.ones(sum(lengths)) if pg_loss is None else pg_loss
    return compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict()), pg_loss=pg_loss, train_log_probs=train,
                                       rollout_log_probs=rollout, loss_masks=masks,
                                       total_lengths=[n + 3 for n in lengths], response_lengths=lengths, **kwargs)


def batch_value(metrics, name):
    """A batch-level metric (the same value on every token)."""
    value = metrics[name]
    assert bool((value == value[0]).all()), name
    return float(value[0])


# --------------------------------------------------------------------------- the current policy
def test_current_policy_weights_are_the_hand_formula_and_detached():
    train = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]  # π_old
    rollout = [torch.tensor([-1.0, -2.5]), torch.tensor([-0.5])]
    current = [torch.tensor([-0.6, -2.0], requires_grad=True), torch.tensor([-1.5], requires_grad=True)]
    masks = [torch.ones(2), torch.ones(1)]
    pg_loss = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    config = MisConfig(use_tis=True, tis_policy="current", tis_upper_bound=2.0)
    loss, out_masks, metrics = call(config, train, rollout, masks, pg_loss=pg_loss, cur_log_probs=current)
    # w = min(exp(log π_θ − log π_rollout), 2): exp(0.4), min(exp(0.5), 2), exp(−1)
    want = torch.tensor([math.exp(0.4), min(math.exp(0.5), 2.0), math.exp(-1.0)])
    torch.testing.assert_close(loss.detach(), torch.tensor([1.0, 2.0, 3.0]) * want)
    loss.sum().backward()
    torch.testing.assert_close(pg_loss.grad, want)  # the weights are constants: d/dpg_loss = w
    assert current[0].grad is None and current[1].grad is None  # detached: no gradient through the weights
    # the metrics read the chosen ratio: k3 of π_θ against π_rollout
    k3 = [math.expm1(x) - x for x in (0.4, 0.5, -1.0)]
    assert batch_value(metrics, "mis_batch_k3") == pytest.approx(sum(k3) / 3, rel=1e-5)
    # the same call with π_θ as train_log_probs under tis_policy: old gives the same weights (every stage applies
    # unchanged to the chosen ratio); so does the other kwarg name
    same = call(MisConfig(use_tis=True), [c.detach() for c in current], rollout, masks, pg_loss=pg_loss.detach())
    torch.testing.assert_close(loss.detach(), same[0])
    other = call(config, train, rollout, masks, pg_loss=pg_loss.detach(), current_log_probs=current)
    assert torch.equal(other[0], same[0])
    # tis_policy: old ignores the current policy's log-probs
    old = call(MisConfig(use_tis=True), train, rollout, masks, cur_log_probs=current)
    assert torch.equal(old[0], call(MisConfig(use_tis=True), train, rollout, masks)[0])


@pytest.mark.parametrize("stage", [
    dict(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0),
    dict(use_rs=True, rs_level="geometric", rs_lower_bound=0.95, rs_upper_bound=1.05, rs_veto_threshold=0.5),
    dict(tis_batch_normalize=True, rs_divergence={"seq_mean_k3": 0.01}),
    dict(tis_upper_bound="auto", tis_auto_target_ess=0.95),
])
def test_every_stage_applies_to_the_current_ratio(stage):
    """tis_policy: current is the same call with the current log-probs as train_log_probs, whatever the stages."""
    old_lp, rollout, masks = random_batch(5, noise=0.2)
    current = [t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(old_lp)]
    with_current = call(MisConfig(use_tis=True, tis_policy="current", **stage), old_lp, rollout, masks,
                        cur_log_probs=current)
    substituted = call(MisConfig(use_tis=True, **stage), current, rollout, masks)
    assert torch.equal(with_current[0], substituted[0])
    assert all(torch.equal(a, b) for a, b in zip(with_current[1], substituted[1]))
    # the same metrics, and the one that says the numerator is the current policy (1 on every token)
    flag = with_current[2].pop("mis_numerator_is_current_policy")
    assert all(bool((f == 1).all()) for f in flag) and sum(f.numel() for f in flag) == sum(m.numel() for m in masks)
    assert sorted(with_current[2]) == sorted(substituted[2])
    assert all(torch.equal(with_current[2][k], substituted[2][k]) for k in with_current[2])


def test_current_policy_errors_name_the_input():
    train, rollout, masks = random_batch(1, num_seqs=4)
    config = MisConfig(use_tis=True, tis_policy="current")
    with pytest.raises(ValueError, match=r"tis_policy: current needs the current policy's log-probs, but the host "
                                         r"passed no cur_log_probs or current_log_probs"):
        call(config, train, rollout, masks)
    short = [t.clone() for t in train]
    short[2] = torch.zeros(short[2].numel() + 1)
    with pytest.raises(InputError, match=r"sequence 2: cur_log_probs\[2\] has \d+ tokens but train_log_probs\[2\]"):
        call(config, train, rollout, masks, cur_log_probs=short)
    with pytest.raises(InputError, match="cur_log_probs and current_log_probs are both given"):
        call(config, train, rollout, masks, cur_log_probs=train, current_log_probs=[t.clone() for t in train])
    with pytest.raises(InputError, match=r"sequence 1: cur_log_probs\[1\] is a str"):
        call(config, train, rollout, masks, cur_log_probs=[train[0], "x", train[2], train[3]])
    # the packed entry point: the flat current log-probs
    flat = torch.cat(train)
    cu = torch.tensor([0] + [t.numel() for t in train]).cumsum(0)
    with pytest.raises(InputError, match="passed no current_log_probs"):
        compute_mis_weights_packed(config, train_log_probs=flat, rollout_log_probs=torch.cat(rollout),
                                   loss_mask=torch.cat(masks), cu_seqlens=cu)
    # a current-policy input of the wrong length is named as the host passed it, not as train_log_probs
    for name in ("current_log_probs", "cur_log_probs"):
        with pytest.raises(InputError, match=rf"^{name} has {flat.numel() - 1} tokens, rollout_log_probs has "
                                             rf"{flat.numel()}"):
            compute_mis_weights_packed(config, train_log_probs=flat, rollout_log_probs=torch.cat(rollout),
                                       loss_mask=torch.cat(masks), cu_seqlens=cu, **{name: flat[:-1]})
    with pytest.raises(InputError, match=r"^current_log_probs is a list"):
        compute_mis_weights_packed(config, train_log_probs=flat, rollout_log_probs=torch.cat(rollout),
                                   loss_mask=torch.cat(masks), cu_seqlens=cu, current_log_probs=list(train))
    weights, _, _ = compute_mis_weights_packed(config, train_log_probs=torch.zeros_like(flat),
                                               rollout_log_probs=torch.cat(rollout), loss_mask=torch.cat(masks),
                                               cu_seqlens=cu, current_log_probs=flat)
    old, _, _ = compute_mis_weights_packed(MisConfig(use_tis=True), train_log_probs=flat,
                                           rollout_log_probs=torch.cat(rollout), loss_mask=torch.cat(masks),
                                           cu_seqlens=cu)
    assert torch.equal(weights, old)


# --------------------------------------------------------------------------- lags as hosts pass them
def test_lags_from_version_lags_and_from_miles_weight_versions():
    assert versions.lags({}, 3) is None
    assert versions.lags({"version_lags": [0, 2, 5]}, 3).tolist() == [0, 2, 5]
    assert versions.lags({"version_lags": torch.tensor([1, 0])}, 2).tolist() == [1, 0]
    # miles: one version string per generation call; the oldest counts; "default" is skipped
    weight_versions = [["7"], ["5", "6", "7"], ["default", "6"], [4], "7"]
    got = versions.lags({"weight_versions": weight_versions, "current_weight_version": "7"}, 5)
    assert got.tolist() == [0, 2, 1, 3, 0]
    assert versions.lags({"weight_versions": [["3"]], "current_weight_version": 9}, 1).tolist() == [6]


@pytest.mark.parametrize("kwargs, message", [
    ({"version_lags": [0, -1, 2]}, r"sequence 1: version_lags\[1\]=-1 is invalid: allowed values are integers >= 0"),
    ({"version_lags": [0, 1.5, 2]}, r"sequence 1: version_lags\[1\]=1.5 is invalid"),
    ({"version_lags": [0, True, 2]}, r"sequence 1: version_lags\[1\]=True is invalid"),
    ({"version_lags": [0, 1]}, "version_lags has 2 entries but the batch has 3 sequences"),
    ({"version_lags": "012"}, "version_lags is a str"),
    ({"version_lags": torch.tensor([0.0, 1.0, 2.0])}, "version_lags is a torch.float32 tensor"),
    ({"version_lags": [0, 1, 2], "weight_versions": [["1"]] * 3}, "pass the lags in one form"),
    ({"weight_versions": [["1"], ["2"], ["3"]]}, "weight_versions is given without current_weight_version"),
    ({"current_weight_version": 3}, "current_weight_version is given without weight_versions"),
    ({"weight_versions": [["1"], ["default"], ["3"]], "current_weight_version": 3},
     r"sequence 1: weight_versions\[1\]=\['default'\] holds no numeric version"),
    ({"weight_versions": [["1"], ["2"], ["4"]], "current_weight_version": "3"},
     r"sequence 2: weight_versions\[2\]=\['4'\] is newer than current_weight_version='3'"),
    # a multi-turn sample with one call newer than the trainer: an error, although its oldest call is older
    ({"weight_versions": [["1"], ["2", "5"], ["3"]], "current_weight_version": "3"},
     r"sequence 1: weight_versions\[1\]=\['2', '5'\] is newer than current_weight_version='3'"),
    ({"weight_versions": [["1"], ["2"], ["3"]], "current_weight_version": "v3"},
     "current_weight_version='v3' is invalid"),
])
def test_bad_lags_name_the_sequence(kwargs, message):
    with pytest.raises(InputError, match=message):
        versions.lags(kwargs, 3)
    train, rollout, masks = random_batch(0, num_seqs=3)
    with pytest.raises(ValueError, match=message):  # the same error from the entry point
        call(MisConfig(use_tis=True), train, rollout, masks, **kwargs)


def test_lag_keys_without_lags_are_one_clear_error():
    train, rollout, masks = random_batch(0, num_seqs=3)
    for config in (MisConfig(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.5]), MisConfig(use_tis=True, rs_max_lag=1)):
        with pytest.raises(ValueError, match="needs? each sequence's lag, but the host passes none"):
            call(config, train, rollout, masks)
        with pytest.raises(ValueError, match="needs? each sequence's lag"):
            compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


def test_no_lags_no_lag_metrics_and_the_same_outputs():
    """Without lags nothing changes: no lag metric, and a call with lags differs from it only by the lag metrics."""
    train, rollout, masks = random_batch(3)
    config = MisConfig(use_tis=True, tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25)
    plain = call(config, train, rollout, masks)
    assert not [name for name in plain[2] if "lag" in name]
    lagged = call(config, train, rollout, masks, version_lags=list(range(len(train))))
    assert torch.equal(plain[0], lagged[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], lagged[1]))
    added = sorted(set(lagged[2]) - set(plain[2]))
    assert added == sorted(["mis_version_lag"] + [f"mis_{name}" for name in staleness.metric_names(True)])
    assert all(torch.equal(plain[2][k], lagged[2][k]) for k in plain[2])


# --------------------------------------------------------------------------- lag metrics, bounds, gate
def test_lag_metrics_hand_case():
    """Three sequences at lags 0, 1 and 4 (bucket 3plus); token truncation at U = 1.5."""
    ells = [[0.0, 0.2], [0.5, -0.1, 0.0], [1.0]]
    rollout = [torch.full((len(e),), -2.0) for e in ells]
    train = [r + torch.tensor(e) for r, e in zip(rollout, ells)]
    masks = [torch.ones(2), torch.tensor([1.0, 1.0, 0.0]), torch.ones(1)]
    _, _, metrics = call(MisConfig(use_tis=True, tis_upper_bound=1.5), train, rollout, masks, version_lags=[0, 1, 4])
    k3 = lambda x: math.expm1(x) - x  # noqa: E731
    expect = {
        "mis_lag_0_k3": (k3(0.0) + k3(0.2)) / 2, "mis_lag_1_k3": (k3(0.5) + k3(-0.1)) / 2, "mis_lag_2_k3": 0.0,
        "mis_lag_3plus_k3": k3(1.0),
        "mis_lag_0_token_fraction": 2 / 5, "mis_lag_1_token_fraction": 2 / 5, "mis_lag_3plus_token_fraction": 1 / 5,
        "mis_lag_2_token_fraction": 0.0,
        # e^0.5 = 1.65 and e^1 = 2.72 exceed 1.5
        "mis_lag_0_bounded_fraction": 0.0, "mis_lag_1_bounded_fraction": 1 / 2, "mis_lag_3plus_bounded_fraction": 1.0,
        "mis_lag_0_rejected_fraction": 0.0, "mis_lag_3plus_rejected_fraction": 0.0,
        # ESS of (1, e^0.2) over 2 tokens; of (1.5, e^-0.1); one token: 1
        "mis_lag_0_ess": (1 + math.exp(0.2)) ** 2 / (2 * (1 + math.exp(0.4))),
        "mis_lag_1_ess": (1.5 + math.exp(-0.1)) ** 2 / (2 * (2.25 + math.exp(-0.2))),
        "mis_lag_3plus_ess": 1.0, "mis_lag_2_ess": 0.0,
    }
    for name, value in expect.items():
        assert batch_value(metrics, name) == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert batch_value(metrics, "mis_version_lag") == pytest.approx(5 / 3)  # the mean lag of the sequences


def test_a_per_lag_bound_tightens_with_the_lag():
    """The same ratio e^0.4 = 1.49 in every sequence: lag 0 keeps it (U 2), lag 1 truncates at 1.3, lags 2 and 7
    at 1.1 (the last bound holds for every larger lag), at token and at sequence level."""
    rollout = [torch.full((2,), -1.0) for _ in range(4)]
    for level, ell in (("token", 0.4), ("sequence", 0.2)):  # a sequence of two tokens at 0.2: ratio e^0.4
        train = [r + ell for r in rollout]
        config = MisConfig(use_tis=True, tis_level=level, tis_upper_bound=2.0, tis_upper_bound_by_lag=[2.0, 1.3, 1.1])
        weights, _, metrics = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout,
                                                  loss_masks=[torch.ones(2)] * 4, version_lags=[0, 1, 2, 7])
        got = [float(w[0]) for w in weights]
        assert got == pytest.approx([math.exp(0.4), 1.3, 1.1, 1.1], rel=1e-6), level
        assert float(metrics["mis_lag_0_bounded_fraction"][0][0]) == 0.0
        assert float(metrics["mis_lag_3plus_bounded_fraction"][0][0]) == 1.0
    # clip mode keeps tis_lower_bound below every per-lag bound
    config = MisConfig(use_tis=True, tis_mode="clip", tis_lower_bound=0.9, tis_upper_bound=2.0,
                       tis_upper_bound_by_lag=[2.0, 1.2])
    weights, _, _ = compute_mis_weights(config, train_log_probs=[torch.tensor([-1.5, -0.5])] * 2,
                                        rollout_log_probs=[torch.tensor([-1.0, -1.0])] * 2,
                                        loss_masks=[torch.ones(2)] * 2, version_lags=[0, 3])
    assert torch.cat(weights).tolist() == pytest.approx([0.9, math.exp(0.5), 0.9, 1.2], rel=1e-6)


def test_the_staleness_gate_against_a_fixed_drop():
    """Lags 0, 1, 2, 2: lag 1 nearly on-policy (k3 ~ 5e-5), lag 2 far off (k3 ~ 0.07). The fixed drop (rs_max_lag 0)
    rejects every stale sequence; the gate (rs_max_lag_k3 1e-3) only the lag whose pooled k3 is above it."""
    rollout = [torch.full((3,), -1.0) for _ in range(4)]
    train = [rollout[0] + 0.0, rollout[1] + 0.01, rollout[2] + 0.4, rollout[3] - 0.3]
    masks, lags = [torch.ones(3)] * 4, [0, 1, 2, 2]
    kept = lambda config: [bool(m.sum() > 0) for m in  # noqa: E731
                           call(config, train, rollout, masks, version_lags=lags)[1]]
    assert kept(MisConfig(use_tis=True, rs_max_lag=0)) == [True, False, False, False]
    assert kept(MisConfig(use_tis=True, rs_max_lag=0, rs_max_lag_k3=1e-3)) == [True, True, False, False]
    assert kept(MisConfig(use_tis=True, rs_max_lag=1)) == [True, True, False, False]
    assert kept(MisConfig(use_tis=True, rs_max_lag=1, rs_max_lag_k3=1.0)) == [True, True, True, True]
    _, _, metrics = call(MisConfig(use_tis=True, rs_max_lag=0, rs_max_lag_k3=1e-3), train, rollout, masks,
                         version_lags=lags)
    assert metrics["mis_rs_stale_seq_fraction"].view(4, 3)[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert batch_value(metrics, "mis_lag_2_rejected_fraction") == 1.0
    assert batch_value(metrics, "mis_lag_1_rejected_fraction") == 0.0


LAG_CONFIGS = [
    dict(tis_upper_bound=1.25, tis_upper_bound_by_lag=[1.25, 1.1, 1.05]),
    dict(tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25, tis_upper_bound_by_lag=[1.25, 1.15],
         rs_max_lag=2, rs_max_lag_k3=0.01),
    dict(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0,
         tis_upper_bound_by_lag=[2.0, 1.5, 1.2], tis_batch_normalize=True),
    dict(tis_level="geometric", tis_mode="icepop", tis_lower_bound=0.93, tis_upper_bound=1.07, use_rs=True,
         rs_level="token", rs_lower_bound=0.8, rs_upper_bound=1.25, rs_veto_threshold=0.75, rs_max_lag=0),
    dict(tis_upper_bound="auto", tis_auto_target_ess=0.95),
    dict(tis_level="sequence", tis_upper_bound="auto", tis_auto_target_ess=0.8, rs_max_lag=1),
    # a truncation bound below 1: a token that is not usable (ρ = 1) must not count as bounded
    dict(tis_upper_bound=0.98, tis_upper_bound_by_lag=[0.98, 0.9]),
]


@pytest.mark.parametrize("combo", LAG_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60])
def test_lag_metrics_bounds_and_gate_match_the_reference(combo):
    from test_reference_equivalence import assert_matches_reference

    cfg = MisConfig(use_tis=True, **combo)
    for seed in range(3):
        train, rollout, masks = random_batch(seed, noise=0.15, nonfinite=seed == 2)
        lags = [(7 * i + seed) % 5 for i in range(len(train))]
        assert_matches_reference(cfg, train, rollout, masks, lags=lags)
    assert_matches_reference(MisConfig(use_tis=False), train, rollout, masks, lags=lags)  # metrics only


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_seqs=st.integers(1, 12), max_lag=st.integers(0, 6))
def test_bucket_metrics_are_sums_by_bucket(seed, num_seqs, max_lag):
    """Property: every bucket metric is its ratio of sums over the bucket's sequences; the token fractions add to
    1 (when a token is valid); ESS and fractions stay in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    lags = torch.randint(0, max_lag + 1, (num_seqs,), generator=gen)
    n_valid = torch.randint(0, 5, (num_seqs,), generator=gen).double()
    n_usable = (n_valid - torch.randint(0, 2, (num_seqs,), generator=gen)).clamp(min=0)
    sum_k3 = torch.rand(num_seqs, generator=gen).double() * n_usable
    n_pass = (n_usable - torch.randint(0, 2, (num_seqs,), generator=gen)).clamp(min=0)
    n_bounded = torch.minimum(torch.randint(0, 3, (num_seqs,), generator=gen).double(), n_usable)
    sum_w = torch.rand(num_seqs, generator=gen).double() * n_pass
    sum_w_sq = sum_w.square() / n_pass.clamp(min=1) * (1 + torch.rand(num_seqs, generator=gen).double())
    metrics = dict(zip(*staleness.bucket_metrics(lags, n_valid, n_usable, sum_k3, n_bounded, n_pass, sum_w,
                                                  sum_w_sq)))
    assert sorted(metrics) == sorted(staleness.metric_names(True))
    fractions = 0.0
    for b, bucket in enumerate(staleness.BUCKETS):
        inside = (lags.clamp(max=3) == b)
        valid, usable = float(n_valid[inside].sum()), float(n_usable[inside].sum())
        assert float(metrics[f"lag_{bucket}_k3"]) == pytest.approx(float(sum_k3[inside].sum()) / max(usable, 1),
                                                                 rel=1e-5, abs=1e-7)
        fractions += float(metrics[f"lag_{bucket}_token_fraction"])
        rejected = 1 - float(n_pass[inside].sum()) / valid if valid else 0.0
        assert float(metrics[f"lag_{bucket}_rejected_fraction"]) == pytest.approx(rejected, abs=1e-6)
        for name in ("ess", "bounded_fraction", "rejected_fraction", "token_fraction"):
            assert 0.0 <= float(metrics[f"lag_{bucket}_{name}"]) <= 1.0
    assert fractions == pytest.approx(1.0 if float(n_valid.sum()) > 0 else 0.0, abs=1e-6)


# --------------------------------------------------------------------------- context parallel
def lag_cp_worker(rank, size):
    configs = [MisConfig(use_tis=True, **combo) for combo in LAG_CONFIGS] + [MisConfig(use_tis=False)]
    for case, config in enumerate(configs):
        fmt = "thd" if case % 2 == 0 else "bshd"
        full, pg_loss = make_full_batch(seed=500 * size + case, fmt=fmt)
        full["version_lags"] = [(3 * i + case) % 5 for i in range(len(full["response_lengths"]))]
        check_case(rank, size, config, full, pg_loss, fmt)  # every rank's masks and reduced metrics equal cp 1
        # the current policy too, in train_log_probs' (sharded) layout
        current = [t + 0.05 for t in full["train_log_probs"]]
        kwargs, local_pg, positions = shard(dict(full, train_log_probs=current), pg_loss, rank, size, fmt)
        cur_config = MisConfig(**dict(config.to_dict(), tis_policy="current"))
        args = SimpleNamespace(**cur_config.to_dict(), qkv_format=fmt)
        ref = compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict(), qkv_format=fmt), pg_loss=pg_loss,
                                          parallel_state=cp_state(0, 1), **dict(full, train_log_probs=current))
        local_old = shard(full, pg_loss, rank, size, fmt)[0]["train_log_probs"]
        got = compute_mis_weights_with_cp(args, pg_loss=local_pg, parallel_state=cp_state(rank, size),
                                          **dict(kwargs, train_log_probs=local_old,
                                                 cur_log_probs=kwargs["train_log_probs"]))
        torch.testing.assert_close(got[0], ref[0][positions])
        assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    lags = [0, 1, 2, 3, 4, 5]

    def expect(message, config=MisConfig(use_tis=True, rs_max_lag=1), **changes):
        with pytest.raises(ValueError, match=message):
            compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict(), qkv_format="thd"), pg_loss=local_pg,
                                        parallel_state=cp_state(rank, size), **dict(kwargs, **changes))

    # the ranks disagree on one sequence's lag: every rank names it
    expect(r"sequence 4: context-parallel ranks disagree on its lengths .*version_lag=4",
           version_lags=[lag + (rank if i == 4 else 0) for i, lag in enumerate(lags)])
    # one rank passes lags, the others none: every rank stops, naming the difference
    expect(r"disagree on the effective config: version_lags: cp rank 0 has 'none', cp rank 1 has 'given'",
           config=MisConfig(use_tis=True), **({"version_lags": lags} if rank else {}))
    # a bad lag on rank 0 only: rank 0 names the sequence, the others name rank 0
    bad = list(lags)
    if rank == 0:
        bad[2] = -3
    expect(r"sequence 2: version_lags\[2\]=-3" if rank == 0 else r"cp rank 0 at sequence 2", version_lags=bad)
    # tis_policy: current without the log-probs on one rank: every rank raises
    current = kwargs["train_log_probs"] if rank else None
    expect(r"needs the current policy's log-probs|cp rank 0", config=MisConfig(use_tis=True, tis_policy="current"),
           cur_log_probs=current)
    # the group still works afterwards
    check_case(rank, size, MisConfig(use_tis=True, tis_upper_bound_by_lag=[2.0, 1.1]), dict(full, version_lags=lags),
               pg_loss, "thd")


@pytest.mark.parametrize("size", [2, 3])
def test_lags_and_current_policy_under_cp_equal_cp1_and_fail_together(size):
    spawn(lag_cp_worker, size)


def test_weight_versions_numbers_and_what_is_skipped():
    lags = lambda versions, current=13: versions_lags(versions, current)  # noqa: E731
    assert lags([[12.0, "13"], [torch.tensor(11)], ["default", 13]]) == [1, 2, 0]  # a JSON round trip's 12.0
    for bad, message in (([[-2]], r"sequence 0: weight_versions\[0\]=-2 is invalid"),
                         ([["13"], [12.5]], r"sequence 1: weight_versions\[1\]=12.5 is invalid"),
                         ([[True]], r"sequence 0: weight_versions\[0\]=True is invalid")):
        with pytest.raises(InputError, match=message):
            lags(bad)


def versions_lags(weight_versions, current):
    return versions.lags({"weight_versions": weight_versions, "current_weight_version": current},
                         len(weight_versions)).tolist()


def test_lag_keys_do_nothing_in_metrics_only_mode_and_every_entry_point_reads_the_kwargs():
    train, rollout, masks = random_batch(4, num_seqs=5)
    for level in ("token", "sequence"):  # metrics-only: no lags needed, the same metrics as without the keys
        config = MisConfig(use_tis=False, tis_level=level, tis_upper_bound_by_lag=[2.0, 1.5], rs_max_lag=1)
        got, plain = call(config, train, rollout, masks), call(MisConfig(use_tis=False, tis_level=level), train,
                                                              rollout, masks)
        assert sorted(got[2]) == sorted(plain[2]) and all(torch.equal(got[2][k], plain[2][k]) for k in got[2])
    from miles_mis import compute_mis_weights_fsdp

    config = MisConfig(use_tis=True, tis_policy="current", tis_upper_bound_by_lag=[2.0, 1.2])
    current = [t + 0.1 for t in train]
    lags = [0, 1, 2, 0, 3]
    pg_loss = torch.ones(sum(t.numel() for t in train))
    fsdp = compute_mis_weights_fsdp(SimpleNamespace(**config.to_dict()), pg_loss=pg_loss, train_log_probs=train,
                                    rollout_log_probs=rollout, loss_masks=masks, cur_log_probs=current,
                                    version_lags=lags)
    with_cp = call(config, train, rollout, masks, cur_log_probs=current, version_lags=lags)
    weights, _, _ = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                        cur_log_probs=current, version_lags=lags)
    assert torch.equal(fsdp[0], with_cp[0]) and torch.equal(torch.cat(weights), with_cp[0])
    assert sorted(fsdp[2]) == sorted(with_cp[2])
