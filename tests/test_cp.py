"""Context parallel on real gloo process groups: every level x mode x RS x veto x normalise combination,
thd and bshd, equals the cp = 1 result; disagreements between ranks raise on every rank.

One spawn per CP size runs all of its cases (process start is the expensive part).
"""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from cp_harness import assert_close, cp_state, host_mean, local_positions, make_full_batch, shard, spawn

from miles_mis import MisConfig, compute_mis_weights_with_cp

LEVELS = ("token", "sequence", "geometric")
BOUNDS = {"token": (0.8, 1.25), "sequence": (0.5, 2.0), "geometric": (0.93, 1.07)}


def all_configs():
    for tis_level, mode, (use_rs, rs_level), veto, normalize in itertools.product(
            LEVELS, ("truncate", "clip", "mask", "icepop"),
            [(False, "token"), (True, "token"), (True, "sequence"), (True, "geometric")], [None, 0.75], [False, True]):
        yield MisConfig(use_tis=True, tis_level=tis_level, tis_mode=mode, use_rs=use_rs, rs_level=rs_level,
                        tis_lower_bound=BOUNDS[tis_level][0], tis_upper_bound=BOUNDS[tis_level][1],
                        rs_lower_bound=BOUNDS[rs_level][0], rs_upper_bound=BOUNDS[rs_level][1],
                        rs_veto_threshold=veto, tis_batch_normalize=normalize)
    yield MisConfig(use_tis=False, use_rs=True, rs_veto_threshold=1e-4)
    # divergence rejection, the sequence options above all (their statistics cross the CP ranks)
    for option, threshold in (("seq_sum_k1", [0.6, 1.6]), ("seq_mean_k1", [0.95, 1.05]), ("seq_sum_k2", 0.1),
                              ("seq_mean_k2", 0.01), ("seq_sum_k3", 0.1), ("seq_mean_k3", 0.01), ("seq_max_k2", 0.05),
                              ("seq_max_k3", 0.05), ("token_k1", [0.8, 1.25]), ("token_k3", 0.02),
                              # in probability space: their per-sequence sums and maxima cross the ranks too
                              ("seq_mean_tv", [-0.01, 0.01]), ("seq_max_bkl", 0.02), ("seq_sum_bkl", 0.05),
                              ("token_atv", 0.05), ("token_tv", [-0.05, 0.04])):
        yield MisConfig(use_tis=True, tis_level="geometric", tis_lower_bound=0.93, tis_upper_bound=1.07,
                        tis_batch_normalize=True, rs_veto_threshold=0.75, rs_divergence={option: threshold})
    yield MisConfig(use_tis=True, use_rs=True, rs_divergence={"token_k2": 0.02, "seq_mean_k1": "0.95_1.05",
                                                             "seq_max_k3": 0.05})
    # the batch gate over every CP rank's tokens: fired (k3 ~ 1e-2 here) and not
    yield MisConfig(use_tis=True, rs_batch_gate={"k3": 1e-6}, tis_batch_normalize=True)
    yield MisConfig(use_tis=True, rs_batch_gate={"k3": 10.0, "max_abs_log_ratio": 50.0})
    # the adaptive bound: every rank must pick the bound cp = 1 picks (inside the range on these batches)
    yield MisConfig(use_tis=True, tis_upper_bound="auto", tis_auto_bounds=[1.0, 2.0], tis_auto_target_ess=0.99,
                    use_rs=True, rs_lower_bound=0.7, rs_upper_bound=1.6, rs_veto_threshold=0.5,
                    tis_batch_normalize=True)
    yield MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto", tis_auto_target_ess=0.75)
    yield MisConfig(use_tis=True, tis_level="geometric", tis_upper_bound="auto", tis_auto_bounds=[1.0, 1.2],
                    tis_auto_target_ess=0.999, rs_divergence={"token_k3": 0.05})


