"""The packed entry point (flat [N] tensors + cu_seqlens): the list path's results, its own input checks,
and no Python loop over sequences."""

import argparse
import math
import random
import warnings

import pytest
import torch
from conftest import random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_count import OP_COUNT_CONFIGS, OP_COUNT_IDS, count_aten_ops

import miles_mis
from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed
from miles_mis.config import preset_files
from miles_mis.plugin import InputError

PRESETS = sorted(preset_files())
DEFAULT = MisConfig.preset("mis", use_tis=True)


def packed(train, rollout, masks):
    """The per-sequence lists as a packed host holds them."""
    lengths = [t.numel() for t in train]
    join = lambda seqs, dtype=torch.float32: torch.cat(seqs) if seqs else torch.zeros(0, dtype=dtype)  # noqa: E731
    return dict(train_log_probs=join(train), rollout_log_probs=join(rollout),
                loss_mask=join(masks, masks[0].dtype if masks else torch.float32),
                cu_seqlens=torch.tensor([0] + lengths, dtype=torch.long,
                                        device=train[0].device if train else "cpu").cumsum(0))


def assert_same_as_list(config, train, rollout, masks):
    """compute_mis_weights_packed on the joined tensors == compute_mis_weights on the lists, joined: bit for bit."""
    weights, mask, metrics = compute_mis_weights_packed(config, **packed(train, rollout, masks))
    list_weights, list_masks, list_metrics = compute_mis_weights(config, train_log_probs=train,
                                                                 rollout_log_probs=rollout, loss_masks=masks)
    join = lambda seqs: torch.cat(seqs) if seqs else torch.zeros(0)  # noqa: E731
    if list_weights is None:
        assert weights is None
    else:
        assert weights.shape == mask.shape and torch.equal(weights, join(list_weights))
    assert mask.dtype == (masks[0].dtype if masks else torch.float32)
    assert torch.equal(mask, join(list_masks).to(mask.dtype))
    assert list(metrics) == list(list_metrics)
    for name, value in metrics.items():
        assert value.shape == mask.shape, name
        torch.testing.assert_close(value, join(list_metrics[name]), rtol=0, atol=0, equal_nan=True, msg=name)
    return weights, mask, metrics


