"""The verdict sweep's tables (benchmarks/lab_verdicts.py tables): per regime the paired verdicts against standard
PPO and the reward figure, a long regime's windows and signals, the mechanism pairs, score centering's signals
and the safe-mismatch curve, as (title, markdown, figure) sections."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import (first_mean, formatted, last_mean, mean_and_spread, outcome, paired_difference,  # noqa: E402
                      recorded_mean, steps_to_level, verdict)
from lab_safe_mismatch import curve, curve_figure, curve_table, level_sentence, safe_level, write_curve  # noqa: E402
from lab_verdicts_docs import FIGURES, NO_RUNS  # noqa: E402
from lab_verdicts_plan import (BASELINE, REGIME_STEPS, REGIMES, SCORE_CENTERING, UNCORRECTED, cell_of,  # noqa: E402
                               quiet_pace, slug)

LEVEL = 0.5  # the reward level of the time-to-level column (fp8 standard PPO ends near 0.58, bf16 near 0.73)
WINDOW = 50  # a long regime's reward windows, in steps


def regime_table(rows: list[dict], regime: str) -> tuple[str, list[str]]:
    """The markdown table of one regime and its verdict sentences (algorithms paired with standard on ≥ 2 seeds)."""
    baseline = {s: last_mean(r["reward"]) for s, r in cell_of(rows, regime, BASELINE).items()}
    lines = [f"| algorithm | seeds | first 10 | last 10 | Δ vs {BASELINE} [95 % CI] | steps to {LEVEL} | "
             "collapsed / stalled | raw k3 | outside clip, 1st minibatch | s / step (quietest run) |",
             "|" + "---|" * 10]
    sentences, missing, shown = [], [], 0
    for algorithm in REGIMES[regime][1]:
        cell = cell_of(rows, regime, algorithm)
        scores = {s: last_mean(r["reward"]) for s, r in cell.items()}
        diff = paired_difference(scores, baseline)
        if algorithm != BASELINE and diff.n < 2:
            missing.append(algorithm)
            continue
        if not cell:
            continue
        shown += 1
        reached = [steps_to_level(r["reward"], LEVEL) for r in cell.values()]
        hits = sorted(n for n in reached if n is not None)
        level = (f"{statistics.median(hits):.0f} ({len(hits)}/{len(reached)})" if hits else f"— (0/{len(reached)})")
        outcomes = [outcome(r["reward"]) for r in cell.values()]
        delta = "—" if algorithm == BASELINE else diff.interval()
        lines.append(
            f"| {algorithm} | {len(cell)} | {recorded_mean(first_mean(r['reward']) for r in cell.values()):.3f} | "
            f"{mean_and_spread(scores.values())} | "
            f"{delta} | {level} | {outcomes.count('collapsed')} / {outcomes.count('stalled')} | "
            f"{formatted(recorded_mean(recorded_mean(r['raw_k3']) for r in cell.values()), '.2e')} | "
            f"""{formatted(recorded_mean(recorded_mean(r['first_minibatch_ppo_ratio_outside_clip'])
                                         for r in cell.values()), '.3f')} | """
            f"{formatted(quiet_pace(cell.values()), '.1f')} |")
        if algorithm != BASELINE:
            sentences.append(verdict(algorithm, BASELINE, diff))
    if missing:
        sentences.append(f"not yet paired on 2 seeds (not shown): {', '.join(missing)}")
    return ("\n".join(lines) if shown else NO_RUNS), sentences


def figure(rows: list[dict], regime: str, path: Path) -> bool:
    """Reward curves (a 3-step moving mean, 10-step for a long regime; mean over seeds, band ± one standard
    deviation) of one regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 10 if regime in REGIME_STEPS else 3
    drawn = False
    for algorithm in REGIMES[regime][1]:
        cell = list(cell_of(rows, regime, algorithm).values())
        if len(cell) < 2:
            continue
        length = min(len(r["reward"]) for r in cell)
        smooth = [[statistics.mean(r["reward"][max(0, i + 1 - window):i + 1]) for i in range(length)] for r in cell]
        mean = [statistics.mean(col) for col in zip(*smooth)]
        spread = [statistics.stdev(col) for col in zip(*smooth)]
        steps = range(1, length + 1)
        ax.plot(steps, mean, label=f"{algorithm} ({len(cell)})")
        ax.fill_between(steps, [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)], alpha=0.12)
        drawn = True
    if drawn:
        ax.set(xlabel="step", ylabel=f"reward ({window}-step mean)",
               title=f"SmolLM2-135M, {regime}: mean ± sd over seeds")
        ax.legend(fontsize=7, ncol=2)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return drawn


