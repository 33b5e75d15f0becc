"""PNG figures of where the mismatch lives, drawn from the statistics dict (``statistics.py``'s schema).

matplotlib is optional (``pip install "miles-mis[figures]"``) and imported only when a figure is drawn; the
figures use matplotlib's object API with the Agg canvas, so no pyplot state or GUI backend is touched.

Five figures, file names in ``FIGURES``:
  by_position      k3 and mean |Δ log p| by token position (first token alone, then log2 buckets)
  by_rollout_prob  the same by the engine's probability of the sampled token
  by_length        k3 and the share of sequences whose product ratio leaves [0.5, 2], by response length
  by_call          per-call k3 over calls (training time) with its least-squares trend line
  histogram        counts of the token log ratio l = log pi_old - log pi_rollout (log counts, symlog l),
                   with candidate ratio bounds drawn at log(bound)

and, when a metrics file holds score centering's per-step series (``sc_metrics``), ``SC_FIGURE``: the tail ratio,
head masses, importance weight and correction over training steps.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

INSTALL_HINT = ('the analyze figures need matplotlib, which is not installed: pip install "miles-mis[figures]" '
                '(or pip install matplotlib)')

FIGURES = {
    "by_position": "mismatch_by_position.png",
    "by_rollout_prob": "mismatch_by_rollout_prob.png",
    "by_length": "mismatch_by_length.png",
    "by_call": "mismatch_over_calls.png",
    "histogram": "log_ratio_histogram.png",
}

# (statistic key, axis label) panels of the three bucket figures; a panel of counts is added below them.
_BUCKET_FIGURES = {
    "by_position": ("Mismatch by token position in the response", "token position (response-relative)",
                    [("k3", "token k3 (mean)"), ("mean_abs_log_ratio", "mean |Δ log p|")], "tokens"),
    "by_rollout_prob": ("Mismatch by the engine's probability of the sampled token", "rollout probability bucket",
                        [("k3", "token k3 (mean)"), ("mean_abs_log_ratio", "mean |Δ log p|")], "tokens"),
    "by_length": ("Mismatch by response length", "response length (tokens)",
                  [("k3", "token k3 (mean)"),
                   ("seq_product_outside_half_two_fraction",
                    "share of sequences with\nproduct ratio outside [0.5, 2]")],
                  "sequences"),
}
_MAX_BOUND_LINES = 6

# the score-centering figure (``write_score_centering_figure``), drawn only when a metrics file holds its series
SC_FIGURE = "score_centering_over_steps.png"


def figures_available() -> bool:
    """True when matplotlib can be imported (the figures are optional)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def write_figures(statistics: Mapping[str, Any], out_dir: Path, candidates: Mapping[str, Any] | None = None,
                  bounds: Sequence[tuple[str, float, float]] | None = None) -> list[Path]:
    """Write the five PNGs of ``FIGURES`` into out_dir (created if missing) and return their paths in that order.

    bounds: (label, lower ratio, upper ratio) lines for the histogram; by default the distinct token-level
    bounds of the candidates' configs (``advisor`` results), or [0.5, 2] when there are none.
    Raises ImportError naming ``pip install "miles-mis[figures]"`` without matplotlib."""
    if not figures_available():
        raise ImportError(INSTALL_HINT)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if bounds is None:
        bounds = candidate_bounds(candidates)
    paths = []
    for key, name in FIGURES.items():
        figure = _draw(key, statistics, list(bounds))
        path = out_dir / name
        _save(figure, path)
        paths.append(path)
    return paths


def write_score_centering_figure(summary: Mapping[str, Any], out_dir: Path) -> Path:
    """``SC_FIGURE`` in out_dir from ``sc_metrics.summarize``'s output: the tail ratio over steps with its rise
    threshold (``rise_factor`` × its first-steps median) and ``limit`` as dashed lines, the train and rollout head
    masses, the importance weight and the correction, one panel each (a series the file lacks says so).
    Raises ImportError naming ``pip install "miles-mis[figures]"`` without matplotlib."""
    if not figures_available():
        raise ImportError(INSTALL_HINT)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SC_FIGURE
    _save(_score_centering_figure(summary), path)
    return path


