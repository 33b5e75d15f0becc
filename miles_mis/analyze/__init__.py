"""``miles-mis analyze``: read the per-token dumps of a run (miles / slime ``--dump-details``, prime-rl's token export,
NeMo RL's train data) and say which correction the engine needs; ``miles-mis admit``: the model-admission check.

A package, one concept a module: ``reading`` (miles dumps: discovery, validation, streaming by call), ``stacks`` (the
other stacks' formats and ``open_dump``, which tells them apart), ``statistics``
(where the mismatch lives), ``advisor`` (candidate configs on the dumped tokens, the recommendation,
``--write-config``), the report (``report_markdown``, ``report_json``, ``figures`` for the PNGs, ``report_html`` for one
self-contained page with ``report_strips``' token strips of the ``worst_sequences``, ``report_files`` writing them with
a stdout summary; ``report_tables``, ``report_sentences``, ``report_configs`` and ``formatting`` are
their parts), ``comparison`` (two dumps side by side), ``sc_metrics`` (score centering's per-step series from a
metrics file, ``--metrics``), ``published`` (the published outcomes the advice cites), ``command`` (the pipeline
and the command line), and ``admission`` with ``admit_command`` (per-step mismatch, drift and verdict).
docs/analyze.md explains every section of the report.
"""

from .advisor import NONFINITE_LIMIT, CandidateEvaluator, Recommendation, candidate_grid, recommend, write_config
from .command import Analysis, analyze
from .reading import CallBatch, DumpReader
from .statistics import StatisticsAccumulator, compute

__all__ = ["NONFINITE_LIMIT", "Analysis", "CallBatch", "CandidateEvaluator", "DumpReader", "Recommendation",
           "StatisticsAccumulator", "analyze", "candidate_grid", "compute", "recommend", "write_config"]
