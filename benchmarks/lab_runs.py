"""What every lab benchmark shares about its runs: the machine a row was measured on, one ``miles-mis train`` run in
a child process, pairing runs by machine or by first rollout, and the results files (one JSON line per finished run,
appended as it ends so an interrupted study resumes where it stopped).

Seeds pair within a group only: the same seed's first rollout differs between some VMs (vLLM-CPU's kernels follow the
CPU), so ``one_machine_per_seed`` keeps, per seed, the group holding most of its cells, and ``left_here`` says which
cells this machine still runs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path


def machine() -> str:
    """The CPU model, its cores and this boot's id: timings compare rows of one machine (one boot) only, since VMs of
    one type differ (the same run took 28 s a step on one and 9 s on another)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{model}, {os.cpu_count()} cores, boot {boot.read_text()[:8] if boot.exists() else 'unknown'}"


def train_child(argv: list[str], run_dir: Path) -> tuple[list[dict], float, float | None]:
    """One ``miles-mis train`` run in a child process (its own memory, measured), resumed from ``run_dir``'s checkpoint
    when there is one: (the per-step metrics, wall seconds, the child's peak RSS in MiB, None when an earlier child of
    this process peaked higher: getrusage keeps the largest)."""
    import resource
    import subprocess

    if (run_dir / "checkpoint.pt").exists():
        argv = [*argv, "--resume"]
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, "-m", "miles_mis.cli", "train", *argv, "--out-dir", str(run_dir), "--quiet"],
                   check=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return history, time.perf_counter() - started, peak / 1024 if peak > before else None


UNRECORDED = "earlier machine (not recorded)"  # rows written before rows named their machine


def machine_of(row: dict) -> str:
    return row.get("machine", UNRECORDED)


def _key(row: dict, fields: tuple[str, ...]) -> tuple:
    return tuple(row[f] for f in fields)


def by_machine(rows: list[dict], seed_fields: tuple[str, ...], cell_fields: tuple[str, ...],
               group_of=machine_of) -> dict[tuple, dict]:
    """(seed key..., group) -> {cell key: row}: each seed's cells, per pairing group (by default the machine that ran
    them; ``group_of`` = ``first_rollout`` groups by the first rollout itself)."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        groups.setdefault((*_key(row, seed_fields), group_of(row)), {})[_key(row, cell_fields)] = row
    return groups


def first_rollout(row: dict) -> str:
    """A row's pairing group: its first step's reward and raw k3 at full precision, a fingerprint of the first rollout
    (the sampled tokens and the engine's log-probs of 32 responses), which every algorithm of a seed shares when the
    machine's kernels give the same numbers; the machine when the row records neither."""
    reward, k3 = (row.get("reward") or [None])[0], (row.get("raw_k3") or [None])[0]
    return machine_of(row) if reward is None or k3 is None else f"first rollout {reward!r} / {k3!r}"


def one_machine_per_seed(rows: list[dict], seed_fields: tuple[str, ...], cell_fields: tuple[str, ...],
                         group_of=machine_of) -> list[dict]:
    """The rows that pair: per seed, the cells of one group (``by_machine``), the one holding most of that seed's cells
    (the whole set when one does). Seeds pair within a group only: the same seed's first rollout differs between some
    VMs (vLLM-CPU's kernels follow the CPU), so a cell with another first rollout is not the same experiment."""
    chosen: dict[tuple, dict] = {}
    for key, group in by_machine(rows, seed_fields, cell_fields, group_of).items():
        if len(group) > len(chosen.get(key[:-1], {})):
            chosen[key[:-1]] = group
    return [row for group in chosen.values() for row in group.values()]


def left_here(cells: list[dict], rows: list[dict], seed_fields: tuple[str, ...], cell_fields: tuple[str, ...],
              here: str, group_of=machine_of) -> list[dict]:
    """The cells this machine still runs: those of every seed no group holds whole, but for the ones this machine's
    group of that seed holds. Grouped by machine, that group is this machine's rows (a seed split across machines runs
    again here, whole). Grouped by the first rollout, it is the group of the last row this machine ran of that seed,
    else the largest group (assumed: a machine that reproduces another's first rollout continues its seed; its first
    run tells, and a run with another first rollout starts a group of its own, whose seed then runs whole)."""
    wanted: dict[tuple, set] = {}
    for cell in cells:
        wanted.setdefault(_key(cell, seed_fields), set()).add(_key(cell, cell_fields))
    groups = by_machine(rows, seed_fields, cell_fields, group_of)
    # whole = one group holds every wanted cell of the seed (not merely as many rows: a subset asked for, e.g. one
    # new algorithm, is not done because the seed's group holds others)
    complete = {key[:-1] for key, group in groups.items() if wanted.get(key[:-1], set()) <= group.keys()}
    mine: dict[tuple, object] = {}
    for seed in wanted:
        ran_here = [r for r in rows if _key(r, seed_fields) == seed and machine_of(r) == here]
        # a group another machine can join: one named by something other than the machine of its rows
        portable = {key[-1]: len(group) for key, group in groups.items()
                    if key[:-1] == seed and any(group_of(r) != machine_of(r) for r in group.values())}
        mine[seed] = (group_of(ran_here[-1]) if ran_here else max(portable, key=portable.get) if portable else here)
    done = {(*key[:-1], *cell) for key, group in groups.items() if key[-1] == mine.get(key[:-1]) for cell in group}
    return [c for c in cells if _key(c, seed_fields) not in complete and _key(c, seed_fields + cell_fields) not in done]


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_result(results: Path, row: dict) -> None:
    """One finished item's row appended to a results file (one JSON line each; read back by ``read_results``)."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as out:
        out.write(json.dumps(row) + "\n")


def append_as_they_finish(futures, results: Path, describe, started: float) -> None:
    """Each finished run's row appended to ``results`` as it ends (an interrupted sweep keeps what it finished),
    with a progress line ``[done/total] describe(row) (seconds; minutes left)``; ``started``: the sweep's start."""
    for count, future in enumerate(concurrent.futures.as_completed(futures), 1):
        row = future.result()
        append_result(results, row)
        elapsed = time.perf_counter() - started
        print(f"[{count}/{len(futures)}] {describe(row)} ({row['seconds']:.0f} s; "
              f"{elapsed / count * (len(futures) - count) / 60:.0f} min left)", file=sys.stderr, flush=True)


__all__ = ["UNRECORDED", "append_as_they_finish", "append_result", "by_machine", "first_rollout", "left_here",
           "machine", "machine_of", "one_machine_per_seed", "read_results", "train_child"]
