"""Boundaries of the plugin call: masks keep their values, outputs carry no graph, fill values are
not log-probs, odd tensors get an InputError naming the sequence."""

import math
import warnings

import pytest
import torch
from conftest import call_plugin as call
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_with_cp
from miles_mis.tensors.ops import LOG_PROB_BOUND
from miles_mis.inputs.packing import tensor_problem
from miles_mis.plugin import InputError

TOKEN_TIS = MisConfig(use_tis=True, tis_upper_bound=10.0)
PRESETS = ["mis", "token_tis", "seq_tis", "seq_mis", "geo_rs", "k3_rs", "token_icepop", "seq_is_rs"]


# --------------------------------------------------------------------------- 2. masks keep their values
def test_kept_tokens_keep_their_mask_value_and_rejected_become_zero():
    # token mask mode [0.5, 2]: token 1 has rho = e^1 > 2 -> rejected; the others are kept with their values
    train = [torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])]
    rollout = [torch.tensor([-1.0, -2.0, -1.1, -0.9, -1.0])]
    masks = [torch.tensor([0.5, 2.0, -1.0, 2.0, 0.0])]
    _, out, _ = call(MisConfig(use_tis=True, tis_mode="mask"), train, rollout, masks)
    assert out[0].tolist() == [0.5, 0.0, -1.0, 2.0, 0.0]
    _, out, _ = call(TOKEN_TIS, train, rollout, masks)  # truncate rejects nothing: the input values come back
    assert torch.equal(out[0], masks[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64, torch.bool])
def test_mask_dtype_and_values_survive(dtype):
    masks = [torch.tensor([3, 0, 1, 2]).to(dtype)]
    _, out, _ = call(TOKEN_TIS, [torch.full((4,), -1.0)], [torch.full((4,), -1.1)], masks)
    assert out[0].dtype == dtype and torch.equal(out[0], masks[0])


def test_host_loss_with_a_half_mask_is_not_doubled():
    # miles' reducer: sum(loss * modified_mask) / sum(original_mask). With nothing rejected, the plugin
    # must not change the numerator: 0.5 must stay 0.5 (it came back as 1.0 before).
    from miles_mis.reference_host import Reducer

    masks = [torch.tensor([0.5, 0.5, 1.0])]
    _, out, _ = call(TOKEN_TIS, [torch.full((3,), -1.0)], [torch.full((3,), -1.0)], masks)
    reduce = Reducer(out, torch.tensor([2.0]), torch.zeros(3, dtype=torch.long), None, per_token=False)
    assert reduce(torch.tensor([1.0, 1.0, 1.0])).item() == pytest.approx((0.5 + 0.5 + 1.0) / 2.0)


@pytest.mark.parametrize("preset", PRESETS + ["metrics_only"])
def test_only_pg_loss_carries_a_graph(preset):
    cfg = MisConfig.preset(preset, use_tis=True)
    train = [(-torch.rand(6)).requires_grad_() for _ in range(3)]
    rollout = [(t.detach() + 0.05 * torch.randn(6)).requires_grad_() for t in train]
    masks = [torch.ones(6, requires_grad=True) for _ in range(3)]
    pg = torch.ones(18, requires_grad=True)
    loss, out, metrics = call(cfg, train, rollout, masks, pg_loss=pg)
    for tensor in out + list(metrics.values()):
        assert not tensor.requires_grad and tensor.grad_fn is None
    loss.sum().backward()
    assert pg.grad is not None and all(t.grad is None for t in train + rollout + masks)


def test_nonfinite_mask_value_is_an_input_error():
    with pytest.raises(InputError, match=r"sequence 1: loss_masks\[1\] holds a non-finite value"):
        call(TOKEN_TIS, [torch.zeros(2)] * 2, [torch.zeros(2)] * 2, [torch.ones(2), torch.tensor([1.0, math.nan])])


# --------------------------------------------------------------------------- 5. fill values are not log-probs
FILLS = [-3.0e38, torch.finfo(torch.float32).min, -LOG_PROB_BOUND, -1.0e5, LOG_PROB_BOUND, 3.0e38,
         -math.inf, math.inf, math.nan]


def batch_with(value, where):
    train = [torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-1.0, -0.3])]
    rollout = [torch.tensor([-1.2, -0.5, -1.9]), torch.tensor([-0.8, -0.3])]
    (train if where == "train" else rollout)[0][1] = value
    return train, rollout, [torch.ones(3), torch.ones(2)]