def check_case(rank, size, config, full, pg_loss, fmt, group=None, ps=None):
    """This rank's shard result equals the cp = 1 result: loss, masks at owned positions, reduced metrics."""
    args = SimpleNamespace(**config.to_dict(), qkv_format=fmt)
    ref_loss, ref_masks, ref_metrics = compute_mis_weights_with_cp(args, pg_loss=pg_loss,
                                                                   parallel_state=cp_state(0, 1), **full)
    kwargs, local_pg, positions = shard(full, pg_loss, rank, size, fmt)
    loss, masks, metrics = compute_mis_weights_with_cp(
        args, pg_loss=local_pg, parallel_state=ps or cp_state(rank, size, group), **kwargs)
    torch.testing.assert_close(loss, ref_loss[positions], rtol=1e-5, atol=1e-6)
    # the WHOLE masks, every position of every sequence (not only this rank's): identical on every rank and
    # equal to cp = 1, values and dtype (a host reducer may divide each sequence by the whole mask's sum)
    assert len(masks) == len(ref_masks)
    for i, (mask, ref_mask) in enumerate(zip(masks, ref_masks)):
        assert mask.dtype == ref_mask.dtype and torch.equal(mask, ref_mask), (
            f"cp rank {rank} of {size}, sequence {i}: mask {mask.tolist()} but cp 1 gives {ref_mask.tolist()}")
    assert sorted(metrics) == sorted(ref_metrics)
    for name in metrics:
        assert metrics[name].shape == local_pg.shape, name
        got = host_mean(metrics[name], full["loss_masks"], full["response_lengths"], positions, group)
        want = host_mean(ref_metrics[name], full["loss_masks"], full["response_lengths"])
        assert_close(name, got, want, tol=1e-5)


def equality_worker(rank, size):
    configs = list(all_configs())
    for case, config in enumerate(configs):
        fmt = "thd" if case % 2 == 0 else "bshd"
        full, pg_loss = make_full_batch(seed=1000 * size + case, fmt=fmt)
        check_case(rank, size, config, full, pg_loss, fmt)
    # the all-zero-mask / NaN / long-sequence corners, once per format
    for fmt in ("thd", "bshd"):
        full, pg_loss = make_full_batch(seed=7, num_seqs=6, max_response=300, fmt=fmt)
        full["loss_masks"][2] = torch.zeros_like(full["loss_masks"][2])
        if full["response_lengths"][3]:
            full["train_log_probs"][3][0] = float("nan")
            full["loss_masks"][3][0] = 1.0
        check_case(rank, size, MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
                   full, pg_loss, fmt)
    # masks with values other than 1 keep them at every position (token MIS rejects some, geometric RS others)
    full, pg_loss = make_full_batch(seed=8, num_seqs=8, fmt="thd")
    gen = torch.Generator().manual_seed(8)
    full["loss_masks"] = [m * (0.5 + 1.5 * torch.randint(0, 2, m.shape, generator=gen)) for m in full["loss_masks"]]
    for config in (MisConfig(use_tis=True, tis_mode="mask", tis_lower_bound=0.85, tis_upper_bound=1.15),
                   MisConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.97,
                             rs_upper_bound=1.03)):
        check_case(rank, size, config, full, pg_loss, "thd")
        kwargs, local_pg, positions = shard(full, pg_loss, rank, size, "thd")
        _, masks, _ = compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict(), qkv_format="thd"),
                                                  pg_loss=local_pg, parallel_state=cp_state(rank, size), **kwargs)
        got, given = torch.cat(masks)[positions], torch.cat(full["loss_masks"])[positions]
        assert bool(((got == given) | (got == 0)).all()) and bool((got == given).any()) and bool((got == 0.5).any())


