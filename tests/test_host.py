"""The reference host: flags, the four algorithms' gradients, equivalences, plugin loading, OPSM."""

import math

import pytest
import torch
from conftest import DEVICE

from miles_mis import reference_host

PLUGIN = "miles_mis.compute_mis_weights_with_cp"


def args_for(*flags, config=None, repo_root=None):
    argv = list(flags)
    if config:
        argv += ["--custom-config-path", str(repo_root / "configs" / config)]
    return reference_host.parse_args(argv)


def make_batch(log_ratios_old, log_ratios_rollout, advantages, masks=None, seed=0):
    """Current log-probs (leaf tensors with grad), π_old = current − old_gap, rollout = current − rollout_gap."""
    gen = torch.Generator().manual_seed(seed)
    current = [(-torch.rand(len(a), generator=gen) - 0.5).to(DEVICE).requires_grad_() for a in advantages]
    batch = dict(
        advantages=[torch.tensor(a, dtype=torch.float32, device=DEVICE) for a in advantages],
        log_probs=[c.detach() - torch.tensor(g, device=DEVICE) for c, g in zip(current, log_ratios_old)],
        rollout_log_probs=[c.detach() - torch.tensor(g, device=DEVICE) for c, g in zip(current, log_ratios_rollout)],
        loss_masks=[torch.ones(len(a), device=DEVICE) if masks is None
                    else torch.tensor(m, dtype=torch.float32, device=DEVICE)
                    for a, m in zip(advantages, masks or advantages)],
        response_lengths=[len(a) for a in advantages], total_lengths=[len(a) + 3 for a in advantages])
    return batch, current


def grads(args, batch, current):
    loss, metrics = reference_host.policy_loss(args, batch, current)
    for c in current:
        c.grad = None
    loss.backward()
    return loss, metrics, [c.grad.clone() for c in current]


# ---------------------------------------------------------------- PPO gradient by hand
# one sequence of 5 tokens, n = 5; r = π_θ/π_old = exp(gap); eps 0.2
GAPS = [math.log(1.1), math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.9)]
ADVS = [1.0, 1.0, -1.0, -1.0, -2.0]


def expected_ppo_grad(ratios, advantages, n, eps=0.2, dual=None):
    out = []
    for r, a in zip(ratios, advantages):
        unclipped, clipped = -r * a, -min(max(r, 1 - eps), 1 + eps) * a
        grad = -r * a if unclipped >= clipped else 0.0  # d/dlogπ of −r·A is −r·A
        if dual is not None and a < 0 and -dual * a < max(unclipped, clipped):
            grad = 0.0
        out.append(grad / n)
    return out


def test_standard_ppo_gradient_matches_analytic():
    batch, current = make_batch([GAPS], [[0.0] * 5], [ADVS])
    loss, metrics, (grad,) = grads(reference_host.parse_args([]), batch, current)
    ratios = [math.exp(g) for g in GAPS]
    torch.testing.assert_close(grad, torch.tensor(expected_ppo_grad(ratios, ADVS, 5)))
    expected_loss = sum(max(-r * a, -min(max(r, 0.8), 1.2) * a) for r, a in zip(ratios, ADVS)) / 5
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)  # tokens 1 (r=1.5, A>0) and 2 (r=0.5, A<0)
    # outside [0.8, 1.2] whatever A's sign: tokens 1, 2 and 3 (r = 1.5, 0.5, 1.5), not 0 or 4 (1.1, 0.9)
    assert metrics["ppo_ratio_outside_clip"].item() == pytest.approx(3 / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(GAPS) / 5, rel=1e-5)


