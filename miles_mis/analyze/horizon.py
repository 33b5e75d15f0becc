"""The lab's long-horizon runs: whether its 40-step nulls held over hundreds of steps, as the analyzer reads them.

``benchmarks/lab_horizon.py tables --json`` writes ``long_horizon.json`` beside this module from paired RL runs of
SmolLM2-135M (vLLM) run to 300 steps: per engine regime, standard PPO's raw k3 over steps 1–40 (the 40-step curve's
measure) and over the last 50 steps, per algorithm how many runs fell back after step 40 (the last-50-step reward at
least ``fell_back`` below the run's best 10-step mean after step 40), and the paired reward differences at step 40
and over the last 50 steps.

``sentence`` places a dump's k3 against them: a long run that started at or above that k3 and fell back is the
headline; a null is said as a null over that horizon, on that model and task, with the mismatch it actually sat at
(the lab's k3 falls as the policy sharpens). Without the file it says nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

POINTS = Path(__file__).with_name("long_horizon.json")
NAMES = {"standard": "standard PPO", "bypass": "bypass", "decoupled_tis": "decoupled token TIS"}


def load(path: Path | None = None) -> dict | None:
    """The long-horizon points, or None when no file is there."""
    path = POINTS if path is None else Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def covering(k3: float, data: Mapping[str, Any]) -> dict | None:
    """The long-horizon point nearest at or above ``k3`` (its runs started at that mismatch or a larger one)."""
    return min((p for p in data.get("points", []) if p["k3"] >= k3), key=lambda p: p["k3"], default=None)


def _interval(cell: Mapping[str, Any]) -> str:
    return f"{cell['mean']:+.3f} [{cell['low']:+.3f}, {cell['high']:+.3f}] over {cell['seeds']} seeds"


def sentence(k3: Any, data: Mapping[str, Any] | None) -> str | None:
    """What the long runs say at ``k3``, in one or two sentences; None without data, points or a finite k3."""
    if data is None or not data.get("points") or k3 is None or not math.isfinite(float(k3)):
        return None
    k3 = float(k3)
    point = covering(k3, data)
    if point is None:
        top = max(data["points"], key=lambda p: p["k3"])
        return (f"Nothing in the lab ran long at this mismatch: its {top['steps']}-step runs sat lower, at k3 = "
                f"{top['k3']:.2e} ({top['regime']}; {data['docs']}).")
    algorithms = point["algorithms"]
    runs = sum(a["runs"] for a in algorithms.values())
    fell = {name: a for name, a in algorithms.items() if a["fell_back"]}
    where = (f"on {data['model']} ({data['engine']}; {data['docs']}), at k3 = {point['k3']:.2e} over steps "
             f"1–{data['early']} and {point['k3_last_50']:.2e} over the last {data['last']} ({point['regime']})")
    below_best = f"{data['fell_back']} reward or more below their best after step {data['early']}"
    if fell:
        lost = ", ".join(f"{NAMES.get(name, name)} {a['fell_back']} of {a['runs']}" for name, a in fell.items())
        return (f"At {point['steps']} steps the lab's runs fell back at this level: {where}, runs ended {below_best} "
                f"({lost}). Correct, and watch the reward and the gradient norm.")
    counts = ", ".join(f"{NAMES.get(name, name)} {a['runs']}" for name, a in algorithms.items())
    text = f"At {point['steps']} steps no run fell back: {where}, none of {runs} runs ({counts}) ended {below_best}"
    gap = next((p for p in point["paired"] if (p["a"], p["b"]) == ("decoupled_tis", "standard")), None)
    if gap is not None:
        text += (f"; decoupled token TIS − standard PPO over the last {data['last']} steps "
                 f"{_interval(gap['at_end'])} (at step {data['early']}: {_interval(gap['at_40'])})")
    reward = algorithms.get("standard", {}).get("reward_last_50")
    ceiling = f", on a task whose reward reached {reward:.2f}" if reward is not None and math.isfinite(reward) else ""
    # the lab's k3 falls as the policy sharpens: a null at a shrinking mismatch is weaker than one at a steady one
    shrank = ", at a mismatch that shrank as it trained" if point["k3_last_50"] < point["k3"] / 2 else ""
    return f"{text}. A stronger null than 40 steps{ceiling}, and still a 135M model with short responses{shrank}."
