"""The analyze report: Markdown and JSON from the statistics dict (``statistics.py``'s schema), the advisor's
candidate results and recommendation; a short stdout summary; and the comparison of two dumps.

Numbers are written with 4 significant digits; None, NaN and inf are "n/a" in Markdown and null in JSON
(``json.dumps(..., allow_nan=False)`` always succeeds on ``to_json``'s output).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import figures as _figures
from . import safe_level as _safe_level
from . import truncation as _truncation
from .figures import finite_number as _finite

USAGE = "--use-tis --custom-tis-function-path miles_mis.compute_mis_weights_with_cp --custom-config-path"

# the whole-dump statistics, in report order, with what each one is
STATISTICS = {
    "files": "dump files read",
    "calls": "calls (dumped training steps)",
    "sequences": "sequences",
    "tokens": "valid tokens (loss mask != 0)",
    "usable_tokens": "valid tokens with finite log-probs on both sides",
    "nonfinite_fraction": "share of valid tokens with a NaN/inf log-prob",
    "nonfinite_engine_fraction": "… NaN/inf in the engine's (rollout) log-prob",
    "nonfinite_trainer_fraction": "… NaN/inf in the trainer's (pi_old) log-prob",
    "k1": "k1: mean of log π_rollout − log π_old",
    "k3": "token k3: mean of ρ − 1 − log ρ, ρ = π_old / π_rollout (estimates KL(π_rollout ‖ π_old))",
    "chi2_token": "token χ²: mean ρ² − 1",
    "mean_abs_log_ratio": "mean |Δ log p| = mean |log ρ|",
    "max_abs_log_ratio": "max |Δ log p|",
    "fraction_ratio_above_2": "share of tokens with ρ > 2",
    "fraction_ratio_below_half": "share of tokens with ρ < 0.5",
    "catastrophic_fraction": "share of tokens with ρ < 1e-4",
    "seq_product_outside_half_two_fraction": "share of sequences whose product ratio leaves [0.5, 2] "
                                             "(|Σ log ρ| > log 2)",
    "mean_response_length": "mean response length (tokens)",
}
COUNTS = frozenset({"files", "calls", "sequences", "tokens", "usable_tokens"})  # sizes, not mismatch

# bucket tables: key -> (heading, bucket column, count column, [(metric, column heading)])
BUCKETS = {
    "by_position": ("By token position", "position", "tokens",
                    [("k3", "k3"), ("k1", "k1"), ("mean_abs_log_ratio", "mean |Δ log p|")]),
    "by_rollout_prob": ("By rollout probability of the sampled token", "rollout probability", "tokens",
                        [("k3", "k3"), ("mean_abs_log_ratio", "mean |Δ log p|")]),
    "by_length": ("By response length", "response length", "sequences",
                  [("k3", "k3"), ("seq_product_outside_half_two_fraction", "sequences outside [0.5, 2]")]),
}
BUCKET_NOTES = {
    "by_position": "The first response token on its own, then log2-spaced position buckets [1, 2), [2, 4), …",
    "by_rollout_prob": "Tokens grouped by the engine's probability of the token it sampled (exp of its log-prob).",
    "by_length": "Sequences grouped by their full response length (log2 buckets); k3 is the mean over their tokens.",
}
CANDIDATE_COLUMNS = [("kept_token_fraction", "kept tokens"), ("kept_sequence_fraction", "kept sequences"),
                     ("ess", "ESS"), ("mean_final_weight", "mean weight"), ("max_final_weight", "max weight"),
                     ("bounded_fraction", "bounded"), ("signal_shift", "signal shift"), ("signal_bias", "signal bias")]
LEVEL_ORDER = ("token", "geometric", "sequence")
GROWS, SHRINKS = 1.25, 0.8  # second half / first half beyond these: k3 grows / shrinks over calls
MAX_CALL_ROWS = 40
REQUIRED_JSON = ("files", "sequences", "tokens", "nonfinite_fraction", "k3", "by_position", "by_rollout_prob",
                 "by_length", "by_call")


# --------------------------------------------------------------------------- cells
def fmt(value: Any) -> str:
    """4 significant digits; integers in full; "n/a" for None, NaN, inf and non-numbers."""
    number = _finite(value)
    if number is None:
        return "n/a"
    if isinstance(value, int) or (number.is_integer() and abs(number) < 1e6):
        return str(int(number))
    return f"{number:.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header)] + [line(row) for row in rows] + [""]


def _figure(figures: Sequence[Path] | None, key: str, caption: str) -> list[str]:
    for path in figures or []:
        if Path(path).name == _figures.FIGURES[key]:
            return [f"![{caption}]({Path(path).name})", ""]
    return []


def _filled(rows: Sequence[Mapping], count: str) -> list[Mapping]:
    return [row for row in rows or [] if (_finite(row.get(count)) or 0) > 0]


# --------------------------------------------------------------------------- sentences
def trend_sentence(statistics: Mapping[str, Any]) -> str:
    """'k3 grows/shrinks/is flat over calls: slope …, second half / first half = …' (or why there is no trend)."""
    trend = statistics.get("trend") or {}
    slope, growth = _finite(trend.get("k3_slope_per_call")), _finite(trend.get("growth"))
    calls = len(statistics.get("by_call") or [])
    if slope is None and growth is None:
        return f"k3 over calls: no trend, it needs per-call k3 on at least 2 calls (this dump has {calls})."
    direction = _direction(growth, slope, statistics)
    return (f"k3 {direction} over calls: slope {fmt(slope)} per call, second half / first half = {fmt(growth)} "
            f"(first half {fmt(trend.get('k3_first_half'))}, second half {fmt(trend.get('k3_second_half'))}, "
            f"{calls} calls).")


def _direction(growth: float | None, slope: float | None, statistics: Mapping[str, Any]) -> str:
    if growth is None:  # first half k3 = 0: judge the slope over the calls against the whole-dump k3
        calls = [row.get("call") for row in statistics.get("by_call") or [] if _finite(row.get("call")) is not None]
        k3 = _finite(statistics.get("k3"))
        span = (max(calls) - min(calls)) if calls else 0
        growth = 1 + slope * span / k3 if k3 else 1 + (slope > 0) - (slope < 0)
    return "grows" if growth > GROWS else "shrinks" if growth < SHRINKS else "is flat"


def k3_context(statistics: Mapping[str, Any]) -> str:
    """The measured k3 against published ranges: context, not a verdict."""
    k3 = _finite(statistics.get("k3"))
    if k3 is None:
        return "No usable token: k3 cannot be placed against published ranges."
    if k3 < 1e-5:
        where = "below the range published for dense models (1e-5 to 1e-3)"
    elif k3 <= 1e-3:
        where = "within the range published for dense models (1e-5 to 1e-3), below that for MoE models (1e-3 to 1e-1)"
    elif k3 <= 1e-1:
        where = "above the range published for dense models (1e-5 to 1e-3), within that for MoE models (1e-3 to 1e-1)"
    else:
        where = "above the ranges published for dense (1e-5 to 1e-3) and MoE models (1e-3 to 1e-1)"
    return (f"For context: the measured token k3 = {fmt(k3)} is {where}. In one published 30B MoE run, training "
            "collapsed at about step 320 after k3 had risen; how k3 moves over training (see Over calls) says more "
            "than its level. These ranges are context, not a verdict on this run.")


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


# --------------------------------------------------------------------------- Markdown sections
def render_markdown(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any, *,
                    title: str, figures: Sequence[Path] | None = None, config_path: Path | str | None = None,
                    figures_note: str | None = None) -> str:
    """The Markdown report. figures: the PNGs of ``figures.write_figures``, linked by file name (the report is
    written next to them); None: a note says why there are none (figures_note, or how to get them).
    config_path: where the recommended config was written, named in the usage line."""
    lines = [f"# {title}", ""]
    lines += _warnings(statistics)
    lines += [_size_line(statistics), ""]
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
    lines += _candidates_section(results, recommendation)
    lines += _recommendation_section(recommendation, config_path)
    return "\n".join(lines).rstrip() + "\n"


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


def _figures_note() -> str:
    if not _figures.figures_available():
        return ('Figures not drawn: matplotlib is not installed. Install it with pip install "miles-mis[figures]" '
                "and run the analysis again to get the PNGs.")
    return ("Figures not drawn here: write the report to a directory (miles-mis analyze DUMP_DIR --out-dir OUT) to "
            "get the PNGs.")


def _warnings(statistics: Mapping[str, Any]) -> list[str]:
    warnings = list(statistics.get("warnings") or [])
    nonfinite = _finite(statistics.get("nonfinite_fraction"))
    if nonfinite:
        warnings.append(f"{fmt(nonfinite)} of the valid tokens have NaN/inf log-probs (engine "
                        f"{fmt(statistics.get('nonfinite_engine_fraction'))}, trainer "
                        f"{fmt(statistics.get('nonfinite_trainer_fraction'))}): an engine or trainer bug to fix")
    return [f"- **Warning:** {warning}" for warning in warnings] + ([""] if warnings else [])


def _size_line(statistics: Mapping[str, Any]) -> str:
    return (f"{fmt(statistics.get('files'))} dump files, {fmt(statistics.get('calls'))} calls, "
            f"{fmt(statistics.get('sequences'))} sequences, {fmt(statistics.get('tokens'))} valid tokens "
            f"({fmt(statistics.get('usable_tokens'))} usable). π_old is the trainer's recompute, π_rollout the "
            "engine's log-prob; l = log π_old − log π_rollout = log ρ.")


def scalar_keys(*dicts: Mapping[str, Any]) -> list[str]:
    """Top-level keys whose value is a number or None: the known ones in report order, then any others."""
    keys = [key for key in STATISTICS if any(key in d for d in dicts)]
    for d in dicts:
        keys += [key for key, value in d.items() if key not in keys and _is_scalar(value)]
    return [key for key in keys if all(_is_scalar(d.get(key)) for d in dicts)]


def _is_scalar(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _whole_dump(statistics: Mapping[str, Any]) -> list[str]:
    rows = [[key, fmt(statistics.get(key)), STATISTICS.get(key, "")] for key in scalar_keys(statistics)]
    return (["## Whole-dump statistics", ""] + _table(["statistic", "value", "what it is"], rows)
            + [k3_context(statistics), ""])


def _bucket_section(statistics: Mapping[str, Any], key: str, figures: Sequence[Path] | None) -> list[str]:
    heading, bucket, count, metrics = BUCKETS[key]
    rows = _filled(statistics.get(key), count)
    lines = [f"### {heading}", "", BUCKET_NOTES[key], ""]
    if not rows:
        return lines + ["No data.", ""]
    counts = ["sequences", "tokens"] if key == "by_length" else [count]
    table = [[str(row.get("bucket"))] + [fmt(row.get(c)) for c in counts] + [fmt(row.get(m)) for m, _ in metrics]
             for row in rows]
    lines += _table([bucket] + counts + [name for _, name in metrics], table)
    return lines + _peak(rows, bucket, count, statistics) + _figure(figures, key, heading)


def _lag_section(statistics: Mapping[str, Any]) -> list[str]:
    """By version lag, and how much of the mismatch is staleness (only when the dump records lags)."""
    rows = statistics.get("by_lag") or []
    if not rows:
        return []
    lines = ["### By version lag", "", "Sequences grouped by how many weight versions behind the trainer they were "
             "generated (asynchronous training); k3 is the mean over their tokens.", ""]
    lines += _table(["lag", "sequences", "tokens", "k3", "k1", "mean |Δ log p|"],
                    [[str(row["bucket"]), fmt(row["sequences"]), fmt(row["tokens"]), fmt(row["k3"]), fmt(row["k1"]),
                      fmt(row["mean_abs_log_ratio"])] for row in rows])
    return lines + [attribution_sentence(statistics.get("lag_attribution")), ""]


def attribution_sentence(attribution: Mapping[str, Any] | None) -> str:
    """Staleness or numerics: what the lag buckets say (statistics.lag_attribution)."""
    if not attribution:
        return "The dump records no lags."
    stale = attribution.get("stale_buckets") or []
    numerics = _finite(attribution.get("numerics_k3"))
    if not stale:
        return (f"Every sequence is at lag 0: the measured k3 ({fmt(numerics)}) is the engine's numerics, with no "
                "staleness in it.")
    if numerics is None:
        return ("No sequence is at lag 0, so staleness and the engine's numerics cannot be told apart here: compare "
                "with the dump of a synchronous run (or of lag-0 samples) of the same engine.")
    parts = [f"lag {row['bucket']}: k3 {fmt(row['k3'])}, {fmt(100 * (row['staleness_share'] or 0.0))} % of it "
             "staleness" for row in stale]
    most = max((row["staleness_share"] or 0.0) for row in stale)
    verdict = ("most of the mismatch of stale samples is staleness: fix the schedule (fewer versions of lag, "
               "`rs_max_lag`, `tis_upper_bound_by_lag`) before the engine" if most > 0.5 else
               "stale samples are about as mismatched as fresh ones: the engine's numerics dominate, fix or correct "
               "them first")
    return (f"Lag-0 sequences carry no staleness: their k3 = {fmt(numerics)} is the engine's numerics. Over it "
            f"({'; '.join(parts)}): {verdict}. (This assumes the numerics do not depend on the lag.)")


def _calls_section(statistics: Mapping[str, Any], figures: Sequence[Path] | None) -> list[str]:
    rows = list(statistics.get("by_call") or [])
    lines = ["### Over calls (training time)", "", trend_sentence(statistics), ""]
    if len(rows) > MAX_CALL_ROWS:
        half = MAX_CALL_ROWS // 2
        lines += [f"The first and last {half} of {len(rows)} calls (all of them in report.json).", ""]
        rows = rows[:half] + [None] + rows[-half:]
    columns = ["call", "sequences", "tokens", "k3", "k1", "max_abs_log_ratio", "nonfinite_fraction"]
    table = [["…"] * len(columns) if row is None else [fmt(row.get(c)) for c in columns] for row in rows]
    lines += _table(["call", "sequences", "tokens", "k3", "k1", "max |Δ log p|", "non-finite"], table)
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
    lines += _table(["quantile", "l", "ρ = exp(l)"], rows) if rows else ["No quantiles.", ""]
    return lines + _figure(figures, "histogram", "histogram of the token log ratio with candidate bounds")


def _worst_section(statistics: Mapping[str, Any]) -> list[str]:
    rows = list(statistics.get("worst_sequences") or [])
    lines = ["### Worst sequences", "", "The sequences with the largest k3 (mean over their usable tokens).", ""]
    if not rows:
        return lines + ["None.", ""]
    columns = ["call", "index", "length", "k3", "max_abs_log_ratio", "worst_position"]
    return lines + _table(["call", "index", "length", "k3", "max |l|", "position of the worst token"],
                          [[fmt(row.get(c)) for c in columns] for row in rows])


# --------------------------------------------------------------------------- candidates and recommendation
def describe_config(config: Mapping[str, Any]) -> str:
    """A one-line summary of a MisConfig dict: TIS mode and bounds, rejection, veto, normalization."""
    if not config:
        return "n/a"
    if not config.get("use_tis", True):
        parts = ["metrics only"]
    else:
        low = config.get("tis_lower_bound")
        if config.get("tis_upper_bound") == "auto":
            bounds = config.get("tis_auto_bounds") or [None, None]
            parts = [f"truncate at an adaptive bound (ESS ≥ {fmt(config.get('tis_auto_target_ess'))}, searched in "
                     f"[{fmt(bounds[0])}, {fmt(bounds[-1])}])"]
        else:
            parts = [f"{config.get('tis_mode', 'truncate')} [{fmt(low)}, {fmt(config.get('tis_upper_bound'))}]"]
    if config.get("use_rs"):
        parts.append(f"RS {config.get('rs_level', 'token')} [{fmt(config.get('rs_lower_bound'))}, "
                     f"{fmt(config.get('rs_upper_bound'))}]")
    if config.get("rs_veto_threshold") is not None:
        parts.append(f"veto ρ < {fmt(config.get('rs_veto_threshold'))}")
    for option, threshold in (config.get("rs_divergence") or {}).items():
        if isinstance(threshold, (list, tuple)) and len(threshold) == 2:
            parts.append(f"reject {option} outside [{fmt(threshold[0])}, {fmt(threshold[1])}]")
        else:
            parts.append(f"reject {option} > {fmt(threshold)}")
    if config.get("tis_batch_normalize"):
        parts.append(f"normalized per {config.get('tis_batch_normalize_scope', 'micro_batch')}")
    return "; ".join(parts)


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(config)


def _rec_name(recommendation: Any) -> str | None:
    return getattr(recommendation, "name", None) if recommendation is not None else None


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
    lines += ["Each candidate's correction applied to the dumped tokens (use_tis on), grouped by level, largest ESS "
              "first. kept: the share of valid tokens / sequences trained on; ESS: (Σw)² / (N Σw²) of the final "
              "weights (1 = uniform, nothing rejected); bounded: the share of kept tokens whose weight a bound "
              "changed (a bias proxy); signal shift: the |A|-weighted mean |w − 1| (0 = gradient signal unchanged, "
              "1 = as much as rejecting every token); signal bias: its signed counterpart.", ""]
    chosen = _rec_name(recommendation)
    rows = []
    for name, result in _sorted_candidates(results):
        config = _config_dict(result.get("config"))
        label = f"**{name}** (recommended)" if name == chosen else name
        rows.append([label, str(config.get("tis_level", "n/a")), describe_config(config)]
                    + [fmt(result.get(key)) for key, _ in CANDIDATE_COLUMNS])
    return lines + _table(["candidate", "level", "correction"] + [h for _, h in CANDIDATE_COLUMNS], rows)


def _recommendation_section(recommendation: Any, config_path: Path | str | None) -> list[str]:
    name, reasons = _rec_name(recommendation), list(getattr(recommendation, "reasons", None) or [])
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


def config_yaml(config: Any) -> str:
    """The config as YAML (None values left out: they are the defaults)."""
    import yaml

    values = {k: v for k, v in _jsonable(_config_dict(config)).items() if v is not None}
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


# --------------------------------------------------------------------------- JSON, files, summary
def _jsonable(value: Any) -> Any:
    """JSON-able copy: NaN/inf -> None, tuples -> lists, Paths -> str, configs -> dicts."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if hasattr(value, "item"):  # numpy / torch scalars
        return _jsonable(value.item())
    return str(value)


