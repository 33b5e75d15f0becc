"""slime's policy loss with miles_mis's correction: ``--loss-type custom_loss --custom-loss-function-path
miles_mis.hosts.slime_loss.policy_loss`` (keep ``--use-tis`` or ``--get-mismatch-metrics`` and
``--custom-config-path mis.yaml``). Verified against THUDM/slime at ``VERIFIED_COMMIT`` (docs/hosts.md)."""

from .adapter import Host, entry_point

VERIFIED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"  # main of 2026-08-21

SLIME = Host(name="slime", repository="THUDM/slime", verified_commit=VERIFIED_COMMIT,
             loss_module="slime.backends.megatron_utils.loss",
             sampling_mask_key="rollout_top_p_token_offsets")

policy_loss = entry_point(SLIME)
