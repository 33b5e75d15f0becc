"""Which tokens PPO's clip blocks in bypass mode: the first minibatch of the first step, by token class.

    python benchmarks/lab_clip_block.py [--regime "bf16 + fp8 weights"] [--seeds 3]   # resumable, a row per seed

In bypass (``--use-rollout-logprobs``) the PPO ratio of the first minibatch is r = π_θ/μ with π_θ still the
trainer's π_old: the engine's error alone, ℓ = log r. PPO-clip then gives a token no gradient when

    A > 0 and r > 1 + ε,   or   A < 0 and r < 1 − ε          (``blocked``)

while a token with A < 0 and r > 1 + ε keeps its gradient, weighted by r. So where the engine's error has a sign on a
class of tokens, bypass learns that class one-sidedly. Per seed this runs one step of the verdict sweep's bypass cell
(lab_verdicts_plan.argv_of: same prompts, same first rollout) with ``--dump-details``, reads the first policy-loss call
(rank 0, call 0: the first minibatch) and sums, per class of tokens, their count, Σℓ, how many have r > 1 + ε and
r < 1 − ε, how many are blocked at ε = 0.2 and 0.5, and Σ of the trainer's and the engine's probability. The classes:
every token, the stop token (the last token of a response shorter than the cap, ``--max-new-tokens``: the engine
stopped on it), the stop token of a response with A > 0 and with A < 0, and every other token. The same tokens give
DPPO's directional mask (``token_dtv: [−0.2, 0.2]`` on p − q, the sweep's ``dppo_ppo`` and ``prime_rl`` cells, which
at the first minibatch compare the same π_θ = π_old with μ): what it removes per class, the advantage sign of what it
removes, and their share of the gradient weight |A|·w inside decoupled PPO (w = min(r, 2)) and in prime-rl's
REINFORCE (w = r). Rows go to
benchmarks/results/lab_clip_block.jsonl (a seed already there is skipped); the table pools them.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_runs import append_result, machine, read_results  # noqa: E402
from lab_verdicts_plan import REGIMES, argv_of  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lab_clip_block.jsonl"
EPSILONS = (0.2, 0.5)
DPPO_DELTA = 0.2  # the sweep's dppo_ppo and prime_rl cells (lab_verdicts.PRIME_RL)
CLASSES = ("every token", "stop token", "stop token, A > 0", "stop token, A < 0", "other tokens")


def blocked(log_ratio: Tensor, advantages: Tensor, eps: float) -> Tensor:
    """PPO-clip's zero-gradient tokens: (A > 0 and ℓ > log(1 + ε)) or (A < 0 and ℓ < log(1 − ε))."""
    return (((advantages > 0) & (log_ratio > math.log1p(eps)))
            | ((advantages < 0) & (log_ratio < math.log1p(-eps))))


def first_minibatch_tokens(dump: dict, cap: int) -> dict[str, Tensor]:
    """The loss tokens of one policy-loss dump (lab.dump's layout), packed: ℓ = train − rollout log-prob, the
    advantage, whether the token is a stop token (last of a response shorter than ``cap``), both probabilities."""
    parts = {"log_ratio": [], "advantages": [], "stop": [], "train_prob": [], "rollout_prob": []}
    for sample in dump["samples"]:
        length = sample["response_length"]
        keep = sample["local_loss_mask"].bool()
        train, rollout = sample["train_log_probs"].double(), sample["rollout_log_probs"].double()
        stop = torch.zeros(length, dtype=torch.bool)
        stop[-1] = length < cap
        for key, value in (("log_ratio", train - rollout), ("advantages", sample["advantages"].double()),
                           ("stop", stop), ("train_prob", train.exp()), ("rollout_prob", rollout.exp())):
            parts[key].append(value[keep])
    return {key: torch.cat(values) for key, values in parts.items()}


def dppo_removed(train_prob: Tensor, rollout_prob: Tensor, advantages: Tensor, delta: float) -> Tensor:
    """DPPO's directional TV mask (``token_dtv: [−δ, δ]``): the tokens it takes out of the loss,
    (A > 0 and p − q > δ) or (A < 0 and p − q < −δ), with p the trainer's and q the engine's probability."""
    gap = train_prob - rollout_prob
    return ((advantages > 0) & (gap > delta)) | ((advantages < 0) & (gap < -delta))


def class_sums(tokens: dict[str, Tensor]) -> dict[str, dict[str, float]]:
    """Per class (CLASSES): sums that pool over seeds by addition (``table`` divides them). Besides the clip's counts,
    DPPO's mask at δ = DPPO_DELTA: the tokens it removes, those with A > 0, and the gradient weight |A|·w of the
    removed and of all tokens in its two forms: inside decoupled PPO with token TIS (w = min(r, 2); the PPO ratio is 1
    at the first minibatch) and in prime-rl's REINFORCE by the raw π_θ/μ (w = r)."""
    ell, adv, stop = tokens["log_ratio"], tokens["advantages"], tokens["stop"]
    removed = dppo_removed(tokens["train_prob"], tokens["rollout_prob"], adv, DPPO_DELTA)
    ratio = ell.exp()
    weights = {"ppo": adv.abs() * ratio.clamp(max=2.0), "reinforce": adv.abs() * ratio}
    selections = {"every token": torch.ones_like(stop), "stop token": stop, "stop token, A > 0": stop & (adv > 0),
                  "stop token, A < 0": stop & (adv < 0), "other tokens": ~stop}
    out = {}
    for name, chosen in selections.items():
        sums = {"tokens": int(chosen.sum()), "log_ratio": float(ell[chosen].sum()),
                "train_prob": float(tokens["train_prob"][chosen].sum()),
                "rollout_prob": float(tokens["rollout_prob"][chosen].sum())}
        for eps in EPSILONS:
            sums[f"above_{eps}"] = int((chosen & (ell > math.log1p(eps))).sum())
            sums[f"below_{eps}"] = int((chosen & (ell < math.log1p(-eps))).sum())
            sums[f"blocked_{eps}"] = int((chosen & blocked(ell, adv, eps)).sum())
        sums["dppo_removed"] = int((chosen & removed).sum())
        sums["dppo_removed_positive"] = int((chosen & removed & (adv > 0)).sum())
        for form, weight in weights.items():
            sums[f"{form}_weight"] = float(weight[chosen].sum())
            sums[f"{form}_weight_removed"] = float(weight[chosen & removed].sum())
        out[name] = sums
    return out


