"""``miles-mis admit``: the model-admission check, from a series of dumps or (``miles_mis.lab.admit``) on the lab's
model.

    miles-mis admit DUMP_DIR [--calls-per-step N] [--threshold 0.015] [--json FILE]

reads any dump the analyzer reads (miles / slime, prime-rl's token export, NeMo RL's train data), groups its calls
into steps (the prime-rl and NeMo RL files name their steps; a miles dump numbers calls, so ``--calls-per-step``
says how many micro-batch calls one step has) and prints the per-step mismatch, its drift and the verdict
(``admission``), with where the mismatch lives over all steps (the analyzer's statistics) and what published
checks measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path
from typing import Any, Iterator

from . import published
from .admission import PRIME_RL_STEPS, PRIME_RL_THRESHOLD, Admission, admit, step_mismatch
from .reading import CallBatch
from .stacks import open_dump
from .statistics import StatisticsAccumulator

LOW_PROB = 0.1  # "low-probability tokens": the engine gave the sampled token less than this


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_dir", type=Path, help="a dump directory of any format `miles-mis analyze` reads")
    add_verdict_arguments(parser)
    parser.add_argument("--calls-per-step", type=int, default=None, metavar="N",
                        help="miles / slime dumps: policy-loss calls per training step (the micro-batches of one "
                             "step; the dump's ranks are one data-parallel group); step = call number // N. The other "
                             "formats name their steps (default: %(default)s = each call one step, said in the "
                             "output)")
    parser.add_argument("--allow-partial", action="store_true",
                        help="read an incomplete dump (missing ranks, a prime-rl step without STABLE) with a "
                             "warning (default: %(default)s)")


def add_verdict_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the dump form and the lab form share."""
    parser.add_argument("--threshold", type=float, default=PRIME_RL_THRESHOLD,
                        help="admitted when every step's token-mean k3 is below this (prime-rl's bar) "
                             "(default: %(default)s)")
    parser.add_argument("--required-steps", type=int, default=PRIME_RL_STEPS, metavar="N",
                        help="fewer measured steps than this are not admitted (prime-rl's table has 20) "
                             "(default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the steps, drift and verdict as JSON (default: %(default)s)")


def step_batches(opened, calls_per_step: int | None) -> Iterator[tuple[int, CallBatch]]:
    """(step, batch) for every call: the step the format records, or call position // calls_per_step."""
    if hasattr(opened.reader, "step_batches"):
        if calls_per_step is not None:
            raise ValueError(f"--calls-per-step: a {opened.format.name} names each call's step; drop the flag")
        yield from opened.reader.step_batches()
        return
    per_step = 1 if calls_per_step is None else calls_per_step
    if per_step < 1:
        raise ValueError(f"--calls-per-step must be an integer >= 1, got {per_step}")
    for batch in opened.reader.batches():  # a miles call batch holds one call; its number places it in time
        yield batch.calls[0] // per_step, batch


def check_dumps(directory: Path, threshold: float = PRIME_RL_THRESHOLD, calls_per_step: int | None = None,
                allow_partial: bool = False, required_steps: int = PRIME_RL_STEPS) -> dict[str, Any]:
    """The admission of one dump directory, and where its mismatch lives: a dict for ``render`` and ``--json``."""
    opened = open_dump(directory, allow_partial=allow_partial)
    steps, calls, seen = [], {}, set()
    accumulator = StatisticsAccumulator()  # where it lives, from the same single read of the dump
    for step, group in itertools.groupby(step_batches(opened, calls_per_step), key=lambda pair: pair[0]):
        if step in seen:  # every reader yields a step's calls together; a step met twice would be pooled wrongly
            raise ValueError(f"{directory}: step {step} appears in two places in the dump's order")
        seen.add(step)
        batches = [batch for _, batch in group]
        for batch in batches:
            accumulator.update(batch)
        calls[step] = len(batches)
        steps.append(step_mismatch(step, batches))
    result = admit(steps, threshold, required_steps)
    warnings = list(opened.reader.warnings)
    short = [step for step, count in calls.items() if calls_per_step and count < calls_per_step]
    if short:
        warnings.append(f"{len(short)} step(s) hold fewer than --calls-per-step {calls_per_step} calls (step "
                        f"{_steps(short)}): calls missing from the dump (--dump-interval, a cut run)")
    statistics = accumulator.result()
    return {"source": str(directory), "format": opened.format.as_dict(), "calls_per_step": calls_per_step,
            "warnings": warnings, **result.as_dict(), "where": where_it_lives(statistics),
            "published": published.admission_sentence(published.load())}


def where_it_lives(statistics: dict) -> dict[str, Any]:
    """The shares of all steps' k3 (Σ_t k3_t) carried by the responses' first tokens and by the tokens the engine
    gave less than LOW_PROB; None where there is no k3 at all."""
    total = statistics["k3"] * statistics["usable_tokens"] if statistics.get("k3") is not None else 0.0

    def share(rows) -> float | None:
        carried = sum(row["k3"] * row["tokens"] for row in rows if row["tokens"] and row["k3"] is not None)
        return carried / total if total > 0 else None

    first = [row for row in statistics["by_position"] if row["start"] == 0]
    low = [row for row in statistics["by_rollout_prob"] if row["high"] <= LOW_PROB]
    return {"k3_all_steps": statistics.get("k3"), "tokens": statistics["usable_tokens"],
            "first_token_share": share(first), "low_prob_share": share(low),
            "low_prob_token_fraction": sum(row["tokens"] for row in low) / max(statistics["usable_tokens"], 1)}


