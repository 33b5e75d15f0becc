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
