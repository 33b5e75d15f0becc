"""``python -m miles_mis.cli``: the ``miles-mis`` command."""

import sys

from .command import main

sys.exit(main())
