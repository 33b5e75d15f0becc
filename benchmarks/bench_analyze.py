"""Streaming analyzer on a large dump: peak memory stays bounded, throughput in tokens/s.

Generates a dump of about ``--gb`` GB in miles' layout (DIR/policy_loss_debug/rank_<r>_call_<c>.pt, cp 2,
every field miles writes), then runs ``miles-mis analyze`` on it in a fresh process (its own peak RSS, read
from /proc/self/status VmHWM at the end) and prints the time of each pass, tokens/s and the peak RSS next to
the dump's size.

    python benchmarks/bench_analyze.py [--gb 2.0] [--dir /tmp/mis_bench_dump] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cp_harness import local_positions  # noqa: E402

SEQS_PER_CALL, LENGTH, CP = 64, 4096, 2


def generate(directory: Path, gigabytes: float) -> tuple[int, int]:
    """Write calls until the dump holds about ``gigabytes``; returns (files, tokens)."""
    out = directory / "policy_loss_debug"
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    positions = [torch.tensor(local_positions(LENGTH + 100, LENGTH, rank, CP, LENGTH + 100)) for rank in range(CP)]
    written = files = tokens = call = 0
    started = time.perf_counter()
    while written < gigabytes * 1e9:
        old = -torch.rand(SEQS_PER_CALL, LENGTH, generator=gen) * 4
        noise = 0.02 * (1 + call / 50)  # the mismatch grows over calls
        rollout = old + noise * torch.randn(SEQS_PER_CALL, LENGTH, generator=gen)
        advantages = torch.randn(SEQS_PER_CALL, 1, generator=gen).expand(-1, LENGTH)
        for rank in range(CP):
            pos = positions[rank]
            samples = [{"index": i, "total_length": LENGTH + 100, "response_length": LENGTH,
                        "train_log_probs": old[i, pos].clone(), "old_log_probs": old[i, pos].clone(),
                        "advantages": advantages[i, pos].clone(), "local_loss_mask": torch.ones(pos.numel()),
                        "rollout_log_probs": rollout[i, pos].clone(),
                        "train_rollout_abs_diff": (old[i, pos] - rollout[i, pos]).abs()}
                       for i in range(SEQS_PER_CALL)]
            path = out / f"rank_{rank}_call_{call}.pt"
            torch.save({"rank": rank, "call": call, "samples": samples, "ppo_kl": torch.zeros(1),
                        "pg_loss": torch.zeros(1), "finite": {}}, path)
            written += path.stat().st_size
            files += 1
        tokens += SEQS_PER_CALL * LENGTH
        call += 1
        print(f"\rgenerating: {written / 1e9:.2f} / {gigabytes:.2f} GB, {files} files, "
              f"{time.perf_counter() - started:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return files, tokens


_CHILD = """
import json, sys, time
from miles_mis.analyze import analyze
started = time.perf_counter()
result = analyze(sys.argv[1], timings=True)
elapsed = time.perf_counter() - started
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": elapsed, "peak_rss_mb": peak / 1024, "timings": result.timings,
                  "tokens": result.statistics["tokens"], "recommendation": result.recommendation.name}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="dump size to generate, in GB (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mis_bench_dump"),
                        help="where to write it (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the dump afterwards (and reuse an existing one)")
    args = parser.parse_args()
    existing = args.keep and (args.dir / "policy_loss_debug").is_dir()
    if not existing:
        shutil.rmtree(args.dir, ignore_errors=True)
        files, tokens = generate(args.dir, args.gb)
    size = sum(p.stat().st_size for p in (args.dir / "policy_loss_debug").iterdir())
    files = len(list((args.dir / "policy_loss_debug").iterdir()))
    run = subprocess.run([sys.executable, "-c", _CHILD, str(args.dir)], capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"dump: {size / 1e9:.2f} GB, {files} files, {result['tokens']:,} tokens (cp {CP}, {SEQS_PER_CALL} x "
          f"{LENGTH} per call)")
    for name, seconds in result["timings"].items():
        print(f"  {name}: {seconds:.1f} s, {result['tokens'] / seconds / 1e6:.2f} M tokens/s")
    print(f"  total: {result['seconds']:.1f} s, {result['tokens'] / result['seconds'] / 1e6:.2f} M tokens/s; "
          f"peak RSS {result['peak_rss_mb']:.0f} MB = {result['peak_rss_mb'] * 1e6 / size:.3f} x the dump size; "
          f"recommendation: {result['recommendation']}")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
