"""The score-centered loss from a rank's logits rows: equal, in loss and in the logits' gradient, to taking each
response token's row, its log-softmax (or its support's) and the per-token estimator; at TP 2 equal to one rank."""

import pytest
import torch
import torch.distributed as dist
from cp_harness import spawn

from miles_mis.centering import Candidates, VocabShard, Weighting, centered_loss, centered_loss_from_logits
from miles_mis.parallel.distributed import Group

ROWS, PADDED, VOCAB = 9, 8, 7
RESPONSE_ROWS = [1, 2, 3, 6, 7]  # the logits rows that score the 5 response tokens (rows 0, 4, 5, 8: prompt, padding)
WEIGHTING = Weighting("tis", tis_clip=1.5)


def case(seed=0, support=False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, PADDED, generator=generator, dtype=torch.float64) * 2
    tokens = torch.randint(0, VOCAB, (5,), generator=generator)
    ids = torch.stack([torch.randperm(VOCAB, generator=generator)[:3] for _ in range(5)])
    ids[1, 2] = -1
    ids[3, 0] = tokens[3]  # the sampled token among the candidates
    if support:  # the engine sampled from the support it recorded: the sampled token is always one of them
        for n in range(5):
            if not (ids[n] == tokens[n]).any():
                ids[n, 0] = tokens[n]
    rollout_candidates = torch.log(torch.rand(5, 3, generator=generator, dtype=torch.float64) * 0.3)
    rollout_candidates = rollout_candidates.masked_fill(ids < 0, float("-inf"))
    rollout = torch.log(torch.rand(5, generator=generator, dtype=torch.float64) * 0.5 + 0.05)
    advantages = torch.randn(5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    return logits, tokens, Candidates(ids, rollout_candidates.float().double()), rollout, advantages, mask


def per_token(logits, tokens, candidates, rollout, advantages, mask, temperature, support):
    """The reference: each response token's own row, its log-softmax (over its support in support mode), gathered."""
    rows = []
    for n, row in enumerate(RESPONSE_ROWS):
        x = logits[row, :VOCAB] / temperature
        if support:
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[candidates.ids[n][candidates.ids[n] >= 0]] = False
            x = x.masked_fill(outside, float("-inf"))
        rows.append(torch.log_softmax(x, 0))
    log_p = torch.stack(rows)
    sampled = log_p.gather(1, tokens[:, None])[:, 0]
    chosen = torch.where(candidates.used, log_p.gather(1, candidates.ids.clamp(min=0)), 0.0)
    return centered_loss(sampled, rollout, chosen, candidates.log_probs, candidates.used, advantages, mask, WEIGHTING)


@pytest.mark.parametrize("support", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_from_logits_equals_the_per_token_rows(support, temperature):
    logits, tokens, candidates, rollout, advantages, mask = case(support=support)
    upstream = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_logits = logits.clone().requires_grad_(True)
    want = per_token(want_logits, tokens, candidates, rollout, advantages, mask, temperature, support)
    (want.token_loss * upstream).sum().backward()
    got_logits = logits.clone().requires_grad_(True)
    got = centered_loss_from_logits(got_logits, torch.tensor(RESPONSE_ROWS), tokens, candidates, rollout, advantages,
                                    mask, WEIGHTING, VocabShard(vocab_size=VOCAB), temperature, support)
    (got.token_loss * upstream).sum().backward()
    assert torch.allclose(got.token_loss, want.token_loss, rtol=0, atol=1e-12)
    assert torch.allclose(got.tail_ratio, want.tail_ratio, rtol=1e-12, atol=0)
    assert torch.allclose(got_logits.grad, want_logits.grad, rtol=0, atol=1e-12)
    assert got_logits.grad[[0, 4, 5, 8]].abs().max() == 0.0  # rows scoring no response token


def _tensor_parallel(rank, size, support):
    logits, tokens, candidates, rollout, advantages, mask = case(support=support)
    whole = logits.clone().requires_grad_(True)
    want = centered_loss_from_logits(whole, torch.tensor(RESPONSE_ROWS), tokens, candidates, rollout, advantages,
                                     mask, WEIGHTING, VocabShard(vocab_size=VOCAB), 1.0, support)
    want.token_loss.sum().backward()
    width = PADDED // size
    part = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
    shard = VocabShard(start=rank * width, vocab_size=VOCAB, group=Group(rank, size, dist.group.WORLD))
    got = centered_loss_from_logits(part, torch.tensor(RESPONSE_ROWS), tokens, candidates, rollout, advantages, mask,
                                    WEIGHTING, shard, 1.0, support)
    got.token_loss.sum().backward()
    assert torch.allclose(got.token_loss, want.token_loss, rtol=0, atol=1e-12), rank
    assert torch.allclose(part.grad, whole.grad[:, rank * width:(rank + 1) * width], rtol=0, atol=1e-12), rank


@pytest.mark.parametrize("support", [False, True])
def test_tensor_parallel_2_equals_one_rank(support):
    spawn(_tensor_parallel, 2, support)


def test_support_mode_refuses_a_sampled_token_outside_its_support():
    logits, tokens, candidates, rollout, advantages, mask = case()  # tokens 1 and 4 lie outside their candidates
    with pytest.raises(ValueError) as error:
        centered_loss_from_logits(logits, torch.tensor(RESPONSE_ROWS), tokens, candidates, rollout, advantages, mask,
                                  WEIGHTING, VocabShard(vocab_size=VOCAB), 1.0, support=True)
    assert str(error.value).startswith(f"response token 1: the sampled token {int(tokens[1])} is not in its recorded")
