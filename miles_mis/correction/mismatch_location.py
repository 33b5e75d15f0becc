"""Where the mismatch lives, as live metrics: k3 on the first response token, on tokens the engine found
unlikely, and by position along the response.

With k3_t = ρ_t − ℓ_t − 1 = expm1(clamp(ℓ_t)) − ℓ_t (float64) on a usable token (0 elsewhere) and
p_t = π_rollout(t):

    mis_k3_first_token        = Σ_{t first of its response} k3_t / #{such usable tokens}
    mis_k3_low_rollout_prob   = Σ_{p_t < θ} k3_t / #{usable t: p_t < θ}      θ = metrics_low_prob_threshold
    mis_low_rollout_prob_token_fraction = #{usable t: p_t < θ} / #{usable t}
    mis_k3_position_<a>_<b>   = Σ_{a ≤ pos_t < b} k3_t / #{usable t: a ≤ pos_t < b}   (POSITION_EDGES)

each 0 when it has no token, and batch-level (one value for the micro-batch, broadcast to its tokens). They
are ratios of sums over tokens, so every CP rank contributes its sums to a fixed-size vector that travels
in the agreement header (``combine``: sums add, the maximum is maxed): CP-exact, no extra collective.
The same vector carries max |ℓ|, which the batch gate (``miles_mis.correction.gate``) reads.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..tensors.ops import constant

POSITION_EDGES = (0, 1, 16, 128, 1024, 8192)  # buckets [0, 1) [1, 16) ... [8192, ∞): the first token alone
BUCKET_NAMES = tuple(f"{a}_{b}" for a, b in zip(POSITION_EDGES, POSITION_EDGES[1:] + ("inf",)))
# in the order local_values builds them; the first token is position bucket [0, 1)
SUM_NAMES = (("low_k3", "low_n") + tuple(f"position_k3_{name}" for name in BUCKET_NAMES)
             + tuple(f"position_n_{name}" for name in BUCKET_NAMES) + ("usable_n",))
MAX_NAMES = ("max_abs_log_ratio",)
NAMES = SUM_NAMES + MAX_NAMES
INDEX = {name: i for i, name in enumerate(NAMES)}


def token_values(k3: Tensor, usable: Tensor, log_ratio: Tensor, rollout_log_probs: Tensor,
                 low_prob_threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """The per-token part of ``local_values``: k3 and the usable indicator in float64 (float64 sums: CP ranks'
    partial sums add up to cp = 1's), and [Σ_{p < θ} k3_t, #{usable t: p_t < θ}, max |ℓ_t|] (float64): one fused
    pass on the compiled backend. ``k3`` and ``log_ratio`` are 0 where not usable (sums of them need no mask)."""
    k3, usable = k3.double(), usable.double()
    low = torch.lt(rollout_log_probs, math.log(low_prob_threshold), out=torch.empty_like(usable))
    if log_ratio.numel():
        smallest, largest = torch.aminmax(log_ratio)
        largest = torch.maximum(largest, -smallest)
    else:
        largest = log_ratio.new_zeros(())
    return k3, usable, torch.stack([torch.dot(k3, low), torch.dot(usable, low), largest.double()])


def local_values(k3: Tensor, usable: Tensor, low_and_max: Tensor, bucket_sum: Callable[[Tensor], Tensor]) -> Tensor:
    """This rank's float64 vector [len(NAMES)] of sums (and the max |ℓ|) over its tokens, from ``token_values``'
    three results. The first token is position bucket 0, and the usable count is the buckets' total.
    ``bucket_sum``: [N] -> [len(BUCKET_NAMES)] sums by response-position bucket (POSITION_EDGES), e.g.
    ``PackedBatch.per_bucket_sum``.
    """
    sums = torch.cat([low_and_max[:2], bucket_sum(k3), bucket_sum(usable)])
    return torch.cat([sums, sums[-len(BUCKET_NAMES):].sum().reshape(1), low_and_max[2:]])


def combine(per_rank: Tensor) -> Tensor:
    """[C, len(NAMES)] -> [len(NAMES)]: sums added, maxima maxed (identical on every CP rank)."""
    return torch.cat([per_rank[:, :len(SUM_NAMES)].sum(0), per_rank[:, len(SUM_NAMES):].amax(0)])


_FIRST = BUCKET_NAMES[0]  # "0_1": the first generated token
_RATIOS = (("k3_first_token", f"position_k3_{_FIRST}", f"position_n_{_FIRST}"),
           ("k3_low_rollout_prob", "low_k3", "low_n"),
           ("low_rollout_prob_token_fraction", "low_n", "usable_n")) + tuple(
    (f"k3_position_{name}", f"position_k3_{name}", f"position_n_{name}") for name in BUCKET_NAMES)
_NUMERATORS = [INDEX[numerator] for _, numerator, _ in _RATIOS]
_DENOMINATORS = [INDEX[denominator] for _, _, denominator in _RATIOS]
_INDEX = tuple(_NUMERATORS + _DENOMINATORS)


def metrics(values: Tensor) -> dict[str, Tensor]:
    """Batch-level metric values (0-d float64; the core casts every batch metric to float32 in one op) from the
    combined vector: every ratio in one division."""
    parts = values.index_select(0, constant(_INDEX, values.device)).view(2, -1)
    ratios = parts[0] / parts[1].clamp(min=1.0)
    return dict(zip((name for name, _, _ in _RATIOS), ratios.unbind(0)))