def _recommendation_json(recommendation: Any) -> dict:
    config = getattr(recommendation, "config", None) if recommendation is not None else None
    return {"name": _rec_name(recommendation), "config": _jsonable(_config_dict(config)) if config else None,
            "reasons": [str(r) for r in getattr(recommendation, "reasons", None) or []]}


def to_json(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any) -> dict:
    """Everything the Markdown shows, machine-readable; no NaN/inf anywhere."""
    out = _jsonable(dict(statistics))
    for key in REQUIRED_JSON:
        out.setdefault(key, [] if key.startswith("by_") else None)
    out["k3_context"] = k3_context(statistics)
    out["trend_sentence"] = trend_sentence(statistics)
    out["safe_level"] = _safe_level.for_dump(statistics, _safe_level.load())
    out["candidates"] = _jsonable(dict(results or {}))
    out["recommendation"] = _recommendation_json(recommendation)
    return out


def write_report(out_dir: Path, statistics: Mapping[str, Any], results: Mapping[str, Any] | None,
                 recommendation: Any, *, title: str, with_figures: bool = True,
                 config_path: Path | str | None = None) -> dict[str, Path]:
    """OUT/report.md, OUT/report.json and (with matplotlib, unless with_figures is False) the PNGs.
    Returns {"markdown": …, "json": …, <figure key>: …}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures, note = None, None if with_figures else "Figures not drawn (turned off: --no-figures)."
    if with_figures and _figures.figures_available():
        bounds = _figures.candidate_bounds(results, first=_rec_name(recommendation))
        figures = _figures.write_figures(statistics, out_dir, candidates=results, bounds=bounds)
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "report.json"}
    paths["markdown"].write_text(render_markdown(statistics, results, recommendation, title=title, figures=figures,
                                                 config_path=config_path, figures_note=note), encoding="utf-8")
    data = to_json(statistics, results, recommendation)
    data["figures"] = [p.name for p in figures] if figures is not None else None
    _write_json(paths["json"], data)
    for key, path in zip(_figures.FIGURES, figures or []):
        paths[key] = path
    return paths


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def summary_text(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any) -> str:
    """A few lines for stdout: size, k3, non-finite share, trend, recommendation."""
    name, reasons = _rec_name(recommendation), list(getattr(recommendation, "reasons", None) or [])
    lines = [_size_line(statistics).split(". ")[0] + ".",
             f"token k3 = {fmt(statistics.get('k3'))}, mean |Δ log p| = {fmt(statistics.get('mean_abs_log_ratio'))}, "
             f"max |Δ log p| = {fmt(statistics.get('max_abs_log_ratio'))}",
             f"non-finite log-probs: {fmt(statistics.get('nonfinite_fraction'))} of valid tokens",
             trend_sentence(statistics)]
    safe = _safe_level.for_dump(statistics, _safe_level.load())
    if safe is not None:
        lines.append(safe)
    first = f" ({reasons[0]})" if reasons else ""
    evaluated = f" of {len(results)} candidates" if results else ""
    lines.append(f"recommendation{evaluated}: {name if name is not None else 'none'}{first}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- comparison of two dumps
def ratio(a: Any, b: Any) -> float | None:
    """B / A; None when either is missing or A is 0."""
    a, b = _finite(a), _finite(b)
    return None if a is None or b is None or a == 0 else b / a


def differs(a: Any, b: Any) -> bool:
    """A difference worth highlighting: B/A > 2 or < 0.5, one value missing, or A = 0 ≠ B."""
    a, b = _finite(a), _finite(b)
    if a is None or b is None:
        return (a is None) != (b is None)
    if a == 0:
        return b != 0
    return not 0.5 <= b / a <= 2


def _ratio_cell(a: Any, b: Any) -> str:
    value = ratio(a, b)
    if value is None:
        return "—" if _finite(a) == 0 and _finite(b) == 0 else "n/a"
    return fmt(value)


def _pair_cells(a: Any, b: Any, highlight: bool = True) -> list[str]:
    cells = [fmt(a), fmt(b), _ratio_cell(a, b)]
    return [f"**{c}**" for c in cells] if highlight and differs(a, b) else cells


def differences(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any]) -> list[dict]:
    """The highlighted differences (whole-dump mismatch statistics, bucket metrics, trend), largest first:
    [{"where", "statistic", "a", "b", "ratio"}]; sizes (files, tokens, …) are not differences."""
    found = [("whole dump", key, stats_a.get(key), stats_b.get(key))
             for key in scalar_keys(stats_a, stats_b) if key not in COUNTS]
    for table, (_, bucket, count, metrics) in BUCKETS.items():
        for label, row_a, row_b in _matched(stats_a.get(table), stats_b.get(table), count):
            found += [(f"{table} {label}", metric, row_a.get(metric), row_b.get(metric)) for metric, _ in metrics]
    trend_a, trend_b = stats_a.get("trend") or {}, stats_b.get("trend") or {}
    found += [("trend", key, trend_a.get(key), trend_b.get(key)) for key in ("k3_first_half", "k3_second_half",
                                                                            "growth")]
    out = [{"where": where, "statistic": key, "a": _jsonable(a), "b": _jsonable(b), "ratio": _jsonable(ratio(a, b))}
           for where, key, a, b in found if differs(a, b)]
    return sorted(out, key=_size_of_difference, reverse=True)


def _size_of_difference(entry: Mapping[str, Any]) -> float:
    value = entry["ratio"]
    return math.inf if value is None or value <= 0 else abs(math.log(value))


def _matched(rows_a: Sequence[Mapping] | None, rows_b: Sequence[Mapping] | None, count: str):
    """(bucket label, row of A or {}, row of B or {}) for buckets with data in either dump, A's order first."""
    by_a = {str(r.get("bucket")): r for r in _filled(rows_a, count)}
    by_b = {str(r.get("bucket")): r for r in _filled(rows_b, count)}
    labels = list(by_a) + [label for label in by_b if label not in by_a]
    return [(label, by_a.get(label, {}), by_b.get(label, {})) for label in labels]