def render(report: dict[str, Any]) -> str:
    """The plain-text answer: the table of steps, the verdict, the drift, where it lives, the published checks."""
    lines = [f"Model admission: {report['source']} ({report['format']['name']}), {len(report['steps'])} steps; "
             f"admitted when every step's token-mean k3 < {report['threshold']:g} (prime-rl's rule)"]
    if report["format"]["name"].startswith("miles") and report.get("calls_per_step") is None:
        lines.append("  each call is taken as one step (pass --calls-per-step N when a step has N calls)")
    lines += [f"  warning: {warning}" for warning in report["warnings"]]
    lines.append("")
    lines.append(f"{'step':>6} {'seqs':>6} {'tokens':>8} {'non-finite':>10} {'k3 (tokens)':>12} {'k3 (seqs)':>10} "
                 f"{'k1':>10} {'max |l|':>8}")
    for step in report["steps"]:
        mark = "  <- at or above" if step["step"] in report["above"] else ""
        lines.append(f"{step['step']:>6} {step['sequences']:>6} {step['tokens']:>8} {step['nonfinite_tokens']:>10} "
                     f"{_num(step['k3']):>12} {_num(step['k3_sequence_mean']):>10} {_num(step['kl']):>10} "
                     f"{_num(step['max_abs_log_ratio'], '.3f'):>8}{mark}")
    lines += ["", verdict_line(report), drift_line(report)]
    where = report["where"]
    if where["first_token_share"] is not None:
        lines.append(f"Where it lives (all steps, k3 {_num(where['k3_all_steps'])}): first tokens carry "
                     f"{_pct(where['first_token_share'])} of the k3, tokens the engine gave < {LOW_PROB:g} "
                     f"({_pct(where['low_prob_token_fraction'])} of tokens) carry {_pct(where['low_prob_share'])}.")
    if report["format"]["lacks"]:
        lines.append("The format lacks: " + "; ".join(report["format"]["lacks"]) + ".")
    if report.get("published"):
        lines.append(report["published"])
    return "\n".join(lines)


def verdict_line(report: dict[str, Any]) -> str:
    measured = [s for s in report["steps"] if s["k3"] is not None]
    if report["admitted"]:
        worst = max(measured, key=lambda s: s["k3"])
        return (f"ADMITTED: all {len(measured)} steps below {report['threshold']:g} (largest k3 {_num(worst['k3'])} "
                f"at step {worst['step']}). This says what was measured on these steps, not that the mismatch is "
                "safe beyond them.")
    parts = []
    if len(report["steps"]) < report["required_steps"]:
        parts.append(f"only {len(report['steps'])} of the {report['required_steps']} required steps were measured "
                     "(--required-steps sets the count)")
    if report["nonfinite"]:
        parts.append(f"step{'s' if len(report['nonfinite']) > 1 else ''} {_steps(report['nonfinite'])} with NaN/inf "
                     "log-probs on trained tokens (an engine or trainer bug: prime-rl's mean would be NaN)")
    if report["above"]:
        parts.append(f"step{'s' if len(report['above']) > 1 else ''} {_steps(report['above'])} at or above "
                     f"{report['threshold']:g}")
    if report["empty"]:
        parts.append(f"step{'s' if len(report['empty']) > 1 else ''} {_steps(report['empty'])} without a usable "
                     "token")
    return "NOT ADMITTED: " + "; ".join(parts) + "."


def drift_line(report: dict[str, Any]) -> str:
    drift = report["drift"]
    if drift is None:
        return "Drift: fewer than 3 measured steps, no trend stated."
    trend = (f"Drift: k3 slope {drift['slope']:+.2e} per step [95 % CI {drift['slope_low']:+.2e}, "
             f"{drift['slope_high']:+.2e}]; last quarter {_num(drift['last_quarter_k3'])} against first quarter "
             f"{_num(drift['first_quarter_k3'])}")
    if drift["growing"]:
        return (trend + ": the mismatch GROWS over the steps, so a verdict on them does not hold for later ones. "
                "At learning rate 0 that is the engine or the trainer drifting by itself (open-instruct 1473 saw it "
                "on OLMo-3-7B, failing near step 550); above 0 the policy's own change is inside it too.")
    return trend + ": no growth the interval can tell from noise over these steps."


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


NOT_ADMITTED = 2  # the exit status of a check that ran and failed (1 is an error: the check did not run)


def check_json_path(path: Path | None) -> None:
    """Before the work: a ``--json`` file whose folder does not exist is one line, not a traceback at the end."""
    if path is not None and not path.parent.is_dir():
        raise ValueError(f"--json {path}: the folder {path.parent} does not exist")


def run(args: argparse.Namespace) -> int:
    check_json_path(args.json)
    report = check_dumps(args.dump_dir, args.threshold, args.calls_per_step, args.allow_partial, args.required_steps)
    print(render(report))
    if args.json is not None:
        write_json(args.json, report)
    return 0 if report["admitted"] else NOT_ADMITTED


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8]))
    return shown + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")


def _num(value: float | None, spec: str = ".2e") -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, spec)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


__all__ = ["NOT_ADMITTED", "Admission", "add_arguments", "add_verdict_arguments", "check_dumps", "check_json_path",
           "render", "run", "write_json"]
