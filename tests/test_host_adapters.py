"""The host adapters (miles_mis/hosts): miles' and slime's own policy loss through their ``custom_loss`` seam, against
doubles of the hosts written from their source (tests/host_doubles.py).

Equality: with nothing extra to read, the adapter's loss, the gradient with respect to the logits and every logged
value equal the host's own ``policy_loss`` + ``--custom-tis-function-path`` path, at cp 1 and cp 2, thd and (miles)
bshd, for standard, bypass and decoupled PPO and metrics-only mode. Extras: each input the batch holds reaches the
correction exactly as if the host had passed it (compared with an explicit hook given the same kwargs)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from cp_harness import spawn
from host_doubles import Double, host_args, installed, make_batch

from miles_mis import MisConfig, compute_mis_weights_with_cp
from miles_mis.hosts import miles_loss, slime_loss

PLUGIN = "miles_mis.compute_mis_weights_with_cp"
ADAPTERS = {"miles": "miles_mis.hosts.miles_loss.policy_loss", "slime": "miles_mis.hosts.slime_loss.policy_loss"}
# configs/mis.yaml's keys, as the host sets them on args (use_tis and the other host flags come from the command line)
MIS_YAML = {k: v for k, v in MisConfig.preset("mis").to_dict().items() if k not in ("use_tis", "get_mismatch_metrics")}

# (name, host flags): the algorithms a user runs, each with the correction or its metrics on
MODES = [
    ("standard", dict()),
    ("metrics-only", dict(get_mismatch_metrics=True)),
    ("bypass-metrics", dict(use_rollout_logprobs=True, get_mismatch_metrics=True)),
    ("decoupled", dict(use_tis=True)),
    ("decoupled-metrics", dict(use_tis=True, get_mismatch_metrics=True, entropy_coef=0.01)),
]


def run(double, args, batch, logits_leaf, logits):
    """The host's loss_function on one micro-batch: (scaled loss, log, gradient w.r.t. the full logits)."""
    logits_leaf.grad = None
    loss, log = double.loss_function(args, batch, logits)
    loss.backward(retain_graph=True)
    return loss.detach(), {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in log.items()}, \
        logits_leaf.grad.clone()


# the adapter hands the correction the batch's rollout_mask_sums (both hosts hold them), so it logs one value more
# than the host path: the share of samples that are fragments of a larger rollout (0 in these complete batches)
ADAPTER_ONLY = ["mis_rollout_incomplete_fraction"]


def assert_same(a, b, where, adapter_only=()):
    """``b`` (the adapter) equals ``a`` (the host path) bit for bit: loss, gradient, every value ``a`` logs, in
    ``a``'s order; ``b`` logs ``adapter_only`` besides."""
    loss_a, log_a, grad_a = a
    loss_b, log_b, grad_b = b
    assert torch.equal(loss_a, loss_b), f"{where}: loss {loss_a} vs {loss_b}"
    assert torch.equal(grad_a, grad_b), f"{where}: gradient differs by {(grad_a - grad_b).abs().max()}"
    assert [k for k in log_b if k not in adapter_only] == list(log_a), \
        f"{where}: log keys {list(log_a)} vs {list(log_b)}"
    assert [k for k in adapter_only if k in log_b] == list(adapter_only), f"{where}: {adapter_only} not logged"
    for name in log_a:
        assert torch.equal(torch.as_tensor(log_a[name]), torch.as_tensor(log_b[name])), f"{where}: {name}"
    for name in adapter_only:
        assert float(log_b[name]) == 0.0, f"{where}: {name} = {float(log_b[name])} in a batch of whole rollouts"


def adapter_only(flags):
    return ADAPTER_ONLY if (flags.get("use_tis") or flags.get("get_mismatch_metrics")) else []


