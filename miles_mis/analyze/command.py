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

from typing import Mapping

from ..config import MisConfig, load_yaml_mapping
from ..correction.divergence import DIRECTIONAL
from ..correction.staleness import lag_keys_in_use
from ..inputs.advantages import needed as reads_advantages
from . import advisor, sc_metrics
from .report import render_comparison, render_markdown, summary_text, write_comparison, write_html_report, write_report
from .stacks import open_dump
from .statistics import StatisticsAccumulator

NONFINITE_LIMIT = advisor.NONFINITE_LIMIT


@dataclass
class Analysis:
    directory: Path
    statistics: dict
    results: dict  # candidate name -> its figures on the dumped tokens (the user's configs too, named "yours: ...")
    recommendation: advisor.Recommendation
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass
    score_centering: dict | None = None  # the metrics file's summary (sc_metrics.summarize); None without one


def analyze(directory: Path | str, allow_partial: bool = False, progress: bool = False,
            timings: bool = False, configs: Mapping[str, MisConfig] | None = None,
            metrics: Path | str | None = None, find_metrics: bool = False) -> Analysis:
    """Read, measure and advise on one dump directory (ValueError with one line for anything wrong).

    ``configs``: the user's own configs (name -> MisConfig), evaluated on the dump beside the candidates and shown
    with them; the recommendation is chosen among the candidates only. A config that needs an input the dump lacks
    (each sequence's lag, the advantages) is refused, naming the key and the input.
    ``metrics``: a per-step metrics file (``sc_metrics``), read first; without it and with ``find_metrics`` (as the
    command line does), the lab's ``metrics.jsonl`` in the dump directory when there is one."""
    score_centering = None
    path, found = sc_metrics.find_metrics(directory, metrics) if (metrics or find_metrics) else (None, False)
    if path is not None:
        score_centering = sc_metrics.summarize(sc_metrics.read_metrics(path), found_in_run_dir=found)
    opened = open_dump(directory, allow_partial=allow_partial, progress=progress)
    reader = opened.reader
    started = time.perf_counter()
    accumulator = StatisticsAccumulator(files=len(reader.files))
    inputs = DumpInputs()
    for batch in reader.batches():
        accumulator.update(batch)
        inputs.update(batch)
    statistics = accumulator.result()
    statistics["warnings"] = list(reader.warnings)
    statistics["dump_format"] = opened.format.as_dict()
    if statistics["tokens"] == 0:
        raise ValueError(f"{directory}: the dumps hold no valid token (every loss mask is 0): nothing to "
                         "analyse")
    seconds = {"statistics pass": time.perf_counter() - started}
    broken = statistics["nonfinite_fraction"] > NONFINITE_LIMIT  # nothing to judge a correction on
    candidates = {} if broken else advisor.candidate_grid(statistics)
    yours = {f"{YOURS}{name}": config for name, config in (configs or {}).items()}
    for name, config in yours.items():
        inputs.require(name, config)
    started = time.perf_counter()
    evaluator = advisor.CandidateEvaluator({**candidates, **yours})
    if candidates or yours:
        for batch in reader.batches():
            evaluator.update(batch)
        seconds[f"advisor pass ({len(candidates) + len(yours)} configs)"] = time.perf_counter() - started
    results = evaluator.results()
    recommendation = advisor.recommend(statistics, {name: row for name, row in results.items() if name not in yours})
    return Analysis(Path(directory), statistics, results, recommendation, seconds if timings else {},
                    score_centering)


YOURS = "yours: "  # the prefix of a user's config in the results


class DumpInputs:
    """Which optional inputs every dumped sequence carries (its version lag, its advantages): a user's config that
    needs one the dump lacks is refused before the advisor pass, instead of evaluating as if it were absent."""

    def __init__(self):
        self.sequences = self.with_lags = self.with_advantages = 0

    def update(self, batch) -> None:
        self.sequences += len(batch.calls)
        self.with_lags += sum(lag is not None for lag in batch.lags)
        self.with_advantages += sum(value is not None for value in batch.advantages)

    def require(self, name: str, config: MisConfig) -> None:
        lag_keys = lag_keys_in_use(config)
        if lag_keys and self.with_lags < self.sequences:
            raise ValueError(f"--config {name[len(YOURS):]}: {' and '.join(lag_keys)} need each sequence's version "
                             f"lag, but {self.sequences - self.with_lags} of the dump's {self.sequences} sequences "
                             "have none (the lab's dumps record version_lag; those of miles, prime-rl and NeMo RL "
                             "do not): drop the lag keys to evaluate it")
        if config.use_tis and reads_advantages(config) and self.with_advantages < self.sequences:
            options = ", ".join(option for option, _, _ in config.rs_divergence if option.split("_")[-1] in DIRECTIONAL)
            raise ValueError(f"--config {name[len(YOURS):]}: {options} read the advantages, but "
                             f"{self.sequences - self.with_advantages} of the dump's {self.sequences} sequences have "
                             "none: dump them (miles' --dump-details keeps batch['advantages'])")


