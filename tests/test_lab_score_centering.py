"""Score centering in the lab (lab/centering_loss.py): the minibatch laid out as its last prompt token and response
gives the loss of the whole sequences' layout; miles' sum_of_sample_mean by hand; short runs on the embedded engine;
the one-line refusals."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from miles_mis.config import MisConfig
from miles_mis.hosts.score_centering import score_centering_loss
from miles_mis.lab import centering_loss
from miles_mis.lab.model import padded_logits
from miles_mis.lab.rollout_collection import truncated_fraction
from miles_mis.lab.train import parse_args, start_run, train
from miles_mis.lab.rollout_collection import collect_rollout


def sc_yaml(tmp_path, weighting="mis"):
    path = tmp_path / "sc.yaml"
    path.write_text(f"score_centering: true\nscore_centering_is: {weighting}\n")
    return path


def lab_args(tmp_path, *flags):
    return parse_args(["--prompts-per-step", "4", "--sft-steps", "10", "--quiet", "--out-dir", str(tmp_path / "run"),
                       "--rollout-dtype", "bf16", *flags])


def test_sample_mean_reducer_by_hand():
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    reduce = centering_loss.sample_mean_reducer(masks)
    values = torch.tensor([2.0, 100.0, 4.0, 7.0, 7.0, 5.0])
    assert float(reduce(values)) == (2 + 4) / 2 + 0.0 + 5.0 / 1


@pytest.mark.parametrize("weighting", ["none", "tis", "mis"])
def test_the_shortened_layout_gives_the_whole_sequences_loss(tmp_path, weighting):
    """The lab hands each sample as (last prompt token, response); the same loss and gradient as the whole sequences
    laid out as miles packs them (thd), through the same adapter code."""
    args = lab_args(tmp_path, "--rollout-top-logprobs-num", "4", "--custom-config-path", str(sc_yaml(tmp_path,
                                                                                                      weighting)))
    run = start_run(args)
    rollout, _ = collect_rollout(run, args, 0)
    idx = [0, 3, 5, 6]
    loss, log = centering_loss.policy_loss(run.policy, args, rollout, idx)
    grads = torch.autograd.grad(loss, run.policy.parameters())

    sequences = [rollout.sequences[i] for i in idx]
    full = padded_logits(run.policy.model, sequences)
    packed = torch.cat([full[k, :s.numel()] for k, s in enumerate(sequences)])[None]
    batch = {"unconcat_tokens": sequences, "total_lengths": [s.numel() for s in sequences],
             "response_lengths": [rollout.response_lengths[i] for i in idx],
             "rollout_log_probs": [rollout.rollout_log_probs[i] for i in idx],
             "advantages": [torch.full((rollout.response_lengths[i],), float(rollout.advantages[i])) for i in idx],
             "loss_masks": [torch.ones(rollout.response_lengths[i]) for i in idx],
             "rollout_topk_token_ids": [rollout.candidates[i][0] for i in idx],
             "rollout_topk_log_probs": [rollout.candidates[i][1] for i in idx]}
    host = SimpleNamespace(qkv_format="thd", rollout_temperature=args.rollout_temperature)
    want, want_log = score_centering_loss(MisConfig.from_args(args), host, batch, packed,
                                          centering_loss.sample_mean_reducer(batch["loss_masks"]))
    want_grads = torch.autograd.grad(want, run.policy.parameters())
    assert float(loss) == pytest.approx(float(want), rel=1e-6, abs=1e-7)
    assert all(torch.allclose(g, w, atol=1e-7) for g, w in zip(grads, want_grads))
    assert {k: float(v) for k, v in log.items()} == pytest.approx({k: float(v) for k, v in want_log.items()})
    assert float(sum(g.abs().sum() for g in grads)) > 0


def test_a_short_run_logs_the_centering_metrics(tmp_path):
    history = train(lab_args(tmp_path, "--steps", "3", "--rollout-top-logprobs-num", "4", "--custom-config-path",
                             str(sc_yaml(tmp_path))))
    assert len(history) == 3
    for row in history:
        assert all(math.isfinite(v) for v in row.values())
        assert 0 < row["mis_sc_rollout_head_mass"] <= 1 + 1e-3 and 0 < row["mis_sc_train_head_mass"] <= 1 + 1e-6
        assert row["mis_sc_tail_ratio"] > 0 and 0.0 <= row["truncated_fraction"] <= 1.0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_without_candidates_the_run_stops_naming_the_flag(tmp_path):
    args = lab_args(tmp_path, "--steps", "1", "--custom-config-path", str(sc_yaml(tmp_path)))
    with pytest.raises(ValueError, match="needs the engine's top-K candidates: run with --rollout-top-logprobs-num"):
        train(args)


def test_context_parallel_is_refused(tmp_path):
    args = lab_args(tmp_path, "--steps", "1", "--rollout-top-logprobs-num", "4", "--custom-config-path",
                    str(sc_yaml(tmp_path)))
    args.context_parallel_size = 2
    with pytest.raises(ValueError, match="score_centering: true with --context-parallel-size > 1"):
        start_run(args)


def test_truncated_fraction_by_hand():
    responses = [torch.tensor([5, 6, 2]), torch.tensor([5, 6, 7]), torch.tensor([5]), torch.tensor([1, 2, 3, 4])]
    # budget 3, stop token 2: the first ends in a stop token at the budget, the second and fourth were cut
    assert truncated_fraction(responses, 3, (2,)) == 0.5
    assert truncated_fraction(responses, 3) == 0.75
