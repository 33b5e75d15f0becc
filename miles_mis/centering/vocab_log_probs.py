"""The trainer's log-probs of chosen token ids (the sampled token and the K candidates) from logits whose vocabulary
may be split over tensor-parallel ranks, without gathering the vocabulary.

Megatron's vocab-parallel layout: TP rank r holds the logits of ids [r·W, (r+1)·W) (``VocabShard.start`` = r·W), and
columns at or beyond the true vocabulary size are padding. With x = logits / T on the real ids:

    m = max_v x_v            (one all-reduce MAX over the TP group; a shift, no gradient flows through it)
    S = Σ_v exp(x_v − m)     (one all-reduce SUM)
    log p(id) = x_id − m − log S   (x_id from the rank that holds it: one all-reduce SUM of the selected logits)

Backward needs no collective: each rank's logits get ∂/∂x_v = g_v·[v chosen] − softmax_v · Σ_chosen g, over its own
columns (the loss is the same on every TP rank), divided by T. An id of −1 (an unused candidate slot) has log-prob 0
and no gradient. Three all-reduces of [N] or [N, 1+K] values per call, whatever the vocabulary.

With truncated sampling (top-p, top-k) the engine samples from a support S_t it records; the candidates are S_t and
the trainer's distribution is renormalised over it (``support_log_probs``): log p(id) = x_id − log Σ_{s∈S} exp(x_s),
from the chosen logits alone (one all-reduce SUM), its gradient flowing into the chosen columns only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..parallel import distributed


@dataclass(frozen=True)
class VocabShard:
    """Which ids this rank's logits hold: ``start`` .. ``start`` + width, of ``vocab_size`` real ids (the columns
    beyond it are padding), and the tensor-parallel group the vocabulary is split over."""

    start: int = 0
    vocab_size: int | None = None  # None: every column of every rank is a real id (one rank: the logits' width)
    group: distributed.Group = distributed.SINGLE


def local_columns(ids: Tensor, shard: VocabShard, width: int) -> tuple[Tensor, Tensor]:
    """(each id's column in this rank's slice, clamped into it; whether this rank holds the id)."""
    local = ids - shard.start
    held = (ids >= 0) & (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), held


class LogNormaliser(torch.autograd.Function):
    """log Σ_v exp(x_v) over the whole vocabulary from this rank's slice ``x`` [N, W] (one all-reduce MAX, one SUM);
    the backward pass gives each rank's slice softmax · g, with no collective."""

    @staticmethod
    def forward(ctx, scaled: Tensor, group: distributed.Group) -> Tensor:
        shift = distributed.all_reduce_max(scaled.detach().amax(dim=1), group)
        exp = (scaled.detach() - shift[:, None]).exp()
        normaliser = distributed.all_reduce_sum(exp.sum(dim=1), group)
        ctx.save_for_backward(exp.div_(normaliser[:, None]))
        return shift + normaliser.log()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (softmax,) = ctx.saved_tensors
        return softmax * grad[:, None], None


class ChosenLogits(torch.autograd.Function):
    """x at ``ids`` [N, J] from this rank's ``logits`` [N, W] slice, summed over the TP group (each id is held by one
    rank; −1: 0); the backward pass puts each rank's share back into its own columns, with no collective."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, shard: VocabShard) -> Tensor:
        width = logits.shape[1]
        local, held = local_columns(ids, shard, width)
        chosen = torch.where(held, logits.detach().gather(1, local), 0.0)
        ctx.save_for_backward(local, held)
        ctx.width = width
        return distributed.all_reduce_sum(chosen, shard.group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        local, held = ctx.saved_tensors
        out = grad.new_zeros((grad.shape[0], ctx.width)).scatter_add_(1, local, torch.where(held, grad, 0.0))
        return out, None, None


def selected_log_probs(logits: Tensor, ids: Tensor, shard: VocabShard = VocabShard(),
                       temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) at ``ids`` [N, J] (−1: an unused slot, log-prob 0), differentiable in ``logits``
    [N, W] (this rank's vocabulary columns). A ValueError names what is wrong; the checks read only ``ids`` and the
    settings, which are the same on every TP rank, so every rank raises together, before any collective."""
    _check(logits, ids, shard, temperature)
    scaled = _scaled(logits, temperature)
    if shard.vocab_size is not None:  # Megatron pads the vocabulary: padded columns are no ids
        columns = torch.arange(shard.start, shard.start + logits.shape[1], device=logits.device)
        scaled = scaled.masked_fill(columns >= shard.vocab_size, float("-inf"))
    chosen = ChosenLogits.apply(scaled, ids.long(), shard)
    return torch.where(ids >= 0, chosen - LogNormaliser.apply(scaled, shard.group)[:, None], 0.0)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / T in float32 (float64 logits stay float64)."""
    return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature


def _check(logits: Tensor, ids: Tensor, shard: VocabShard, temperature: float) -> None:
    """The arguments' one-line errors (from ``ids`` and settings only: the same on every TP rank)."""
    if not (temperature > 0):
        raise ValueError(f"temperature={temperature!r}: a sampling temperature > 0")
    if logits.ndim != 2 or ids.ndim != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)}: expected [N, W] and [N, J]")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids have dtype {ids.dtype}: expected int32 or int64 token ids")
    vocab = shard.vocab_size if shard.vocab_size is not None else logits.shape[1] * shard.group.size
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= vocab):
        bad = int(ids[(ids < -1) | (ids >= vocab)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab}) (-1: an unused slot)")



def support_log_probs(logits: Tensor, ids: Tensor, shard: VocabShard = VocabShard(),
                      temperature: float = 1.0) -> Tensor:
    """Log-probs renormalised over each row's recorded support: ``ids`` [N, 1+K] holds the sampled token in column 0
    and the support in columns 1.. (−1: unused). Every used column's log-prob is x_id − log Σ_support exp(x_s), with
    x = logits / T; a row without support gives 0 everywhere (and no gradient)."""
    _check(logits, ids, shard, temperature)
    chosen = ChosenLogits.apply(_scaled(logits, temperature), ids.long(), shard)
    in_support = ids[:, 1:] >= 0
    normaliser = torch.logsumexp(chosen[:, 1:].masked_fill(~in_support, float("-inf")), dim=1)
    has_support = in_support.any(dim=1, keepdim=True)
    used = (ids >= 0) & has_support
    return torch.where(used, chosen - torch.where(has_support[:, 0], normaliser, 0.0)[:, None], 0.0)
