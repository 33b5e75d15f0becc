"""The analyze report written to a directory (``write_report``: report.md, report.json, report.html and, with
matplotlib, the PNGs), the HTML page alone (``write_html_report``, its figures drawn in a temporary directory) and the
few lines printed instead of them (``summary_text``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping

from . import figures as _figures
from .. import safe_level as _safe_level
from .configs import recommendation_name
from .formatting import fmt, write_json
from .page import render_html, write_html
from .as_json import to_json
from .markdown import render_markdown
from .sentences import size_line, trend_sentence


def write_report(out_dir: Path, statistics: Mapping[str, Any], results: Mapping[str, Any] | None,
                 recommendation: Any, *, title: str, with_figures: bool = True,
                 config_path: Path | str | None = None,
                 score_centering: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """OUT/report.md, OUT/report.json, OUT/report.html (one self-contained page, ``page``) and (with
    matplotlib, unless with_figures is False) the PNGs, with the score-centering figure (key "score_centering") when
    ``score_centering`` (``sc_metrics.summarize``) holds series.
    Returns {"markdown": …, "json": …, "html": …, <figure key>: …}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures, note = draw_figures(out_dir, statistics, results, recommendation, with_figures, score_centering)
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "report.json", "html": out_dir / "report.html"}
    paths["markdown"].write_text(render_markdown(statistics, results, recommendation, title=title, figures=figures,
                                                 config_path=config_path, figures_note=note,
                                                 score_centering=score_centering), encoding="utf-8")
    write_html(paths["html"], render_html(statistics, results, recommendation, title=title, figures=figures,
                                          figures_note=note, config_path=config_path,
                                          score_centering=score_centering))
    data = to_json(statistics, results, recommendation, score_centering)
    data["figures"] = [p.name for p in figures] if figures is not None else None
    write_json(paths["json"], data)
    for key, path in zip(_figures.FIGURES, figures or []):
        paths[key] = path
    if figures and figures[-1].name == _figures.SC_FIGURE:
        paths["score_centering"] = figures[-1]
    return paths


def draw_figures(out_dir: Path, statistics: Mapping[str, Any], results: Mapping[str, Any] | None,
                 recommendation: Any, with_figures: bool = True,
                 score_centering: Mapping[str, Any] | None = None) -> tuple[list[Path] | None, str | None]:
    """The report's PNGs in out_dir (the score-centering one when ``score_centering`` holds series): (their paths,
    None); (None, why not) when turned off; (None, None) without matplotlib (the reports say how to get it)."""
    if not with_figures:
        return None, "Figures not drawn (turned off: --no-figures)."
    if not _figures.figures_available():
        return None, None
    bounds = _figures.candidate_bounds(results, first=recommendation_name(recommendation))
    figures = _figures.write_figures(statistics, out_dir, candidates=results, bounds=bounds)
    if score_centering and score_centering.get("present"):
        figures.append(_figures.write_score_centering_figure(score_centering, out_dir))
    return figures, None


def write_html_report(path: Path | str, statistics: Mapping[str, Any], results: Mapping[str, Any] | None,
                      recommendation: Any, *, title: str, with_figures: bool = True,
                      config_path: Path | str | None = None,
                      score_centering: Mapping[str, Any] | None = None) -> Path:
    """The HTML page alone at ``path``: its figures are drawn in a temporary directory, inlined, then deleted."""
    with tempfile.TemporaryDirectory(prefix="miles_mis_figures_") as scratch:
        figures, note = draw_figures(Path(scratch), statistics, results, recommendation, with_figures,
                                     score_centering)
        return write_html(path, render_html(statistics, results, recommendation, title=title, figures=figures,
                                            figures_note=note, config_path=config_path,
                                            score_centering=score_centering))


def summary_text(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any,
                 score_centering: Mapping[str, Any] | None = None) -> str:
    """A few lines for stdout: size, k3, non-finite share, trend, the score-centering tail ratio (with a metrics file
    that holds it), recommendation."""
    name, reasons = recommendation_name(recommendation), list(getattr(recommendation, "reasons", None) or [])
    lines = [size_line(statistics).split(". ")[0] + ".",
             f"token k3 = {fmt(statistics.get('k3'))}, mean |Δ log p| = {fmt(statistics.get('mean_abs_log_ratio'))}, "
             f"max |Δ log p| = {fmt(statistics.get('max_abs_log_ratio'))}",
             f"non-finite log-probs: {fmt(statistics.get('nonfinite_fraction'))} of valid tokens",
             trend_sentence(statistics)]
    safe = _safe_level.for_dump(statistics, _safe_level.load())
    if safe is not None:
        lines.append(safe)
    tail = (score_centering or {}).get("tail_ratio")
    if tail:
        lines.append(sc_line(score_centering))
    first = f" ({reasons[0]})" if reasons else ""
    evaluated = f" of {len(results)} candidates" if results else ""
    lines.append(f"recommendation{evaluated}: {name if name is not None else 'none'}{first}")
    return "\n".join(lines) + "\n"


def sc_line(summary: Mapping[str, Any]) -> str:
    """One stdout line on the score-centering tail ratio of a metrics file (``sc_metrics.summarize``'s output)."""
    tail = summary["tail_ratio"]
    def at(step):
        return "never" if step is None else f"step {step}"
    rise = "n/a" if tail["rise_threshold"] is None else at(tail["first_step_above_rise"])
    return (f"score centering ({summary['file']}, {tail['steps']} steps): tail ratio first-{tail['baseline_steps']}-"
            f"step median {fmt(tail['baseline_median'])}, max {fmt(tail['max'])} (step {tail['max_step']}), last "
            f"{fmt(tail['last'])}; above {fmt(tail['rise_factor'])}x the median: {rise}; above "
            f"{fmt(tail['limit'])}: {at(tail['first_step_above_limit'])}")
