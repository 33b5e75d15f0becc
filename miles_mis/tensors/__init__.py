"""The packed tensors every stage works on (`PackedBatch`: B sequences' tokens concatenated, with their segment
operations, and the rollout groups of split rollouts, `RolloutGroups`), small tensor helpers (`ops`) and the kernel
backends (`backend`: eager, or compiled)."""

from .ops import LOG_PROB_BOUND, LOG_RATIO_CLAMP
from .packed_batch import PackedBatch
from .rollout_groups import RolloutGroups

__all__ = ["LOG_PROB_BOUND", "LOG_RATIO_CLAMP", "PackedBatch", "RolloutGroups"]
