"""Deprecated: the reference host is ``miles_mis.reference_host`` (the same names); this path warns and works until
miles-mis 0.3.0."""

from ..deprecation import warn_moved

warn_moved("miles_mis.host", "miles_mis.reference_host")

from ..reference_host import *  # noqa: E402,F401,F403 (the same public names)
from ..reference_host import __all__  # noqa: E402,F401
