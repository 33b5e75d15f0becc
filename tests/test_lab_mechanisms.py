"""The lab's production mismatch mechanisms, each real arithmetic: MoE routing in the engine dtype (and router
replay), truncated sampling with full or processed log-probs, fp8 weights."""

import math

import pytest
import torch

from miles_mis.lab import task
from miles_mis.lab.engine import FP8_MAX, RolloutEngine, quantize_fp8, truncate_distribution
from miles_mis.lab.model import ModelConfig, TinyGPT, choose_experts, sequence_log_probs


def _moe_model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16, moe_experts=8, moe_top_k=2))


def _rollout(engine, prompts):
    responses, log_probs = engine.generate(prompts, 8)
    return [torch.cat([p, r]) for p, r in zip(prompts, responses)], log_probs


def _routing_differences(model, sequences, routing):
    """Fraction of (layer, position) decisions where the trainer's own router picks another expert set."""
    differ = total = 0
    for sequence, engine_choices in zip(sequences, routing):
        _, own = model.forward_with_routing(sequence[None])
        own = own[:, 0, :engine_choices.shape[1]]
        differ += int((own.sort(-1).values != engine_choices.sort(-1).values).any(-1).sum())
        total += own.shape[0] * own.shape[1]
    return differ / total


def test_near_tie_router_logits_pick_other_experts_in_bf16():
    # experts 0 and 1 are 1e-3 apart: float32 tells them apart, bf16 (8 bits of mantissa) rounds both to 4.0
    logits = torch.tensor([[4.0, 4.001, 1.0, 3.0]])
    assert choose_experts(logits, 1).tolist() == [[1]]
    assert logits.bfloat16()[0, 0] == logits.bfloat16()[0, 1]
    replay = torch.tensor([[0]])
    assert choose_experts(logits, 1, replay).tolist() == [[0]]  # a recorded choice wins
    assert choose_experts(logits, 1, torch.tensor([[-1]])).tolist() == [[1]]  # none recorded: the router's


def test_bf16_engine_routes_some_tokens_elsewhere_and_replay_removes_it():
    model = _moe_model()
    prompts = task.make_prompts(64, 6, torch.Generator().manual_seed(0))
    fp32 = RolloutEngine(model, "fp32", seed=0)
    sequences, _ = _rollout(fp32, prompts)
    assert _routing_differences(model, sequences, fp32.last_routing) == 0.0  # same precision: same experts

    bf16 = RolloutEngine(model, "bf16", seed=0)
    sequences, rollout = _rollout(bf16, prompts)
    assert _routing_differences(model, sequences, bf16.last_routing) > 0.0
    own = sequence_log_probs(model, sequences, [8] * 64, 1.0)
    replayed = sequence_log_probs(model, sequences, [8] * 64, 1.0, routing=bf16.last_routing)
    used = [model.forward_with_routing(s[None], _replay_of(model, r, s.numel()))[1][:, 0, :r.shape[1]]
            for s, r in zip(sequences, bf16.last_routing)]
    assert all(torch.equal(u, r) for u, r in zip(used, bf16.last_routing))  # replay uses the engine's experts
    gap_own = torch.cat([a - b for a, b in zip(own, rollout)]).abs().mean()
    gap_replayed = torch.cat([a - b for a, b in zip(replayed, rollout)]).abs().mean()
    assert gap_replayed < gap_own  # what is left is the bf16 arithmetic alone


def _replay_of(model, choices, length):
    replay = torch.full((choices.shape[0], 1, length, choices.shape[2]), -1, dtype=torch.long)
    replay[:, 0, :choices.shape[1]] = choices
    return replay


