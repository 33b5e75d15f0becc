"""slime's policy loss with miles_mis's correction: ``--loss-type custom_loss --custom-loss-function-path
miles_mis.hosts.slime_loss.policy_loss`` (keep ``--use-tis`` or ``--get-mismatch-metrics`` and
``--custom-config-path mis.yaml``). Verified against THUDM/slime at ``VERIFIED_COMMIT`` (docs/hosts.md)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .adapter import Host
from .adapter import policy_loss as _host_policy_loss

VERIFIED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # main of 2026-08-21


SLIME = Host(name="slime", repository="THUDM/slime", verified_commit=VERIFIED_COMMIT,
             loss_module="slime.backends.megatron_utils.loss",
             sampling_mask_key="rollout_top_p_token_offsets")


def policy_loss(args: Any, batch: Mapping[str, Any], logits: torch.Tensor, sum_of_sample_mean: Any):
    """slime's ``custom_loss`` entry: slime's own policy loss, corrected by miles_mis with what the batch holds."""
    return _host_policy_loss(SLIME, args, batch, logits, sum_of_sample_mean)