def test_dual_clip_and_asymmetric_clip_gradients():
    batch, current = make_batch([GAPS], [[0.0] * 5], [ADVS])
    _, _, (grad,) = grads(reference_host.parse_args(["--eps-clip-c", "1.3"]), batch, current)
    ratios = [math.exp(g) for g in GAPS]
    torch.testing.assert_close(grad, torch.tensor(expected_ppo_grad(ratios, ADVS, 5, dual=1.3)))
    _, _, (grad,) = grads(reference_host.parse_args(["--eps-clip-high", "0.6"]), batch, current)
    # with 1 + ε_high = 1.6, token 1 (r = 1.5, A > 0) is no longer clipped
    assert grad[1].item() == pytest.approx(-1.5 / 5, rel=1e-5)


def test_bypass_uses_rollout_log_probs_and_equals_standard_when_old_is_rollout():
    batch, current = make_batch([[0.0] * 5], [GAPS], [ADVS])
    _, _, (grad,) = grads(reference_host.parse_args(["--use-rollout-logprobs"]), batch, current)
    ratios = [math.exp(g) for g in GAPS]  # π_θ/π_rollout
    torch.testing.assert_close(grad, torch.tensor(expected_ppo_grad(ratios, ADVS, 5)))
    same, current2 = make_batch([GAPS], [GAPS], [ADVS])
    loss_std, _, g_std = grads(reference_host.parse_args([]), same, current2)
    loss_byp, _, g_byp = grads(reference_host.parse_args(["--use-rollout-logprobs"]), same, current2)
    assert loss_std.item() == pytest.approx(loss_byp.item())
    torch.testing.assert_close(g_std, g_byp)


def test_decoupled_gradient_is_weighted_ppo_gradient(repo_root):
    # π_old/π_rollout per token = exp(rollout_gap − old_gap); token_tis.yaml truncates at 2
    old_gaps = [0.0] * 5
    rollout_gaps = [0.3, -0.2, 1.0, 0.0, -1.5]
    batch, current = make_batch([old_gaps], [rollout_gaps], [ADVS])
    args = args_for("--use-tis", "--custom-tis-function-path", PLUGIN, config="token_tis.yaml", repo_root=repo_root)
    loss, metrics, (grad,) = grads(args, batch, current)
    weights = [min(math.exp(r - o), 2.0) for r, o in zip(rollout_gaps, old_gaps)]
    base = expected_ppo_grad([1.0] * 5, ADVS, 5)
    torch.testing.assert_close(grad, torch.tensor([w * b for w, b in zip(weights, base)]))
    assert metrics["ois"].item() == pytest.approx(1.0)
    assert metrics["mis_tis_truncate_fraction"].item() == pytest.approx(1 / 5)


def test_decoupled_equals_standard_when_old_is_rollout(repo_root):
    batch, current = make_batch([GAPS], [GAPS], [ADVS])
    loss_std, m_std, g_std = grads(reference_host.parse_args([]), batch, current)
    args = args_for("--use-tis", "--custom-tis-function-path", PLUGIN, config="mis.yaml", repo_root=repo_root)
    loss_dec, m_dec, g_dec = grads(args, batch, current)
    assert loss_std.item() == pytest.approx(loss_dec.item(), rel=1e-6)
    torch.testing.assert_close(g_std, g_dec)
    for name in ("pg_clipfrac", "ppo_kl"):
        assert m_std[name].item() == pytest.approx(m_dec[name].item())


