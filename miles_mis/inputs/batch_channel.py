"""The seam between a host adapter and the entry points: the batch inputs the hook's arguments lack.

The hosts' correction hook (``--custom-tis-function-path``) receives only the log-probs, masks and lengths. A host
adapter (``miles_mis.hosts``) runs the host's own policy loss, which calls the hook, and sends the hook the rest of
what the batch holds (advantages, the current policy's log-probs, rollout ids, lags, sampling masks) through
``BATCH_INPUTS``: the adapter sends with ``BATCH_INPUTS.sending(inputs)`` around the host's loss, and the entry
points' reader (``miles_mis.inputs.host_call``) receives them as if the host had passed them as keyword arguments (a
keyword argument the host does pass wins). Both sides import this one object, so the channel shows in the imports.
Scoped to one call of the adapter (a ``ContextVar``: nothing leaks into the next micro-batch or another thread).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Mapping


class Deferred:
    """An input known only once the host's loss has run up to the hook (the current policy's log-probs, which the
    host computes itself): ``value()`` is called when the reader receives the inputs."""

    def __init__(self, value: Callable[[], Any]):
        self.value = value


class BatchChannel:
    """A scoped channel of keyword inputs from a host adapter to the entry point its host's loss calls."""

    def __init__(self, name: str):
        self.inputs: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(name, default={})

    @contextlib.contextmanager
    def sending(self, inputs: Mapping[str, Any]) -> Iterator[None]:
        """Within the block, every entry point receives ``inputs`` as optional keyword arguments."""
        token = self.inputs.set(dict(inputs))
        try:
            yield
        finally:
            self.inputs.reset(token)

    def received(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``kwargs`` with what was sent added (the host's own keyword arguments win), deferred inputs read now."""
        sent = self.inputs.get()
        if not sent:
            return dict(kwargs)
        given = {key: value for key, value in kwargs.items() if value is not None}
        return {**{key: value.value() if isinstance(value, Deferred) else value
                   for key, value in sent.items() if key not in given}, **given}


BATCH_INPUTS = BatchChannel("miles_mis_batch_inputs")