def load_config(path: Path) -> tuple[str, MisConfig]:
    """A user's ``--config`` file as the plugin reads it with ``--use-tis`` (``use_tis: true`` unless the file sets
    it): (its name in the report, the config); one-line errors naming the file."""
    values = load_yaml_mapping(path)
    values.setdefault("use_tis", True)
    return str(path), MisConfig.from_dict(values, source=str(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_dir", type=Path, help="a dump directory: miles / slime --dump-details (holding "
                        "policy_loss_debug/), prime-rl's token export (token_exports/step_<s>/), or NeMo RL's "
                        "train_data_step<N>.jsonl; the format is told from the files")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write report.md, report.json, report.html and the PNG figures there; stdout gets a "
                             "short summary (default: %(default)s = the Markdown report on stdout)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown report to this file "
                        "(default: %(default)s)")
    parser.add_argument("--html", type=Path, default=None, metavar="FILE",
                        help="also write the report as one self-contained HTML page (inline figures, no network) to "
                             "this file; --out-dir always writes it as report.html (default: %(default)s)")
    parser.add_argument("--write-config", type=Path, default=None, metavar="FILE",
                        help="write the recommended config as a ready mis.yaml (default: %(default)s)")
    parser.add_argument("--compare", type=Path, default=None, metavar="DUMP_DIR_B",
                        help="a second dump: the two reports side by side, differences highlighted "
                             "(default: %(default)s)")
    parser.add_argument("--allow-partial", action="store_true",
                        help="analyse an incomplete dump (a call lacking a rank, a sequence short of its "
                             "response_length) with a warning, instead of refusing it")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    parser.add_argument("--metrics", type=Path, default=None, metavar="FILE",
                        help="a per-step metrics file: the lab's metrics.jsonl, a W&B history as JSON lines, a JSON "
                             "array or CSV (a step column; keys such as train/sc_tail_ratio); its score-centering "
                             "series (mis_sc_*, miles' sc_*) get a section of the report. Default: DUMP_DIR/"
                             "metrics.jsonl when there is one (default: %(default)s)")
    parser.add_argument("--config", type=Path, action="append", default=None, metavar="FILE", dest="configs",
                        help="also evaluate your own mis.yaml on the dump, in the candidates' table (repeatable; "
                             "use_tis: true unless the file sets it; default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """The command: one-line errors (``error: ...``, exit 1), never a traceback for bad input."""
    try:
        metrics = getattr(args, "metrics", None)
        if metrics is not None and args.compare:
            raise ValueError(f"--metrics {metrics}: the score-centering section is part of the single-dump report, "
                             "not of --compare: analyse the dump alone with --metrics")
        if args.html is not None and args.compare:
            raise ValueError(f"--html {args.html}: the HTML page is the single-dump report, not --compare's: analyse "
                             "each dump alone with --html")
        configs = dict(load_config(path) for path in args.configs or ())
        first = analyze(args.dump_dir, allow_partial=args.allow_partial, progress=True, configs=configs,
                        metrics=metrics, find_metrics=not args.compare)
        second = (analyze(args.compare, allow_partial=args.allow_partial, progress=True, configs=configs,
                          find_metrics=False)
                  if args.compare else None)
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
        comparison = render_comparison(first.statistics, second.statistics, first.results, second.results,
                                       first.recommendation, second.recommendation, names=names)
        if args.out_dir:
            write_comparison(args.out_dir, first.statistics, second.statistics, first.results, second.results,
                             first.recommendation, second.recommendation, names=names)
        if args.out:
            args.out.write_text(comparison)
        return comparison
    title = f"miles_mis analysis of {first.directory}"
    if args.out_dir:
        write_report(args.out_dir, first.statistics, first.results, first.recommendation, title=title,
                     with_figures=not args.no_figures, config_path=args.write_config,
                     score_centering=first.score_centering)
        text = summary_text(first.statistics, first.results, first.recommendation, first.score_centering)
        markdown = (args.out_dir / "report.md").read_text()
        if args.html is not None:
            args.html.write_text((args.out_dir / "report.html").read_text(encoding="utf-8"), encoding="utf-8")
    else:
        text = markdown = render_markdown(first.statistics, first.results, first.recommendation, title=title,
                                          figures=None, config_path=args.write_config,
                                          figures_note="figures: pass --out-dir DIR to write them",
                                          score_centering=first.score_centering)
        if args.html is not None:
            write_html_report(args.html, first.statistics, first.results, first.recommendation, title=title,
                              with_figures=not args.no_figures, config_path=args.write_config,
                              score_centering=first.score_centering)
    if args.out:
        args.out.write_text(markdown)
    return text
