"""benchmarks/lab_clip_block.py: PPO-clip's blocked tokens and the per-class sums of a hand-made dump, by hand."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import load_benchmark


@pytest.fixture(scope="module")
def clip_block():
    return load_benchmark("lab_clip_block")


def _sample(train_probs, log_ratio, advantage, mask=None):
    train = torch.tensor(train_probs).log()
    n = len(train_probs)
    return {"response_length": n, "train_log_probs": train.float(),
            "rollout_log_probs": (train - torch.tensor(log_ratio, dtype=torch.float64)).float(),
            "advantages": torch.full((n,), float(advantage)),
            "local_loss_mask": torch.tensor(mask if mask is not None else [1.0] * n)}


def _dump():
    # response 0: 3 tokens under the cap of 4, so its last is a stop token; A = +1; ℓ = 0, −0.5, +0.3
    # response 1: 4 tokens (the cap: no stop token); A = −1; ℓ = +0.1, −0.3, −0.8, +0.5 (the last outside the mask)
    return {"samples": [_sample([0.5, 0.2, 0.6], [0.0, -0.5, 0.3], 1.0),
                        _sample([0.4, 0.3, 0.2, 0.1], [0.1, -0.3, -0.8, 0.5], -1.0, [1.0, 1.0, 1.0, 0.0])]}


def test_class_sums_by_hand(clip_block):
    tokens = clip_block.first_minibatch_tokens(_dump(), cap=4)
    assert tokens["stop"].tolist() == [False, False, True, False, False, False]
    sums = clip_block.class_sums(tokens)
    every = sums["every token"]
    # ln 1.2 = 0.182, ln 0.8 = −0.223, ln 1.5 = 0.405, ln 0.5 = −0.693
    assert every["tokens"] == 6 and every["log_ratio"] == pytest.approx(-1.2, abs=1e-6)
    assert (every["above_0.2"], every["below_0.2"], every["above_0.5"], every["below_0.5"]) == (1, 3, 0, 1)
    # blocked at 0.2: +0.3 with A > 0; −0.3 and −0.8 with A < 0 (−0.5 has A > 0: it keeps its gradient); at 0.5: −0.8
    assert (every["blocked_0.2"], every["blocked_0.5"]) == (3, 1)
    assert every["train_prob"] == pytest.approx(2.2, abs=1e-6)
    assert every["rollout_prob"] == pytest.approx(sum(p * math.exp(-ell) for p, ell in zip(
        [0.5, 0.2, 0.6, 0.4, 0.3, 0.2], [0.0, -0.5, 0.3, 0.1, -0.3, -0.8])), abs=1e-6)
    assert sums["stop token"]["tokens"] == 1 and sums["stop token"]["blocked_0.2"] == 1
    assert sums["stop token"]["log_ratio"] == pytest.approx(0.3, abs=1e-6)
    assert sums["stop token, A > 0"]["tokens"] == 1 and sums["stop token, A < 0"]["tokens"] == 0
    assert sums["other tokens"]["tokens"] == 5 and sums["other tokens"]["blocked_0.2"] == 2
    table = clip_block.table([{"seed": 0, "classes": sums}, {"seed": 1, "classes": sums}])  # pooled: shares unchanged
    assert "| every token | 12 | -0.200 | 0.167 | 0.500 | 0.500 | 0.167 | 0.367 |" in table
    assert "| stop token, A < 0 | 0 | — | — | — | — | — | — | — |" in table
    assert table.startswith("| 2 seeds (0, 1), first minibatch |")


def test_dppo_sums_by_hand(clip_block):
    """DPPO's mask at δ = 0.2 on the hand-made dump plus a stop token the engine underweights: p = 0.9, ℓ = 1
    (q = 0.9/e = 0.331, r = e), A > 0: removed, with weight min(e, 2) = 2 inside PPO and e in REINFORCE."""
    dump = _dump()
    dump["samples"].append(_sample([0.9], [1.0], 1.0))
    sums = clip_block.class_sums(clip_block.first_minibatch_tokens(dump, cap=4))
    # q = p·e^−ℓ; p − q: response 0 (A > 0): 0, −0.130, +0.156 (none above 0.2); response 1 (A < 0): +0.038, −0.105,
    # −0.245 (removed); the new stop token +0.569 (removed)
    every, stop = sums["every token"], sums["stop token, A > 0"]
    assert (every["dppo_removed"], every["dppo_removed_positive"]) == (2, 1)
    assert (stop["tokens"], stop["dppo_removed"], sums["other tokens"]["dppo_removed"]) == (2, 1, 1)
    ratios = [1.0, math.exp(-0.5), math.exp(0.3), math.exp(0.1), math.exp(-0.3), math.exp(-0.8)]
    assert every["ppo_weight"] == pytest.approx(sum(ratios) + 2.0, abs=1e-5)
    assert every["reinforce_weight"] == pytest.approx(sum(ratios) + math.e, abs=1e-5)
    assert every["ppo_weight_removed"] == pytest.approx(math.exp(-0.8) + 2.0, abs=1e-5)
    assert every["reinforce_weight_removed"] == pytest.approx(math.exp(-0.8) + math.e, abs=1e-5)
    table = clip_block.dppo_table([{"seed": 0, "classes": sums}])
    ppo_share = (math.exp(-0.8) + 2.0) / (sum(ratios) + 2.0)
    reinforce_share = (math.exp(-0.8) + math.e) / (sum(ratios) + math.e)
    assert f"| every token | 7 | {2 / 7:.3f} | 1/2 | {ppo_share:.3f} | {reinforce_share:.3f} |" in table
    assert f"| stop token, A > 0 | 2 | 0.500 | 1/1 | {2 / (sum(ratios) + 2):.3f} |" in table
    assert "| stop token, A < 0 | 0 | 0.000 | 0/0 | 0.000 | 0.000 |" in table


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.sampled_from([-1.0, 0.0, 2.0])), min_size=1, max_size=30),
       st.floats(0.01, 0.9), st.floats(0.01, 0.9))
def test_blocked_is_one_sided_and_shrinks_as_the_clip_widens(clip_block, tokens, eps_a, eps_b):
    log_ratio = torch.tensor([t[0] for t in tokens], dtype=torch.float64)
    advantages = torch.tensor([t[1] for t in tokens], dtype=torch.float64)
    narrow, wide = sorted((eps_a, eps_b))
    at_narrow, at_wide = (clip_block.blocked(log_ratio, advantages, narrow),
                          clip_block.blocked(log_ratio, advantages, wide))
    assert not (at_wide & ~at_narrow).any()  # a wider clip never blocks a token the narrower one keeps
    assert not at_narrow[advantages == 0].any()
    # the PPO loss −min(rA, clip(r)A) has zero gradient in r exactly on the blocked tokens (r away from the edges)
    ratio = log_ratio.exp().requires_grad_(True)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - narrow, 1 + narrow) * advantages).sum()
    loss.backward()
    away = ((ratio - (1 + narrow)).abs() > 1e-9) & ((ratio - (1 - narrow)).abs() > 1e-9) & (advantages != 0)
    assert torch.equal((ratio.grad == 0)[away], at_narrow[away])


def test_measure_runs_one_bypass_step_of_the_sweep_and_reads_its_first_minibatch(clip_block, monkeypatch):
    """The glue, without the engine: the child gets the sweep's bypass argv for 1 step with dumps; the row holds
    the fingerprint of its first rollout and the sums of call 0 (the first minibatch), not of call 1."""
    import json

    seen = []

    def child(argv, check):
        seen.append(argv)
        out, dumps = (Path(argv[argv.index(flag) + 1]) for flag in ("--out-dir", "--dump-details"))
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.25, "raw_k3": 0.04}) + "\n")
        (dumps / "policy_loss_debug").mkdir(parents=True)
        torch.save(_dump(), dumps / "policy_loss_debug" / "rank_0_call_0.pt")
        torch.save({"samples": [_sample([0.5], [2.0], 1.0)]}, dumps / "policy_loss_debug" / "rank_0_call_1.pt")

    monkeypatch.setattr(clip_block.subprocess, "run", child)
    row = clip_block.measure("bf16 + fp8 weights", 2, cap=4)
    argv = seen[0]
    assert "--use-rollout-logprobs" in argv and "--rollout-weight-quant" in argv
    assert argv[argv.index("--steps") + 1] == "1" and argv[argv.index("--seed") + 1] == "2"
    assert (row["seed"], row["first_reward"], row["first_raw_k3"], row["cap"]) == (2, 0.25, 0.04, 4)
    assert row["classes"]["every token"]["tokens"] == 6 and row["classes"]["stop token"]["blocked_0.2"] == 1