def fault_worker(rank, size):
    full, pg_loss = make_full_batch(seed=3, num_seqs=6)
    config = SimpleNamespace(**MisConfig(use_tis=True).to_dict(), qkv_format="thd")
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")

    def expect(message, **changes):
        call = dict(kwargs, **changes)
        with pytest.raises(ValueError, match=message):
            compute_mis_weights_with_cp(config, pg_loss=call.pop("pg_loss", local_pg),
                                        parallel_state=cp_state(rank, size), **call)

    # ranks disagree on one sequence's total length: same collective, same error everywhere
    totals = list(full["total_lengths"])
    if rank == 1:
        totals[4] += 2 * size * 50  # moves the layout: this rank's shard lengths may also no longer match
    expect(r"sequence 4|rejected their inputs", total_lengths=totals)
    # ranks disagree on the lengths of an empty response (both shards stay valid): caught by the length columns
    empty = full["response_lengths"].index(0)
    totals = list(full["total_lengths"])
    totals[empty] += rank
    expect(rf"sequence {empty}: context-parallel ranks disagree on its lengths \(cp rank 0: response_length=0, "
           rf"total_length={full['total_lengths'][empty]}", total_lengths=totals)
    # ranks disagree on the number of sequences
    if rank == 1:
        dropped = {k: (v[:-1] if isinstance(v, list) else v) for k, v in kwargs.items()}
        dropped["pg_loss"] = local_pg[:local_pg.numel() - kwargs["train_log_probs"][-1].numel()]
        expect("disagree on the number of sequences", **dropped)
    else:
        expect("disagree on the number of sequences")
    # a rank whose shard has the wrong length: it names the sequence, the others name the rank
    if rank == 0:
        bad = list(kwargs["train_log_probs"])
        bad[5] = torch.zeros(bad[5].numel() + 1)
        rollout = list(kwargs["rollout_log_probs"])
        rollout[5] = torch.zeros(rollout[5].numel() + 1)
        expect(r"sequence 5: train_log_probs has \d+ tokens on cp rank 0", train_log_probs=bad,
               rollout_log_probs=rollout, pg_loss=torch.zeros(local_pg.numel() + 1))
    else:
        expect(r"rank 0 at sequence 5")
    # after all that, the group still works
    check_case(rank, size, MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.9,
                                     tis_upper_bound=1.1), full, pg_loss, "thd")