def odd_masks(masks, seed):
    """Masks with holes and the values 0.5 and 2 (kept tokens keep their value)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in masks:
        m = m.clone()
        draw = torch.rand(m.shape, generator=gen)
        m[(draw < 0.15) & (m != 0)] = 0.5
        m[(draw > 0.9) & (m != 0)] = 2.0
        out.append(m)
    return out


# --------------------------------------------------------------------------- same results as the list path
def odd_batch(seed):
    """Ragged lengths with empty sequences (first, middle, last) and a 1-token one, an all-masked one, holes,
    mask values 0.5 and 2, a NaN log-prob on a valid token and an inf one on a masked token."""
    train, rollout, masks = random_batch(seed, num_seqs=14, max_len=30, nonfinite=True)
    masks = odd_masks(masks, seed)
    for i in (0, 7, len(train) + 2):
        train.insert(i, torch.zeros(0))
        rollout.insert(i, torch.zeros(0))
        masks.insert(i, torch.zeros(0))
    return train, rollout, masks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", PRESETS)
def test_packed_equals_list_for_every_preset(name, seed):
    train, rollout, masks = odd_batch(seed)
    weights, mask, _ = assert_same_as_list(MisConfig.preset(name, use_tis=True), train, rollout, masks)
    if weights is not None:
        assert ((mask == 0) | (mask == 0.5) | (mask == 1) | (mask == 2)).all()
        assert (weights[mask == 0] == 0).all()


@pytest.mark.parametrize("config", [
    MisConfig(use_tis=True, rs_batch_gate={"k3": 1e-6}),  # fires: every weight and mask 0
    MisConfig(use_tis=True, rs_batch_gate={"kl": 10.0, "max_abs_log_ratio": 50.0}),  # does not fire
    MisConfig(use_tis=True, rs_divergence={"token_k2": 0.1, "seq_mean_k1": [0.9, 1.1], "seq_max_k3": 0.5}),
    MisConfig(use_tis=True, metrics_low_prob_threshold=0.5, tis_level="geometric", tis_mode="mask"),
], ids=["gate-fires", "gate-quiet", "divergence", "geometric-low-prob"])
def test_packed_equals_list_beyond_the_presets(config):
    train, rollout, masks = odd_batch(5)
    weights, mask, metrics = assert_same_as_list(config, train, rollout, masks)
    if config.rs_batch_gate == (("k3", 1e-6),):
        assert not weights.any() and not mask.any() and bool((metrics["mis_batch_gated"] == 1).all())


def test_the_odd_batch_holds_what_it_promises():
    train, rollout, masks = odd_batch(0)
    lengths = [t.numel() for t in train]
    assert lengths[0] == lengths[7] == lengths[-1] == 0 and 1 in lengths
    assert any(torch.isnan(t).any() for t in train) and any(torch.isinf(r).any() for r in rollout)
    flat = torch.cat(masks)
    assert (flat == 0.5).any() and (flat == 2).any() and (flat == 0).any()
    assert any(m.numel() and not m.any() for m in masks)  # an all-masked sequence


@pytest.mark.parametrize("config", [MisConfig(use_tis=False), MisConfig.preset("metrics_only")],
                         ids=["use_tis-false", "metrics_only-preset"])
def test_metrics_only_returns_no_weights_and_the_input_mask(config):
    train, rollout, masks = random_batch(4, nonfinite=True)
    masks = odd_masks(masks, 4)
    inputs = packed(train, rollout, masks)
    weights, mask, metrics = assert_same_as_list(config, train, rollout, masks)
    assert weights is None
    assert torch.equal(mask, inputs["loss_mask"])
    assert "mis_kl" in metrics and "mis_tis_weight_before_bound" not in metrics
    # a new tensor: the host may change it without changing its own mask
    again = compute_mis_weights_packed(config, **inputs)[1]
    assert again.data_ptr() != inputs["loss_mask"].data_ptr()


def test_a_namespace_config_gives_the_same_result_as_the_misconfig(repo_root):
    import yaml

    args = argparse.Namespace(use_tis=True, tis_clip=2.0, qkv_format="thd")
    for key, value in yaml.safe_load((repo_root / "configs" / "mis.yaml").read_text()).items():
        setattr(args, key, value)
    train, rollout, masks = random_batch(5)
    inputs = packed(train, rollout, masks)
    a = compute_mis_weights_packed(args, **inputs)
    b = compute_mis_weights_packed(DEFAULT, **inputs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in b[2])


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0], [1], [0, 1, 0, 2, 0]])
def test_empty_batches_and_sequences(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    train = [-torch.rand(n, generator=gen) for n in lengths]
    rollout = [t - 0.1 for t in train]
    masks = [torch.ones(n) for n in lengths]
    weights, mask, metrics = assert_same_as_list(DEFAULT, train, rollout, masks)
    assert weights.shape == mask.shape == (sum(lengths),)
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64, torch.bfloat16])
def test_the_mask_keeps_its_dtype(dtype):
    train, rollout, masks = random_batch(6)
    masks = [m.to(dtype) for m in masks]
    weights, mask, _ = assert_same_as_list(DEFAULT, train, rollout, masks)
    assert mask.dtype == dtype


def test_inputs_are_not_modified_and_outputs_carry_no_graph():
    train, rollout, masks = random_batch(7, nonfinite=True)
    inputs = packed(train, rollout, odd_masks(masks, 7))
    inputs["train_log_probs"].requires_grad_(True)
    before = {k: v.detach().clone() for k, v in inputs.items()}
    weights, mask, metrics = compute_mis_weights_packed(DEFAULT, **inputs)
    for name, value in inputs.items():
        torch.testing.assert_close(value.detach(), before[name], rtol=0, atol=0, equal_nan=True, msg=name)
    assert not weights.requires_grad and not mask.requires_grad
    assert not any(v.requires_grad for v in metrics.values())


def test_exported():
    assert miles_mis.compute_mis_weights_packed is compute_mis_weights_packed
    assert "compute_mis_weights_packed" in miles_mis.__all__


# --------------------------------------------------------------------------- input checks
class _Elsewhere(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (a second device, without a GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _quantized(n):
    with warnings.catch_warnings():  # quantized tensors are deprecated, but a host may still pass one
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(n), 0.1, 0, torch.qint8)


def _nested():
    with warnings.catch_warnings():  # the strided nested layout is a prototype: a host may still pass one
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


def good_inputs():
    """5 tokens in 3 sequences of 2, 0 and 3 tokens."""
    train = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3])
    return dict(train_log_probs=train, rollout_log_probs=train - 0.05, loss_mask=torch.ones(5),
                cu_seqlens=torch.tensor([0, 2, 2, 5]))


BAD = [
    ("train_log_probs", None, r"^train_log_probs is None: the host must pass"),
    ("rollout_log_probs", None, r"^rollout_log_probs is None: the host must return rollout log-probs"),
    ("train_log_probs", [torch.zeros(2), torch.zeros(3)],
     r"^train_log_probs is a list: the packed entry point takes one flat tensor \(per-sequence lists: "
     r"compute_mis_weights\)"),
    ("loss_mask", [1.0] * 5, r"^loss_mask is a list: the packed entry point takes one flat tensor"),
    ("rollout_log_probs", "x", r"^rollout_log_probs is a str, not a tensor"),
    ("train_log_probs", torch.zeros(1, 5), r"^train_log_probs has shape \(1, 5\): expected a flat 1-D \[N\] tensor"),
    ("loss_mask", torch.tensor(1.0), r"^loss_mask has shape \(\): expected a flat 1-D \[N\] tensor"),
    ("rollout_log_probs", torch.zeros(4), r"^train_log_probs has 5 tokens, rollout_log_probs has 4, loss_mask has 5: "
                                          r"the flat tensors must have equal lengths"),
    ("loss_mask", torch.ones(6), r"^train_log_probs has 5 tokens, rollout_log_probs has 5, loss_mask has 6"),
    ("train_log_probs", torch.zeros(5).to_sparse(), r"^train_log_probs is a sparse_coo tensor: dense tensors only"),
    ("loss_mask", torch.ones(5).to_sparse(), r"^loss_mask is a sparse_coo tensor: dense tensors only"),
    ("rollout_log_probs", _quantized(5), r"^rollout_log_probs is a quantized tensor \(torch.qint8\)"),
    ("train_log_probs", torch.empty(5, device="meta"), r"^train_log_probs is on the meta device"),
    ("loss_mask", torch.ones(5, device="meta"), r"^loss_mask is on the meta device"),
    ("train_log_probs", _nested(), r"^train_log_probs is a nested tensor"),
    ("rollout_log_probs", torch.zeros(5).as_subclass(_Elsewhere),
     r"^rollout_log_probs is on cuda:0 but train_log_probs is on cpu: all inputs on one device"),
    ("loss_mask", torch.ones(5).as_subclass(_Elsewhere), r"^loss_mask is on cuda:0 but train_log_probs is on cpu"),
    ("cu_seqlens", torch.tensor([0, 2, 2, 5]).as_subclass(_Elsewhere), r"^cu_seqlens is on cuda:0 but train_log_probs"),
    ("train_log_probs", torch.zeros(5, dtype=torch.complex64), r"^train_log_probs has dtype torch.complex64: log-probs "
                                                               r"are real"),
    ("loss_mask", torch.ones(5, dtype=torch.complex64), r"^loss_mask has dtype torch.complex64: masks are real"),
    ("loss_mask", torch.tensor([1.0, 1.0, 1.0, math.nan, 1.0]),
     r"^sequence 2: loss_mask\[3\]=nan is not finite: masks are finite weights"),
    ("loss_mask", torch.tensor([math.inf, 1.0, 1.0, 1.0, 1.0]), r"^sequence 0: loss_mask\[0\]=inf is not finite"),
    ("loss_mask", torch.tensor([1.0, 1.0, 1.0, 1.0, -math.inf]), r"^sequence 2: loss_mask\[4\]=-inf is not finite"),
    ("cu_seqlens", [0, 2, 2, 5], r"^cu_seqlens is a list: the packed entry point takes one flat tensor"),
    ("cu_seqlens", torch.tensor([0.0, 2.0, 2.0, 5.0]), r"^cu_seqlens has dtype torch.float32: expected integer "
                                                       r"offsets \(int32, as flash-attention and Megatron"),
    ("cu_seqlens", torch.tensor([False, True, True, True]), r"^cu_seqlens has dtype torch.bool: expected integer"),
    ("cu_seqlens", torch.tensor([[0, 2, 2, 5]]), r"^cu_seqlens has shape \(1, 4\): expected a 1-D \[B\+1\] tensor"),
    ("cu_seqlens", torch.zeros(0, dtype=torch.long), r"^cu_seqlens is empty: expected B\+1 offsets, \[0\] for no "
                                                     r"sequence"),
    ("cu_seqlens", torch.tensor([1, 2, 2, 5]), r"^cu_seqlens\[0\]=1: the offsets start at 0"),
    ("cu_seqlens", torch.tensor([0, 2, 1, 5]), r"^sequence 1: cu_seqlens decreases from cu_seqlens\[1\]=2 to "
                                               r"cu_seqlens\[2\]=1: the offsets must be non-decreasing"),
    ("cu_seqlens", torch.tensor([0, 2, 2, 5, 4, 5]), r"^sequence 3: cu_seqlens decreases from cu_seqlens\[3\]=5"),
    ("cu_seqlens", torch.tensor([0, 2, 2, 4]), r"^cu_seqlens\[-1\]=4 but the flat tensors hold 5 tokens: the last "
                                               r"offset is the number of tokens N"),
    ("cu_seqlens", torch.tensor([0, 2, 2, 6]), r"^cu_seqlens\[-1\]=6 but the flat tensors hold 5 tokens"),
    ("cu_seqlens", torch.tensor([0]), r"^cu_seqlens\[-1\]=0 but the flat tensors hold 5 tokens"),
]


@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_named(name, value, message):
    inputs = dict(good_inputs(), **{name: value})
    with pytest.raises(InputError, match=message) as caught:
        compute_mis_weights_packed(DEFAULT, **inputs)
    assert isinstance(caught.value, ValueError)
    sequence = message.split(":")[0].removeprefix("^sequence ")
    assert caught.value.sequence_index == (int(sequence) if sequence.isdigit() else -1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_any_integer_cu_seqlens_gives_the_int64_result(dtype):
    """int32 is the cu_seqlens of flash-attention and Megatron's packed sequences: the same result as int64."""
    train, rollout, masks = odd_batch(3)
    inputs = packed(train, rollout, masks)
    want = compute_mis_weights_packed(DEFAULT, **inputs)
    got = compute_mis_weights_packed(DEFAULT, **dict(inputs, cu_seqlens=inputs["cu_seqlens"].to(dtype)))
    assert inputs["cu_seqlens"].dtype == torch.int64 and int(inputs["cu_seqlens"][-1]) < 256
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert sorted(got[2]) == sorted(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=0, equal_nan=True)