MECHANISMS = (  # (regime, question, algorithm, its comparison, what to read of both)
    ("bf16 + fp8 weights", "bypass: does the clip range explain its failure?", "bypass_wide_clip", "bypass",
     "first_minibatch_ppo_ratio_outside_clip"),
    ("bf16 + fp8 weights", "widening the clip alone (the control)", "standard_wide_clip", "standard",
     "first_minibatch_ppo_ratio_outside_clip"),
    ("bf16 + fp8 weights", "bypass without a clip: is any clip the mechanism?", "bypass_no_clip", "bypass",
     "first_minibatch_ppo_ratio_outside_clip"),
    ("bf16 + fp8 weights", "DPPO's mask inside decoupled PPO: does it cost reward?", "dppo_ppo", "decoupled_tis",
     "removed"),
    ("bf16 + fp8 weights", "DPPO's mask: inside decoupled PPO against its REINFORCE form", "dppo_ppo", "prime_rl",
     "removed"),
    ("async lags 0..2", "the lag gate against the fixed drop", "lag_gate", "fixed_drop", "removed"),
    ("async lags 0..4", "the lag gate against the fixed drop", "lag_gate", "fixed_drop", "removed"),
)


def _ratio_of_means(cell: dict[int, dict], numerator: str, denominator: str) -> float:
    """Σ over runs and steps of ``numerator`` / the same of ``denominator`` (nan when either is missing)."""
    top = [v for r in cell.values() for v in r.get(numerator) or [] if v is not None]
    bottom = [v for r in cell.values() for v in r.get(denominator) or [] if v is not None]
    return sum(top) / sum(bottom) if top and bottom and sum(bottom) > 0 else math.nan


def _response_lengths(cell: dict[int, dict]) -> str:
    """The mean response length over the last 10 steps, and the steps whose every response ran to the cap (the real
    model's response budget, --max-new-tokens' default): the bypass mechanism's prediction (a policy that stops
    learning to stop sits at the cap)."""
    from miles_mis.lab.smollm_policy import DEFAULT_MAX_NEW_TOKENS as cap

    lengths = [r.get("response_length") or [] for r in cell.values()]
    at_cap = sum(sum(1 for v in run if v is not None and v >= cap - 1e-6) for run in lengths)
    steps = sum(len(run) for run in lengths)
    return (f"responses {formatted(recorded_mean(recorded_mean(run[-10:]) for run in lengths if run), '.1f')} "
            f"tokens over the last 10 steps, all at the {cap}-token cap on {at_cap} of {steps} steps")


def _has(cell: dict[int, dict], key: str) -> bool:
    """Whether some run of ``cell`` recorded ``key`` (a synchronous run records no stale share: all None)."""
    return any(v is not None for r in cell.values() for v in r.get(key) or [])


