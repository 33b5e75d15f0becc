"""Score centering over training steps: the per-step metrics a run logged, read for ``miles-mis analyze --metrics``.

Score centering (docs/score_centering.md) logs five values per training step, each the host's ``sum_of_sample_mean``
of a per-token value: our adapters as ``mis_sc_<name>``, miles' ``--loss-type score_centering`` as ``sc_<name>``
(under W&B's ``train/`` namespace: ``train/sc_tail_ratio``). ``read_metrics`` reads them from

- the lab's ``metrics.jsonl`` (one JSON object per step, with ``step``), or any JSON-lines file of objects;
- a JSON array of such objects (a W&B history exported as records);
- a CSV with a header and a step column (a W&B history or chart export).

A key is recognised by its last ``/`` part (any prefix: ``train/sc_tail_ratio``, ``train/mis_sc_tail_ratio``) and,
in a W&B chart export, after its ``<run name> - `` prefix; its ``__MIN``/``__MAX`` columns are not read. The step is
the first of ``STEP_KEYS`` present in the first row that carries a score-centering value (``train/step`` in a miles
W&B history, ``step`` in the lab's file), and every row with a value must carry it.

What is refused (a one-line ``ValueError`` naming the file and the line or record): a file that cannot be read, a
line that is not a JSON object, a row without any step key, a step that is not an integer, a score-centering value
that is not a number, two keys giving the same series (``mis_sc_tail_ratio`` and ``sc_tail_ratio`` in one file). What
is skipped and counted (said in the report): a NaN or infinite value (the step keeps its other values), a value a
later row of the same step replaces, and rows without any score-centering value.

``summarize`` turns what was read into the report's numbers (every one over the finite values, by step):
the tail ratio's median over its first ``BASELINE_STEPS`` steps, its maximum, its last value, the first step where
it exceeds ``RISE_FACTOR`` times that median and the first where it exceeds ``TAIL_LIMIT``; for each series its
first, minimum, median, maximum and last value; and every step's values. ``advice`` weighs them against the
published score-centering outcomes (``published.with_topic("score_centering")``) and cites the lab's paired
verdicts after them (``lab_centering``), saying what was measured and never that a run is safe.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics as _stats
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import lab_centering, published

# the series in report order: name -> what it is (the per-token value the host averages)
SERIES = {
    "tail_ratio": "tail ratio ρ = max(1 − Q, ε) / max(1 − P, ε), the tail model's q/p",
    "train_head_mass": "train head mass P = Σ_H p_h",
    "rollout_head_mass": "rollout head mass Q = Σ_H q_h",
    "importance_weight": "importance weight w = f(p_y / q_y)",
    "correction": "correction Σ_H c_h log p_h, the subtracted expected score",
}
OURS, MILES = "mis_sc_", "sc_"  # miles_mis' adapters and miles' --loss-type score_centering
STEP_KEYS = ("step", "train/step", "_step", "Step", "global_step")
METRICS_FILE = "metrics.jsonl"  # what the lab writes in its run directory
FORMATS = {"jsonl": "JSON lines", "json": "a JSON array", "csv": "CSV"}
BASELINE_STEPS = 10
RISE_FACTOR = 2.0
TAIL_LIMIT = 20.0
MAX_STEP_ROWS = 40


@dataclass
class MetricsFile:
    """What ``read_metrics`` found in one file."""

    path: Path
    format: str  # "jsonl", "json" or "csv"
    rows: int = 0  # rows (records) read
    rows_without_sc: int = 0  # rows with no score-centering value
    step_key: str | None = None
    keys: dict[str, str] = field(default_factory=dict)  # series -> the key it was read from
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> series -> value
    nonfinite: int = 0  # NaN/inf values skipped
    first_nonfinite: str | None = None  # where the first one was ("line 4, train/sc_tail_ratio = nan")
    replaced: int = 0  # values a later row of the same step replaced
    first_replaced: str | None = None

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of one series, by step."""
        return [(step, row[name]) for step, row in sorted(self.values.items()) if name in row]


def series_of(key: str) -> tuple[str, str] | None:
    """(series, whose name) of a logged key, or None: ``train/sc_tail_ratio`` -> ("tail_ratio", "miles")."""
    name = key.rsplit(" - ", 1)[-1].rsplit("/", 1)[-1]
    for series in SERIES:
        if name == OURS + series:
            return series, "miles_mis"
        if name == MILES + series:
            return series, "miles"
    return None