def candidate_bounds(candidates: Mapping[str, Any] | None, first: str | None = None) -> list[tuple[str, float, float]]:
    """Distinct token-level ratio bounds of the candidates (names joined per bound pair), at most
    _MAX_BOUND_LINES, the pair of candidate ``first`` (the recommended one) first; [0.5, 2] if none."""
    merged: dict[tuple[float, float], list[str]] = {}
    items = sorted((candidates or {}).items(), key=lambda item: item[0] != first)
    for name, result in items:
        pair = _token_bounds((result or {}).get("config") or {})
        if pair is not None:
            merged.setdefault(pair, []).append(str(name) + (" (recommended)" if name == first else ""))
    if not merged:
        return [("ratio 0.5 and 2", 0.5, 2.0)]
    out = [(_join_names(names), low, high) for (low, high), names in merged.items()]
    return out[:_MAX_BOUND_LINES]


def _token_bounds(config: Mapping[str, Any]) -> tuple[float, float] | None:
    """The (lower, upper) ratio bounds a config applies per token: its token-level RS bounds, else TIS bounds."""
    if config.get("use_rs") and config.get("rs_level") == "token":
        low, high = config.get("rs_lower_bound"), config.get("rs_upper_bound")
    elif config.get("tis_level", "token") == "token":
        low, high = config.get("tis_lower_bound"), config.get("tis_upper_bound")
    else:
        return None
    if not _positive(high):
        return None
    low = low if _positive(low) else 1.0 / high
    return float(low), float(high)


def _join_names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")


# --------------------------------------------------------------------------- drawing
def _draw(key: str, statistics: Mapping[str, Any], bounds: list[tuple[str, float, float]]):
    if key in _BUCKET_FIGURES:
        return _bucket_figure(statistics.get(key) or [], *_BUCKET_FIGURES[key])
    if key == "by_call":
        return _calls_figure(statistics.get("by_call") or [])
    return _histogram_figure(statistics.get("histogram") or {}, bounds)


def _new_figure(rows: int, height: float = 3.0):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8.0, 1.0 + height * rows), layout="constrained")
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return figure, list(axes)


def _save(figure, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=100)


