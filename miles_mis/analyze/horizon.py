"""The lab's long-horizon runs: whether its 40-step nulls held over hundreds of steps, as the analyzer reads them.

``benchmarks/lab_horizon.py tables --json`` writes ``long_horizon.json`` beside this module from paired RL runs of
SmolLM2-135M (vLLM) run to 300 steps: per engine regime, standard PPO's raw k3 over steps 1–40 (the 40-step curve's
measure) and over the last 50 steps, per algorithm how many runs fell back after step 40 (the last-50-step reward at
least ``fell_back`` below the run's best 10-step mean after step 40), and the paired reward differences at step 40
and over the last 50 steps.

``sentence`` places a dump's k3 against them: a long run that started at or above that k3 and fell back is the
headline (``fell_back``: the analyzer then puts this sentence first), with the algorithms that held; a paired
difference is stated only where it is resolved (3 seeds or more, the 95 % interval excluding 0); a null is said as a
null over that horizon, on that model and task, with the mismatch it actually sat at (the lab's k3 falls as the
policy sharpens). Without the file it says nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

POINTS = Path(__file__).with_name("long_horizon.json")
NAMES = {"standard": "standard PPO", "bypass": "bypass", "decoupled_tis": "decoupled token TIS"}
HEADLINE_PAIR = ("decoupled_tis", "standard")  # the pair the sentence always states; others only where resolved


def load(path: Path | None = None) -> dict | None:
    """The long-horizon points, or None when no file is there."""
    path = POINTS if path is None else Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


NEAR = 2.0  # a long run up to this factor below a dump's k3 still speaks for it (a dump's k3 varies this much by batch)


def covering(k3: float, data: Mapping[str, Any]) -> dict | None:
    """The long-horizon point that speaks for ``k3``: the nearest at or above it, else the nearest within ``NEAR``×
    below it; None when every point lies further below."""
    points = data.get("points", [])
    above = min((p for p in points if p["k3"] >= k3), key=lambda p: p["k3"], default=None)
    return above or max((p for p in points if p["k3"] * NEAR >= k3), key=lambda p: p["k3"], default=None)


def _interval(cell: Mapping[str, Any]) -> str:
    return f"{cell['mean']:+.3f} [{cell['low']:+.3f}, {cell['high']:+.3f}] over {cell['seeds']} seeds"


def _number(value: Any) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _seeds(seeds: list) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(str(s) for s in seeds)}"


def _other_resolved(point: Mapping[str, Any], data: Mapping[str, Any], algorithms: Mapping[str, Any]) -> str:
    """The resolved differences over the last steps other than ``HEADLINE_PAIR`` (the sentence's own), each with both
    algorithms' late k3: a user of bypass needs to hear that bypass ended lower."""
    parts = []
    for pair in point.get("paired", []):
        if (pair["a"], pair["b"]) == HEADLINE_PAIR or not pair.get("at_end", {}).get("resolved"):
            continue
        k3 = [_number(algorithms.get(name, {}).get("raw_k3_last_50")) for name in (pair["a"], pair["b"])]
        late = "" if None in k3 else f" (their k3 over those steps: {k3[0]:.2e} against {k3[1]:.2e})"
        parts.append(f"{NAMES.get(pair['a'], pair['a'])} against {NAMES.get(pair['b'], pair['b'])} "
                     f"{_interval(pair['at_end'])}{late}")
    return f" Resolved over the last {data['last']} steps: {'; '.join(parts)}." if parts else ""


def fell_back(k3: Any, data: Mapping[str, Any] | None) -> bool:
    """Whether a long run at or above ``k3`` (the covering point) fell back after step 40: then the long runs, not
    the 40-step levels, lead the analyzer's answer."""
    if data is None or k3 is None or not math.isfinite(float(k3)):
        return False
    point = covering(float(k3), data)
    return point is not None and any(a["fell_back"] for a in point["algorithms"].values())


def sentence(k3: Any, data: Mapping[str, Any] | None) -> str | None:
    """What the long runs say at ``k3``, in one to three sentences; None without data, points or a finite k3."""
    if data is None or not data.get("points") or k3 is None or not math.isfinite(float(k3)):
        return None
    point = covering(float(k3), data)
    if point is None:
        top = max(data["points"], key=lambda p: p["k3"])
        return (f"Nothing in the lab ran long at this mismatch: its {top['steps']}-step runs sat more than "
                f"{NEAR:g}× lower, at k3 = {top['k3']:.2e} ({top['regime']}; {data['docs']}).")
    algorithms = point["algorithms"]
    last = _number(point.get("k3_last_50"))
    at = (f"at k3 = {point['k3']:.2e} over steps 1–{data['early']}"
          + ("" if last is None else f" and {last:.2e} over the last {data['last']}") + f" ({point['regime']}), "
          + ("at or above this dump's" if point["k3"] >= float(k3) else f"within {NEAR:g}× below this dump's")
          + f"; {data['model']}, {data['engine']}, {data['docs']}")
    below_best = f"{data['fell_back']} reward or more below its best 10-step mean after step {data['early']}"
    fell = {name: a for name, a in algorithms.items() if a["fell_back"]}
    if fell:
        lost = " and ".join(f"{NAMES.get(name, name)} on {_seeds(a['fell_back_seeds'])} (of {a['runs']})"
                            for name, a in fell.items())
        held = [NAMES.get(name, name) for name, a in algorithms.items() if not a["fell_back"]]
        text = (f"At {point['steps']} steps the lab's runs fell back ({at}): {lost} ended {below_best}"
                + (f", while every run of {' and '.join(held)} held" if held else "") + ".")
        text += _other_resolved(point, data, algorithms)
        return text + (f" Use {' or '.join(held)} and watch the reward and the gradient norm." if held else
                       " Watch the reward and the gradient norm.")
    counts = ", ".join(f"{NAMES.get(name, name)} on {_seeds(a['seeds'])}" for name, a in algorithms.items())
    text = f"At {point['steps']} steps no run fell back ({at}): no run ({counts}) ended {below_best}."
    gap = next((p for p in point.get("paired", []) if (p["a"], p["b"]) == HEADLINE_PAIR), None)
    resolved = gap is not None and gap["at_end"]["resolved"]
    if gap is not None:
        end, early = gap["at_end"], gap["at_40"]
        few = end["seeds"] < data["min_verdict_seeds"]
        verdict = "resolved" if resolved else "no verdict" if few else "not resolved"
        text += (f" Decoupled token TIS against standard PPO, over the last {data['last']} steps: {_interval(end)} "
                 f"({verdict}); at step {data['early']}: {_interval(early)}.")
    others = _other_resolved(point, data, algorithms)
    text += others
    reward = _number(algorithms.get("standard", {}).get("reward_last_50"))
    ceiling = "" if reward is None else f", on a task where standard PPO's reward reached {reward:.2f}"
    # the lab's k3 falls as the policy sharpens: a null at a shrinking mismatch is weaker than at a steady one
    shrank = ", at a mismatch that shrank as it trained" if last is not None and last < point["k3"] / 2 else ""
    # the caveat covers whatever was resolved too; only where nothing was is the reading a null
    lead = "These are results" if resolved or others else "A null"
    return f"{text} {lead} over {point['steps']} steps{ceiling}{shrank}, on a 135M model with short responses."
