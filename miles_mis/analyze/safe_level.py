"""What mismatch needs a correction, as measured on a real model: the analyzer's reading of the lab's mismatch curve.

``benchmarks/lab_verdicts.py tables --docs docs/lab/verdicts.md`` writes ``safe_mismatch.json`` beside this module
from its paired RL runs on SmolLM2-135M (vLLM): per engine regime, standard PPO's raw k3 and the best correction's
paired gain over standard PPO with a 95 % interval, and from those two levels:

- ``safe_below``: the largest k3 up to which no regime showed a resolved gain from any correction, with the largest
  gain the intervals there leave open (``not_excluded``, at ``seeds`` seeds);
- ``matters_at``: the first (smallest-k3) regime where one did, and which correction.

``sentence`` places a dump's k3 against them, against the lab's long runs (``horizon``: 300 steps at bf16; one
that fell back leads the answer) and against the published production outcomes (``published``): the lab
is a 135M model on short responses over tens of steps, so a level where it saw no effect is said as that, never as
"safe", and the runs that collapsed at or below the level, or at unstated levels, are named with what held there.
Without the curve (no measurement shipped) it says nothing.
``for_dump`` does so for a dump's statistics, except where π_old equals the rollout log-probs bit for bit on every
token: a dump written in bypass mode (``--use-rollout-logprobs``: miles dumps the rollout log-probs as π_old) shows
k3 = 0 whatever the engine, so nothing about safety can be read from it, and it says so (with what bypass cost where
it was measured).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from . import horizon, published

CURVE = Path(__file__).with_name("safe_mismatch.json")


def load(path: Path | None = None) -> dict | None:
    """The measured curve, or None when no file is there."""
    path = CURVE if path is None else Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


SHIPPED = object()  # sentence's default for long_runs: the shipped long-horizon points (horizon.load())


def sentence(k3: Any, curve: Mapping[str, Any] | None, outcomes: list | None = None,
             long_runs: Any = SHIPPED) -> str | None:
    """Where ``k3`` lies against the measured levels for standard PPO, in one or two sentences; what the lab's long
    runs say there (``long_runs``: ``horizon.load()`` by default, None for none); at or above the level where a
    correction beat bypass, that bypass lost there; then against the published outcomes (``outcomes``:
    ``published.load()`` by default). None without a curve or a finite k3."""
    if curve is None or k3 is None or not math.isfinite(float(k3)):
        return None
    outcomes = published.load() if outcomes is None else outcomes
    long_runs = horizon.load() if long_runs is SHIPPED else long_runs
    text = _standard_sentence(float(k3), curve)
    long_text = horizon.sentence(float(k3), long_runs)
    if text is not None and long_text is not None:  # a long run that fell back leads: it outweighs a 40-step null
        text = f"{long_text} {text}" if horizon.fell_back(float(k3), long_runs) else f"{text} {long_text}"
    lost = _bypass_lost(float(k3), curve)
    if text is not None and lost is not None:
        text = (f"{text} Not in bypass mode (--use-rollout-logprobs, the engine's log-probs as π_old): at k3 = "
                f"{lost['k3']:.2e} ({lost['regime']}) {lost['correction']} beat bypass by {lost['mean']:+.3f} reward "
                f"[{lost['low']:+.3f}, {lost['high']:+.3f}] over {lost['seeds']} seeds; recompute π_old.")
    evidence = published.sentence(float(k3), outcomes)
    if text is None or evidence is None:
        return text
    return f"{text} {evidence}"


def _bypass_lost(k3: float, curve: Mapping[str, Any]) -> dict | None:
    """Where bypass lost nearest below ``k3``: the measured regime of largest k3 at or below it where a correction beat
    bypass resolvably (its gap, with the regime and k3), else bypass's first such level when no point is listed;
    None below that level."""
    first = curve["levels"].get("bypass", {}).get("matters_at")
    if first is None or k3 < first["k3"]:
        return None
    nearest = _nearest_below(k3, curve, lambda gaps: gaps.get("bypass", {}).get("resolved"))
    if nearest is None:
        return first
    return {**nearest["gaps"]["bypass"], "k3": nearest["k3"], "regime": nearest["regime"]}


def _nearest_below(k3: float, curve: Mapping[str, Any], keep) -> dict | None:
    """The measured point of largest k3 at or below ``k3`` whose gaps satisfy ``keep``; None when there is none."""
    below = [point for point in curve.get("points", []) if point["k3"] <= k3 and keep(point["gaps"])]
    return max(below, key=lambda point: point["k3"], default=None)


def _standard_sentence(k3: float, curve: Mapping[str, Any]) -> str | None:
    """``sentence``'s reading against standard PPO's levels."""
    level = curve["levels"]["standard"]
    safe, matters = level.get("safe_below"), level.get("matters_at")
    where = (f"measured on {curve['model']} ({curve['engine']}, paired RL runs of {curve['steps']} steps; "
             f"{curve['docs']})")
    if safe is not None and k3 <= safe["k3"]:
        return (f"No resolved effect in the lab at this level: k3 = {k3:.2e} is at or below {safe['k3']:.2e} "
                f"({safe['regime']}), up to which no correction changed standard PPO's final reward resolvably (a gain "
                f"up to {safe['not_excluded']:+.3f} reward is not excluded at {safe['seeds']} seeds), {where}: a small "
                f"model, short responses and {curve['steps']} steps, too short for the collapses published after "
                "hundreds of steps. "
                "Use a correction: it cost nothing measurable there, and longer responses, an MoE model or "
                "asynchronous training make a collapse likelier.")
    if matters is not None and k3 >= matters["k3"]:
        text = (f"Above the lab's no-effect level: k3 = {k3:.2e} is at or above {matters['k3']:.2e} "
                f"({matters['regime']}), where {matters['correction']} beat standard PPO by "
                f"{matters['mean']:+.3f} reward [{matters['low']:+.3f}, {matters['high']:+.3f}] over "
                f"{matters['seeds']} seeds, {where}.")
        return f"{text} {_nearest_sentence(k3, curve, matters)}"
    if matters is None:  # then k3 is above the no-effect level, or nothing was paired at all
        if safe is None:
            return None
        return (f"Not measured: k3 = {k3:.2e} is above every regime {where} (the largest: {safe['k3']:.2e}, "
                f"{safe['regime']}), none of which showed a resolved gain from a correction. Correct, and watch the "
                "reward.")
    low = "0" if safe is None else f"{safe['k3']:.2e} ({safe['regime']})"
    return (f"Between the measured levels: k3 = {k3:.2e} lies between the lab's no-effect level {low} and the first "
            f"level where a correction mattered, {matters['k3']:.2e} ({matters['regime']}: {matters['correction']}), "
            f"{where}. No measurement decides it: correct if unsure.")


def _nearest_sentence(k3: float, curve: Mapping[str, Any], matters: Mapping[str, Any]) -> str:
    """The advice above the no-effect level, from the measured regime nearest below ``k3`` (the curve need not be
    monotone: a correction that won at one level can lose at a higher one)."""
    nearest = _nearest_below(k3, curve, lambda gaps: "standard" in gaps)
    if nearest is None or nearest["regime"] == matters["regime"]:
        return f"Correct: {matters['correction']} won there."
    gap = nearest["gaps"]["standard"]
    at = f"at {nearest['k3']:.2e} ({nearest['regime']})"
    if gap["resolved"]:
        return (f"Nearer this k3, {at}, {gap['correction']} beat standard PPO by {gap['mean']:+.3f} reward "
                f"[{gap['low']:+.3f}, {gap['high']:+.3f}] over {gap['seeds']} seeds. Correct: {gap['correction']} won "
                "there.")
    lost = [loss for loss in gap.get("losses", []) if loss["correction"] == matters["correction"]]
    text = f"Nearer this k3, {at}, no correction beat standard PPO resolvably"
    if lost:
        text += (f", and {matters['correction']} lost to it by {lost[0]['mean']:+.3f} reward [{lost[0]['low']:+.3f}, "
                 f"{lost[0]['high']:+.3f}] over {lost[0]['seeds']} seeds: do not use it at this mismatch")
    return text + ". Keep π_old recomputed (standard PPO, not bypass) and watch the reward."


def for_dump(statistics: Mapping[str, Any], curve: Mapping[str, Any] | None) -> str | None:
    """``sentence`` for a dump's statistics (then, where most sequences' ∏ρ leaves [0.5, 2], the published rows on
    sequence-level weights, ``published.sequence_weight_sentence``), or, when every usable token's π_old equals its
    rollout log-prob bit for bit (``identical_fraction`` = 1), why its k3 = 0 says nothing (None without a curve)."""
    if curve is None:
        return None
    if statistics.get("identical_fraction") != 1.0:
        text = sentence(statistics.get("k3"), curve)
        lengths = published.sequence_weight_sentence(statistics, published.load())
        return text if lengths is None else " ".join(part for part in (text, lengths) if part)
    text = ("Not readable from this dump: π_old equals the engine's log-probs bit for bit on every token. That is a "
            "dump written in bypass mode (--use-rollout-logprobs: miles dumps the rollout log-probs as π_old), where "
            "k3 = 0 whatever the engine, unless trainer and engine are bit-identical (a true on-policy setup). Dump "
            "one step without --use-rollout-logprobs to measure the mismatch.")
    lost = curve["levels"].get("bypass", {}).get("matters_at")
    if lost is not None:
        text += (f" Bypass itself was measured on {curve['model']} ({curve['engine']}; {curve['docs']}): at k3 = "
                 f"{lost['k3']:.2e} ({lost['regime']}) {lost['correction']} beat it by {lost['mean']:+.3f} reward "
                 f"[{lost['low']:+.3f}, {lost['high']:+.3f}] over {lost['seeds']} seeds.")
    return text
