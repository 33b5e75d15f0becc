"""What a host adapter read from the whole batch, for the correction hook the host calls inside its own loss.

The hosts' correction hook (``--custom-tis-function-path``) receives only the log-probs, masks and lengths; a host
adapter (``miles_mis.hosts``) runs the host's own policy loss, which calls the hook, and hands the hook the rest of
what the batch holds (advantages, the current policy's log-probs, rollout ids, lags, sampling masks) through
``provided``: the entry points read these as if the host had passed them as keyword arguments (a keyword argument the
host does pass wins). Scoped to one call of the adapter (a ``ContextVar``: nothing leaks into the next micro-batch or
another thread).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Mapping

_PROVIDED: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("miles_mis_batch_inputs", default={})


@contextlib.contextmanager
def provided(inputs: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, every entry point reads ``inputs`` as optional keyword arguments."""
    token = _PROVIDED.set(dict(inputs))
    try:
        yield
    finally:
        _PROVIDED.reset(token)


class Deferred:
    """An input known only once the host's loss has run up to the hook (the current policy's log-probs, which the
    host computes itself): ``value()`` is called when the hook reads the inputs."""

    def __init__(self, value: Callable[[], Any]):
        self.value = value


def with_provided(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with what the adapter provided added (the host's own keyword arguments win), deferred inputs read
    now."""
    inputs = _PROVIDED.get()
    if not inputs:
        return dict(kwargs)
    given = {key: value for key, value in kwargs.items() if value is not None}
    return {**{key: value.value() if isinstance(value, Deferred) else value
               for key, value in inputs.items() if key not in given}, **given}