def render_comparison(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any], results_a: Mapping[str, Any] | None,
                      results_b: Mapping[str, Any] | None, rec_a: Any, rec_b: Any, *,
                      names: tuple[str, str] = ("A", "B")) -> str:
    """The two dumps side by side (columns A, B, B/A), differences in bold and listed, both recommendations."""
    a, b = names
    lines = [f"# miles_mis comparison: {a} vs {b}", ""]
    for name, stats in ((a, stats_a), (b, stats_b)):
        lines += [line.replace("**Warning:**", f"**Warning ({name}):**") for line in _warnings(stats)]
    lines += [f"- {a}: {_size_line(stats_a).split('. ')[0]}.", f"- {b}: {_size_line(stats_b).split('. ')[0]}.", "",
              f"Cells in bold: {b}/{a} > 2 or < 0.5, or a value on one side only.", ""]
    lines += _largest_differences(differences(stats_a, stats_b), names)
    rows = [[key] + _pair_cells(stats_a.get(key), stats_b.get(key), key not in COUNTS)
            for key in scalar_keys(stats_a, stats_b)]
    lines += ["## Whole-dump statistics", ""] + _table(["statistic", a, b, f"{b}/{a}"], rows)
    lines += [f"- {a}: {k3_context(stats_a)}", f"- {b}: {k3_context(stats_b)}", ""]
    lines += ["## Where the mismatch lives", ""]
    for key in BUCKETS:
        lines += _bucket_comparison(stats_a, stats_b, key, names)
    lines += ["### Over calls (training time)", "", f"- {a}: {trend_sentence(stats_a)}",
              f"- {b}: {trend_sentence(stats_b)}", ""]
    lines += _candidates_comparison(results_a, results_b, names)
    lines += _recommendations_comparison(rec_a, rec_b, names)
    return "\n".join(lines).rstrip() + "\n"


