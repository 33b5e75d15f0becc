"""``miles-mis analyze``: read the per-token dumps of a run (miles / slime ``--dump-details``, prime-rl's token export,
NeMo RL's train data) and say which correction the engine needs; ``miles-mis admit``: the model-admission check.

A package, one concept a module: ``reading`` (miles dumps: discovery, validation, streaming by call), ``stacks`` (the
other stacks' formats and ``open_dump``, which tells them apart), ``statistics``
(where the mismatch lives, with ``worst_sequences``), ``advisor`` (candidate configs on the dumped tokens, the
recommendation, ``--write-config``), ``report`` (a package: report.md, report.json, the PNG figures, report.html and
the comparison of two dumps), ``sc_metrics`` (score centering's per-step series from a
metrics file, ``--metrics``), ``published`` (the published outcomes the advice cites), ``lab_centering`` (the lab's
score-centering verdicts it cites after them), ``lab_staleness`` (the lab's verdicts at a version lag, cited after the
published runs with stale rollouts), ``command`` (the pipeline
and the command line), and ``admission`` with ``admit_command`` (per-step mismatch, drift and verdict).
docs/analyze.md explains every section of the report.
"""

from .advisor import NONFINITE_LIMIT, CandidateEvaluator, Recommendation, candidate_grid, recommend, write_config
from .command import Analysis, analyze
from .reading import CallBatch, DumpReader
from .statistics import StatisticsAccumulator, compute

__all__ = ["NONFINITE_LIMIT", "Analysis", "CallBatch", "CandidateEvaluator", "DumpReader", "Recommendation",
           "StatisticsAccumulator", "analyze", "candidate_grid", "compute", "recommend", "write_config"]
