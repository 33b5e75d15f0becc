"""The unreplayed-truncation detector (miles_mis/correction/truncated_sampling.py) over a whole dump, and what it
means in words.

The same sums the plugin's live metrics use, over every usable token of the dump: the share of log ratios below 0
and their mean over their spread. ``miles-mis analyze`` and ``miles-mis measure`` print ``advice``.
"""

from __future__ import annotations

from torch import Tensor

from ..correction import truncated_sampling


def local_values(ell: Tensor, usable: Tensor) -> Tensor:
    """One batch's sums (add them over batches; ``ell`` 0 where not usable)."""
    return truncated_sampling.local_values(ell, usable, None)


def summary(sums: Tensor) -> dict[str, float]:
    """The detector's values from the summed vector: negative_fraction, standardized_mean, fired (0/1)."""
    # as logged
    metrics = {name: value.float() for name, value in truncated_sampling.metrics(sums, with_sizes=False).items()}
    return {"negative_fraction": float(metrics["log_ratio_negative_fraction"]),
            "standardized_mean": float(metrics["log_ratio_standardized_mean"]),
            "mean": float(metrics["log_ratio_mean"]), "fired": float(metrics["unreplayed_truncation"])}


def advice(negative_fraction: float, standardized_mean: float, mean: float, fired: bool) -> list[str]:
    """What the detector saw, what it means, what to change (one or two lines)."""
    seen = (f"truncation detector: {negative_fraction:.1%} of the nonzero log ratios are negative, mean {mean:+.2e}, "
            f"mean/std {standardized_mean:+.2f}")
    if not fired:
        return [f"{seen}: no sign of unreplayed truncated sampling (the alarm needs >= "
                f"{truncated_sampling.NEGATIVE_FRACTION:.0%} negative, "
                f"mean/std <= -{truncated_sampling.STANDARDIZED_MEAN:g} and a "
                f"mean <= -{truncated_sampling.MEAN_SHIFT:g})."]
    return [f"{seen}: the engine's log-probs look renormalised over a truncated set (top-p/top-k/min-p) while the "
            "trainer's are over the whole vocabulary, so every ratio carries the log of the kept mass.",
            "  Fix: replay the sampling mask in the trainer (slime: rollout_top_p_token_ids/offsets; miles: "
            "rollout_sampling_mask_ids/offsets), or have the engine return raw log-probs (vLLM "
            "logprobs_mode=raw_logprobs); a correction on these ratios only masks the bias (docs/config.md)."]
