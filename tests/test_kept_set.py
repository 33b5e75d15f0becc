"""Sampling-mask replay in the lab (miles_mis/lab/kept_set.py): log-probs over a kept set against a slow reference
and by hand, the whole vocabulary bit for bit, the sampled token always kept, and the trainer's flag end to end."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_mis.lab import kept_set
from miles_mis.lab.kept_set import KeptSets, kept_log_probs, recompute_sets, truncation_keep


def slow_kept_log_prob(logits: list[float], target: int, kept: list[int]) -> float:
    """log p_S(y) written out: z_y − log Σ_{v∈S} e^{z_v}, in float64."""
    peak = max(logits[v] for v in kept)
    return logits[target] - (peak + math.log(sum(math.exp(logits[v] - peak) for v in kept)))


def test_hand_case_with_a_known_kept_set():
    # z = log(0.5, 0.3, 0.15, 0.05): top-p 0.7 keeps {0, 1}; p_S(1) = 0.3 / 0.8
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = truncation_keep(torch.softmax(logits, -1), 0, 0.7)
    assert keep.tolist() == [[True, True, False, False]]
    sets = KeptSets.from_mask(keep, torch.tensor([1]))
    assert sets.ids.tolist() == [0, 1] and sets.offsets.tolist() == [0, 2] and sets.forced == 0
    assert float(kept_log_probs(logits, torch.tensor([1]), sets)) == pytest.approx(math.log(0.3 / 0.8), rel=1e-6)
    # top-k 3 keeps {0, 1, 2}; the sampled token 3 outside it is added (and counted)
    forced = recompute_sets(logits, torch.tensor([3]), 3, 1.0)
    assert forced.ids.tolist() == [0, 1, 2, 3] and forced.forced == 1


@st.composite
def rows(draw):
    n, vocab = draw(st.integers(1, 6)), draw(st.integers(2, 40))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * draw(st.sampled_from([0.1, 1.0, 5.0]))
    targets = torch.randint(0, vocab, (n,), generator=gen)
    keep = torch.rand(n, vocab, generator=gen) < draw(st.floats(0.0, 1.0))
    return logits, targets, keep


@settings(max_examples=60, deadline=None)
@given(rows())
def test_kept_log_probs_equal_the_slow_reference_and_always_keep_the_sampled_token(batch):
    logits, targets, keep = batch
    sets = KeptSets.from_mask(keep, targets)
    got = kept_log_probs(logits, targets, sets)
    for t in range(len(sets)):
        ids = sets.ids[sets.offsets[t]:sets.offsets[t + 1]].tolist()
        assert int(targets[t]) in ids  # the sampled token is always kept
        assert ids == sorted(set(ids))
        want = slow_kept_log_prob(logits[t].double().tolist(), int(targets[t]), ids)
        assert float(got[t]) == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert float(got[t]) <= 1e-6  # a probability over S: at most 1


@settings(max_examples=40, deadline=None)
@given(rows())
def test_the_whole_vocabulary_is_the_full_log_prob_bit_for_bit(batch):
    logits, targets, _ = batch
    whole = KeptSets.from_mask(torch.ones_like(logits, dtype=torch.bool), targets)
    assert torch.equal(kept_log_probs(logits, targets, whole), kept_set.score(logits, targets, None))


def test_sets_split_and_join_round_trip():
    keep = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    sets = KeptSets.from_mask(keep, torch.tensor([0, 1, 2]))
    first, second = sets.split([1, 2])
    assert first.ids.tolist() == [0, 2] and second.offsets.tolist() == [0, 1, 4]
    joined = KeptSets.cat([first, second])
    assert torch.equal(joined.ids, sets.ids) and torch.equal(joined.offsets, sets.offsets)
    assert sets.masks_equal(joined).all()


def test_the_engine_records_exactly_the_set_it_sampled_from():
    from miles_mis.lab import task
    from miles_mis.lab.engine import RolloutEngine
    from miles_mis.lab.model import ModelConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16))
    engine = RolloutEngine(model, "fp32", top_k=4, top_p=0.8, logprob_source="processed", seed=3)
    prompts = torch.randint(0, 10, (6, 4))
    responses, log_probs = engine.generate(prompts, 6)
    assert len(engine.last_kept) == 6
    for response, processed, sets in zip(responses, log_probs, engine.last_kept):
        assert len(sets) == response.numel() and sets.forced == 0  # the engine's own sample is always in its set
        assert bool((sets.sizes <= 4).all())
    # scoring through the policy's path: the same weights in fp32 reproduce the processed log-probs
    from miles_mis.lab.model import sequence_log_probs

    sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    trainer = sequence_log_probs(model, sequences, [4] * 6, 1.0, kept=engine.last_kept)
    for got, want in zip(trainer, log_probs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _lab(tmp_path, *flags, name):
    from miles_mis.lab.train import parse_args, train

    argv = ["--steps", "2", "--prompts-per-step", "4", "--sft-steps", "10", "--quiet",
            "--out-dir", str(tmp_path / name), "--rollout-top-p", "0.9", "--use-tis", "--custom-tis-function-path",
            "miles_mis.compute_mis_weights_with_cp", *flags]
    return train(parse_args(argv))


def test_replay_removes_the_truncation_bias_and_the_detector_sees_it(tmp_path):
    """Processed top-p log-probs: without replay π_old differs from the engine by the log kept mass on every token
    (the detector fires); with the engine's sets or recomputed ones the fp32-trained engine matches again."""
    off = _lab(tmp_path, "--rollout-logprob-source", "processed", "--rollout-dtype", "fp32", name="off")
    engine = _lab(tmp_path, "--rollout-logprob-source", "processed", "--rollout-dtype", "fp32",
                  "--sampling-mask", "engine", name="engine")
    recompute = _lab(tmp_path, "--rollout-logprob-source", "processed", "--rollout-dtype", "fp32",
                     "--sampling-mask", "recompute", name="recompute")
    assert all(r["mis_unreplayed_truncation"] == 1.0 and r["raw_k3"] > 1e-4 for r in off)
    for run in (engine, recompute):
        assert all(r["mis_unreplayed_truncation"] == 0.0 and r["raw_k3"] < 1e-8 for r in run)
        # the plugin's metric is per minibatch (averaged over the step's two), the lab's over the whole batch
        assert all(r["mis_sampling_mask_size_mean"] == pytest.approx(r["kept_set_size_mean"], rel=0.1) for r in run)
    assert all(r["kept_set_differs_fraction"] < 0.05 and r["kept_set_forced_fraction"] == 0.0 for r in recompute)


@pytest.mark.parametrize("flags, message", [
    (["--sampling-mask", "engine", "--rollout-top-p", "1.0"], "needs truncated sampling"),
    (["--sampling-mask", "recompute"], "with --rollout-logprob-source full"),
])
def test_sampling_mask_refusals(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        _lab(tmp_path, *flags, name="x")