def _bucket_figure(rows: list, title: str, xlabel: str, panels: list, count_key: str):
    rows = [row for row in rows if (finite_number(row.get(count_key)) or 0) > 0]  # empty buckets are not drawn
    figure, axes = _new_figure(len(panels) + 1, height=2.4)
    figure.suptitle(title)
    labels = [str(row.get("bucket", i)) for i, row in enumerate(rows)]
    x = list(range(len(rows)))
    for ax, (metric, label) in zip(axes, panels):
        values = [finite_number(row.get(metric)) for row in rows]
        ax.plot(x, _gaps(values), marker="o")
        ax.set_ylabel(label)
        _log_if_decades(ax, values)
        ax.grid(True, alpha=0.3)
    counts = [finite_number(row.get(count_key)) or 0.0 for row in rows]
    ax = axes[-1]
    ax.bar(x, counts, color="0.6")
    ax.set_ylabel(count_key)
    _log_if_decades(ax, counts)
    ax.set_xticks(x, labels, rotation=45 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center")
    ax.set_xlabel(xlabel)
    if not rows:
        axes[0].text(0.5, 0.5, "no data", transform=axes[0].transAxes, ha="center")
    return figure


def _calls_figure(rows: list):
    figure, (k3_axis, max_axis) = _new_figure(2)
    figure.suptitle("Mismatch over calls (training time)")
    calls = [row.get("call") for row in rows]
    k3 = [finite_number(row.get("k3")) for row in rows]
    k3_axis.plot(calls, _gaps(k3), marker="o", linestyle="-", label="k3 of the call")
    fit = least_squares([(c, v) for c, v in zip(calls, k3) if c is not None and v is not None])
    if fit is not None and len(calls) > 1:
        slope, intercept = fit
        ends = [min(c for c in calls if c is not None), max(c for c in calls if c is not None)]
        k3_axis.plot(ends, [intercept + slope * c for c in ends], linestyle="--", color="C3",
                     label=f"least-squares trend: {slope:.3g} per call")
        k3_axis.legend(loc="best")
    k3_axis.set_ylabel("token k3 (mean over the call)")
    _log_if_decades(k3_axis, k3)
    k3_axis.grid(True, alpha=0.3)
    max_axis.plot(calls, _gaps([finite_number(row.get("max_abs_log_ratio")) for row in rows]), marker=".", color="C1")
    max_axis.set_ylabel("max |Δ log p| in the call")
    max_axis.set_xlabel("call (dump order = training time)")
    max_axis.grid(True, alpha=0.3)
    if not rows:
        k3_axis.text(0.5, 0.5, "no data", transform=k3_axis.transAxes, ha="center")
    return figure


def _score_centering_figure(summary: Mapping[str, Any]):
    rows = list(summary.get("per_step") or [])
    steps = [row.get("step") for row in rows]
    figure, (tail_axis, mass_axis, weight_axis, correction_axis) = _new_figure(4, height=2.2)
    figure.suptitle("Score centering over training steps")
    tail = [finite_number(row.get("tail_ratio")) for row in rows]
    tail_axis.plot(steps, _gaps(tail), marker=".", label="tail ratio")
    summary_tail = summary.get("tail_ratio") or {}
    rise, limit = finite_number(summary_tail.get("rise_threshold")), finite_number(summary_tail.get("limit"))
    if rise is not None:
        tail_axis.axhline(rise, color="C1", linestyle="--",
                          label=f"{summary_tail.get('rise_factor', 2):g} × first-steps median ({rise:.3g})")
    if limit is not None and any(v is not None and v > limit / 10 for v in tail):
        tail_axis.axhline(limit, color="C3", linestyle="--", label=f"{limit:g}")
    tail_axis.set_ylabel("tail ratio")
    _log_if_decades(tail_axis, tail + ([limit] if limit is not None else []))
    panels = ((mass_axis, (("train_head_mass", "train head mass P"), ("rollout_head_mass", "rollout head mass Q")),
               "head mass"),
              (weight_axis, (("importance_weight", "importance weight"),), "importance weight"),
              (correction_axis, (("correction", "correction"),), "correction"))
    for ax, series, label in ((tail_axis, (("tail_ratio", "tail ratio"),), "tail ratio"), *panels):
        drawn = False
        for key, name in series:
            values = [finite_number(row.get(key)) for row in rows]
            if any(v is not None for v in values):
                drawn = True
                if ax is not tail_axis:
                    ax.plot(steps, _gaps(values), marker=".", label=name)
        if not drawn:
            ax.text(0.5, 0.5, "not in the metrics file", transform=ax.transAxes, ha="center")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    correction_axis.set_xlabel(f"step ({summary.get('step_key') or 'step'} in the metrics file)")
    return figure


def least_squares(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(slope, intercept) of the ordinary least-squares line through the points; None for < 2 distinct x."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return slope, mean_y - slope * mean_x


def _histogram_figure(histogram: Mapping[str, Any], bounds: list[tuple[str, float, float]]):
    figure, (ax,) = _new_figure(1, height=4.5)
    ax.set_title("Token log ratio l = log π_old − log π_rollout (all usable tokens)")
    edges, counts = _occupied(_finite_edges(histogram.get("edges") or []),
                              [finite_number(c) or 0.0 for c in histogram.get("counts") or []])
    if counts:
        ax.stairs(counts, edges, fill=True, alpha=0.7, label="tokens")
        ax.set_yscale("log")
        ax.set_xscale("symlog", linthresh=_linthresh(edges, counts), linscale=2.0)
        _note_centre(ax, edges, counts)
    else:
        ax.text(0.5, 0.5, "no usable tokens", transform=ax.transAxes, ha="center")
    for i, (label, low, high) in enumerate(bounds):
        for j, ratio in enumerate((low, high)):
            if _positive(ratio):
                ax.axvline(math.log(ratio), color=f"C{(i + 1) % 10}", linestyle="--",
                           label=f"{label}: ratio [{low:.3g}, {high:.3g}]" if j == 0 else None)
    ax.axvline(0.0, color="k", linewidth=0.8)
    ax.set_xlabel("l (symmetric log scale, linear near 0); dashed lines at log(ratio bound)")
    ax.set_ylabel("token count (log scale)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", frameon=False)
    return figure


def _centre_bin(edges: list[float]) -> int | None:
    """The bin holding l = 0 (identical log-probs), if any."""
    return next((i for i in range(len(edges) - 1) if edges[i] <= 0 <= edges[i + 1]), None)


def _note_centre(ax, edges: list[float], counts: list[float]) -> None:
    centre = _centre_bin(edges)
    if centre is not None and counts[centre] > 0:
        share = counts[centre] / sum(counts)
        ax.text(0.02, 0.97, f"{counts[centre]:.0f} tokens ({share:.1%}) with |l| ≤ {edges[centre + 1]:.0e}",
                transform=ax.transAxes, va="top", fontsize="small")


def _finite_edges(edges: list) -> list[float]:
    """Edges with infinite/None outer edges replaced by a finite extension (doubling the last finite one)."""
    values = [finite_number(e) for e in edges]
    finite = [v for v in values if v is not None]
    if not finite:
        return []
    low, high = min(finite), max(finite)
    span = max(abs(low), abs(high), 1.0)
    return [v if v is not None else (-2 * span if i == 0 else 2 * span) for i, v in enumerate(values)]


def _occupied(edges: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    """The bins from the first to the last non-empty one, one empty bin kept on either side; ([], []) if
    edges and counts do not match or all counts are 0."""
    if len(edges) != len(counts) + 1:
        return [], []
    filled = [i for i, c in enumerate(counts) if c > 0]
    if not filled:
        return [], []
    first, last = max(filled[0] - 1, 0), min(filled[-1] + 1, len(counts) - 1)
    return edges[first:last + 2], counts[first:last + 1]


def _linthresh(edges: list[float], counts: list[float]) -> float:
    """The symlog's linear range: the |l| below which 1 % of the tokens outside the centre bin lie (so the
    decades holding almost no token do not take the width), at least the smallest nonzero |edge|."""
    smallest = min((abs(e) for e in edges if e != 0), default=1e-3)
    centre = _centre_bin(edges)
    inner = sorted((min(abs(edges[i]), abs(edges[i + 1])), c) for i, c in enumerate(counts) if i != centre and c > 0)
    total, seen = sum(c for _, c in inner), 0.0
    for magnitude, count in inner:
        seen += count
        if seen >= 0.01 * total:
            return max(magnitude, smallest)
    return smallest


def _log_if_decades(ax, values: list) -> None:
    """Log y axis when the positive values span two decades or more."""
    positive = [v for v in values if v is not None and v > 0]
    if len(positive) >= 2 and max(positive) / min(positive) >= 100:
        ax.set_yscale("log")


def finite_number(value: Any) -> float | None:
    """A finite float, or None for None, booleans, strings, NaN, ±inf and anything not a number (the report's
    and the figures' one rule for what is shown as a value)."""
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _gaps(values: list) -> list[float]:
    """None as NaN: matplotlib leaves a gap there."""
    return [math.nan if v is None else v for v in values]


def _positive(value: Any) -> bool:
    number = finite_number(value)
    return number is not None and number > 0
