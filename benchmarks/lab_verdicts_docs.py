"""Writes ``lab_verdicts.py tables`` into a markdown file between markers, so the docs show the committed rows
without copying by hand (``python benchmarks/lab_verdicts.py tables --docs docs/lab/verdicts.md``):

    <!-- lab_verdicts:verdicts --> ... <!-- /lab_verdicts:verdicts -->   a line on the runs, then every regime's table
    <!-- lab_verdicts:safe --> ... <!-- /lab_verdicts:safe -->           the safe-mismatch table and its levels
    <!-- lab_verdicts:<regime slug> --> ... <!-- /lab_verdicts:<slug> -->  a regime of its own length (REGIME_STEPS,
                                                                          its own results file), alone

Everything outside the markers (the prose that reads the tables) stays as it is; a regime with no runs and the
mechanism lines (read in the prose) are left out. The figures' links are relative to the page, wherever it lies
(docs/lab/verdicts.md links ``../figures/...``)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from lab_runs import machine_of

MARKERS = ("<!-- lab_verdicts:{} -->", "<!-- /lab_verdicts:{} -->")
SAFE = "What mismatch needs a correction"
NOT_IN_DOCS = ("Mechanisms",)
WIDTH = 116
NO_RUNS = "(no runs yet)"  # lab_verdicts_tables.regime_table's body for a regime without runs; kept out of the docs
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"  # where lab_verdicts draws them


def replace_marked(text: str, name: str, body: str, source: str = "the file") -> str:
    """``text`` with what lies between the ``name`` markers replaced by ``body``; ValueError naming the file and the
    markers unless each occurs once, in order."""
    begin, end = (marker.format(name) for marker in MARKERS)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{source}: needs one '{begin}' and, after it, one '{end}' (found {text.count(begin)} and "
                         f"{text.count(end)})")
    return text[:text.index(begin) + len(begin)] + "\n" + body.strip("\n") + "\n" + text[text.index(end):]


def runs_line(rows: list[dict], steps: int, left: str, other_first_rollouts: int) -> str:
    """The paragraph before the tables: how many runs on which machines, how they pair, what is left (``left``: the
    budget's words, "N runs, about H CPU hours left (...)")."""
    boots = sorted({machine_of(row) for row in rows})
    kinds = sorted({machine.rsplit(", boot ", 1)[0] for machine in boots})  # lab_runs.machine's "<CPU>, boot <id>"
    pairing = ("every boot so far reproduced the first rollouts of the others" if other_first_rollouts == 0 else
               f"{other_first_rollouts} seed(s) had another first rollout on some boot, and the tables take each seed "
               "from the group that holds most of it")
    text = (f"`tables` on the runs so far: {len(rows)} run{'s' if len(rows) != 1 else ''} of {steps} steps, on "
            f"{len(boots)} boot(s) of "
            f"{' / '.join(kinds)} (each row names its machine; the tables pair runs by first rollout, and {pairing}). "
            "± is the standard deviation over seeds, Δ the paired difference of the last-10-step reward against "
            "standard PPO with its 95 % t interval; s / step is the median step of the quietest run (rollout, "
            f"recompute, 2 optimizer steps). Cells not yet run are listed under each table; `budget` says {left}.")
    return textwrap.fill(text, WIDTH)


def figures_link(page: Path, figures: Path = FIGURES) -> str:
    """The folder ``figures`` as a markdown link from ``page``: relative to the page's folder, with / separators."""
    return Path(os.path.relpath(figures.resolve(), page.resolve().parent)).as_posix()


def verdict_body(sections: list[tuple[str, str, str | None]], intro: str, figures: str = "figures") -> str:
    """The intro, then per regime with runs: its title in bold, its table and sentences, its figure (linked as
    ``figures``/name, ``figures`` relative to the page)."""
    parts = [intro]
    for title, body, figure in sections:
        if title == SAFE or title in NOT_IN_DOCS or NO_RUNS in body:
            continue
        parts.append(f"**{title}**\n\n{body.strip()}")
        if figure:
            parts.append(f"![reward per step, {title}]({figures}/{figure})")
    return "\n\n".join(parts) + "\n"


def write_docs(path: Path, sections: list[tuple[str, str, str | None]], rows: list[dict], steps: int, left: str,
               other_first_rollouts: int, figures: Path = FIGURES) -> None:
    """Rewrites the two marked parts of ``path`` from ``lab_verdicts_tables.sections``; the figures (files under
    ``figures``) are linked relative to ``path``."""
    text = path.read_text()
    text = replace_marked(text, "verdicts", verdict_body(sections, runs_line(rows, steps, left, other_first_rollouts),
                                                         figures_link(path, figures)), str(path))
    safe = {title: body for title, body, _ in sections}.get(SAFE, "(no regime paired on 2 seeds yet)")
    text = replace_marked(text, "safe", safe, str(path))
    path.write_text(text)


def write_regime_docs(path: Path, marker: str, sections: list[tuple[str, str, str | None]], rows: list[dict],
                      steps: int, left: str, other_first_rollouts: int, figures: Path = FIGURES) -> None:
    """Rewrites ``marker``'s part of ``path`` alone, for a regime of its own length and results file: the 40-step
    tables, the safe-mismatch table and the analyzer's curve belong to other rows and stay as they are."""
    text = path.read_text()
    body = verdict_body(sections, runs_line(rows, steps, left, other_first_rollouts), figures_link(path, figures))
    path.write_text(replace_marked(text, marker, body, str(path)))
