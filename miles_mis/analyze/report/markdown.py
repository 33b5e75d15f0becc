"""The analyze report in Markdown (``render_markdown``): the sections, in report order, from the statistics dict
(``statistics.py``'s schema), the advisor's candidate results and its recommendation. docs/analyze.md explains every
section."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import figures as _figures
from .. import lab_staleness as _lab_staleness
from .. import published as _published
from .. import safe_level as _safe_level
from .. import sc_metrics as _sc
from .. import truncation as _truncation
from .configs import config_dict, config_yaml, describe_config, recommendation_name
from .figures import finite_number as _finite
from .formatting import fmt, markdown_table
from .sentences import attribution_sentence, k3_context, size_line, trend_sentence, warning_lines
from .tables import BUCKET_NOTES, BUCKETS, STATISTICS, filled_rows, scalar_keys

USAGE = "--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp --custom-config-path"
CANDIDATE_COLUMNS = [("kept_token_fraction", "kept tokens"), ("kept_sequence_fraction", "kept sequences"),
                     ("ess", "ESS"), ("mean_final_weight", "mean weight"), ("max_final_weight", "max weight"),
                     ("bounded_fraction", "bounded"), ("signal_shift", "signal shift"), ("signal_bias", "signal bias")]
LEVEL_ORDER = ("token", "geometric", "sequence")
MAX_CALL_ROWS = 40


# --------------------------------------------------------------------------- the report
def render_markdown(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any, *,
                    title: str, figures: Sequence[Path] | None = None, config_path: Path | str | None = None,
                    figures_note: str | None = None, score_centering: Mapping[str, Any] | None = None) -> str:
    """The Markdown report. figures: the PNGs of ``figures.write_figures``, linked by file name (the report is
    written next to them); None: a note says why there are none (figures_note, or how to get them).
    config_path: where the recommended config was written, named in the usage line.
    score_centering: ``sc_metrics.summarize``'s output for a metrics file (its figure, ``figures.SC_FIGURE``, is
    linked when it is among ``figures``); None: no metrics file was read."""
    lines = [f"# {title}", ""]
    lines += warning_lines(statistics)
    lines += [size_line(statistics), ""]
    if figures is None:
        lines += [f"_{figures_note or _figures_note()}_", ""]
    lines += _whole_dump(statistics)
    lines += _truncation_section(statistics)
    lines += ["## Where the mismatch lives", ""]
    for key in BUCKETS:
        lines += _bucket_section(statistics, key, figures)
    lines += _lag_section(statistics)
    lines += _calls_section(statistics, figures)
    lines += _histogram_section(statistics, figures)
    lines += _worst_section(statistics)
    lines += _safe_level_section(statistics)
    lines += score_centering_section(score_centering, figures)
    lines += _candidates_section(results, recommendation)
    lines += _recommendation_section(recommendation, config_path)
    return "\n".join(lines).rstrip() + "\n"


def _figures_note() -> str:
    if not _figures.figures_available():
        return ('Figures not drawn: matplotlib is not installed. Install it with pip install "miles-mis[figures]" '
                "and run the analysis again to get the PNGs.")
    return ("Figures not drawn here: write the report to a directory (miles-mis analyze DUMP_DIR --out-dir OUT) to "
            "get the PNGs.")


def _figure(figures: Sequence[Path] | None, key: str, caption: str) -> list[str]:
    for path in figures or []:
        if Path(path).name == _figures.FIGURES[key]:
            return [f"![{caption}]({Path(path).name})", ""]
    return []


def _peak(rows: Sequence[Mapping], label: str, count: str, statistics: Mapping[str, Any]) -> list[str]:
    """'k3 is largest at …: x (r × the whole-dump k3, n tokens).'"""
    values = [(row, _finite(row.get("k3"))) for row in rows]
    values = [(row, v) for row, v in values if v is not None]
    if len(values) < 2:
        return []
    row, top = max(values, key=lambda item: item[1])
    whole = _finite(statistics.get("k3"))
    ratio = f"{fmt(top / whole)} × the whole-dump k3, " if whole else ""
    return [f"k3 is largest at {label} {row.get('bucket')}: {fmt(top)} ({ratio}{fmt(row.get(count))} {count}).", ""]


# --------------------------------------------------------------------------- sections
def _truncation_section(statistics: Mapping[str, Any]) -> list[str]:
    """The unreplayed-truncation detector over the dump, in words."""
    values = statistics.get("truncation")
    if not values:
        return []
    return (["## Truncated sampling", ""] + _truncation.advice(values["negative_fraction"],
                                                               values["standardized_mean"], values["mean"],
                                                               bool(values["fired"]))
            + [""])


def _safe_level_section(statistics: Mapping[str, Any]) -> list[str]:
    """This dump's k3 against the mismatch measured safe on a real model (``safe_level``), when one is shipped."""
    text = _safe_level.for_dump(statistics, _safe_level.load())
    return [] if text is None else ["## Does this mismatch need a correction?", "", text, ""]


