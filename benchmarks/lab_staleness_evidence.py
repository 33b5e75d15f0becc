"""The lab's verdicts at a version lag as the analyzer cites them: ``miles_mis/analyze/lab_staleness.json``.

``lab_verdicts.py tables --docs`` calls ``stale_entry`` for each regime it wrote whose engine flags set a lag
schedule (``schedule``: ``--async-max-lag``, ``--rollout-lag``, ``--rollout-staleness``) and writes the entries with
``lab_centering_evidence.write``. Per regime: its schedule in words and its largest lag (read from those flags),
standard PPO's raw k3 and collapsed runs, and per other algorithm the paired difference of the last-10-step reward
against standard PPO with its 95 % t interval and its collapsed runs (``lab_centering_evidence.regime_entry``). The
analyzer (``miles_mis.analyze.lab_staleness``) cites it beside the published runs with stale rollouts when a dump
holds stale samples; nothing in the file is typed by hand.
"""

from __future__ import annotations

from lab_centering_evidence import LABELS as CENTERING_LABELS
from lab_centering_evidence import regime_entry

LABELS = {"bypass": "bypass", "decoupled_tis": "decoupled PPO + token TIS (U 2)",
          "seq_mis": "sequence MIS [0.5, 2]", "ratio_mask": "token ratio mask", "prime_rl": "prime-rl's loss",
          "auto_bound": "TIS with the auto bound", "batch_gate": "batch k3 gate 0.05",
          "lag_bound": "TIS bound by lag [2, 1.5, 1.25, 1.1]", "fixed_drop": "drop lag ≥ 2 (rs_max_lag 1)",
          "lag_gate": "drop lag ≥ 2 above k3 0.05", **CENTERING_LABELS}


def schedule(flags: list[str]) -> tuple[str, int] | None:
    """A regime's lag schedule from its engine flags: (words, largest lag); None for a synchronous regime.

    >>> schedule(["--rollout-dtype", "bf16", "--async-max-lag", "2"])
    ('every batch mixes lags 0 to 2', 2)
    >>> schedule(["--rollout-lag", "1"])
    ('every sample 1 version old', 1)
    """
    def value(flag: str) -> int | None:
        return int(flags[flags.index(flag) + 1]) if flag in flags else None

    if (lag := value("--async-max-lag")) is not None:
        return f"every batch mixes lags 0 to {lag}", lag
    if (lag := value("--rollout-lag")) is not None:
        return f"every sample {lag} version{'s' if lag != 1 else ''} old", lag
    if (every := value("--rollout-staleness")) is not None:
        return f"the engine syncs every {every} steps (lags 0 to {every - 1})", every - 1
    return None


def stale_entry(cells: dict[str, dict[int, dict]], steps: int, flags: list[str],
                baseline: str = "standard") -> dict | None:
    """A stale regime's entry (``regime_entry`` over every algorithm but ``baseline``, and its schedule); None for a
    synchronous regime or one with no cell paired on 2 seeds."""
    lag = schedule(flags)
    if lag is None:
        return None
    entry = regime_entry(cells, steps, baseline, {a: LABELS.get(a, a) for a in cells if a != baseline})
    return None if entry is None else {"schedule": lag[0], "max_lag": lag[1], **entry}


__all__ = ["LABELS", "schedule", "stale_entry"]
