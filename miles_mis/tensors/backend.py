"""The compiled backend: the core's per-token kernels through ``torch.compile`` (inductor: C++/OpenMP on CPU, Triton
on GPU), opt-in.

``kernel_backend: compiled`` in the YAML (or ``MILES_MIS_BACKEND=compiled`` in the environment, the default of a config
that does not set the key) runs the kernels the core hands to ``call`` compiled: each a pure function of tensors
and the config, whose chain of elementwise passes inductor fuses into one loop. They are compiled with
``dynamic=True`` (a new batch size does not recompile) and ``fullgraph=True`` (a graph break is an error, never a
silent split; tests/test_backend.py counts them). The sparse per-sequence sums, the extremes and the small
per-sequence stages stay eager: the same reductions in the same order on either backend, so the per-sequence table
and every sequence-level decision are identical, and token decisions are taken in log space (``ops.log_bound``).
What differs is an ulp of exp/expm1 in the weights and metrics (docs/performance.md).

``effective`` resolves the backend a process actually runs: ``compiled`` needs a working compiler, checked once
per process by compiling a two-op probe; without one, one warning line (logger ``miles_mis``) and ``eager``. The
effective backend is part of the settings CP/DP ranks agree on (``inputs.host_call.config_text``): every rank of a
group runs the same one, or all of them raise, naming it. A kernel that fails to compile later falls back to eager the
same way (counted in ``FALLBACKS``). Compiled code is cached by inductor on disk (``TORCHINDUCTOR_CACHE_DIR``, by
default /tmp/torchinductor_<user>): the first call of a process compiles (seconds), a later process reuses it.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

BACKENDS = ("eager", "compiled")
ENVIRONMENT = "MILES_MIS_BACKEND"  # the backend of a config that does not set the key

LOGGER = logging.getLogger("miles_mis")
FALLBACKS: list[str] = []  # one line per kernel (or probe) that could not compile and runs eager instead
_COMPILED: dict[Callable, Callable] = {}
_FAILED: set[Callable] = set()  # kernels that failed to compile: eager from then on
_PROBE: dict[str, str | None] = {}  # "reason" -> None when a compiler works, else why not


def environment_default() -> str | None:
    """``MILES_MIS_BACKEND`` when set (unchecked: MisConfig checks it like the key), else None."""
    value = os.environ.get(ENVIRONMENT)
    return value if value else None


def _probe_kernel(x):
    return (x * 2.0).exp()


def unavailable_reason() -> str | None:
    """Why ``compiled`` cannot run in this process (None when it can): a two-op kernel compiled once and checked."""
    if "reason" not in _PROBE:
        try:
            import torch

            probe = torch.compile(_probe_kernel, dynamic=True, fullgraph=True)
            value = torch.arange(3, dtype=torch.float32)
            if not torch.allclose(probe(value), _probe_kernel(value)):
                raise RuntimeError("the probe kernel computed another value")
            _PROBE["reason"] = None
        except Exception as error:  # no compiler, a broken toolchain, no inductor: every cause is a fallback
            _PROBE["reason"] = _one_line(error)
    return _PROBE["reason"]


def effective(requested: str) -> str:
    """The backend this process runs for ``requested``: ``eager`` for ``compiled`` without a working compiler
    (one warning line, once per process)."""
    if requested != "compiled":
        return requested
    reason = unavailable_reason()
    if reason is None:
        return "compiled"
    _fall_back("kernel_backend: compiled", reason)
    return "eager"


def call(kernel: Callable, requested: str, *args):
    """``kernel(*args)``, compiled when the effective backend of ``requested`` is ``compiled``. Under a
    TorchDispatchMode (an op counter, a debug mode), which torch.compile does not support, it runs eager."""
    if effective(requested) != "compiled" or kernel in _FAILED or _dispatch_mode_active():
        return kernel(*args)
    compiled = _COMPILED.get(kernel)
    if compiled is None:
        import torch

        compiled = _COMPILED[kernel] = torch.compile(kernel, dynamic=True, fullgraph=True)
    try:
        return compiled(*args)
    except Exception as error:
        # the kernel's own error (a bad input) is raised again by the eager call, as the eager backend raises it;
        # an error eager does not raise was the compiler's: this kernel runs eager from now on
        result = kernel(*args)
        _FAILED.add(kernel)
        _fall_back(f"{kernel.__module__}.{kernel.__qualname__}", _one_line(error))
        return result


def _dispatch_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _fall_back(what: str, reason: str) -> None:
    line = f"miles_mis: {what} runs eager: {reason}"
    if line not in FALLBACKS:
        FALLBACKS.append(line)
        LOGGER.warning(line)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
