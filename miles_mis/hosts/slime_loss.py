"""slime's policy loss with miles_mis's correction: ``--loss-type custom_loss --custom-loss-function-path
miles_mis.hosts.slime_loss.policy_loss`` (keep ``--use-tis`` or ``--get-mismatch-metrics`` and
``--custom-config-path mis.yaml``). Verified against THUDM/slime at ``VERIFIED_COMMIT`` (docs/hosts.md)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .adapter import Host
from .adapter import policy_loss as _host_policy_loss

VERIFIED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # main of 2026-08-21


def current_log_probs(module: Any, args: Any, batch: Mapping[str, Any], logits: torch.Tensor) -> list:
    """π_θ's log-probs per sample (CP-local) by slime's own ``get_log_probs_and_entropy`` (which returns a pair),
    with the arguments its ``policy_loss_function`` passes, top-p replay included (loss.py L970-978 at the verified
    commit)."""
    extra = module.get_rollout_top_p_logprob_kwargs(args, batch) \
        if hasattr(module, "get_rollout_top_p_logprob_kwargs") else {}
    _, values = module.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=False, **extra)
    return values["log_probs"]


SLIME = Host(name="slime", repository="THUDM/slime", verified_commit=VERIFIED_COMMIT,
             loss_module="slime.backends.megatron_utils.loss", current_log_probs=current_log_probs,
             sampling_mask_key="rollout_top_p_token_offsets")


def policy_loss(args: Any, batch: Mapping[str, Any], logits: torch.Tensor, sum_of_sample_mean: Any):
    """slime's ``custom_loss`` entry: slime's own policy loss, corrected by miles_mis with what the batch holds."""
    return _host_policy_loss(SLIME, args, batch, logits, sum_of_sample_mean)