def test_reinforce_with_is_gradient(repo_root):
    rollout_gaps = [0.3, -0.2, 1.0, 0.0, -1.5]
    batch, current = make_batch([[0.0] * 5], [rollout_gaps], [ADVS])
    args = args_for("--loss-type", "reinforce", "--use-tis", "--custom-tis-function-path", PLUGIN,
                    config="token_tis.yaml", repo_root=repo_root)
    loss, metrics, (grad,) = grads(args, batch, current)
    weights = [min(math.exp(r), 2.0) for r in rollout_gaps]
    torch.testing.assert_close(grad, torch.tensor([-a * w / 5 for a, w in zip(ADVS, weights)]))
    expected = sum(-a * lp * w for a, lp, w in zip(ADVS, current[0].tolist(), weights)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["pg_clipfrac"].item() == 0.0
    # bypass REINFORCE: w = π_θ/π_rollout within the built-in bounds [tis_clip_low, tis_clip], no PPO clipping
    _, _, (grad,) = grads(reference_host.parse_args(["--loss-type", "reinforce", "--use-rollout-logprobs"]), batch,
                          current)
    weights = [min(math.exp(r), 2.0) for r in rollout_gaps]
    torch.testing.assert_close(grad, torch.tensor([-a * w / 5 for a, w in zip(ADVS, weights)]))


def test_builtin_vanilla_tis_and_metrics():
    batch, current = make_batch([[0.0, 0.0]], [[math.log(3.0), -0.5]], [[1.0, 1.0]])
    loss, metrics, (grad,) = grads(reference_host.parse_args(["--use-tis"]), batch, current)
    # w = clamp(π_old/π_rollout, 0, 2) = [2, e^-0.5]; standard-PPO gradient at r = 1 is −A/n
    torch.testing.assert_close(grad, torch.tensor([-2.0 / 2, -math.exp(-0.5) / 2]))
    assert metrics["tis"].item() == pytest.approx((3.0 + math.exp(-0.5)) / 2, rel=1e-5)
    assert metrics["tis_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["tis_abs"].item() == pytest.approx((2.0 + 1 - math.exp(-0.5)) / 2, rel=1e-5)


def test_rejection_rebuilds_numerator_but_keeps_original_denominator(repo_root):
    # seq_mis: sequence 0 has a product ratio π_old/π_rollout = exp(−2) < 0.5 -> rejected (its loss is 0), and
    # sequence 1 keeps its own per-sequence mean (denominator = its original count)
    batch, current = make_batch([[0.0] * 3, [0.0] * 2], [[-1.0, -0.5, -0.5], [0.1, -0.1]], [[1.0] * 3, [1.0] * 2])
    args = args_for("--use-tis", "--custom-tis-function-path", PLUGIN, config="seq_mis.yaml", repo_root=repo_root)
    loss, metrics, (g0, g1) = grads(args, batch, current)
    assert g0.abs().sum() == 0
    torch.testing.assert_close(g1, torch.tensor([-1.0 / 2, -1.0 / 2]))
    assert loss.item() == pytest.approx(-1.0, rel=1e-6)  # Σ_seq mean: 0 + (−1·1·1)
    assert metrics["mis_tis_mask_fraction_low"].item() == pytest.approx(1.0)  # Σ over sequences: 1 + 0
    # what the mask removed (Σ over sequences of per-sequence means): all of sequence 0 (|A| = 1, A > 0), none of 1
    assert metrics["removed_token_fraction"].item() == pytest.approx(1.0)
    assert metrics["removed_abs_advantage"].item() == pytest.approx(1.0)
    assert metrics["removed_positive_advantage"].item() == pytest.approx(1.0)
    assert metrics["abs_advantage"].item() == pytest.approx(2.0)  # 1 + 1: half the advantage mass removed


def test_per_token_loss_sums_tokens():
    batch, current = make_batch([[0.0] * 3, [0.0] * 2], [[0.0] * 3, [0.0] * 2], [[1.0] * 3, [2.0] * 2])
    loss, _, (g0, g1) = grads(reference_host.parse_args(["--calculate-per-token-loss"]), batch, current)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * 2.0))
    torch.testing.assert_close(g1, torch.tensor([-2.0, -2.0]))


def test_nan_advantages_are_zeroed():
    batch, current = make_batch([[0.0] * 3], [[0.0] * 3], [[1.0, float("nan"), float("inf")]])
    loss, metrics, (grad,) = grads(reference_host.parse_args([]), batch, current)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor([-1.0 / 3, 0.0, 0.0]))


