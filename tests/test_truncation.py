"""The unreplayed-truncation detector and the sampling-mask sizes (miles_mis/correction/truncated_sampling.py,
sampling_mask.py): hand cases, every form a host passes the masks in, bad inputs, and every CP rank against cp = 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from cp_harness import cp_state, make_full_batch, shard, spawn
from reference import truncation_reference
from test_cp import check_case

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed, compute_mis_weights_with_cp
from miles_mis.correction import truncated_sampling
from miles_mis.inputs.packing import InputError


def batch_value(metrics, name):
    return float(torch.cat(metrics[name])[0])


def shifted_batch(num_seqs=4, length=50, kept_mass=(0.85, 0.99), noise=1e-3, seed=0):
    """Processed log-probs: the engine's log-probs renormalised over a kept set of mass Z_t (ℓ shifted by log Z_t)."""
    gen = torch.Generator().manual_seed(seed)
    train = [-torch.rand(length, generator=gen) * 2 for _ in range(num_seqs)]
    rollout = [t + noise * torch.randn(length, generator=gen) for t in train]
    low, high = kept_mass
    processed = [r - torch.log(low + (high - low) * torch.rand(length, generator=gen)) for r in rollout]
    return train, rollout, processed, [torch.ones(length) for _ in train]


def test_the_detector_fires_on_processed_log_probs_and_not_on_numerical_noise():
    train, rollout, processed, masks = shifted_batch()
    for rollout_log_probs, fires in ((rollout, 0.0), (processed, 1.0)):
        _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=rollout_log_probs,
                                            loss_masks=masks)
        ells = torch.cat([t.double() - r.double() for t, r in zip(train, rollout_log_probs)])
        # written out, against the float32 log-probs the plugin reads
        ells = torch.cat([t.double() - r.double() for t, r in zip(train, rollout_log_probs)]).tolist()
        want = truncation_reference([{"ell": e} for e in ells])
        for name, value in want.items():
            assert batch_value(metrics, f"mis_{name}") == pytest.approx(value, rel=1e-5, abs=1e-7), name
        assert batch_value(metrics, "mis_unreplayed_truncation") == fires
    negative = batch_value(metrics, "mis_log_ratio_negative_fraction")
    assert negative == 1.0  # every kept mass < 1 outweighs noise of 1e-3 here


def test_the_detector_by_hand():
    # 60 tokens at l = -0.1 and 40 at l = +0.05 (mean -0.04, std 0.0735): 60 % negative, below the 70 % alarm
    ells = [-0.1] * 60 + [0.05] * 40
    train = [torch.tensor(ells, dtype=torch.float32) - 1.0]
    rollout = [torch.full((100,), -1.0)]
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=[torch.ones(100)])
    ell = (train[0].double() + 1.0).tolist()
    mean = sum(ell) / 100
    std = math.sqrt(sum(e * e for e in ell) / 100 - mean ** 2)
    assert batch_value(metrics, "mis_log_ratio_negative_fraction") == pytest.approx(0.6)
    assert batch_value(metrics, "mis_log_ratio_standardized_mean") == pytest.approx(mean / std, rel=1e-5)
    assert batch_value(metrics, "mis_unreplayed_truncation") == 0.0
    # 90 negative of 100: the alarm; the same with 40 tokens only: too few to call
    for n, alarm in ((100, 1.0), (40, 0.0)):
        ells = [-0.1] * (9 * n // 10) + [0.05] * (n // 10)
        _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=[torch.tensor(ells) - 1.0],
                                            rollout_log_probs=[torch.full((n,), -1.0)], loss_masks=[torch.ones(n)])
        assert batch_value(metrics, "mis_unreplayed_truncation") == alarm, n
    # a consistent but tiny shift (an fp32 engine's 1e-5 per token): too small to call, whatever its sign test says
    ells = [-2e-5] * 95 + [1e-5] * 5
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=[torch.tensor(ells, dtype=torch.float64) - 0.5],
                                        rollout_log_probs=[torch.full((100,), -0.5, dtype=torch.float64)],
                                        loss_masks=[torch.ones(100)])
    assert batch_value(metrics, "mis_log_ratio_negative_fraction") == pytest.approx(0.95)
    assert batch_value(metrics, "mis_log_ratio_standardized_mean") < -1.0
    assert batch_value(metrics, "mis_unreplayed_truncation") == 0.0
    # exact ties (l = 0, an fp32 engine) are left out of the fraction
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=[torch.full((200,), -1.0)],
                                        rollout_log_probs=[torch.full((200,), -1.0)], loss_masks=[torch.ones(200)])
    assert batch_value(metrics, "mis_log_ratio_negative_fraction") == 0.0
    assert batch_value(metrics, "mis_log_ratio_standardized_mean") == 0.0


