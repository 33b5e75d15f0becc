"""miles' policy loss with miles_mis's correction: ``--loss-type custom_loss --custom-loss-function-path
miles_mis.hosts.miles_loss.policy_loss`` (keep ``--use-tis`` or ``--get-mismatch-metrics`` and
``--custom-config-path mis.yaml``). Verified against radixark/miles at ``VERIFIED_COMMIT`` (docs/hosts.md)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .adapter import Host
from .adapter import policy_loss as _host_policy_loss

VERIFIED_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"  # main of 2026-08-21


MILES = Host(name="miles", repository="radixark/miles", verified_commit=VERIFIED_COMMIT,
             loss_module="miles.backends.training_utils.loss_hub.losses",
             sampling_mask_key="rollout_sampling_mask_offsets")


def policy_loss(args: Any, batch: Mapping[str, Any], logits: torch.Tensor, sum_of_sample_mean: Any):
    """miles' ``custom_loss`` entry: miles' own policy loss, corrected by miles_mis with what the batch holds."""
    return _host_policy_loss(MILES, args, batch, logits, sum_of_sample_mean)
