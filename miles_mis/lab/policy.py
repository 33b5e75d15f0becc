"""The lab's models, one pluggable piece each (``--model``): what ``lab/train.py`` trains, samples and rewards.

A policy holds the trainer's model and everything about it that the RL loop must not know:

- ``model`` and ``parameters()`` (what the optimizer updates), ``state_dict()`` / ``load_state_dict()`` (what a
  lab checkpoint keeps of it);
- ``sample_prompts(generator)`` -> :class:`Prompts` (token ids per sample, group members adjacent) and
  ``rewards(prompts, responses)``; ``max_new_tokens``;
- ``old_log_probs(sequences, prompt_lengths, routing)`` -> (π_old of every response token, features the
  minibatch steps may reuse) and ``log_probs(sequences, prompt_lengths, routing, features)`` (with gradients),
  both log softmax(logits / T); ``select_features(features, indices)``;
- ``make_engine()``: the rollout engine for ``--engine``.

Each model's module also has ``check_args(args)``: its defaults for the model-dependent flags and its one-line
refusals. ``tiny`` (tiny_policy.py): the lab's TinyGPT on the digit tasks, embedded or vLLM engine, warm-started
by supervised steps. ``smollm2-135m`` (smollm_policy.py): SmolLM2-135M-Instruct on chat-formatted addition,
vLLM engine.
"""

from __future__ import annotations

from typing import Any

import torch

from .prompts import Prompts

# Prompts: the policies' batch type, re-exported here with the interface
__all__ = ["MODELS", "Prompts", "group_advantages", "make_policy"]

MODELS = ("tiny", "smollm2-135m")


def make_policy(args: Any):
    """The ``--model`` policy: ``TinyPolicy`` (tiny_policy.py) or ``SmolLMPolicy`` (smollm_policy.py)."""
    if args.model == "tiny":
        from .tiny_policy import TinyPolicy

        return TinyPolicy(args)
    from .smollm_policy import SmolLMPolicy

    return SmolLMPolicy(args)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO, the same for every policy's rewards: (r − mean of the group) / (std of the group + 1e-6)."""
    grouped = rewards.view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