def mechanism_lines(rows: list[dict]) -> list[str]:
    """Per mechanism with both cells paired on ≥ 2 seeds: the paired reward difference and, on the same seeds, what
    each removed (its share of the |A| mass and the share of it with A > 0) or how many tokens its PPO ratio put
    outside the clip range at the first minibatch; with the response lengths where the rows have them (a policy that
    stops learning to stop sits at the cap)."""
    lines = []
    for regime, question, algorithm, other, read in MECHANISMS:
        a, b = cell_of(rows, regime, algorithm), cell_of(rows, regime, other)
        paired = a.keys() & b.keys()  # what each removed, read on the seeds the difference pairs
        a, b = {s: a[s] for s in paired}, {s: b[s] for s in paired}
        diff = paired_difference({s: last_mean(r["reward"]) for s, r in a.items()},
                                 {s: last_mean(r["reward"]) for s, r in b.items()})
        if diff.n < 2:
            continue
        if read == "removed":
            parts = [f"{name} removes "
                     f"{formatted(100 * _ratio_of_means(cell, 'removed_abs_advantage', 'abs_advantage'), '.1f')} % "
                     "of the |A| mass, "
                     f"""{formatted(100 * _ratio_of_means(cell, 'removed_positive_advantage', 'removed_token_fraction'),
                                   '.0f')} % """
                     "of its removed tokens with A > 0"
                     + (f", "
                        f"""{formatted(100 * recorded_mean(recorded_mean(r.get('mis_rs_stale_seq_fraction')
                                                                         or [math.nan]) for r in cell.values()),
                                       '.1f')} % """
                        "of sequences as stale" if _has(cell, "mis_rs_stale_seq_fraction") else "")
                     + (f", {_response_lengths(cell)}" if _has(cell, "response_length") else "")
                     for name, cell in ((algorithm, a), (other, b))]
        else:
            parts = [f"{name}: {formatted(100 * recorded_mean(recorded_mean(r[read]) for r in cell.values()), '.1f')} "
                     f"% of tokens outside the clip range at the first minibatch, {_response_lengths(cell)}"
                     for name, cell in ((algorithm, a), (other, b))]
        lines.append(f"- {regime}, {question}: {verdict(algorithm, other, diff)}; " + "; ".join(parts))
    return lines


def _first_last(cell: dict[int, dict], key: str, spec: str) -> str:
    """``key``'s mean over the first 10 steps → over the last 10 (means over runs), and its largest step value."""
    runs = [[v for v in r.get(key) or [] if v is not None] for r in cell.values()]
    runs = [run for run in runs if run]
    if not runs:
        return "not recorded"
    first = recorded_mean(recorded_mean(run[:10]) for run in runs)
    last = recorded_mean(recorded_mean(run[-10:]) for run in runs)
    return (f"{formatted(first, spec)} → {formatted(last, spec)} (largest step "
            f"{formatted(max(max(run) for run in runs), spec)})")


def signal_line(regime: str, algorithm: str, cell: dict[int, dict]) -> str:
    """One cell's signals, first 10 steps → last 10: the tail ratio ρ where score centering recorded it, the
    gradient norm, the response length and the truncated share."""
    tail = f"tail ratio {_first_last(cell, 'mis_sc_tail_ratio', '.3g')}, " if _has(cell, "mis_sc_tail_ratio") else ""
    runs = f"{len(cell)} run{'s' if len(cell) != 1 else ''}"
    return (f"- {regime}, {algorithm} ({runs}): {tail}grad norm {_first_last(cell, 'grad_norm', '.3g')}, "
            f"response length {_first_last(cell, 'response_length', '.1f')}, truncated share "
            f"{_first_last(cell, 'truncated_fraction', '.2f')}")


def centering_lines(rows: list[dict]) -> list[str]:
    """Per 40-step regime and score-centering or IcePop cell with runs, the signals the 35B study saw move first
    (``signal_line``), standard PPO's beside them."""
    lines = []
    for regime in (r for r in REGIMES if r not in REGIME_STEPS):
        for algorithm in (a for a in REGIMES[regime][1] if a in SCORE_CENTERING or a == BASELINE):
            cell = cell_of(rows, regime, algorithm)
            if not cell or (algorithm == BASELINE and not any(cell_of(rows, regime, a) for a in SCORE_CENTERING)):
                continue
            lines.append(signal_line(regime, algorithm, cell))
    return lines