def count_collectives_worker(rank, size):
    """Exactly two collectives per call, whatever the batch size: the fixed-size agreement header, then the
    O(B) table (bytes), with the token-level rejections when a rank has one: the cheaper of a bit per local
    token and an int32 index per rejection, rounded up to 8 bytes, sized by the largest rank."""
    from miles_mis.correction import TableSchema
    from miles_mis.parallel.distributed import HEADER_BYTES
    from miles_mis.parallel.cp_layout import zigzag_layout

    calls = []
    original = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def counting(output, tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(output, tensor, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        for num_seqs in (3, 40):
            full, pg_loss = make_full_batch(seed=num_seqs, num_seqs=num_seqs)
            kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
            before = len(calls)
            config = MisConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_veto_threshold=1e-4,
                               tis_batch_normalize=True)
            compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict()), pg_loss=local_pg,
                                        parallel_state=cp_state(rank, size), **kwargs)
            table_bytes = num_seqs * (TableSchema.of(config).width + 3) * 8
            assert calls[before:] == [HEADER_BYTES, table_bytes]
            # token-level rejections (token MIS): every rank's rejections, encoded, in the same second collective
            totals, responses = torch.tensor(full["total_lengths"]), torch.tensor(full["response_lengths"])
            tokens = max(int(zigzag_layout(totals, responses, r, size).local_lengths.sum()) for r in range(size))
            for lower, upper in ((0.999, 1.001), (0.7, 1.4)):  # most tokens rejected, then a few
                config = MisConfig(use_tis=True, tis_mode="mask", tis_lower_bound=lower, tis_upper_bound=upper)
                before = len(calls)
                _, masks, _ = compute_mis_weights_with_cp(SimpleNamespace(**config.to_dict()), pg_loss=local_pg,
                                                          parallel_state=cp_state(rank, size), **kwargs)
                dropped = (torch.cat(full["loss_masks"]) != 0) & (torch.cat(masks) == 0)  # identical on every rank
                rejected = max(int(dropped[shard(full, pg_loss, r, size, "thd")[2]].sum()) for r in range(size))
                assert rejected > 0 or upper > 1.01  # the tight band rejects; the loose one may not, at B = 3
                words = lambda size_in_bytes: -(-size_in_bytes // 8) * 8  # noqa: E731
                extra = min(words(-(-tokens // 8)), words(4 * rejected))  # 0 when no rank rejected a token
                assert calls[before:] == [HEADER_BYTES, table_bytes + extra], (lower, rejected, calls[before:])
    finally:
        setattr(dist, name, original)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_cp_equals_cp1_for_every_combination(size):
    spawn(equality_worker, size)


def test_cp_faults_raise_on_every_rank_and_two_collectives_per_call():
    spawn(_faults_and_count, 2)


def _faults_and_count(rank, size):
    fault_worker(rank, size)
    count_collectives_worker(rank, size)
    host_worker(rank, size)
    whole_mask_reducer_worker(rank, size)
    long_response_worker(rank, size)


def long_response_worker(rank, size):
    """Responses of 6000 and 100k tokens: every metric and the loss at cp 2 within 1e-6 relative of cp 1 (the
    per-sequence table is summed in float64: float32 partial sums drifted by 2e-5 on 6000 tokens)."""
    gen = torch.Generator().manual_seed(21)
    lengths = [6000, 100_000, 37]
    train = [-torch.rand(n, generator=gen) * 3.0 for n in lengths]
    full = dict(train_log_probs=train,
                rollout_log_probs=[t + 0.02 * torch.randn(t.shape, generator=gen) for t in train],
                loss_masks=[(torch.rand(n, generator=gen) > 0.1).float() for n in lengths],
                total_lengths=[n + 100 for n in lengths], response_lengths=lengths, max_seq_lens=None)
    pg_loss = torch.randn(sum(lengths), generator=gen)
    for config in (MisConfig(use_tis=True, tis_mode="icepop", tis_lower_bound=0.95, tis_upper_bound=1.05,
                             tis_batch_normalize=True),
                   MisConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.99,
                             rs_upper_bound=1.01, tis_batch_normalize=True, rs_divergence={"seq_mean_k3": 1e-3})):
        args = SimpleNamespace(**config.to_dict(), qkv_format="thd")
        ref_loss, ref_masks, ref_metrics = compute_mis_weights_with_cp(args, pg_loss=pg_loss,
                                                                       parallel_state=cp_state(0, 1), **full)
        kwargs, local_pg, positions = shard(full, pg_loss, rank, size, "thd")
        loss, masks, metrics = compute_mis_weights_with_cp(args, pg_loss=local_pg,
                                                           parallel_state=cp_state(rank, size), **kwargs)
        torch.testing.assert_close(loss, ref_loss[positions], rtol=1e-6, atol=1e-9)
        assert all(torch.equal(m, r) for m, r in zip(masks, ref_masks))
        assert sorted(metrics) == sorted(ref_metrics)
        for name, value in metrics.items():
            torch.testing.assert_close(value, ref_metrics[name][positions], rtol=1e-6, atol=1e-9, msg=name)


def host_worker(rank, size):
    """The reference host under CP: local losses summed over ranks and local gradients equal cp = 1, with the
    loss denominators of the input masks and (as miles' reducer without rollout_mask_sums) of the WHOLE returned
    masks, which only holds when every rank returns the same masks."""
    from miles_mis import reference_host

    full, _ = make_full_batch(seed=11, num_seqs=7)
    gen = torch.Generator().manual_seed(5)
    advantages = [torch.full((n,), float(torch.randn(1, generator=gen))) for n in full["response_lengths"]]
    current_full = [t + 0.05 * torch.randn(t.shape, generator=gen) for t in full["train_log_probs"]]
    plugin = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
    geometric = dict(use_rs=True, rs_level="geometric", rs_veto_threshold=0.5, tis_batch_normalize=True,
                     rs_lower_bound=0.95, rs_upper_bound=1.05)
    token_rs = dict(use_rs=True, rs_level="token", rs_lower_bound=0.85, rs_upper_bound=1.15, tis_batch_normalize=True)
    token_mis = dict(tis_mode="mask", tis_lower_bound=0.8, tis_upper_bound=1.25, rs_divergence={"token_k3": 0.05})
    cases = [(plugin + ["--use-opsm", "--opsm-delta", "0.0"], geometric),
             (["--loss-type", "reinforce", "--use-rollout-logprobs"], geometric),
             (plugin + ["--loss-denominator", "returned-mask"], token_rs),
             (plugin + ["--loss-denominator", "returned-mask", "--loss-type", "reinforce"], token_mis),
             (plugin + ["--loss-denominator", "returned-mask", "--calculate-per-token-loss"], token_rs),
             (plugin + ["--loss-denominator", "returned-mask", "--qkv-format", "bshd"], token_rs)]
    for argv, settings in cases:
        args = reference_host.parse_args(argv)
        for key, value in settings.items():
            setattr(args, key, value)
        fmt = args.qkv_format
        spans = [t + 3 * (i % 4) for i, t in enumerate(full["total_lengths"])] if fmt == "bshd" else None

        def run(ps, pick):
            current = [pick(i, t).clone().requires_grad_() for i, t in enumerate(current_full)]
            batch = dict(full, advantages=[pick(i, a) for i, a in enumerate(advantages)], max_seq_lens=spans,
                         log_probs=[pick(i, t) for i, t in enumerate(full["train_log_probs"])],
                         rollout_log_probs=[pick(i, t) for i, t in enumerate(full["rollout_log_probs"])])
            loss, metrics = reference_host.policy_loss(args, batch, current, parallel_state=ps)
            loss.backward()
            return loss.detach(), metrics, [c.grad for c in current]

        ref_loss, ref_metrics, ref_grads = run(cp_state(0, 1), lambda i, t: t)
        span_of = spans or full["total_lengths"]
        owned = [torch.tensor(local_positions(full["total_lengths"][i], n, rank, size, span_of[i]), dtype=torch.long)
                 for i, n in enumerate(full["response_lengths"])]
        loss, metrics, grads = run(cp_state(rank, size), lambda i, t: t[owned[i]])
        dist.all_reduce(loss)
        assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss))), (argv, loss, ref_loss)
        for i, g in enumerate(grads):
            torch.testing.assert_close(g, ref_grads[i][owned[i]], rtol=1e-5, atol=1e-7)
        for name in ("ppo_kl", "pg_clipfrac", "ppo_ratio_outside_clip", "ois", "mis_kl", "opsm_fraction",
                     "removed_token_fraction", "removed_abs_advantage", "removed_positive_advantage", "abs_advantage"):
            if name in metrics:
                value = torch.tensor(float(metrics[name]), dtype=torch.float64)
                if name != "opsm_fraction":  # a per-batch fraction, identical on every rank
                    dist.all_reduce(value)
                want = float(ref_metrics[name])
                assert abs(float(value) - want) < 1e-5 * max(1.0, abs(want)), (name, value, want)
        if settings is not geometric:  # the batch really has token-level rejections (inside sequences that span ranks)
            assert sum(float(ref_metrics.get(f"mis_{stage}_mask_fraction_{side}", 0.0))
                       for stage in ("rs", "tis") for side in ("low", "high")) > 0, argv


