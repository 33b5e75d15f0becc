"""Deprecated: ``miles_mis.reference_host.flags``; this path warns and works until miles-mis 0.3.0."""

from typing import Any

from ..deprecation import warn_moved
from ..reference_host import flags

warn_moved("miles_mis.host.flags", "miles_mis.reference_host.flags")


def __getattr__(name: str) -> Any:
    return getattr(flags, name)