def test_plugin_by_dotted_path_and_by_file_path_agree(tmp_path, repo_root):
    plugin_file = tmp_path / "my_correction.py"
    plugin_file.write_text("from miles_mis import compute_mis_weights_with_cp\n")
    batch, current = make_batch([[0.1, -0.2, 0.0]], [[0.4, 0.3, -0.9]], [[1.0, -1.0, 0.5]])
    results = []
    for path in (PLUGIN, f"{plugin_file}:compute_mis_weights_with_cp"):
        args = args_for("--use-tis", "--custom-tis-function-path", path, config="mis.yaml", repo_root=repo_root)
        loss, metrics, g = grads(args, batch, current)
        results.append((loss.item(), {k: float(v) for k, v in metrics.items()}, g))
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    torch.testing.assert_close(results[0][2], results[1][2])


def test_opsm_decides_per_sequence_against_rollout_log_probs():
    # gaps: behaviour − current log-prob. Rollout gaps: seq0 mean 0.2 (> δ, A < 0: rejected), seq1 mean −0.1
    # (A < 0, kept), seq2 mean 0.5 (A > 0, kept). The recomputed π_old would tell the opposite for seq0/seq1.
    # (make_batch takes current − behaviour: the negated gaps)
    batch, current = make_batch([[0.1, 0.1], [-0.1, -0.1], [0.0]], [[-0.1, -0.3], [0.1, 0.1], [-0.5]],
                                [[-1.0, -1.0], [-1.0, -1.0], [1.0]])
    args = reference_host.parse_args(["--use-opsm", "--opsm-delta", "0.05"])
    loss, metrics, (g0, g1, g2) = grads(args, batch, current)
    assert metrics["opsm_fraction"] == pytest.approx(1 / 3)
    assert g0.abs().sum() == 0 and g1.abs().sum() > 0 and g2.abs().sum() > 0


def test_train_rollout_logprob_abs_diff():
    batch, current = make_batch([[0.0, 0.0]], [[0.2, -0.4]], [[1.0, 1.0]])
    _, metrics = reference_host.policy_loss(reference_host.parse_args([]), batch, current)
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.3, rel=1e-5)


@pytest.mark.parametrize("argv, words", [
    (["--use-tis", "--use-rollout-logprobs"], ["--use-tis", "--use-rollout-logprobs", "mutually exclusive"]),
    (["--get-mismatch-metrics"], ["--get-mismatch-metrics", "--custom-tis-function-path"]),
    (["--loss-type", "reinforce"], ["--loss-type reinforce", "--use-tis", "--use-rollout-logprobs"]),
    (["--eps-clip-c", "0.9"], ["--eps-clip-c", "> 1"]),
    (["--use-tis", "--custom-tis-function-path", "miles_mis.no_such_function"], ["no_such_function"]),
    (["--use-tis", "--custom-tis-function-path", "no/such/file.py:f"], ["no Python file"]),
])
def test_flag_validation(argv, words):
    with pytest.raises(ValueError) as info:
        reference_host.parse_args(argv)
    for word in words:
        assert word in str(info.value)


def test_yaml_is_merged_before_validation(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("use_tis: true\n")
    with pytest.raises(ValueError, match="mutually exclusive"):
        reference_host.parse_args(["--use-rollout-logprobs", "--custom-config-path", str(config)])
    config.write_text("tis_mode: trunc\n")
    with pytest.raises(ValueError, match="did you mean 'truncate'"):
        reference_host.parse_args(["--use-tis", "--custom-tis-function-path", PLUGIN,
                                   "--custom-config-path", str(config)])


def test_reinforce_bypass_is_allowed_and_needs_rollout_log_probs():
    args = reference_host.parse_args(["--loss-type", "reinforce", "--use-rollout-logprobs"])
    batch, current = make_batch([[0.0]], [[0.0]], [[1.0]])
    batch["rollout_log_probs"] = None
    with pytest.raises(ValueError, match="rollout_log_probs"):
        reference_host.policy_loss(args, batch, current)


@pytest.mark.parametrize("argv", [["--use-tis"], ["--loss-type", "reinforce", "--use-rollout-logprobs"]])
def test_nan_rollout_log_prob_does_not_poison_the_loss(argv):
    batch, current = make_batch([[0.0, 0.0, 0.0]], [[0.1, -0.2, 0.0]], [[1.0, -1.0, 0.5]],
                                masks=[[1.0, 1.0, 0.0]])
    batch["rollout_log_probs"][0][2] = float("nan")  # on an untrained token
    batch["rollout_log_probs"][0][1] = float("-inf")  # on a trained token: weight at the clip bound
    loss, metrics, (grad,) = grads(reference_host.parse_args(argv), batch, current)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())


