"""Split rollouts (miles_mis/inputs/rollouts.py): samples sharing a rollout id are one sequence for every sequence-level
stage. Hand cases, the rollout as one concatenated sequence (a property test), every entry point, CP against cp = 1,
incomplete rollouts counted, and bad ids named."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from cp_harness import cp_state, make_full_batch, shard, spawn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp import check_case

from miles_mis import MisConfig, compute_mis_weights, compute_mis_weights_packed, compute_mis_weights_with_cp
from miles_mis.inputs.packing import InputError

SEQUENCE_TIS = MisConfig(use_tis=True, tis_level="sequence", tis_mode="truncate", tis_upper_bound=2.0)


def two_fragments():
    """One rollout cut into two samples: ℓ = +0.1 on sample 0's token, −0.25 on sample 1's (float64, exact sums)."""
    train = [torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)]
    rollout = [torch.tensor([-1.1], dtype=torch.float64), torch.tensor([-1.75], dtype=torch.float64)]
    return dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=[torch.ones(1), torch.ones(1)])


def test_hand_case_sequence_and_geometric_weights_are_the_rollouts():
    inputs = two_fragments()
    weights, _, _ = compute_mis_weights(SEQUENCE_TIS, **inputs)
    # per sample: e^0.1 = 1.105 and e^−0.25 = 0.779, each a fragment's ratio
    assert [float(w) for w in torch.cat(weights)] == pytest.approx([math.exp(0.1), math.exp(-0.25)], rel=1e-6)
    weights, _, metrics = compute_mis_weights(SEQUENCE_TIS, rollout_ids=[7, 7], **inputs)
    # the rollout as one sequence: e^(0.1 − 0.25) = 0.861 on both
    assert [float(w) for w in torch.cat(weights)] == pytest.approx([math.exp(-0.15)] * 2, rel=1e-6)
    assert torch.cat(metrics["mis_rollout_split_fraction"]).tolist() == [1.0, 1.0]
    geometric = MisConfig(use_tis=True, tis_level="geometric", tis_mode="truncate", tis_upper_bound=2.0)
    weights, _, _ = compute_mis_weights(geometric, rollout_ids=[7, 7], **inputs)
    assert [float(w) for w in torch.cat(weights)] == pytest.approx([math.exp(-0.075)] * 2, rel=1e-6)


def test_hand_case_sequence_rejection_takes_the_whole_rollout():
    """Geometric RS [0.9, 1.1]: alone, sample 0 (e^0.1 = 1.105) is out and sample 1 (e^−0.25) too; with a third
    sample at ℓ = +0.15 in the same rollout, the mean ℓ is 0: all three kept. Sample 3, its own rollout, stays
    out."""
    train = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.0]), torch.tensor([-1.0])]
    rollout = [torch.tensor([-1.1]), torch.tensor([-1.75]), torch.tensor([-1.15]), torch.tensor([-1.5])]
    masks = [torch.ones(1) for _ in train]
    config = MisConfig(use_tis=True, tis_level="token", use_rs=True, rs_level="geometric", rs_lower_bound=0.9,
                       rs_upper_bound=1.1)
    _, alone, _ = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert torch.cat(alone).tolist() == [0.0, 0.0, 0.0, 0.0]
    _, grouped, _ = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                        rollout_ids=["a", "a", "a", "b"])
    assert torch.cat(grouped).tolist() == [1.0, 1.0, 1.0, 0.0]


def test_the_veto_of_one_fragment_rejects_its_siblings():
    # sample 1's token has ℓ = −12 + 1 = −11 < ln 1e-4 = −9.2: the veto fires on its rollout (samples 0 and 1)
    train = [torch.tensor([-1.0, -1.0]), torch.tensor([-12.0]), torch.tensor([-1.0])]
    rollout = [torch.tensor([-1.0, -1.0]), torch.tensor([-1.0]), torch.tensor([-1.0])]
    masks = [torch.ones(2), torch.ones(1), torch.ones(1)]
    config = MisConfig(use_tis=True, rs_veto_threshold=1e-4)
    _, alone, _ = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert [m.tolist() for m in alone] == [[1.0, 1.0], [0.0], [1.0]]
    _, grouped, _ = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                        rollout_ids=torch.tensor([3, 3, 4]))
    assert [m.tolist() for m in grouped] == [[0.0, 0.0], [0.0], [1.0]]


def test_distinct_ids_change_nothing_but_the_split_metric():
    full, _ = make_full_batch(seed=3, num_seqs=7)
    inputs = {k: full[k] for k in ("train_log_probs", "rollout_log_probs", "loss_masks")}
    config = MisConfig.preset("seq_tis", use_tis=True)
    want = compute_mis_weights(config, **inputs)
    got = compute_mis_weights(config, rollout_ids=list(range(10, 17)), **inputs)
    for a, b in zip(torch.cat(want[0]), torch.cat(got[0])):
        assert a == b
    assert set(got[2]) - set(want[2]) == {"mis_rollout_split_fraction"}
    for name in want[2]:
        assert torch.equal(torch.cat(want[2][name]), torch.cat(got[2][name])), name


# --------------------------------------------------------------------------- the rollout as one sequence
SEQUENCE_LEVEL_CONFIGS = [
    MisConfig.preset("seq_tis", use_tis=True),
    MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25),
    MisConfig(use_tis=True, tis_level="sequence", tis_mode="clip", use_rs=True, rs_level="geometric",
              rs_lower_bound=0.95, rs_upper_bound=1.05, rs_veto_threshold=1e-3, tis_batch_normalize=True),
    MisConfig(use_tis=True, rs_divergence={"seq_mean_k3": 0.02, "seq_max_k2": 0.5}),
    MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto"),
    MisConfig(use_tis=False),
]
# per position bucket (where the mismatch lives): a split sample's positions restart at 0, the concatenation's do not
POSITIONAL = ("k3_first_token", "k3_position_0_1", "k3_position_1_16", "k3_position_16_128", "k3_position_128_1024",
              "k3_position_1024_8192", "k3_position_8192_inf")


def concatenated(train, rollout, masks, group):
    """Each group's samples joined into one sequence (groups by first appearance, samples in batch order), and the
    permutation taking the joined tokens back to the batch's token order."""
    order = sorted(range(len(train)), key=lambda i: (group[i], i))
    starts = torch.tensor([0] + [t.numel() for t in train]).cumsum(0)
    token_order = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in order] or [torch.zeros(0)])
    join = lambda values, members: torch.cat([values[i] for i in members]) if members else torch.zeros(0)  # noqa
    groups = sorted(set(group))
    members = [[i for i in order if group[i] == g] for g in groups]
    back = torch.empty_like(token_order.long())
    back[token_order.long()] = torch.arange(token_order.numel())
    return ([join(train, m) for m in members], [join(rollout, m) for m in members], [join(masks, m) for m in members],
            back)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_rollouts=st.integers(1, 5),
       config_index=st.integers(0, len(SEQUENCE_LEVEL_CONFIGS) - 1))