def find_metrics(dump_dir: Path | str, explicit: Path | str | None) -> tuple[Path | None, bool]:
    """(the metrics file to read, whether it was found rather than given): ``--metrics FILE`` when given, else the
    lab's ``metrics.jsonl`` in the dump directory when there is one, else (None, False)."""
    if explicit is not None:
        return Path(explicit), False
    found = Path(dump_dir) / METRICS_FILE
    return (found, True) if found.is_file() else (None, False)


def read_metrics(path: Path | str) -> MetricsFile:
    """Read a metrics file (JSON lines, a JSON array of objects, or CSV); one-line ValueError for bad input."""
    path = Path(path)
    text = _read_text(path)
    if not text.strip():
        raise ValueError(f"{path}: empty file: no metrics rows")
    if path.suffix.lower() == ".csv":
        result = MetricsFile(path, "csv")
        records = _csv_records(path, text)
    elif text.lstrip().startswith("["):
        result = MetricsFile(path, "json")
        records = _array_records(path, text)
    else:
        result = MetricsFile(path, "jsonl")
        records = _jsonl_records(path, text)
    for where, record in records:
        _take(result, where, record)
    return result


# --------------------------------------------------------------------------- reading
def _read_text(path: Path) -> str:
    if not path.exists():
        raise ValueError(f"{path} does not exist (--metrics FILE: a metrics.jsonl, a JSON export or a CSV)")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a metrics file (--metrics FILE: a metrics.jsonl, a JSON "
                         "export or a CSV)")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: unreadable: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except OSError as error:
        raise ValueError(f"{path}: unreadable ({error.strerror or error})") from None


def _jsonl_records(path: Path, text: str):
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not an object of metrics")
        yield f"line {number}", record


def _array_records(path: Path, text: str):
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: a JSON {type(records).__name__}, not a list of metrics objects")
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise ValueError(f"{path}: record {number} is a JSON {type(record).__name__}, not an object of metrics")
        yield f"record {number}", record


def _csv_records(path: Path, text: str):
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
        if not any(key in header for key in STEP_KEYS):
            shown = ", ".join(header[:6]) + (f", … ({len(header)} columns)" if len(header) > 6 else "")
            raise ValueError(f"{path}:1: no step column (one of {', '.join(STEP_KEYS)}); the header has: {shown}")
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            if len(row) > len(header):
                raise ValueError(f"{path}:{reader.line_num}: {len(row)} fields, but the header has {len(header)}")
            yield f"line {reader.line_num}", dict(zip(header, row))
    except csv.Error as error:
        raise ValueError(f"{path}:{reader.line_num}: not CSV ({error})") from None


def _take(result: MetricsFile, where: str, record: Mapping[str, Any]) -> None:
    """One row: its score-centering values under its step."""
    result.rows += 1
    found = {}
    for key, raw in record.items():
        match = series_of(str(key))
        if match is None or _absent(raw):
            continue
        series = match[0]
        earlier = result.keys.setdefault(series, str(key))
        if earlier != str(key):
            raise ValueError(f"{result.path}: {where}: both '{earlier}' and '{key}' give the {series.replace('_', ' ')}"
                             ": keep one run's (or one host's) series per file")
        found[series] = (str(key), _number(result.path, where, str(key), raw))
    if not any(_present(record, key) for key in STEP_KEYS):
        raise ValueError(f"{result.path}: {where}: no step (looked for {', '.join(STEP_KEYS)})")
    if not found:
        result.rows_without_sc += 1
        return
    if result.step_key is None:
        result.step_key = next(key for key in STEP_KEYS if _present(record, key))
    if not _present(record, result.step_key):
        raise ValueError(f"{result.path}: {where}: no '{result.step_key}' (the step of this file's earlier rows with "
                         "score-centering values)")
    step = _step(result.path, where, result.step_key, record[result.step_key])
    for series, (key, value) in found.items():
        if not math.isfinite(value):
            result.nonfinite += 1
            result.first_nonfinite = result.first_nonfinite or f"{where}, {key} = {value}"
            continue
        row = result.values.setdefault(step, {})
        if series in row:
            result.replaced += 1
            result.first_replaced = result.first_replaced or f"step {step}, {key} ({where})"
        row[series] = value


