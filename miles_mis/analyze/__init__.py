"""``miles-mis analyze``: read miles ``--dump-details`` policy-loss dumps and say which correction the engine needs.

A package, one concept a module: ``reading`` (discovery, validation, streaming by call), ``statistics``
(where the mismatch lives), ``advisor`` (candidate configs on the dumped tokens, the recommendation),
``figures`` and ``report`` (Markdown, JSON, PNG, comparison of two dumps).
"""

from .legacy import (CANDIDATES, NONFINITE_LIMIT, Dump, load_dumps, logprobs_broken, mismatch_summary,  # noqa: F401
                     recommend, report, simulate_presets)
