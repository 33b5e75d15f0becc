"""Public names that moved: the old import path keeps working for a release and warns, naming the new one."""

from __future__ import annotations

import warnings

REMOVED_IN = "0.3.0"  # the release that drops the old paths below


def warn_moved(old: str, new: str) -> None:
    """A ``DeprecationWarning`` at the import of ``old`` (called from the old module's top level: the warning points
    at the line that imports it; the import machinery's frames are skipped by ``warnings``)."""
    warnings.warn(f"{old} is deprecated and will be removed in miles-mis {REMOVED_IN}: import {new} instead "
                  "(the same names)", DeprecationWarning, stacklevel=3)