def test_the_good_inputs_pass():
    weights, mask, _ = compute_mis_weights_packed(DEFAULT, **good_inputs())
    assert weights.shape == mask.shape == (5,)


def test_integer_and_bool_masks_skip_the_finiteness_check():
    inputs = dict(good_inputs(), loss_mask=torch.tensor([1, 0, 1, 1, 1]))
    assert compute_mis_weights_packed(DEFAULT, **inputs)[1].tolist() == [1, 0, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_finite_mask_values_whose_sum_overflows_are_accepted(dtype):
    """The cheap finiteness check is a sum: an overflowing sum of finite values must not be an error."""
    huge = torch.finfo(dtype).max / 2
    inputs = dict(good_inputs(), loss_mask=torch.tensor([huge, huge, 1.0, huge, 0.0], dtype=dtype))
    mask = compute_mis_weights_packed(MisConfig(use_tis=False), **inputs)[1]
    assert torch.equal(mask, inputs["loss_mask"])
    lists = [inputs[k].split([2, 0, 3]) for k in ("train_log_probs", "rollout_log_probs", "loss_mask")]
    list_masks = compute_mis_weights(MisConfig(use_tis=False), train_log_probs=list(lists[0]),
                                     rollout_log_probs=list(lists[1]), loss_masks=list(lists[2]))[1]
    assert torch.equal(torch.cat(list_masks), mask)


def test_a_config_error_is_a_value_error():
    with pytest.raises(ValueError, match="tis_mode"):
        compute_mis_weights_packed(argparse.Namespace(use_tis=True, tis_mode="trunc"), **good_inputs())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_packed_equals_list_and_a_cpu_input_is_named():
    train, rollout, masks = odd_batch(3)
    to_gpu = lambda seqs: [t.cuda() for t in seqs]  # noqa: E731
    weights, mask, metrics = assert_same_as_list(DEFAULT, to_gpu(train), to_gpu(rollout), to_gpu(masks))
    assert weights.is_cuda and mask.is_cuda and all(v.is_cuda for v in metrics.values())
    inputs = {k: v.cuda() for k, v in good_inputs().items()}
    with pytest.raises(InputError, match=r"^cu_seqlens is on cpu but train_log_probs is on cuda:0"):
        compute_mis_weights_packed(DEFAULT, **dict(inputs, cu_seqlens=inputs["cu_seqlens"].cpu()))
    with pytest.raises(InputError, match=r"^sequence 1: cu_seqlens decreases"):
        compute_mis_weights_packed(DEFAULT, **dict(inputs, cu_seqlens=torch.tensor([0, 3, 2, 5], device="cuda")))


# --------------------------------------------------------------------------- no Python loop over sequences
def ops_per_packed_call(config, num_seqs):
    gen = torch.Generator().manual_seed(num_seqs)
    lengths = torch.randint(0, 40, (num_seqs,), generator=gen).tolist()
    train = [-torch.rand(n, generator=gen) for n in lengths]
    rollout = [t + 0.05 * torch.randn(t.shape, generator=gen) for t in train]
    inputs = packed(train, rollout, [torch.ones(n) for n in lengths])
    return count_aten_ops(lambda: compute_mis_weights_packed(config, **inputs))


@pytest.mark.parametrize("config", OP_COUNT_CONFIGS, ids=OP_COUNT_IDS)
def test_packed_op_count_does_not_grow_with_batch_size(config):
    ops_per_packed_call(config, 8)  # the first call of a process builds cached constants (ops.constant): not counted
    assert ops_per_packed_call(config, 8) == ops_per_packed_call(config, 64) == ops_per_packed_call(config, 512)


# --------------------------------------------------------------------------- property
log_prob = st.one_of(st.floats(-30.0, 0.0, width=32), st.sampled_from([-1000.0, 0.0, -1e-6, math.nan, -math.inf]))


@st.composite
def ragged_batches(draw):
    lengths = draw(st.lists(st.integers(0, 10), min_size=0, max_size=7))
    train, rollout, masks = [], [], []
    for n in lengths:
        t = draw(st.lists(log_prob, min_size=n, max_size=n))
        shift = draw(st.floats(-3.0, 3.0, width=32))
        r = [x + shift * random.Random(i).random() for i, x in enumerate(t)] if draw(st.booleans()) else \
            draw(st.lists(log_prob, min_size=n, max_size=n))
        m = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, 0.5, 2.0]), min_size=n, max_size=n))
        train.append(torch.tensor(t, dtype=torch.float32))
        rollout.append(torch.tensor(r, dtype=torch.float32))
        masks.append(torch.tensor(m, dtype=torch.float32))
    return train, rollout, masks


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(PRESETS), ragged_batches())
def test_property_packed_equals_list(name, batch):
    assert_same_as_list(MisConfig.preset(name, use_tis=True), *batch)
