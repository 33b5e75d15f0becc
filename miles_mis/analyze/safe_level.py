"""What mismatch is safe, as measured on a real model: the analyzer's reading of the lab's safe-mismatch curve.

``benchmarks/lab_verdicts.py tables`` writes ``safe_mismatch.json`` beside this module from its paired RL runs on
SmolLM2-135M (vLLM): per engine regime, standard PPO's raw k3 and the best correction's paired gain over standard
PPO with a 95 % interval, and from those two levels:

- ``safe_below``: the largest k3 up to which no regime showed a resolved gain from any correction, with the largest
  gain the intervals there leave open (``not_excluded``, at ``seeds`` seeds);
- ``matters_at``: the first (smallest-k3) regime where one did, and which correction.

``sentence`` places a dump's k3 against them. Without the file (no measurement shipped) it says nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

CURVE = Path(__file__).with_name("safe_mismatch.json")


def load(path: Path | None = None) -> dict | None:
    """The measured curve, or None when no file is there."""
    path = CURVE if path is None else Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def sentence(k3: Any, curve: Mapping[str, Any] | None) -> str | None:
    """Where ``k3`` lies against the measured levels for standard PPO, in one or two sentences; None without a curve
    or a finite k3."""
    if curve is None or k3 is None or not math.isfinite(float(k3)):
        return None
    k3 = float(k3)
    level = curve["levels"]["standard"]
    safe, matters = level.get("safe_below"), level.get("matters_at")
    where = (f"measured on {curve['model']} ({curve['engine']}, paired RL runs of {curve['steps']} steps; "
             f"{curve['docs']})")
    if safe is not None and k3 <= safe["k3"]:
        return (f"Safe by measurement: k3 = {k3:.2e} is at or below {safe['k3']:.2e} ({safe['regime']}), up to which no "
                f"correction changed standard PPO's final reward resolvably (a gain up to {safe['not_excluded']:+.3f} "
                f"reward is not excluded at {safe['seeds']} seeds), {where}. A correction is cheap insurance here, "
                "not a need.")
    if matters is not None and k3 >= matters["k3"]:
        return (f"Above the safe level: k3 = {k3:.2e} is at or above {matters['k3']:.2e} ({matters['regime']}), where "
                f"{matters['correction']} beat standard PPO by {matters['mean']:+.3f} reward "
                f"[{matters['low']:+.3f}, {matters['high']:+.3f}] over {matters['seeds']} seeds, {where}. Correct: "
                f"{matters['correction']} won there.")
    if matters is None:  # then k3 is above the safe level, or nothing was paired at all
        if safe is None:
            return None
        return (f"Not measured: k3 = {k3:.2e} is above every regime {where} (the largest: {safe['k3']:.2e}, "
                f"{safe['regime']}), none of which showed a resolved gain from a correction. Correct, and watch the "
                "reward.")
    low = "0" if safe is None else f"{safe['k3']:.2e} ({safe['regime']})"
    return (f"Between the measured levels: k3 = {k3:.2e} lies between the safe level {low} and the first level where a "
            f"correction mattered, {matters['k3']:.2e} ({matters['regime']}: {matters['correction']}), {where}. No "
            "measurement decides it: correct if unsure.")