def test_truncate_distribution_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    torch.testing.assert_close(truncate_distribution(probs, 0, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(truncate_distribution(probs, 0, 0.9), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    torch.testing.assert_close(truncate_distribution(probs, 1, 1.0), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(truncate_distribution(probs, 3, 0.9), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    torch.testing.assert_close(truncate_distribution(probs, 0, 0.3), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert truncate_distribution(probs, 0, 1.0) is probs


@pytest.mark.parametrize("source", ["full", "processed"])
def test_top_p_engine_reports_the_full_or_the_truncated_log_probs(source):
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16))
    prompts = task.make_prompts(32, 6, torch.Generator().manual_seed(1))
    engine = RolloutEngine(model, "fp32", seed=0, top_p=0.7, logprob_source=source)
    sequences, reported = _rollout(engine, prompts)
    full = sequence_log_probs(model, sequences, [8] * 32, 1.0)
    for sequence, got, want in zip(sequences, reported, full):
        logits = model(sequence[None])[0, 7:sequence.numel() - 1]
        nucleus = truncate_distribution(torch.softmax(logits, -1), 0, 0.7)
        sampled = sequence[8:]
        assert bool((nucleus.gather(1, sampled[:, None]) > 0).all()), "every sampled token is in the nucleus"
        if source == "full":  # the ratio looks perfect although the tail can never be sampled
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        else:  # log of the renormalised nucleus: log p − log Z, Z the nucleus mass (< 1 when the tail is cut)
            torch.testing.assert_close(got, nucleus.gather(1, sampled[:, None]).squeeze(1).log(), atol=2e-5, rtol=0)
            assert bool((got >= want - 2e-5).all())


def test_fp8_quantisation_error_is_within_e4m3_rounding():
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    quantized = quantize_fp8(weight)
    scale = weight.abs().amax(-1, keepdim=True) / FP8_MAX
    scaled = (weight / scale).abs()
    error = (quantized - weight).abs()
    normal = scaled >= 2.0 ** -6  # e4m3's smallest normal: below it the spacing is the subnormal step 2^-9
    assert bool((error[normal] <= weight.abs()[normal] * 2.0 ** -4 * (1 + 1e-6)).all())
    assert bool((error[~normal] <= scale.expand_as(weight)[~normal] * 2.0 ** -10 * (1 + 1e-6)).all())
    torch.testing.assert_close(quantized.abs().amax(-1), weight.abs().amax(-1))  # the row's max is exact
    assert 0.005 < float((error / weight.abs()).median()) < 2.0 ** -4  # typical e4m3 error: about 2^-6
    assert not torch.equal(quantized, weight)


def test_fp8_engine_disagrees_more_than_bf16():
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16))
    prompts = task.make_prompts(32, 6, torch.Generator().manual_seed(2))
    gaps = {}
    for quant in ("none", "fp8"):
        sequences, reported = _rollout(RolloutEngine(model, "bf16", quant, seed=0), prompts)
        full = sequence_log_probs(model, sequences, [8] * 32, 1.0)
        gaps[quant] = float(torch.cat([a.detach() - b for a, b in zip(full, reported)]).abs().mean())
    assert gaps["fp8"] > 2 * gaps["none"] > 0, gaps
    assert math.isfinite(gaps["fp8"]) and gaps["fp8"] < 0.5, gaps


def test_reverse_task_targets_and_rewards():
    prompt = torch.tensor([task.BOS, 3, 1, 2, task.SEP])
    assert task.target(prompt, "reverse").tolist() == [2, 1, 3, task.EOS]
    assert task.reward(prompt, torch.tensor([2, 1, 3, task.EOS]), "reverse") == 1.0
    assert task.reward(prompt, torch.tensor([1, 2, 3, task.EOS]), "reverse") == 0.5  # 3 and EOS right of 4
    long_prompt = task.make_prompts(1, 64, torch.Generator().manual_seed(0))[0]
    assert task.target(long_prompt, "reverse").numel() == 65  # the long-response case
    with pytest.raises(ValueError, match="allowed values are sort, reverse"):
        task.target(prompt, "rotate")


# --------------------------------------------------------------------------- the lab's flags
def _lab(tmp_path, *flags, name="run"):
    from miles_mis.lab.train import parse_args, train

    argv = ["--steps", "1", "--sft-steps", "5", "--prompts-per-step", "8", "--quiet",
            "--out-dir", str(tmp_path / name), *flags]
    return train(parse_args(argv))[-1]


def test_router_replay_removes_the_routing_part_of_the_mismatch(tmp_path):
    """Same seed, same first batch: replaying the engine's experts leaves only the arithmetic mismatch."""
    flags = ("--moe-experts", "8", "--rollout-weight-quant", "fp8")
    natural = _lab(tmp_path, *flags, name="natural")
    replayed = _lab(tmp_path, *flags, "--router-replay", name="replay")
    assert natural["routing_mismatch"] > 0.01  # the trainer's own router disagrees on some decisions
    assert replayed["raw_k3"] < natural["raw_k3"] / 2


def test_lab_runs_every_mechanism_with_the_adaptive_bound(tmp_path):
    row = _lab(tmp_path, "--task", "reverse", "--num-digits", "20", "--rollout-top-p", "0.9",
               "--rollout-top-k", "5", "--rollout-logprob-source", "processed", "--rollout-weight-quant", "fp8",
               "--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp",
               "--mis-set", "tis_upper_bound=auto", "--mis-set", "tis_auto_target_ess=0.99")
    assert row["response_length"] > 10 and 0.0 <= row["reward"] <= 1.0
    assert 1.2 <= row["mis_tis_upper_bound_effective"] <= 20.0
    # processed log-probs of a truncated sampler: π_rollout > π_train on the sampled tokens, so ℓ < 0 on average
    assert row["raw_kl"] > 0


@pytest.mark.parametrize("flags, message", [
    (("--router-replay",), "needs a MoE model"),
    (("--moe-experts", "4", "--moe-top-k", "5"), "1 <= --moe-top-k <= --moe-experts"),
    (("--rollout-top-p", "0"), r"--rollout-top-p in \(0, 1\]"),
    (("--rollout-top-k", "-1"), "--rollout-top-k >= 0"),
])
def test_lab_flag_errors(flags, message):
    from miles_mis.lab.train import parse_args

    with pytest.raises(ValueError, match=message):
        parse_args(list(flags))
