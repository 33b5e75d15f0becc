"""The HTML report's token strips: the worst sequences (``statistics["token_strips"]``, ``worst_sequences``) as rows of
tokens shaded by Δ log p = log π_rollout − log π_old (the engine's log-prob minus the trainer's, = −l).

Shading (``shade``): one diverging scale for the whole page, so strips compare: with S the largest |Δ| over the
shown usable tokens and t = √min(|Δ| / S, 1), a token's colour goes from white (Δ = 0) to red (Δ > 0: the engine gave
the token more probability than the trainer) or blue (Δ < 0) as channel = round(255 + t · (end − 255)). The square
root: on a linear scale every token but the worst is near white; here a token at a quarter of S is half shaded.

A token the loss mask excludes is grey and hatched, one with a NaN/inf or fill-value log-prob (not usable, as the
plugin defines it) dark; each token's tooltip (its title, read without JavaScript) gives its position, both log-probs
and Δ. Marks at a strip's ends say how many tokens the window leaves out, and a sequence whose dump holds fewer tokens
than its response_length is marked truncated.
Miles' dumps carry no sampling mask nor kept set, so only the loss mask's exclusions can be marked.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Mapping, Sequence

from .figures import finite_number
from .formatting import fmt
from ..worst_sequences import STRIP_TOKENS, WORST

WHITE = (255, 255, 255)
POSITIVE = (178, 24, 43)  # Δ > 0, the engine above the trainer: ColorBrewer RdBu's dark red
NEGATIVE = (33, 102, 172)  # Δ < 0, the engine below the trainer: RdBu's dark blue
# Δ / S at the legend's gradient stops (on a linear Δ axis from −S to +S; between stops the browser interpolates, so
# the stops are dense where the square root bends most, near 0)
LEGEND_STOPS = (-1.0, -0.5, -0.25, -0.0625, 0.0, 0.0625, 0.25, 0.5, 1.0)


def delta(rollout: Any, old: Any) -> float | None:
    """Δ log p = log π_rollout − log π_old; None when either log-prob is NaN/inf."""
    engine, trainer = finite_number(rollout), finite_number(old)
    return None if engine is None or trainer is None else engine - trainer


def shade(value: float, scale: float) -> str:
    """The colour of Δ = ``value`` on a page whose largest |Δ| is ``scale``, as #rrggbb (module docstring)."""
    if scale <= 0 or value == 0:
        return "#ffffff"
    strength = math.sqrt(min(abs(value) / scale, 1.0))
    end = POSITIVE if value > 0 else NEGATIVE
    channels = (math.floor(255 + strength * (e - 255) + 0.5) for e in end)  # round half up, not to even
    return "#" + "".join(f"{c:02x}" for c in channels)


def page_scale(strips: Sequence[Mapping[str, Any]]) -> float:
    """S: the largest |Δ| over the usable tokens the strips show (0 when there is none)."""
    values = [abs(d) for strip in strips for d, usable in zip(_deltas(strip), strip.get("usable") or [])
              if usable and d is not None]
    return max(values, default=0.0)


def strips_section(statistics: Mapping[str, Any]) -> str:
    """The section: what is shown of how many, the legend, one strip per sequence."""
    strips = list(statistics.get("token_strips") or [])
    total = statistics.get("sequences")
    head = ('<section id="strips"><h2>The worst sequences, token by token</h2>'
            f"<p>{len(strips)} of the {escape(fmt(total))} sequences are shown: those with the highest k3 (the mean "
            f"over their usable tokens; at most {WORST}), each as at most {STRIP_TOKENS} tokens around its largest "
            "|Δ log p|. Δ log p = log π_rollout − log π_old (engine minus trainer, = −l). Hover a token for its "
            "position and log-probs. Every statistic is in report.json.</p>"
            "<p>The dumps carry no sampling mask or kept set: the marked exclusions are the loss mask's.</p>")
    if not strips:
        return head + "<p>No sequence with a usable token.</p></section>"
    scale = page_scale(strips)
    rows = "".join(strip_html(strip, scale) for strip in strips)
    return head + legend_html(scale) + f'<div class="strips">{rows}</div></section>'