def host_path_and_adapter(host, mode_flags, batch_seed, cp_rank=0, cp_size=1, group=None, fmt="thd", unset_path=False,
                          config=MIS_YAML):
    """(host path result, adapter result) on the same batch."""
    double = Double(host, cp_rank, cp_size, group)
    out = []
    with installed(double):
        for loss_type in ("policy_loss", "custom_loss"):
            batch, leaf, logits, _ = make_batch(batch_seed, cp_rank, cp_size, fmt)
            tis_path = None if (loss_type == "custom_loss" and unset_path) else PLUGIN
            args = host_args(**config, **mode_flags, qkv_format=fmt, loss_type=loss_type,
                             custom_loss_function_path=ADAPTERS[host],
                             custom_tis_function_path=tis_path if (mode_flags.get("use_tis")
                                                                   or mode_flags.get("get_mismatch_metrics")) else None)
            if host == "miles":
                args.parallel_state = None
            out.append(run(double, args, batch, leaf, logits))
    return out


@pytest.mark.parametrize("host", ["miles", "slime"])
@pytest.mark.parametrize("mode, flags", MODES, ids=[m for m, _ in MODES])
def test_the_adapter_equals_the_hosts_own_path_at_cp1(host, mode, flags):
    fmts = ("thd", "bshd") if host == "miles" else ("thd",)
    for fmt in fmts:
        for seed in (0, 1):
            host_result, adapter_result = host_path_and_adapter(host, flags, seed, fmt=fmt)
            assert_same(host_result, adapter_result, f"{host} {mode} {fmt} seed {seed}", adapter_only(flags))
            assert torch.isfinite(host_result[0]) and host_result[2].abs().sum() > 0


def test_the_corrected_loss_differs_from_the_uncorrected_one():
    """A check that the equality above compares corrected losses: decoupled PPO with mis.yaml is not standard PPO."""
    (standard, _), (decoupled, _) = (host_path_and_adapter("miles", flags, 0) for flags in (MODES[0][1], MODES[3][1]))
    assert not torch.equal(standard[0], decoupled[0])
    assert "mis_k3_kl" in decoupled[1] and "mis_k3_kl" not in standard[1]


@pytest.mark.parametrize("host", ["miles", "slime"])
def test_an_unset_tis_path_runs_miles_mis_and_a_foreign_one_is_refused(host):
    host_result, adapter_result = host_path_and_adapter(host, dict(use_tis=True), 2, unset_path=True)
    assert_same(host_result, adapter_result, f"{host}, --custom-tis-function-path unset", ADAPTER_ONLY)
    double = Double(host)
    with installed(double):
        batch, _, logits, _ = make_batch(0)
        args = host_args(**MIS_YAML, use_tis=True, loss_type="custom_loss", custom_loss_function_path=ADAPTERS[host],
                         custom_tis_function_path="my_pkg.my_tis")
        with pytest.raises(ValueError, match=r"^--custom-tis-function-path my_pkg.my_tis: "
                                             r"miles_mis.hosts.\w+_loss runs "
                                             r"miles_mis's correction"):
            double.loss_function(args, batch, logits)


@pytest.mark.parametrize("host", ["miles", "slime"])
def test_recompute_loss_function_gives_the_same_gradient(host):
    """--recompute-loss-function runs the loss again in backward (miles: reentrant checkpoint, slime: not): the
    adapter's batch inputs and the kept current log-probs are set again there."""
    config = dict(MIS_YAML, tis_policy="current")
    results = []
    for recompute in (False, True):
        double = Double(host)
        with installed(double):
            batch, leaf, logits, _ = make_batch(3)
            args = host_args(**config, use_tis=True, loss_type="custom_loss", custom_loss_function_path=ADAPTERS[host],
                             recompute_loss_function=recompute)
            results.append(run(double, args, batch, leaf, logits))
            assert len(double.hook_calls) == 1 + recompute  # the hook ran again in backward
    assert_same(*results, f"{host} recompute")


# --------------------------------------------------------------------------- the batch's inputs reach the correction
def explicit_hook(**kwargs):
    """A correction hook given, explicitly, what the test put in EXPLICIT: the reference for the adapter."""
    return compute_mis_weights_with_cp(**kwargs, **EXPLICIT)


EXPLICIT: dict = {}


def with_explicit_hook(monkeypatch):
    module = types.ModuleType("explicit_hook_module")
    module.hook = explicit_hook
    monkeypatch.setitem(sys.modules, "explicit_hook_module", module)
    return "explicit_hook_module.hook"