@pytest.mark.parametrize("where", ["train", "rollout"])
@pytest.mark.parametrize("preset", PRESETS + ["metrics_only"])
def test_fill_values_are_treated_exactly_like_nan(preset, where):
    cfg = MisConfig.preset(preset, use_tis=True)
    loss_nan, masks_nan, metrics_nan = call(cfg, *batch_with(math.nan, where))
    for value in FILLS:
        loss, masks, metrics = call(cfg, *batch_with(value, where))
        assert torch.isfinite(loss).all()
        assert torch.equal(loss, loss_nan), value
        assert all(torch.equal(a, b) for a, b in zip(masks, masks_nan)), value
        assert metrics.keys() == metrics_nan.keys()
        for name in metrics:
            assert torch.isfinite(metrics[name]).all(), (value, name)
            assert torch.equal(metrics[name], metrics_nan[name]), (value, name)
        assert metrics["mis_nonfinite_token_fraction"].tolist() == [0, 1, 0, 0, 0]
        if cfg.use_tis:  # the sequence is rejected whole
            assert masks[0].tolist() == [0, 0, 0]


def test_just_inside_the_bound_is_a_log_prob():
    train, rollout, masks = batch_with(-LOG_PROB_BOUND * 0.999, "train")
    rollout[0][1] = -LOG_PROB_BOUND * 0.999
    _, out, metrics = call(TOKEN_TIS, train, rollout, masks)
    assert metrics["mis_nonfinite_token_fraction"].sum() == 0 and out[0].tolist() == [1, 1, 1]
    # the per-sequence mean log-prob includes it: (-1 - 9990 - 2) / 3
    assert metrics["mis_training_log_ppl"][0].item() == pytest.approx((1 + LOG_PROB_BOUND * 0.999 + 2) / 3, rel=1e-6)


log_prob = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                     st.floats(-30.0, 0.0, width=32), st.sampled_from(FILLS))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(log_prob, log_prob, st.sampled_from([0.0, 1.0, 0.5])), min_size=1, max_size=12),
       st.sampled_from(PRESETS))
def test_k3_is_non_negative_and_everything_finite_on_any_input(tokens, preset):
    train = [torch.tensor([t for t, _, _ in tokens], dtype=torch.float32)]
    rollout = [torch.tensor([r for _, r, _ in tokens], dtype=torch.float32)]
    masks = [torch.tensor([m for _, _, m in tokens])]
    loss, _, metrics = call(MisConfig.preset(preset, use_tis=True), train, rollout, masks)
    assert torch.isfinite(loss).all()
    for name, value in metrics.items():
        assert torch.isfinite(value).all(), name
    assert (metrics["mis_k3_kl"] >= 0).all()
    assert (metrics["mis_chi2_token"] >= -1).all()


@pytest.mark.parametrize("preset", ["k3_rs", "mis"])
def test_k3_is_non_negative_when_the_engines_agree_to_a_few_ulps(preset):
    # |l| ~ 1e-7: exp(l) - l - 1 rounds below 0 in float32 for a large share of such tokens
    gen = torch.Generator().manual_seed(0)
    train = [-torch.rand(200, generator=gen) * 3 for _ in range(50)]
    rollout = [t + torch.randint(-3, 4, t.shape, generator=gen) * torch.finfo(torch.float32).eps * t.abs()
               for t in train]
    cfg = MisConfig.preset(preset, use_tis=True)
    cfg = MisConfig.from_dict(dict(cfg.to_dict(), rs_divergence={"token_k3": 0.5, "seq_mean_k3": 0.5,
                                                                "seq_sum_k3": 5.0, "seq_max_k3": 0.5}))
    _, _, metrics = call(cfg, train, rollout, [torch.ones(200)] * 50)
    k3_metrics = [name for name in metrics if "k3" in name and not name.endswith("fraction")]
    assert len(k3_metrics) == 1 + 4 * 3 + 9  # mis_k3_kl, mean/max/min of the 4 options, 9 batch-level k3
    for name in k3_metrics:
        assert (metrics[name] >= 0).all(), name


