"""The trainer's log-probs of chosen ids from vocabulary-parallel logits: equal to log_softmax(logits / T) gathered,
with its gradient, at one rank and at TP 2 and 3 on gloo (each rank holding a vocabulary slice, padding included)."""

import pytest
import torch
import torch.distributed as dist
from cp_harness import spawn

from miles_mis.centering.vocab_log_probs import VocabShard, selected_log_probs, support_log_probs
from miles_mis.parallel.distributed import Group

VOCAB, PADDED, ROWS = 11, 12, 5  # 11 real ids; the logits padded to 12 columns (divisible by TP 2, 3, 4)


def case(seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, PADDED, generator=generator, dtype=dtype) * 3
    ids = torch.randint(0, VOCAB, (ROWS, 4), generator=generator)
    ids[1, 2:] = -1  # unused slots
    ids[3, 1] = ids[3, 0]  # the sampled token also among the candidates
    upstream = torch.randn(ROWS, 4, generator=generator, dtype=dtype)
    return logits, ids, upstream


def dense(logits, ids, upstream, temperature):
    """The reference: a full log-softmax over the real ids, gathered; its value and gradient."""
    logits = logits.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(logits[:, :VOCAB] / temperature, dim=1)
    out = torch.where(ids >= 0, log_p.gather(1, ids.clamp(min=0)), 0.0)
    (out * upstream).sum().backward()
    return out.detach(), logits.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_rank_equals_the_dense_log_softmax(temperature):
    logits, ids, upstream = case()
    want, want_grad = dense(logits, ids, upstream, temperature)
    leaf = logits.clone().requires_grad_(True)
    got = selected_log_probs(leaf, ids, VocabShard(vocab_size=VOCAB), temperature)
    (got * upstream).sum().backward()
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(leaf.grad, want_grad, rtol=0, atol=1e-12)
    assert got[1, 2:].tolist() == [0.0, 0.0]
    assert leaf.grad[:, VOCAB:].abs().max() == 0.0  # padding columns get no gradient


def test_float32_logits_keep_their_dtype_and_agree():
    logits, ids, upstream = case(dtype=torch.float32)
    want, want_grad = dense(logits.double(), ids, upstream.double(), 1.0)
    leaf = logits.clone().requires_grad_(True)
    got = selected_log_probs(leaf, ids, VocabShard(vocab_size=VOCAB))
    (got * upstream).sum().backward()
    assert leaf.grad.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5) and torch.allclose(leaf.grad.double(), want_grad, atol=1e-5)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([[11]]), "token id 11 is outside the vocabulary [0, 11)"),
    (torch.tensor([[-2]]), "token id -2 is outside the vocabulary"),
    (torch.tensor([[1.0]]), "ids have dtype torch.float32"),
])
def test_bad_ids_are_one_line_errors(ids, message):
    with pytest.raises(ValueError) as error:
        selected_log_probs(torch.zeros(1, PADDED), ids, VocabShard(vocab_size=VOCAB))
    assert str(error.value).startswith(message)


def _tensor_parallel(rank, size, temperature):
    logits, ids, upstream = case()
    want, want_grad = dense(logits, ids, upstream, temperature)
    width = PADDED // size
    leaf = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
    shard = VocabShard(start=rank * width, vocab_size=VOCAB, group=Group(rank, size, dist.group.WORLD))
    got = selected_log_probs(leaf, ids, shard, temperature)
    (got * upstream).sum().backward()
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (rank, got, want)
    assert torch.allclose(leaf.grad, want_grad[:, rank * width:(rank + 1) * width], rtol=0, atol=1e-12), rank


@pytest.mark.parametrize("size", [2, 3])
def test_tensor_parallel_ranks_equal_one_rank(size):
    spawn(_tensor_parallel, size, 0.7)


def support_case():
    logits, ids, upstream = case(seed=3)
    support = ids.clone()
    support[:, 0] = support[:, 1]  # the sampled token is one of the support's
    support[2, 1:] = -1  # a row without support
    support[4, 2:] = -1
    return logits, support, upstream


def dense_support(logits, ids, upstream, temperature):
    """The reference: log_softmax over each row's support only (the rest at −inf), gathered."""
    logits = logits.detach().clone().requires_grad_(True)
    outside = torch.ones(ROWS, PADDED, dtype=torch.bool)
    for row in range(ROWS):
        for token in ids[row, 1:].tolist():
            if token >= 0:
                outside[row, token] = False
    log_p = torch.log_softmax((logits / temperature).masked_fill(outside, float("-inf")), dim=1)
    has = (ids[:, 1:] >= 0).any(1, keepdim=True)
    out = torch.where((ids >= 0) & has, log_p.gather(1, ids.clamp(min=0)), 0.0)
    (out * upstream).sum().backward()
    return out.detach(), logits.grad


def test_support_renormalises_over_the_recorded_support():
    logits, ids, upstream = support_case()
    want, want_grad = dense_support(logits, ids, upstream, 0.7)
    leaf = logits.clone().requires_grad_(True)
    got = support_log_probs(leaf, ids, VocabShard(vocab_size=VOCAB), 0.7)
    (got * upstream).sum().backward()
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and got[2].tolist() == [0.0] * 4
    assert torch.allclose(leaf.grad, want_grad, rtol=0, atol=1e-12)
    assert got[0, 1:].exp().sum().item() == pytest.approx(1.0)  # a full row's support carries all the mass


def _tensor_parallel_support(rank, size):
    logits, ids, upstream = support_case()
    want, want_grad = dense_support(logits, ids, upstream, 1.0)
    width = PADDED // size
    leaf = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
    shard = VocabShard(start=rank * width, vocab_size=VOCAB, group=Group(rank, size, dist.group.WORLD))
    got = support_log_probs(leaf, ids, shard)
    (got * upstream).sum().backward()
    assert torch.allclose(got, want, rtol=0, atol=1e-12), rank
    assert torch.allclose(leaf.grad, want_grad[:, rank * width:(rank + 1) * width], rtol=0, atol=1e-12), rank


def test_support_at_tensor_parallel_2_equals_one_rank():
    spawn(_tensor_parallel_support, 2)
