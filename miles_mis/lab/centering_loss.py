"""Score centering in the lab: a minibatch of the rollout handed to ``miles_mis.hosts.score_centering`` as miles
hands its own batch to its loss, so the lab's runs exercise the adapters' code path, input checks included.

The batch is miles' (``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``rollout_log_probs``,
``advantages``, ``loss_masks``, ``rollout_topk_token_ids``, ``rollout_topk_log_probs``) with one shortcut: the logits
are computed only where they score a response token, so each sample is laid out as its last prompt token and its
response (total length R + 1, a zero logits row after the response, which scores nothing). The loss reads the same
logits rows, tokens and candidates as from the whole sequence; the prompt's other rows would only be skipped.
The reduction is miles' ``sum_of_sample_mean``: Σ_i Σ_t m_t x_t / max(Σ_t m_t, 1), the sum over samples of each
sample's mean, as the reference host's policy loss (its caller divides by the number of samples).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable

import torch
from torch import Tensor

from ..config import MisConfig
from ..hosts.score_centering import score_centering_loss


def enabled(args: argparse.Namespace) -> bool:
    """The run's config turns score centering on (``score_centering: true`` in its --custom-config-path YAML)."""
    return bool(getattr(args, "score_centering", False)) and MisConfig.from_args(args).score_centering


def sample_mean_reducer(masks: list[Tensor]) -> Callable[[Tensor], Tensor]:
    """miles' ``sum_of_sample_mean`` over these samples' tokens (one rank): Σ_i Σ_t m_t x_t / max(Σ_t m_t, 1)."""
    lengths = [m.numel() for m in masks]
    flat = torch.cat(masks).float()
    sample = torch.repeat_interleave(torch.arange(len(masks)), torch.tensor(lengths))
    denominators = torch.zeros(len(masks)).index_add_(0, sample, flat).clamp(min=1.0)

    def sum_of_sample_mean(values: Tensor) -> Tensor:
        return (values * flat / denominators.index_select(0, sample)).sum()

    return sum_of_sample_mean


def centering_batch(policy: Any, rollout: Any, idx: list[int]) -> tuple[dict[str, Any], Tensor]:
    """(miles' batch of the samples ``idx``, their logits [1, Σ (R_i + 1), V]) with each sample laid out as its last
    prompt token and its response."""
    if rollout.candidates is None:
        raise ValueError("score_centering: true needs the engine's top-K candidates: run with "
                         "--rollout-top-logprobs-num K (K > 0)")
    sequences = [rollout.sequences[i] for i in idx]
    prompts = [rollout.prompt_lengths[i] for i in idx]
    routing = None if rollout.routing is None else [rollout.routing[i] for i in idx]
    logits = policy.response_logits(sequences, prompts, routing, policy.select_features(rollout.features, idx))
    width = logits[0].shape[-1] if logits else 1
    packed = torch.cat([torch.cat([rows, rows.new_zeros(1, width)]) for rows in logits])[None]
    responses = [s.numel() - p for s, p in zip(sequences, prompts)]
    batch = {
        "unconcat_tokens": [s[p - 1:] for s, p in zip(sequences, prompts)],
        "total_lengths": [n + 1 for n in responses], "response_lengths": responses,
        "rollout_log_probs": [rollout.rollout_log_probs[i] for i in idx],
        "advantages": [torch.full((n,), float(rollout.advantages[i])) for n, i in zip(responses, idx)],
        "loss_masks": [torch.ones(n) for n in responses],
        "rollout_topk_token_ids": [rollout.candidates[i][0] for i in idx],
        "rollout_topk_log_probs": [rollout.candidates[i][1] for i in idx],
    }
    return batch, packed


def policy_loss(policy: Any, args: argparse.Namespace, rollout: Any, idx: list[int]) -> tuple[Tensor, dict]:
    """The score-centered loss of the samples ``idx`` (a sum over samples of their mean, as the reference host's
    policy loss) and its log. With top-k/top-p sampling the candidates are each token's support (support mode)."""
    batch, logits = centering_batch(policy, rollout, idx)
    call_args = copy.copy(args)
    call_args.qkv_format = "thd"
    call_args.use_sampling_support_replay = args.rollout_top_k > 0 or args.rollout_top_p < 1.0
    return score_centering_loss(MisConfig.from_args(args), call_args, batch, logits,
                                sample_mean_reducer(batch["loss_masks"]))
