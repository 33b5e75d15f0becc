"""Published production outcomes at a given mismatch: the rows the analyzer weighs beside the lab's measurements.

``published_outcomes.json`` (beside this module) holds runs from papers, blogs, PRs and issues, each row written from
its source (``url``): the model, its mismatch as published (``mismatch_metric``/``mismatch_value``) and as k3 only where
the source's own formula is k3 or a stated conversion gives it (``k3_equivalent``, a number or [low, high];
``k3_note`` says which), the horizon, the outcome (collapsed, degraded, stable, improved; ``outcome_step``) and which
corrections held or failed. "When Speed Kills Stability"'s vllm-kl and prime-rl's mismatch_kl are computed as
e^d − d − 1 per token, which is k3; miles' train_rollout_kl is the same per token, averaged per sample first.

Rows that bear on one question carry ``topics`` (``TOPICS``): ``with_topic`` finds them and ``cite`` words them as the
advice cites them (``describe``'s few words, then the row's one-sentence ``quote``):

- ``score_centering``: runs with score centering (``sc_metrics``);
- ``staleness``: runs on rollouts a version lag old (``staleness_sentence``);
- ``sequence_weight``: a sequence-level weight exp(Σ l) on long responses (``sequence_weight_sentence``, for a dump
  where most sequences' product ratio leaves [0.5, 2]);
- ``lr0_drift``: a mismatch that grew with the weights fixed (learning rate 0); ``sentence`` ends with them, since a
  dump's k3 is one reading and not a bound on later steps;
- ``admission``: a new model's mismatch checked before RL (``admission_sentence``).

A level its source states in another metric (``mismatch_metric``/``mismatch_value`` without ``k3_equivalent``: a tail
ratio, a mean |l|, a rollout age) is said as that metric, "no k3 stated", and never enters the k3 comparison. A row
whose outcome is ``measured`` reports a level with no training outcome (a check at learning rate 0, one logged step).

The lab measures a 135M model on short responses over tens of steps; these runs are production models over hundreds
to thousands of steps, so the analyzer never calls a level safe where one of them went wrong at or below it, or at a
level its source does not state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

OUTCOMES = Path(__file__).with_name("published_outcomes.json")
WENT_WRONG = ("collapsed",)  # a degraded row is a correction's cost (a too-tight mask), not the mismatch's
CORRECTION_WORDS = ("TIS", "MIS", "masking", "sequence-level")  # the weight corrections among a row's remedies
OUTCOME_VALUES = ("collapsed", "degraded", "stable", "improved", "measured")  # measured: a level, no training outcome
TOPICS = ("score_centering", "staleness", "sequence_weight", "lr0_drift", "admission")
PRODUCT_OUTSIDE_SHARE = 0.5  # cite the sequence_weight rows when at least this share of sequences' ∏ρ leaves [0.5, 2]


def load(path: Path | None = None) -> list[dict]:
    """The shipped rows (an empty list without the file)."""
    path = OUTCOMES if path is None else Path(path)
    if not path.exists():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def k3_range(row: Mapping[str, Any]) -> tuple[float, float] | None:
    """A row's k3 as (low, high) (a single value twice); None where its source states none."""
    value = row.get("k3_equivalent")
    if value is None:
        return None
    low, high = (value, value) if isinstance(value, (int, float)) else value
    return float(low), float(high)