def _whole_dump(statistics: Mapping[str, Any]) -> list[str]:
    rows = [[key, fmt(statistics.get(key)), STATISTICS.get(key, "")] for key in scalar_keys(statistics)]
    return (["## Whole-dump statistics", ""] + markdown_table(["statistic", "value", "what it is"], rows)
            + [k3_context(statistics), ""])


def _bucket_section(statistics: Mapping[str, Any], key: str, figures: Sequence[Path] | None) -> list[str]:
    heading, bucket, count, metrics = BUCKETS[key]
    rows = filled_rows(statistics.get(key), count)
    lines = [f"### {heading}", "", BUCKET_NOTES[key], ""]
    if not rows:
        return lines + ["No data.", ""]
    counts = ["sequences", "tokens"] if key == "by_length" else [count]
    table = [[str(row.get("bucket"))] + [fmt(row.get(c)) for c in counts] + [fmt(row.get(m)) for m, _ in metrics]
             for row in rows]
    lines += markdown_table([bucket] + counts + [name for _, name in metrics], table)
    return lines + _peak(rows, bucket, count, statistics) + _figure(figures, key, heading)


def _lag_section(statistics: Mapping[str, Any]) -> list[str]:
    """By version lag, and how much of the mismatch is staleness (only when the dump records lags)."""
    rows = statistics.get("by_lag") or []
    if not rows:
        return []
    lines = ["### By version lag", "", "Sequences grouped by how many weight versions behind the trainer they were "
             "generated (asynchronous training); k3 is the mean over their tokens.", ""]
    lines += markdown_table(["lag", "sequences", "tokens", "k3", "k1", "mean |Δ log p|"],
                            [[str(row["bucket"]), fmt(row["sequences"]), fmt(row["tokens"]), fmt(row["k3"]),
                              fmt(row["k1"]), fmt(row["mean_abs_log_ratio"])] for row in rows])
    lines += [attribution_sentence(statistics.get("lag_attribution")), ""]
    evidence = staleness_evidence(statistics)
    return lines + ([evidence, ""] if evidence else [])


def staleness_evidence(statistics: Mapping[str, Any]) -> str | None:
    """The published runs with stale rollouts (``published.staleness_sentence``), then the lab's paired runs at a
    version lag (``lab_staleness.sentence``), when the dump holds stale samples (a lag bucket above 0); None
    otherwise (or with neither file)."""
    attribution = statistics.get("lag_attribution") or {}
    stale = attribution.get("stale_buckets") or [row for row in statistics.get("by_lag") or []
                                                 if str(row.get("bucket")) != "0"]
    if not stale:
        return None
    said = [_published.staleness_sentence(_published.load()), _lab_staleness.sentence()]
    return " ".join(text for text in said if text) or None


def _calls_section(statistics: Mapping[str, Any], figures: Sequence[Path] | None) -> list[str]:
    rows = list(statistics.get("by_call") or [])
    lines = ["### Over calls (training time)", "", trend_sentence(statistics), ""]
    if len(rows) > MAX_CALL_ROWS:
        half = MAX_CALL_ROWS // 2
        lines += [f"The first and last {half} of {len(rows)} calls (all of them in report.json).", ""]
        rows = rows[:half] + [None] + rows[-half:]
    columns = ["call", "sequences", "tokens", "k3", "k1", "max_abs_log_ratio", "nonfinite_fraction"]
    table = [["…"] * len(columns) if row is None else [fmt(row.get(c)) for c in columns] for row in rows]
    lines += markdown_table(["call", "sequences", "tokens", "k3", "k1", "max |Δ log p|", "non-finite"], table)
    return lines + _figure(figures, "by_call", "k3 over calls with its least-squares trend")


def _histogram_section(statistics: Mapping[str, Any], figures: Sequence[Path] | None) -> list[str]:
    quantiles = statistics.get("quantiles") or {}
    lines = ["### Distribution of the token log ratio", "",
             "Quantiles of l = log ρ over the usable tokens (from the histogram, linear within a bin).", ""]
    rows = []
    for name, value in quantiles.items():
        number = _finite(value)
        ratio = math.exp(number) if number is not None and number < 700 else None
        rows.append([str(name), fmt(number), fmt(ratio)])
    lines += markdown_table(["quantile", "l", "ρ = exp(l)"], rows) if rows else ["No quantiles.", ""]
    return lines + _figure(figures, "histogram", "histogram of the token log ratio with candidate bounds")


