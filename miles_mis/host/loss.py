"""Deprecated: ``miles_mis.reference_host.loss``; this path warns and works until miles-mis 0.3.0."""

from typing import Any

from ..deprecation import warn_moved
from ..reference_host import loss

warn_moved("miles_mis.host.loss", "miles_mis.reference_host.loss")


def __getattr__(name: str) -> Any:
    return getattr(loss, name)