def test_property_a_split_rollout_equals_the_rollout_as_one_sequence(seed, num_rollouts, config_index):
    config = SEQUENCE_LEVEL_CONFIGS[config_index]
    full, _ = make_full_batch(seed=seed, num_seqs=8, max_response=12)
    gen = torch.Generator().manual_seed(seed)
    group = torch.randint(0, num_rollouts, (8,), generator=gen)
    first = {int(g): i for i, g in reversed(list(enumerate(group.tolist())))}
    ranked = sorted(first, key=first.get)
    group = [ranked.index(int(g)) for g in group]  # numbered by first appearance
    train, rollout, masks = full["train_log_probs"], full["rollout_log_probs"], full["loss_masks"]
    weights, out_masks, metrics = compute_mis_weights(config, train_log_probs=train, rollout_log_probs=rollout,
                                                      loss_masks=masks, rollout_ids=[100 + g for g in group])
    j_train, j_rollout, j_masks, back = concatenated(train, rollout, masks, group)
    j_weights, j_out_masks, j_metrics = compute_mis_weights(config, train_log_probs=j_train,
                                                            rollout_log_probs=j_rollout, loss_masks=j_masks)
    flat = lambda values: torch.cat(values) if values else torch.zeros(0)  # noqa: E731
    if weights is None:
        assert j_weights is None
    else:
        torch.testing.assert_close(flat(weights), flat(j_weights)[back], rtol=1e-5, atol=1e-7)
    assert torch.equal(flat(out_masks), flat(j_out_masks)[back])
    for name, values in j_metrics.items():
        if name.removeprefix("mis_") in POSITIONAL:
            continue
        torch.testing.assert_close(flat(metrics[name]), flat(values)[back], rtol=1e-5, atol=1e-6, msg=name)