def went_wrong_at_or_below(k3: float, rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows that collapsed at a stated k3 whose low end is at or below ``k3``, nearest level first."""
    hits = [row for row in rows if row.get("outcome") in WENT_WRONG and (k3_range(row) or (float("inf"),))[0] <= k3]
    return sorted(hits, key=lambda row: -k3_range(row)[0])


def went_wrong_unstated(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs that collapsed at a level their source does not state numerically (one per model and source)."""
    out, seen = [], set()
    for row in rows:
        key = (str(row.get("model", "")).split(" (")[0], row.get("source"))
        if row.get("outcome") in WENT_WRONG and k3_range(row) is None and key not in seen:
            seen.add(key)
            out.append(row)
    return out


def held_corrections(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """(correction, row) of every weight correction (TIS, MIS, a sequence mask) a row reports as having held or been
    best, one per source: what a user can switch on (not a hardware change or a "did no harm")."""
    out, sources = [], set()
    for row in rows:
        for correction in row.get("corrections", []):
            result, name = str(correction.get("result", "")), correction["name"]
            if (result.startswith(("held", "best")) and "no harm" not in result
                    and any(word in name for word in CORRECTION_WORDS) and row.get("source") not in sources):
                sources.add(row.get("source"))
                out.append((name, row))
    return out


def describe(row: Mapping[str, Any]) -> str:
    """One row in a few words: model, level, what happened and when, and its source."""
    level = k3_range(row)
    stated = _stated_level(row)
    if level is None and stated is not None:
        at = f"at {row['mismatch_metric']} {stated}, no k3 stated"
    elif level is None:
        at = "at a level its source gives only in figures" if row.get("mismatch_metric") else "at an unstated level"
    else:
        metric = row.get("mismatch_metric") or "k3"
        at = f"at {metric} {_span(level)}" + ("" if metric == "k3" else " (= k3)")
    step = row.get("outcome_step") or row.get("steps")
    if step and row.get("outcome") in (*WENT_WRONG, "degraded"):
        when = f" by step {step}"
    else:
        when = f" over {row['steps']} steps" if row.get("steps") else ""
    model = str(row.get("model", "")).split(" (")[0]
    return f"{model} {row['outcome']}{when} {at} ({_short_source(row)})"


def sentence(k3: float, rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Where ``k3`` lies against the published outcomes, in one or two sentences; None without rows."""
    if not rows:
        return None
    below = went_wrong_at_or_below(k3, rows)
    unstated = went_wrong_unstated(rows)
    parts = []
    if below:
        parts.append("Published runs went wrong at or below this level: "
                     + "; ".join(describe(row) for row in below[:3]) + ".")
    else:
        lowest = min((row for row in rows if row.get("outcome") in WENT_WRONG and k3_range(row) is not None),
                     key=lambda row: k3_range(row)[0], default=None)
        if lowest is not None:
            parts.append(f"The lowest published level where a run went wrong is above this one: {describe(lowest)}.")
    if unstated:
        parts.append("Others collapsed at levels their sources do not state: "
                     + "; ".join(describe(row) for row in unstated[:2]) + ".")
    held = held_corrections(rows)
    if held:
        parts.append("Corrections that held in published runs: " + "; ".join(
            f"{name} ({str(row.get('model', '')).split(' (')[0]}, {_short_source(row)})"
            for name, row in held[:3]) + ".")
    drift = drift_sentence(rows)
    if drift:
        parts.append(drift)
    return " ".join(parts) or None


def with_topic(topic: str, rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows tagged with ``topic`` (their ``topics`` list; one of ``TOPICS``), in file order."""
    if topic not in TOPICS:
        raise ValueError(f"topic must be one of {', '.join(TOPICS)}; got {topic!r}")
    return [row for row in rows if topic in (row.get("topics") or ())]


def cite(row: Mapping[str, Any]) -> str:
    """A row as the advice cites it: ``describe``'s few words, then the row's one-sentence summary of its source."""
    quote = str(row.get("quote") or "").strip()
    return f"{describe(row)}: {quote[:1].lower() + quote[1:]}" if quote else describe(row)


def staleness_sentence(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """What published runs at a version lag found, citing the ``staleness`` rows; None without any."""
    tagged = with_topic("staleness", rows)
    if not tagged:
        return None
    return "Published runs with stale rollouts: " + _cited(tagged) + "."


def drift_sentence(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The ``lr0_drift`` rows: a mismatch read once bounds no later step, since it grew in a published run whose
    weights were fixed; None without any."""
    tagged = with_topic("lr0_drift", rows)
    if not tagged:
        return None
    return ("One reading is not a bound on later steps; the mismatch grew with the weights fixed: "
            + _cited(tagged) + ".")


def sequence_weight_sentence(statistics: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str | None:
    """For a dump where a sequence-level weight ∏ρ = exp(Σ l) is set by length more than by mismatch, the published
    ``sequence_weight`` rows; None otherwise (or without rows, or without the dump's share).

    The trigger is ``seq_product_outside_half_two_fraction`` (the share of sequences whose ∏ρ leaves [0.5, 2]) at or
    above PRODUCT_OUTSIDE_SHARE: with small per-token log-ratios summed over long responses, most products leave the
    band, and a weight built on exp(Σ l) rescales whole sequences, where a token or sequence-mean weight exp(mean l)
    stays near 1."""
    share = statistics.get("seq_product_outside_half_two_fraction")
    tagged = with_topic("sequence_weight", rows)
    if share is None or not tagged:
        return None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"seq_product_outside_half_two_fraction must be a number in [0, 1], got {share!r}")
    if float(share) < PRODUCT_OUTSIDE_SHARE:
        return None
    length = statistics.get("mean_response_length")
    mean = f", mean response {float(length):,.0f} tokens" if isinstance(length, (int, float)) and length > 0 else ""
    return (f"{float(share):.0%} of the sequences' product ratio ∏ρ = exp(Σ l) leaves [0.5, 2] here{mean}: a "
            "sequence-level weight on exp(Σ l) rescales whole sequences by their length; a token-level weight or the "
            "sequence mean exp(mean l) (geometric level) does not. Published: " + _cited(tagged) + ".")


def admission_sentence(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """What published new-model checks measured (the ``admission`` rows), then the ``lr0_drift`` rows that a short
    check at learning rate 0 would not have seen; None without admission rows."""
    tagged = with_topic("admission", rows)
    if not tagged:
        return None
    text = "Published new-model checks: " + _cited(tagged) + "."
    drift = with_topic("lr0_drift", rows)
    if drift:
        text += " A short check can pass and the mismatch still grow later: " + _cited(drift) + "."
    return text


def _stated_level(row: Mapping[str, Any]) -> str | None:
    """A non-k3 level its source states (``mismatch_value`` under ``mismatch_metric``), as text; None without one."""
    value = row.get("mismatch_value")
    if not row.get("mismatch_metric") or value is None or isinstance(value, bool):
        return None
    low, high = (value, value) if isinstance(value, (int, float)) else value
    return f"{float(low):.3g}" if low == high else f"{float(low):.3g}–{float(high):.3g}"


def _cited(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as the advice cites them, one after another (no closing full stop)."""
    return "; ".join(cite(row).rstrip(".") for row in rows)


def _span(level: tuple[float, float]) -> str:
    low, high = level
    return f"{low:.1e}" if low == high else f"{low:.1e}–{high:.1e}"


def _short_source(row: Mapping[str, Any]) -> str:
    """The source's short title (before a colon, a slash or a parenthesis) and its date."""
    title = str(row.get("source", "")).split(":")[0].split(" / ")[0].split(" (")[0].strip()
    return title + (f", {row['date']}" if row.get("date") else "")
