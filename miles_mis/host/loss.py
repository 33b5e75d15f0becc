"""Deprecated: ``miles_mis.reference_host.loss``; this path warns and works until miles-mis 0.3.0."""

from ..deprecation import warn_moved

warn_moved("miles_mis.host.loss", "miles_mis.reference_host.loss")

from ..reference_host.loss import *  # noqa: E402,F401,F403