def _worst_section(statistics: Mapping[str, Any]) -> list[str]:
    rows = list(statistics.get("worst_sequences") or [])
    lines = ["### Worst sequences", "", "The sequences with the largest k3 (mean over their usable tokens).", ""]
    if not rows:
        return lines + ["None.", ""]
    columns = ["call", "index", "length", "k3", "max_abs_log_ratio", "worst_position"]
    return lines + markdown_table(["call", "index", "length", "k3", "max |l|", "position of the worst token"],
                                  [[fmt(row.get(c)) for c in columns] for row in rows])


def score_centering_section(summary: Mapping[str, Any] | None, figures: Sequence[Path] | None) -> list[str]:
    """Score centering over training steps, from a metrics file (``sc_metrics``): nothing without a file; a line
    saying what was read when it holds no score-centering value; else what was read and what it lacks, the tail
    ratio's rise, every series' summary, the per-step values, the figure and the advice."""
    if not summary:
        return []
    where = ", found in the run directory" if summary.get("found_in_run_directory") else ""
    read = f"Read `{summary['file']}` ({_sc.FORMATS[summary['format']]}{where}): {summary['rows']} rows"
    if not summary.get("present"):
        return [f"_Metrics: {read}, none with a score-centering value (no key named mis_sc_* or sc_*, with or "
                "without a prefix such as train/): no score-centering section._", ""]
    lines = ["## Score centering over training steps", ""]
    keys = ", ".join(f"`{item['key']}`" for item in summary["keys"].values())
    names = sorted({item["names"] for item in summary["keys"].values()})
    lines += [f"{read}; {summary['steps']} steps with score-centering values, steps {summary['first_step']}–"
              f"{summary['last_step']} (step column `{summary['step_key']}`); keys {keys} ({' and '.join(names)} "
              "names). Each value is the host's sum_of_sample_mean of a per-token value over "
              "one training step.", ""]
    notes = []
    missing = summary.get("missing") or []
    if missing:
        notes.append("not in the file: " + ", ".join(f"{name.replace('_', ' ')} (mis_sc_{name} / sc_{name})"
                                                      for name in missing) + "; nothing is shown for them")
    if summary.get("rows_without_values"):
        notes.append(f"{summary['rows_without_values']} rows without any score-centering value were not used")
    if summary.get("nonfinite_skipped"):
        notes.append(f"{summary['nonfinite_skipped']} NaN/inf values skipped, not replaced (first: "
                     f"{summary['first_nonfinite']})")
    if summary.get("replaced"):
        notes.append(f"{summary['replaced']} values replaced by a later row of the same step (first: "
                     f"{summary['first_replaced']})")
    lines += [f"- {note}." for note in notes] + ([""] if notes else [])
    tail = summary.get("tail_ratio")
    if tail:
        rise = tail["rise_threshold"]
        table = [[f"median over its first {tail['baseline_steps']} steps ({tail['baseline_first_step']}–"
                  f"{tail['baseline_last_step']})", fmt(tail["baseline_median"]), ""],
                 ["maximum", fmt(tail["max"]), str(tail["max_step"])],
                 ["last", fmt(tail["last"]), str(tail["last_step"])],
                 [f"first step above {fmt(tail['rise_factor'])} × that median"
                  + (f" ({fmt(rise)})" if rise is not None else " (not measured: the median is not positive)"),
                  "", _step_or_never(tail["first_step_above_rise"], rise is not None)],
                 [f"first step above {fmt(tail['limit'])}", "", _step_or_never(tail["first_step_above_limit"])]]
        lines += ["The tail ratio ρ = max(1 − Q, ε) / max(1 − P, ε) (the tail model's q/p: 1 where trainer and engine "
                  "put the same mass outside the recorded candidates):", ""]
        lines += markdown_table(["tail ratio", "value", "step"], table)
    rows = [[name.replace("_", " "), f"`{summary['keys'][name]['key']}`", fmt(s["steps"]),
             f"{fmt(s['first'])} ({s['first_step']})", f"{fmt(s['min'])} ({s['min_step']})", fmt(s["median"]),
             f"{fmt(s['max'])} ({s['max_step']})", f"{fmt(s['last'])} ({s['last_step']})"]
            for name, s in (summary.get("series") or {}).items()]
    lines += ["Each series (value, and its step in parentheses):", ""]
    lines += markdown_table(["series", "key", "steps", "first", "min", "median", "max", "last"], rows)
    per_step = _sc.step_rows(summary)
    shown = [name for name in _sc.SERIES if name not in missing]
    if len(per_step) < len(summary.get("per_step") or []):
        lines += [f"The first and last {_sc.MAX_STEP_ROWS // 2} of {summary['steps']} steps (all of them in "
                  "report.json):", ""]
    lines += markdown_table(["step"] + [name.replace("_", " ") for name in shown],
                            [["…"] * (len(shown) + 1) if row is None else
                             [str(row["step"])] + [fmt(row.get(name)) for name in shown] for row in per_step])
    for path in figures or []:
        if Path(path).name == _figures.SC_FIGURE:
            lines += [f"![score centering over training steps]({Path(path).name})", ""]
    return lines + [summary.get("advice") or "", ""]