def _absent(raw: Any) -> bool:
    return raw is None or (isinstance(raw, str) and not raw.strip())


def _present(record: Mapping[str, Any], key: str) -> bool:
    return key in record and not _absent(record[key])


def _number(path: Path, where: str, key: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{path}: {where}: {key} is a {type(raw).__name__}, not a number")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{path}: {where}: {key} = {raw!r} is not a number") from None


def _step(path: Path, where: str, key: str, raw: Any) -> int:
    try:
        number = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or not number.is_integer():
        raise ValueError(f"{path}: {where}: {key} = {raw!r} is not an integer step")
    return int(number)


# --------------------------------------------------------------------------- the report's numbers
def summarize(metrics: MetricsFile, found_in_run_dir: bool = False) -> dict:
    """The score-centering section's numbers (JSON-able, no NaN): see the module docstring. ``present`` is False when
    the file holds no score-centering value (then only what was read is described)."""
    steps = sorted(metrics.values)
    out = {"file": str(metrics.path), "found_in_run_directory": found_in_run_dir, "format": metrics.format,
           "rows": metrics.rows, "rows_without_values": metrics.rows_without_sc, "present": bool(steps),
           "step_key": metrics.step_key, "steps": len(steps), "first_step": steps[0] if steps else None,
           "last_step": steps[-1] if steps else None,
           "keys": {series: {"key": key, "names": _whose(key)} for series, key in metrics.keys.items()},
           "missing": [series for series in SERIES if not metrics.series(series)],
           "nonfinite_skipped": metrics.nonfinite, "first_nonfinite": metrics.first_nonfinite,
           "replaced": metrics.replaced, "first_replaced": metrics.first_replaced}
    if not steps:
        return out
    out["tail_ratio"] = tail_ratio_summary(metrics.series("tail_ratio"))
    out["series"] = {series: series_summary(metrics.series(series)) for series in SERIES if metrics.series(series)}
    out["per_step"] = [{"step": step, **{series: metrics.values[step].get(series) for series in SERIES}}
                       for step in steps]
    out["advice"] = advice(out)
    return out


def tail_ratio_summary(points: Sequence[tuple[int, float]]) -> dict | None:
    """The tail ratio's baseline (median over its first ``BASELINE_STEPS`` steps), maximum, last value, and the
    first steps where it exceeds ``RISE_FACTOR`` × the baseline and ``TAIL_LIMIT``; None without a value."""
    if not points:
        return None
    first = points[:BASELINE_STEPS]
    baseline = _stats.median(value for _, value in first)
    top = max(points, key=lambda point: point[1])  # the first step reaching the maximum
    rise = RISE_FACTOR * baseline if baseline > 0 else None
    return {"baseline_median": baseline, "baseline_steps": len(first),
            "baseline_first_step": first[0][0], "baseline_last_step": first[-1][0],
            "max": top[1], "max_step": top[0], "last": points[-1][1], "last_step": points[-1][0],
            "rise_factor": RISE_FACTOR, "rise_threshold": rise,
            "first_step_above_rise": next((step for step, value in points if rise is not None and value > rise), None),
            "limit": TAIL_LIMIT,
            "first_step_above_limit": next((step for step, value in points if value > TAIL_LIMIT), None),
            "steps": len(points)}


def series_summary(points: Sequence[tuple[int, float]]) -> dict:
    """First, minimum, median, maximum and last (with their steps) of one series."""
    low = min(points, key=lambda point: point[1])
    high = max(points, key=lambda point: point[1])
    return {"steps": len(points), "first": points[0][1], "first_step": points[0][0],
            "min": low[1], "min_step": low[0], "median": _stats.median(value for _, value in points),
            "max": high[1], "max_step": high[0], "last": points[-1][1], "last_step": points[-1][0]}


def _whose(key: str) -> str:
    match = series_of(key)
    return "miles_mis' mis_sc_*" if match and match[1] == "miles_mis" else "miles' sc_*"


def _g(value: float) -> str:
    return f"{value:.4g}"


