"""Deprecated: the reference host is ``miles_mis.reference_host`` (the same names); this path warns and works until
miles-mis 0.3.0."""

from typing import Any

from .. import reference_host
from ..deprecation import warn_moved

warn_moved("miles_mis.host", "miles_mis.reference_host")

__all__ = reference_host.__all__


def __getattr__(name: str) -> Any:
    return getattr(reference_host, name)