def _largest_differences(found: list[dict], names: tuple[str, str], limit: int = 10) -> list[str]:
    a, b = names
    lines = ["## Largest differences", ""]
    if not found:
        return lines + [f"None: every mismatch statistic of {b} is within a factor 2 of {a}'s.", ""]
    for entry in found[:limit]:
        lines.append(f"- **{entry['statistic']}** ({entry['where']}): {a} {fmt(entry['a'])}, {b} {fmt(entry['b'])}, "
                     f"{b}/{a} = {_ratio_cell(entry['a'], entry['b'])}")
    more = len(found) - limit
    return lines + ([f"- … and {more} more (comparison.json)"] if more > 0 else []) + [""]


def _bucket_comparison(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any], key: str,
                       names: tuple[str, str]) -> list[str]:
    heading, bucket, count, metrics = BUCKETS[key]
    a, b = names
    matched = _matched(stats_a.get(key), stats_b.get(key), count)
    lines = [f"### {heading}", ""]
    if not matched:
        return lines + ["No data.", ""]
    header = [bucket, f"{count} {a}", f"{count} {b}"]
    for _, title in metrics:
        header += [f"{title} {a}", f"{title} {b}", f"{b}/{a}"]
    rows = []
    for label, row_a, row_b in matched:
        cells = [label, fmt(row_a.get(count)), fmt(row_b.get(count))]
        for metric, _ in metrics:
            cells += _pair_cells(row_a.get(metric), row_b.get(metric))
        rows.append(cells)
    return lines + _table(header, rows)


