"""Collectives and bytes per call under context parallelism: ours against gather-everything, in one run.

Real gloo process groups on this machine (torch.multiprocessing spawn), cp = 2 and 4, B = 256 responses
with lengths uniform in [T/4, T], T = 8192, prompts of 256 tokens, three configs (CONFIGS).

  ours      compute_mis_weights_with_cp: an all-gather of a fixed 3904-byte agreement header (errors, sizes,
            config fingerprint: docs/reliability.md), then one of a [B, 15] float64 table per rank, with the
            token-level rejections (bits or indices, whichever is smaller; nothing when there are none)
  baseline  what miles' example does before its per-sequence loop: for every sequence, each of the two
            log-prob tensors is zero-padded to the full response and all-reduced over the CP group
            (2·B collectives of O(tokens) bytes), then the full-sequence computation runs on every rank

Counts are of collective calls and of the bytes each rank hands to them (payload; a ring all-reduce
moves about 2·(C−1)/C of its payload per rank, an all-gather (C−1)/C of its output).

    python benchmarks/bench_cp.py [--num-seqs 256] [--max-len 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from miles_mis import MisConfig, compute_mis_weights_with_cp
from miles_mis.inputs import config_text
from miles_mis.parallel import distributed
from miles_mis.parallel.cp_layout import zigzag_layout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

sys.path.insert(0, str(ROOT / "benchmarks"))

from core_baselines import make_inputs  # noqa: E402 (benchmarks/ on sys.path above)
from cp_harness import cp_state, shard, spawn  # noqa: E402 (tests/ on sys.path above)

CONFIG = MisConfig(use_tis=True, use_rs=True, rs_veto_threshold=1e-4, tis_batch_normalize=True)
# (label, config): the default rejects at token level but, at this noise (sigma 0.05), almost never does; token
# MIS at [0.95, 1.05] rejects about a third of the tokens; geometric RS cannot reject a token alone
CONFIGS = (("default (token TIS+RS [0.5, 2], veto)", CONFIG),
           ("token MIS [0.95, 1.05] (rejects ~1/3 of tokens)",
            MisConfig(use_tis=True, tis_mode="mask", tis_lower_bound=0.95, tis_upper_bound=1.05)),
           ("geometric RS [0.999, 1.001] + token TIS (no token-level rejection)",
            MisConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.999, rs_upper_bound=1.001,
                      rs_veto_threshold=1e-4)))


class Counter:
    """Wraps the collectives both implementations use and counts calls and payload bytes."""

    NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.calls = 0
        self.bytes = 0
        self.originals = {}

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                original = getattr(dist, name)
                self.originals[name] = original

                def wrapped(*args, _original=original, _name=name, **kwargs):
                    tensor = args[1] if _name != "all_reduce" else args[0]
                    self.calls += 1
                    self.bytes += tensor.numel() * tensor.element_size()
                    return _original(*args, **kwargs)

                setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)


def gather_everything(kwargs, rank, size):
    """The baseline: rebuild every full response on every rank, 2 all-reduces per sequence."""
    totals = torch.tensor(kwargs["total_lengths"])
    responses = torch.tensor(kwargs["response_lengths"])
    layout = zigzag_layout(totals, responses, rank, size)
    full = {}
    for key in ("train_log_probs", "rollout_log_probs"):
        gathered = []
        for i, local in enumerate(kwargs[key]):
            buffer = torch.zeros(int(responses[i]))
            n0 = int(layout.len0[i])
            s0, s1 = int(layout.start0[i]), int(layout.start1[i])
            buffer[s0:s0 + n0] = local[:n0]
            buffer[s1:s1 + local.numel() - n0] = local[n0:]
            dist.all_reduce(buffer)
            gathered.append(buffer)
        full[key] = gathered
    return full


def worker(rank, size, num_seqs, max_len, results_path):
    full = dict(make_inputs(num_seqs, max_len, prompt_len=256), max_seq_lens=None)
    pg_loss = torch.ones(sum(full["response_lengths"]))
    kwargs, local_pg, _ = shard(full, pg_loss, rank, size, "thd")
    runs = {}
    calls = [(label, lambda args=SimpleNamespace(**config.to_dict(), qkv_format="thd"): compute_mis_weights_with_cp(
        args, pg_loss=local_pg, parallel_state=cp_state(rank, size), **kwargs)) for label, config in CONFIGS]
    for name, fn in calls + [("baseline", lambda: gather_everything(kwargs, rank, size))]:
        fn()
        with Counter() as counter:
            fn()
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        runs[name] = (counter.calls, counter.bytes, statistics.median(times) * 1e3)
    header_times = []  # the fail-together header alone, to show what it costs inside "ours"
    for _ in range(21):
        dist.barrier()
        start = time.perf_counter()
        distributed.agree(distributed.Group(rank, size, None), "cp", batch_size=num_seqs, width=15,
                          config_text=config_text(CONFIG, "thd"))
        header_times.append(time.perf_counter() - start)
    if rank == 0:
        tokens = sum(full["response_lengths"])
        lines = [f"cp={size} | tokens={tokens} | agreement header alone: "
                 f"{statistics.median(header_times) * 1e3:.2f} ms"]
        base = runs["baseline"]
        for name, (calls, nbytes, ms) in runs.items():
            line = f"  {name}: {calls} collectives, {nbytes:,} bytes ({nbytes / 1e6:.3f} MB), {ms:.1f} ms"
            if name != "baseline":
                line += (f" | baseline/ours: collectives {base[0] / calls:.0f}x, bytes {base[1] / nbytes:.0f}x, "
                         f"time {base[2] / ms:.1f}x")
            lines.append(line)
        Path(results_path).write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=8192)
    args = parser.parse_args()
    print(f"B={args.num_seqs}, response lengths uniform in [{args.max_len // 4}, {args.max_len}], gloo on "
          f"{torch.get_num_threads()}-thread CPU; per call, per rank")
    import tempfile

    for size in (2, 4):
        with tempfile.NamedTemporaryFile(suffix=".txt") as out:
            spawn(worker, size, args.num_seqs, args.max_len, out.name, timeout=900)
            print(Path(out.name).read_text())


if __name__ == "__main__":
    main()
