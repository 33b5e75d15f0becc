"""Sampling-mask replay: the kept set S_t of each sampled token, from the engine or recomputed, and log-probs over it.

With top-k/top-p the engine samples y_t from softmax(z_t / T) restricted to S_t and renormalised; its processed
log-probs are log p_S(y_t). A trainer that scores the whole vocabulary gets log p(y_t) = log p_S(y_t) + log Z_t
(Z_t = the kept mass ≤ 1), so every ratio is off by Z_t and the tail outside S_t still gets gradient. Replay
scores π_old and π_θ over the recorded set instead, fixed for the whole optimisation of the batch:

    log p_S(y) = z_y − logsumexp_{v ∈ S} z_v          (z = logits / T; y ∈ S always)

Sets travel as CSR (``ids[offsets[t]:offsets[t + 1]]`` for token t, as vLLM, SGLang, slime and miles ship them).
``--sampling-mask engine`` replays the engine's sets; ``recompute`` applies the same top-k/top-p to the trainer's
own π_old logits (NeMo-RL's approach), adding the sampled token where the trainer's set misses it (counted).
The [tokens, V] logits are only ever held a chunk of rows at a time by the callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("off", "engine", "recompute")


def truncation_keep(probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """[N, V] bool: the tokens top-k then top-p keep (SGLang/vLLM order). top-k keeps the k most likely (0 = off);
    top-p then keeps the smallest set of the most likely tokens whose probability reaches p of the kept mass
    (1.0 = off), always at least the most likely one."""
    if top_k <= 0 and top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[:, top_k:] = False
    if top_p < 1.0:
        kept_probs = sorted_probs * keep
        before = kept_probs.cumsum(-1) - kept_probs  # mass of the more likely kept tokens
        keep &= before < top_p * kept_probs.sum(-1, keepdim=True)
    return torch.zeros_like(keep).scatter(-1, order, keep)


@dataclass
class KeptSets:
    """The kept sets of n tokens in CSR form: token t keeps ``ids[offsets[t]:offsets[t + 1]]`` (int64)."""

    ids: Tensor
    offsets: Tensor  # [n + 1], offsets[0] = 0
    forced: int = 0  # tokens whose sampled token was added (a recomputed set that missed it)

    @property
    def sizes(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @classmethod
    def from_mask(cls, keep: Tensor, sampled: Tensor) -> "KeptSets":
        """The sets of a [n, V] bool mask with each row's sampled token added (``forced``: how many rows lacked it)."""
        rows = torch.arange(keep.shape[0])
        missing = int((~keep[rows, sampled]).sum())
        keep = keep.clone()
        keep[rows, sampled] = True
        ids = keep.nonzero()[:, 1]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(-1).cumsum(0)])
        return cls(ids, offsets, missing)

    @classmethod
    def cat(cls, parts: list["KeptSets"]) -> "KeptSets":
        if not parts:
            return cls(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        ids = torch.cat([p.ids for p in parts])
        sizes = torch.cat([p.sizes for p in parts])
        return cls(ids, torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]), sum(p.forced for p in parts))

    def rows(self, start: int, end: int) -> "KeptSets":
        """Tokens start..end − 1, offsets rebased to 0."""
        first, last = int(self.offsets[start]), int(self.offsets[end])
        return KeptSets(self.ids[first:last], self.offsets[start:end + 1] - first)

    def split(self, lengths: list[int]) -> list["KeptSets"]:
        out, start = [], 0
        for n in lengths:
            out.append(self.rows(start, start + n))
            start += n
        return out

    def masks_equal(self, other: "KeptSets") -> Tensor:
        """[n] bool: token t's set is the same in both (ids are in ascending order in each)."""
        same = self.sizes == other.sizes
        if bool(same.all()) and torch.equal(self.ids, other.ids):
            return same
        out = torch.zeros(len(self), dtype=torch.bool)
        for t in same.nonzero().flatten().tolist():  # only where the sizes agree; lab-side diagnostics
            a = self.ids[self.offsets[t]:self.offsets[t + 1]]
            b = other.ids[other.offsets[t]:other.offsets[t + 1]]
            out[t] = torch.equal(a, b)
        return out


def kept_log_probs(logits: Tensor, targets: Tensor, sets: KeptSets) -> Tensor:
    """log p_S(y) = z_y − logsumexp_{v∈S} z_v for [n, V] scaled logits z, [n] targets and n sets. A set holding the
    whole vocabulary gives z_y − logsumexp(z) computed exactly as the full log-prob (bit for bit)."""
    n, vocab = logits.shape
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    full = torch.logsumexp(logits, dim=-1)
    sizes = sets.sizes.to(logits.device)
    rows = torch.repeat_interleave(torch.arange(n, device=logits.device), sizes)
    values = logits[rows, sets.ids.to(logits.device)]
    peak = torch.full((n,), float("-inf"), dtype=logits.dtype, device=logits.device).scatter_reduce(
        0, rows, values, reduce="amax")
    mass = torch.zeros(n, dtype=logits.dtype, device=logits.device).index_add_(0, rows, (values - peak[rows]).exp())
    kept = mass.log() + peak
    return picked - torch.where(sizes == vocab, full, kept)


def recompute_sets(logits: Tensor, targets: Tensor, top_k: int, top_p: float) -> KeptSets:
    """The trainer's own kept sets of [n, V] scaled logits: the engine's top-k/top-p on softmax(z), the sampled token
    added where the set misses it (counted in ``forced``)."""
    return KeptSets.from_mask(truncation_keep(torch.softmax(logits.float(), dim=-1), top_k, top_p), targets)


def score(logits: Tensor, targets: Tensor, sets: KeptSets | None) -> Tensor:
    """The trainer's log-probs of ``targets``: over the whole vocabulary (``sets`` None) or over each kept set."""
    if sets is None:
        return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return kept_log_probs(logits, targets, sets)