def table(rows: list[dict]) -> str:
    """The pooled sums of ``rows`` as a markdown table (shares of each class's tokens)."""
    eps_low, eps_high = EPSILONS
    lines = [f"| {len(rows)} seeds ({', '.join(str(r['seed']) for r in rows)}), first minibatch | tokens | mean ℓ | "
             f"r > {1 + eps_low} | r < {1 - eps_low} | blocked at ε = {eps_low} | blocked at ε = {eps_high} | "
             "mean π_trainer | mean μ |", "|" + "---|" * 9]
    for name in CLASSES:
        pooled = {key: sum(r["classes"][name][key] for r in rows) for key in rows[0]["classes"][name]}
        n = pooled["tokens"]
        if n == 0:
            lines.append(f"| {name} | 0 |" + " — |" * 7)
            continue
        lines.append(f"| {name} | {n} | {pooled['log_ratio'] / n:+.3f} | {pooled[f'above_{eps_low}'] / n:.3f} | "
                     f"{pooled[f'below_{eps_low}'] / n:.3f} | {pooled[f'blocked_{eps_low}'] / n:.3f} | "
                     f"{pooled[f'blocked_{eps_high}'] / n:.3f} | {pooled['train_prob'] / n:.3f} | "
                     f"{pooled['rollout_prob'] / n:.3f} |")
    return "\n".join(lines)


def dppo_table(rows: list[dict]) -> str:
    """DPPO's mask on the pooled sums of ``rows``: per class, the share of its tokens removed, how many of those have
    A > 0, and the removed tokens' gradient weight as a share of every token's, inside PPO and in REINFORCE."""
    every = {key: sum(r["classes"]["every token"][key] for r in rows) for key in ("ppo_weight", "reinforce_weight")}
    lines = [f"| {len(rows)} seeds, first minibatch, δ = {DPPO_DELTA} | tokens | removed | removed with A > 0 | "
             "gradient weight removed, of all: PPO + TIS | REINFORCE π_θ/μ |", "|" + "---|" * 6]
    for name in CLASSES:
        pooled = {key: sum(r["classes"][name][key] for r in rows) for key in rows[0]["classes"][name]}
        n, gone = pooled["tokens"], pooled["dppo_removed"]
        lines.append(f"| {name} | {n} | {gone / n if n else 0:.3f} | {pooled['dppo_removed_positive']}/{gone} | "
                     f"{pooled['ppo_weight_removed'] / every['ppo_weight']:.3f} | "
                     f"{pooled['reinforce_weight_removed'] / every['reinforce_weight']:.3f} |")
    return "\n".join(lines)


def measure(regime: str, seed: int, cap: int) -> dict:
    """One step of the sweep's bypass cell with dumps: the row of ``seed`` (its first rollout's fingerprint too)."""
    import json

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        config = folder / "mis.yaml"
        config.write_text("{}\n")
        argv = argv_of(regime, "bypass", seed, 1, config)
        subprocess.run([sys.executable, "-m", "miles_mis.cli", "train", *argv, "--out-dir", str(folder / "run"),
                        "--dump-details", str(folder / "dumps"), "--quiet"], check=True)
        step = json.loads((folder / "run" / "metrics.jsonl").read_text().splitlines()[0])
        dump = torch.load(folder / "dumps" / "policy_loss_debug" / "rank_0_call_0.pt", weights_only=True)
    return {"regime": regime, "seed": seed, "machine": machine(), "first_reward": step["reward"],
            "first_raw_k3": step["raw_k3"], "cap": cap, "classes": class_sums(first_minibatch_tokens(dump, cap))}


def current(row: dict) -> bool:
    """Whether ``row`` holds every sum ``class_sums`` writes (rows written before DPPO's were added are measured again
    and the new row read; the old stays in the file)."""
    return "dppo_removed" in row["classes"]["every token"]


def main() -> None:
    from miles_mis.lab.smollm_policy import DEFAULT_MAX_NEW_TOKENS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=list(REGIMES), default="bf16 + fp8 weights",
                        help="the engine setting (default: bf16 + fp8 weights)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default: 3)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the results file (default: {RESULTS})")
    args = parser.parse_args()
    done = {r["seed"] for r in read_results(args.results) if r["regime"] == args.regime and current(r)}
    for seed in range(args.seeds):
        if seed in done:
            continue
        print(f"clip-block: {args.regime} seed {seed} ({seed + 1}/{args.seeds})", file=sys.stderr, flush=True)
        append_result(args.results, measure(args.regime, seed, DEFAULT_MAX_NEW_TOKENS))
    rows = [r for r in read_results(args.results) if r["regime"] == args.regime and r["seed"] < args.seeds
            and current(r)]
    print(f"{args.regime}, bypass, SmolLM2-135M on vLLM:\n\n{table(rows)}\n\n{dppo_table(rows)}" if rows
          else "no rows")


if __name__ == "__main__":
    main()
