"""NeMo RL's per-step training data: ``train_data_step<N>.jsonl`` under the logger's directory, one JSON line a
sample.

Schema read at NVIDIA-NeMo/RL 7ea279abfbeb698b092856d0dab61e7cf39bc909 (``nemo_rl/algorithms/grpo.py`` writes it
every step through ``Logger.log_batched_dict_as_jsonl``). Each field of a line is the sample's row of the batch
wrapped in a one-element list (``"rewards": [0.5]``), beside a bare ``idx``. Per token, right-padded to the batch
width: ``token_loss_mask`` (1 on generated tokens), ``generation_logprobs`` (the engine's), ``prev_logprobs`` (the
trainer's π_old, index 0 a prepended 0) and ``advantages``; per sample ``input_lengths`` (the real tokens) and
``sample_loss_mask`` (0 for a sample the run filtered out). Both log-prob columns are of the processed sampling
distribution (temperature, top-k/top-p applied on both sides).

A call here is one step's whole batch (the file does not record micro-batches). Refused, each with one line: a file
from before token masks were written (NeMo RL before February 2026: no ``token_loss_mask``; the generated tokens
cannot be told apart safely), and a file whose ``prev_logprobs`` are all 0 on the generated tokens (the run skipped
the trainer's recompute, ``force_on_policy_ratio``, so there is no trainer side to compare).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterator

from ..reading import CallBatch
from .sequences import Response, call_batch, json_lines, left_out_warning, mask_column, number_column, response, \
    same_lengths, warn_once

STEP_FILE = re.compile(r"train_data_step(\d+)\.jsonl")


def step_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.glob("**/train_data_step*.jsonl") if STEP_FILE.fullmatch(path.name))


class NemoRLReader:
    """One run's ``train_data_step<N>.jsonl`` files, in step order, one step in memory at a time."""

    def __init__(self, directory: Path | str, allow_partial: bool = False, progress: bool = False):
        self.directory = Path(directory)
        self.warnings: list[str] = []
        owner: dict[int, Path] = {}
        for path in step_files(self.directory):
            step = int(STEP_FILE.fullmatch(path.name).group(1))
            if step in owner:
                raise ValueError(f"step {step} appears twice: {owner[step]} and {path} (logs of two runs? analyse "
                                 "one run's directory, e.g. logs/exp_001)")
            owner[step] = path
        self.steps = sorted(owner)
        self.files = [owner[step] for step in self.steps]
        self._empty = 0

    def batches(self) -> Iterator[CallBatch]:
        """One CallBatch per step file, in step order."""
        for _, batch in self.step_batches():
            yield batch

    def step_batches(self) -> Iterator[tuple[int, CallBatch]]:
        """(the step number in the file name, its CallBatch)."""
        self._empty = 0
        for call, (step, path) in enumerate(zip(self.steps, self.files)):
            yield step, call_batch(call, self._read_file(path))
        if self._empty:
            warn_once(self.warnings, left_out_warning(self._empty, "sample", "token_loss_mask 0 everywhere, or "
                                                      "sample_loss_mask 0: filtered by the run"))

    def _read_file(self, path: Path) -> list[Response]:
        responses, seen, trainer_nonzero = [], {}, False
        for where, record in json_lines(path):
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a {type(record).__name__}, not a NeMo RL train_data line (an object)")
            index = record.get("idx")
            if isinstance(index, bool) or not isinstance(index, int):
                raise ValueError(f"{where}: idx is {index!r}, expected the sample's integer row")
            if index in seen:
                raise ValueError(f"{where}: idx {index} also at {seen[index]}")
            seen[index] = where
            kept = read_line(where, unwrap(where, record), index)
            if kept is None:
                self._empty += 1
                continue
            trainer_nonzero |= bool((kept.trainer[kept.mask != 0] != 0).any())
            responses.append(kept)
        if responses and not trainer_nonzero:
            raise ValueError(f"{path}: prev_logprobs are 0 on every generated token: this run skipped the trainer's "
                             "log-prob recompute (force_on_policy_ratio), so the file holds no trainer side to compare")
        return responses


def unwrap(where: str, record: dict) -> dict:
    """Every field but ``idx`` is a one-element list holding the sample's value."""
    out = {}
    for name, value in record.items():
        if name == "idx":
            continue
        if not isinstance(value, list) or len(value) != 1:
            raise ValueError(f"{where}: {name} is not a one-element list (NeMo RL writes each field as the sample's "
                             "row of the batch, [value])")
        out[name] = value[0]
    return out


def read_line(where: str, fields: dict, index: int) -> Response | None:
    """One sample's response span: tokens up to ``input_lengths``, kept where ``token_loss_mask`` × ``sample_loss_mask``
    is nonzero."""
    if "token_loss_mask" not in fields:
        raise ValueError(f"{where}: no token_loss_mask: a NeMo RL file from before token masks were logged "
                         "(February 2026); its generated tokens cannot be told apart safely, so it is not read")
    columns = {"token_loss_mask": mask_column(where, fields, "token_loss_mask"),
               "prev_logprobs": number_column(where, fields, "prev_logprobs", nullable=False),
               "generation_logprobs": number_column(where, fields, "generation_logprobs", nullable=False),
               "advantages": number_column(where, fields, "advantages", nullable=False)}
    for name in ("prev_logprobs", "generation_logprobs"):
        if columns[name] is None:
            raise ValueError(f"{where}: no {name} (a NeMo RL train_data line has generation_logprobs and "
                             "prev_logprobs per token)")
    width = same_lengths(where, columns)
    length = fields.get("input_lengths")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= width:
        raise ValueError(f"{where}: input_lengths is {length!r}, expected an integer in [0, {width}] (the row's "
                         "width)")
    sample_mask = fields.get("sample_loss_mask", 1.0)
    if isinstance(sample_mask, bool) or not isinstance(sample_mask, (int, float)) or not 0 <= sample_mask < math.inf:
        raise ValueError(f"{where}: sample_loss_mask is {sample_mask!r}, expected a finite number >= 0 (0 = filtered)")
    mask = columns["token_loss_mask"][:length] * float(sample_mask)
    advantages = columns["advantages"]
    return response(index, columns["prev_logprobs"][:length], columns["generation_logprobs"][:length], mask,
                    None if advantages is None else advantages[:length])

