"""Why the staleness gate lost to the fixed drop on mixed-lag batches: the gate's choice, or how much it keeps?

In the lab's asynchronous sweep (lab_async.py, mixed lags 0..3, lr 3·10⁻³) the gate (``rs_max_lag: 1``,
``rs_max_lag_k3: 0.05``) kept more stale data than the fixed drop (``rs_max_lag: 1``) and ended lower, while
decoupled TIS, which keeps every stale sample, ended highest. The gate keeps a lag's sequences in a micro-batch
exactly when that lag's pooled k3 there is at most 0.05: it chooses the stale groups the policy has moved least on.
Two explanations make different predictions:

- **the choice** (keeping stale groups *selected by a low k3* costs reward): a gate that keeps the same share of
  each lag's groups *at random* (``random_gate``) ends where the fixed drop does, above the gate;
- **the amount** (keeping part of the stale data, whichever part, costs reward): ``random_gate`` ends where the
  gate does, below the fixed drop.

``random_gate`` is the gate with its decision replaced, per micro-batch and per lag beyond ``rs_max_lag``, by a coin
that keeps that lag's sequences with the probability the real gate kept them in the same seed's run (its
``mis_lag_<b>_rejected_fraction`` over the run); everything else (the plugin, the loss, the seeds) is the gate's run.
It exists only here, for this test (``random_stale_rejections`` replaces ``staleness.stale_rejections`` inside the
benchmark's own process), not as a config option.

    python benchmarks/lab_gate_selection.py [--seeds 6]   # resumable: a row per run in the results file

Per seed: fixed_drop, lag_gate, decoupled_tis (lab_async.py's configs), then random_gate at that seed's gate rates;
150 steps each on the embedded engine (about 30 s a run on one core). The table gives each algorithm's last-10-step
reward and its paired differences (95 % t interval over seeds) against the gate and against the fixed drop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import last_mean, mean_and_spread, paired_difference, verdict  # noqa: E402
from lab_async import ALGORITHMS, BASE, PLUGIN, SCHEDULES  # noqa: E402
from lab_runs import append_result, read_results  # noqa: E402

from miles_mis.correction import staleness  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lab_gate_selection.jsonl"
SCHEDULE = "mixed lags 0..3"
ORDER = ("fixed_drop", "lag_gate", "decoupled_tis", "random_gate")
BUCKETS = {2: "2", 3: "3plus"}  # the stale lags of the schedule (beyond rs_max_lag = 1) and their metric buckets


def random_stale_rejections(lags: torch.Tensor, max_lag: int, keep: dict[int, float],
                            generator: torch.Generator) -> torch.Tensor:
    """[B] bool: every sequence of a lag λ > ``max_lag`` is rejected together, unless one coin per lag of the
    micro-batch keeps them with probability ``keep[min(λ, max key)]``: the gate's granularity, without its k3."""
    values, group = torch.unique(lags, return_inverse=True)
    probability = torch.tensor([keep[min(int(v), max(keep))] if v > max_lag else 1.0 for v in values.tolist()],
                               dtype=torch.float64)
    kept = torch.rand(values.numel(), generator=generator, dtype=torch.float64) < probability
    return (lags > max_lag) & ~kept.index_select(0, group.cpu()).to(lags.device)


def gate_keep_rates(row: dict) -> dict[int, float]:
    """The share of each stale lag's tokens the real gate kept over its run (from its per-step metrics)."""
    return {lag: 1.0 - row["rejected"][bucket] for lag, bucket in BUCKETS.items()}


def rejected_share(history: list[dict], bucket: str) -> float:
    """A lag bucket's rejected share over a run, token-weighted: Σ_t f_t r_t / Σ_t f_t with f the bucket's token
    fraction and r its rejected fraction at step t (a step without that lag reports 0 for both)."""
    weights = [r.get(f"mis_lag_{bucket}_token_fraction") or 0.0 for r in history]
    rejected = [r.get(f"mis_lag_{bucket}_rejected_fraction") or 0.0 for r in history]
    return sum(w * x for w, x in zip(weights, rejected)) / max(sum(weights), 1e-30)