def _candidates_comparison(results_a: Mapping[str, Any] | None, results_b: Mapping[str, Any] | None,
                           names: tuple[str, str]) -> list[str]:
    a, b = names
    results_a, results_b = results_a or {}, results_b or {}
    lines = ["## Candidate configurations", ""]
    labels = list(results_a) + [n for n in results_b if n not in results_a]
    if not labels:
        return lines + ["No candidate was evaluated.", ""]
    columns = [("kept_token_fraction", "kept tokens"), ("ess", "ESS"), ("bounded_fraction", "bounded")]
    header = ["candidate"]
    for _, title in columns:
        header += [f"{title} {a}", f"{title} {b}", f"{b}/{a}"]
    rows = []
    for label in labels:
        row_a, row_b = results_a.get(label) or {}, results_b.get(label) or {}
        rows.append([str(label)] + [c for key, _ in columns for c in _pair_cells(row_a.get(key), row_b.get(key))])
    return lines + _table(header, rows)


def _recommendations_comparison(rec_a: Any, rec_b: Any, names: tuple[str, str]) -> list[str]:
    lines = ["## Recommendations", ""]
    for name, rec in zip(names, (rec_a, rec_b)):
        chosen = _rec_name(rec)
        reasons = "; ".join(getattr(rec, "reasons", None) or []) or "no reason given"
        lines.append(f"- {name}: {f'`{chosen}`' if chosen else 'none'} — {reasons}")
    same = _rec_name(rec_a) == _rec_name(rec_b)
    return lines + ["", "Both dumps get the same recommendation." if same else
                    "**The recommendations differ.**", ""]


