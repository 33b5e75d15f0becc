"""Trust regions in probability space: properties of the binary TV / KL estimators, and the directional options
(DPPO's token rule, VACO's sequence gate) by hand, against the per-token reference for both signs of the
advantage, as properties, through every entry point, and under context parallelism against cp = 1."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import random_advantages, random_batch
from cp_harness import cp_state, make_full_batch, shard, spawn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp import check_case
from test_reference_equivalence import assert_matches_reference

from miles_mis import (MisConfig, compute_mis_weights, compute_mis_weights_fsdp, compute_mis_weights_packed,
                       compute_mis_weights_with_cp)
from miles_mis.correction.divergence import probability_estimators

log_prob = st.floats(-40.0, 0.0, width=64)


# --------------------------------------------------------------------------- the estimators
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(log_prob, log_prob), min_size=1, max_size=20))
def test_binary_tv_in_range_binary_kl_nonnegative_and_both_zero_where_the_policies_agree(pairs):
    log_p = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    log_q = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    values = probability_estimators(log_p - log_q, log_p, log_q, ("tv", "atv", "bkl"))
    assert all(bool(torch.isfinite(v).all()) for v in values.values())
    assert bool((values["tv"] >= -1).all() and (values["tv"] <= 1).all())
    assert torch.equal(values["atv"], values["tv"].abs())
    assert bool((values["bkl"] >= 0).all())
    # p − q has the sign of ℓ = log p − log q (the directional rule reads ℓ's sign for either statistic)
    assert bool(((values["tv"] * (log_p - log_q)) >= 0).all())
    same = probability_estimators(torch.zeros_like(log_q), log_q, log_q, ("tv", "atv", "bkl"))
    assert all(bool((v == 0).all()) for v in same.values())


# --------------------------------------------------------------------------- by hand
# t0: p 0.9 vs q 0.5 (p − q = +0.4), t1: 0.2 vs 0.6 (−0.4), t2: 0.3 vs 0.3 (0), t3: 0.52 vs 0.5 (+0.02)
HAND_TRAIN = [math.log(0.9), math.log(0.2), math.log(0.3), math.log(0.52)]
HAND_ROLLOUT = [math.log(0.5), math.log(0.6), math.log(0.3), math.log(0.5)]


def run_hand(options, advantages, extra_sequence=False, **cfg):
    train, rollout = [torch.tensor(HAND_TRAIN)], [torch.tensor(HAND_ROLLOUT)]
    if extra_sequence:  # nearly on-policy: a gate never fires on it, whatever its tokens' directions
        train.append(torch.tensor([math.log(0.5), math.log(0.4)]))
        rollout.append(torch.tensor([math.log(0.49), math.log(0.41)]))
    masks = [torch.ones(len(t)) for t in train]
    advantages = [torch.tensor(a, dtype=torch.float32) for a in advantages]
    config = MisConfig(use_tis=True, tis_upper_bound=10.0, rs_divergence=options, **cfg)
    return compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                               advantages=advantages)


@pytest.mark.parametrize("advantage, kept", [
    (1.0, [0.0, 1.0, 1.0, 1.0]),    # A > 0 raises p: t0 (already 0.4 above q) would move further out
    (-1.0, [1.0, 0.0, 1.0, 1.0]),   # A < 0 lowers p: t1 (0.4 below q) would
    (0.0, [1.0, 1.0, 1.0, 1.0]),    # no update, no direction: nothing (prime-rl's where(A > 0, ...) masks t1 here)
])
def test_dppo_token_rule_by_hand_for_both_signs(advantage, kept):
    _, masks, metrics = run_hand({"token_dtv": [-0.2, 0.2]}, [[advantage] * 4])
    assert masks[0].tolist() == kept
    assert metrics["mis_rs_token_dtv_masked_token_fraction"][0].tolist() == [1.0 - k for k in kept]
    assert metrics["mis_rs_token_dtv_mean"][0].tolist() == pytest.approx([0.4, -0.4, 0.0, 0.02], abs=1e-6)
    # per-token advantages of the other sign keep the tokens the uniform ones reject
    _, masks, _ = run_hand({"token_dtv": [-0.2, 0.2]}, [[-1.0, 1.0, 1.0, 1.0]])
    assert masks[0].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_dppo_kl_rule_by_hand():
    # KL(Bern(q) ‖ Bern(p)): t0 0.5·log(0.5/0.9) + 0.5·log(0.5/0.1) = 0.511, t1 0.6·log 3 + 0.4·log 0.5 = 0.382
    bkl = lambda p, q: q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # noqa: E731
    _, masks, metrics = run_hand({"token_dbkl": 0.45}, [[1.0, -1.0, 1.0, 1.0]])
    assert masks[0].tolist() == [0.0, 1.0, 1.0, 1.0]  # t1 moves out too but its KL is inside the bound
    assert metrics["mis_rs_token_dbkl_mean"][0].tolist() == pytest.approx(
        [bkl(0.9, 0.5), bkl(0.2, 0.6), 0.0, bkl(0.52, 0.5)], rel=1e-5, abs=1e-7)
    _, masks, _ = run_hand({"token_dbkl": 0.3}, [[1.0, -1.0, 1.0, -1.0]])
    assert masks[0].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_vaco_gate_removes_only_the_moving_out_tokens_of_the_gated_sequence():
    # sequence 0: mean |p − q| = (0.4 + 0.4 + 0 + 0.02) / 4 = 0.205 > 0.2, the gate fires; sequence 1: 0.01
    weights, masks, metrics = run_hand({"seq_mean_datv": 0.2}, [[1.0] * 4, [1.0, -1.0]], extra_sequence=True)
    assert masks[0].tolist() == [0.0, 1.0, 1.0, 0.0]  # A > 0: the tokens with p > q (t0, t3) move out
    assert masks[1].tolist() == [1.0, 1.0]  # moving out too (0.5 > 0.49, A > 0), but not gated
    assert weights[0].tolist() == pytest.approx([0.0, 0.2 / 0.6, 1.0, 0.0])
    assert metrics["mis_rs_seq_mean_datv_mean"][0][0].item() == pytest.approx(0.205, rel=1e-5)
    assert metrics["mis_rs_seq_mean_datv_masked_token_fraction"][0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["mis_rs_seq_mean_datv_masked_seq_fraction"][0][0].item() == 1.0
    assert metrics["mis_rs_seq_mean_datv_masked_seq_fraction"][1][0].item() == 0.0
    assert metrics["mis_rs_divergence_masked_token_fraction"][0].tolist() == [1.0, 0.0, 0.0, 1.0]
    _, masks, _ = run_hand({"seq_mean_datv": 0.2}, [[-1.0] * 4])
    assert masks[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    _, masks, metrics = run_hand({"seq_mean_datv": 0.21}, [[1.0] * 4])  # below the threshold: nothing
    assert masks[0].tolist() == [1.0] * 4 and metrics["mis_rs_seq_mean_datv_masked_seq_fraction"][0][0] == 0.0


def test_vaco_kept_token_statistics_are_those_of_the_staying_tokens():
    """Normalisation, ESS and per-sequence extremes read the kept tokens after the gate: t1 (1/3) and t2 (1)."""
    _, _, metrics = run_hand({"seq_mean_datv": 0.2}, [[1.0] * 4], tis_batch_normalize=True)
    mean = (1 / 3 + 1.0) / 2
    assert metrics["mis_batch_norm_factor"][0][0].item() == pytest.approx(mean, rel=1e-6)
    assert metrics["mis_is_ratio_max_final"][0][0].item() == pytest.approx(1.0 / mean, rel=1e-6)
    assert metrics["mis_is_ratio_min_final"][0][0].item() == pytest.approx((1 / 3) / mean, rel=1e-6)
    # ESS = (Σw)² / (N Σw²) over the 4 valid tokens
    assert metrics["mis_ess"][0][0].item() == pytest.approx((4 / 3) ** 2 / (4 * (1 / 9 + 1)), rel=1e-6)


# --------------------------------------------------------------------------- against the reference
DIRECTIONAL_CONFIGS = [
    dict(rs_divergence={"token_dtv": [-0.05, 0.04]}),
    dict(rs_divergence={"token_dbkl": 0.01}, tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0),
    dict(rs_divergence={"seq_mean_datv": 0.02}, tis_batch_normalize=True),
    dict(rs_divergence={"seq_mean_dbkl": 0.003}, use_rs=True, rs_lower_bound=0.6, rs_upper_bound=1.6),
    dict(rs_divergence={"seq_mean_datv": 0.02}, tis_level="sequence", tis_upper_bound=3.0),
    dict(rs_divergence={"seq_mean_datv": 0.02, "token_dtv": [-0.06, 0.06]}, tis_level="geometric",
         tis_mode="mask", tis_lower_bound=0.9, tis_upper_bound=1.1, rs_veto_threshold=0.5),
    dict(rs_divergence={"seq_mean_datv": 0.02}, tis_upper_bound="auto", tis_auto_bounds=[1.0, 2.0],
         tis_auto_target_ess=0.99),
    dict(rs_divergence={"seq_mean_dbkl": 0.003}, tis_level="sequence", tis_upper_bound="auto",
         tis_auto_target_ess=0.8),
    dict(rs_divergence={"token_dtv": [-0.2, 0.2]}, tis_policy="old", tis_upper_bound=485165195.4),
]


@pytest.mark.parametrize("combo", DIRECTIONAL_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_directional_options_match_the_reference_for_both_signs(combo):
    cfg = MisConfig(use_tis=True, **combo)
    for seed in range(3):
        train, rollout, masks = random_batch(seed, noise=0.2, nonfinite=seed == 2)
        advantages = random_advantages(masks, seed)
        assert_matches_reference(cfg, train, rollout, masks, advantages=advantages)
        assert_matches_reference(cfg, train, rollout, masks, advantages=[-a for a in advantages])


def test_directional_options_with_lags_match_the_reference():
    cfg = MisConfig(use_tis=True, rs_divergence={"seq_mean_datv": 0.02}, tis_upper_bound_by_lag=[2.0, 1.5],
                    rs_max_lag=2)
    train, rollout, masks = random_batch(4, noise=0.2)
    assert_matches_reference(cfg, train, rollout, masks, lags=[i % 4 for i in range(len(masks))],
                             advantages=random_advantages(masks, 4))


# --------------------------------------------------------------------------- properties
@st.composite
def directional_batches(draw):
    num_seqs = draw(st.integers(1, 5))
    train, rollout, masks, advantages = [], [], [], []
    for _ in range(num_seqs):
        n = draw(st.integers(0, 10))
        # no subnormal log-probs: after a compiled kernel has run, the process may flush them to zero (FTZ/DAZ), and
        # the reference's own ℓ = train − rollout below would then disagree with the code's in its last bit
        lists = [draw(st.lists(st.floats(-8.0, 0.0, width=32, allow_subnormal=False), min_size=n, max_size=n))
                 for _ in range(2)]
        train.append(torch.tensor(lists[0], dtype=torch.float32))
        rollout.append(torch.tensor(lists[1], dtype=torch.float32))
        masks.append(torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))))
        advantages.append(torch.tensor(draw(st.lists(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 2.0]), min_size=n,
                                                     max_size=n))))
    return train, rollout, masks, advantages


def _masks(options, train, rollout, masks, advantages=None):
    extra = {} if advantages is None else {"advantages": advantages}
    out = compute_mis_weights(MisConfig(use_tis=True, rs_divergence=options), train_log_probs=train,
                              rollout_log_probs=rollout, loss_masks=masks, **extra)
    return torch.cat(out[1]) if out[1] else torch.zeros(0), out


@settings(max_examples=200, deadline=None)
@given(directional_batches(), st.floats(0.01, 0.5), st.floats(0.01, 0.5))
def test_dppo_rejects_the_undirected_rejections_that_move_out_and_nothing_else(batch, alpha, beta):
    train, rollout, masks, advantages = batch
    undirected, _ = _masks({"token_tv": [-alpha, beta]}, train, rollout, masks)
    forward, (weights, _, _) = _masks({"token_dtv": [-alpha, beta]}, train, rollout, masks, advantages)
    backward, _ = _masks({"token_dtv": [-alpha, beta]}, train, rollout, masks, [-a for a in advantages])
    valid = torch.cat(masks) != 0 if masks else torch.zeros(0, dtype=torch.bool)
    rejected = valid & (undirected == 0)
    signs = torch.cat(advantages) if advantages else torch.zeros(0)
    log_ratio = (torch.cat(train) - torch.cat(rollout)) if train else torch.zeros(0)
    moving = signs * log_ratio > 0
    assert torch.equal(valid & (forward == 0), rejected & moving)
    assert torch.equal(valid & (backward == 0), rejected & (signs * log_ratio < 0))
    # A and −A together reject exactly what the undirected mask rejects, except tokens with A = 0
    assert torch.equal(valid & ((forward == 0) | (backward == 0)), rejected & (signs != 0))
    assert all(bool(torch.isfinite(w).all()) for w in weights)


@settings(max_examples=200, deadline=None)
@given(directional_batches(), st.floats(0.001, 0.3))
def test_vaco_removes_moving_out_tokens_of_sequences_the_undirected_option_rejects(batch, delta):
    train, rollout, masks, advantages = batch
    undirected, _ = _masks({"seq_mean_atv": delta}, train, rollout, masks)
    gated, (weights, _, metrics) = _masks({"seq_mean_datv": delta}, train, rollout, masks, advantages)
    valid = torch.cat(masks) != 0 if masks else torch.zeros(0, dtype=torch.bool)
    moving = (torch.cat(advantages) * (torch.cat(train) - torch.cat(rollout)) > 0) if train else valid
    assert torch.equal(valid & (gated == 0), valid & (undirected == 0) & moving)
    zero = [torch.zeros_like(a) for a in advantages]
    unmoved, _ = _masks({"seq_mean_datv": delta, "token_dtv": [-delta, delta]}, train, rollout, masks, zero)
    assert torch.equal(unmoved != 0, valid)  # A = 0: no direction, nothing rejected
    assert all(bool(torch.isfinite(w).all()) for w in weights)
    assert all(bool(torch.isfinite(v).all()) for values in metrics.values() for v in values)


# --------------------------------------------------------------------------- the advantages input
def test_advantages_per_sequence_flat_and_every_entry_point_agree():
    train, rollout, masks = random_batch(5, noise=0.2)
    advantages = random_advantages(masks, 5)
    cfg = MisConfig(use_tis=True, rs_divergence={"token_dtv": [-0.03, 0.03], "seq_mean_datv": 0.02})
    lists = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                advantages=advantages)
    flat = compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                               advantages=torch.cat(advantages))
    assert all(torch.equal(a, b) for a, b in zip(lists[1], flat[1]))
    assert any(bool((m == 0).any() & (o != 0).any()) for m, o in zip(lists[1], masks))  # it rejects some
    pg_loss = torch.ones(sum(len(m) for m in masks))
    args = SimpleNamespace(**cfg.to_dict())
    for loss, out_masks, _ in (
            compute_mis_weights_with_cp(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=masks, total_lengths=[len(m) + 3 for m in masks],
                                        response_lengths=[len(m) for m in masks], advantages=advantages),
            compute_mis_weights_fsdp(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                                     loss_masks=masks, advantages=torch.cat(advantages))):
        assert all(torch.equal(a, b) for a, b in zip(out_masks, lists[1]))
        torch.testing.assert_close(loss, torch.cat(lists[0]))
    cu = torch.tensor([0] + [len(m) for m in masks]).cumsum(0)
    weights, mask, _ = compute_mis_weights_packed(cfg, train_log_probs=torch.cat(train),
                                                  rollout_log_probs=torch.cat(rollout), loss_mask=torch.cat(masks),
                                                  cu_seqlens=cu, advantages=torch.cat(advantages))
    assert torch.equal(mask, torch.cat(lists[1])) and torch.equal(weights, torch.cat(lists[0]))


@pytest.mark.parametrize("change, message", [
    (dict(advantages=None), r"rs_divergence option token_dtv, seq_mean_datv masks a token by the sign of its "
                            r"advantage, but the host passed no advantages"),
    (dict(advantages="drop the last"), r"advantages has 11 sequences but the batch has 12"),
    (dict(advantages="short"), r"sequence 5: advantages\[5\] is \(\d+,\) but train_log_probs\[5\] has \d+ tokens"),
    (dict(advantages="flat short"), r"advantages is a tensor of shape \(\d+,\): expected this rank's \d+ tokens"),
    (dict(advantages="nan"), r"sequence 6: advantages\[6\] holds a non-finite value on a valid token"),
    (dict(advantages="bool"), r"advantages is a torch.bool tensor: expected real numbers"),
    (dict(advantages=3.0), r"advantages is a float: expected a list of B 1-D tensors"),
])
def test_bad_advantages_raise_one_line_naming_what_is_wrong(change, message):
    train, rollout, masks = random_batch(6, holes=False, zero_length=False)
    good = random_advantages(masks, 6)
    value = {"drop the last": good[:-1], "short": [a[:-1] if i == 5 else a for i, a in enumerate(good)],
             "flat short": torch.cat(good)[:-1], "nan": [a.clone() for a in good],
             "bool": torch.cat(good) > 0}.get(change["advantages"], change["advantages"]) \
        if isinstance(change["advantages"], str) else change["advantages"]
    if change["advantages"] == "nan":
        value[6][0] = float("nan")
    cfg = MisConfig(use_tis=True, rs_divergence={"token_dtv": [-0.1, 0.1], "seq_mean_datv": 0.05})
    with pytest.raises(ValueError, match=message):
        compute_mis_weights(cfg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                            **({} if value is None else {"advantages": value}))


def test_advantages_are_ignored_where_no_option_reads_them():
    train, rollout, masks = random_batch(2)
    options = {"token_dtv": [-0.1, 0.1], "seq_mean_dbkl": 0.01}
    # metrics-only: the directional options act on nothing, so no advantages are needed (one YAML for both modes)
    _, out, _ = compute_mis_weights(MisConfig(use_tis=False, rs_divergence=options), train_log_probs=train,
                                    rollout_log_probs=rollout, loss_masks=masks)
    assert all(torch.equal(a, b) for a, b in zip(out, masks))
    # a config without a directional option does not read (or check) them
    plain = dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    cfg = MisConfig(use_tis=True, rs_divergence={"token_tv": [-0.1, 0.1]})
    with_bad = compute_mis_weights(cfg, **plain, advantages="not read")
    without = compute_mis_weights(cfg, **plain)
    assert all(torch.equal(a, b) for a, b in zip(with_bad[1], without[1]))


# --------------------------------------------------------------------------- context parallel
CP_CONFIGS = [
    MisConfig(use_tis=True, rs_divergence={"token_dtv": [-0.05, 0.04]}),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_datv": 0.02}, tis_batch_normalize=True),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_dbkl": 0.002, "token_dbkl": 0.01}, tis_level="geometric",
              tis_lower_bound=0.93, tis_upper_bound=1.07, rs_veto_threshold=0.5),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_datv": 0.02}, tis_mode="mask", tis_lower_bound=0.8,
              tis_upper_bound=1.25, tis_upper_bound_by_lag=None),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_datv": 0.015}, tis_upper_bound="auto",
              tis_auto_bounds=[1.0, 2.0], tis_auto_target_ess=0.99),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_dbkl": 0.002}, tis_level="sequence", tis_upper_bound=4.0),
]


def directional_cp_worker(rank, size):
    for case, config in enumerate(CP_CONFIGS):
        fmt = "thd" if case % 2 == 0 else "bshd"
        full, pg_loss = make_full_batch(seed=700 * size + case, fmt=fmt)
        full["advantages"] = random_advantages(full["loss_masks"], case)
        check_case(rank, size, config, full, pg_loss, fmt)  # every rank's masks, loss and metrics equal cp 1
    # advantages missing on one rank: every rank raises (the others name that rank)
    full, pg_loss = make_full_batch(seed=11, num_seqs=6)
    full["advantages"] = random_advantages(full["loss_masks"], 11)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    if rank == size - 1:
        kwargs.pop("advantages")
    args = SimpleNamespace(**CP_CONFIGS[1].to_dict(), qkv_format="thd")
    with pytest.raises(ValueError, match=r"passed no advantages" if rank == size - 1 else rf"cp rank {size - 1}"):
        compute_mis_weights_with_cp(args, pg_loss=local_pg, parallel_state=cp_state(rank, size), **kwargs)
    # the group still works afterwards
    check_case(rank, size, CP_CONFIGS[0], full, pg_loss, "thd")


@pytest.mark.parametrize("size", [2, 3])
def test_directional_options_under_cp_equal_cp1_and_fail_together(size):
    spawn(directional_cp_worker, size)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("density", [0.02, 0.6])  # few flags: int32 indices are cheaper; many: bits
def test_rejection_planes_round_trip_in_both_encodings(planes, density):
    from miles_mis.parallel import rejection_wire

    gen = torch.Generator().manual_seed(int(density * 100) + planes)
    tokens = [370, 0, 640, 5]
    flags = [(torch.rand(planes, n, generator=gen) < density).float() for n in tokens]
    counts = [int(f.sum()) for f in flags]
    encoding = rejection_wire.Encoding.choose(tokens, counts, planes)
    assert encoding.kind == ("indices" if density < 0.1 else "bits") and encoding.size % 8 == 0
    gathered = torch.stack([rejection_wire.encode(f if planes == 2 else f[0], encoding) for f in flags])
    rank, index, plane = rejection_wire.decode(gathered, encoding)
    got = sorted(zip(rank.tolist(), plane.tolist(), index.tolist()))
    want = sorted((r, p, j) for r, f in enumerate(flags) for p, j in f.nonzero().tolist())
    assert got == want and len(want) > 0