@pytest.mark.parametrize("host", ["miles", "slime"])
@pytest.mark.parametrize("case", ["current-policy", "directional", "split-rollouts", "lags", "sampling-masks"])
def test_each_batch_input_reaches_the_correction_as_a_kwarg_would(host, case, monkeypatch):
    config = dict(MIS_YAML)
    extras = case == "split-rollouts"
    if case == "current-policy":
        config.update(tis_policy="current")
    elif case == "directional":
        config.update(rs_divergence={"token_dtv": [-0.02, 0.02]})
    elif case == "split-rollouts":
        config.update(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0)
    elif case == "lags":
        config.update(tis_upper_bound_by_lag=[2.0, 1.5, 1.2])
    hook_path = with_explicit_hook(monkeypatch)
    results = []
    for path in ("adapter", "explicit"):
        double = Double(host)
        with installed(double):
            batch, leaf, logits, _ = make_batch(4, extras=extras)
            versions = [[str(7 - i % 3)] for i in range(len(batch["response_lengths"]))]
            offsets = [torch.arange(n + 1) * 2 for n in batch["response_lengths"]]
            if case == "lags":
                batch["weight_versions"] = versions
            if case == "sampling-masks":
                batch["rollout_sampling_mask_offsets" if host == "miles" else "rollout_top_p_token_offsets"] = offsets
            flags = dict(use_tis=True, current_weight_version=9 if case == "lags" else None)
            if path == "adapter":
                args = host_args(**config, **flags, loss_type="custom_loss", custom_loss_function_path=ADAPTERS[host])
            else:
                args = host_args(**config, **flags, custom_tis_function_path=hook_path)
                EXPLICIT.clear()
                EXPLICIT["rollout_mask_sums"] = batch["rollout_mask_sums"]
                if case == "current-policy":
                    out = double.get_log_probs_and_entropy(
                        logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                        total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
                    EXPLICIT["cur_log_probs"] = [t.detach() for t in (out[1] if host == "slime" else out)["log_probs"]]
                if case == "directional":
                    EXPLICIT["advantages"] = batch["advantages"]
                if extras:
                    EXPLICIT["rollout_ids"] = batch["rollout_ids"]
                if case == "lags":
                    EXPLICIT.update(weight_versions=versions, current_weight_version=9)
                if case == "sampling-masks":
                    EXPLICIT["sampling_mask_sizes"] = [torch.full((n,), 2) for n in batch["response_lengths"]]
            results.append(run(double, args, batch, leaf, logits))
            assert len(double.hook_calls) == 1
    assert_same(*results, f"{host} {case}")
    log = results[0][1]
    if case == "current-policy":
        trained = sum(1 for mask in batch["loss_masks"] if mask.sum() > 0)  # Σ over samples of a mean of 1
        assert float(log["mis_numerator_is_current_policy"]) == pytest.approx(trained)
    if case == "split-rollouts":
        assert float(log["mis_rollout_split_fraction"]) > 0
    if case == "lags":
        assert "mis_version_lag" in log
    if case == "sampling-masks":
        assert float(log["mis_sampling_mask_size_mean"]) > 0


def test_lags_without_weight_versions_name_the_host_commit():
    double = Double("miles")
    with installed(double):
        batch, _, logits, _ = make_batch(0)
        args = host_args(**dict(MIS_YAML, rs_max_lag=2), use_tis=True, loss_type="custom_loss",
                         custom_loss_function_path=ADAPTERS["miles"])
        with pytest.raises(ValueError, match=r"^rs_max_lag needs each sample's lag, but this miles batch holds no "
                                             r"weight_versions \(miles at radixark/miles@31f1ca961 does not") as caught:
            double.loss_function(args, batch, logits)
    assert "\n" not in str(caught.value)


def test_lags_need_the_trainers_version_and_are_read_only_with_both():
    from miles_mis.hosts.adapter import batch_lags

    acting = MisConfig.from_args(host_args(**dict(MIS_YAML, rs_max_lag=2), use_tis=True))
    watching = MisConfig.from_args(host_args(**MIS_YAML, get_mismatch_metrics=True))
    batch = {"weight_versions": [["5", "7"], ["default", "6"], ["7"]]}
    with pytest.raises(ValueError, match=r"^rs_max_lag needs each sample's lag, the trainer's weight version minus the "
                                         r"sample's, but args.current_weight_version is not set"):
        batch_lags(miles_loss.MILES, acting, host_args(), batch)
    assert batch_lags(miles_loss.MILES, acting, host_args(current_weight_version=9), batch) == {
        "weight_versions": batch["weight_versions"], "current_weight_version": 9}
    # monitoring: read only when both are there (no lag relative to another sample's version)
    assert batch_lags(miles_loss.MILES, watching, host_args(), batch) == {}
    assert batch_lags(miles_loss.MILES, watching, host_args(current_weight_version=9), {}) == {}
    read = batch_lags(miles_loss.MILES, watching, host_args(current_weight_version=9), batch)
    assert read["current_weight_version"] == 9


# --------------------------------------------------------------------------- outside the host
@pytest.mark.parametrize("module, commit", [(miles_loss, "radixark/miles@31f1ca961"),
                                            (slime_loss, "THUDM/slime@624b824a8")])
def test_outside_the_host_one_line_names_what_is_missing_and_the_verified_commit(module, commit):
    batch, _, logits, _ = make_batch(0)
    with pytest.raises(ImportError) as caught:
        module.policy_loss(host_args(use_tis=True), batch, logits, lambda x: x.sum())
    message = str(caught.value)
    assert "\n" not in message and commit in message and "cannot import" in message


def test_a_host_without_policy_loss_function_is_named(monkeypatch):
    for name in ("miles", "miles.backends", "miles.backends.training_utils", "miles.backends.training_utils.loss_hub",
                 "miles.backends.training_utils.loss_hub.losses"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    batch, _, logits, _ = make_batch(0)
    with pytest.raises(ImportError, match=r"has no policy_loss_function: this miles version differs from the one the "
                                          r"adapter was verified against \(radixark/miles@31f1ca961\)"):
        miles_loss.policy_loss(host_args(), batch, logits, lambda x: x.sum())


@pytest.mark.parametrize("host", ["miles", "slime"])
def test_the_current_policy_is_the_hosts_own_log_probs_computed_once(host):
    """tis_policy: current reads the log-probs the host's loss computes (no second log-softmax over the logits), and
    the host's helper is restored after the call, also when the loss raises."""
    double = Double(host)
    with installed(double) as module:
        original, calls = module.get_log_probs_and_entropy, []
        module.get_log_probs_and_entropy = lambda *a, **k: calls.append(1) or original(*a, **k)
        helper = module.get_log_probs_and_entropy
        batch, leaf, logits, _ = make_batch(6)
        args = host_args(**dict(MIS_YAML, tis_policy="current"), use_tis=True, loss_type="custom_loss",
                         custom_loss_function_path=ADAPTERS[host])
        run(double, args, batch, leaf, logits)
        assert len(calls) == 1 and module.get_log_probs_and_entropy is helper
        with pytest.raises(ValueError, match="policy loss requires old-policy log-probs"):
            double.loss_function(args, dict(batch, log_probs=None), logits)
        assert module.get_log_probs_and_entropy is helper


def test_a_host_without_the_log_prob_helper_is_named_when_the_current_policy_is_needed():
    double = Double("slime")
    with installed(double) as module:
        del module.get_log_probs_and_entropy
        batch, _, logits, _ = make_batch(0)
        args = host_args(**dict(MIS_YAML, tis_policy="current"), use_tis=True, loss_type="custom_loss",
                         custom_loss_function_path=ADAPTERS["slime"])
        with pytest.raises(ImportError, match=r"has no get_log_probs_and_entropy, which tis_policy: current needs .* "
                                              r"\(THUDM/slime@624b824a8\)$"):
            double.loss_function(args, batch, logits)


# --------------------------------------------------------------------------- skip-forward and gradient-carrying inputs
def test_the_skip_forward_mode_is_recognised_and_said():
    """miles' --skip-actor-forward-only: the hook's train_log_probs are the training forward's own (detached)."""
    double = Double("miles")
    with installed(double):
        batch, leaf, logits, _ = make_batch(5)
        batch["log_probs"] = None
        args = host_args(**MIS_YAML, use_tis=True, custom_tis_function_path=PLUGIN, skip_actor_forward_only=True)
        _, log, _ = run(double, args, batch, leaf, logits)
        call = double.hook_calls[0]
    assert all(not t.requires_grad for t in call["train_log_probs"])
    trained = sum(1 for mask in batch["loss_masks"] if mask.sum() > 0)  # the reducer: Σ over samples of a mean of 1
    assert float(log["mis_numerator_is_current_policy"]) == pytest.approx(trained)
    assert float(log["ppo_kl"]) == 0.0  # π_old is π_θ itself: the PPO ratio is exactly 1


@pytest.mark.parametrize("spelling", ["cur_log_probs", "current_log_probs"])
@pytest.mark.parametrize("flat", [False, True])
def test_current_log_probs_with_grad_are_detached(spelling, flat):
    """Current log-probs passed with their graph (per sequence or flat): no gradient flows through the weights."""
    gen = torch.Generator().manual_seed(0)
    current = [(-torch.rand(n, generator=gen)).requires_grad_() for n in (3, 0, 4)]
    rollout = [c.detach() + 0.3 * torch.randn(c.shape, generator=gen) for c in current]
    masks = [torch.ones(c.numel()) for c in current]
    pg_loss = torch.randn(7, generator=gen).requires_grad_()
    args = types.SimpleNamespace(use_tis=True, tis_policy="current", tis_level="token", tis_mode="truncate",
                                 tis_upper_bound=2.0, use_rs=False, rs_veto_threshold=None, tis_batch_normalize=False)
    value = torch.cat(current) if flat else current
    loss, _, _ = compute_mis_weights_with_cp(args, pg_loss=pg_loss, train_log_probs=[c.detach() - 0.1 for c in current],
                                             rollout_log_probs=rollout, loss_masks=masks,
                                             response_lengths=[3, 0, 4], total_lengths=[5, 2, 6], **{spelling: value})
    loss.sum().backward()
    assert all(c.grad is None for c in current)
    weights = torch.exp(torch.cat(current).detach() - torch.cat(rollout)).clamp(max=2.0)
    torch.testing.assert_close(loss.detach(), pg_loss.detach() * weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pg_loss.grad, weights, rtol=1e-6, atol=1e-7)  # the weights enter as constants


# --------------------------------------------------------------------------- context parallel
def adapters_cp_worker(rank, size):
    import torch.distributed as dist

    group = dist.new_group(list(range(size)))
    for host in ("miles", "slime"):
        if host == "slime":  # slime passes no parallel_state: the plugin reads Megatron-core's
            from megatron.core import parallel_state as mpu

            mpu.initialize_model_parallel(context_parallel_size=size)
            group = mpu.get_context_parallel_group()
        for fmt in (("thd", "bshd") if host == "miles" else ("thd",)):
            for mode, flags in MODES:
                seed = 10 + MODES.index((mode, flags))
                host_result, adapter_result = host_path_and_adapter(host, flags, seed, rank, size, group, fmt)
                assert_same(host_result, adapter_result, f"cp rank {rank}: {host} {mode} {fmt}", adapter_only(flags))
                if host == "slime":  # Megatron-core says cp 2 now: no cp 1 call in this process
                    continue
                # the ranks' partial losses add up to cp 1's (the host's reducer; a check of the double's layout)
                partial = host_result[0].clone().double()
                dist.all_reduce(partial, group=group)
                whole = host_path_and_adapter(host, flags, seed, 0, 1, None, fmt)[0]
                assert abs(float(partial) / size - float(whole[0])) < 1e-5 * max(1.0, abs(float(whole[0]))), \
                    f"{host} {mode} {fmt}: ranks sum to {float(partial) / size}, cp 1 gives {float(whole[0])}"
        if host == "slime":
            mpu.destroy_model_parallel()


def test_the_adapter_equals_the_hosts_own_path_at_cp2():
    spawn(adapters_cp_worker, 2, timeout=400)