def comparison_json(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any], results_a: Mapping[str, Any] | None,
                    results_b: Mapping[str, Any] | None, rec_a: Any, rec_b: Any, *,
                    names: tuple[str, str] = ("A", "B")) -> dict:
    """{"names", "a", "b", "differences"}: both reports (``to_json``) and the highlighted differences."""
    return {"names": list(names), "a": to_json(stats_a, results_a, rec_a), "b": to_json(stats_b, results_b, rec_b),
            "differences": differences(stats_a, stats_b)}


def write_comparison(out_dir: Path, stats_a: Mapping[str, Any], stats_b: Mapping[str, Any],
                     results_a: Mapping[str, Any] | None, results_b: Mapping[str, Any] | None, rec_a: Any, rec_b: Any,
                     *, names: tuple[str, str] = ("A", "B")) -> dict[str, Path]:
    """OUT/comparison.md and OUT/comparison.json; returns {"markdown": …, "json": …}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "comparison.md", "json": out_dir / "comparison.json"}
    paths["markdown"].write_text(render_comparison(stats_a, stats_b, results_a, results_b, rec_a, rec_b, names=names),
                                 encoding="utf-8")
    _write_json(paths["json"], comparison_json(stats_a, stats_b, results_a, results_b, rec_a, rec_b, names=names))
    return paths