def advice(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]] | None = None,
           lab: Mapping[str, Any] | None = None) -> str:
    """What the file measured, the published score-centering outcomes (``rows``: the shipped ones by default), the
    lab's paired verdicts after them (``lab``: the shipped ``lab_centering`` file by default, {} for none), and how
    the file weighs against the outcomes. Never says a run is safe."""
    rows = published.load() if rows is None else rows
    evidence = published.with_topic("score_centering", rows)
    parts = [_measured(summary)]
    weights = (summary.get("series") or {}).get("importance_weight")
    per_step = summary.get("per_step") or []
    if weights and all(row.get("importance_weight") in (None, 1.0) for row in per_step):
        parts.append("The logged importance weight is exactly 1 at every step, which is what score centering with no "
                     "weight (score_centering_is: none) logs.")
    if evidence:
        parts.append("Published score-centering outcomes: " + "; ".join(published.cite(row).rstrip(".")
                                                                         for row in evidence) + ".")
    parts.append(lab_centering.sentence(lab) or "")
    parts.append(_weighed(summary, evidence))
    return " ".join(part for part in parts if part)


def _measured(summary: Mapping[str, Any]) -> str:
    tail = summary.get("tail_ratio")
    if not tail:
        return (f"This file has no tail ratio (mis_sc_tail_ratio or sc_tail_ratio) in its {summary['steps']} steps "
                "with score-centering values, so the rise published runs showed first cannot be read from it.")
    few = f" (all it has: fewer than {BASELINE_STEPS})" if tail["baseline_steps"] < BASELINE_STEPS else ""
    text = (f"Measured in this file: the tail ratio over {tail['steps']} steps ({tail['baseline_first_step']}–"
            f"{tail['last_step']}) has a median of {_g(tail['baseline_median'])} over its first "
            f"{tail['baseline_steps']} steps{few}, a maximum of {_g(tail['max'])} at step {tail['max_step']} and "
            f"ends at {_g(tail['last'])} (step {tail['last_step']}).")
    rise, limit, top = tail["first_step_above_rise"], tail["first_step_above_limit"], _g(TAIL_LIMIT)
    if tail["rise_threshold"] is None:
        text += " Its first-steps median is not positive, so no rise against it is measured."
    elif rise is not None:
        text += f" It first exceeded {_g(RISE_FACTOR)}× that median at step {rise}"
        text += f" and {top} at step {limit}." if limit is not None else f", and never exceeded {top}."
    else:
        text += f" It never exceeded {_g(RISE_FACTOR)}× that median"
        text += f", but exceeded {top} at step {limit}." if limit is not None else f" nor {top}."
    return text


def _weighed(summary: Mapping[str, Any], evidence: Sequence[Mapping[str, Any]]) -> str:
    tail = summary.get("tail_ratio")
    if not tail:
        return "Log the tail ratio with the other values to compare this run with those outcomes."
    collapsed = [row for row in evidence if row.get("outcome") in published.WENT_WRONG and row.get("outcome_step")]
    began = f" (from about step {collapsed[0]['outcome_step']} there)" if collapsed else ""
    rose = tail["first_step_above_rise"] is not None or tail["first_step_above_limit"] is not None
    if rose:
        first = min(step for step in (tail["first_step_above_rise"], tail["first_step_above_limit"])
                    if step is not None)
        return (f"In the collapses cited, the tail ratio's rise came before the reward fell{began}: weigh this run's "
                f"reward and response length from step {first} on. Where score centering held in those outcomes it "
                "carried MIS weights [0.5, 5] (score_centering_is: mis, score_centering_mis_low: 0.5, "
                "score_centering_mis_high: 5.0).")
    return (f"No such rise in these {tail['steps']} steps, up to step {tail['last_step']}: that is what this file "
            f"measured, not a forecast; in the collapses cited the rise began within tens of steps{began}, and a "
            "later one would show here first. Keep logging the tail ratio.")


def step_rows(summary: Mapping[str, Any]) -> list[dict | None]:
    """The per-step rows the Markdown shows: all of them up to ``MAX_STEP_ROWS``, else the first and last half of
    that with None between them."""
    rows = list(summary.get("per_step") or [])
    if len(rows) <= MAX_STEP_ROWS:
        return rows
    half = MAX_STEP_ROWS // 2
    return rows[:half] + [None] + rows[-half:]