def offsets_of(sizes):
    return [torch.cat([torch.zeros(1, dtype=torch.long), s.cumsum(0)]) for s in sizes]


def test_sampling_mask_sizes_in_every_form_give_the_hand_values():
    train, rollout, processed, masks = shifted_batch(num_seqs=2, length=4)
    masks[1][3] = 0.0  # not trained: left out
    sizes = [torch.tensor([1, 3, 0, 5]), torch.tensor([1, 1, 2, 9])]  # 0: an unrecorded mask
    want = {"mis_sampling_mask_size_mean": (1 + 3 + 5 + 1 + 1 + 2) / 6, "mis_sampling_mask_size_min": 1.0,
            "mis_sampling_mask_singleton_fraction": 3 / 6, "mis_sampling_mask_unrecorded_fraction": 1 / 7}
    forms = [{"rollout_sampling_mask_offsets": offsets_of(sizes)}, {"rollout_top_p_token_offsets": offsets_of(sizes)},
             {"sampling_mask_sizes": sizes}, {"sampling_mask_sizes": [s.tolist() for s in sizes]}]
    for form in forms:
        _, _, metrics = compute_mis_weights(MisConfig(use_tis=True), train_log_probs=train,
                                            rollout_log_probs=processed, loss_masks=masks, **form)
        for name, value in want.items():
            assert batch_value(metrics, name) == pytest.approx(value), (form, name)
    # the packed entry point: per sequence offsets, or the sizes flat
    cu = torch.tensor([0, 4, 8])
    for form in (forms[0], {"sampling_mask_sizes": torch.cat(sizes)}):
        _, _, metrics = compute_mis_weights_packed(MisConfig(), train_log_probs=torch.cat(train),
                                                   rollout_log_probs=torch.cat(processed), loss_mask=torch.cat(masks),
                                                   cu_seqlens=cu, **form)
        for name, value in want.items():
            assert float(metrics[name][0]) == pytest.approx(value), (form, name)
    # without them: no sampling-mask metrics at all
    _, _, metrics = compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=processed,
                                        loss_masks=masks)
    assert not [name for name in metrics if "sampling_mask" in name]


@pytest.mark.parametrize("spelling", ["sampling_mask_sizes", "rollout_sampling_mask_offsets",
                                      "rollout_top_p_token_offsets"])
@pytest.mark.parametrize("container", [list, tuple])
def test_an_empty_response_in_python_lists_is_accepted_at_every_entry_point(spelling, container):
    """[[3, 1], []]: the empty list of the 0-token response is int64, not float32, in every spelling."""
    train = [torch.tensor([-1.0, -2.0]), torch.zeros(0)]
    rollout = [torch.tensor([-1.1, -1.9]), torch.zeros(0)]
    masks = [torch.ones(2), torch.zeros(0)]
    values = [[3, 1], []] if spelling == "sampling_mask_sizes" else [[0, 3, 4], [0]]
    form = {spelling: container(container(v) for v in values)}
    want = {"mis_sampling_mask_size_mean": 2.0, "mis_sampling_mask_size_min": 1.0,
            "mis_sampling_mask_singleton_fraction": 0.5}
    _, _, metrics = compute_mis_weights(MisConfig(use_tis=True), train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=masks, **form)
    _, _, cp_metrics = compute_mis_weights_with_cp(SimpleNamespace(use_tis=True), pg_loss=torch.ones(2),
                                                   train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                                   total_lengths=[5, 3], response_lengths=[2, 0], **form)
    packed_form = form if spelling != "sampling_mask_sizes" else {spelling: torch.tensor([3, 1])}
    _, _, packed_metrics = compute_mis_weights_packed(MisConfig(use_tis=True), train_log_probs=torch.cat(train),
                                                      rollout_log_probs=torch.cat(rollout),
                                                      loss_mask=torch.cat(masks), cu_seqlens=torch.tensor([0, 2, 2]),
                                                      **packed_form)
    for name, value in want.items():
        assert batch_value(metrics, name) == pytest.approx(value), name
        assert float(cp_metrics[name][0]) == pytest.approx(value), name
        assert float(packed_metrics[name][0]) == pytest.approx(value), name


