"""The analyze report as one self-contained HTML page (``render_html``), for a browser or to attach to an issue.

One file that loads nothing: the CSS is inline, the figures are the report's PNGs as base64 data: URIs, and a
Content-Security-Policy forbids every fetch (``default-src 'none'``; images only from data:, the one inline script
only by its hash). The script sorts a table by a click on its heading; without it the page reads the same.

The sections, in order: the advice (the recommendation, its YAML, its reasons, the warnings and what the evidence says
about this mismatch), the worst sequences token by token (``strips``), the candidates' table (the rows of
report.md), the figures, and the published outcomes the advice cites, each linked to its source. Every text value is
HTML-escaped.
"""

from __future__ import annotations

import base64
import hashlib
import re
from html import escape
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import figures as _figures
from .. import published as _published
from .. import safe_level as _safe_level
from .. import truncation as _truncation
from .formatting import fmt
from .configs import config_yaml, recommendation_name
from .markdown import CANDIDATE_HEADER, CANDIDATE_NOTE, USAGE, candidate_rows, staleness_evidence
from .sentences import size_line, warning_lines
from .strips import strips_section
from .tables import BUCKETS

SECTIONS = ("advice", "strips", "candidates", "figures", "published")
CAPTIONS = {**{_figures.FIGURES[key]: BUCKETS[key][0] for key in BUCKETS},
            _figures.FIGURES["by_call"]: "k3 over calls with its least-squares trend",
            _figures.FIGURES["histogram"]: "Histogram of the token log ratio with candidate bounds",
            _figures.SC_FIGURE: "Score centering over training steps"}
GITHUB_REFERENCE = re.compile(r"\b([A-Za-z0-9][\w.-]*/[\w.-]+)#(\d+)\b")  # owner/repo#123: an issue or a PR
URL = re.compile(r"https?://[^\s;()<>\"']+")

SCRIPT = """document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0], column = th.cellIndex;
    var ascending = th.getAttribute("data-order") !== "ascending";
    th.setAttribute("data-order", ascending ? "ascending" : "descending");
    var key = function (row) {
      var text = row.cells[column].textContent, number = parseFloat(text);
      return isNaN(number) ? text : number;
    };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b);
      if (typeof x !== typeof y) { return typeof x === "number" ? -1 : 1; }
      return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
    }).forEach(function (row) { body.appendChild(row); });
  });
});"""
STYLE = """body{font:15px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
section{display:block}pre{background:#f6f6f6;padding:.7em;overflow-x:auto}
.warning{background:#fff4e0;border-left:4px solid #e69500;padding:.3em .7em;margin:.4em 0}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:.25em .45em;text-align:left}
th{background:#f0f0f0;cursor:pointer}tr.chosen{font-weight:bold;background:#eef7ee}
.tok,.key{display:inline-block;width:12px;height:18px;margin:0 1px 1px 0;border:1px solid #ddd;
vertical-align:middle;background:#fff}.masked{background:repeating-linear-gradient(45deg,#bbb 0 2px,#f2f2f2 2px 4px)}
.nonfinite{background:#222}.peak{outline:2px solid #000}.strip p{margin:.6em 0 .15em;font-size:13px}
.gap,.cut{font-size:11px;color:#555;margin:0 .3em;vertical-align:middle}.cut{color:#a00}
.legend .bar{height:14px;max-width:420px;border:1px solid #ccc}
.legend .ticks{display:flex;justify-content:space-between;max-width:420px;font-size:12px}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #ddd}figcaption{font-size:13px;color:#555}"""