def whole_mask_reducer_worker(rank, size):
    """One sequence (prompt 4, response 8) at cp 2, token at offset 1 with ratio e^-3 < 0.5, token TIS + RS
    [0.5, 2], pg_loss 1 per token; miles' reducer divides by the whole returned mask's sum: the loss is 1 at cp 1
    and at cp 2 (it was 0.964286 when each rank zeroed only its own tokens)."""
    full = dict(train_log_probs=[torch.zeros(8)], rollout_log_probs=[torch.tensor([0.0, 3, 0, 0, 0, 0, 0, 0])],
                loss_masks=[torch.ones(8)], total_lengths=[12], response_lengths=[8], max_seq_lens=None)
    args = SimpleNamespace(**MisConfig(use_tis=True, use_rs=True, tis_lower_bound=0.5, tis_upper_bound=2.0).to_dict())
    kwargs, local_pg, positions = shard(full, torch.ones(8), rank, size, "thd")
    loss, masks, _ = compute_mis_weights_with_cp(args, pg_loss=local_pg, parallel_state=cp_state(rank, size), **kwargs)
    assert masks[0].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], (rank, masks[0].tolist())
    total = (loss * masks[0][positions]).sum() / masks[0].sum()
    dist.all_reduce(total)
    assert float(total) == 1.0


