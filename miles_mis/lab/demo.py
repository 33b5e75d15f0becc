"""``miles-mis demo``: the same seed under one mismatch setting, four algorithms, one figure and a table.

Each algorithm is a ``miles-mis train`` run with the flags a miles user would type; its correction
config is written next to its metrics and passed with ``--custom-config-path``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from .train import PLUGIN, parse_args, train

# the mismatch setting of the demo (see docs/lab.md for how it was chosen and what it shows)
DEFAULT_SETTING = ["--rollout-dtype", "bf16", "--rollout-weight-quant", "int8", "--rollout-staleness", "4", "--lr", "3e-3"]
DEFAULT_STEPS = 150

# every algorithm the lab compares: host flags, and the miles_mis config written to the run's mis.yaml
ALGORITHMS = {
    "standard": (["--get-mismatch-metrics"], {}),
    "bypass": (["--use-rollout-logprobs", "--get-mismatch-metrics"], {}),
    "decoupled_tis": (["--use-tis"], {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0}),
    "seq_mis": (["--use-tis"], {"tis_level": "sequence", "tis_mode": "mask", "tis_lower_bound": 0.5,
                                "tis_upper_bound": 2.0}),
    "geo_rs": (["--use-tis"], {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0,
                               "rs_divergence": {"seq_mean_k1": [0.999, 1.001]}, "rs_veto_threshold": 1e-4}),
    "icepop": (["--use-tis"], {"tis_level": "token", "tis_mode": "icepop", "tis_lower_bound": 0.5,
                               "tis_upper_bound": 2.0}),
    "adaptive_tis": (["--use-tis"], {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": "auto"}),
}
DEMO_ALGORITHMS = ("standard", "bypass", "decoupled_tis", "seq_mis")  # the demo's four runs


def run_algorithm(name: str, setting: list[str], seed: int, steps: int, out_dir: Path, quiet: bool = True,
                  extra: list[str] | None = None) -> list[dict]:
    flags, config = ALGORITHMS[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "mis.yaml"
    config_path.write_text(yaml.safe_dump(config) if config else "{}\n")
    argv = [*flags, "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(config_path), *setting,
            "--seed", str(seed), "--steps", str(steps), "--out-dir", str(out_dir), *(extra or [])]
    if quiet:
        argv.append("--quiet")
    (out_dir / "command.txt").write_text("miles-mis train " + " ".join(argv) + "\n")
    return train(parse_args(argv))


def summarize(history: list[dict], tail: int = 10) -> dict[str, float]:
    last = history[-tail:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {
        f"reward (last {tail})": mean(last, "reward"),
        "exact match (last)": mean(last, "exact_match"),
        "best reward": max(r["reward"] for r in history),
        "mean raw KL": mean(history, "raw_kl"),
        "min raw ESS": min(r["raw_ess"] for r in history),
        "mean grad norm": mean(history, "grad_norm"),
        "seconds": sum(r["seconds"] for r in history),
    }


def markdown_table(rows: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(rows.values())))
    lines = ["| algorithm | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.4g}" for c in columns) + " |")
    return "\n".join(lines)


def plot(histories: dict[str, list[dict]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'miles-mis[figures]'): no figure", file=sys.stderr)
        return False
    panels = [("reward", "reward"), ("raw_kl", "raw KL(π_rollout‖π_train): batch mean of log π_rollout − log π_old"),
              ("raw_ess", "raw ESS of π_old/π_rollout over the batch"), ("grad_norm", "grad norm (before clipping)")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, label) in zip(axes.flat, panels):
        for name, history in histories.items():
            values = [r[key] for r in history]
            if key == "reward":  # exponential moving average: the per-step reward is noisy
                smoothed, level = [], values[0]
                for v in values:
                    level = 0.8 * level + 0.2 * v
                    smoothed.append(level)
                values, label = smoothed, "reward (EMA 0.2)"
            ax.plot([r["step"] for r in history], values, label=name, linewidth=1.2)
        if key == "grad_norm":
            ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def demo(out_dir: Path, steps: int, seed: int, setting: list[str]) -> int:
    started = time.perf_counter()
    description = " ".join(setting)
    print(f"mismatch lab demo: sort-digits GRPO, seed {seed}, {steps} steps, engine setting: {description}",
          file=sys.stderr)
    histories = {}
    for name in DEMO_ALGORITHMS:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        histories[name] = run_algorithm(name, setting, seed, steps, out_dir / name)
    rows = {name: summarize(h) for name, h in histories.items()}
    table = markdown_table(rows)
    figure = out_dir / "demo.png"
    plotted = plot(histories, figure, f"miles_mis lab: {description}, seed {seed}")
    summary = (f"# miles_mis lab demo\n\nSetting: `{description}`, seed {seed}, {steps} steps.\n\n{table}\n\n"
               "raw KL / ESS compare the trainer's π_old with the engine's log-probs of the same samples.\n")
    (out_dir / "summary.md").write_text(summary)
    print(table)
    print(f"\nwrote {out_dir}/<algorithm>/metrics.jsonl, {out_dir}/summary.md"
          + (f", {figure}" if plotted else "") + f" in {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-mis demo", description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setting", default=" ".join(DEFAULT_SETTING),
                        help="engine/training flags shared by the four runs")
    args = parser.parse_args(argv)
    return demo(args.out_dir, args.steps, args.seed, args.setting.split())


if __name__ == "__main__":
    sys.exit(main())