def test_metrics_only_preset_keeps_the_plugin_called_under_use_tis(repo_root):
    args = args_for("--use-tis", "--custom-tis-function-path", PLUGIN, config="metrics_only.yaml", repo_root=repo_root)
    assert args.use_tis is False and args.get_mismatch_metrics is True
    batch, current = make_batch([[0.0, 0.1]], [[0.2, -0.1]], [[1.0, -1.0]])
    _, metrics = reference_host.policy_loss(args, batch, current)
    assert "mis_kl" in metrics and "mis_tis_weight_before_bound" not in metrics


# ---------------------------------------------------------------- the current policy and lags through the host
def test_reinforce_with_the_current_policy_weights_by_pi_theta_over_pi_rollout(tmp_path):
    """--loss-type reinforce --use-tis with tis_policy: current: the loss is −Σ_t A·w_t·log π_θ / n with
    w_t = min(π_θ/π_rollout, U), detached, so d loss / d log π_θ = −A·w / n: the policy gradient at θ itself."""
    config = tmp_path / "mis.yaml"
    config.write_text("tis_policy: current\ntis_upper_bound: 1.5\n")
    args = reference_host.parse_args(["--use-tis", "--loss-type", "reinforce", "--custom-tis-function-path", PLUGIN,
                            "--custom-config-path", str(config), "--pass-current-log-probs"])
    gaps_old, gaps_rollout, advantages = [0.3, -0.2, 0.0], [0.1, 0.6, -0.4], [1.0, -1.0, 2.0]
    batch, current = make_batch([gaps_old], [gaps_rollout], [advantages])
    _, metrics, (grad,) = grads(args, batch, current)
    weights = [min(math.exp(g), 1.5) for g in gaps_rollout]  # log π_θ − log π_rollout = the rollout gap
    assert grad.tolist() == pytest.approx([-a * w / 3 for a, w in zip(advantages, weights)], rel=1e-5)
    # tis_policy: old weighs by π_old/π_rollout = exp(rollout gap − old gap) instead
    config.write_text("tis_upper_bound: 1.5\n")
    args = reference_host.parse_args(["--use-tis", "--loss-type", "reinforce", "--custom-tis-function-path", PLUGIN,
                            "--custom-config-path", str(config)])
    _, _, (grad,) = grads(args, *make_batch([gaps_old], [gaps_rollout], [advantages]))
    weights = [min(math.exp(r - o), 1.5) for o, r in zip(gaps_old, gaps_rollout)]
    assert grad.tolist() == pytest.approx([-a * w / 3 for a, w in zip(advantages, weights)], rel=1e-5)


