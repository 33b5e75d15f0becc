"""How exact the k3 and chi-square metrics are when the engines nearly agree (log-ratio sigma 1e-5 ... 1).

k3_t = e^c − c − 1 (c the log ratio of a token) is about c²/2: at c ~ 1e-4 it is ~5e-9, far below float32's
resolution of e^c near 1 (6e-8), so e^c − c − 1 evaluated in float32 cancels to 0 or to a rounding step.
This benchmark draws N log ratios with a given sigma (float32 log-probs, as hosts pass them), runs the plugin,
and compares each metric with the exact value computed in float64 from the same float32 inputs:

  mis_k3_kl             per-sequence mean k3 (one sequence here)
  mis_batch_k3          batch mean k3 (the batch gate's statistic)
  per-token k3          mis_rs_token_k3_mean (a token_k3 option with a threshold that rejects nothing), the
                        largest relative error over the tokens
  mis_chi2_token        mean(ρ²) − 1 = mean(expm1(2c)): absolute error (it is near 0, so relative is moot)

    python benchmarks/bench_precision.py [--tokens 100000]
"""

from __future__ import annotations

import argparse

import torch

from miles_mis import MisConfig, compute_mis_weights

SIGMAS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2, 1e-1, 1.0)


def run(sigma: float, tokens: int, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(tokens, generator=gen) * 2.0 - 0.1
    train = rollout + (sigma * torch.randn(tokens, generator=gen, dtype=torch.float64)).float()
    c = train.double() - rollout.double()  # exact: the float32 log ratio the plugin sees
    exact_k3 = torch.expm1(c) - c
    exact_chi2 = torch.expm1(2 * c).mean()
    config = MisConfig(use_tis=True, rs_divergence={"token_k3": 1e30})
    _, _, metrics = compute_mis_weights(config, train_log_probs=[train], rollout_log_probs=[rollout],
                                        loss_masks=[torch.ones(tokens)])
    mean_exact = float(exact_k3.mean())
    per_token = metrics["mis_rs_token_k3_mean"][0].double()
    token_error = ((per_token - exact_k3).abs() / exact_k3.clamp(min=1e-300)).max()
    return {"sigma": sigma, "exact_k3": mean_exact,
            "k3_kl": float(metrics["mis_k3_kl"][0][0]) / mean_exact - 1.0,
            "batch_k3": float(metrics["mis_batch_k3"][0][0]) / mean_exact - 1.0,
            "token_k3_max": float(token_error),
            "chi2_abs": abs(float(metrics["mis_chi2_token"][0][0]) - float(exact_chi2)),
            "exact_chi2": float(exact_chi2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens (one response) per sigma")
    args = parser.parse_args()
    print(f"{args.tokens} tokens per row, float32 log-probs; relative errors against float64 expm1(c) − c")
    print(f"{'sigma':>7} {'exact mean k3':>14} {'mis_k3_kl':>10} {'batch_k3':>10} {'token k3 max':>13} "
          f"{'chi2 abs err':>13} {'exact chi2':>11}")
    for sigma in SIGMAS:
        row = run(sigma, args.tokens)
        print(f"{row['sigma']:>7.0e} {row['exact_k3']:>14.4e} {row['k3_kl']:>+10.2e} {row['batch_k3']:>+10.2e} "
              f"{row['token_k3_max']:>13.2e} {row['chi2_abs']:>13.2e} {row['exact_chi2']:>+11.3e}")


if __name__ == "__main__":
    main()