def render_html(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any, *,
                title: str, figures: Sequence[Path] | None = None, figures_note: str | None = None,
                config_path: Path | str | None = None, score_centering: Mapping[str, Any] | None = None,
                outcomes: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The page. ``figures``: the report's PNGs, inlined; None: ``figures_note`` says why there are none.
    ``outcomes``: the published rows (``published.load()`` by default)."""
    outcomes = _published.load() if outcomes is None else list(outcomes)
    advice = advice_paragraphs(statistics, recommendation, score_centering)
    reasons = [str(reason) for reason in getattr(recommendation, "reasons", None) or []]
    cited = cited_outcomes(" ".join(reasons + [text for _, text in advice]), outcomes)
    body = "".join([
        f"<header><h1>{escape(title)}</h1><p>{escape(size_line(statistics))}</p>"
        f"<p>token k3 {escape(fmt(statistics.get('k3')))}, mean |Δ log p| "
        f"{escape(fmt(statistics.get('mean_abs_log_ratio')))}, max |Δ log p| "
        f"{escape(fmt(statistics.get('max_abs_log_ratio')))}. Every table is in report.md and report.json.</p>"
        "</header>",
        advice_section(statistics, recommendation, advice, config_path),
        strips_section(statistics),
        candidates_section(results, recommendation),
        figures_section(figures, figures_note),
        published_section(cited),
    ])
    policy = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
              f"script-src 'sha256-{base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()}'")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{policy}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" href="data:,"><title>{escape(title)}</title><style>{STYLE}</style></head>'
            f"<body>{body}<script>{SCRIPT}</script></body></html>\n")


def write_html(path: Path | str, page: str) -> Path:
    """``page`` (``render_html``'s) as UTF-8 at ``path``."""
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- the advice
def advice_paragraphs(statistics: Mapping[str, Any], recommendation: Any,
                      score_centering: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(heading, text) of what the evidence says about this dump beyond the recommendation's reasons: against the
    lab's curve and the published runs, the staleness evidence, the score-centering advice, the truncation alarm."""
    out = []
    safe = _safe_level.for_dump(statistics, _safe_level.load())
    if safe:
        out.append(("Does this mismatch need a correction?", safe))
    stale = staleness_evidence(statistics)
    if stale:
        out.append(("Stale rollouts", stale))
    if score_centering and score_centering.get("present") and score_centering.get("advice"):
        out.append(("Score centering", str(score_centering["advice"])))
    values = statistics.get("truncation") or {}
    if values.get("fired"):
        out.append(("Truncated sampling", " ".join(line.strip() for line in _truncation.advice(
            values["negative_fraction"], values["standardized_mean"], values["mean"], True))))
    return out


def advice_section(statistics: Mapping[str, Any], recommendation: Any, advice: Sequence[tuple[str, str]],
                   config_path: Path | str | None) -> str:
    name = recommendation_name(recommendation)
    config = getattr(recommendation, "config", None) if recommendation is not None else None
    reasons = [str(reason) for reason in getattr(recommendation, "reasons", None) or []]
    parts = [f"<h2>Recommendation: {escape(name) if name is not None and config is not None else 'none'}</h2>"]
    if name is not None and config is not None:
        target = str(config_path) if config_path is not None else "FILE"
        where = f"It is written to {config_path}." if config_path is not None else "Save it as a YAML file FILE."
        parts.append(f"<pre>{escape(config_yaml(config).rstrip())}</pre>"
                     f"<p>{escape(where)} Use it with <code>{escape(f'{USAGE} {target}')}</code>.</p>")
    parts.append("<ul>" + "".join(f"<li>{escape(reason)}</li>" for reason in reasons or ["no recommendation made"])
                 + "</ul>")
    parts += [f'<p class="warning"><strong>Warning:</strong> {escape(text)}</p>' for text in warnings(statistics)]
    parts += [f"<h3>{escape(heading)}</h3><p>{escape(text)}</p>" for heading, text in advice]
    return f'<section id="advice">{"".join(parts)}</section>'


def warnings(statistics: Mapping[str, Any]) -> list[str]:
    """The report's warnings as text (``warning_lines``, whose Markdown bullet prefix is dropped)."""
    prefix = "- **Warning:** "
    return [line[len(prefix):] for line in warning_lines(statistics) if line.startswith(prefix)]


# --------------------------------------------------------------------------- candidates and figures
def candidates_section(results: Mapping[str, Any] | None, recommendation: Any) -> str:
    head = "<section id=\"candidates\"><h2>Candidate configurations on these tokens</h2>"
    if not results:
        return head + "<p>No candidate was evaluated.</p></section>"
    header = "".join(f"<th>{escape(cell)}</th>" for cell in CANDIDATE_HEADER)
    rows = "".join((f'<tr class="chosen"><td>{escape(name)} (recommended)</td>' if chosen
                    else f"<tr><td>{escape(name)}</td>") + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"
                   for name, chosen, cells in candidate_rows(results, recommendation))
    return (f"{head}<p>{escape(CANDIDATE_NOTE)} Click a heading to sort.</p>"
            f'<table class="sortable"><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table></section>')


def figures_section(figures: Sequence[Path] | None, note: str | None = None) -> str:
    head = '<section id="figures"><h2>Figures</h2>'
    if figures is None:
        text = note or ("Figures not drawn: matplotlib is not installed (pip install \"miles-mis[figures]\")."
                        if not _figures.figures_available() else "Figures not drawn.")
        return f"{head}<p>{escape(text)}</p></section>"
    items = []
    for path in figures:
        path = Path(path)
        caption = CAPTIONS.get(path.name, path.stem.replace("_", " "))
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        items.append(f'<figure><img alt="{escape(caption)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{escape(caption)} ({escape(path.name)})</figcaption></figure>")
    return head + "".join(items) + "</section>"


# --------------------------------------------------------------------------- published outcomes
def cited_outcomes(advice: str, rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The published rows the advice names, in file order: a row whose ``published.describe`` words are in
    ``advice``, or whose held correction is cited as "NAME (MODEL" (``published.held_corrections``)."""
    held = {id(row) for name, row in _published.held_corrections(rows)
            if f"{name} ({str(row.get('model', '')).split(' (')[0]}" in advice}
    return [row for row in rows if id(row) in held or _published.describe(row) in advice]


def source_links(url: str) -> str:
    """A row's ``url`` as HTML: each full http(s) URL and each owner/repo#N (a GitHub issue or pull request:
    https://github.com/owner/repo/issues/N, which GitHub redirects for a PR) linked, the words around them escaped."""
    out, last = [], 0
    pattern = re.compile(f"{URL.pattern}|{GITHUB_REFERENCE.pattern}")
    for match in pattern.finditer(url):
        if match.group(0).startswith(("http://", "https://")):
            href = match.group(0)
        else:
            href = f"https://github.com/{match.group(1)}/issues/{match.group(2)}"
        out.append(escape(url[last:match.start()]) + f'<a href="{escape(href)}">{escape(match.group(0))}</a>')
        last = match.end()
    return "".join(out) + escape(url[last:])


def published_section(cited: Sequence[Mapping[str, Any]]) -> str:
    head = '<section id="published"><h2>Published outcomes the advice cites</h2>'
    if not cited:
        return head + "<p>The advice cites no published outcome for this dump.</p></section>"
    items = "".join(f"<li>{escape(_published.cite(row))} Source: {escape(str(row.get('source', '')))}, "
                    f"{source_links(str(row.get('url', '')))}</li>" for row in cited)
    return f"{head}<ul>{items}</ul></section>"
