"""report.json's content (``to_json``): everything the Markdown report shows, machine-readable, with no NaN or inf
anywhere (None, NaN and inf are null, so ``json.dumps(..., allow_nan=False)`` always succeeds on it)."""

from __future__ import annotations

from typing import Any, Mapping

from .. import safe_level as _safe_level
from .configs import config_dict, recommendation_name
from .formatting import jsonable
from .markdown import staleness_evidence
from .sentences import k3_context, trend_sentence

REQUIRED_JSON = ("files", "sequences", "tokens", "nonfinite_fraction", "k3", "by_position", "by_rollout_prob",
                 "by_length", "by_call")


def to_json(statistics: Mapping[str, Any], results: Mapping[str, Any] | None, recommendation: Any,
            score_centering: Mapping[str, Any] | None = None) -> dict:
    """Everything the Markdown shows, machine-readable; no NaN/inf anywhere. ``score_centering``: the metrics file's
    summary (``sc_metrics.summarize``), null when no metrics file was read."""
    out = jsonable(dict(statistics))
    for key in REQUIRED_JSON:
        out.setdefault(key, [] if key.startswith("by_") else None)
    out["k3_context"] = k3_context(statistics)
    out["trend_sentence"] = trend_sentence(statistics)
    out["safe_level"] = _safe_level.for_dump(statistics, _safe_level.load())
    out["staleness_evidence"] = staleness_evidence(statistics)
    out["score_centering"] = jsonable(dict(score_centering)) if score_centering else None
    out["candidates"] = jsonable(dict(results or {}))
    out["recommendation"] = _recommendation_json(recommendation)
    return out


def _recommendation_json(recommendation: Any) -> dict:
    config = getattr(recommendation, "config", None) if recommendation is not None else None
    return {"name": recommendation_name(recommendation), "config": jsonable(config_dict(config)) if config else None,
            "reasons": [str(r) for r in getattr(recommendation, "reasons", None) or []]}