# --------------------------------------------------------------------------- 7. odd tensors
def test_odd_entries_name_the_sequence():
    good = torch.tensor([-1.0, -0.5])
    sparse = good.to_sparse()
    with warnings.catch_warnings():  # quantized tensors are deprecated, but a host may still pass one
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(good, 0.1, 0, torch.qint8)
    cases = [
        ("train_log_probs", [-1.0, -0.5], r"sequence 1: train_log_probs\[1\] is a list, not a tensor"),
        ("rollout_log_probs", None, r"sequence 1: rollout_log_probs\[1\] is a NoneType, not a tensor"),
        ("train_log_probs", sparse, r"sequence 1: train_log_probs\[1\] is a sparse_coo tensor"),
        ("rollout_log_probs", quantized, r"sequence 1: rollout_log_probs\[1\] is a quantized tensor"),
        ("train_log_probs", torch.empty(2, device="meta"), r"sequence 1: train_log_probs\[1\] is on the meta device"),
        ("loss_masks", torch.ones(2, device="meta"), r"sequence 1: loss_masks\[1\] is on the meta device"),
        ("loss_masks", [1, 1], r"sequence 1: loss_masks\[1\] is a list"),
        ("train_log_probs", torch.zeros(2, dtype=torch.complex64),
         r"sequence 1: train_log_probs\[1\] has dtype torch.complex64"),
        ("rollout_log_probs", torch.zeros(1, 2), r"sequence 1: rollout_log_probs\[1\] has shape \(1, 2\)"),
    ]
    for name, bad, message in cases:
        lists = {"train_log_probs": [good, good.clone()], "rollout_log_probs": [good, good.clone()],
                 "loss_masks": [torch.ones(2), torch.ones(2)]}
        lists[name][1] = bad
        for entry in (lambda: compute_mis_weights(TOKEN_TIS, **lists),
                      lambda: compute_mis_weights_with_cp(TOKEN_TIS, pg_loss=torch.zeros(4), **lists)):
            with pytest.raises(InputError, match=message) as error:
                entry()
            assert error.value.sequence_index == 1


def test_another_device_is_named():
    problem = tensor_problem(torch.zeros(2), torch.device("cuda", 0), "log-probs")
    assert problem == "is on cpu but sequence 0 is on cuda:0: every sequence on one device"


@pytest.mark.parametrize("lengths, message", [
    ([2, 2.5], r"sequence 1: response_lengths\[1\]=2.5 is not an integer"),
    ([2, None], r"sequence 1: response_lengths\[1\]=None is not an integer"),
    (torch.tensor([2.0, 2.0]), r"response_lengths is a torch.float32 tensor"),
])
def test_lengths_must_be_integers(lengths, message):
    with pytest.raises(InputError, match=message):
        compute_mis_weights_with_cp(TOKEN_TIS, pg_loss=torch.zeros(4), train_log_probs=[torch.zeros(2)] * 2,
                                    rollout_log_probs=[torch.zeros(2)] * 2, loss_masks=[torch.ones(2)] * 2,
                                    total_lengths=[5, 5], response_lengths=lengths)


def _nested():
    with warnings.catch_warnings():  # the strided nested layout is a prototype: a host may still pass one
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)])


@pytest.mark.parametrize("make, message", [
    (lambda n: torch.empty(n, device="meta"), r"^pg_loss is on the meta device"),
    (lambda n: torch.ones(n).to_sparse(), r"^pg_loss is a sparse_coo tensor"),
    (lambda n: torch.arange(n), r"^pg_loss has dtype torch.int64: the loss is floating point"),
    (lambda n: torch.ones(n + 1), r"^pg_loss has shape \(5,\) but the 2 sequences hold 4 local tokens"),
    (lambda n: [1.0] * n, r"^pg_loss is a list, not a tensor"),
    (lambda n: _nested(), r"^pg_loss is a nested tensor"),
])
def test_pg_loss_is_checked_before_anything_uses_it(make, message):
    with pytest.raises(InputError, match=message):
        call(TOKEN_TIS, [torch.zeros(2)] * 2, [torch.zeros(2)] * 2, [torch.ones(2)] * 2, pg_loss=make(4))


@pytest.mark.parametrize("name", ["train_log_probs", "rollout_log_probs", "loss_masks"])
def test_a_list_that_is_not_a_list_is_named(name):
    lists = {"train_log_probs": [torch.zeros(2)], "rollout_log_probs": [torch.zeros(2)], "loss_masks": [torch.ones(2)]}
    lists[name] = torch.zeros(1, 2) if name != "loss_masks" else None
    kind = "NoneType" if name == "loss_masks" else "Tensor"
    with pytest.raises(InputError, match=rf"^{name} is a {kind}: expected a list of B 1-D tensors"):
        compute_mis_weights_with_cp(TOKEN_TIS, pg_loss=torch.zeros(2), **lists)


def test_nested_tensor_entry_is_named():
    nested = _nested()
    with pytest.raises(InputError, match=r"^sequence 0: train_log_probs\[0\] is a nested tensor"):
        compute_mis_weights(TOKEN_TIS, train_log_probs=[nested], rollout_log_probs=[torch.zeros(2)],
                            loss_masks=[torch.ones(2)])
