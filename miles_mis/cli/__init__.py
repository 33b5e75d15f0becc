"""The ``miles-mis`` command line (``main``; setup.py's console script is ``miles_mis.cli:main``, and
``python -m miles_mis.cli`` runs it too).

``command`` parses the subcommands and runs ``check-config`` and ``plugin-demo`` itself; the lab's subcommands
(``demo``, ``train``, ``measure``) and ``analyze`` are handed to ``miles_mis.lab`` and ``miles_mis.analyze``.
``example_batch`` (the synthetic micro-batch) and ``reporting`` (the host-side reduction of the metrics and a
plain-text table) serve ``plugin-demo``.
"""

from .command import main

__all__ = ["main"]