def window_table(rows: list[dict], regime: str, width: int = WINDOW) -> str:
    """Per algorithm of a long regime with runs, the mean reward of each ``width``-step window (the mean over its
    runs, ± their standard deviation): where the runs saturate (a window no higher than the one before) and whether
    one collapses late."""
    cells = {a: cell_of(rows, regime, a) for a in REGIMES[regime][1]}
    cells = {a: cell for a, cell in cells.items() if cell}
    steps = max(len(r["reward"]) for cell in cells.values() for r in cell.values())
    windows = [(start, min(start + width, steps)) for start in range(0, steps, width)]
    lines = ["| algorithm | runs | " + " | ".join(f"steps {a + 1}–{b}" for a, b in windows) + " |",
             "|" + "---|" * (len(windows) + 2)]
    for algorithm, cell in cells.items():
        means = [[recorded_mean(r["reward"][a:b]) for r in cell.values() if len(r["reward"]) >= b] for a, b in windows]
        lines.append(f"| {algorithm} | {len(cell)} | " + " | ".join(mean_and_spread(m) if m else "—" for m in means)
                     + " |")
    return "\n".join(lines)


def long_regime_lines(rows: list[dict], regime: str) -> list[str]:
    """The signals of every algorithm of a long regime (``signal_line``), whose collapse would show first in them."""
    return [signal_line(regime, a, cell) for a in REGIMES[regime][1] if (cell := cell_of(rows, regime, a))]


def sections(rows: list[dict], figures: Path | None,
             curve_file: Path | None = None) -> list[tuple[str, str, str | None]]:
    """The tables as (title, markdown, figure file under ``figures`` or None): each regime, the mechanisms, and what
    mismatch needs a correction (with ``curve_file``, its points are also written there: CURVE_FILE is the levels the
    analyzer reads). Rows of regimes of their own length alone (REGIME_STEPS) give those regimes' sections alone: the
    other regimes, the mechanisms and the curve belong to the 40-step sweep."""
    out = []
    present = {r["regime"] for r in rows}
    own_length_only = bool(present) and present <= set(REGIME_STEPS)
    for regime in REGIMES:
        if regime not in present and (regime in REGIME_STEPS or own_length_only):
            continue  # a regime of its own length not in these rows, or a 40-step regime beside such rows
        table, sentences = regime_table(rows, regime)
        name = f"lab_verdicts_{slug(regime)}.png"
        # without figures, the one drawn last time (if any) is still named
        drawn = figure(rows, regime, figures / name) if figures is not None else (FIGURES / name).exists()
        out.append((regime, "\n".join([table, "", *[f"- {s}" for s in sentences]]), name if drawn else None))
        if regime in REGIME_STEPS:  # a long regime: where it saturates, and the signals a late collapse shows in
            out.append((f"{regime}: mean reward by {WINDOW}-step window", window_table(rows, regime), None))
            out.append((f"{regime}: signals, first 10 steps → last 10", "\n".join(long_regime_lines(rows, regime)),
                        None))
    if own_length_only:
        return out
    mechanisms = mechanism_lines(rows)
    out.append(("Mechanisms", "\n".join(mechanisms or ["(no mechanism pair has 2 paired seeds yet)"]), None))
    centering = centering_lines(rows)
    if centering:
        out.append(("Score centering's signals, first 10 steps → last 10", "\n".join(centering), None))
    points = curve(rows)
    safe = [curve_table(points), "", *[f"- {level_sentence(safe_level(points, u))}" for u in UNCORRECTED]]
    name = "lab_verdicts_safe_mismatch.png" if points else None
    if points and curve_file is not None:
        write_curve(points, rows, curve_file)
        if figures is not None:
            curve_figure(points, figures / name)
        elif not (FIGURES / name).exists():  # as for the regimes: the one drawn last time, if any
            name = None
    out.append(("What mismatch needs a correction", "\n".join(safe), name))
    return out


def printed_tables(rows: list[dict]) -> str:
    """The sections as printed: no figure drawn, written or named (the ones in docs/figures may be another study's
    rows)."""
    return "\n".join(f"### {title}\n\n{body}\n" for title, body, _ in sections(rows, None))


