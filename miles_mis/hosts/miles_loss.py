"""miles' policy loss with miles_mis's correction: ``--loss-type custom_loss --custom-loss-function-path
miles_mis.hosts.miles_loss.policy_loss`` (keep ``--use-tis`` or ``--get-mismatch-metrics`` and
``--custom-config-path mis.yaml``). Verified against radixark/miles at ``VERIFIED_COMMIT`` (docs/hosts.md)."""

from .adapter import Host, entry_point

VERIFIED_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"  # main of 2026-08-21

MILES = Host(name="miles", repository="radixark/miles", verified_commit=VERIFIED_COMMIT,
             loss_module="miles.backends.training_utils.loss_hub.losses",
             sampling_mask_key="rollout_sampling_mask_offsets")

policy_loss = entry_point(MILES)
