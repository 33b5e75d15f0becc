"""How the analyze report writes one value or one table: ``fmt`` for Markdown and stdout (4 significant digits;
"n/a" for None, NaN and inf), ``markdown_table``, and ``jsonable``/``write_json`` for JSON (None, NaN and inf are
null: ``json.dumps(..., allow_nan=False)`` always succeeds on what they write)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from .figures import finite_number as _finite


# --------------------------------------------------------------------------- Markdown
def fmt(value: Any) -> str:
    """4 significant digits; integers in full; "n/a" for None, NaN, inf and non-numbers."""
    number = _finite(value)
    if number is None:
        return "n/a"
    if isinstance(value, int) or (number.is_integer() and abs(number) < 1e6):
        return str(int(number))
    return f"{number:.4g}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table's lines ('|' in a cell escaped), then an empty line."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return [line(header), "|" + "---|" * len(header)] + [line(row) for row in rows] + [""]


# --------------------------------------------------------------------------- JSON
def jsonable(value: Any) -> Any:
    """JSON-able copy: NaN/inf -> None, tuples -> lists, Paths -> str, configs -> dicts."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if hasattr(value, "item"):  # numpy / torch scalars
        return jsonable(value.item())
    return str(value)


def write_json(path: Path, data: Any) -> None:
    """``data`` (``jsonable``'s output) as indented JSON; NaN or inf in it raise instead of writing invalid JSON."""
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
