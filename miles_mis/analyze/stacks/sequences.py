"""What the JSON-lines readers share: a record's per-token columns checked and cut to its response.

Both prime-rl and NeMo RL write whole sequences (prompt, response and, in multi-turn, environment tokens) with
"index i = the log-prob of token i" on both sides and a 0/1 loss mask. The analyzer's sequence starts at the first
token the mask keeps: its positions count from there (in multi-turn, environment tokens between turns are inside
the span and masked out), as a miles response's do from its first token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from ..reading import CallBatch


@dataclass(frozen=True)
class Response:
    """One sequence's response span: trainer and engine log-probs (NaN where the file says null or non-finite),
    the 0/1 loss mask and the advantages (None where the format has none)."""

    index: int
    trainer: Tensor
    engine: Tensor
    mask: Tensor
    advantages: Tensor | None


def json_lines(path: Path, cut_last_line: list[str] | None = None) -> Iterator[tuple[str, Any]]:
    """(``path:line``, the parsed line) for every non-blank line; a line that is not JSON is one error naming it.
    Python's parser also takes the NaN / Infinity tokens that NeMo RL's writer emits.

    ``cut_last_line``: for a file still being written, the last line may be cut off mid-record: it is left out and
    its ``path:line`` appended to this list, instead of an error (any earlier bad line is still one)."""
    with open(path, encoding="utf-8") as handle:
        lines = [(number, line) for number, line in enumerate(handle, start=1) if line.strip()]
    for position, (number, line) in enumerate(lines):
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as error:  # JSONDecodeError, and the int-too-long error of a 4,300-digit number
            if cut_last_line is not None and position == len(lines) - 1:
                cut_last_line.append(where)
                return
            detail = f"{error.msg} at column {error.colno}" if isinstance(error, json.JSONDecodeError) else error
            raise ValueError(f"{where}: not a JSON line ({detail})") from None
        yield where, record


def number_column(where: str, record: dict, name: str, *, nullable: bool) -> Tensor | None:
    """A list of numbers as float64 (``null`` -> NaN when ``nullable``); None when the field is absent or all null
    (how both writers say "not computed")."""
    values = record.get(name)
    if values is None:
        return None
    if not isinstance(values, list):
        raise ValueError(f"{where}: {name} is a {type(values).__name__}, expected a list of numbers per token")
    if values and all(value is None for value in values):
        return None
    for position, value in enumerate(values):
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            allowed = "numbers or null" if nullable else "numbers"
            raise ValueError(f"{where}: {name}[{position}] is {value!r}; expected {allowed}")
    try:
        return torch.tensor([math.nan if value is None else float(value) for value in values], dtype=torch.float64)
    except OverflowError:  # an integer beyond float range
        raise ValueError(f"{where}: {name} holds a number beyond the float range") from None


def mask_column(where: str, record: dict, name: str) -> Tensor | None:
    """A per-token 0/1 (or true/false) list as float64; None when absent; anything else is one error."""
    values = record.get(name)
    if values is None:
        return None
    if not isinstance(values, list):
        raise ValueError(f"{where}: {name} is a {type(values).__name__}, expected a list of 0/1 per token")
    for position, value in enumerate(values):
        if value not in (0, 1):  # True/False and 0.0/1.0 compare equal to 0/1; None, strings and 0.5 do not
            raise ValueError(f"{where}: {name}[{position}] is {value!r}; expected 0/1 or true/false")
    return torch.tensor([float(value) for value in values], dtype=torch.float64)


def same_lengths(where: str, columns: dict[str, Tensor | None]) -> int:
    """The common token count of the present columns; one error naming the two that differ."""
    present = {name: column.numel() for name, column in columns.items() if column is not None}
    first = next(iter(present))
    for name, length in present.items():
        if length != present[first]:
            raise ValueError(f"{where}: {name} has {length} tokens but {first} has {present[first]}")
    return present[first]


def response(index: int, trainer: Tensor, engine: Tensor, mask: Tensor, advantages: Tensor | None) -> Response | None:
    """The span from the first token the mask keeps to the end; None when the mask keeps no token."""
    kept = torch.nonzero(mask).flatten()
    if kept.numel() == 0:
        return None
    start = int(kept[0])
    return Response(index, trainer[start:].float(), engine[start:].float(), mask[start:].float(),
                    None if advantages is None else advantages[start:].float())


def call_batch(call: int, responses: list[Response]) -> CallBatch:
    """One call's responses as the analyzer's batch: positions count from each response's first kept token; no
    version lags (neither format records them)."""
    return CallBatch(calls=[call] * len(responses), indices=[r.index for r in responses],
                     response_lengths=[r.trainer.numel() for r in responses],
                     old_log_probs=[r.trainer for r in responses], rollout_log_probs=[r.engine for r in responses],
                     loss_masks=[r.mask for r in responses], advantages=[r.advantages for r in responses],
                     positions=[torch.arange(r.trainer.numel()) for r in responses], lags=[None] * len(responses))


def warn_once(warnings: list[str], warning: str) -> None:
    """Append ``warning`` unless it is there (a reader's passes each end with the same counts)."""
    if warning not in warnings:
        warnings.append(warning)


def left_out_warning(count: int, noun: str, why: str) -> str:
    """'N <noun>s keep no token (<why>): left out', the count-agreeing sentence both readers end a pass with."""
    subject = f"1 {noun} keeps" if count == 1 else f"{count} {noun}s keep"
    return f"{subject} no token ({why}): left out"


def integer_field(where: str, record: dict, name: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} is {value!r}, expected an integer")
    return value
