"""``miles-mis analyze``: the pipeline (read → statistics → advisor → report) and its command line.

Two streaming passes over the dump, one call in memory at a time: the first gathers the statistics (their
quantiles of ℓ choose the data-driven candidate bounds), the second runs every candidate config through the
plugin, call by call (a call is one micro-batch, as in training).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import advisor, report
from .reading import DumpReader
from .statistics import StatisticsAccumulator

NONFINITE_LIMIT = advisor.NONFINITE_LIMIT


@dataclass
class Analysis:
    directory: Path
    statistics: dict
    results: dict  # candidate name -> its figures on the dumped tokens
    recommendation: advisor.Recommendation
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass


def analyze(directory: Path | str, allow_partial: bool = False, progress: bool = False,
            timings: bool = False) -> Analysis:
    """Read, measure and advise on one dump directory (ValueError with one line for anything wrong)."""
    reader = DumpReader(directory, allow_partial=allow_partial, progress=progress)
    started = time.perf_counter()
    accumulator = StatisticsAccumulator(files=len(reader.files))
    for batch in reader.batches():
        accumulator.update(batch)
    statistics = accumulator.result()
    statistics["warnings"] = list(reader.warnings)
    if statistics["tokens"] == 0:
        raise ValueError(f"{directory}: the dumps hold no valid token (every local_loss_mask is 0): nothing to "
                         "analyse")
    seconds = {"statistics pass": time.perf_counter() - started}
    broken = statistics["nonfinite_fraction"] > NONFINITE_LIMIT  # nothing to judge a correction on
    candidates = {} if broken else advisor.candidate_grid(statistics)
    started = time.perf_counter()
    evaluator = advisor.CandidateEvaluator(candidates)
    if candidates:
        for batch in reader.batches():
            evaluator.update(batch)
        seconds[f"advisor pass ({len(candidates)} candidates)"] = time.perf_counter() - started
    results = evaluator.results()
    recommendation = advisor.recommend(statistics, results)
    return Analysis(Path(directory), statistics, results, recommendation, seconds if timings else {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_dir", type=Path, help="the --dump-details directory (holding policy_loss_debug/)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write report.md, report.json and the PNG figures there; stdout gets a short summary "
                             "(default: %(default)s = the Markdown report on stdout)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown report to this file "
                        "(default: %(default)s)")
    parser.add_argument("--write-config", type=Path, default=None, metavar="FILE",
                        help="write the recommended config as a ready mis.yaml (default: %(default)s)")
    parser.add_argument("--compare", type=Path, default=None, metavar="DUMP_DIR_B",
                        help="a second dump: the two reports side by side, differences highlighted "
                             "(default: %(default)s)")
    parser.add_argument("--allow-partial", action="store_true",
                        help="analyse an incomplete dump (a call lacking a rank, a sequence short of its "
                             "response_length) with a warning, instead of refusing it")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")


def run(args: argparse.Namespace) -> int:
    """The command: one-line errors (``error: ...``, exit 1), never a traceback for bad input."""
    try:
        first = analyze(args.dump_dir, allow_partial=args.allow_partial, progress=True)
        second = analyze(args.compare, allow_partial=args.allow_partial, progress=True) if args.compare else None
        if args.write_config:
            if first.recommendation.config is None:
                raise ValueError(f"--write-config {args.write_config}: nothing written, there is no recommendation "
                                 f"({first.recommendation.reasons[0] if first.recommendation.reasons else 'none'})")
            advisor.write_config(args.write_config, first.recommendation, first.statistics)
        text = _write(args, first, second)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # an output that cannot be written (a directory, no permission, a full disk)
        print(f"error: cannot write {error.filename or 'the report'}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _write(args: argparse.Namespace, first: Analysis, second: Analysis | None) -> str:
    """Write what was asked for; returns what goes to stdout."""
    if second is not None:
        names = (str(first.directory), str(second.directory))
        comparison = report.render_comparison(first.statistics, second.statistics, first.results, second.results,
                                              first.recommendation, second.recommendation, names=names)
        if args.out_dir:
            report.write_comparison(args.out_dir, first.statistics, second.statistics, first.results,
                                    second.results, first.recommendation, second.recommendation, names=names)
        if args.out:
            args.out.write_text(comparison)
        return comparison
    title = f"miles_mis analysis of {first.directory}"
    if args.out_dir:
        report.write_report(args.out_dir, first.statistics, first.results, first.recommendation, title=title,
                            with_figures=not args.no_figures, config_path=args.write_config)
        text = report.summary_text(first.statistics, first.results, first.recommendation)
        markdown = (args.out_dir / "report.md").read_text()
    else:
        text = markdown = report.render_markdown(first.statistics, first.results, first.recommendation, title=title,
                                                 figures=None, config_path=args.write_config,
                                                 figures_note="figures: pass --out-dir DIR to write them")
    if args.out:
        args.out.write_text(markdown)
    return text
