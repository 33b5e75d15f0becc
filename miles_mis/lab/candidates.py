"""The engine's score-centering candidates (``--rollout-top-logprobs-num K``): each response token's K most likely
tokens of the distribution whose log-probs the engine reports, with those log-probs, as miles records them
(``rollout_topk_token_ids`` / ``rollout_topk_log_probs``: ids [R, K] int64, unused -1; log-probs [R, K] float32,
unused -inf). Both rollout engines build them here: the embedded one from its own probabilities
(``candidate_slots``), the vLLM one from the flat log-prob lists vLLM returns (``candidates_of``). In support mode
(processed log-probs under top-k/top-p) the candidates are the kept set, and a kept set larger than K is an error
(``support_overflow``).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..centering.candidates import UNUSED_ID


def check_top_logprobs_num(k: int) -> None:
    """Refuse a negative ``--rollout-top-logprobs-num`` (one line)."""
    if k < 0:
        raise ValueError(f"--rollout-top-logprobs-num {k} is invalid: allowed values are >= 0 (0 = no candidates "
                         "recorded)")


def candidate_slots(ids: Tensor, log_probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Ranked entries [N, M] (M <= K) -> the candidate tensors [N, K] score centering reads (int64 ids, float32
    log-probs): an entry with a finite log-prob is a used slot, any other (-inf: outside a truncated distribution's
    support) and the K - M padding slots are unused (``UNUSED_ID``, -inf)."""
    used = torch.isfinite(log_probs)
    ids = torch.where(used, ids.long(), UNUSED_ID)
    log_probs = torch.where(used, log_probs.float(), -math.inf)
    pad = (0, k - ids.shape[1])
    return F.pad(ids, pad, value=UNUSED_ID), F.pad(log_probs, pad, value=-math.inf)


def support_overflow(k: int, overflowing: int, tokens: int, top_k: int, vocab_size: int) -> str:
    """The one-line error of support mode when ``overflowing`` of ``tokens`` response tokens were sampled from a kept
    set larger than K: it names the K that fits every step (top-k's k, else the vocabulary)."""
    bound = (f"{min(top_k, vocab_size)}, --rollout-top-k" if top_k > 0 else
             f"{vocab_size}, the vocabulary: top-p alone bounds no kept set")
    return (f"--rollout-top-logprobs-num {k}: {overflowing} of {tokens} response tokens were sampled from a "
            f"top-k/top-p kept set of more than {k} tokens, which {k} candidates cannot hold (with processed "
            f"log-probs the candidates are the kept set); allowed values here are >= {bound}")


def candidates_of(outputs, k: int, requested: int, top_k: int, vocab_size: int) -> list[tuple[Tensor, Tensor]]:
    """Each finished request's candidates: (ids [R, K] int64, log-probs [R, K] float32), the ranks 1..K vLLM
    returned for each of its R response tokens in rank order, unused slots -1 / -inf.

    The requests were sent with ``logprobs=requested`` and ``flat_logprobs=True``, so each token's entries lie in one
    flat list in the sampler's order (``Sampler.gather_logprobs``, ``append_logprobs_for_next_position``): the sampled
    token with its own rank (which may exceed K: it is not a candidate then), then the top ``requested`` by rank 1, 2,
    ... — read here as one [Σ R, requested + 1] table, no loop over tokens. An entry whose log-prob is -inf (processed
    log-probs outside the top-k/top-p kept set) is an unused slot. ``requested`` = K + 1 (support mode, K below the
    vocabulary): the K+1-th entry witnesses a kept set larger than K, a ValueError counting the tokens it hit
    (:func:`support_overflow`: ``top_k`` and ``vocab_size`` name the K that holds every kept
    set). ``requested`` < K (K above the vocabulary): the slots past it are unused."""
    flats = [output.outputs[0].logprobs for output in outputs]
    lengths = [len(flat) for flat in flats]
    width = requested + 1
    ids = torch.tensor(list(itertools.chain.from_iterable(flat.token_ids for flat in flats)), dtype=torch.long)
    log_probs = torch.tensor(list(itertools.chain.from_iterable(flat.logprobs for flat in flats)), dtype=torch.float32)
    ranks = torch.tensor(list(itertools.chain.from_iterable(flat.ranks for flat in flats)), dtype=torch.long)
    if ids.numel() != width * sum(lengths) or not bool((ranks.view(-1, width)[:, 1:] == torch.arange(1, width)).all()):
        raise RuntimeError(f"vLLM returned its log-probs in another layout than 0.32's flat_logprobs (the sampled "
                           f"token, then ranks 1..{requested}, per token): the candidates cannot be read")
    ids, log_probs = ids.view(-1, width)[:, 1:], log_probs.view(-1, width)[:, 1:]
    if requested > k:
        overflowing = int(torch.isfinite(log_probs[:, k]).sum())
        if overflowing:
            raise ValueError(support_overflow(k, overflowing, sum(lengths), top_k, vocab_size))
    ids, log_probs = candidate_slots(ids[:, :k], log_probs[:, :k], k)
    return list(zip(ids.split(lengths), log_probs.split(lengths)))
