"""Deprecated: ``miles_mis.reference_host.flags``; this path warns and works until miles-mis 0.3.0."""

from ..deprecation import warn_moved

warn_moved("miles_mis.host.flags", "miles_mis.reference_host.flags")

from ..reference_host.flags import *  # noqa: E402,F401,F403
