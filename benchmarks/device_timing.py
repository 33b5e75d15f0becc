"""Timing and launch counts of a call on a device (bench_core.py --device; benchmarks/gpu_check.sh).

- ``interleaved_device_ms``: median milliseconds of functions run in turn (the order shuffled every round), each
  timed with CUDA events on a CUDA device (the time the GPU spends between the two events, after a synchronise),
  with ``time.perf_counter`` elsewhere.
- ``launches_and_syncs``: what one call costs the host, from the torch profiler: the CUDA kernels it launches
  (``cudaLaunchKernel`` and its variants) and the host syncs (a stream, event or device synchronise, or a
  blocking device-to-host copy, as ``.item()`` and ``bool(tensor)`` cause), plus the profiler's aten events
  (nested ones included, views too: splitting the output into B masks counts B) and the ``aten::_local_scalar_dense``
  reads (a sync on a GPU) it runs. On a CPU the kernel and sync counts are 0; the scalar reads are the syncs a GPU
  would wait for.

Needs only torch (any version with ``torch.profiler``, 2.0 and later).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

import torch

_LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
_SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_device_ms(*fns: Callable[[], object], repeats: int, device: torch.device, seed: int = 0) -> list[float]:
    """Median ms of each function, run in turn in a shuffled order each round, after one warm-up call each."""
    rng = random.Random(seed)
    for fn in fns:
        fn()
    synchronize(device)
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            times[i].append(_one_call_ms(fns[i], device))
    return [statistics.median(t) for t in times]


def _one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def launches_and_syncs(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """Kernel launches, host syncs, aten operations and scalar reads of one call of ``fn`` (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    names = [event.name for event in prof.events()]
    # the profiler's own closing synchronise is not the call's: leave one out on CUDA
    syncs = sum(name.startswith(_SYNC_NAMES) and "Async" not in name for name in names)
    return {"kernel_launches": sum(name.startswith(_LAUNCH_PREFIXES) for name in names),
            "host_syncs": max(syncs - (1 if device.type == "cuda" else 0), 0),
            "aten_events": sum(name.startswith("aten::") for name in names),
            "scalar_reads": sum(name == "aten::_local_scalar_dense" for name in names)}
