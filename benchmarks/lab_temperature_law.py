"""Seed 003's law on the lab: with logit noise ε of fixed variance, KL(π_rollout ‖ π_train) ≈ Var(ε) / (2T²),
so mis_kl × T² is roughly constant across rollout temperatures at a fixed engine dtype.

A warm-started lab model; for each temperature the engine samples 4096 responses and the trainer
scores them; mis_kl is the mean over tokens of log π_rollout − log π_train (the plugin's mis_kl at
per-token granularity), k3 the mean of ρ − log ρ − 1.

    python benchmarks/lab_temperature_law.py
"""

from __future__ import annotations

import torch

from miles_mis.lab import task
from miles_mis.lab.engine import RolloutEngine
from miles_mis.lab.model import ModelConfig, TinyGPT, sequence_log_probs
from miles_mis.lab.tiny_policy import warm_start

TEMPERATURES = (0.5, 0.7, 1.0, 1.4, 2.0)
SETTINGS = {"bf16": dict(dtype="bf16"), "fp16": dict(dtype="fp16"),
            "SYNTHETIC fp32 + N(0, 0.1²) logit noise": dict(dtype="fp32", logit_noise=0.1)}


def measure(model, prompts, temperature: float, **engine_kwargs) -> tuple[float, float]:
    engine = RolloutEngine(model, temperature=temperature, seed=1, **engine_kwargs)
    responses, rollout = engine.generate(prompts, 8)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    with torch.no_grad():
        train = sequence_log_probs(model, sequences, [prompts.shape[1]] * len(sequences), temperature)
    log_ratio = torch.cat(train) - torch.cat(rollout)
    return float(-log_ratio.mean()), float((log_ratio.exp() - log_ratio - 1).mean())


def main() -> None:
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16))
    warm_start(model, 30, 6, seed=0)
    prompts = task.make_prompts(4096, 6, torch.Generator().manual_seed(3))
    print("| engine | T | mis_kl | mis_kl·T² | k3 | k3·T² |")
    print("|---|---|---|---|---|---|")
    for name, kwargs in SETTINGS.items():
        for temperature in TEMPERATURES:
            kl, k3 = measure(model, prompts, temperature, **kwargs)
            t2 = temperature ** 2
            print(f"| {name} | {temperature} | {kl:.3e} | {kl * t2:.3e} | {k3:.3e} | {k3 * t2:.3e} |", flush=True)
    print("\nprediction for the synthetic row: Var(ε)/2 = 0.1²/2 = 5.0e-03 for mis_kl·T² and k3·T²")


if __name__ == "__main__":
    main()