def run_one(algorithm: str, seed: int, steps: int, out_dir: Path, keep: dict[int, float] | None) -> dict:
    from miles_mis.lab.train import parse_args, train

    torch.set_num_threads(1)
    flags, config = ALGORITHMS["lag_gate" if algorithm == "random_gate" else algorithm]
    out = out_dir / f"{algorithm}_seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "mis.yaml").write_text(yaml.safe_dump(config))
    argv = [*flags, "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(out / "mis.yaml"), *BASE,
            *SCHEDULES[SCHEDULE], "--seed", str(seed), "--steps", str(steps), "--out-dir", str(out), "--quiet",
            "--save-interval", "0"]
    real_gate = staleness.stale_rejections
    if keep is not None:
        generator = torch.Generator().manual_seed(10_000 + seed)
        staleness.stale_rejections = lambda config, lags, sum_k3, n_usable: random_stale_rejections(
            lags, config.rs_max_lag, keep, generator)
    started = time.perf_counter()
    try:
        history = train(parse_args(argv))
    finally:
        staleness.stale_rejections = real_gate
    mean = lambda key: statistics.mean(r.get(key) or 0.0 for r in history)  # noqa: E731
    return {"algorithm": algorithm, "seed": seed, "steps": steps, "seconds": time.perf_counter() - started,
            "reward": [r["reward"] for r in history], "keep": keep,
            "rejected": {b: rejected_share(history, b) for b in staleness.BUCKETS},
            "lag_k3": {b: mean(f"mis_lag_{b}_k3") for b in staleness.BUCKETS},
            "removed_token_fraction": mean("removed_token_fraction"),
            "removed_abs_advantage_share": sum(r["removed_abs_advantage"] for r in history)
            / max(sum(r["abs_advantage"] for r in history), 1e-30)}


def table(rows: list[dict]) -> str:
    cells = {a: {r["seed"]: r for r in rows if r["algorithm"] == a} for a in ORDER}
    score = lambda r: last_mean(r["reward"])  # noqa: E731
    steps = rows[0]["steps"] if rows else 0
    lines = [f"| {SCHEDULE}, {steps} steps | seeds | last 10 steps | Δ vs lag_gate [95 % CI] | Δ vs fixed_drop | "
             "tokens removed | kept of lag 2, lag ≥ 3 |", "|---|---|---|---|---|---|---|"]
    sentences = []
    for algorithm in ORDER:
        cell = cells[algorithm]
        if not cell:
            continue
        scores = [score(r) for r in cell.values()]
        diff, to_drop = (paired_difference({s: score(r) for s, r in cell.items()},
                                           {s: score(r) for s, r in cells[other].items()})
                         for other in ("lag_gate", "fixed_drop"))
        shown = "—" if algorithm == "lag_gate" else diff.interval()
        shown += " | " + ("—" if algorithm == "fixed_drop" else to_drop.interval())
        kept = [statistics.mean(1 - r["rejected"][b] for r in cell.values()) for b in ("2", "3plus")]
        lines.append(f"| {algorithm} | {len(cell)} | {mean_and_spread(scores)} | {shown} | "
                     f"{statistics.mean(r['removed_token_fraction'] for r in cell.values()):.3f} | "
                     f"{kept[0]:.2f}, {kept[1]:.2f} |")
        if algorithm != "lag_gate" and diff.n >= 2:
            sentences.append(verdict(algorithm, "lag_gate", diff))
        if algorithm == "random_gate" and to_drop.n >= 2:
            sentences.append(verdict(algorithm, "fixed_drop", to_drop))
    return "\n".join(lines + [""] + [f"- {s}" for s in sentences])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=6, help="seeds (default: 6)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run (default: 150, as lab_async.py)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lab_gate_selection"),
                        help="the runs' files (default: runs/lab_gate_selection)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results file (default: {RESULTS})")
    args = parser.parse_args()
    rows = [r for r in read_results(args.results) if r["steps"] == args.steps]
    done = {(r["algorithm"], r["seed"]) for r in rows}
    todo = [(a, s) for s in range(args.seeds) for a in ORDER if (a, s) not in done]
    for count, (algorithm, seed) in enumerate(todo, 1):
        keep = None
        if algorithm == "random_gate":
            keep = gate_keep_rates(next(r for r in rows if r["algorithm"] == "lag_gate" and r["seed"] == seed))
        row = run_one(algorithm, seed, args.steps, args.out_dir, keep)
        append_result(args.results, row)
        rows.append(row)
        print(f"[{count}/{len(todo)}] {algorithm} seed {seed}: last 10 steps "
              f"{last_mean(row['reward']):.3f} ({row['seconds']:.0f} s)", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
