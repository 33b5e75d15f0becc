"""The packed tensors every stage works on (`PackedBatch`: B sequences' tokens concatenated, with their segment
operations), small tensor helpers (`ops`) and the kernel backends (`backend`: eager, or compiled)."""

from .ops import LOG_PROB_BOUND, LOG_RATIO_CLAMP
from .packed_batch import PackedBatch

__all__ = ["LOG_PROB_BOUND", "LOG_RATIO_CLAMP", "PackedBatch"]
