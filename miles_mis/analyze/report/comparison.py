"""The comparison of two dumps (``miles-mis analyze A --compare B``): side by side in Markdown (columns A, B and
B/A, differences in bold and listed largest first, both recommendations), comparison.json (both reports and the
differences), and the two files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from .configs import recommendation_name
from .figures import finite_number as _finite
from .formatting import fmt, jsonable, markdown_table, write_json
from .as_json import to_json
from .sentences import k3_context, size_line, trend_sentence, warning_lines
from .tables import BUCKETS, COUNTS, filled_rows, scalar_keys


# --------------------------------------------------------------------------- differences
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
    out = [{"where": where, "statistic": key, "a": jsonable(a), "b": jsonable(b), "ratio": jsonable(ratio(a, b))}
           for where, key, a, b in found if differs(a, b)]
    return sorted(out, key=_size_of_difference, reverse=True)


def _size_of_difference(entry: Mapping[str, Any]) -> float:
    value = entry["ratio"]
    return math.inf if value is None or value <= 0 else abs(math.log(value))


def _matched(rows_a: Sequence[Mapping] | None, rows_b: Sequence[Mapping] | None, count: str):
    """(bucket label, row of A or {}, row of B or {}) for buckets with data in either dump, A's order first."""
    by_a = {str(r.get("bucket")): r for r in filled_rows(rows_a, count)}
    by_b = {str(r.get("bucket")): r for r in filled_rows(rows_b, count)}
    labels = list(by_a) + [label for label in by_b if label not in by_a]
    return [(label, by_a.get(label, {}), by_b.get(label, {})) for label in labels]


# --------------------------------------------------------------------------- Markdown
def render_comparison(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any], results_a: Mapping[str, Any] | None,
                      results_b: Mapping[str, Any] | None, rec_a: Any, rec_b: Any, *,
                      names: tuple[str, str] = ("A", "B")) -> str:
    """The two dumps side by side (columns A, B, B/A), differences in bold and listed, both recommendations."""
    a, b = names
    lines = [f"# miles_mis comparison: {a} vs {b}", ""]
    for name, stats in ((a, stats_a), (b, stats_b)):
        lines += [line.replace("**Warning:**", f"**Warning ({name}):**") for line in warning_lines(stats)]
    lines += [f"- {a}: {size_line(stats_a).split('. ')[0]}.", f"- {b}: {size_line(stats_b).split('. ')[0]}.", "",
              f"Cells in bold: {b}/{a} > 2 or < 0.5, or a value on one side only.", ""]
    lines += _largest_differences(differences(stats_a, stats_b), names)
    rows = [[key] + _pair_cells(stats_a.get(key), stats_b.get(key), key not in COUNTS)
            for key in scalar_keys(stats_a, stats_b)]
    lines += ["## Whole-dump statistics", ""] + markdown_table(["statistic", a, b, f"{b}/{a}"], rows)
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
    return lines + markdown_table(header, rows)


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
    return lines + markdown_table(header, rows)


def _recommendations_comparison(rec_a: Any, rec_b: Any, names: tuple[str, str]) -> list[str]:
    lines = ["## Recommendations", ""]
    for name, rec in zip(names, (rec_a, rec_b)):
        chosen = recommendation_name(rec)
        reasons = "; ".join(getattr(rec, "reasons", None) or []) or "no reason given"
        lines.append(f"- {name}: {f'`{chosen}`' if chosen else 'none'} — {reasons}")
    same = recommendation_name(rec_a) == recommendation_name(rec_b)
    return lines + ["", "Both dumps get the same recommendation." if same else
                    "**The recommendations differ.**", ""]


def _ratio_cell(a: Any, b: Any) -> str:
    value = ratio(a, b)
    if value is None:
        return "—" if _finite(a) == 0 and _finite(b) == 0 else "n/a"
    return fmt(value)


def _pair_cells(a: Any, b: Any, highlight: bool = True) -> list[str]:
    cells = [fmt(a), fmt(b), _ratio_cell(a, b)]
    return [f"**{c}**" for c in cells] if highlight and differs(a, b) else cells


# --------------------------------------------------------------------------- JSON and files
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
    write_json(paths["json"], comparison_json(stats_a, stats_b, results_a, results_b, rec_a, rec_b, names=names))
    return paths
