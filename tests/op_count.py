"""Counting aten operations (not time): shared by tests/test_no_python_loops.py and benchmarks/bench_core.py."""

from __future__ import annotations

from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[[], object]) -> int:
    """Number of aten operations dispatched while ``fn()`` runs."""
    with _Count() as counter:
        fn()
    return counter.ops


def _configs():
    from miles_mis import MisConfig

    return [MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True),
            MisConfig(use_tis=True, tis_level="geometric", tis_mode="mask", use_rs=True, rs_level="sequence",
                      tis_lower_bound=0.9, tis_upper_bound=1.1, tis_batch_normalize=True),
            MisConfig(use_tis=True, rs_divergence={"token_k2": 0.1, "seq_mean_k1": [0.9, 1.1], "seq_max_k3": 0.5}),
            MisConfig(use_tis=False),
            MisConfig(use_tis=True, tis_upper_bound="auto", tis_batch_normalize=True),
            MisConfig(use_tis=True, tis_level="sequence", tis_upper_bound="auto")]


# the configs whose aten-op count per call must not grow with the batch size (list and packed entry points)
OP_COUNT_CONFIGS = _configs()
OP_COUNT_IDS = ["default", "geometric-mask-seq-rs", "divergence", "metrics-only", "auto-token", "auto-sequence"]