def test_current_policy_flag_is_checked_at_start_up(tmp_path, capsys):
    config = tmp_path / "mis.yaml"
    config.write_text("tis_policy: current\n")
    flags = ["--use-tis", "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(config)]
    with pytest.raises(ValueError, match="tis_policy: current needs --pass-current-log-probs"):
        reference_host.parse_args(flags)
    reference_host.parse_args(flags + ["--pass-current-log-probs"])  # PPO: valid, with a warning about double counting
    assert "count it twice" in capsys.readouterr().err
    reference_host.parse_args(flags + ["--pass-current-log-probs", "--loss-type", "reinforce"])
    assert "count it twice" not in capsys.readouterr().err


@pytest.mark.parametrize("entry", [PLUGIN, "miles_mis.compute_mis_weights_packed"])
def test_the_host_hands_the_batch_lags_to_the_plugin(entry, tmp_path):
    config = tmp_path / "mis.yaml"
    config.write_text("rs_max_lag: 1\n")
    args = reference_host.parse_args(["--use-tis", "--custom-tis-function-path", entry,
                                      "--custom-config-path", str(config)])
    batch, current = make_batch([[0.1, 0.0], [0.0], [0.2, 0.1]], [[0.0, 0.1], [0.3], [0.0, 0.0]],
                                [[1.0, 1.0], [-1.0], [2.0, 2.0]])
    for lags in ({"version_lags": [0, 2, 1]}, {"weight_versions": [["5"], ["3", "4"], ["4"]],
                                                 "current_weight_version": 5}):
        _, metrics = reference_host.policy_loss(args, dict(batch, **lags), current)
        # the host's reducer: the mean lag over sequences (per-sequence value), 1 of 3 sequences stale
        assert float(metrics["mis_version_lag"]) == pytest.approx(0 + 2 + 1)
        assert float(metrics["mis_rs_stale_seq_fraction"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rs_max_lag needs each sequence's lag"):
        reference_host.policy_loss(args, batch, current)


@pytest.mark.parametrize("entry", [PLUGIN, "miles_mis.compute_mis_weights_packed"])
def test_prime_rl_default_on_the_host_masks_by_the_advantage_sign(entry, tmp_path):
    """prime-rl's default loss as a mis.yaml: REINFORCE weighted by π_θ/μ, tokens masked when π_θ − μ leaves
    [−0.2, 0.2] in the direction of their update (the host hands its advantages to the plugin)."""
    config = tmp_path / "mis.yaml"
    config.write_text("tis_policy: current\nrs_divergence: {token_dtv: [-0.2, 0.2]}\ntis_upper_bound: 485165195.4\n")
    args = reference_host.parse_args(["--use-tis", "--loss-type", "reinforce", "--custom-tis-function-path", entry,
                            "--custom-config-path", str(config), "--pass-current-log-probs"])
    gaps_rollout, advantages = [1.0, -1.0, 1.0, -1.0, 0.05, 1.5], [1.0, -1.0, -1.0, 1.0, 1.0, 0.0]
    batch, current = make_batch([[0.0] * 6], [gaps_rollout], [advantages], seed=3)
    _, metrics, (grad,) = grads(args, batch, current)
    p = current[0].detach().double().exp()
    delta = p - (current[0].detach().double() - torch.tensor(gaps_rollout, dtype=torch.float64)).exp()
    masked = [(a > 0 and d > 0.2) or (a < 0 and d < -0.2) for a, d in zip(advantages, delta.tolist())]
    assert masked[:4] == [True, True, False, False]  # both signs masked; the wrong-direction twins kept
    want = [0.0 if m else -a * math.exp(g) / 6 for a, g, m in zip(advantages, gaps_rollout, masked)]
    assert grad.tolist() == pytest.approx(want, rel=1e-5)
    assert float(metrics["mis_rs_token_dtv_masked_token_fraction"]) == pytest.approx(sum(masked) / 6)


def test_a_correction_function_with_an_explicit_signature_gets_only_what_it_names(tmp_path):
    """The host's optional kwargs (advantages, lags, the current policy) go to a function with **kwargs whole, and to
    one with an explicit signature only as far as it names them; cur_log_probs it cannot take is an error."""
    plugin_file = tmp_path / "strict.py"
    plugin_file.write_text(
        "import torch\n"
        "def scaled(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,\n"
        "           response_lengths, parallel_state=None, max_seq_lens=None, version_lags=None):\n"
        "    return pg_loss * 0.5, list(loss_masks), {'seen_lag': torch.full_like(pg_loss, float(version_lags[0]))}\n"
        "def identity(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,\n"
        "             response_lengths, parallel_state=None, max_seq_lens=None):\n"
        "    return pg_loss, list(loss_masks), {}\n")
    batch, current = make_batch([[0.1, -0.2]], [[0.3, 0.0]], [[1.0, -1.0]])
    batch = dict(batch, version_lags=[2])
    losses = {}
    for name in ("scaled", "identity"):
        args = reference_host.parse_args(["--use-tis", "--custom-tis-function-path", f"{plugin_file}:{name}"])
        losses[name], metrics = reference_host.policy_loss(args, batch, current)
    assert float(losses["scaled"].detach()) == pytest.approx(0.5 * float(losses["identity"].detach()), rel=1e-6)
    assert float(metrics.get("seen_lag", 0.0)) == 0.0 and "ois" in metrics  # identity returns no metric
    args = reference_host.parse_args(["--use-tis", "--custom-tis-function-path", f"{plugin_file}:scaled"])
    # the lag it named
    assert float(reference_host.policy_loss(args, batch, current)[1]["seen_lag"]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="takes no cur_log_probs"):
        reference_host.policy_loss(reference_host.parse_args(["--use-tis", "--loss-type", "reinforce",
                                                              "--pass-current-log-probs", "--custom-tis-function-path",
                                                              f"{plugin_file}:identity"]), batch, current)
    assert reference_host.optional_kwargs_taken(lambda **kwargs: None, {"advantages": 1}) == {"advantages": 1}


# --------------------------------------------------------------------------- split rollouts: the hosts' denominators
def test_split_rollouts_divide_by_the_whole_rollouts_token_count():
    """Two samples of one rollout (2 and 3 trained tokens) and a third alone: the loss is the rollout's token mean
    plus the third's mean, by hand, whether the batch gives rollout_ids or the hosts' rollout_mask_sums."""
    batch, current = make_batch([[0.0, 0.0], [0.0, 0.0, 0.0], [0.0]], [[0.0, 0.0], [0.0, 0.0, 0.0], [0.0]],
                                [[1.0, 2.0], [3.0, -1.0, 4.0], [5.0]])
    args = args_for("--loss-type", "reinforce", "--use-rollout-logprobs")
    values = [[float(v) for v in c.detach()] for c in current]
    adv = [[1.0, 2.0], [3.0, -1.0, 4.0], [5.0]]
    per_token = [[-a * v for a, v in zip(aa, vv)] for aa, vv in zip(adv, values)]
    want = (sum(per_token[0]) + sum(per_token[1])) / 5 + per_token[2][0] / 1
    for form in ({"rollout_ids": [7, 7, 8]}, {"rollout_mask_sums": [torch.tensor(5.0), torch.tensor(5.0), 1.0]}):
        loss, _ = reference_host.policy_loss(args, dict(batch, **form), current)
        assert float(loss) == pytest.approx(want, rel=1e-6), form
    loss, _ = reference_host.policy_loss(args, batch, current)  # without them: each sample's own mean
    assert float(loss) == pytest.approx(sum(per_token[0]) / 2 + sum(per_token[1]) / 3 + per_token[2][0], rel=1e-6)
    assert reference_host.sample_denominators({"rollout_ids": ["a", "b", "a"]}, [torch.ones(2), torch.ones(4),
                                                                       torch.tensor([1.0, 0.0])]).tolist() == [3, 4, 3]
    with pytest.raises(ValueError, match=r"rollout_ids'\] has 2 entries but the batch has 3 sequences"):
        reference_host.sample_denominators({"rollout_ids": [1, 2]}, [torch.ones(1)] * 3)
    with pytest.raises(ValueError, match=r"^sequence 1: batch\['rollout_mask_sums'\]\[1\]=nan is invalid"):
        reference_host.sample_denominators({"rollout_mask_sums": [1.0, float("nan")]}, [torch.ones(1)] * 2)
