"""Which mismatch settings make uncorrected RL measurably worse? Four algorithms x settings x seeds.

Each cell is a real lab run (miles_mis.lab.demo.run_algorithm); the table prints, per setting and
algorithm, the final reward (mean of the last 10 steps) as mean ± std over seeds, and the mean raw KL.

    python benchmarks/lab_sweep.py [--seeds 3] [--steps 150] [--out-dir runs/sweep]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from miles_mis.lab.demo import ALGORITHMS, run_algorithm, summarize

SETTINGS = {
    "bf16": ["--rollout-dtype", "bf16"],
    "bf16+int8": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "int8"],
    "bf16 stale4 lr3e-3": ["--rollout-dtype", "bf16", "--rollout-staleness", "4", "--lr", "3e-3"],
    "bf16+int8 stale4 lr3e-3": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "int8",
                                "--rollout-staleness", "4", "--lr", "3e-3"],
    "bf16 lr3e-3 (no staleness)": ["--rollout-dtype", "bf16", "--lr", "3e-3"],
    "bf16+int8 stale8 lr3e-3": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "int8",
                                "--rollout-staleness", "8", "--lr", "3e-3"],
    "SYNTHETIC noise 0.5": ["--rollout-dtype", "bf16", "--rollout-logit-noise", "0.5"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/sweep"))
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS))
    args = parser.parse_args()
    print(f"| setting | algorithm | final reward (mean ± std over {args.seeds} seeds) | exact match | "
          "mean raw KL | min raw ESS |")
    print("|---|---|---|---|---|---|")
    for setting in args.settings:
        for name in ALGORITHMS:
            results = [summarize(run_algorithm(name, SETTINGS[setting], seed, args.steps,
                                               args.out_dir / setting.replace(" ", "_") / name / f"seed{seed}"))
                       for seed in range(args.seeds)]
            finals = [r["reward (last 10)"] for r in results]
            exact = statistics.mean(r["exact match (last)"] for r in results)
            kl = statistics.mean(r["mean raw KL"] for r in results)
            ess = min(r["min raw ESS"] for r in results)
            print(f"| {setting} | {name} | {statistics.mean(finals):.3f} ± {statistics.stdev(finals):.3f} | "
                  f"{exact:.3f} | {kl:.2e} | {ess:.4f} |", flush=True)


if __name__ == "__main__":
    main()
