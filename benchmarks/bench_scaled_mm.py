"""vLLM's fp8 GEMM on this CPU: ``torch._scaled_mm`` against a float32 matmul and the lab's emulation.

Each shape M x K x N is the product vLLM's fp8_per_channel kernel on a CPU (ChannelWiseTorchFP8ScaledMMLinearKernel)
hands to ``torch._scaled_mm``: e4m3 activations A [M, K] (row-major), the e4m3 weight stored [N, K] and passed
transposed (B = W.t(), [K, N] column-major), unit scales, a float32 output. Timed, interleaved:

  scaled_mm   torch._scaled_mm(A, B, scale_a=1, scale_b=1, out_dtype=float32): this torch build's CPU fp8 GEMM
              (oneDNN's where the CPU has AMX, torch's own float32 emulation elsewhere)
  float32     torch.mm on the same operands already in float32: the unquantised layer's GEMM
  emulation   miles_mis.lab.fp8_gemm.scaled_mm, what the lab's vLLM engine runs instead (upcast both operands to
              float32, torch.mm, scale, cast): the upcast is timed with it
  upcast      B.float() alone: the part of the emulation that converts the e4m3 weight to float32

Median milliseconds over the repeats of each (at least 3; fewer than --repeats when one call is slower than
--budget seconds / --repeats), and the ratios to float32. The largest |emulation − scaled_mm| is printed too.
Default shapes: SmolLM2-135M's MLP (576 -> 1536 -> 576) and attention output at 64 tokens, and the lab's tiny
model's MLP and qkv (d_model 64) at a batch of 128 tokens.

    python benchmarks/bench_scaled_mm.py [--shapes 64x576x1536 ...] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from miles_mis.lab.fp8_gemm import scaled_mm

SHAPES = ("64x576x1536", "64x1536x576", "64x576x576", "128x64x256", "128x256x64", "128x64x192")


def cpu_model() -> str:
    """lscpu's model name (or /proc/cpuinfo's where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = open("/proc/cpuinfo").read().replace("model name", "Model name")
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def cpu_flags() -> str:
    """The CPU flags that decide the fp8 GEMM's path: AMX (oneDNN in torch._scaled_mm), AVX-512, AVX2."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "avx512f", "avx512_bf16", "avx2")
    return " ".join(flag for flag in wanted if flag in flags) or "none of " + ", ".join(wanted)


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 A [M, K] and B = W.t() with W [N, K], from normal values scaled into e4m3's range (per-token and
    per-channel scaling leave values of this size)."""
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=generator) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=generator) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return a, w.t()


def time_shape(m: int, k: int, n: int, repeats: int, budget: float) -> dict[str, float]:
    a, b = operands(m, k, n)
    one = torch.ones(1)
    a32, b32 = a.float(), b.float()
    calls = {"scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32),
             "float32": lambda: torch.mm(a32, b32),
             "emulation": lambda: scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32),
             "upcast": lambda: b.float()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    outputs = {name: call() for name, call in calls.items()}  # one warm-up call each
    started = time.perf_counter()
    while True:
        for name, call in calls.items():
            begin = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - begin)
        done = len(times["float32"])
        if done >= repeats or (done >= 3 and time.perf_counter() - started > budget):
            break
    row = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    row["repeats"] = done
    row["max_diff"] = float((outputs["emulation"] - outputs["scaled_mm"]).abs().max())
    assert torch.equal(outputs["upcast"], b32)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="M x K x N products to time")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each kind per shape (at most)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds per shape after which no more repeats start (at least 3 are timed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs; flags: {cpu_flags()})")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, mkldnn enabled: "
          f"{torch.backends.mkldnn.enabled}; load average at start: "
          + " ".join(f"{load:.2f}" for load in os.getloadavg()))
    print(f"{'M x K x N':>14} {'scaled_mm ms':>13} {'float32 ms':>11} {'emulation ms':>13} {'scaled_mm/f32':>14} "
          f"{'emulation/f32':>14} {'upcast ms':>10} {'repeats':>8} {'max |emu-smm|':>14}")
    for shape in args.shapes:
        m, k, n = (int(size) for size in shape.lower().split("x"))
        row = time_shape(m, k, n, args.repeats, args.budget)
        print(f"{shape:>14} {row['scaled_mm']:>13.3f} {row['float32']:>11.3f} {row['emulation']:>13.3f} "
              f"{row['scaled_mm'] / row['float32']:>14.2f} {row['emulation'] / row['float32']:>14.2f} "
              f"{row['upcast']:>10.3f} {row['repeats']:>8} {row['max_diff']:>14.3g}")
    print("load average at end: " + " ".join(f"{load:.2f}" for load in os.getloadavg()))


if __name__ == "__main__":
    main()