def megatron_worker(rank, world, use_kwarg):
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(context_parallel_size=2)
    cp_rank, cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    assert cp_size == 2 and mpu.get_data_parallel_world_size(with_context_parallel=False) == 2
    group = mpu.get_context_parallel_group()
    ps = SimpleNamespace(cp=SimpleNamespace(rank=cp_rank, size=cp_size, group=group),
                         intra_dp=SimpleNamespace(rank=dp_rank, size=2,
                                                  group=mpu.get_data_parallel_group(with_context_parallel=False)))
    for case, config in enumerate([MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=0.75,
                                             tis_batch_normalize=True),
                                   MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask",
                                             tis_lower_bound=0.93, tis_upper_bound=1.07)]):
        full, pg_loss = make_full_batch(seed=100 * dp_rank + case)  # each DP replica has its own data
        check_case(cp_rank, cp_size, config, full, pg_loss, "thd", group=group, ps=ps if use_kwarg else None)

    # tis_batch_normalize_scope: dp -> the factor of the two replicas' micro-batches together
    replicas = [make_full_batch(seed=500 + r) for r in range(2)]
    config = MisConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="dp")
    full, pg_loss = replicas[dp_rank]
    kwargs, local_pg, positions = shard(full, pg_loss, cp_rank, cp_size, "thd")
    args = SimpleNamespace(**config.to_dict(), qkv_format="thd")
    loss, _, metrics = compute_mis_weights_with_cp(args, pg_loss=local_pg, parallel_state=ps if use_kwarg else None,
                                                   **kwargs)
    joined = {k: replicas[0][0][k] + replicas[1][0][k] for k in ("train_log_probs", "rollout_log_probs",
                                                                   "loss_masks", "total_lengths", "response_lengths")}
    joined_pg = torch.cat([replicas[0][1], replicas[1][1]])
    ref_args = SimpleNamespace(**MisConfig(use_tis=True, tis_batch_normalize=True).to_dict(), qkv_format="thd")
    ref_loss, _, ref_metrics = compute_mis_weights_with_cp(ref_args, pg_loss=joined_pg,
                                                           parallel_state=cp_state(0, 1), **joined)
    offset = 0 if dp_rank == 0 else replicas[0][1].numel()
    torch.testing.assert_close(loss, ref_loss[offset + positions], rtol=1e-5, atol=1e-6)
    assert abs(float(metrics["mis_batch_norm_factor"][0]) - float(ref_metrics["mis_batch_norm_factor"][0])) < 1e-6
    mpu.destroy_model_parallel()


@pytest.mark.parametrize("use_kwarg", [True, False], ids=["parallel_state_kwarg", "megatron_fallback"])
def test_megatron_core_groups_dp2_cp2(use_kwarg):
    pytest.importorskip("megatron.core")
    spawn(megatron_worker, 4, use_kwarg)