def _step_or_never(step: Any, measured: bool = True) -> str:
    if not measured:
        return "n/a"
    return "never in this file" if step is None else str(step)


# --------------------------------------------------------------------------- candidates and recommendation
def _sorted_candidates(results: Mapping[str, Any]) -> list[tuple[str, Mapping]]:
    """Grouped by level (token, geometric, sequence, others), by ESS (largest first) within a level."""
    def key(item):
        name, result = item
        level = (result.get("config") or {}).get("tis_level", "")
        ess = _finite(result.get("ess"))
        rank = LEVEL_ORDER.index(level) if level in LEVEL_ORDER else len(LEVEL_ORDER)
        return rank, ess is None, -(ess or 0.0), name
    return sorted(((str(n), r or {}) for n, r in results.items()), key=key)


def _candidates_section(results: Mapping[str, Any] | None, recommendation: Any) -> list[str]:
    lines = ["## Candidate configurations on these tokens", ""]
    if not results:
        return lines + ["No candidate was evaluated.", ""]
    lines += [CANDIDATE_NOTE, ""]
    rows = [[f"**{name}** (recommended)" if chosen else name] + cells
            for name, chosen, cells in candidate_rows(results, recommendation)]
    return lines + markdown_table(CANDIDATE_HEADER, rows)


CANDIDATE_NOTE = ("Each candidate's correction applied to the dumped tokens (use_tis on), grouped by level, largest "
                  "ESS first. kept: the share of valid tokens / sequences trained on; ESS: (Σw)² / (N Σw²) of the "
                  "final weights (1 = uniform, nothing rejected); bounded: the share of kept tokens whose weight a "
                  "bound changed (a bias proxy); signal shift: the |A|-weighted mean |w − 1| (0 = gradient signal "
                  "unchanged, 1 = as much as rejecting every token); signal bias: its signed counterpart.")
CANDIDATE_HEADER = ["candidate", "level", "correction"] + [heading for _, heading in CANDIDATE_COLUMNS]


def candidate_rows(results: Mapping[str, Any], recommendation: Any) -> list[tuple[str, bool, list[str]]]:
    """The candidates' table in report order (``_sorted_candidates``): per candidate its name, whether it is the
    recommended one, and its cells after the name (level, correction, then ``CANDIDATE_COLUMNS``), as text. The
    Markdown and the HTML report show these rows."""
    chosen = recommendation_name(recommendation)
    rows = []
    for name, result in _sorted_candidates(results):
        config = config_dict(result.get("config"))
        rows.append((name, name == chosen, [str(config.get("tis_level", "n/a")), describe_config(config)]
                     + [fmt(result.get(key)) for key, _ in CANDIDATE_COLUMNS]))
    return rows


def _recommendation_section(recommendation: Any, config_path: Path | str | None) -> list[str]:
    name, reasons = recommendation_name(recommendation), list(getattr(recommendation, "reasons", None) or [])
    config = getattr(recommendation, "config", None) if recommendation is not None else None
    if name is None or config is None:
        return (["## Recommendation: none", ""] + [f"- {reason}" for reason in reasons or ["no recommendation made"]]
                + [""])
    lines = [f"## Recommendation: `{name}`", ""] + [f"- {reason}" for reason in reasons] + [""]
    lines += ["The configuration:", "", "```yaml", config_yaml(config).rstrip(), "```", ""]
    target = str(config_path) if config_path is not None else "FILE"
    where = (f"It is written to `{config_path}`." if config_path is not None
             else "Save it as a YAML file FILE.")
    return lines + [f"{where} Use it with `{USAGE} {target}`.", ""]
