"""A config and the advisor's recommendation as the analyze report writes them: a config in one line
(``describe_config``) and as YAML (``config_yaml``), a config object or dict as a dict (``config_dict``), and the name
of a recommendation that may be None (``recommendation_name``)."""

from __future__ import annotations

from typing import Any, Mapping

from .formatting import fmt, jsonable


def describe_config(config: Mapping[str, Any]) -> str:
    """A one-line summary of a MisConfig dict: TIS mode and bounds, rejection, veto, normalization."""
    if not config:
        return "n/a"
    if not config.get("use_tis", True):
        parts = ["metrics only"]
    else:
        low = config.get("tis_lower_bound")
        if config.get("tis_upper_bound") == "auto":
            bounds = config.get("tis_auto_bounds") or [None, None]
            parts = [f"truncate at an adaptive bound (ESS ≥ {fmt(config.get('tis_auto_target_ess'))}, searched in "
                     f"[{fmt(bounds[0])}, {fmt(bounds[-1])}])"]
        else:
            parts = [f"{config.get('tis_mode', 'truncate')} [{fmt(low)}, {fmt(config.get('tis_upper_bound'))}]"]
    if config.get("use_rs"):
        parts.append(f"RS {config.get('rs_level', 'token')} [{fmt(config.get('rs_lower_bound'))}, "
                     f"{fmt(config.get('rs_upper_bound'))}]")
    if config.get("rs_veto_threshold") is not None:
        parts.append(f"veto ρ < {fmt(config.get('rs_veto_threshold'))}")
    for option, threshold in (config.get("rs_divergence") or {}).items():
        if isinstance(threshold, (list, tuple)) and len(threshold) == 2:
            parts.append(f"reject {option} outside [{fmt(threshold[0])}, {fmt(threshold[1])}]")
        else:
            parts.append(f"reject {option} > {fmt(threshold)}")
    if config.get("tis_batch_normalize"):
        parts.append(f"normalized per {config.get('tis_batch_normalize_scope', 'micro_batch')}")
    return "; ".join(parts)


def config_dict(config: Any) -> dict:
    """A MisConfig (``to_dict``) or a mapping as a plain dict; None as {}."""
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(config)


def recommendation_name(recommendation: Any) -> str | None:
    """The recommended candidate's name; None without a recommendation or when it names none."""
    return getattr(recommendation, "name", None) if recommendation is not None else None


def config_yaml(config: Any) -> str:
    """The config as YAML (None values left out: they are the defaults)."""
    import yaml

    values = {k: v for k, v in jsonable(config_dict(config)).items() if v is not None}
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