def legend_html(scale: float) -> str:
    """The colour bar from −S to +S (its stops drawn with ``shade``) and the marks' swatches."""
    stops = ", ".join(f"{shade(u * scale, scale)} {100 * (u + 1) / 2:g}%" for u in LEGEND_STOPS)
    ticks = "".join(f"<span>{escape(fmt(v))}</span>" for v in (-scale, -scale / 2, 0.0, scale / 2, scale))
    return ('<div class="legend"><div class="bar" style="background: linear-gradient(to right, '
            f'{stops})"></div><div class="ticks">{ticks}</div>'
            "<p>Δ log p: blue, the engine gave the token less probability than the trainer; red, more (square-root "
            f"scale, full colour at the largest |Δ| shown, {escape(fmt(scale))}). "
            '<span class="key masked"></span> excluded by the loss mask '
            '<span class="key nonfinite"></span> NaN/inf log-prob '
            '<span class="key peak"></span> the sequence\'s largest |Δ| '
            '<span class="gap">…</span> tokens not shown '
            '<span class="cut">✂</span> not in the dump (truncated)</p></div>')


def strip_html(strip: Mapping[str, Any], scale: float) -> str:
    """One sequence: its heading line and its tokens."""
    start, end, held = int(strip.get("start", 0)), int(strip.get("end", 0)), int(strip.get("held", 0))
    length = strip.get("length")
    missing = (int(length) - held) if isinstance(length, int) and length > held else 0
    worst = strip.get("worst_position")
    at = f"position {worst}" if isinstance(worst, int) and worst >= 0 else "an unknown position"
    heading = (f"call {fmt(strip.get('call'))}, sequence {fmt(strip.get('index'))}: k3 {fmt(strip.get('k3'))}, "
               f"max |Δ log p| {fmt(strip.get('max_abs_log_ratio'))} at {at}; "
               f"tokens {start}–{end - 1} of {held}" + (f" (response_length {length}: {missing} not in the dump)"
                                                         if missing else ""))
    cells = []
    if start > 0:
        cells.append(f'<span class="gap" title="{start} tokens before not shown">…{start}</span>')
    for offset, (position, rollout, old, valid, usable, value) in enumerate(zip(
            strip.get("positions") or [], strip.get("rollout") or [], strip.get("old") or [],
            strip.get("valid") or [], strip.get("usable") or [], _deltas(strip))):
        where = position if isinstance(position, int) and position >= 0 else f"unknown (token {start + offset})"
        cells.append(token_html(where, rollout, old, bool(valid), value if usable else None, scale,
                                peak=start + offset == strip.get("peak")))
    if end < held:
        cells.append(f'<span class="gap" title="{held - end} tokens after not shown">…{held - end}</span>')
    if missing:
        cells.append(f'<span class="cut" title="the dump holds {held} of the {length} response tokens: '
                     f'{missing} truncated">✂{missing}</span>')
    return f'<div class="strip"><p>{escape(heading)}</p><div class="tokens">{"".join(cells)}</div></div>'


def token_html(position: Any, rollout: Any, old: Any, valid: bool, value: float | None, scale: float,
               peak: bool = False) -> str:
    """One token's cell: shaded by Δ (``value``; None for a token that is not usable); its tooltip gives position,
    both log-probs and Δ."""
    where = position if isinstance(position, str) else fmt(position)
    title = (f"position {where}: log π_rollout {fmt(rollout)}, log π_old {fmt(old)}, Δ log p "
             f"{fmt(value)}")
    classes = ["tok"] + (["peak"] if peak else [])
    style = ""
    if not valid:
        classes.append("masked")
        title += " (excluded by the loss mask)"
    elif value is None:
        classes.append("nonfinite")
        title += " (a NaN/inf or fill-value log-prob: not usable)"
    else:
        style = f' style="background:{shade(value, scale)}"'
    return f'<span class="{" ".join(classes)}"{style} title="{escape(title)}"></span>'


def _deltas(strip: Mapping[str, Any]) -> list[float | None]:
    return [delta(r, o) for r, o in zip(strip.get("rollout") or [], strip.get("old") or [])]