def test_the_packed_and_cp_entry_points_group_as_the_list_one():
    full, pg_loss = make_full_batch(seed=11, num_seqs=6)
    ids = [5, 1, 5, 2, 1, 5]
    config = MisConfig.preset("seq_tis", use_tis=True)
    inputs = {k: full[k] for k in ("train_log_probs", "rollout_log_probs", "loss_masks")}
    weights, masks, metrics = compute_mis_weights(config, rollout_ids=ids, **inputs)
    lengths = full["response_lengths"]
    packed = compute_mis_weights_packed(config, train_log_probs=torch.cat(inputs["train_log_probs"]),
                                        rollout_log_probs=torch.cat(inputs["rollout_log_probs"]),
                                        loss_mask=torch.cat(inputs["loss_masks"]),
                                        cu_seqlens=torch.tensor([0] + lengths).cumsum(0), rollout_ids=ids)
    assert torch.equal(packed[0], torch.cat(weights)) and torch.equal(packed[1], torch.cat(masks))
    loss, cp_masks, cp_metrics = compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict()), pg_loss=pg_loss,
                                                             rollout_ids=ids, **full)
    torch.testing.assert_close(loss, pg_loss * torch.cat(weights))
    assert all(torch.equal(a, b) for a, b in zip(cp_masks, masks))
    assert sorted(cp_metrics) == sorted(metrics) == sorted(packed[2])


# --------------------------------------------------------------------------- incomplete rollouts
def test_a_rollout_with_tokens_outside_the_call_is_counted():
    inputs = two_fragments()
    # the rollout holds 2 trained tokens here; rollout_mask_sums says 5 (3 more in another micro-batch)
    _, _, metrics = compute_mis_weights(SEQUENCE_TIS, rollout_ids=[7, 7], rollout_mask_sums=[5.0, 5.0], **inputs)
    assert torch.cat(metrics["mis_rollout_incomplete_fraction"]).tolist() == [1.0, 1.0]
    _, _, metrics = compute_mis_weights(SEQUENCE_TIS, rollout_ids=[7, 8], rollout_mask_sums=torch.tensor([1.0, 4.0]),
                                        **inputs)
    assert torch.cat(metrics["mis_rollout_incomplete_fraction"]).tolist() == [0.0, 1.0]
    assert torch.cat(metrics["mis_rollout_split_fraction"]).tolist() == [0.0, 0.0]


def test_numpy_ids_and_counts_as_a_host_stores_them():
    """miles keeps rollout ids and counts in int64 / float arrays: numpy arrays and numpy scalars are taken."""
    import numpy as np

    inputs = two_fragments()
    want = compute_mis_weights(SEQUENCE_TIS, rollout_ids=[7, 7], rollout_mask_sums=[2.0, 2.0], **inputs)
    for ids, sums in ((np.array([7, 7]), np.array([2.0, 2.0])), ([np.int64(7), np.int64(7)], [np.float32(2.0)] * 2),
                      (torch.tensor([7, 7]), [torch.tensor(2.0), torch.tensor(2.0)])):
        got = compute_mis_weights(SEQUENCE_TIS, rollout_ids=ids, rollout_mask_sums=sums, **inputs)
        assert torch.equal(torch.cat(got[0]), torch.cat(want[0])), (type(ids), type(sums))
        assert torch.equal(torch.cat(got[2]["mis_rollout_incomplete_fraction"]), torch.zeros(2))


def test_without_ids_the_mask_sums_alone_flag_fragments():
    """miles' and slime's loss batches hold rollout_mask_sums but not the ids: a sample holding fewer trained tokens
    than its rollout is a fragment, counted; nothing is grouped (the weights are the per-sample ones)."""
    inputs = two_fragments()
    alone, _, _ = compute_mis_weights(SEQUENCE_TIS, **inputs)
    weights, _, metrics = compute_mis_weights(SEQUENCE_TIS, rollout_mask_sums=[2.0, 1.0], **inputs)
    assert torch.cat(metrics["mis_rollout_incomplete_fraction"]).tolist() == [1.0, 0.0]
    assert "mis_rollout_split_fraction" not in metrics
    assert torch.equal(torch.cat(weights), torch.cat(alone))


