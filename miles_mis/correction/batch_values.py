"""Stage 2, the batch-sum vector: a fixed-size float64 vector of this rank's batch sums (``local_batch_values``),
combined over the CP group in the agreement header (its size does not depend on B), and the adaptive token-level
bound chosen from it (``bound_token_terms``).

Layout: ``mismatch_location.NAMES``, ``truncated_sampling.NAMES``, then, with an adaptive token-level bound, the
histogram of the passing tokens' ratios (``miles_mis.correction.adaptive``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from . import adaptive, mismatch_location, truncated_sampling
from ..tensors import backend, ops
from ..config import MisConfig
from ..tensors.packed_batch import PackedBatch
from .token_terms import TokenTerms

# where the adaptive bound's histogram starts
HISTOGRAM_START = len(mismatch_location.NAMES) + len(truncated_sampling.NAMES)


def adaptive_token_level(config: MisConfig) -> bool:
    """The token weights' bound is chosen per call from every rank's ratios (before the per-sequence table)."""
    return config.use_tis and config.upper_bound.adaptive and config.tis_level == "token"


def local_batch_values(batch: PackedBatch, terms: TokenTerms, config: MisConfig) -> Tensor:
    """This rank's batch-sum vector (the module's layout); combined over CP ranks by ``combine_batch_values``."""
    k3, usable, low_and_max, truncation_values = backend.call(
        batch_value_kernel, config.kernel_backend, terms.k3, terms.usable, terms.log_ratio, batch.rollout_log_probs,
        config.metrics_low_prob_threshold, batch.mask_sizes)
    values = torch.cat([mismatch_location.local_values(k3, usable, low_and_max,
                                              lambda v: batch.per_bucket_sum(v, mismatch_location.POSITION_EDGES)),
                        truncation_values])
    if adaptive_token_level(config):
        edges = adaptive.candidates(config.upper_bound.search_range, terms.token_ratio.device)
        values = torch.cat([values, adaptive.histogram(terms.token_ratio, terms.token_pass, edges,
                                                       (terms.log_ratio, ops.log_bounds(edges)))])
    return values


def batch_value_kernel(k3: Tensor, usable: Tensor, log_ratio: Tensor, rollout_log_probs: Tensor,
                       low_prob_threshold: float, mask_sizes: Tensor | None) -> tuple[Tensor, ...]:
    """The per-token passes of ``local_batch_values``: ``mismatch_location.token_values`` and
    ``truncated_sampling.local_values``, one fused kernel on the compiled backend (the position-bucket sums, sparse
    mat-vecs, stay outside it)."""
    return (*mismatch_location.token_values(k3, usable, log_ratio, rollout_log_probs, low_prob_threshold),
            truncated_sampling.local_values(log_ratio, usable, mask_sizes))


def combine_batch_values(per_rank: Tensor) -> Tensor:
    """[C, M] -> [M]: the location and truncation parts combined by their ``combine``, a histogram after them
    added."""
    size, end = len(mismatch_location.NAMES), HISTOGRAM_START
    return torch.cat([mismatch_location.combine(per_rank[:, :size]), truncated_sampling.combine(per_rank[:, size:end]),
                      per_rank[:, end:].sum(0)])


def bound_token_terms(terms: TokenTerms, batch_values: Tensor, config: MisConfig,
                      reduce_histogram: Callable[[Tensor], Tensor]) -> tuple[TokenTerms, adaptive.Choice | None]:
    """With an adaptive token-level bound: pick U from the histogram in the (CP-combined) ``batch_values``,
    combined by ``reduce_histogram`` (over the DP group with ``tis_auto_scope: dp``), and truncate the token weights
    at it. Otherwise the terms unchanged and None."""
    if not adaptive_token_level(config):
        return terms, None
    bound = config.upper_bound
    hist = reduce_histogram(batch_values[HISTOGRAM_START:])
    choice = adaptive.choose(hist, adaptive.candidates(bound.search_range, hist.device), bound.target_ess)
    return terms.bounded(choice.upper.to(terms.token_ratio.device)), choice