@pytest.mark.parametrize("kwargs, message", [
    ({"rollout_sampling_mask_offsets": "x"}, "rollout_sampling_mask_offsets is a str"),
    ({"rollout_sampling_mask_offsets": [torch.arange(5)]}, "has 1 sequences but the batch has 2"),
    ({"rollout_sampling_mask_offsets": [torch.arange(5), torch.arange(4)]},
     r"sequence 1: rollout_sampling_mask_offsets\[1\] has 4 offsets but the response has 4 tokens"),
    ({"rollout_top_p_token_offsets": [torch.arange(5), torch.tensor([0, 2, 1, 3, 4])]},
     r"sequence 1: rollout_top_p_token_offsets\[1\] decrease at response token 1"),
    ({"rollout_top_p_token_offsets": [torch.arange(5.0), torch.arange(5)]}, r"sequence 0: .* is a torch.float32"),
    ({"sampling_mask_sizes": [torch.ones(4, dtype=torch.long), torch.ones(3, dtype=torch.long)]},
     r"sequence 1: sampling_mask_sizes\[1\] has 3 sizes but the response has 4 tokens"),
    ({"sampling_mask_sizes": [torch.ones(4, dtype=torch.long)] * 2,
      "rollout_top_p_token_offsets": [torch.arange(5)] * 2}, "pass one"),
])
def test_bad_sampling_masks_name_the_sequence(kwargs, message):
    train, rollout, processed, masks = shifted_batch(num_seqs=2, length=4)
    with pytest.raises(InputError, match=message):
        compute_mis_weights(MisConfig(), train_log_probs=train, rollout_log_probs=processed, loss_masks=masks,
                            **kwargs)


def truncation_cp_worker(rank, size):
    for case, config in enumerate([MisConfig(), MisConfig(use_tis=True), MisConfig(use_tis=True, use_rs=True)]):
        fmt = "thd" if case % 2 == 0 else "bshd"
        full, pg_loss = make_full_batch(seed=70 * size + case, fmt=fmt)
        gen = torch.Generator().manual_seed(case)
        # processed log-probs: the detector fires at cp 1, and so on every rank
        full["rollout_log_probs"] = [r - torch.log(0.8 + 0.15 * torch.rand(r.shape, generator=gen))
                                     for r in full["rollout_log_probs"]]
        sizes = [torch.randint(0, 6, (n,), generator=gen) for n in full["response_lengths"]]
        check_case(rank, size, config, full, pg_loss, fmt)
        check_case(rank, size, config, dict(full, rollout_top_p_token_offsets=offsets_of(sizes)), pg_loss, fmt)
        # Python lists, an empty response's [] among them (make_full_batch has a 0-token response)
        assert [] in [s.tolist() for s in sizes]
        check_case(rank, size, config, dict(full, sampling_mask_sizes=[s.tolist() for s in sizes]), pg_loss, fmt)
    # one rank passes sampling masks, the others none: every rank stops, naming the difference
    full, pg_loss = make_full_batch(seed=5, num_seqs=4)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    masks = {"sampling_mask_sizes": [torch.ones(n, dtype=torch.long) for n in full["response_lengths"]]}
    with pytest.raises(ValueError, match=r"sampling_masks: cp rank 0 has 'none', cp rank 1 has 'given'"):
        compute_mis_weights_with_cp(SimpleNamespace(use_tis=True, qkv_format="thd"), pg_loss=local_pg,
                                    parallel_state=cp_state(rank, size), **dict(kwargs, **(masks if rank else {})))


@pytest.mark.parametrize("size", [2, 3])
def test_detector_and_sampling_masks_under_cp_equal_cp1(size):
    spawn(truncation_cp_worker, size, timeout=240)


def test_thresholds_are_what_the_docs_state():
    assert (truncated_sampling.NEGATIVE_FRACTION, truncated_sampling.STANDARDIZED_MEAN, truncated_sampling.MEAN_SHIFT,
            truncated_sampling.MIN_TOKENS) == (0.7, 0.3, 1e-3, 64)