@pytest.mark.parametrize("kwargs, message", [
    ({"rollout_ids": [7]}, r"^rollout_ids has 1 entries but the batch has 2 sequences"),
    ({"rollout_ids": "77"}, r"^rollout_ids is a str: expected B ids"),
    ({"rollout_ids": torch.tensor([7.0, 7.0])}, r"^rollout_ids is a torch.float32 tensor of shape \(2,\)"),
    ({"rollout_ids": [7, 1.5]}, r"^sequence 1: rollout_ids\[1\]=1.5 is invalid: allowed values are integers or "
                                r"strings"),
    ({"rollout_ids": [True, 7]}, r"^sequence 0: rollout_ids\[0\]=True is invalid"),
    ({"rollout_ids": [7, "7"]}, r"^rollout_ids mixes integers and strings"),
    ({"rollout_ids": [7, 7], "rollout_mask_sums": [2.0, 3.0]},
     r"^sequence 1: rollout_mask_sums\[1\]=3.0 differs from the first sample of its rollout \(sequence 0: 2.0\)"),
    ({"rollout_ids": [7, 7], "rollout_mask_sums": [1.0, 1.0]},
     r"^sequence 0: its rollout's samples hold 2 trained tokens in this call but rollout_mask_sums\[0\]=1"),
    ({"rollout_ids": [7, 8], "rollout_mask_sums": [1.0, math.nan]},
     r"^sequence 1: rollout_mask_sums\[1\]=nan is invalid: a trained-token count is finite and >= 0"),
    ({"rollout_ids": [7, 8], "rollout_mask_sums": [1.0]}, r"^rollout_mask_sums has 1 entries but the batch has 2"),
])
def test_bad_rollout_inputs_are_named(kwargs, message):
    with pytest.raises(InputError, match=message) as caught:
        compute_mis_weights(SEQUENCE_TIS, **two_fragments(), **kwargs)
    assert "\n" not in str(caught.value)
    first = message.removeprefix("^sequence ").split(":")[0]
    assert caught.value.sequence_index == (int(first) if first.isdigit() else -1)


# --------------------------------------------------------------------------- context parallel
def rollouts_cp_worker(rank, size):
    configs = SEQUENCE_LEVEL_CONFIGS + [MisConfig.preset("mis", use_tis=True)]
    for case, config in enumerate(configs):
        fmt = "thd" if case % 2 == 0 else "bshd"
        full, pg_loss = make_full_batch(seed=90 * size + case, num_seqs=9, fmt=fmt)
        ids = [3, 1, 3, 2, 1, 3, 9, 2, 2]
        check_case(rank, size, config, dict(full, rollout_ids=ids), pg_loss, fmt)
        sums = []  # the rollouts' in-call counts, one of them short of its whole (incomplete)
        for i, rid in enumerate(ids):
            sums.append(sum(float(full["loss_masks"][j].sum()) for j, other in enumerate(ids) if other == rid)
                        + (4.0 if rid == 2 else 0.0))
        check_case(rank, size, config, dict(full, rollout_ids=ids, rollout_mask_sums=sums), pg_loss, fmt)
    # the ranks disagree on the grouping: every rank raises, naming the column
    full, pg_loss = make_full_batch(seed=5, num_seqs=4)
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    ids = [1, 1, 2, 3] if rank == 0 else [1, 2, 2, 3]
    with pytest.raises(ValueError, match=r"sequence 1: context-parallel ranks disagree .*rollout_group"):
        compute_mis_weights_with_cp(SimpleNamespace(use_tis=True, qkv_format="thd", tis_level="sequence"),
                                    pg_loss=local_pg, parallel_state=cp_state(rank, size), rollout_ids=ids, **kwargs)
    # one rank passes the counts, the others nothing: every rank stops, naming the difference (not a collective
    # of mismatched sizes)
    sums = [float(m.sum()) for m in full["loss_masks"]]
    with pytest.raises(ValueError, match=r"rollout_inputs: cp rank 0 has 'none', cp rank 1 has 'mask_sums'"):
        compute_mis_weights_with_cp(SimpleNamespace(use_tis=True, qkv_format="thd"), pg_loss=local_pg,
                                    parallel_state=cp_state(rank, size),
                                    **dict(kwargs, **({"rollout_mask_sums": sums} if rank else {})))
    # one rank's ids are bad: every rank raises the same one-line error
    ids = [1, 1, 2] if rank == size - 1 else [1, 1, 2, 3]
    with pytest.raises(ValueError, match=r"rollout_ids has 3 entries but the batch has 4 sequences"):
        compute_mis_weights_with_cp(SimpleNamespace(use_tis=True, qkv_format="thd"), pg_loss=local_pg,
                                    parallel_state=cp_state(rank, size), rollout_ids=ids, **kwargs)


@pytest.mark.parametrize("size", [2, 3])
def test_split_rollouts_under_cp_equal_cp1(size):
    spawn(rollouts_cp_worker, size, timeout=300)
