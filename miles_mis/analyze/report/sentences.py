"""The analyze report's sentences about a statistics dict, shared by the Markdown report, report.json, the stdout
summary and the comparison of two dumps: the size line, the warnings, k3 against published ranges (context, not a
verdict), the trend of k3 over calls, and what the version lags say (staleness or numerics)."""

from __future__ import annotations

from typing import Any, Mapping

from .figures import finite_number as _finite
from .formatting import fmt

GROWS, SHRINKS = 1.25, 0.8  # second half / first half beyond these: k3 grows / shrinks over calls


def size_line(statistics: Mapping[str, Any]) -> str:
    """'F dump files, C calls, S sequences, T valid tokens (U usable).' then what π_old, π_rollout and l are."""
    return (f"{fmt(statistics.get('files'))} dump files, {fmt(statistics.get('calls'))} calls, "
            f"{fmt(statistics.get('sequences'))} sequences, {fmt(statistics.get('tokens'))} valid tokens "
            f"({fmt(statistics.get('usable_tokens'))} usable). {format_sentence(statistics)}π_old is the trainer's "
            "log-prob, π_rollout the engine's; l = log π_old − log π_rollout = log ρ.")


def format_sentence(statistics: Mapping[str, Any]) -> str:
    """For a dump of another stack: which format was read, what a call is in it and what it lacks ('' for a miles
    dump, whose layout the whole report assumes)."""
    fmt_ = statistics.get("dump_format") or {}
    if not fmt_ or fmt_.get("name", "").startswith("miles"):
        return ""
    lacks = f" It lacks {'; '.join(fmt_['lacks'])}." if fmt_.get("lacks") else ""
    return f"Read as a {fmt_['name']} ({fmt_['files']}; schema: {fmt_['schema']}); a call is {fmt_['call']}.{lacks} "


def warning_lines(statistics: Mapping[str, Any]) -> list[str]:
    """The statistics' warnings and a non-finite log-prob share, as Markdown bullets (then an empty line)."""
    warnings = list(statistics.get("warnings") or [])
    nonfinite = _finite(statistics.get("nonfinite_fraction"))
    if nonfinite:
        warnings.append(f"{fmt(nonfinite)} of the valid tokens have NaN/inf log-probs (engine "
                        f"{fmt(statistics.get('nonfinite_engine_fraction'))}, trainer "
                        f"{fmt(statistics.get('nonfinite_trainer_fraction'))}): an engine or trainer bug to fix")
    return [f"- **Warning:** {warning}" for warning in warnings] + ([""] if warnings else [])


def k3_context(statistics: Mapping[str, Any]) -> str:
    """The measured k3 against published ranges: context, not a verdict."""
    k3 = _finite(statistics.get("k3"))
    if k3 is None:
        return "No usable token: k3 cannot be placed against published ranges."
    if k3 < 1e-5:
        where = "below the range published for dense models (1e-5 to 1e-3)"
    elif k3 <= 1e-3:
        where = "within the range published for dense models (1e-5 to 1e-3), below that for MoE models (1e-3 to 1e-1)"
    elif k3 <= 1e-1:
        where = "above the range published for dense models (1e-5 to 1e-3), within that for MoE models (1e-3 to 1e-1)"
    else:
        where = "above the ranges published for dense (1e-5 to 1e-3) and MoE models (1e-3 to 1e-1)"
    return (f"For context: the measured token k3 = {fmt(k3)} is {where}. In one published 30B MoE run, training "
            "collapsed at about step 320 after k3 had risen; how k3 moves over training (see Over calls) says more "
            "than its level. These ranges are context, not a verdict on this run.")


def trend_sentence(statistics: Mapping[str, Any]) -> str:
    """'k3 grows/shrinks/is flat over calls: slope …, second half / first half = …' (or why there is no trend)."""
    trend = statistics.get("trend") or {}
    slope, growth = _finite(trend.get("k3_slope_per_call")), _finite(trend.get("growth"))
    calls = len(statistics.get("by_call") or [])
    if slope is None and growth is None:
        return f"k3 over calls: no trend, it needs per-call k3 on at least 2 calls (this dump has {calls})."
    direction = _direction(growth, slope, statistics)
    return (f"k3 {direction} over calls: slope {fmt(slope)} per call, second half / first half = {fmt(growth)} "
            f"(first half {fmt(trend.get('k3_first_half'))}, second half {fmt(trend.get('k3_second_half'))}, "
            f"{calls} calls).")


def _direction(growth: float | None, slope: float | None, statistics: Mapping[str, Any]) -> str:
    if growth is None:  # first half k3 = 0: judge the slope over the calls against the whole-dump k3
        calls = [row.get("call") for row in statistics.get("by_call") or [] if _finite(row.get("call")) is not None]
        k3 = _finite(statistics.get("k3"))
        span = (max(calls) - min(calls)) if calls else 0
        growth = 1 + slope * span / k3 if k3 else 1 + (slope > 0) - (slope < 0)
    return "grows" if growth > GROWS else "shrinks" if growth < SHRINKS else "is flat"


def attribution_sentence(attribution: Mapping[str, Any] | None) -> str:
    """Staleness or numerics: what the lag buckets say (statistics.lag_attribution)."""
    if not attribution:
        return "The dump records no lags."
    stale = attribution.get("stale_buckets") or []
    numerics = _finite(attribution.get("numerics_k3"))
    if not stale:
        return (f"Every sequence is at lag 0: the measured k3 ({fmt(numerics)}) is the engine's numerics, with no "
                "staleness in it.")
    if numerics is None:
        return ("No sequence is at lag 0, so staleness and the engine's numerics cannot be told apart here: compare "
                "with the dump of a synchronous run (or of lag-0 samples) of the same engine.")
    parts = [f"lag {row['bucket']}: k3 {fmt(row['k3'])}, {fmt(100 * (row['staleness_share'] or 0.0))} % of it "
             "staleness" for row in stale]
    most = max((row["staleness_share"] or 0.0) for row in stale)
    verdict = ("most of the mismatch of stale samples is staleness: fix the schedule (fewer versions of lag, "
               "`rs_max_lag`, `tis_upper_bound_by_lag`) before the engine" if most > 0.5 else
               "stale samples are about as mismatched as fresh ones: the engine's numerics dominate, fix or correct "
               "them first")
    return (f"Lag-0 sequences carry no staleness: their k3 = {fmt(numerics)} is the engine's numerics. Over it "
            f"({'; '.join(parts)}): {verdict}. (This assumes the numerics do not depend on the lag.)")
